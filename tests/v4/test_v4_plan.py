"""``flashdsa plan`` for DeepSeek-V4: the per-type costs computed by hand, the CLI's preset, config file and
refusals."""

from __future__ import annotations

import json

import pytest

from flashdsa.cli import main
from flashdsa.v4 import CSA, HCA, V4Config
from flashdsa.v4.plan import format_plan_v4, plan_v4


def run_cli(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_flash_at_128k_by_hand():
    cfg = V4Config.preset("v4-flash")  # 20 CSA and 23 HCA layers, 64 heads of 512, window 128, top-512
    r = plan_v4(cfg, context=131072, kv_format="fp8")
    csa, hca = r["layer_types"][CSA], r["layer_types"][HCA]
    assert (csa["layers"], hca["layers"]) == (20, 23)
    assert csa["bytes_per_token"] == (656 + 132) / 4 and hca["bytes_per_token"] == 656 / 128
    assert csa["keys_per_query"] == 128 + 512 and hca["keys_per_query"] == 128 + 1024
    assert csa["attention_flops_per_token"] == 2 * 64 * 1024 * 640
    assert csa["indexer_flops_per_token"] == 2 * 64 * 128 * 32768 and hca["indexer_flops_per_token"] == 0
    assert csa["cache_bytes_per_request"] == 128 * 656 + 197 * 131072
    assert r["cache_bytes"] == 20 * csa["cache_bytes_per_request"] + 23 * hca["cache_bytes_per_request"]
    assert "compressed_sparse_attention" in format_plan_v4(r)
    with pytest.raises(ValueError, match="^kv_format:"):
        plan_v4(cfg, 1024, kv_format="fp8_raw")


def test_cli_preset_config_and_refusals(capsys, tmp_path):
    rc, out, _ = run_cli(["plan", "--preset", "v4-flash", "--context", "65536"], capsys)
    assert rc == 0 and "DeepSeek-V4 (preset v4-flash), context 65536" in out
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": 3,
                                                      "compress_ratios": [0, 4, 128]}))
    rc, out, _ = run_cli(["plan", "--config", str(tmp_path), "--json"], capsys)
    report = json.loads(out)
    assert rc == 0 and set(report["layer_types"]) == {"sliding_attention", CSA, HCA}
    rc, _, err = run_cli(["plan", "--preset", "v4-flash", "--kpool", "4"], capsys)
    assert rc == 2 and "kpool" in err
    rc, _, err = run_cli(["plan", "--preset", "v4-flash", "--kv-format", "fp8_raw"], capsys)
    assert rc == 2 and err.startswith("flashdsa plan: --kv-format:")
