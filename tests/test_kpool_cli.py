"""kpool on the command line: ``flashdsa demo --kpool C`` (its JSON adds ``kpool`` and
``indexer_bytes_per_token``) and ``flashdsa plan --kpool C`` (the indexer cache and scan shrink by C)."""

from __future__ import annotations

import json

import pytest

from flashdsa.cli import main
from flashdsa.demo.scenario import _scenario, demo_config


def test_demo_kpool_json(capsys):
    rc = main(["demo", "--json", "--layers", "3", "--kpool", "4"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"] is True
    assert report["kpool"] == 4
    # 2 of the 3 layers have an indexer: 132 B per 4 tokens each
    assert report["indexer_bytes_per_token"] == 2 * 132 / 4 == report["kv_bytes_per_token"]["index"]
    assert report["kv_bytes_per_token"]["total"] == 3 * 656 + 66
    for name in ("dense_equivalence", "chunked_vs_oneshot", "verify_vs_decode"):
        assert report[f"{name}_rel_rms"] < report["tolerance_rel_rms"]
    assert report["skip_layers_reuse_exact"] is True and report["dense_fallback_ran"] is True


def test_demo_kpool_chunks_split_groups():
    _, cuts, _ = _scenario(demo_config("tiny", kpool=4), 2)
    assert all(c % 4 for c in cuts[1:-1])
    _, plain, _ = _scenario(demo_config("tiny"), 2)
    assert plain == [0, 32, 128, 199]


@pytest.mark.parametrize("argv, flag", [
    (["demo", "--kpool", "3"], "--kpool: index_topk"),
    (["demo", "--kpool", "0"], "--kpool: expected an integer >= 1"),
    (["plan", "--kpool", "3"], "--kpool: index_topk"),
    (["plan", "--kpool", "0"], "--kpool: expected a positive integer"),
    (["demo", "--dcp", "2", "--kpool", "4"], "--kpool: decode context parallelism"),
])
def test_bad_kpool_is_one_line_naming_the_flag(capsys, argv, flag):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"flashdsa {argv[0]}: {flag}"), err


def test_plan_kpool_shrinks_the_indexer(capsys):
    assert main(["plan", "--preset", "glm5", "--json"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(["plan", "--preset", "glm5", "--json", "--kpool", "4"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["model"]["index_kpool"] == 4 and rep["model"]["page_size"] == 256
    assert rep["kv_bytes_per_token"]["indexer"] * 4 == base["kv_bytes_per_token"]["indexer"] == 78 * 132
    assert rep["flops_per_token"]["indexer"] * 4 == base["flops_per_token"]["indexer"]
    k = base["model"]["index_topk"]  # the tail group widens the selection to k + 3 tokens
    assert rep["crossover_context"] == -(-4 * base["crossover_context"] * (k + 3) // k)
    assert main(["plan", "--preset", "glm5", "--kpool", "4"]) == 0
    assert "kpool 4" in capsys.readouterr().out


def test_bench_kpool_script_smoke(monkeypatch):
    """benchmarks/bench_kpool.py on tiny shapes (CPU: the Triton interpreter): its checks pass, its rows say
    the indexer cache shrinks by c."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["bench_kpool.py", "--smoke"])
    import bench_kpool

    rows = bench_kpool.run(smoke=True)
    assert [(r["c"], r["ok"]) for r in rows] == [(1, True), (4, True)]
    assert rows[0]["index B/token"] == 132 and rows[1]["index B/token"] == 33
