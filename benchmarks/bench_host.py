"""Host cost of one plain (eager) call of each public op and of the peers, at DeepSeek-V3.2's decode shapes,
and the plain-call decode step against its CUDA-graph replay (issue #18).

    PYTHONPATH=. python benchmarks/bench_host.py [--ctx 8192,32768] [--calls 100] [--profile OP] [--smoke]

Host µs: the GPU is first given a spin kernel (``torch.cuda._sleep``) longer than the timed calls take, so
every launch only queues and the wall time of ``--calls`` back-to-back calls is the host path alone
(argument checks, dispatch, config, value checks, Triton's launcher); the best of 9 such batches (the
shared host's load moves medians by +-40 % between runs; the best batch is the path's own cost).
``gpu_busy`` says the spin outlasted the batch (else the time may include waiting). Ours with the
default value checks (on the device, inside the op's own kernel, no host sync) and with checks off; the
peers as ``flashdsa.testing.peers`` calls them (their schedule metadata made once, outside the timing);
top-k's peer is sgl-kernel's Python entry ``fast_topk_v2``, which allocates its output per call as ours
does (before 2026-12-02 the raw op writing into a buffer made once: still timed, ``ours/raw fast_topk``), and
``topk_transform(out=)`` into a buffer made once is compared with that raw op.
Calibration rows: torch.add and an empty Triton kernel with 2 / 12 arguments. The device cost of the
value checks folded into the paged-logits and top-k kernels: graph-replayed µs with and without them.

Decode step (paged logits -> top-k with slot translation -> sparse MLA decode, B 64, one layer): µs per
step of 50 back-to-back plain calls timed with CUDA events (the GPU waits for the host when the host is
slower), against the same loop of CUDA-graph replays of the step; the peers' step (DeepGEMM, fast_topk,
FlashMLA) likewise. Targets (issue #18): paged logits <= 45 µs and top-k <= 20 µs of host time, each op
<= 2x its peer's, the plain-call step <= 1.2x the replayed one: printed as PASS / FAIL lines
(``--strict``: exit 1 on a FAIL).

``--profile OP`` (paged, topk, decode, quant, ragged) prints cProfile's top functions of that op's host
path. ``--smoke``: tiny shapes on the CPU (Triton interpreter), to check the script; its times mean
nothing. JSON: $OUT/bench_host.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from _common import load_deep_gemm, load_sgl_ops, print_table, write_json  # noqa: E402

from flashdsa._checks import value_check_setting  # noqa: E402
from flashdsa.testing.host_cost import COLUMNS, HostTimer, decode_inputs, measure, our_calls  # noqa: E402


def profile(op: str, a, dev: str, timer: HostTimer) -> None:
    import cProfile
    import pstats
    d = decode_inputs(dev, a.B, a.ctx[0], a.H, a.h_q, a.topk, a.backend)
    names = {"paged": "indexer_logits_paged", "topk": "topk_transform (page table)", "decode": "sparse_mla_decode",
             "quant": "indexer_quant (q)", "step": "step"}
    if op not in names:
        raise SystemExit(f"--profile: expected one of {', '.join(names)}, got {op!r}")
    fn = our_calls(d)[names[op]][0]
    timer(fn)
    prof = cProfile.Profile()
    if dev == "cuda":
        torch.cuda._sleep(int(timer.cycles_per_us * 400 * timer.calls))
    prof.enable()
    for _ in range(timer.calls):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", default="8192,32768", help="contexts (tokens per request), comma-separated")
    ap.add_argument("--calls", type=int, default=100, help="calls per timed batch")
    ap.add_argument("--profile", default=None, help="cProfile one op's host path: paged, topk, decode, quant, step")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (CPU ok)")
    a = ap.parse_args()
    a.ctx = [int(c) for c in a.ctx.split(",")]
    a.B, a.H, a.h_q, a.topk, a.backend = 64, 64, 128, 2048, None
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not a.smoke:
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    if a.smoke:
        a.ctx, a.calls, a.B, a.H, a.h_q, a.topk, a.backend = [200], 2, 2, 8, 16, 64, "triton"
    import triton
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    print(f"{name} | torch {torch.__version__} | triton {triton.__version__} | value checks: "
          f"{value_check_setting()}")
    timer = HostTimer(dev, a.calls)
    if a.profile:
        profile(a.profile, a, dev, timer)
        return 0
    dg = dev == "cuda" and load_deep_gemm() is not None
    sgl = dev == "cuda" and load_sgl_ops()
    rows, verdicts = measure(dev, a.ctx, a.calls, a.B, a.H, a.h_q, a.topk, a.backend, dg, sgl, timer)
    write_json(rows, "bench_host")
    print_table([{c: r[c] for c in COLUMNS if c in r} for r in rows],
                f"host us per plain call (GPU kept busy), B {a.B}, H_I {a.H}, h_q {a.h_q}, top-{a.topk}"
                + (" [smoke: times mean nothing]" if a.smoke else ""))
    for text, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return 1 if a.strict and not all(ok for _, ok in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
