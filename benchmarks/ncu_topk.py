"""A few top-2048 calls at a decode shape, for Nsight Compute (one kernel, nothing else on the GPU)::

    ncu --kernel-name regex:topk --launch-count 1 --section SourceCounters --page source --print-source sass \
        --csv python3 benchmarks/ncu_topk.py --scores randn > out/ncu-topk.csv
    python benchmarks/ncu_sass_top.py out/ncu-topk.csv

Rows: 64 x ~U(0.7, 1.3) x 8K in a width of 10 624 with a page table (the decode selection's top-k) by
default; ``--width`` / ``--full`` change it, ``--scores`` picks a kind of ``bench_topk.make_scores``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_topk as bt  # noqa: E402

from flashdsa import ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=10624)
    ap.add_argument("--full", action="store_true", help="every row the full width (default: ragged)")
    ap.add_argument("--scores", default="randn")
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    R, L = 64, a.width
    x = bt.make_scores(a.scores, R, L, seed=R + L)
    lengths = bt.decode_lengths(R, L, not a.full)
    table = bt.page_table(R, L)
    ops.set_value_checks(False)
    for _ in range(a.calls):
        ops.topk_transform(x, lengths, 2048, page_table=table)
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
