"""flashdsa.plan: the cost model pinned to the figures of docs/DSA.md §1, §4, §8, GLM-5, skip-top-k
layers, kpool, memory, and the ``flashdsa plan`` command line."""

from __future__ import annotations

import json
import math

import pytest

from flashdsa import plan as P
from flashdsa.cli import main
from flashdsa.config import PRESETS, DSAConfig

V32 = DSAConfig.preset("v32")
GLM5 = DSAConfig.preset("glm5")
GLM5_SKIP = GLM5.replace(index_topk_freq=4, index_skip_topk_offset=3)  # top-k at 0, 1, 2, 6, ..., 74
GLM5_KPOOL4 = GLM5.replace(index_kpool=4)

REQUIRED_KEYS = ("kv_bytes_per_token", "indexer_share", "flops_per_token", "crossover_context",
                 "comm_bytes_per_rank_per_layer", "memory_gb")


def run_cli(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# ---- the figures of docs/DSA.md (DeepSeek-V3.2, 61 layers) --------------------------------------------------

def test_v32_kv_bytes_match_the_seed():
    kv = P.kv_bytes_per_token(V32)
    assert kv["per_layer"] == {"mla": {"bf16": 1152, "fp8": 656, "fp8_raw": 576}, "indexer": 132,
                               "total": {"bf16": 1284, "fp8": 788, "fp8_raw": 708}}
    a = kv["all_layers"]
    assert a["dense_bf16"] == a["mla"]["bf16"] == 1152 * 61 == 70272
    assert a["mla"] == {"bf16": 70272, "fp8": 40016, "fp8_raw": 35136}
    assert a["indexer"] == 132 * 61 == 8052
    assert a["total"]["fp8"] == 788 * 61 == 48068
    # "dense bf16 ≈ 70 KB, DSA fp8 MLA ≈ 40 KB, with indexer ≈ 48 KB"
    assert a["dense_bf16"] / 1e3 == pytest.approx(70, abs=0.5)
    assert a["mla"]["fp8"] / 1e3 == pytest.approx(40, abs=0.5)
    assert a["total"]["fp8"] / 1e3 == pytest.approx(48, abs=0.5)


def test_v32_indexer_share_is_about_17_percent():
    share = P.indexer_share(V32)
    assert share == pytest.approx(132 / 788, rel=1e-12)
    assert share == pytest.approx(0.168, abs=0.001)
    assert round(100 * share) == 17
    # a wider MLA cache makes the indexer's share smaller, a narrower one larger
    assert P.indexer_share(V32, "bf16") == pytest.approx(132 / 1284)
    assert P.indexer_share(V32, "fp8_raw") == pytest.approx(132 / 708)
    assert P.indexer_share(V32, "bf16") < share < P.indexer_share(V32, "fp8_raw")


def test_v32_flops_per_history_token_and_crossover():
    fl = P.flops_per_token(V32, 131072)
    assert fl["per_history_token"] == {"indexer": 16384, "mla": 278528}  # "≈16K vs ≈278K"
    assert fl["indexer"] == 16384 * 131072
    assert fl["sparse_mla"] == 278528 * 2048  # ≈ 570M, flat past top-k
    assert fl["sparse_mla"] / 1e6 == pytest.approx(570, abs=1)
    assert fl["dense_mla"] == 278528 * 131072
    assert fl["indexer_over_sparse_mla"] == pytest.approx(16384 * 131072 / (278528 * 2048))
    assert P.crossover_context(V32) == 278528 * 2048 // 16384 == 34816
    assert P.crossover_context(V32) / 1e3 == pytest.approx(35, abs=0.5)  # "≈35K"
    assert P.crossover_context(V32, all_layers=True) == 34816  # every V3.2 layer has an indexer


def test_v32_cp_mla_gather_is_25x_smaller_than_tp_o_proj():
    S, p = 32768, 8
    cm = P.comm_bytes_per_rank_per_layer(V32, S, p)
    ring = (p - 1) / p
    assert cm["tp_indexer"] == pytest.approx(2 * ring * 4 * S * S, rel=1e-12)
    assert cm["cp_indexer"] == pytest.approx(ring * 256 * S, rel=1e-12)
    assert cm["tp_mla"] == pytest.approx(2 * ring * 2 * 7168 * S, rel=1e-12)
    assert cm["cp_mla"] == pytest.approx(ring * 1152 * S, rel=1e-12)
    assert cm["tp_mla"] / cm["cp_mla"] == pytest.approx(2 * 2 * 7168 / 1152, rel=1e-12)
    assert cm["tp_mla"] / cm["cp_mla"] == pytest.approx(25, abs=0.2)  # "≈25x"
    ratio = P.comm_tp_over_cp(V32, S)
    assert ratio["mla"] == pytest.approx(24.888, abs=1e-3)
    assert ratio["indexer"] == pytest.approx(cm["tp_indexer"] / cm["cp_indexer"]) == pytest.approx(S / 32)


# ---- GLM-5 -----------------------------------------------------------------------------------------

def test_glm5_numbers():
    kv = P.kv_bytes_per_token(GLM5)["all_layers"]
    assert kv["mla"] == {"bf16": 1152 * 78, "fp8": 656 * 78, "fp8_raw": 576 * 78} == \
        {"bf16": 89856, "fp8": 51168, "fp8_raw": 44928}
    assert kv["indexer"] == 10296 and kv["total"]["fp8"] == 61464
    assert P.indexer_share(GLM5) == pytest.approx(132 / 788)
    fl = P.flops_per_token(GLM5, 65536)
    assert fl["per_history_token"] == {"indexer": 2 * 32 * 128, "mla": 2 * 64 * 1088} == \
        {"indexer": 8192, "mla": 139264}
    assert fl["sparse_mla"] == 139264 * 2048 and fl["dense_mla"] == 139264 * 65536
    # half the heads on both sides: the same crossover as V3.2
    assert P.crossover_context(GLM5) == 139264 * 2048 // 8192 == 34816
    assert P.comm_tp_over_cp(GLM5, 4096)["mla"] == pytest.approx(2 * 2 * 6144 / 1152)  # 21.3
    cm = P.comm_bytes_per_rank_per_layer(GLM5, 4096, 4)
    assert cm["tp_mla"] == 2 * 3 * 2 * 6144 * 4096 // 4 and cm["cp_mla"] == 3 * 1152 * 4096 // 4


def test_glm5_flash_costs_its_dsa_layers():
    """GLM-5.3-Flash: 45 layers, 11 of them DSA (the KDA layers hold no KV of ours); NoPE MLA over the
    512-dim latent (FLOPs of the model's math), stored in the 528-B NoPE rows; kpool 16: one pooled key per 16
    tokens."""
    cfg = DSAConfig.preset("glm5-flash")
    report = P.plan(cfg, context=131072)
    m = report["model"]
    assert (m["num_hidden_layers"], m["dsa_layers"], m["indexer_layers"], m["nope"]) == (45, 11, 11, True)
    kv = report["kv_bytes_per_token"]
    assert kv["mla"]["fp8"] == 528 * 11 and kv["indexer"] == pytest.approx(11 * 132 / 16)
    assert (kv["mla"]["bf16"], kv["mla"]["fp8_raw"], kv["dense_bf16"]) == (1024 * 11, 512 * 11, 1024 * 11)
    fl = report["flops_per_token"]
    assert fl["per_history_token"]["mla"] == 2 * 64 * (512 + 512)
    assert "11 DSA" in P.format_plan(report) and "NoPE" in P.format_plan(report)
    assert "MLA fp8 (528)" in P.format_plan(report)


# ---- skip-top-k layers and kpool -------------------------------------------------------------------

def test_skip_topk_layers_have_no_indexer_cache():
    assert len(GLM5_SKIP.topk_layers) == 21
    kv, full = P.kv_bytes_per_token(GLM5_SKIP), P.kv_bytes_per_token(GLM5)
    assert kv["all_layers"]["indexer"] == 132 * 21 == 2772
    assert kv["all_layers"]["mla"] == full["all_layers"]["mla"]  # MLA cache on every layer regardless
    assert kv["all_layers"]["total"]["fp8"] == 51168 + 2772
    assert kv["per_layer"] == full["per_layer"]  # a layer that has an indexer still costs 132 B
    assert P.indexer_share(GLM5_SKIP) == pytest.approx(2772 / (51168 + 2772))
    assert P.indexer_share(GLM5_SKIP) < P.indexer_share(GLM5)
    fl = P.flops_per_token(GLM5_SKIP, 65536)
    assert fl["all_layers"]["indexer"] == 21 * 8192 * 65536
    assert fl["all_layers"]["sparse_mla"] == 78 * 139264 * 2048
    # per indexer layer unchanged; the model as a whole crosses over later
    assert P.crossover_context(GLM5_SKIP) == 34816
    assert P.crossover_context(GLM5_SKIP, all_layers=True) == math.ceil(34816 * 78 / 21) == 129317
    mem, mem_full = P.memory_gb(GLM5_SKIP, 2, 8192, 1), P.memory_gb(GLM5, 2, 8192, 1)
    assert mem["mla"] == mem_full["mla"]
    assert mem["indexer"] == pytest.approx(mem_full["indexer"] * 21 / 78, rel=1e-12)
    params, params_full = P.attention_params(GLM5_SKIP), P.attention_params(GLM5)
    assert params["mla"] == params_full["mla"] and params["indexer"] * 78 == params_full["indexer"] * 21


def test_kpool_shrinks_indexer_cache_and_scan():
    c = 4
    kv, full = P.kv_bytes_per_token(GLM5_KPOOL4), P.kv_bytes_per_token(GLM5)
    assert kv["per_layer"]["indexer"] == 33
    assert kv["all_layers"]["indexer"] * c == full["all_layers"]["indexer"] == 10296
    assert kv["all_layers"]["mla"] == full["all_layers"]["mla"]
    fl, fl_full = P.flops_per_token(GLM5_KPOOL4, 65536), P.flops_per_token(GLM5, 65536)
    assert fl["indexer"] * c == fl_full["indexer"]
    # topk / c groups expand back to topk tokens, and the unfinished tail group adds up to c - 1
    k = GLM5.index_topk
    assert fl["sparse_mla"] * k == fl_full["sparse_mla"] * (k + c - 1)
    assert P.crossover_context(GLM5_KPOOL4) == math.ceil(c * 34816 * (k + c - 1) / k)
    cm, cm_full = P.comm_bytes_per_rank_per_layer(GLM5_KPOOL4, 8192, 8), P.comm_bytes_per_rank_per_layer(GLM5, 8192, 8)
    assert cm["tp_indexer"] * c == cm_full["tp_indexer"]  # logits over S/c pooled keys
    assert cm["cp_indexer"] == cm_full["cp_indexer"]  # keys gathered before pooling
    # page = 64 c tokens; an 8448-byte indexer page covers all of them
    mem, mem_full = P.memory_gb(GLM5_KPOOL4, 1, 131072, 1), P.memory_gb(GLM5, 1, 131072, 1)
    assert mem["indexer"] * c == pytest.approx(mem_full["indexer"], rel=1e-12)
    assert mem["mla"] == mem_full["mla"]


def test_fractional_indexer_bytes_with_kpool_8():
    cfg = DSAConfig.preset("v32").replace(index_kpool=8)
    kv = P.kv_bytes_per_token(cfg)
    assert kv["per_layer"]["indexer"] == 16.5 and isinstance(kv["per_layer"]["indexer"], float)
    assert kv["all_layers"]["indexer"] == pytest.approx(16.5 * 61)
    json.dumps(kv)


# ---- FLOPs, crossover, comm, memory in general ----------------------------------------------------

@pytest.mark.parametrize("cfg", [V32, GLM5, GLM5_SKIP, GLM5_KPOOL4, DSAConfig.preset("tiny")],
                         ids=["v32", "glm5", "glm5-skip", "glm5-kpool4", "tiny"])
def test_crossover_is_where_the_indexer_catches_up(cfg):
    def cost(S, all_layers):
        fl = P.flops_per_token(cfg, S)
        src = fl["all_layers"] if all_layers else fl
        return src["indexer"], src["sparse_mla"]

    for all_layers in (False, True):
        s = P.crossover_context(cfg, all_layers=all_layers)
        assert s > cfg.index_topk
        idx, mla = cost(s, all_layers)
        assert idx >= mla
        idx, mla = cost(s - 1, all_layers)
        assert idx < mla


def test_crossover_when_the_indexer_is_never_cheaper():
    cfg = DSAConfig.preset("tiny").replace(index_n_heads=64)  # 2*64*128 > 2*4*1088
    assert P.crossover_context(cfg) == 1
    fl = P.flops_per_token(cfg, 1)
    assert fl["indexer"] >= fl["sparse_mla"]


def test_flops_shape_in_context():
    k = V32.index_topk
    for S in (1, 63, k - 1, k):
        fl = P.flops_per_token(V32, S)
        assert fl["sparse_mla"] == fl["dense_mla"] == 278528 * S  # sparse == dense up to top-k
    a, b = P.flops_per_token(V32, k + 1), P.flops_per_token(V32, 4 * k)
    assert a["sparse_mla"] == b["sparse_mla"] == 278528 * k  # flat past top-k
    assert b["indexer"] == 16384 * 4 * k and b["dense_mla"] == 278528 * 4 * k


def test_comm_one_rank_is_zero_and_scales_with_s_and_p():
    assert P.comm_bytes_per_rank_per_layer(V32, 4096, 1) == {"tp_indexer": 0, "cp_indexer": 0, "tp_mla": 0, "cp_mla": 0}
    a, b = P.comm_bytes_per_rank_per_layer(V32, 4096, 2), P.comm_bytes_per_rank_per_layer(V32, 8192, 2)
    assert a == {"tp_indexer": 4 * 4096 ** 2, "cp_indexer": 128 * 4096, "tp_mla": 2 * 7168 * 4096, "cp_mla": 576 * 4096}
    assert b["tp_indexer"] == 4 * a["tp_indexer"]  # O(S^2)
    assert b["cp_indexer"] == 2 * a["cp_indexer"] and b["tp_mla"] == 2 * a["tp_mla"] and b["cp_mla"] == 2 * a["cp_mla"]
    c = P.comm_bytes_per_rank_per_layer(V32, 4096, 3)  # (p-1)/p = 2/3: not always whole bytes
    assert c["cp_mla"] == pytest.approx(2 / 3 * 1152 * 4096)
    json.dumps(c)


def test_memory_v32_tp_and_cp():
    S, B = 131072, 4
    tp = P.memory_gb(V32, B, S, 8, "fp8", "tp")
    assert tp["mla"] == pytest.approx(B * S * 656 * 61 / 1e9, rel=1e-12)
    assert tp["indexer"] == pytest.approx(B * S * 132 * 61 / 1e9, rel=1e-12)
    assert tp["kv_per_gpu"] == pytest.approx(B * S * 48068 / 1e9, rel=1e-12) == pytest.approx(25.20, abs=0.01)
    assert tp["kv_all_gpus"] == pytest.approx(8 * tp["kv_per_gpu"])
    assert tp["tokens_per_gpu"] == B * S
    cp = P.memory_gb(V32, B, S, 8, "fp8", "cp")
    assert cp["kv_per_gpu"] == pytest.approx(tp["kv_per_gpu"] / 8, rel=1e-12)
    assert cp["kv_all_gpus"] == pytest.approx(tp["kv_per_gpu"], rel=1e-12)
    bf16 = P.memory_gb(V32, B, S, 8, "bf16", "tp")
    assert bf16["mla"] == pytest.approx(B * S * 70272 / 1e9, rel=1e-12)
    assert bf16["indexer"] == tp["indexer"]
    raw = P.memory_gb(V32, B, S, 8, "fp8_raw", "tp")
    assert raw["mla"] == pytest.approx(B * S * 576 * 61 / 1e9, rel=1e-12)


def test_memory_rounds_to_whole_pages():
    one = P.memory_gb(V32, 1, 100, 1)  # 100 tokens take two 64-token pages
    assert one["tokens_per_gpu"] == 128
    assert one["kv_per_gpu"] == pytest.approx(128 * 48068 / 1e9, rel=1e-12)
    assert P.memory_gb(V32, 3, 64, 1)["kv_per_gpu"] == pytest.approx(3 * 64 * 48068 / 1e9, rel=1e-12)
    cp = P.memory_gb(V32, 2, 1000, 3, parallel="cp")  # ceil(1000 / 3) = 334 tokens -> 6 pages = 384
    assert cp["tokens_per_gpu"] == 2 * 384
    assert cp["kv_per_gpu"] == pytest.approx(2 * 384 * 48068 / 1e9, rel=1e-12)


def test_attention_params_v32():
    params = P.attention_params(V32)
    mla_layer = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168)
    assert mla_layer == 187107328
    assert params["mla"] == 61 * mla_layer
    assert params["indexer"] == 61 * (1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64)


