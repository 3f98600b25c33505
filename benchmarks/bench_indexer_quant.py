"""The indexer's RoPE -> Hadamard -> fp8 (``ops.indexer_quant``): the fused Triton op vs the torch composition.

    PYTHONPATH=. python benchmarks/bench_indexer_quant.py [--quick] [--sweep] [--smoke]

Shapes: queries ``[T, 64, 128]`` and keys ``[T, 128]`` for T in {1, 64, 4096, 16384} (``--quick``: 1 and
4096), bf16, random rows of mixed scales. Checks first, on every shape, both RoPE layouts: ours against
the torch reference on the GPU, e4m3 codes and fp32 scales bit for bit (the kernel runs without FMA
contraction, so equality is expected; a difference prints its count and its largest distance in e4m3
steps), and ours with the integer ("soft") casts the interpreter uses. Then kernel launches per call
(torch.profiler, T = 1) and times: median µs of ``triton.testing.do_bench`` over one plain call, host
overhead included (the way decode calls it). ``GB/s`` counts ours' bytes (x in, e4m3 + scale out, cos /
sin in). ``--sweep`` also times other launch configs (rows per program, warps, soft casts). ``--smoke``
runs tiny shapes (on the CPU through the interpreter when there is no GPU) to check the script itself;
its times mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from _common import print_table, timed, write_json

from flashdsa import ops
from flashdsa.ops.indexer_quant import triton as K
from flashdsa.quant import rope_cos_sin

TS = (1, 64, 4096, 16384)
TS_QUICK = (1, 4096)
TS_SMOKE = (1, 5)
H = 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SWEEP = [K.IndexerQuantConfig(block_r=b, num_warps=w)
         for b, w in ((4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4), (32, 8))]
SWEEP += [K.IndexerQuantConfig(soft_casts=True)]


def make_inputs(T: int, heads: int | None, g: torch.Generator):
    shape = (T, 128) if heads is None else (T, heads, 128)
    scale = torch.exp(torch.randn(shape[:-1] + (1,), generator=g) * 2)
    x = (torch.randn(shape, generator=g) * scale).to(torch.bfloat16).to(DEV)
    cos, sin = rope_cos_sin(torch.randint(0, 100_000, (T,), generator=g))
    return x, cos.to(DEV), sin.to(DEV)


def e4m3_order(q: torch.Tensor) -> torch.Tensor:
    """e4m3 codes -> integers in value order (one step = one representable value)."""
    b = q.view(torch.uint8).int()
    return torch.where(b >= 0x80, -(b & 0x7F), b)


def compare(ours, ref) -> tuple[int, int, int]:
    """(differing e4m3 codes, their largest distance in steps, differing scales)."""
    (q, s), (q_ref, s_ref) = ours, ref
    diff = (e4m3_order(q) - e4m3_order(q_ref)).abs()
    n_s = int((s.view(torch.int32) != s_ref.view(torch.int32)).sum())
    return int((diff > 0).sum()), int(diff.max()) if diff.numel() else 0, n_s


def launches(fn) -> int:
    """CUDA kernels one call of fn launches (-1 without CUDA)."""
    if DEV != "cuda":
        return -1
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    ts = TS_SMOKE if args.smoke else TS_QUICK if args.quick else TS
    cases = [(f"q T{T} H{H}", T, H) for T in ts] + [(f"k T{T}", T, None) for T in ts]

    ok = True
    for name, T, heads in cases:
        x, cos, sin = make_inputs(T, heads, g)
        for il in (False, True):
            ref = ops.indexer_quant(x, cos, sin, il, backend="torch")
            for label, cfg in (("hw casts", None), ("soft casts", K.IndexerQuantConfig(soft_casts=True))):
                n_q, steps, n_s = compare(K.indexer_quant(x, cos, sin, il, config=cfg), ref)
                if n_q or n_s:
                    ok = False
                    print(f"[check] {name} interleave={il} {label}: {n_q} e4m3 codes differ (max {steps} steps), "
                          f"{n_s} scales differ")
    print(f"[check] ours == torch reference bit for bit on every case: {ok}")

    x, cos, sin = make_inputs(1, H, g)
    xk = x[:, 0].contiguous()
    n_ref = launches(lambda: (ops.indexer_quant(x, cos, sin, False, backend="torch"),
                              ops.indexer_quant(xk, cos, sin, False, backend="torch")))
    n_ours = launches(lambda: (ops.indexer_quant(x, cos, sin, False, backend="triton"),
                               ops.indexer_quant(xk, cos, sin, False, backend="triton")))
    print(f"[launches] one indexer call (q [1, {H}, 128] + k [1, 128]): torch {n_ref}, ours {n_ours}")

    rows = []
    for name, T, heads in cases:
        x, cos, sin = make_inputs(T, heads, g)
        ref_us = timed(lambda: ops.indexer_quant(x, cos, sin, False, backend="torch"), DEV)
        ours_us = timed(lambda: ops.indexer_quant(x, cos, sin, False, backend="triton"), DEV)
        nbytes = x.numel() * (x.element_size() + 1) + x[..., 0].numel() * 4 + 2 * cos.numel() * 4
        row = dict(case=name, ref_us=ref_us, ours_us=ours_us, speedup=ref_us / ours_us,
                   ours_GBps=nbytes / ours_us / 1e3)
        if args.sweep:
            for cfg in SWEEP:
                key = "soft" if cfg.soft_casts else f"b{cfg.block_r}w{cfg.num_warps}"
                row[f"{key}_us"] = timed(lambda: K.indexer_quant(x, cos, sin, False, config=cfg), DEV)
        rows.append(row)
        x = cos = sin = None  # free this case before the next (the timed lambdas are done with them)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    write_json(rows, "bench_indexer_quant")
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    print_table(rows, f"indexer_quant, bf16, NeoX, {device}, "
                      f"{datetime.date.today()} (µs, do_bench median of one plain call)")


if __name__ == "__main__":
    main()
