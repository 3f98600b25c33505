"""Timing on the GPU: the median of ``triton.testing.do_bench`` (CUDA events, L2 flushed before each rep)
over a CUDA-graph replay of one call (no Python / launch overhead, how decode runs) or over the plain call.

triton and CUDA are touched only when a function here runs, so importing this module costs nothing on a
machine without a GPU.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def do_bench_us(fn: Callable[[], Any], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median µs of ``fn`` by ``triton.testing.do_bench`` (``warmup_ms`` of warm-up, ``rep_ms`` of reps)."""
    import triton.testing
    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def capture_graph(fn: Callable[[], Any], reps: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``reps`` back-to-back calls of ``fn``, after one warm-up call on a side stream (compiles,
    allocator pools and lazy init happen outside the capture). Raises what capture raises."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g


def time_us(fn: Callable[[], Any], graph: bool = True, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median µs of ``fn`` on the GPU (:func:`do_bench_us`): a CUDA-graph replay of one call, or the plain
    call when ``graph`` is off or the call cannot be captured."""
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return do_bench_us(capture_graph(fn).replay, warmup_ms, rep_ms)
        except Exception:  # noqa: BLE001 - a call that cannot be captured is timed plainly
            torch.cuda.synchronize()
    return do_bench_us(fn, warmup_ms, rep_ms)
