"""The demo through the command line: one JSON object that says ok, one-line errors for bad input, a
refusal (with the numbers) for a preset that does not fit the device, "n/a" for a check that does not
apply, a warm-up before the timed run.

Only the stable contract is checked (exit codes, the JSON keys named here, the error lines); the report's
other keys belong to the demo and change with it. Full runs use the tiny preset, cut to few layers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import flashdsa.demo as demo
import flashdsa.demo.run as demo_run  # run_demo's own names: where a test swaps available_memory
from flashdsa.cli import main
from flashdsa.demo import demo_config, memory_estimate, run_demo
from flashdsa.engine import DSAModel
from flashdsa.plan import attention_params

REPO = Path(__file__).resolve().parents[1]


def _one_line_error(capsys, argv: list[str], code: int = 2) -> str:
    rc = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == code, (rc, err)
    assert captured.out == ""
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"flashdsa {argv[0]}: ") or err.startswith("flashdsa: "), err
    return err


def test_demo_json(capsys):
    # 3 layers keep the skip-top-k layer (2) of the tiny preset.
    rc = main(["demo", "--json", "--layers", "3"])
    out = capsys.readouterr().out
    report = json.loads(out)  # exactly one JSON object, nothing else on stdout
    assert isinstance(report, dict)
    assert report["ok"] is True
    assert rc == 0
    assert report["device"] == "cpu"
    # Every check applied here, so each has a number (or True), none is skipped.
    assert report["skip_layers"] == [2] and report["skip_layers_reuse_exact"] is True
    assert report["dense_fallback_ran"] is True
    for name in ("dense_equivalence", "chunked_vs_oneshot", "verify_vs_decode"):
        assert isinstance(report[f"{name}_rel_rms"], float)
        assert report[f"{name}_rel_rms"] < report["tolerance_rel_rms"]
    assert report["not_applicable"] == {}
    # The warm-up runs on the CPU too, is shown, and is not part of tokens/s.
    stages = report["stages_s"]
    assert stages["warmup"] > 0
    timed = sum(t for n, t in stages.items() if n not in ("build", "warmup"))
    tokens = sum(report["prompt_lens"]) + 4 * 3 + report["next_n"] * 3
    assert report["tokens_per_s"] == pytest.approx(tokens / timed, rel=1e-2)  # stages_s is rounded to 0.1 ms


def test_checks_that_do_not_apply_say_na_and_force_runs_past_the_refusal(monkeypatch):
    """fp8_raw never takes the dense path and 2 layers have no skip-top-k layer: both checks are None in
    the report (null in JSON) and "n/a" in the text, never 0. A device too small only warns with --force."""
    monkeypatch.setattr(demo_run, "available_memory", lambda device: 1000)
    lines: list[str] = []
    report = run_demo(kv_format="fp8_raw", layers=2, log=lines.append, force=True)
    text = "\n".join(lines)
    assert report["ok"] is True
    assert any(line.startswith("[demo] warning (--force): preset: tiny") for line in lines), text
    back = json.loads(json.dumps(report))
    for key in ("dense_equivalence_rel_rms", "dense_equivalence_max_abs", "dense_fallback_ran",
                "skip_layers_reuse_exact"):
        assert back[key] is None, key
    assert set(back["not_applicable"]) == {"dense_equivalence", "skip_layers_reuse"}
    assert "dense equivalence n/a (fp8_raw never takes the dense path)" in text
    assert "skip layers reuse n/a" in text
    assert isinstance(back["verify_vs_decode_rel_rms"], float)


@pytest.mark.parametrize("argv, flag", [
    (["demo", "--device", "gpu"], "--device"),
    (["demo", "--device", "cuda:99"], "--device"),
    (["demo", "--device", "cpu:1"], "--device"),
    (["demo", "--layers", "0"], "--layers"),
    (["demo", "--layers", "5"], "--layers"),  # the tiny preset has 4
    (["demo", "--next-n", "0"], "--next-n"),
    (["demo", "--next-n", "two"], "--next-n"),
    (["demo", "--next-n", "100000"], "--next-n"),  # past the model's context: refused, not out of memory
    (["demo", "--kpool", "3"], "--kpool"),  # index_topk (64) is not a multiple of 3
    (["demo", "--kpool", "128"], "--kpool"),
    (["demo", "--seed", "-1"], "--seed"),
    (["demo", "--preset", "v4"], "--preset"),
    (["demo", "--kv-format", "fp4"], "--kv-format"),
    (["demo", "--no-such-flag"], "--no-such-flag"),
    (["plan", "--context", "0"], "--context"),
    (["plan", "--config", "no/such/config.json"], "--config"),
    (["bench", "--ops", "nothing"], "--ops"),
    (["nothing"], "nothing"),
], ids=lambda x: x if isinstance(x, str) else "_".join(x))
def test_bad_flag_is_one_line(capsys, argv, flag):
    err = _one_line_error(capsys, argv)
    assert flag in err


def test_next_n_is_bounded_by_the_model_context(capsys, monkeypatch):
    """The longest prompt (3 index_topk + 7 = 199 tokens), its 4 decodes and the drafts must fit the tiny preset's
    max_position_embeddings (4096): 3893 drafts at most, said before anything is built."""
    monkeypatch.setattr(DSAModel, "random", None)
    assert demo.max_next_n(demo_config("tiny")) == 4096 - 199 - 4
    err = _one_line_error(capsys, ["demo", "--next-n", "3894"])
    assert err.startswith("flashdsa demo: --next-n: expected an integer 1 <= next_n <= 3893 ") and "4096" in err, err


def test_memory_estimate_counts_the_verify_step(capsys, monkeypatch):
    """The verify step's indexer logits [3 next_n, context] fp32 grow with next_n squared: 3000 drafts need about
    0.6 GB on the tiny preset (0.13 GB without them). The refusal names --next-n before anything is built."""
    monkeypatch.setattr(demo_run, "available_memory", lambda device: 300 * 10 ** 6)
    monkeypatch.setattr(DSAModel, "random", None)
    tiny = demo_config("tiny")
    assert memory_estimate(tiny, next_n=3000)["total"] > 300e6 > memory_estimate(tiny)["total"]
    err = _one_line_error(capsys, ["demo", "--next-n", "3000"])
    assert "a smaller --next-n (3000" in err, err


def test_triton_backend_without_cuda_is_refused_before_building(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the suite interprets Triton on the CPU
    monkeypatch.setattr(DSAModel, "random", None)  # building the model would fail loudly
    err = _one_line_error(capsys, ["demo", "--backend", "triton"])
    assert "--backend" in err and "cuda" in err


def test_preset_too_big_is_refused_with_the_numbers(capsys, monkeypatch):
    """v32 on a 24 GB CPU: refused before anything is allocated, with the estimate, the memory there is,
    and how to proceed (the layer count that fits, a GPU, --force)."""
    monkeypatch.setattr(demo_run, "available_memory", lambda device: 24 * 10 ** 9)
    monkeypatch.setattr(DSAModel, "random", None)
    err = _one_line_error(capsys, ["demo", "--preset", "v32"])
    m = re.search(r"needs about ([\d.]+) GB \(weights ([\d.]+) GB, KV caches ([\d.]+) GB, activations ([\d.]+) GB\) "
                  r"but 24.0 GB is available", err)
    assert m, err
    total, *parts = map(float, m.groups())
    assert total == pytest.approx(sum(parts), abs=0.15) and total > 24
    layers = int(re.search(r"--layers N fits for N <= (\d+)", err)[1])
    # The refusal's own advice must hold: that many layers fit, one more does not.
    for n, fits in ((layers, True), (layers + 1, False)):
        est = memory_estimate(demo_config("v32", n))
        assert (est["total"] * 1.1 <= 24e9) is fits, n
    assert "--device cuda" in err and "--force" in err


@pytest.mark.parametrize("preset", ["tiny", "v32", "glm5"])
def test_weight_estimate_matches_the_cost_model(preset):
    """The meta-device count of the demo model equals the parameters written out from the config with
    flashdsa.plan's attention formula: bf16 matrices, fp32 norms (and the indexer's LayerNorm bias)."""
    cfg = demo_config(preset)
    att, L, d = attention_params(cfg), cfg.num_hidden_layers, cfg.hidden_size
    L_I = len(cfg.topk_layers)
    norms = 2 * d * L + d + (cfg.q_lora_rank + cfg.kv_lora_rank) * L + 2 * cfg.index_head_dim * L_I  # fp32
    matrices = (att["mla"] + att["indexer"] - (cfg.q_lora_rank + cfg.kv_lora_rank) * L
                - 2 * cfg.index_head_dim * L_I + 3 * d * cfg.intermediate_size * L + 2 * cfg.vocab_size * d)
    rope_table = 8 * cfg.qk_rope_head_dim // 2  # float64 inverse frequencies
    assert memory_estimate(cfg)["weights"] == 2 * matrices + 4 * norms + rope_table


def test_out_of_memory_is_one_line(capsys, monkeypatch):
    def oom(**_):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 123 bytes.\nmore lines")
    monkeypatch.setattr(demo, "run_demo", oom)
    err = _one_line_error(capsys, ["demo"], code=1)
    assert "out of memory" in err and "--layers" in err


def test_help_cites_only_files_in_the_repository(capsys):
    for cmd in ([], ["demo"], ["plan"], ["bench"]):
        with pytest.raises(SystemExit) as exit_:
            main([*cmd, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert "SPEC" not in text, cmd
        for path in re.findall(r"[\w/.-]+\.md\b", text):
            assert (REPO / path).is_file(), f"flashdsa {cmd} --help cites {path}"
