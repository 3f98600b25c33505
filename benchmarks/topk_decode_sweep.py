"""Launch alternatives of top-2048 at the decode shapes (64 rows, page table), timed against the default.

    PYTHONPATH=. python benchmarks/topk_decode_sweep.py [--smoke]

Each variant is ``dataclasses.replace(default_config(...), ...)``; its slots are checked bit for bit against
the torch oracle (``bench_topk.oracle`` through the page table) before it is timed (CUDA-graph replay). The
variants ask whether the rows kernel (a row in registers, 2048-bucket levels counted with shared-memory
atomics) or a row's whole length as U (``cand >= L``: no sample, every key a candidate, one
program a row) beats the split kernel's sample + chunks at 8K-16K, where the levels dominate
(README.md "Triton details": select 8.2 of 22.9 µs at 64 x 8K).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_topk as bt  # noqa: E402
from _common import load_sgl_ops  # noqa: E402
from flashdsa.testing.compare import topk_tie_safe  # noqa: E402
from flashdsa.testing.peers import fast_topk  # noqa: E402
from flashdsa.ops._triton_utils import next_pow2, num_sms  # noqa: E402
from flashdsa.ops.topk import launch  # noqa: E402


def variants(R: int, L: int, K: int, sms: int) -> list[tuple[str, dict]]:
    cand = next_pow2(L)
    out = [("default", {})]
    for nw in (8, 16):
        for stream in (False, True):
            out.append((f"row nw{nw}{' stream' if stream else ''}",
                        dict(kind="fused", cand=cand, wcap=launch.WCAP, num_warps=nw, grid=R, maxnreg=0,
                             stream=stream, unroll=2, move_step=128, block=128 * nw)))
    # one program a row with the default U (the sample, then one program's compaction; no arrival, no gather)
    for nw, unroll in ((8, 4), (16, 2)):
        out.append((f"fused nw{nw} grid R", dict(kind="fused", num_warps=nw, grid=R, maxnreg=0, stream=False,
                                                 unroll=unroll, move_step=128, block=128 * nw)))
    # a program a row, the row in registers, shared-memory histograms (rows.py; rows of at most 16K)
    if L <= launch.ROWS_MAX_L:
        for nw in (8, 16, 32):
            for bits in (11, 8):
                out.append((f"rows nw{nw} b{bits}", dict(kind="rows", num_warps=nw, bits=bits, maxnreg=0, tiles=1)))
        # the levels' ranges (TopkConfig.narrow): min / max of the row and of every bucket (n2), of the row and
        # of buckets of over 1/32 of the row (n1), none at all (n0)
        for narrow in (2, 1, 0):
            out.append((f"rows n{narrow}", dict(kind="rows", num_warps=16, bits=11, maxnreg=0, narrow=narrow,
                                                tiles=1)))
        # the row as two tiles (TopkConfig.tiles): 8256 scores in 8192 + 2048 key slots, not 16384
        for nw in (8, 16):
            out.append((f"rows nw{nw} tiles2", dict(kind="rows", num_warps=nw, bits=11, maxnreg=0, tiles=2)))
    # the fused kernel's default launch (many rows), and the split kernel (the default at these shapes before the
    # rows kernel), whatever the default is now
    out.append(("fused", dataclasses.asdict(launch.default_config(R, L, K, sms, kind="fused"))))
    split = dataclasses.asdict(launch.default_config(R, L, K, sms, kind="split"))
    out.append(("split", split))
    out.append(("split chunks 1", dict(split, chunks=1)))
    out.append(("split chunks 4", dict(split, chunks=4)))
    out.append(("split nw16", dict(split, num_warps=16, block=128 * 16)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (checks only)")
    ap.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--shapes", default="", help="comma-separated case indices of the default shapes (0-4)")
    ap.add_argument("--rl", default="", help="comma-separated RxL shapes instead of the default ones (page "
                    "table, full rows), e.g. 1x8256,16x8256; RxLc: causal lengths (the last R rows of an L prompt)")
    ap.add_argument("--peer", action="store_true", help="also time sgl-kernel fast_topk on the same scores "
                    "(untranslated positions; its sets checked tie-safe)")
    ap.add_argument("--scores", default="randn", help="comma-separated score kinds of bench_topk.make_scores "
                    "(randn, levels256, levels16, equal, narrow), each a pass over the shapes")
    a = ap.parse_args()
    if a.smoke:
        bt.DEV, K, shapes = "cpu", 64, [(3, 700, False), (2, 500, True)]
    else:
        K, shapes = 2048, [(64, 8192, False), (64, 10649, True), (64, 16384, False), (64, 32768, False),
                           (64, 10624, True)]
    if a.shapes:
        shapes = [shapes[int(i)] for i in a.shapes.split(",")]
    if a.rl:  # "RxL", or "RxLc": causal lengths, the last R rows of an L-token prompt (prefill's)
        shapes = [(int(r), int(c.rstrip("c")), "causal" if c.endswith("c") else False)
                  for r, c in (x.split("x") for x in a.rl.split(","))]
    peer = a.peer and not a.smoke and load_sgl_ops() and hasattr(torch.ops.sgl_kernel, "fast_topk")
    only = set(filter(None, a.only.split(",")))
    bt.K = K
    dev = torch.device(bt.DEV)
    rows = []
    for kind, (R, L, ragged) in [(kd, sh) for kd in a.scores.split(",") for sh in shapes]:
        x = bt.make_scores(kind, R, L, seed=R + L)
        lengths = (torch.arange(R, device=dev) + L - R + 1).clamp(min=0).to(torch.int32) if ragged == "causal" \
            else bt.decode_lengths(R, L, ragged)
        table = bt.page_table(R, L)
        pos = bt.oracle(x, lengths, K)
        page = torch.gather(table, 1, (pos // 64).clamp(min=0).long())
        want = torch.where(pos >= 0, page * 64 + pos % 64, -1)
        default = launch.default_config(R, L, K, num_sms(dev) if bt.DEV == "cuda" else 4)
        base = None
        for name, kw in variants(R, L, K, num_sms(dev) if bt.DEV == "cuda" else 4):
            if only and name not in only and name != "default":
                continue
            cfg = dataclasses.replace(default, **kw)
            got = bt._ours(x, lengths, cfg, table)
            ok = bool(torch.equal(got, want))
            us = bt._time_graph(lambda: bt._ours(x, lengths, cfg, table)) if ok and not a.smoke else float("nan")
            base = us if name == "default" else base
            case = f"{R}x{L}{' ' + str(ragged) if ragged == 'causal' else ' ragged' if ragged else ''}" \
                   f"{'' if kind == 'randn' else ' ' + kind}"
            rows.append({"case": case, "variant": name, "ok": ok, "us": us,
                         "vs_default": us / base if base else float("nan")})
            print(rows[-1], flush=True)
        if peer:
            call, out = fast_topk(x, lengths, K)
            call()
            exact = topk_tie_safe(x, lengths, out, K)[0]
            us = bt._time_graph(call)
            rows.append({"case": case, "variant": "fast_topk (peer)", "ok": exact, "us": us, "vs_default": us / base})
            print(rows[-1], flush=True)
    print(f"\n{'case':<26} | {'variant':<18} | ok    | us      | vs default")
    for r in rows:
        print(f"{r['case']:<26} | {r['variant']:<18} | {str(r['ok']):<5} | {r['us']:7.1f} | {r['vs_default']:.3f}")


if __name__ == "__main__":
    main()