# ---- the report ------------------------------------------------------------------------------------

def test_plan_report_keys_and_definitions():
    rep = P.plan(V32, context=65536, batch=2, gpus=4, kv_format="fp8", parallel="cp", source="x")
    for key in REQUIRED_KEYS:
        assert key in rep and key in rep["definitions"]
    assert rep["kv_bytes_per_token"] == P.kv_bytes_per_token(V32)["all_layers"]
    assert set(rep["flops_per_token"]) >= {"indexer", "sparse_mla", "dense_mla"}
    assert set(rep["comm_bytes_per_rank_per_layer"]) == {"tp_indexer", "cp_indexer", "tp_mla", "cp_mla"}
    assert rep["memory_gb"] == P.memory_gb(V32, 2, 65536, 4, "fp8", "cp")
    assert rep["inputs"] == {"context": 65536, "batch": 2, "gpus": 4, "kv_format": "fp8", "parallel": "cp"}
    json.dumps(rep)
    text = P.format_plan(rep)
    for needle in ("70.3 KB", "40.0 KB", "48.1 KB", "indexer share 16.8 %", "16.38 K", "278.5 K", "34816", "24.9x"):
        assert needle in text, needle


@pytest.mark.parametrize("kw, name", [
    (dict(context=0), "context"), (dict(batch=-1), "batch"), (dict(gpus=0), "gpus"),
    (dict(context=True), "context"), (dict(context=2.5), "context"),
    (dict(kv_format="fp16"), "kv_format"), (dict(parallel="dp"), "parallel"),
], ids=["context0", "batch-neg", "gpus0", "context-bool", "context-float", "kv-format", "parallel"])
def test_plan_rejects_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=name):
        P.plan(V32, **kw)


