"""Run each sparse-MLA kernel a few times at one shape, for Nsight Compute to profile (issue #16's "what
bounds it" evidence): our Gluon fp8 decode kernel and FlashMLA's decode, on the same inputs; with
``--prefill``, our Gluon bf16 prefill kernel and FlashMLA's prefill (T 4096, N 8K, h_q 128, top-2048).
Times mean nothing here; run it under ncu::

    ncu --kernel-name regex:'sparse_mla_decode_ws|sparse|flash' --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        --section WarpStateStats python3 benchmarks/ncu_sparse_mla.py [--calls 3]

``benchmarks/gpu_session.sh ncu`` runs it with the sections above and prints ncu's report. The variants
of the Gluon kernels profiled on the way are in git history: gluon.py at e14c64d holds them as its
``VARIANTS`` table, and this script at that commit takes ``--variants``.
"""

from __future__ import annotations

import argparse

import torch

from _common import load_sgl_ops

from flashdsa.ops.sparse_mla import gluon, gluon_bf16
from flashdsa.testing import peers
from flashdsa.testing.inputs import decode_slots, mla_cache, paged_batch, prefill_indices, randn

SM_SCALE = 576 ** -0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3, help="launches of each kernel")
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--prefill", action="store_true", help="the prefill kernels instead (T 4096, N 8K)")
    a = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    sgl = load_sgl_ops()
    if a.prefill:
        kv = randn((8192, 576), g, dev, torch.bfloat16)
        q = randn((4096, a.h_q, 576), g, dev, torch.bfloat16)
        idx = prefill_indices(4096, 8192, 2048, g, dev)
        calls = {"gluon_bf16": lambda: gluon_bf16.sparse_mla_prefill(q, kv, idx, SM_SCALE, 512)}
        if sgl:
            calls["FlashMLA prefill"] = peers.flashmla_prefill(q, kv, idx, SM_SCALE)
        for name, fn in calls.items():
            for _ in range(a.calls):
                fn()
            torch.cuda.synchronize()
            print(f"ran {name} x{a.calls}", flush=True)
        return
    seq, bt, P = paged_batch(a.B, a.ctx, 1, g, dev)
    cache = mla_cache(P, g, dev)
    q = randn((a.B, 1, a.h_q, 576), g, dev, torch.bfloat16)
    idx = decode_slots(bt, int(seq.min()), 1, 2048, g)
    for _ in range(a.calls):
        gluon.sparse_mla_decode_gluon(q, cache, idx, SM_SCALE)
    torch.cuda.synchronize()
    print(f"ran gluon x{a.calls}", flush=True)
    if sgl:
        fn = peers.flashmla_decode(q, cache, idx, SM_SCALE, seq.to(torch.int32))
        for _ in range(a.calls):
            fn()
        torch.cuda.synchronize()
        print(f"ran FlashMLA x{a.calls}", flush=True)


if __name__ == "__main__":
    main()
