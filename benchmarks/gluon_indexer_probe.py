"""The Gluon paged indexer (``flashdsa/ops/indexer/gluon.py``, issue #17) on the H200: its shipped launch checked
against the reference, then timed (CUDA-graph replay) next to our Triton kernel and DeepGEMM in the same run.

    PYTHONPATH=. python benchmarks/gluon_indexer_probe.py [--cases quick|full] [--host]
    PYTHONPATH=/path/to/triton-3.6:. python benchmarks/gluon_indexer_probe.py --compile-only [--sass-dir D]   # no GPU
    ncu ... python benchmarks/gluon_indexer_probe.py --profile 2

Correctness first, on small ragged batches (lengths 0, 1, 63, 64, 65, several chunks and several items a
CTA, junk in the block table past each row's reach, NaN-poisoned outputs): the exact -inf pattern and max
|err| relative to the largest logit (<= 1e-3: Hopper's fp8 accumulation). Then the timed cases: B 64, ctx
~U(0.7, 1.3) x 32K (``--cases full``: also 8K and B 128), next_n 1..4, the Gluon kernel's default launch
against ours (Triton default) and DeepGEMM (n <= 2). JSON: $OUT/gluon_indexer_probe.json when $OUT is set.
``--host``: the host cost of plain calls instead. --compile-only compiles every next_n for sm_90 with the
Triton on the path and prints shared memory, setmaxnreg budgets, ptxas spills and QGMMA / DEPBAR counts.

The variants measured against the shipped schedule (and the knobs this probe once took to time them) live in
git history; flashdsa/ops/indexer/README.md lists them with their numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

D, H = 128, 64


def compile_only(ns=(1, 2, 3, 4), sass_dir: str | None = None) -> int:
    """Compile for sm_90 (no GPU) and report what ptxas made of it (``sass_dir``: also write each next_n's SASS
    and PTX there)."""
    import triton
    from sass_report import gluon_report

    from flashdsa.ops.indexer import gluon as G
    print(f"triton {triton.__version__} ({triton.__file__})")
    for n in ns:
        try:
            k = G.compile_sm90(n)
        except Exception as e:  # noqa: BLE001
            print(f"n{n}: FAILED {type(e).__name__}: " + " | ".join(str(e).splitlines()[-3:])[-800:])
            continue
        print(gluon_report(k, f"n{n}", sass_dir, ir="ptx"))
    return 0


# ---- GPU ------------------------------------------------------------------------------------------------------

def _small_case(B, n, lens_list, P_extra=5, seed=0):
    """A ragged batch with explicit lengths (row j of request b: lens_list[b] - n + 1 + j, clamped at 0) and
    junk page ids past each request's pages."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    seq = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
    pages = [(int(s) + 63) // 64 for s in lens_list]
    maxp = max(max(pages), 1) + 2
    P = sum(pages) + P_extra
    perm = torch.randperm(P, generator=g, device="cuda").to(torch.int32)
    bt = torch.full((B, maxp), 2 ** 30, dtype=torch.int32, device="cuda")   # junk past the reach
    o = 0
    for b in range(B):
        bt[b, :pages[b]] = perm[o:o + pages[b]]
        o += pages[b]
    cache = torch.randint(0, 256, (P, 8448), dtype=torch.uint8, device="cuda", generator=g)
    keys = cache[:, :8192].view(P, 64, D)
    keys.copy_((torch.randn(P, 64, D, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn).view(torch.uint8))
    cache[:, 8192:].view(torch.float32).copy_(torch.rand(P, 64, device="cuda", generator=g) + 0.01)
    ctx = (seq[:, None] - n + 1 + torch.arange(n, device="cuda")[None, :]).clamp(min=0).to(torch.int32)
    q = (torch.randn(B, n, H, D, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    w = torch.randn(B * n, H, device="cuda", generator=g)
    return q, cache, w, ctx, bt, maxp * 64


def _check(out, ref):
    inf_ok = torch.equal(torch.isneginf(out), torch.isneginf(ref)) and not torch.isnan(out).any()
    fin = torch.isfinite(ref)
    scale = ref[fin].abs().max().clamp(min=1e-30) if fin.any() else torch.tensor(1.0)
    err = float((out - ref)[fin].abs().max() / scale) if fin.any() else 0.0
    return inf_ok, err


def run_profile(n: int) -> int:
    """One case (B 64, ctx ~32K, next_n n), the Gluon kernel launched 3 times (for ncu: no checks, no peers)."""
    from bench_indexer import _paged_case

    from flashdsa.ops.indexer import gluon as G
    c = _paged_case(64, n, 32768)
    a = (c["q_fp8"], c["cache"], c["w"], c["ctx"], c["bt"], c["max_len"])
    out = torch.empty(64 * n, c["max_len"], device="cuda")
    grid, kw = G.kernel_args(*a, out)
    for _ in range(3):
        G.indexer_paged_ws_kernel[grid](**kw)
    torch.cuda.synchronize()
    return 0


def run_gpu(args) -> int:
    from flashdsa.ops.indexer import gluon as G
    from flashdsa.ops.indexer import paged as KP
    from flashdsa.ops.indexer import reference
    from flashdsa.testing.peers import deepgemm_paged, import_deep_gemm
    rows = []
    ok_all = True
    # correctness: lengths 0, 1, 63, 64, 65, 200, 1000 with small chunks over few CTAs (several items a CTA, the
    # rings' phases wrapping, fills) and the default chunks
    for n in (1, 2, 3, 4):
        for cp, max_ctas in ((1, 3), (2, None), (None, None), (1, 2), (2, 5), (4, 3)):
            lens = [0, 1, 63, 64, 65, 200, 1000, 777]
            q, cache, w, ctx, bt, max_len = _small_case(len(lens), n, lens, seed=n)
            out = torch.full((len(lens) * n, max_len), float("nan"), device="cuda")
            grid, kw = G.kernel_args(q, cache, w, ctx, bt, max_len, out, chunk_pages=cp, max_ctas=max_ctas)
            G.indexer_paged_ws_kernel[grid](**kw)
            torch.cuda.synchronize()
            ref = reference.indexer_logits_paged(q, cache, w, ctx, bt, max_len)
            inf_ok, err = _check(out, ref)
            ok = inf_ok and err < 1e-3   # Hopper's fp8 wgmma accumulates in less than fp32 (~2e-4)
            ok_all &= ok
            print(f"check n{n} chunk_pages {cp} max_ctas {max_ctas}: -inf pattern {inf_ok}, max rel err {err:.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
            rows.append(dict(kind="check", n=n, chunk_pages=cp, max_ctas=max_ctas, inf_ok=inf_ok, err=err))
    # timing
    from bench_indexer import _graph_time, _paged_case
    dg, why = import_deep_gemm()
    if dg is None:
        print(f"DeepGEMM absent ({why}): its column stays empty", flush=True)
    cases = [(64, 1, 32768), (64, 2, 32768), (64, 3, 32768), (64, 4, 32768)]
    if args.cases == "full":
        cases = [(64, 1, 8192), (64, 2, 8192)] + cases + [(128, 1, 32768)]
    table = []
    for B, n, avg in cases:
        c = _paged_case(B, n, avg)
        a = (c["q_fp8"], c["cache"], c["w"], c["ctx"], c["bt"], c["max_len"])
        ref = KP.indexer_logits_paged(*a)   # the Triton kernel (checked against the reference in its tests)
        t_tri = _graph_time(lambda: KP.indexer_logits_paged(*a))
        t_dg = None
        if dg is not None and n <= 2:
            call = deepgemm_paged(*a)
            call()
            t_dg = _graph_time(call)
        out = torch.full_like(ref, float("nan"))
        grid, kw = G.kernel_args(*a, out)
        G.indexer_paged_ws_kernel[grid](**kw)
        torch.cuda.synchronize()
        inf_ok, err = _check(out, ref)
        t = _graph_time(lambda: G.indexer_paged_ws_kernel[grid](**kw))
        cfg = f"cp{kw['CHUNK_PAGES']} nc{kw['NC']} dp{kw['DP']} b{kw['NBUF']} grid{grid[0]}" + " pta" * kw["PTA"]
        r = dict(kind="time", B=B, n=n, ctx=avg, cfg=cfg, inf_ok=inf_ok, err_vs_triton=err,
                 gluon_us=t, triton_us=t_tri, deepgemm_us=t_dg)
        rows.append(r)
        table.append(r)
        print(r, flush=True)
        del c, a, ref
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gluon_indexer_probe.json").write_text(json.dumps(rows, indent=1))
    print("\ncase             | config                       | gluon us | triton us | DeepGEMM us | gluon/DG | gluon/triton | ok")
    for r in table:
        g_, t_, d_ = r["gluon_us"], r["triton_us"], r["deepgemm_us"]
        print(f"B{r['B']} n{r['n']} ctx~{r['ctx'] // 1024}K".ljust(17) + f"| {r['cfg']:28} | {g_:8.1f} | "
              f"{t_:9.1f} | " + (f"{d_:11.1f} | {g_ / d_:8.3f}" if d_ else f"{'-':>11} | {'-':>8}")
              + f" | {g_ / t_:12.3f} | {r['inf_ok'] and r['err_vs_triton'] < 1e-3}")
    print("correctness:", "all ok" if ok_all else "FAILURES")
    return 0 if ok_all else 1


def run_host(calls: int = 100) -> int:
    """Host µs of one plain call (the GPU kept busy, ``host_cost.HostTimer``), B 64 ctx ~32K, next_n 1 / 2 / 4:
    the Gluon kernel's own entry (a JIT launch with new descriptors), the public op with the default (device)
    checks (the Triton kernel with its in-kernel checks; from next_n 4 on the check kernel, then the Gluon
    kernel), the public op with checks off (from next_n 4 on: the Gluon kernel alone), the same forced to
    Triton, and DeepGEMM."""
    from bench_indexer import _paged_case

    from flashdsa import ops
    from flashdsa._checks import value_check_setting
    from flashdsa.ops.indexer import gluon as G
    from flashdsa.testing.host_cost import HostTimer
    from flashdsa.testing.peers import deepgemm_paged, import_deep_gemm
    timer = HostTimer("cuda", calls)
    dg, _ = import_deep_gemm()
    cols = ("gluon entry", "op, checks on", "op, checks off", "op, triton, checks off", "deepgemm")
    print("\nhost us a plain call, best (median) of the batches | " + " | ".join(cols))
    for n in (1, 2, 4):
        c = _paged_case(64, n, 32768)
        a = (c["q_fp8"], c["cache"], c["w"], c["ctx"], c["bt"], c["max_len"])
        fns = {"gluon entry": lambda: G.indexer_logits_paged_gluon(*a),
               "op, checks on": lambda: ops.indexer_logits_paged(*a),
               "op, checks off": lambda: ops.indexer_logits_paged(*a),
               "op, triton, checks off": lambda: ops.indexer_logits_paged(*a, backend="triton")}
        if dg is not None and n <= 2:
            fns["deepgemm"] = deepgemm_paged(*a)
        setting = value_check_setting()
        try:   # the default (device) checks for "op, checks on" only; every other column runs without
            r = timer.interleaved(fns, before=lambda key: ops.set_value_checks(key == "op, checks on"))
        finally:
            ops.set_value_checks(setting)
        # best (median of the batches): a median far above the best says more than the host's load was timed
        cell = {k: f"{v[0]:.1f} ({statistics.median(timer.batches[k]):.1f})"
                + ("" if v[1] else " (GPU idle: not host-bound)") for k, v in r.items()}
        print(f"B64 n{n} ctx~32K | " + " | ".join(cell.get(k, "-") for k in cols), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--sass-dir", default=None, help="with --compile-only: write the SASS / PTX here")
    ap.add_argument("--profile", type=int, default=0, help="next_n: only launch that case 3 times (for ncu)")
    ap.add_argument("--cases", default="quick", choices=["quick", "full"])
    ap.add_argument("--host", action="store_true", help="only the host cost of plain calls (bench_host's timer)")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(sass_dir=args.sass_dir)
    if args.profile:
        return run_profile(args.profile)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --compile-only)")
        return 1
    return run_host() if args.host else run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