# ---- command line ----------------------------------------------------------------------------------

def test_cli_v32_json_reproduces_the_seed(capsys):
    rc, out, err = run_cli(["plan", "--preset", "v32", "--json"], capsys)
    assert rc == 0 and err == ""
    rep = json.loads(out)
    assert rep["config"] == "preset v32"
    assert rep["kv_bytes_per_token"]["dense_bf16"] == 70272
    assert rep["kv_bytes_per_token"]["mla"]["fp8"] == 40016
    assert rep["kv_bytes_per_token"]["total"]["fp8"] == 48068
    assert rep["indexer_share"] == pytest.approx(0.1675, abs=1e-4)
    assert rep["flops_per_token"]["per_history_token"] == {"indexer": 16384, "mla": 278528}
    assert rep["crossover_context"] == 34816
    cm = rep["comm_bytes_per_rank_per_layer"]
    assert cm["tp_mla"] / cm["cp_mla"] == pytest.approx(24.89, abs=0.01)
    assert cm["tp_indexer"] > 1000 * cm["cp_indexer"]
    assert rep["inputs"] == {"context": P.DEFAULT_CONTEXT, "batch": 1, "gpus": P.DEFAULT_GPUS,
                             "kv_format": "fp8", "parallel": "tp"}
    assert rep["memory_gb"]["kv_per_gpu"] == pytest.approx(P.DEFAULT_CONTEXT * 48068 / 1e9, rel=1e-12)


