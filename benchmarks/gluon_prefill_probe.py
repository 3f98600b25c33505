"""Probe of the two-consumer Gluon kernel over bf16 rows (flashdsa/ops/sparse_mla/gluon_bf16.py, issue #16)
on one H200: sparse prefill and the bf16-cache decode, against the fp32 reference, our Triton kernels and
FlashMLA, in one run.

    PYTHONPATH=. python benchmarks/gluon_prefill_probe.py [--child-timeout 150]
    PYTHONPATH=. python benchmarks/gluon_prefill_probe.py --compile-only [--sass-dir D]   # no GPU

The kernel runs in a child process (a deadlocked kernel only loses the child, killed after
``--child-timeout`` s; its output so far is kept): compile stats, then correctness on fresh random inputs
(NaN-poisoned outputs; ragged / mixed -1, -7, >= N / all-empty rows / NaN in row 0 never selected / top-k
0 ... 2048 / h 64, 128, 192; the Triton tests' tolerance ``|out - ref| <= 2^-8 (max |v| + |ref|)``), then
CUDA-graph replay medians next to our Triton kernel and FlashMLA. The table is printed last; JSON in
$OUT/gluon_prefill_probe.json.

The schedules measured on the way (sparse_mla/README.md lists what lost and by how much) are in git
history: gluon_bf16.py at e14c64d holds them as its ``VARIANTS`` table, and this probe at that commit
checks and times any of them (``--variants``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SM_SCALE = 576 ** -0.5
PREFILL_CASES = [(4096, 8192, 128), (4096, 32768, 64), (4096, 32768, 128)]   # (T, N, h_q), top-2048
DECODE_CASES = [(64, 1, 128), (128, 2, 64)]   # (B, s_q, h_q), bf16 pages, 32K context, top-2048


def check(out, lse, ref_out, ref_lse) -> dict:
    v_max = float(ref_out.abs().max()) if ref_out.numel() else 0.0
    err = (out.float() - ref_out).abs()
    bound = 2.0 ** -8 * (v_max + ref_out.abs())
    fin = torch.isfinite(ref_lse)
    lse_ok = bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))) and \
        bool(((lse[fin] - ref_lse[fin]).abs() <= 1e-3 + 1e-4 * ref_lse[fin].abs()).all())
    return dict(max_err=float(err.max()) if err.numel() else 0.0, ok=bool((err <= bound).all()) and lse_ok
                and bool(torch.isfinite(out).all()), lse_ok=lse_ok)


def small_prefill(T, N, h_q, topk, kind, gen, dev):
    """(q, kv, indices) over N rows with the edge cases of ``kind`` (gluon_sparse_mla_probe.edge_indices;
    "nan0": row 0 of kv is NaN and never selected)."""
    from gluon_sparse_mla_probe import edge_indices

    from flashdsa.testing.inputs import randn
    kv = randn((N, 576), gen, dev, torch.bfloat16)
    q = randn((T, h_q, 576), gen, dev, torch.bfloat16)
    idx = edge_indices(T, topk, N, kind, gen, dev)
    if kind == "nan0":
        kv[0] = float("nan")
    return q, kv, idx.int().contiguous()


def run_child(log) -> dict:
    from _common import load_sgl_ops, timed
    from flashdsa.ops.sparse_mla import gluon_bf16 as G, reference, triton as tri
    from flashdsa.testing.inputs import decode_slots, mla_cache, prefill_indices, randn
    from flashdsa.testing.peers import flashmla_decode, flashmla_prefill
    dev = torch.device("cuda")
    res = dict(cases=[], timings=[])

    def prep(q, kv, idx, stride_page, stride_row, n_slots):
        # NaN-poisoned outputs and a launch into them (timed without the allocation)
        R, h_q, _ = q.shape
        out = torch.full((R, h_q, 512), float("nan"), dtype=torch.bfloat16, device=dev)
        lse = torch.full((R, h_q), float("nan"), dtype=torch.float32, device=dev)
        grid, kw = G.kernel_args(q, kv, stride_page, stride_row, n_slots, idx, SM_SCALE, out, lse)
        return (lambda: G.sparse_mla_bf16_ws_kernel[grid](**kw)), out, lse

    def launch(*args):
        fn, out, lse = prep(*args)
        return out, lse, fn()

    gen = torch.Generator(device=dev).manual_seed(0)
    t0 = time.time()
    q, kv, idx = small_prefill(4, 300, 128, 128, "full", gen, dev)
    out, lse, k = launch(q, kv, idx, 64 * 576, 576, 300)
    torch.cuda.synchronize()
    res["compile"] = dict(n_regs=k.n_regs, n_spills=k.n_spills, shared=k.metadata.shared, s=round(time.time() - t0, 1))
    log(f"compiled {res['compile']}")
    for T, N, h_q, topk, kind in [(4, 300, 128, 128, "full"), (5, 300, 64, 100, "full"),
                                  (9, 4096, 128, 2048, "full"), (7, 4096, 128, 2048, "ragged"),
                                  (7, 4096, 64, 192, "mixed"), (3, 300, 128, 64, "empty"), (5, 300, 128, 256, "nan0"),
                                  (6, 1000, 64, 1, "full"), (6, 1000, 192, 65, "ragged"), (2, 128, 128, 0, "full")]:
        q, kv, idx = small_prefill(T, N, h_q, topk, kind, gen, dev)
        out, lse, _ = launch(q, kv, idx, 64 * 576, 576, N)
        ref_out, ref_lse = reference.sparse_mla_prefill(q, kv, idx, SM_SCALE, 512)
        c = dict(case=f"prefill T{T} N{N} h{h_q} topk{topk} {kind}", **check(out, lse, ref_out, ref_lse))
        t_out, t_lse = tri.sparse_mla_prefill(q, kv, idx, SM_SCALE, 512)
        c["triton_max_err"] = float((t_out.float() - ref_out).abs().max()) if ref_out.numel() else 0.0
        res["cases"].append(c)
        log(f"  {c}")
    # bf16 paged cache through the decode layout (page / row strides)
    for B, s_q, h_q, topk in [(3, 2, 128, 256), (4, 1, 64, 2048)]:
        cache = randn((48, 64, 576), gen, dev, torch.bfloat16)
        qd = randn((B, s_q, h_q, 576), gen, dev, torch.bfloat16)
        idd = torch.stack([torch.randperm(48 * 64, generator=gen, device=dev)[:topk] for _ in range(B * s_q)])
        idd = torch.where(torch.rand(idd.shape, generator=gen, device=dev) < 0.1, -1, idd).int().view(B, s_q, topk)
        out, lse, _ = launch(qd.view(B * s_q, h_q, 576), cache, idd.view(B * s_q, topk), cache.stride(0),
                             cache.stride(1), 48 * 64)
        ref_out, ref_lse = reference.sparse_mla_decode(qd, cache, idd, SM_SCALE, 512, None)
        c = dict(case=f"decode bf16 B{B} s_q{s_q} h{h_q} topk{topk}",
                 **check(out.view(ref_out.shape), lse.view(ref_lse.shape), ref_out, ref_lse))
        res["cases"].append(c)
        log(f"  {c}")
    if not all(c["ok"] for c in res["cases"]):
        log("NOT all correct; timing anyway")

    peer_ok = load_sgl_ops()
    for T, N, h_q in PREFILL_CASES:
        g = torch.Generator(device=dev).manual_seed(1)
        kv = randn((N, 576), g, dev, torch.bfloat16)
        q = randn((T, h_q, 576), g, dev, torch.bfloat16)
        idx = prefill_indices(T, N, 2048, g, dev)
        fn, out, lse = prep(q, kv, idx, 64 * 576, 576, N)
        fn()
        t_out, t_lse = tri.sparse_mla_prefill(q, kv, idx, SM_SCALE, 512)
        sub = torch.randperm(T, device=dev)[:8]
        r_out, r_lse = reference.sparse_mla_prefill(q[sub], kv, idx[sub], SM_SCALE, 512)
        ok = check(out[sub], lse[sub], r_out, r_lse)
        row = dict(case=f"prefill T{T} N{N} h{h_q}", ok=ok["ok"], max_err=ok["max_err"],
                   vs_triton=float((out.float() - t_out.float()).abs().max()))
        row["gluon_us"] = timed(fn, "cuda", True)
        if T == PREFILL_CASES[0][0] and N == PREFILL_CASES[0][1] and h_q == PREFILL_CASES[0][2]:
            # every row on the same 64 keys (L2 / L1 resident): the kernel without the gathers' latency
            hot = (torch.arange(2048, device=dev, dtype=torch.int32) % 64).expand_as(idx).contiguous()
            row["gluon_hot64_us"] = timed(prep(q, kv, hot, 64 * 576, 576, N)[0], "cuda", True)
        row["triton_us"] = timed(lambda: tri.sparse_mla_prefill(q, kv, idx, SM_SCALE, 512), "cuda", True)
        if peer_ok:
            row["flashmla_us"] = timed(flashmla_prefill(q, kv, idx, SM_SCALE), "cuda", True)
        res["timings"].append(row)
        log(f"  {row}")
        del kv, q, idx, out, t_out
    for B, s_q, h_q in DECODE_CASES:
        g = torch.Generator(device=dev).manual_seed(2)
        ctx = 32768
        P = B * ctx // 64
        cache = mla_cache(P, g, dev, fmt="bf16")
        block_table = torch.randperm(P, device=dev, generator=g).view(B, ctx // 64)
        idd = decode_slots(block_table, ctx, s_q, 2048, g)
        qd = randn((B, s_q, h_q, 576), g, dev, torch.bfloat16)
        R = B * s_q
        fn, out, lse = prep(qd.view(R, h_q, 576), cache, idd.view(R, 2048), cache.stride(0), cache.stride(1), P * 64)
        fn()
        sub = torch.randperm(R, device=dev)[:8]
        r_out, r_lse = reference.sparse_mla_decode(qd.view(R, 1, h_q, 576)[sub], cache, idd.view(R, 1, 2048)[sub],
                                                   SM_SCALE, 512, None)
        ok = check(out[sub], lse[sub], r_out.view(8, h_q, 512), r_lse.view(8, h_q))
        row = dict(case=f"decode bf16 B{B} s_q{s_q} h{h_q} 32K", ok=ok["ok"], max_err=ok["max_err"])
        row["gluon_us"] = timed(fn, "cuda", True)
        row["triton_us"] = timed(lambda: tri.sparse_mla_decode(qd, cache, idd, SM_SCALE, 512, None), "cuda", True)
        if peer_ok:
            # FlashMLA has no bf16-cache sparse decode: its fp8 one on the same slots
            c8 = mla_cache(P, torch.Generator(device=dev).manual_seed(2), dev)
            seqlens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            row["flashmla_fp8_us"] = timed(flashmla_decode(qd, c8, idd, SM_SCALE, seqlens), "cuda", True)
            del c8
        res["timings"].append(row)
        log(f"  {row}")
        del cache
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child-timeout", type=float, default=150.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile-only", action="store_true", help="compile the kernel for sm_90 (no GPU)")
    ap.add_argument("--sass-dir", default=None, help="with --compile-only: write the kernel's SASS and LLVM IR here")
    args = ap.parse_args()
    if args.compile_only:
        from gluon_sparse_mla_probe import compile_only
        from flashdsa.ops.sparse_mla.gluon_bf16 import compile_sm90
        return compile_only(compile_sm90, "gluon_bf16", args.sass_dir)
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gluon_prefill_probe.json"
    if args.child:
        def log(msg):
            print(msg, flush=True)
        path.write_text(json.dumps(run_child(log), indent=1))
        return 0
    path.unlink(missing_ok=True)
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, __file__, "--child"], timeout=args.child_timeout)
        status = f"exit {p.returncode}"
    except subprocess.TimeoutExpired:
        status = f"killed after {args.child_timeout:.0f} s (deadlock?)"
    print(f"== gluon_bf16: {status} in {time.time() - t0:.0f} s", flush=True)
    if not path.exists():
        return 1
    res = json.loads(path.read_text())
    print("\ncase | ok | gluon us | hot64 us | triton us | FlashMLA us | gluon/FlashMLA | gluon/triton")
    for t in res["timings"]:
        peer = t.get("flashmla_us") or t.get("flashmla_fp8_us")
        tri_us = t.get("triton_us")
        print(f"{t['case']} | {t['ok']} | {t['gluon_us']:.1f} | {t.get('gluon_hot64_us', float('nan')):.1f} | "
              f"{tri_us or float('nan'):.1f} | {peer or float('nan'):.1f} | "
              f"{t['gluon_us'] / peer if peer else float('nan'):.3f} | "
              f"{t['gluon_us'] / tri_us if tri_us else float('nan'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
