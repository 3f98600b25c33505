"""``flashdsa demo --cp P / --dcp P`` under torchrun (gloo, CPU): one JSON object from rank 0 that says ok, with
the keys the issue asks for, and the bytes per rank per layer that ``flashdsa plan`` predicts. Bad launches
are one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from flashdsa import plan as cost
from flashdsa.cli import main
from flashdsa.config import DSAConfig
from flashdsa.demo.scenario import _scenario

REPO = Path(__file__).resolve().parents[2]


# A gloo rank's C++ runtime aborting ("terminate called without an active exception": a std::thread of
# torch's c10d / gloo destroyed while joinable), seen in 2 of 4 fresh-clone CI runs on 2026-12-01, never
# when the demo or this file runs alone (0 of 45 reruns); Python code cannot raise it. One retry, with the
# first run's stderr in a warning; anything else, or a second abort, fails.
_GLOO_ABORT = "terminate called without an active exception"


def torchrun(nproc: int, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

    def run():
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(nproc), "-m", "flashdsa", "demo", "--layers", "3", "--json", *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    proc = run()
    if proc.returncode != 0 and _GLOO_ABORT in proc.stderr:
        warnings.warn(f"torchrun {' '.join(args)}: a rank aborted in torch's C++ runtime; retrying once. stdout: "
                      f"{proc.stdout[-1000:]!r} stderr: {proc.stderr[:3000]!r} ... {proc.stderr[-1500:]!r}")
        proc = run()
    assert proc.returncode == 0, proc.stderr[:2000] + "\n...\n" + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout  # rank 0 prints, the others do not
    return json.loads(lines[0])


def test_torchrun_retries_only_a_runtime_abort_once(monkeypatch):
    calls = []

    def fake(results):
        def run(*args, **kwargs):
            calls.append(1)
            return results.pop(0)
        return run
    ok = subprocess.CompletedProcess([], 0, stdout='{"ok": true}\n', stderr="")
    abort = subprocess.CompletedProcess([], 1, stdout="", stderr=f"{_GLOO_ABORT}\nexitcode  : -6")
    other = subprocess.CompletedProcess([], 1, stdout="", stderr="ValueError: dcp: expected ...")
    monkeypatch.setattr(subprocess, "run", fake([abort, ok]))
    with pytest.warns(UserWarning, match="aborted in torch's C"):
        assert torchrun(2) == {"ok": True}
    for results in ([abort, abort], [other, ok]):
        calls.clear()
        monkeypatch.setattr(subprocess, "run", fake(list(results)))
        with pytest.raises(AssertionError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torchrun(2)
        assert len(calls) == (2 if results[0] is abort else 1)


@pytest.mark.parametrize("nproc, args", [(2, ["--cp", "2", "--cp-split", "zigzag"]), (3, ["--dcp", "3"]),
                                         (2, ["--cp", "2", "--cp-split", "interleave", "--kpool", "4"])],
                         ids=["cp2-zigzag", "dcp3", "cp2-interleave-kpool4"])
def test_demo_under_torchrun_says_ok_and_agrees_with_the_plan(nproc, args):
    report = torchrun(nproc, *args)
    assert report["ok"] is True, report
    assert report["world_size"] == nproc and report["selections_bitwise_equal"] is True
    assert report["split"] == (args[args.index("--cp-split") + 1] if "--cp" in args else "kv-by-position")
    assert report["max_abs_over_tolerance"] <= 1.0 and report["ranks_agree"] is True
    cfg = DSAConfig.preset("tiny")
    if "--kpool" in args:
        cfg = cfg.replace(index_kpool=4)
        assert report["kpool"] == 4
    if "--cp" in args:
        assert report["max_abs_vs_single_process"] == 0.0
        assert report["logits_max_abs_vs_single_process_free_running"] == 0.0
        lens, cuts, _ = _scenario(cfg, 2)
        t = lens["short"] + lens["at_topk"] + cuts[1]  # the first prefill batch (128; kpool cuts inside a group: 130)
        want = cost.cp_gather_bytes_per_rank_per_layer(cfg, t, nproc)
    else:
        want = cost.dcp_bytes_per_rank_per_layer(cfg, 3, nproc)
    assert report["bytes_all_gathered_per_rank_per_layer"] == want == report["plan_bytes_per_rank_per_layer"]


@pytest.mark.parametrize("argv, start", [
    (["demo", "--cp", "2"], "flashdsa demo: --cp: expected one process per rank: torchrun --nproc-per-node 2"),
    (["demo", "--dcp", "2", "--cp", "2"], "flashdsa demo: --dcp: expected --cp or --dcp, not both"),
    (["demo", "--cp", "2", "--cp-split", "ring"], "flashdsa demo: argument --cp-split: invalid choice"),
    (["demo", "--dcp", "2", "--kpool", "4"], "flashdsa demo: --kpool: decode context parallelism (--dcp) with kpool "
                                             "is not built"),
    # flags the parallel demo has no use for are refused, never dropped
    (["demo", "--cp", "2", "--offload"], "flashdsa demo: --offload: host offload (--offload, --device-buffer) with "
                                         "context parallelism (--cp / --dcp) is not built"),
    (["demo", "--dcp", "2", "--device-buffer", "128"], "flashdsa demo: --device-buffer: host offload"),
    (["demo", "--dcp", "2", "--cp-split", "zigzag"], "flashdsa demo: --cp-split: expected only with --cp"),
    (["demo", "--cp-split", "interleave"], "flashdsa demo: --cp-split: expected only with --cp"),
    (["demo", "--cp", "0"], "flashdsa demo: --cp: expected an integer >= 1"),
    (["demo", "--dcp", "-1"], "flashdsa demo: --dcp: expected an integer >= 1"),
], ids=["no-torchrun", "both", "bad-split", "dcp-kpool", "cp-offload", "dcp-device-buffer", "dcp-split",
        "split-alone", "cp0", "dcp-negative"])
def test_bad_parallel_launches_are_one_line_errors(capsys, monkeypatch, argv, start):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(start) and "\n" not in err, err


def test_rank_count_must_be_torchrun_s_before_joining(capsys, monkeypatch):
    import flashdsa.parallel as par

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(par, "init", None)  # joining the group would fail loudly
    assert main(["demo", "--cp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "flashdsa demo: --cp: expected the number of processes torchrun started (3), got 2", err


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["--cp", "--dcp"])
def test_nccl_path_at_world_size_one_on_one_gpu(mode):
    # One rank over NCCL: the all-gathers and the merge run and change nothing, so it is one process's bits.
    report = torchrun(1, mode, "1", "--device", "cuda")
    assert report["ok"] is True, report
    assert report["world_size"] == 1 and report["device"].startswith("cuda") and report["backend"] == "triton"
    assert report["max_abs_vs_single_process"] == 0.0 and report["ranks_agree"] is True