def test_cli_default_is_v32_table(capsys):
    rc, out, _ = run_cli(["plan"], capsys)
    assert rc == 0
    assert out.startswith("flashdsa plan: DeepseekV32ForCausalLM (preset v32): 61 layers")
    assert "48.1 KB" in out and "34816" in out and "24.9x" in out


def test_cli_options_reach_the_model(capsys):
    rc, out, _ = run_cli(["plan", "--preset", "glm5", "--context", "8192", "--batch", "3", "--gpus", "2",
                          "--kv-format", "bf16", "--parallel", "cp", "--json"], capsys)
    assert rc == 0
    rep = json.loads(out)
    assert rep == json.loads(json.dumps(P.plan(GLM5, context=8192, batch=3, gpus=2, kv_format="bf16",
                                               parallel="cp", source="preset glm5")))


def test_cli_config_file_and_folder(tmp_path, capsys):
    hf = dict(PRESETS["glm5"], index_topk_freq=4, index_skip_topk_offset=3)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    expect = json.loads(json.dumps(P.plan(GLM5_SKIP, source=str(path))))
    rc, out, _ = run_cli(["plan", "--config", str(path), "--json"], capsys)
    assert rc == 0
    rep = json.loads(out)
    assert rep == expect
    assert rep["model"]["indexer_layers"] == 21 and rep["kv_bytes_per_token"]["indexer"] == 2772
    rc, out, _ = run_cli(["plan", "--config", str(tmp_path), "--json"], capsys)  # the folder holding it
    assert rc == 0 and json.loads(out)["kv_bytes_per_token"] == expect["kv_bytes_per_token"]


