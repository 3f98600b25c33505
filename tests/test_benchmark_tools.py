"""The GPU-box helpers of benchmarks/ that run anywhere: ``ncu_sass_top.py`` on a CSV shaped like Nsight
Compute's ``--page source --print-source sass --csv`` output; ``topk_decode_sweep.py``'s smoke mode."""

from __future__ import annotations

from pathlib import Path

CSV = '''==PROF== Connected to process 1
ran something x1
"Kernel Name","k_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","L1 Wavefronts Shared Excessive","L1 Wavefronts Shared","L1 Wavefronts Shared Ideal","L2 Theoretical Sectors Local","stall_long_sb","stall_wait","stall_barrier"
"0x7f0000000100","      STS.128 [R8], R96","3","16384","65536","131072","65536","0","0","0","0"
"0x7f0000000110","      LDL R15, [R1]","5","16384","0","0","0","65536","5","0","0"
"0x7f0000000120","  @!P0  BRA 0x7f0000000100","90","1000","0","0","0","0","88","2","0"
'''


def test_ncu_sass_top_ranks_instructions(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ncu_sass_top

    path = tmp_path / "k.csv"
    path.write_text(CSV)
    text = ncu_sass_top.summary(path, top=2)
    lines = text.splitlines()
    assert lines[0] == "== k_kernel (3 SASS instructions)"
    assert "shared wavefronts 131,072 (ideal 65,536, excess 65,536 = 50.0%)" in lines[1]
    assert "local-memory sectors 65,536; stall samples 98" in lines[1]
    assert lines[2].startswith("stall samples by reason: long_sb 93 (95%), wait 2 (2%)")
    excess = lines.index("-- top 1 by excess shared wavefronts")
    assert "STS.128 [R8], R96" in lines[excess + 1]
    stalls = lines.index("-- top 2 by stall samples")  # of 3: the top 2 only
    assert "BRA" in lines[stalls + 1] and "LDL" in lines[stalls + 2]


def test_topk_decode_sweep_smoke():
    """``topk_decode_sweep.py --smoke`` on the CPU interpreter: a launch variant's slots are the oracle's (the
    script's own check, the one its GPU run relies on) and the table prints."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "topk_decode_sweep.py"), "--smoke", "--shapes", "0",
                          "--only", "split chunks 1"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("3x700")]
    assert [r.split("|")[1].strip() for r in rows] == ["default", "split chunks 1"], run.stdout[-2000:]
    assert all(r.split("|")[2].strip() == "True" for r in rows), run.stdout[-2000:]


def test_sparse_decode_grid_smoke():
    """``sparse_decode_grid.py --smoke`` on the CPU interpreter: every top-k split of the Triton kernel gives the
    default's output (the script's own check, which its GPU run relies on) and the table prints."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "sparse_decode_grid.py"), "--smoke"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    last = [c.strip() for c in run.stdout.rstrip().splitlines()[-1].split("|")]
    assert "triton-s32" in run.stdout and last[:3] == ["1", "1", "16"], run.stdout[-2000:]  # B, s_q, h


def test_small_batch_selection_smoke():
    """``small_batch_selection.py --smoke --logit-chunks`` on the CPU interpreter: every top-k launch and every
    logits chunk width gives the default's bits (the script's own checks, which its GPU run relies on)."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "small_batch_selection.py"), "--smoke",
                          "--logit-chunks"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "'logits:c128'" in run.stdout and "'topk:split-c2'" in run.stdout, run.stdout[-2000:]
    assert run.stdout.rstrip().splitlines()[-1].startswith("3 | 1200"), run.stdout[-2000:]


def test_bench_v4_decode_smoke():
    """``bench_v4_decode.py --smoke`` on the CPU (torch backends): the V4 CSA decode chain builds, its checks
    run and the table prints."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_v4_decode.py"), "--smoke"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "'topk_same': True" in run.stdout and run.stdout.rstrip().splitlines()[-1].startswith("2 | 4096")


def test_prefill_selection_parts_smoke():
    """``prefill_selection_parts.py --smoke`` on the CPU interpreter: the fused op (reading its bounds and given
    them on the host) equals the unfused composition, and the table prints."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "prefill_selection_parts.py"), "--smoke"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    last = run.stdout.rstrip().splitlines()[-1].split("|")
    assert last[0].strip() == "40x100" and last[1].strip() == "True", run.stdout[-2000:]


def test_v4_hf_check_smoke():
    """``v4_hf_check.py --smoke`` on the CPU: every attention layer type of the tiny V4 against HF's on HF's own
    inputs, both backends, within fp32 rounding (the table's errors are printed as numbers)."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "v4_hf_check.py"), "--smoke"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split("|") for line in run.stdout.splitlines() if line[:1].isdigit()]
    assert len(rows) == 8 and all(float(r[3]) < 1e-5 for r in rows), run.stdout
