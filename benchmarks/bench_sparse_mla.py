"""Sparse MLA (Triton) side by side with FlashMLA on the GPU: decode over the fp8 656-B paged cache and
prefill over gathered bf16 KV.

    PYTHONPATH=. python benchmarks/bench_sparse_mla.py [--quick] [--no-graph]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_sparse_mla.py --cpu-smoke   # script check, no GPU

For every shape: correctness of our default configuration first (against the fp32 reference on a
subsample of rows, and against FlashMLA's output where it runs; how FlashMLA's lse relates to ours is
measured, not assumed), then the time of a few kernel configurations of ours and of FlashMLA, one
line per configuration: us | TFLOP/s | GB/s | peer us | ratio (ours / peer; < 1 is faster). FLOPs and
bytes count valid selected tokens only. Timing is the median of triton.testing.do_bench (cold L2
between runs) over a CUDA-graph replay of one call (--no-graph: the plain call), for ours and the peer
alike. The table comes last; rows go to $OUT/bench_sparse_mla.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from _common import load_sgl_ops, print_table, timed, write_json

from flashdsa.cache.layouts import PAGE_SIZE
from flashdsa.ops.sparse_mla import reference
from flashdsa.ops.sparse_mla import triton as tri
from flashdsa.testing.compare import cos_diff
from flashdsa.testing.inputs import decode_slots, mla_cache, prefill_indices, randn, rows_subset
from flashdsa.testing.peers import flashmla_decode, flashmla_prefill

SM_SCALE = 576 ** -0.5
CTX = 32768                    # context per decode request
TOPK = 2048
DEV = "cuda"
H200 = dict(copy_GBps=4273, bf16_TFLOPs=709)

# configurations tried per shape; None is launch_config()'s default. The first case of each list runs them all.
Config = tri.SparseMLAConfig
DECODE_CONFIGS_BIG_H = [
    ("default", None),                                                    # h > 64: wide, else heads_m; s3
    ("heads_m-s3", Config(kernel="heads_m", num_stages=3, slots_ahead=True)),   # 9 tensor-core ops per step
    ("wide-s3", Config(kernel="wide", num_stages=3, slots_ahead=True)),         # 3 tensor-core ops per step
    ("prev-default", Config(kernel="heads_m", num_stages=2, slots_ahead=False)),  # before issue 5's tuning
    ("splits2", Config(num_splits=2)),                                    # flash-decoding over 2 programs
]
DECODE_CONFIGS_SMALL_H = [
    ("default", None),                                                    # h 17..32: 64-head tiles; <= 16: 16
    ("bh64-w8-s3", Config(kernel="heads_m", block_h=64, block_n=64, num_warps=8, num_stages=3, slots_ahead=True)),
    ("bh16-w4-s3", Config(kernel="heads_m", block_h=16, block_n=32, num_warps=4, num_stages=3, slots_ahead=True)),
    ("prev-default", Config(kernel="heads_m", block_h=16, block_n=32, num_warps=4, num_stages=2, slots_ahead=False)),
]
PREFILL_CONFIGS = [
    ("default", None),                                                    # heads_m 64 x 64, 2 stages, in-step slots
    ("default-hot64", None),  # same kernel, every step reads the same 64 rows (L2 / L1 hot): the math ceiling
    ("wide-s2", Config(kernel="wide", num_stages=2)),
    ("bn32-s3", Config(block_n=32, num_stages=3, slots_ahead=True)),
]


def lse_relation(peer_lse: torch.Tensor, ours: torch.Tensor) -> str:
    """How the peer's lse relates to ours (natural log): 'natural', 'log2' or the fitted factor."""
    p = peer_lse.float()
    if p.shape != ours.shape and p.dim() == ours.dim() and p.transpose(-1, -2).shape == ours.shape:
        p = p.transpose(-1, -2)
    if p.shape != ours.shape:
        return f"shape {list(peer_lse.shape)} vs ours {list(ours.shape)}"
    m = torch.isfinite(p) & torch.isfinite(ours) & (ours.abs() > 1e-3)
    if not m.any():
        return "no finite pairs"
    ratio = float((p[m] / ours[m]).median())
    err_nat = float((p[m] - ours[m]).abs().max())
    err_log2 = float((p[m] - ours[m] * math.log2(math.e)).abs().max())
    if err_nat < 1e-2:
        return f"natural log (max |diff| {err_nat:.1e})"
    if err_log2 < 1e-2:
        return f"log2 (= ours * log2(e), max |diff| {err_log2:.1e})"
    return f"unclear: median ratio {ratio:.4f}"