@pytest.mark.parametrize("argv, needle", [
    (["--context", "0"], "context"),
    (["--batch", "-2"], "batch"),
    (["--gpus", "0"], "gpus"),
    (["--config", "/nonexistent/config.json"], "no such file"),
], ids=["context0", "batch-neg", "gpus0", "missing-config"])
def test_cli_errors_exit_2_with_a_message(argv, needle, capsys):
    rc, out, err = run_cli(["plan", *argv], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("flashdsa plan: ") and needle in err


def test_cli_bad_config_files(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc, _, err = run_cli(["plan", "--config", str(bad)], capsys)
    assert rc == 2 and "cannot read" in err
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    rc, _, err = run_cli(["plan", "--config", str(lst)], capsys)
    assert rc == 2 and "JSON object" in err
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({k: v for k, v in PRESETS["v32"].items() if k != "index_topk"}))
    rc, _, err = run_cli(["plan", "--config", str(dense)], capsys)
    assert rc == 2 and "index_topk" in err
    rc, _, err = run_cli(["plan", "--config", str(tmp_path / "empty_dir_missing")], capsys)
    assert rc == 2 and "no such file" in err


@pytest.mark.parametrize("argv", [
    ["--preset", "v32", "--config", "x.json"], ["--preset", "nope"], ["--context", "abc"],
    ["--kv-format", "fp16"], ["--parallel", "dp"],
], ids=["preset-and-config", "unknown-preset", "context-not-int", "kv-format", "parallel"])
def test_cli_usage_errors(argv, capsys):
    rc, out, err = run_cli(["plan", *argv], capsys)
    assert rc == 2 and out == ""
    # One line naming the flag, not argparse's usage block (flashdsa.cli keeps only its error line).
    assert err.startswith("flashdsa plan: ") and len(err.strip().splitlines()) == 1
    assert argv[0] in err


def test_load_config_errors():
    with pytest.raises(ValueError, match="either --preset or --config"):
        P.load_config(preset="v32", config="x.json")
    with pytest.raises(ValueError, match="preset"):
        P.load_config(preset="v4")
    cfg, label = P.load_config()
    assert cfg == V32 and label == "preset v32"
