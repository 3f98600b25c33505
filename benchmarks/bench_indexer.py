"""Indexer logits, ours (Triton) vs DeepGEMM on DeepGEMM's test shapes, checked before they are timed.

    PYTHONPATH=. python benchmarks/bench_indexer.py [--quick] [--sweep] [--only paged|ragged] [--smoke]

Paged (decode / MTP verify): H 64, D 128, B requests with context ~U(0.7, 1.3) * avg (DeepGEMM's
generator), verify lengths ``seq - n + j + 1`` per draft row, pages shuffled over the pool. The cache is
built once in our 8448-B layout and handed to DeepGEMM as the same bytes viewed ``[P, 64, 1, 132]``;
its schedule metadata is made outside the timed region (once per batch in an engine). DeepGEMM runs
next_n 1 and 2 only (Hopper asserts next_n <= 2); n 3 / 4 are ours alone, compared with our n = 2.

Ragged (prefill): q [sq, 64, 128] against skv keys, ks = 0, ke = i + skv - sq (DeepGEMM's test ranges:
row i sees the skv - sq prefix keys plus the i earlier tokens). TFLOP/s count valid (q, key) pairs only,
2 * pairs * H * D, as DeepGEMM counts; GB/s count q + w + keys read + valid logits written, as DeepGEMM
counts (our kernel also writes -inf past each length: "roof us" is the copy-bandwidth time of all our
bytes).

Times: ``ours_us`` / ``dg_us`` are do_bench medians (L2 flushed before each call; the host launch is
inside the timed region whenever it outlasts the flush, which our Python launcher can at 8K contexts);
``graph_us`` / ``dg_graph_us`` replay 20 back-to-back calls from one CUDA graph (no host launch cost, no
L2 flush: how an engine runs decode).

Checks per case, before timing: exact -inf pattern and cosine diff against our torch reference, i.e.
fp32 math on the dequantised inputs (paged: every row; ragged: a subsample of rows), bitwise-identical
repeat, cosine diff against DeepGEMM inside each row's valid range, and (information: the fp8
quantisation error, DeepGEMM's test bar is < 1e-3) cosine diff against fp32 math on the unquantised
bf16 inputs. ``--sweep`` times a few launch shapes of ours (results go to
the table; the defaults live in flashdsa/ops/indexer/paged_config.py / ragged.py: PagedConfig / RaggedConfig).
``--smoke`` runs the same code on tiny shapes (on CPU through the Triton interpreter when there is no
GPU) to check the script itself; its times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from _common import load_deep_gemm, print_table, timed, write_json

from flashdsa.cache.layouts import INDEX_BYTES_PER_TOKEN, index_page_views
from flashdsa.ops.indexer import reference
from flashdsa.ops.indexer import paged as KP
from flashdsa.ops.indexer import ragged as KR
from flashdsa.quant import FP8, act_quant
from flashdsa.testing.compare import cos_diff, masked_cos_diff
from flashdsa.testing.inputs import paged_batch
from flashdsa.testing.peers import deepgemm_paged, deepgemm_ragged
from flashdsa.testing.timing import capture_graph

H, D = 64, 128
COPY_BPS = 4.27e12  # the H200's measured copy bandwidth (anchors/h200-2026-11-29.json)

PAGED = [  # (B, next_n, avg context)
    (64, 1, 8192), (64, 1, 32768), (64, 1, 65536),
    (64, 2, 8192), (64, 2, 32768), (64, 2, 65536),
    (64, 3, 32768), (64, 4, 32768),
    (128, 1, 8192), (128, 1, 32768), (128, 1, 65536),
]
PAGED_QUICK = [(64, 1, 32768), (64, 2, 32768), (64, 4, 32768)]
RAGGED = [(4096, 4096), (4096, 16384), (8192, 32768)]
RAGGED_QUICK = [(4096, 16384)]
PAGED_SMOKE = [(3, 1, 200), (3, 2, 200), (2, 4, 150)]
RAGGED_SMOKE = [(40, 100)]
DEV = "cuda"


def _graph_time(fn, reps: int = 20) -> float | None:
    """Median µs per call of ``reps`` back-to-back calls replayed from one CUDA graph: no host launch cost
    (how an engine runs decode) and no L2 flush between calls. None if the call cannot be captured."""
    if DEV != "cuda":
        return None
    try:
        g = capture_graph(fn, reps)
        ts = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / reps)
        return sorted(ts)[2]
    except Exception as e:  # noqa: BLE001 - a peer that cannot be captured just loses the column
        print(f"[graph] capture failed: {e!r}"[:200])
        return None


def _quantise_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, 128] bf16 -> e4m3 [N, 128], scale [N] f32`` in slices (act_quant's temporaries are 5x the input)."""
    out, sc = torch.empty(k.shape, dtype=FP8, device=k.device), torch.empty(k.shape[0], device=k.device)
    step = 1 << 22
    for i in range(0, k.shape[0], step):
        f, s = act_quant(k[i:i + step], block=128, ue8m0=False)  # DeepGEMM's test: amax / 448 a token
        out[i:i + step], sc[i:i + step] = f, s[:, 0]
    return out, sc


