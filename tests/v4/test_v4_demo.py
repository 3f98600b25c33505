"""``flashdsa demo --preset v4-tiny``: DeepSeek-V4's three layer types through flashdsa's step against
transformers' own layers (flashdsa/demo/v4.py), through the command line and the function."""

from __future__ import annotations

import json
import sys

import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("transformers without deepseek_v4", allow_module_level=True)
from flashdsa.cli import main  # noqa: E402
from flashdsa.demo.v4 import EXACT_TOL, run_v4_demo  # noqa: E402
from flashdsa.v4.config import LAYER_TYPES  # noqa: E402


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_cli_json_report(capsys):
    """One JSON object on stdout: ok, both precisions of every layer type, exact mode within its bound (a
    prompt of 70 tokens in chunks of 32: the last chunk of 6 closes no HCA entry), the state's bytes."""
    assert main(["demo", "--preset", "v4-tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["preset"] == "v4-tiny" and report["prompt"] == 70
    rows = {(r["precision"], r["layer"]): r for r in report["layers"]}
    assert set(rows) == {(p, t) for p in ("exact", "fp8") for t in LAYER_TYPES}
    for (precision, _), r in rows.items():
        assert r["tokens"] == 70 + report["decode_steps"] and r["state_bytes_per_request"] > 0
        if precision == "exact":
            assert r["max_err"] <= EXACT_TOL
        else:  # fp8 rows and picks: close to HF's bf16 layer, never equal
            assert 0 < r["max_rel"] < 1


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_a_longer_prompt_through_the_function():
    report = run_v4_demo("v4-tiny", prompt=150, batch=1, log=None)
    assert report["ok"] and report["prompt"] == 150 and report["batch"] == 1


def test_dsa_flags_and_bad_values_refused(capsys):
    for argv in (["--next-n", "3"], ["--kv-format", "bf16"], ["--layers", "2"], ["--offload"]):
        assert main(["demo", "--preset", "v4-tiny", *argv]) == 2
        err = capsys.readouterr().err  # the CLI names the flag as typed
        assert err.startswith(f"flashdsa demo: {argv[0]}: a flag of the DSA demo") and "\n" not in err.strip(), err
    for kwargs, name in ((dict(preset="v4"), "preset"), (dict(batch=0), "batch"), (dict(prompt=1), "prompt"),
                         (dict(backend="cuda"), "backend"), (dict(prompt=5000), "prompt")):
        with pytest.raises(ValueError, match=f"^{name}:"):
            run_v4_demo(**{"preset": "v4-tiny", **kwargs}, log=None)


def test_without_transformers_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ValueError, match="^preset: .*transformers >= 5.23"):
        run_v4_demo("v4-tiny", log=None)
