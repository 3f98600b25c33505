"""Where the time of prefill selection goes: ``indexer_topk_ragged`` against its parts, on one chunk of query rows.

    PYTHONPATH=. python benchmarks/prefill_selection_parts.py [--shapes 4096x4096,4096x32768] [--smoke]

A shape ``TxN`` is the last T rows of an N-token prompt (one request: ks 0, ke = N - T + 1 + i), the rows
``flashdsa bench --ops prefill`` selects for. Timed (plain calls, medians): the ragged logits alone; top-k on
them with the op's arguments (row_starts and out_offsets) and without (ks is 0 here, so the same rows);
the fused op, reading ks / ke back and given them on the host (``host_bounds``); DeepGEMM's logits ->
fast_topk where they load. Then the CUDA kernels of one fused call
(torch.profiler), so launch gaps and host work show as the difference to the kernels' sum.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_deep_gemm, load_sgl_ops, print_table, timed  # noqa: E402

from flashdsa import ops  # noqa: E402
from flashdsa.quant import FP8  # noqa: E402


def inputs(T: int, N: int, H: int, dev: str):
    g = torch.Generator(device=dev).manual_seed(T + N)
    q = torch.randn(T, H, 128, generator=g, device=dev).to(FP8)
    k = torch.randn(N, 128, generator=g, device=dev).to(FP8)
    k_scale = torch.rand(N, generator=g, device=dev) + 0.5
    w = torch.randn(T, H, generator=g, device=dev) * H ** -0.5
    ks = torch.zeros(T, dtype=torch.int32, device=dev)
    ke = (torch.arange(T, device=dev) + N - T + 1).to(torch.int32)
    return q, k, k_scale, w, ks, ke


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096x4096,4096x32768,4096x131072")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter: the script only")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes, H, K = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")], 64, 2048
    backend = None if dev == "cuda" else "triton"
    if a.smoke:
        shapes, H, K = [(40, 100)], 8, 16
    dg = load_deep_gemm() if dev == "cuda" else None
    sgl = dev == "cuda" and load_sgl_ops() and hasattr(torch.ops.sgl_kernel, "fast_topk")
    ops.set_value_checks(False)  # as the engine runs prefill
    rows = []
    for T, N in shapes:
        q, k, k_scale, w, ks, ke = inputs(T, N, H, dev)
        lens = ke - ks
        bounds = torch.stack((ks, ke)).cpu()  # what an engine holds on the host already
        logits = ops.indexer_logits_ragged(q, k, k_scale, w, ks, ke, backend=backend)
        fused = ops.indexer_topk_ragged(q, k, k_scale, w, ks, ke, K, out_offsets=ks, backend=backend)
        given = ops.indexer_topk_ragged(q, k, k_scale, w, ks, ke, K, out_offsets=ks, backend=backend,
                                        host_bounds=torch.stack((ks, ke)).cpu())
        unfused = ops.topk_transform(logits, lens, K, row_starts=ks, out_offsets=ks, backend=backend)
        plain = ops.topk_transform(logits, lens, K, backend=backend)
        row = {"shape": f"{T}x{N}", "same": bool(torch.equal(fused, unfused) and torch.equal(plain, unfused)
                                                 and torch.equal(given, unfused)),
               "logits_us": timed(lambda: ops.indexer_logits_ragged(q, k, k_scale, w, ks, ke, backend=backend), dev),
               "topk_us": timed(lambda: ops.topk_transform(logits, lens, K, row_starts=ks, out_offsets=ks,
                                                          backend=backend), dev),
               "topk_plain_us": timed(lambda: ops.topk_transform(logits, lens, K, backend=backend), dev),
               "fused_us": timed(lambda: ops.indexer_topk_ragged(q, k, k_scale, w, ks, ke, K, out_offsets=ks,
                                                                 backend=backend), dev),
               "fused_host_bounds_us": timed(lambda: ops.indexer_topk_ragged(
                   q, k, k_scale, w, ks, ke, K, out_offsets=ks, backend=backend, host_bounds=bounds), dev)}
        if dg is not None:
            row["dg_logits_us"] = timed(lambda: dg.fp8_mqa_logits(q, (k, k_scale), w, ks, ke), dev)
            if sgl and K == 2048:
                x = dg.fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
                out = torch.empty(T, K, dtype=torch.int32, device=dev)
                row["fast_topk_us"] = timed(lambda: torch.ops.sgl_kernel.fast_topk(x, out, lens, None), dev)
        rows.append(row)
        print(row, flush=True)
        if dev == "cuda":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                ops.indexer_topk_ragged(q, k, k_scale, w, ks, ke, K, out_offsets=ks, backend=backend)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
    print_table(rows, "prefill selection: the fused op against its parts (us, plain calls)")


if __name__ == "__main__":
    main()