def _paged_case(B: int, n: int, avg: int, seed: int = 0) -> dict:
    dev = DEV
    g = torch.Generator(device=dev).manual_seed(seed)
    seq, bt, P = paged_batch(B, avg, n, g, dev)
    k_bf16 = torch.randn(P * 64, D, generator=g, device=dev, dtype=torch.bfloat16)
    k_fp8, k_s = _quantise_keys(k_bf16)
    cache = torch.empty(P, 8448, dtype=torch.uint8, device=dev)
    keys, scales = index_page_views(cache)
    keys.copy_(k_fp8.view(P, 64, D))
    scales.copy_(k_s.view(P, 64))
    del k_fp8, k_s
    ctx = (seq[:, None] - n + 1 + torch.arange(n, device=dev)[None, :]).to(torch.int32)
    q_bf16 = torch.randn(B, n, H, D, generator=g, device=dev, dtype=torch.bfloat16)
    q_fp8 = q_bf16.to(FP8)
    w = torch.randn(B * n, H, generator=g, device=dev)
    return dict(seq=seq, bt=bt, k_bf16=k_bf16, cache=cache, ctx=ctx, q_bf16=q_bf16,
                q_fp8=q_fp8, w=w, max_len=bt.shape[1] * 64, P=P)


def _check_paged(c: dict, out: torch.Tensor, n: int) -> dict:
    ref = reference.indexer_logits_paged(c["q_fp8"], c["cache"], c["w"], c["ctx"], c["bt"], c["max_len"])
    inf_ok = torch.equal(torch.isneginf(out), torch.isneginf(ref)) and not torch.isnan(out).any()
    fin = torch.isfinite(ref)
    err = float((out - ref)[fin].abs().max() / ref[fin].abs().max())
    # fp32 on the unquantised bf16 inputs, a few requests (the quantisation error, DeepGEMM's < 1e-3 bar)
    worst = 0.0
    for b in range(0, c["seq"].shape[0], max(1, c["seq"].shape[0] // 4)):
        L = int(c["seq"][b])
        pages = c["bt"][b, :(L + 63) // 64].long()
        k = c["k_bf16"].view(-1, 64, D)[pages].reshape(-1, D)[:L].float()
        s = torch.einsum("jhd,nd->jhn", c["q_bf16"][b].float(), k).relu()
        want = torch.einsum("jhn,jh->jn", s, c["w"][b * n:(b + 1) * n])
        worst = max(worst, masked_cos_diff(out[b * n:(b + 1) * n, :L], want, fin[b * n:(b + 1) * n, :L]))
    return {"inf_pattern": inf_ok, "cos_ref": cos_diff(out, ref), "max_err_rel": err, "cos_unquant": worst}


def run_paged(cases, dg, rows: list[dict], sweep: bool) -> None:
    ours_n2 = {}
    for B, n, avg in cases:
        t0 = time.time()
        c = _paged_case(B, n, avg)
        args = (c["q_fp8"], c["cache"], c["w"], c["ctx"], c["bt"], c["max_len"])
        out = KP.indexer_logits_paged(*args)
        row = {"case": f"paged B{B} n{n} ctx~{avg // 1024}K", **_check_paged(c, out, n)}
        row["bitwise_repeat"] = torch.equal(out.view(torch.int32), KP.indexer_logits_paged(*args).view(torch.int32))
        sum_lens = int(c["ctx"].sum())                      # scored (row, position) pairs
        kv_bytes = int(c["seq"].sum()) * INDEX_BYTES_PER_TOKEN  # each key read once per request
        dg_bytes = c["q_fp8"].numel() + c["w"].numel() * 4 + kv_bytes + 4 * sum_lens
        our_bytes = c["q_fp8"].numel() + c["w"].numel() * 4 + kv_bytes + out.numel() * 4
        t = timed(lambda: KP.indexer_logits_paged(*args), DEV)
        row.update({"ours_us": t, "GB/s": dg_bytes / t / 1e3, "TFLOP/s": 2 * sum_lens * H * D / t / 1e6,
                    "roof_us": our_bytes / COPY_BPS * 1e6, "graph_us": _graph_time(lambda: KP.indexer_logits_paged(*args))})
        if n == 2:
            ours_n2[(B, avg)] = t, row["graph_us"]
        if n > 2 and (B, avg) in ours_n2:
            row["vs_ours_n2"] = t / ours_n2[(B, avg)][0]
            if row["graph_us"] and ours_n2[(B, avg)][1]:
                row["graph vs_ours_n2"] = row["graph_us"] / ours_n2[(B, avg)][1]
        if dg is None:
            row["note"] = "DeepGEMM absent"
        elif n > 2:
            row["note"] = "DeepGEMM: next_n <= 2 on Hopper"
        else:
            dg_call = deepgemm_paged(*args)
            dg_out = dg_call()
            valid = torch.arange(c["max_len"], device=DEV)[None, :] < c["ctx"].view(-1, 1)
            row["cos_dg"] = masked_cos_diff(out, dg_out.float(), valid)
            td = timed(dg_call, DEV)
            row.update({"dg_us": td, "ours/dg": t / td, "dg_graph_us": _graph_time(dg_call)})
            if row["graph_us"] and row["dg_graph_us"]:
                row["graph ours/dg"] = row["graph_us"] / row["dg_graph_us"]
        if sweep:
            _sweep_paged(c, args, t, rows, row["case"])
        row["setup_s"] = time.time() - t0
        rows.append(row)
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del c, out
        if DEV == "cuda":
            torch.cuda.empty_cache()


def _shapes(G: int, HP: int, stages: tuple[int, ...], chunk: int | None = None, bn_default: int = 64):
    """Ragged: (block_n, num_warps, num_stages, chunk), every step shape whose fp32 accumulator fits 128
    registers a thread."""
    return [(bn, nw, ns, chunk) for bn in (64, 128) for nw in (4, 8) for ns in stages
            if bn * G * HP // (32 * nw) <= 128]


def _paged_shapes(G: int, HP: int, tma: bool) -> list[KP.PagedConfig]:
    """Paged, either kernel: block_n {64, 128} x rows per dot (1, 2 or 4 dots a step) with an accumulator of
    <= 128 registers a thread (TMA: or one 256-column dot over 8 warps) x 6 / 8 stages x ~8 / 16 programs
    a SM; the pointer kernel also with the fma-chain head sum, the TMA kernel also storing through tl.store."""
    out = []
    for bn in (64, 128):
        for GS in sorted({G, max(1, G // 2), max(1, G // 4)}):
            warps = 8 if tma and GS * HP == KP.MAX_DOT_N else 4
            if bn * GS * HP // (32 * warps) > 128:
                continue
            for ns in (6, 8):
                for pps in (8, 16):
                    base = {"block_n": bn, "sub_rows": GS, "num_stages": ns, "programs_per_sm": pps,
                            "num_warps": warps, "tma": tma}
                    if tma:
                        out += [KP.PagedConfig(**base), KP.PagedConfig(**base, asm_store=False)]
                    else:
                        out += [KP.PagedConfig(**base, chain=c) for c in ((False, True) if HP == 64 else (False,))]
    return out


def _sweep_paged(c, args, t_default, rows, name):
    base = KP.indexer_logits_paged(*args)
    B, n, Hq, _ = c["q_fp8"].shape
    shape = KP.paged_config(B, n, Hq, c["max_len"], c["q_fp8"].device)
    for tma in (True, False):
        for cfg in _paged_shapes(shape.G, shape.HP, tma):
            out = KP.indexer_logits_paged(*args, config=cfg)
            ok = torch.equal(torch.isneginf(out), torch.isneginf(base)) and cos_diff(out, base) < 1e-9
            t = timed(lambda: KP.indexer_logits_paged(*args, config=cfg), DEV, warmup_ms=10, rep_ms=40)
            desc = (f"{'tma' if tma else 'ptr'} bn{cfg.block_n} rows/dot {cfg.sub_rows} w{cfg.num_warps} "
                    f"s{cfg.num_stages} pps{cfg.programs_per_sm}"
                    + (f" {'chain' if cfg.chain else 'sum'}" if not tma else "" if cfg.asm_store else " tl.store"))
            rows.append({"case": f"sweep {name}", "config": desc, "ours_us": t, "vs_default": t / t_default,
                         "same_logits": ok})


def run_ragged(cases, dg, rows: list[dict], sweep: bool) -> None:
    dev = DEV
    for sq, skv in cases:
        t0 = time.time()
        g = torch.Generator(device=dev).manual_seed(sq + skv)
        q_bf16 = torch.randn(sq, H, D, generator=g, device=dev, dtype=torch.bfloat16)
        q_fp8 = q_bf16.to(FP8)
        kv = torch.randn(skv, D, generator=g, device=dev, dtype=torch.bfloat16)
        k_fp8, k_s = _quantise_keys(kv)
        w = torch.randn(sq, H, generator=g, device=dev)
        ks = torch.zeros(sq, dtype=torch.int32, device=dev)
        ke = (torch.arange(sq, device=dev) + skv - sq).to(torch.int32)
        args = (q_fp8, k_fp8, k_s, w, ks, ke)
        out = KR.indexer_logits_ragged(*args)
        sub = torch.arange(0, sq, 61, device=dev)
        ref = reference.indexer_logits_ragged(q_fp8[sub], k_fp8, k_s, w[sub], ks[sub], ke[sub])
        o = out[sub]
        fin = torch.isfinite(ref)
        s = torch.einsum("thd,nd->thn", q_bf16[sub].float(), kv.float()).relu()
        want = torch.einsum("thn,th->tn", s, w[sub])
        del s
        row = {"case": f"ragged {sq}x{skv}",
               "inf_pattern": torch.equal(torch.isneginf(o), torch.isneginf(ref)) and not torch.isnan(out).any(),
               "cos_ref": cos_diff(o, ref), "max_err_rel": float((o - ref)[fin].abs().max() / ref[fin].abs().max()),
               "cos_unquant": masked_cos_diff(o, want, fin),
               "bitwise_repeat": torch.equal(out.view(torch.int32), KR.indexer_logits_ragged(*args).view(torch.int32))}
        del ref, want, o
        pairs = int((ke - ks).clamp(min=0).sum())
        flops = 2 * pairs * H * D
        t = timed(lambda: KR.indexer_logits_ragged(*args), DEV)
        our_bytes = q_fp8.numel() + w.numel() * 4 + skv * (D + 4) + out.numel() * 4
        row.update({"ours_us": t, "TFLOP/s": flops / t / 1e6, "roof_us": our_bytes / COPY_BPS * 1e6})
        if dg is None:
            row["note"] = "DeepGEMM absent"
        else:
            dg_call = deepgemm_ragged(*args)
            dg_out = dg_call()
            valid = torch.isfinite(out)
            row["cos_dg"] = masked_cos_diff(out, dg_out.float(), valid)
            row["dg_inf_same"] = torch.equal(torch.isneginf(dg_out), torch.isneginf(out))
            del dg_out
            td = timed(dg_call, DEV)
            row.update({"dg_us": td, "ours/dg": t / td, "dg_TFLOP/s": flops / td / 1e6})
        if sweep:
            _sweep_ragged(args, out, t, rows, row["case"])
        row["setup_s"] = time.time() - t0
        rows.append(row)
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del out, q_bf16, kv
        if DEV == "cuda":
            torch.cuda.empty_cache()


def _sweep_ragged(args, base, t_default, rows, name):
    for G in (2, 4, 8):
        for bn, nw, ns, _ in _shapes(G, H, (3, 4)):
            cfg = KR.RaggedConfig(block_n=bn, rows=G, num_warps=nw, num_stages=ns)
            out = KR.indexer_logits_ragged(*args, config=cfg)
            ok = torch.equal(torch.isneginf(out), torch.isneginf(base)) and cos_diff(out, base) < 1e-9
            t = timed(lambda: KR.indexer_logits_ragged(*args, config=cfg), DEV, warmup_ms=10, rep_ms=40)
            rows.append({"case": f"sweep {name}", "config": f"bn{bn} G{G} w{nw} s{ns}", "ours_us": t,
                         "vs_default": t / t_default, "same_logits": ok})
            del out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a one-minute subset")
    ap.add_argument("--sweep", action="store_true", help="also time a few launch shapes of ours (slow)")
    ap.add_argument("--only", choices=("paged", "ragged"), default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (CPU ok)")
    a = ap.parse_args()
    global DEV
    if not torch.cuda.is_available():
        if not a.smoke:
            raise SystemExit("needs a CUDA GPU (or --smoke)")
        DEV = "cpu"
    import triton
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    print(f"{name} | torch {torch.__version__} | triton {triton.__version__}")
    dg = load_deep_gemm() if DEV == "cuda" else None
    rows: list[dict] = []
    paged = PAGED_SMOKE if a.smoke else PAGED_QUICK if a.quick else PAGED
    ragged = RAGGED_SMOKE if a.smoke else RAGGED_QUICK if a.quick else RAGGED
    if a.only in (None, "paged"):
        run_paged(paged, dg, rows, a.sweep)
    if a.only in (None, "ragged"):
        run_ragged(ragged, dg, rows, a.sweep)
    write_json(rows, "bench_indexer")
    main_rows = [r for r in rows if not r["case"].startswith("sweep")]
    sweep_rows = [r for r in rows if r["case"].startswith("sweep")]
    if sweep_rows:
        print_table(sweep_rows, "launch-shape sweep (ours)")
    cols = ("case", "ours_us", "dg_us", "ours/dg", "vs_ours_n2", "graph_us", "dg_graph_us", "graph ours/dg",
            "graph vs_ours_n2", "GB/s", "TFLOP/s", "dg_TFLOP/s", "roof_us", "inf_pattern", "cos_ref", "cos_unquant",
            "cos_dg", "bitwise_repeat", "note")
    print_table([{k: r[k] for k in cols if k in r} for r in main_rows],
                "indexer logits: ours (Triton) vs DeepGEMM, H 64, D 128 (ours/dg < 1: ours faster)")


if __name__ == "__main__":
    main()
