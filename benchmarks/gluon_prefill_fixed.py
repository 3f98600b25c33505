"""Fixed cost per CTA of the bf16 Gluon kernel (gluon_bf16.py): prefill T 4096, N 8K, h 128 timed at
top-k 128 / 512 / 2048 (1 / 4 / 16 block pairs a CTA); a line through the three gives the cost per pair and
what a CTA costs besides its pairs (barrier set-up, Q load, epilogue, wave tails), next to FlashMLA's.

    PYTHONPATH=. python benchmarks/gluon_prefill_fixed.py

The variants once timed here (the persistent grid, the first version) are in git history: gluon_bf16.py at
e14c64d holds them as its ``VARIANTS`` table, and this script at that commit takes ``--variants``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from _common import load_sgl_ops, timed
    from flashdsa.ops.sparse_mla import gluon_bf16 as G
    from flashdsa.testing.inputs import prefill_indices, randn
    from flashdsa.testing.peers import flashmla_prefill
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    T, N, h = 4096, 8192, 128
    kv, q = randn((N, 576), g, dev, torch.bfloat16), randn((T, h, 576), g, dev, torch.bfloat16)
    peer_ok = load_sgl_ops()
    names = ["gluon_bf16", "FlashMLA"]
    rows = []
    out = torch.empty(T, h, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, h, dtype=torch.float32, device=dev)
    for k in (128, 512, 2048):
        idx = prefill_indices(T, N, k, g, dev)
        grid, kw = G.kernel_args(q, kv, 64 * 576, 576, N, idx, 576 ** -0.5, out, lse)
        row = [k // 128, timed(lambda: G.sparse_mla_bf16_ws_kernel[grid](**kw), "cuda", True),
               timed(flashmla_prefill(q, kv, idx, 576 ** -0.5), "cuda", True) if peer_ok else float("nan")]
        rows.append(row)
        print(f"topk {k}: " + ", ".join(f"{n} {t:.1f} us" for n, t in zip(names, row[1:])), flush=True)
    for col, name in enumerate(names, start=1):
        p0, p1 = rows[0][0], rows[-1][0]
        t0, t1 = rows[0][col], rows[-1][col]
        per_pair = (t1 - t0) / (p1 - p0)
        print(f"{name}: {per_pair:.1f} us per pair of blocks (all CTAs), fixed {t0 - per_pair * p0:.1f} us "
              f"({(t0 - per_pair * p0) / t1:.1%} of top-2048), top-2048 {t1:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