# FlashMLA's test criteria: every element within abs_tol OR rel_tol, and the cosine diff below cos_tol
DECODE_TOL = dict(abs_tol=1e-3, rel_tol=2.01 / 128, cos_tol=5e-6)
PREFILL_TOL = dict(abs_tol=8e-4, rel_tol=3.01 / 128, cos_tol=7e-6)


def ref_check(out, lse, ref_fn, q_rows, idx_rows, tol):
    """Errors of out / lse against the fp32 reference (on dequantised inputs) for a few rows, and whether
    they pass FlashMLA's criteria (lse: 1e-6 abs or 8/65536 rel)."""
    ref_out, ref_lse = ref_fn(q_rows, idx_rows)
    o, r = out.float(), ref_out.float()
    err = (o - r).abs()
    cd = cos_diff(o, r)
    ok_out = bool(((err < tol["abs_tol"]) | (err / (r.abs() + 1e-6) < tol["rel_tol"])).all()) and cd < tol["cos_tol"]
    fin = torch.isfinite(ref_lse)
    lerr = (lse - ref_lse).abs()
    ok_lse = torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and bool(
        ((lerr < 1e-6) | (lerr / (ref_lse.abs() + 1e-6) < 8.01 / 65536))[fin].all())
    return dict(ref_max_abs=float(err.max()), ref_cos_diff=cd,
                ref_lse_max_abs=float(lerr[fin].max()) if fin.any() else 0.0, ref_ok=ok_out and ok_lse)


# ---- decode -------------------------------------------------------------------------------------------

def decode_inputs(B: int, s_q: int, h_q: int, dev):
    """fp8 656-B pool with CTX tokens per request on shuffled pages, topk distinct valid slots per row."""
    pages_per_req = CTX // PAGE_SIZE
    P = B * pages_per_req
    gen = torch.Generator(device=dev).manual_seed(0)
    cache = mla_cache(P, gen, dev)
    block_table = torch.randperm(P, device=dev, generator=gen).view(B, pages_per_req)
    slots = decode_slots(block_table, CTX, s_q, TOPK, gen)
    q = randn((B, s_q, h_q, 576), gen, dev, torch.bfloat16)
    return q, cache, slots


def run_decode(B, s_q, h_q, configs, peer_ok, graph, rows):
    dev = torch.device(DEV)
    q, cache, idx = decode_inputs(B, s_q, h_q, dev)
    n_valid = int((idx >= 0).sum())
    flop = 2 * h_q * (576 + 512) * n_valid
    byts = n_valid * 656 + q.numel() * 2 + B * s_q * h_q * 512 * 2 + idx.numel() * 4
    name = f"decode fp8 B{B} s_q{s_q} h{h_q} topk{TOPK}"

    out, lse = tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None)
    sub = rows_subset(B, 8, dev)
    info = ref_check(out[sub], lse[sub], lambda qq, ii: reference.sparse_mla_decode(qq, cache, ii, SM_SCALE, 512, None),
                     q[sub], idx[sub], DECODE_TOL)
    peer_us = None
    if peer_ok and h_q in (64, 128):
        try:
            seqlens = torch.full((B,), CTX, dtype=torch.int32, device=dev)
            peer = flashmla_decode(q, cache, idx, SM_SCALE, seqlens)
            p_out, p_lse = peer()[:2]
            info.update(peer_max_abs=float((out.float() - p_out.float()).abs().max()),
                        peer_cos_diff=cos_diff(out.float(), p_out.float()),
                        peer_lse=lse_relation(p_lse, lse))
            peer_us = timed(peer, DEV, graph)
        except Exception as e:  # noqa: BLE001
            info["peer_error"] = repr(e)[:160]
    print(f"{name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()))
    for cname, config in configs:
        fn = lambda: tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, config)  # noqa: E731
        try:
            extra = agreement(fn, out, lse) if config is not None else info
            us = timed(fn, DEV, graph)
            extra = dict(extra, res=resources(lambda: decode_launch(q, cache, idx, config)))
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile is reported, not fatal
            print(f"  {cname:12s} failed: {e!r:.200}")
            rows.append(dict(case=name, config=cname, error=repr(e)[:120]))
            continue
        add_row(rows, name, cname, us, flop, byts, peer_us, extra)
    cache = None  # free the pool before the next case (the timed lambdas are done with it)
    if DEV == "cuda":
        torch.cuda.empty_cache()


