"""Probe of the Gluon sparse MLA decode kernel (flashdsa/ops/sparse_mla/gluon.py, issue #16) on one H200.

    PYTHONPATH=. python benchmarks/gluon_sparse_mla_probe.py [--child-timeout 150]
    PYTHONPATH=. python benchmarks/gluon_sparse_mla_probe.py --compile-only [--sass-dir D]   # no GPU

GPU run, in this order:
  1. Baselines in this process: our Triton default (``flashdsa.ops.sparse_mla.triton``) and FlashMLA
     (skipped when sgl-kernel's ops do not load) timed on the three decode shapes below, and the Triton
     default on the correctness cases (a yardstick for the Gluon kernel's errors).
  2. The shipped Gluon kernel in a child process (a deadlocked kernel only loses the child, killed after
     ``--child-timeout`` s): compile stats (n_regs / n_spills / shared / setmaxnreg), correctness on fresh
     random inputs against ``reference.py`` (outputs NaN-poisoned first, so unwritten elements fail; ``ok``
     is the Triton tests' tolerance, see :func:`check`), then the three timings (CUDA-graph replay, median;
     the big cases also checked on a few rows) and, for the first shape, "hot64" (every step on the same 64
     rows: the kernel without DRAM latency).
  3. The table last (case | Gluon us | hot64 us | Triton us | FlashMLA us | ratios), and JSON in
     $OUT/gluon_sparse_mla_probe.json.

--compile-only compiles the kernel for sm_90 with the Triton on the path and prints shared memory,
setmaxnreg budgets, ptxas spills, HGMMA / WARPGROUP.DEPBAR counts, named barriers and ptxas's
wgmma-serialisation notes (``--sass-dir``: its SASS and LLVM IR, with debug locations, too).

The schedules measured on the way to this kernel (sparse_mla/README.md lists what lost and by how much) are
in git history: gluon.py at e14c64d holds them as its ``VARIANTS`` table, and this probe at that commit
checks and times any of them (``--variants``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SM_SCALE = 576 ** -0.5
TIMING_CASES = [(64, 1, 128), (64, 2, 128), (128, 2, 64)]   # (B, s_q, h_q), topk 2048, 32K context


# ---- correctness inputs ---------------------------------------------------------------------------------

def edge_indices(R, topk, N, kind, gen, dev):
    """``[R, topk]`` indices into N rows with the edge cases of ``kind``: "full": every index a distinct valid
    row; "ragged": row r keeps a random number of valid rows (0 for row 0: all -1, topk for the last), the
    rest -1; "mixed": -1, -7 and >= N sprinkled over the list, duplicates allowed; "empty": every index -1;
    "nan0": distinct rows, never row 0 (the caller poisons it: a skipped index must not read it)."""
    lo = 1 if kind == "nan0" else 0
    idx = torch.stack([torch.randperm(N - lo, generator=gen, device=dev)[:topk] + lo for _ in range(R)])
    if kind == "ragged":
        keep = torch.randint(0, topk + 1, (R,), generator=gen, device=dev)
        keep[0] = 0
        keep[-1] = topk
        pos = torch.arange(topk, device=dev)
        idx = torch.where(pos[None, :] < keep[:, None], idx, -1)
    elif kind == "mixed":
        idx = torch.randint(0, N, (R, topk), generator=gen, device=dev)   # duplicates count twice
        r = torch.rand(R, topk, generator=gen, device=dev)
        idx = torch.where(r < 0.1, -1, idx)
        idx = torch.where((r >= 0.1) & (r < 0.15), -7, idx)
        idx = torch.where((r >= 0.15) & (r < 0.2), N + 5, idx)
    elif kind == "empty":
        idx = torch.full_like(idx, -1)
    return idx


def small_case(B, s_q, h_q, topk, kind, seed, dev):
    """(q, cache, indices) on a small pool (48 pages = 3072 slots) with the edge cases of ``kind``
    (:func:`edge_indices`; "nan0": slot 0 of the cache is NaN bytes, and 30 % of the indices are -1)."""
    from flashdsa.testing.inputs import mla_cache, randn
    gen = torch.Generator(device=dev).manual_seed(seed)
    P = 48
    cache = mla_cache(P, gen, dev)
    N = P * 64
    q = randn((B, s_q, h_q, 576), gen, dev, torch.bfloat16)
    R = B * s_q
    idx = edge_indices(R, topk, N, kind, gen, dev)
    if kind == "nan0":
        cache[0, 0, :] = 0xFF   # e4m3 NaN latent, NaN scales, NaN rope
        idx = torch.where(torch.rand(R, topk, generator=gen, device=dev) < 0.3, -1, idx)
    return q, cache, idx.view(B, s_q, topk).to(torch.int32).contiguous()


CORRECTNESS_CASES = [
    # (B, s_q, h_q, topk, kind)
    (2, 1, 64, 128, "ragged"),
    (2, 2, 128, 192, "ragged"),
    (3, 1, 64, 100, "mixed"),       # topk not a multiple of 64: the last step is partial
    (2, 2, 128, 128, "mixed"),
    (2, 1, 64, 64, "empty"),        # every row empty: out 0, lse -inf
    (2, 2, 64, 192, "nan0"),
    (4, 2, 128, 2048, "full"),
    (3, 1, 64, 2048, "ragged"),
    (2, 2, 128, 2048, "ragged"),
    (2, 1, 16, 128, "ragged"),      # beyond the brief: h_q < 64 (masked heads)
]


def check(out, lse, q, cache, idx, tol) -> dict:
    """Errors against the fp32 reference on the dequantised cache. ``ok``: the criterion of
    tests/ops/test_sparse_mla_triton.py (flashdsa.testing.compare.assert_close: NaN / inf positions equal,
    |out - ref| <= 1e-3 + 2.01/128 |ref|, cosine diff <= 5e-6; lse 1e-6 + 8.01/65536 |ref|; empty rows
    exactly 0). ``ref_ok`` (reported, not required): bench_sparse_mla.ref_check's stricter per-element
    "1e-3 abs OR 2/128 rel" rule, which bf16 P alone can break on short lists (see the Triton column)."""
    from bench_sparse_mla import ref_check
    from flashdsa.ops.sparse_mla import reference
    from flashdsa.testing.compare import assert_close
    ref_out, ref_lse = reference.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None)
    info = ref_check(out, lse, lambda qq, ii: (ref_out, ref_lse), q, idx, tol)
    fail = None
    try:
        assert_close(lse, ref_lse, name="lse", atol=1e-6, rtol=8.01 / 65536)
        assert_close(out, ref_out, name="out", atol=1e-3, rtol=2.01 / 128, max_cos_diff=5e-6)
    except AssertionError as e:
        fail = str(e)[:300]
    n_nan = int(torch.isnan(out.float()).sum()) + int(torch.isnan(lse).sum())
    empty = torch.isneginf(ref_lse)
    empty_ok = bool((out[empty].float() == 0).all()) and bool(torch.isneginf(lse[empty]).all())
    info.update(nan=n_nan, empty_rows=int(empty.any(-1).sum()), empty_ok=empty_ok)
    if fail:
        info["fail"] = fail
    info["ok"] = fail is None and n_nan == 0 and empty_ok
    return info


# ---- the child: the Gluon kernel -------------------------------------------------------------------------

def run_child(result_path: str) -> None:
    from _common import timed
    from bench_sparse_mla import DECODE_TOL, decode_inputs
    from flashdsa.ops.sparse_mla import gluon as G
    from flashdsa.testing.inputs import rows_subset
    dev = torch.device("cuda")
    res = {"cases": [], "timing": []}

    def save():
        with open(result_path, "w") as f:
            json.dump(res, f, indent=1)

    def say(msg):
        print(f"[gluon] {msg}", flush=True)

    t0 = time.time()
    try:
        q, cache, idx = small_case(2, 1, 64, 128, "full", 0, dev)
        k = G.compiled_kernel(q, cache, idx, SM_SCALE)
        torch.cuda.synchronize()
        res["compile"] = dict(n_regs=k.n_regs, n_spills=k.n_spills, shared=k.metadata.shared,
                              wgmma="wgmma" in k.asm["ptx"],
                              setmaxnreg=re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"]))
        say(f"compiled in {time.time() - t0:.1f} s: {res['compile']}")
    except Exception as e:  # noqa: BLE001
        res["compile_error"] = repr(e)[-2000:]
        say(f"compile FAILED: {e!r}"[:3000])
        save()
        return
    save()

    for seed, (B, s_q, h_q, topk, kind) in enumerate(CORRECTNESS_CASES):
        name = f"B{B} s_q{s_q} h{h_q} topk{topk} {kind}"
        try:
            q, cache, idx = small_case(B, s_q, h_q, topk, kind, 100 + seed, dev)
            out = torch.full((B, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=dev)
            lse = torch.full((B, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
            G.sparse_mla_decode_gluon(q, cache, idx, SM_SCALE, 512, out=out, lse=lse)
            torch.cuda.synchronize()
            info = check(out, lse, q, cache, idx, DECODE_TOL)
        except Exception as e:  # noqa: BLE001
            info = dict(ok=False, error=repr(e)[:300])
        res["cases"].append(dict(case=name, **info))
        say(f"{name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()))
        save()

    for B, s_q, h_q in TIMING_CASES:
        name = f"B{B} s_q{s_q} h{h_q} topk2048"
        try:
            q, cache, idx = decode_inputs(B, s_q, h_q, dev)
            out, lse = G.sparse_mla_decode_gluon(q, cache, idx, SM_SCALE)
            sub = rows_subset(B, 4, dev)
            torch.cuda.synchronize()
            info = check(out[sub], lse[sub], q[sub], cache, idx[sub], DECODE_TOL)
            us = timed(lambda: G.sparse_mla_decode_gluon(q, cache, idx, SM_SCALE), "cuda", True)
            row = dict(case=name, us=round(us, 1), **info)
            if (B, s_q, h_q) == TIMING_CASES[0]:
                # every step gathers the same 64 rows (L1 / L2 hits): the kernel without DRAM latency
                hot = (torch.arange(idx.shape[-1], device=dev, dtype=torch.int32) % 64).expand_as(idx).contiguous()
                row["hot64_us"] = round(timed(lambda: G.sparse_mla_decode_gluon(q, cache, hot, SM_SCALE), "cuda",
                                              True), 1)
        except Exception as e:  # noqa: BLE001
            row = dict(case=name, error=repr(e)[:300])
        res["timing"].append(row)
        say(f"time {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                                       if k != "case"))
        save()
        cache = q = idx = None
        torch.cuda.empty_cache()
    say(f"done in {time.time() - t0:.1f} s")


# ---- the parent --------------------------------------------------------------------------------------

def baselines(rows: dict) -> None:
    """Our Triton default and FlashMLA on the timing cases (this process)."""
    from _common import load_sgl_ops, timed
    from bench_sparse_mla import decode_inputs
    from flashdsa.ops.sparse_mla import triton as tri
    from flashdsa.testing.peers import flashmla_decode
    dev = torch.device("cuda")
    peer_ok = load_sgl_ops()
    for B, s_q, h_q in TIMING_CASES:
        name = f"B{B} s_q{s_q} h{h_q} topk2048"
        row = rows.setdefault(name, {"case": name})
        q, cache, idx = decode_inputs(B, s_q, h_q, dev)
        try:
            row["triton_us"] = round(timed(lambda: tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None), "cuda",
                                           True), 1)
        except Exception as e:  # noqa: BLE001
            row["triton_error"] = repr(e)[:200]
        if peer_ok:
            try:
                seqlens = torch.full((B,), 32768, dtype=torch.int32, device=dev)
                row["flashmla_us"] = round(timed(flashmla_decode(q, cache, idx, SM_SCALE, seqlens), "cuda", True), 1)
            except Exception as e:  # noqa: BLE001
                row["flashmla_error"] = repr(e)[:200]
        print(f"[baseline] {name}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k != "case"), flush=True)
        cache = q = idx = None
        torch.cuda.empty_cache()


def triton_on_cases() -> list[dict]:
    """Our Triton default on the correctness cases, judged the same way (a yardstick for the errors)."""
    from bench_sparse_mla import DECODE_TOL
    from flashdsa.ops.sparse_mla import triton as tri
    dev = torch.device("cuda")
    res = []
    for seed, (B, s_q, h_q, topk, kind) in enumerate(CORRECTNESS_CASES):
        name = f"B{B} s_q{s_q} h{h_q} topk{topk} {kind}"
        try:
            q, cache, idx = small_case(B, s_q, h_q, topk, kind, 100 + seed, dev)
            out, lse = tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None)
            torch.cuda.synchronize()
            info = check(out, lse, q, cache, idx, DECODE_TOL)
        except Exception as e:  # noqa: BLE001
            info = dict(ok=False, error=repr(e)[:300])
        res.append(dict(case=name, **info))
        print(f"[triton] {name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in info.items()), flush=True)
    return res


def run_parent(child_timeout: float) -> int:
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", end=" ")
    import triton
    print(f"triton {triton.__version__}", flush=True)
    rows: dict = {}
    try:
        baselines(rows)
    except Exception as e:  # noqa: BLE001 - the Gluon kernel still runs
        print(f"[baseline] FAILED: {e!r}"[:500], flush=True)
    try:
        triton_cases = triton_on_cases()
    except Exception as e:  # noqa: BLE001
        triton_cases = []
        print(f"[triton] correctness cases FAILED: {e!r}"[:500], flush=True)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        subprocess.run([sys.executable, __file__, "--child", "--result", path], timeout=child_timeout, check=False)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        print(f"[gluon] TIMED OUT (hang?) after {child_timeout:.0f} s", flush=True)
    try:
        with open(path) as f:
            r = json.load(f)
    except Exception:  # noqa: BLE001
        r = {}
    r["timed_out"] = timed_out
    # ---- the table
    print()
    for name, cases in (("gluon", r.get("cases", [])), ("triton (yardstick)", triton_cases)):
        n_ok = sum(1 for c in cases if c.get("ok"))
        n_strict = sum(1 for c in cases if c.get("ref_ok"))
        worst = max((c.get("ref_max_abs", 0.0) for c in cases), default=float("nan"))
        worst_cd = max((c.get("ref_cos_diff", 0.0) for c in cases), default=float("nan"))
        print(f"== {name}: correctness {n_ok}/{len(cases)} ok (strict per-element rule {n_strict}/{len(cases)}); "
              f"worst max_abs {worst:.3g}, worst cos_diff {worst_cd:.3g}")
        for c in cases:
            print(f"   {c['case']}: max_abs {c.get('ref_max_abs', float('nan')):.3g} ok {c.get('ok')} "
                  f"strict {c.get('ref_ok')}" + ("" if c.get("ok") else f" FAIL {c}"))
    print(f"== gluon compile: {r.get('compile', r.get('compile_error', '-'))}{' (TIMED OUT)' if timed_out else ''}")
    for t in r.get("timing", []):
        row = rows.setdefault(t["case"], {"case": t["case"]})
        row.update(gluon_us=t.get("us"), gluon_ok=t.get("ok"), gluon_hot64_us=t.get("hot64_us"))
    print("\n== sparse MLA decode fp8, topk 2048, H200: the Gluon kernel vs our Triton default and FlashMLA "
          "(us, CUDA-graph replay median; hot64: every step on the same 64 rows)")
    head = ["case", "gluon us", "ok", "hot64 us", "triton us", "FlashMLA us", "gluon/FlashMLA", "gluon/triton"]
    table = [head]
    for name, row in rows.items():
        g, fm, tr = row.get("gluon_us"), row.get("flashmla_us"), row.get("triton_us")
        row.update(gluon_over_flashmla=round(g / fm, 3) if g and fm else None,
                   gluon_over_triton=round(g / tr, 3) if g and tr else None)
        table.append([name] + [str(row.get(k)) for k in ("gluon_us", "gluon_ok", "gluon_hot64_us", "triton_us",
                                                         "flashmla_us", "gluon_over_flashmla", "gluon_over_triton")])
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for line in table:
        print(" | ".join(c.ljust(w) for c, w in zip(line, widths)))
    print(f"total {time.time() - t0:.0f} s")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gluon_sparse_mla_probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "gluon": r, "rows": list(rows.values()),
                       "triton_cases": triton_cases}, f, indent=1)
    return 0


# ---- no GPU: compile for sm_90 ---------------------------------------------------------------------------

def compile_only(compile_sm90, name: str, sass_dir: str | None = None) -> int:
    """Compile a Gluon kernel for sm_90 (no GPU; ``compile_sm90``: its module's, gluon.py's here, gluon_bf16.py's
    from the prefill probe) and report what ptxas made of it; ``sass_dir``: also write its SASS and LLVM IR
    there as ``name``.sass / .llir."""
    import triton
    from sass_report import gluon_report
    print(f"triton {triton.__version__} ({triton.__file__})")
    print(gluon_report(compile_sm90(), name, sass_dir))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child-timeout", type=float, default=150.0)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--sass-dir", default=None, help="with --compile-only: write the kernel's SASS and LLVM IR here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile_only:
        from flashdsa.ops.sparse_mla.gluon import compile_sm90
        return compile_only(compile_sm90, "gluon", args.sass_dir)
    if args.child:
        run_child(args.result)
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --compile-only)")
        return 1
    return run_parent(args.child_timeout)


if __name__ == "__main__":
    sys.exit(main())