# ---- prefill ------------------------------------------------------------------------------------------

def run_prefill(T, N, h_q, configs, peer_ok, graph, rows):
    dev = torch.device(DEV)
    gen = torch.Generator(device=dev).manual_seed(1)
    kv = randn((N, 576), gen, dev, torch.bfloat16)
    q = randn((T, h_q, 576), gen, dev, torch.bfloat16)
    idx = prefill_indices(T, N, TOPK, gen, dev)  # causal-like: query t among the first max(topk, N (t+1) / T)
    flop = 2 * h_q * (576 + 512) * T * TOPK
    byts = T * TOPK * 1152 + q.numel() * 2 + T * h_q * 512 * 2 + idx.numel() * 4
    name = f"prefill bf16 T{T} N{N} h{h_q} topk{TOPK}"

    out, lse = tri.sparse_mla_prefill(q, kv, idx, SM_SCALE, 512)
    sub = rows_subset(T, 16, dev)
    info = ref_check(out[sub], lse[sub], lambda qq, ii: reference.sparse_mla_prefill(qq, kv, ii, SM_SCALE, 512),
                     q[sub], idx[sub], PREFILL_TOL)
    peer_us = None
    if peer_ok and h_q % 64 == 0:
        try:
            peer = flashmla_prefill(q, kv, idx, SM_SCALE)
            res = peer()
            p_out, p_lse = res[0], res[2]
            info.update(peer_max_abs=float((out.float() - p_out.float()).abs().max()),
                        peer_cos_diff=cos_diff(out.float(), p_out.float()),
                        peer_lse=lse_relation(p_lse, lse))
            peer_us = timed(peer, DEV, graph)
        except Exception as e:  # noqa: BLE001
            info["peer_error"] = repr(e)[:160]
    print(f"{name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()))
    for cname, config in configs:
        ii = idx
        if cname.endswith("hot64"):  # every step gathers the same 64 rows: what the math alone costs
            ii = (torch.arange(TOPK, device=dev, dtype=torch.int32) % min(64, N)).expand_as(idx).contiguous()
        fn = lambda: tri.sparse_mla_prefill(q, kv, ii, SM_SCALE, 512, config)  # noqa: E731
        try:
            extra = {} if ii is not idx else agreement(fn, out, lse) if config is not None else info
            us = timed(fn, DEV, graph)
            extra = dict(extra, res=resources(lambda: prefill_launch(q, kv, ii, config)))
        except Exception as e:  # noqa: BLE001
            print(f"  {cname:12s} failed: {e!r:.200}")
            rows.append(dict(case=name, config=cname, error=repr(e)[:120]))
            continue
        add_row(rows, name, cname, us, flop, byts, peer_us, extra)


def agreement(fn, out, lse) -> dict:
    """A non-default configuration must give the default's answer (same math, other tiling)."""
    o, l = fn()
    fin = torch.isfinite(lse)
    same_inf = torch.equal(torch.isneginf(l), torch.isneginf(lse))
    cd = cos_diff(o.float(), out.float())
    lse_err = float((l[fin] - lse[fin]).abs().max()) if fin.any() else 0.0
    return dict(vs_default_cos_diff=cd, vs_default_lse_max_abs=lse_err,
                vs_default_ok=same_inf and cd < 1e-5 and lse_err < 1e-3 and not torch.isnan(o).any().item())


def decode_launch(q, cache, idx, config):
    """One launch of the configuration through the launcher, returning the compiled main kernel."""
    B, s_q, h_q, _ = q.shape
    q3, i2 = q.reshape(B * s_q, h_q, 576), idx.reshape(B * s_q, idx.shape[-1])
    cfg = tri.launch_config(h_q, "fp8", B * s_q, i2.shape[1], q.device, config)
    out = torch.empty(B * s_q, h_q, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B * s_q, h_q, dtype=torch.float32, device=q.device)
    return tri._launch(cfg, q3, cache, cache.stride(0), cache.stride(1), cache.shape[0] * PAGE_SIZE, "fp8", i2,
                       SM_SCALE, 512, None, out, lse)


def prefill_launch(q, kv, idx, config):
    T, h_q, _ = q.shape
    cfg = tri.launch_config(h_q, "bf16", T, idx.shape[1], q.device, config, split=False)
    out = torch.empty(T, h_q, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(T, h_q, dtype=torch.float32, device=q.device)
    return tri._launch(cfg, q, kv, PAGE_SIZE * kv.stride(0), kv.stride(0), kv.shape[0], "bf16", idx, SM_SCALE, 512,
                       None, out, lse)


def resources(launch) -> str:
    """'registers / spills / shared bytes' of the compiled main kernel ('-' under the interpreter)."""
    try:
        k = launch()
        return f"{k.n_regs}/{k.n_spills}/{k.metadata.shared}"
    except Exception:  # noqa: BLE001 - the interpreter returns no compiled kernel
        return "-"


def add_row(rows, name, cname, us, flop, byts, peer_us, info):
    tf, gbs = flop / us / 1e6, byts / us / 1e3
    row = dict(case=name, config=cname, us=round(us, 1), TFLOPs=round(tf, 1), GBps=round(gbs),
               pct_bf16_peak=round(100 * tf / H200["bf16_TFLOPs"]), pct_copy=round(100 * gbs / H200["copy_GBps"]),
               peer_us=None if peer_us is None else round(peer_us, 1),
               ratio=None if peer_us is None else round(us / peer_us, 3))
    row.update({k: v for k, v in info.items() if k.startswith(("ref_", "peer_", "vs_default", "res"))})
    rows.append(row)
    peer = "-" if peer_us is None else f"{peer_us:.1f}"
    ratio = "-" if peer_us is None else f"{us / peer_us:.2f}"
    print(f"  {cname:12s} {us:8.1f} us | {tf:6.1f} TFLOP/s | {gbs:6.0f} GB/s | peer {peer} us | ratio {ratio} | "
          f"regs/spills/smem {info.get('res', '-')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one decode and one prefill shape, default config only")
    ap.add_argument("--no-graph", action="store_true", help="time plain calls instead of CUDA-graph replays")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on CPU under TRITON_INTERPRET=1: checks the script, times nothing real")
    args = ap.parse_args()
    global DEV, CTX, TOPK
    t0 = time.time()
    if args.cpu_smoke:
        DEV, CTX, TOPK = "cpu", 256, 96
        rows: list[dict] = []
        run_decode(2, 2, 64, DECODE_CONFIGS_BIG_H[:2], False, False, rows)
        run_decode(2, 1, 16, DECODE_CONFIGS_SMALL_H, False, False, rows)
        run_prefill(8, 300, 64, PREFILL_CONFIGS[:2], False, False, rows)
        print_table(rows, "cpu smoke (interpreter; times are meaningless)")
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu-smoke)")
        return 1
    peer_ok = load_sgl_ops()
    graph = not args.no_graph
    rows: list[dict] = []
    big, small, pre = DECODE_CONFIGS_BIG_H, DECODE_CONFIGS_SMALL_H, PREFILL_CONFIGS
    if args.quick:
        big, small, pre = big[:1], small[:1], pre[:1]
        decode_cases = [(64, 1, 128, big), (64, 1, 16, small)]
        prefill_cases = [(4096, 8192, 128, pre)]
    else:
        decode_cases = [(64, 1, 128, big), (128, 1, 128, big[:1]), (64, 2, 128, big[:1]), (128, 2, 128, big[:1]),
                        (128, 2, 64, big[:3]), (64, 1, 32, small), (64, 1, 16, small), (128, 2, 16, small[:1])]
        prefill_cases = [(4096, 8192, 128, pre), (4096, 32768, 64, pre[:1])]
    for B, s_q, h_q, cfgs in decode_cases:
        run_decode(B, s_q, h_q, cfgs, peer_ok, graph, rows)
    for T, N, h_q, cfgs in prefill_cases:
        run_prefill(T, N, h_q, cfgs, peer_ok, graph, rows)
    print(f"total {time.time() - t0:.0f} s")
    write_json(rows, "bench_sparse_mla")
    cols = ("case", "config", "us", "TFLOPs", "GBps", "pct_bf16_peak", "pct_copy", "peer_us", "ratio", "res", "ref_ok",
            "ref_max_abs", "ref_cos_diff", "peer_max_abs", "peer_cos_diff", "vs_default_ok", "error")
    print_table([{k: r[k] for k in cols if k in r} for r in rows],
                "sparse MLA: ours (Triton) vs FlashMLA, H200 ceilings 709 bf16 TFLOP/s, 4273 GB/s copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
