"""``flashdsa bench``: our ops timed next to the peers that import, at docs/DSA.md §9's shapes, checked first.

Cases (``--quick`` keeps those marked Q; the sweeps feed the plot):

    indexer     paged logits B 64, next_n 1, context ~U(0.7, 1.3) x {4K Q, 8K, 16K Q, 32K Q, 64K Q, 128K}
                paged logits B 64, next_n 2, context ~32K Q                       peer: DeepGEMM paged
                paged logits B 64, next_n 4, context ~32K (the Gluon kernel on sm_90)   peer: none
                ragged logits 4096 x 16384 Q, 8192 x 32768                        peer: DeepGEMM ragged
    topk        top-2048 of [64, 32K] Q, [64, 128K], [4096, 8K], [4096, 32K] Q      peers: fast_topk, torch.topk
    selection   decode selection: paged logits -> top-2048 -> physical slots, B 64, next_n 1, context
                ~U(0.7, 1.3) x {8K Q, 32K Q, 128K}, as one chain (issue #17's bar)
                                          peer: DeepGEMM paged -> sgl-kernel fast_topk_transform_fused
    sparse_mla  decode fp8 656, B 64, s_q 1, h_q 128, top-2048, context {4K Q, 16K Q, 32K Q, 64K Q}
                (top-k fixed, so the time is flat in context)                     peer: FlashMLA decode
                full run also: fp8 B 64 s_q 2 h_q 128 and B 128 s_q 2 h_q 64, and bf16 pages B 64 h_q 128 and
                B 128 s_q 2 h_q 64 (FlashMLA reads fp8 pages of the same tokens: it has no bf16-cache sparse
                decode), 32K Q
                prefill bf16, T 4096, h_q 128, top-2048 over 8K Q / 32K keys      peer: FlashMLA prefill
    layer       one V3.2 decode step of one layer the way flashdsa.engine runs it (paged indexer -> top-k
                with slot translation -> sparse decode), B 64 at context 8K and 32K Q, split into indexer /
                top-k / attention / whole step; the step's peer is DeepGEMM + fast_topk_transform_fused (fast_topk,
                untranslated, where the sgl-kernel build lacks it) + FlashMLA in a row
    host        host µs of one plain (eager) call of each public op at the V3.2 decode shapes, B 64, context
                8K and 32K Q, with the GPU kept busy so only the launch path counts, and the plain-call decode
                step against its CUDA-graph replay (flashdsa.testing.host_cost; issue #18's targets as PASS /
                FAIL lines, which do not change the exit code)      peers: DeepGEMM, fast_topk_v2, FlashMLA

Inputs are random (never zeros), built on the device in our byte layouts (flashdsa.testing.inputs): DeepGEMM
reads our indexer pages viewed ``[P, 64, 1, 132]``, FlashMLA our 656-B pages viewed ``[P, 64, 1, 656]``.
Before timing, ours is compared with the torch reference (``backend="torch"``) on the same inputs (a
subsample of rows for big shapes): logits need the same -inf pattern and cosine diff <= 1e-6, top-k the
same bits, attention cosine diff <= 1e-5 and |lse diff| <= 1e-3. Peers are compared with ours too
(information). Times: median µs of ``triton.testing.do_bench`` over a CUDA-graph replay of one call
(``--no-graph``: the plain call), value checks off (the production decode setting). ``roof_us`` =
max(bytes / copy bandwidth, FLOPs / matmul rate) with both ceilings measured on the card in the same run;
bytes and FLOPs count valid work only.

Peers load when they import: ``deep_gemm``; sgl-kernel's ops (FlashMLA sparse decode / prefill,
fast_topk) from ``import sgl_kernel`` or from the ``*.so`` files of ``--peer-libs DIR`` /
``$FLASHDSA_SGL_KERNEL_LIBS``. Without CUDA the command says what it would measure and exits 0;
``--cpu-check`` instead runs every kind of case at tiny sizes on the CPU, Triton interpreter vs the torch
reference, correctness only (for CI). ``--from-json REPORT --plot OUT.png`` redraws the table and the plot
of a saved report (a GPU box without matplotlib: plot on another machine).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flashdsa.cache.layouts import MLA_BF16_BYTES, MLA_FP8_BYTES
from flashdsa.testing import peers
from flashdsa.testing.compare import cos_diff, masked_cos_diff, topk_tie_safe
from flashdsa.testing.inputs import (CHUNK_PAGES, decode_slots, index_cache, mla_cache, paged_batch, prefill_indices,
                                     randn, rows_subset)
from flashdsa.testing.peers import peer_status
from flashdsa.testing.timing import do_bench_us, time_us

OPS = ("indexer", "topk", "selection", "sparse_mla", "layer", "host")
HOST_CTX = (8 * 1024, 32 * 1024)  # the host cost's contexts (--quick: the last)
K = 1024
SM_SCALE = 576 ** -0.5
LOGITS_COS, ATTN_COS, LSE_ABS = 1e-6, 1e-5, 1e-3  # ours vs the torch reference (see the module docstring)
PLOT_SWEEPS = {"indexer_paged": "paged indexer logits, B 64, next_n 1",
               "sparse_decode": "sparse MLA decode, fp8 656, B 64, h_q 128, top-2048"}


# ---- cases -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    op: str                  # one of OPS
    kind: str                # paged | ragged | topk | decode | prefill | layer (picks the setup function)
    name: str
    params: dict
    sweep: str | None = None  # rows of a context sweep (a plot panel); x = params["ctx"]


def _ctx_name(ctx: int) -> str:
    return f"{ctx // K}K" if ctx >= K else str(ctx)


def cases(ops: tuple[str, ...] = OPS, quick: bool = False, tiny: bool = False) -> list[Case]:
    """The cases of ``ops`` in run order: docs/DSA.md §9's shapes, or ``tiny`` ones for the CPU check."""
    out: list[Case] = []
    if tiny:  # every kind of case, small enough for the Triton interpreter
        if "indexer" in ops:
            if not quick:
                out.append(Case("indexer", "paged", "paged B3 n1 ctx~200", dict(B=3, n=1, ctx=200, H=8)))
            out.append(Case("indexer", "paged", "paged B2 n2 ctx~150", dict(B=2, n=2, ctx=150, H=8)))
            out.append(Case("indexer", "ragged", "ragged 12x100", dict(T=12, N=100, H=8)))
        if "topk" in ops:
            out.append(Case("topk", "topk", "top-64 of [3, 700]", dict(R=3, L=700, k=64, pages=False)))
            if not quick:
                out.append(Case("topk", "topk", "top-64 of [5, 300] pages", dict(R=5, L=300, k=64, pages=True)))
        if "sparse_mla" in ops:
            out.append(Case("sparse_mla", "decode", "decode fp8 B2 s_q2 h16 top-64 ctx 256",
                            dict(B=2, s_q=2, h=16, topk=64, ctx=256)))
            if not quick:
                out.append(Case("sparse_mla", "decode", "decode bf16 B2 s_q1 h16 top-64 ctx 256",
                                dict(B=2, s_q=1, h=16, topk=64, ctx=256, fmt="bf16")))
            out.append(Case("sparse_mla", "prefill", "prefill bf16 T4 N200 h16 top-64",
                            dict(T=4, N=200, h=16, topk=64)))
        if "selection" in ops:
            out.append(Case("selection", "selection", "selection B3 n1 ctx~300 top-64", dict(B=3, ctx=300, H=8, k=64)))
        if "layer" in ops:
            out.append(Case("layer", "layer", "tiny decode B2 ctx 200", dict(preset="tiny", B=2, ctx=200)))
        return out
    sweep = (4 * K, 16 * K, 32 * K, 64 * K) if quick else (4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K)
    if "indexer" in ops:
        for ctx in sweep:
            out.append(Case("indexer", "paged", f"paged B64 n1 ctx~{_ctx_name(ctx)}", dict(B=64, n=1, ctx=ctx, H=64),
                            sweep="indexer_paged"))
        out.append(Case("indexer", "paged", "paged B64 n2 ctx~32K", dict(B=64, n=2, ctx=32 * K, H=64)))
        if not quick:  # MTP verify with 4 draft rows: the Gluon kernel's case (DeepGEMM stops at 2)
            out.append(Case("indexer", "paged", "paged B64 n4 ctx~32K", dict(B=64, n=4, ctx=32 * K, H=64)))
        for T, N in [(4096, 16 * K)] + ([] if quick else [(8192, 32 * K)]):
            out.append(Case("indexer", "ragged", f"ragged {T}x{N}", dict(T=T, N=N, H=64)))
    if "topk" in ops:
        shapes = [(64, 32 * K), (4096, 32 * K)] if quick else \
            [(64, 32 * K), (64, 128 * K), (4096, 8 * K), (4096, 32 * K)]
        for R, L in shapes:
            out.append(Case("topk", "topk", f"top-2048 of [{R}, {_ctx_name(L)}]", dict(R=R, L=L, k=2048, pages=False)))
    if "selection" in ops:
        for ctx in [8 * K, 32 * K] + ([] if quick else [128 * K]):
            out.append(Case("selection", "selection", f"selection B64 n1 ctx~{_ctx_name(ctx)}",
                            dict(B=64, ctx=ctx, H=64)))
    if "sparse_mla" in ops:
        for ctx in sweep:
            out.append(Case("sparse_mla", "decode", f"decode fp8 B64 h128 top-2048 ctx {_ctx_name(ctx)}",
                            dict(B=64, s_q=1, h=128, topk=2048, ctx=ctx), sweep="sparse_decode"))
        if not quick:  # the other decode shapes, and our bf16 pages against FlashMLA's fp8 ones
            for B, s_q, h, fmt in [(64, 2, 128, "fp8"), (128, 2, 64, "fp8"), (64, 1, 128, "bf16"), (128, 2, 64, "bf16")]:
                out.append(Case("sparse_mla", "decode", f"decode {fmt} B{B} s_q{s_q} h{h} top-2048 ctx 32K",
                                dict(B=B, s_q=s_q, h=h, topk=2048, ctx=32 * K, fmt=fmt)))
        for N in [8 * K] + ([] if quick else [32 * K]):
            out.append(Case("sparse_mla", "prefill", f"prefill bf16 T4096 N{_ctx_name(N)} h128 top-2048",
                            dict(T=4096, N=N, h=128, topk=2048)))
    if "layer" in ops:
        for ctx in ([] if quick else [8 * K]) + [32 * K]:
            out.append(Case("layer", "layer", f"v32 decode B64 ctx {_ctx_name(ctx)}",
                            dict(preset="v32", B=64, ctx=ctx)))
    return out


def peers_of(case: Case) -> str:
    """The peers a case is timed against (when they import)."""
    if case.kind == "paged" and case.params["n"] > 2:
        return "none (DeepGEMM: next_n <= 2 on Hopper)"
    if case.kind == "topk":
        return "none (peers do not translate slots)" if case.params["pages"] else "fast_topk, torch.topk"
    if case.kind == "selection":
        return "DeepGEMM paged -> fast_topk_transform_fused" if case.params.get("k", 2048) == 2048 else "none (k 2048)"
    return {"paged": "DeepGEMM", "ragged": "DeepGEMM", "decode": "FlashMLA", "prefill": "FlashMLA",
            "layer": "DeepGEMM / fast_topk_transform_fused / FlashMLA per stage, the three in a row for the step"}[case.kind]


def parse_ops(text: str) -> tuple[str, ...]:
    """``"topk,indexer"`` -> ``("indexer", "topk")`` (run order); ValueError naming ``ops`` otherwise."""
    names = [s.strip() for s in str(text).split(",") if s.strip()]
    bad = [s for s in names if s not in OPS]
    if not names or bad:
        raise ValueError(f"ops: expected a comma-separated subset of {','.join(OPS)}, got {text!r}")
    return tuple(op for op in OPS if op in names)


# ---- one benchmark: what a setup function hands the driver -----------------------------------------

@dataclass
class Bench:
    """``ours``: the call to time. ``check``: ours vs the torch reference -> ``{"ok", "summary", ...}``.
    ``peers``: name -> a factory returning ``(call to time, its check dict)`` (run only when timing).
    ``bytes`` / ``flops``: valid work, for GB/s, TFLOP/s and the roofline; ``dtype``: the matmul rate
    that bounds it ("fp8" / "bf16", None = memory only)."""
    ours: Callable[[], Any]
    check: Callable[[], dict]
    peers: dict[str, Callable[[], tuple[Callable[[], Any], dict]]] = field(default_factory=dict)
    bytes: float = 0.0
    flops: float = 0.0
    dtype: str | None = None
    parts: tuple["Bench", ...] = ()  # a composite (the layer step): its roofline is the sum of its parts'


def _check_logits(out: torch.Tensor, ref: torch.Tensor) -> dict:
    same_inf = bool(torch.equal(torch.isneginf(out), torch.isneginf(ref)) and not torch.isnan(out).any())
    cd = cos_diff(out, ref)
    return {"ok": same_inf and cd <= LOGITS_COS, "inf_pattern": same_inf, "cos_diff": cd,
            "summary": f"cos {cd:.1e}" + ("" if same_inf else ", -inf pattern differs")}


def _check_same(out: torch.Tensor, ref: torch.Tensor) -> dict:
    same = bool(torch.equal(out, ref))
    return {"ok": same, "same_bits": same, "summary": "same bits" if same else "selections differ"}


def _check_attention(out, lse, ref_out, ref_lse) -> dict:
    cd = cos_diff(out.float(), ref_out.float())
    same_inf = bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)))
    fin = torch.isfinite(ref_lse)
    lerr = float((lse - ref_lse)[fin].abs().max()) if fin.any() else 0.0
    ok = same_inf and cd <= ATTN_COS and lerr <= LSE_ABS and not bool(torch.isnan(out).any())
    return {"ok": ok, "cos_diff": cd, "lse_max_abs": lerr, "summary": f"cos {cd:.1e}, lse {lerr:.1e}"}


def _masked_cos(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> dict:
    cd = masked_cos_diff(a, b, valid)
    return {"cos_diff_vs_ours": cd, "summary": f"cos {cd:.1e} vs ours"}


def _topk_exact(x: torch.Tensor, lengths: torch.Tensor, idx: torch.Tensor, k: int) -> dict:
    """A peer's picks, tie-safely (compare.topk_tie_safe): exact whatever its tie rule."""
    exact = topk_tie_safe(x, lengths, idx, k)[0]
    return {"exact": exact, "summary": "exact" if exact else "NOT exact"}


# ---- peers: the Bench factories of the calls in flashdsa.testing.peers --------------------------------

def _deepgemm_paged(q_fp8, cache, w, lens, bt, max_len, ours):
    """DeepGEMM's paged logits over our pages; schedule made once, untimed."""
    def make():
        fn = peers.deepgemm_paged(q_fp8, cache, w, lens, bt, max_len)
        # DeepGEMM leaves garbage past each row's length: compare inside the lengths only
        valid = torch.arange(max_len, device=lens.device)[None, :] < lens.reshape(-1, 1)
        return fn, _masked_cos(ours(), fn(), valid)
    return make


def _token_table(block_table: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[B, max_len] int32``: the slot of each position through ``block_table`` (SGLang's page table of page
    size 1, what fast_topk_transform_fused translates through)."""
    j = torch.arange(max_len, device=block_table.device)
    return (block_table.long()[:, j // 64] * 64 + j % 64).to(torch.int32).contiguous()


def _same_slot_sets(theirs: torch.Tensor, mine: torch.Tensor) -> dict:
    """A peer's translated top-k against ours, as sets a row (its order within a row is its own)."""
    a, b = theirs.reshape(mine.shape).sort(dim=-1).values, mine.sort(dim=-1).values
    same = (a == b).all(dim=-1).float().mean()
    return {"summary": f"same slots (as sets) in {same:.1%} of rows"}


def _flashmla_decode(q, cache, idx, sm_scale, seqlens, ours):
    """FlashMLA's sparse decode over our 656-B pages."""
    def make():
        fn = peers.flashmla_decode(q, cache, idx, sm_scale, seqlens)
        out = ours()[0]
        return fn, _masked_cos(out.float(), fn()[0], torch.ones_like(out, dtype=torch.bool))
    return make


def _topk_peers(x, lengths, k, status) -> dict:
    out = {}
    if status["fast_topk"]["ok"] and k == 2048:
        def make_fast():
            fn, picks = peers.fast_topk(x, lengths, k)
            fn()
            sub = rows_subset(x.shape[0], 64, x.device)
            return fn, _topk_exact(x[sub], lengths[sub], picks[sub], k)
        out["fast_topk"] = make_fast
    out["torch.topk"] = lambda: ((lambda: torch.topk(x, k, dim=1)), {})  # exact by construction, untranslated
    return out


# ---- setups: inputs, ours, the check, peers, work ----------------------------------------------------

def _setup_paged(p: dict, dev, status) -> list[tuple[str, Bench]]:
    from flashdsa import ops
    from flashdsa.quant import FP8
    B, n, ctx, H = p["B"], p["n"], p["ctx"], p["H"]
    g = torch.Generator(device=dev).manual_seed(ctx + n)
    seq, bt, P = paged_batch(B, ctx, n, g, dev)
    cache = index_cache(P, g, dev)
    lens = (seq[:, None] - n + 1 + torch.arange(n, device=dev)[None, :]).to(torch.int32)  # verify rows
    max_len = bt.shape[1] * 64
    q, w = randn((B, n, H, 128), g, dev, FP8), randn((B * n, H), g, dev)
    # the default backend on CUDA (the Gluon kernel from next_n 4 on on sm_90, else Triton: the op's rule); the
    # Triton kernel on the CPU (interpreted: the CPU default is the torch reference itself)
    backend = None if q.is_cuda else "triton"
    ours = lambda: ops.indexer_logits_paged(q, cache, w, lens, bt, max_len, backend=backend)  # noqa: E731

    def check():
        sub = rows_subset(B, 4, dev)
        rows = (sub[:, None] * n + torch.arange(n, device=dev)).flatten()
        ref = ops.indexer_logits_paged(q[sub], cache, w[rows], lens[sub], bt[sub], max_len, backend="torch")
        return _check_logits(ours()[rows], ref)

    pairs = int(lens.sum())
    peer = {"DeepGEMM": _deepgemm_paged(q, cache, w, lens, bt, max_len, ours)} \
        if status["DeepGEMM"]["ok"] and n <= 2 else {}  # DeepGEMM: next_n <= 2 on Hopper
    return [("", Bench(ours, check, peer, bytes=q.numel() + 4 * w.numel() + 132 * int(seq.sum()) + 4 * pairs,
                       flops=2 * pairs * H * 128, dtype="fp8"))]


def _setup_ragged(p: dict, dev, status) -> list[tuple[str, Bench]]:
    from flashdsa import ops
    from flashdsa.quant import FP8
    T, N, H = p["T"], p["N"], p["H"]
    g = torch.Generator(device=dev).manual_seed(T + N)
    q, k = randn((T, H, 128), g, dev, FP8), randn((N, 128), g, dev, FP8)
    k_scale, w = torch.rand(N, generator=g, device=dev) + 0.5, randn((T, H), g, dev)
    ks = torch.zeros(T, dtype=torch.int32, device=dev)
    ke = (torch.arange(T, device=dev) + N - T + 1).to(torch.int32)  # row i: the N - T prefix keys and itself
    ours = lambda: ops.indexer_logits_ragged(q, k, k_scale, w, ks, ke, backend="triton")  # noqa: E731

    def check():
        sub = rows_subset(T, 32, dev)
        ref = ops.indexer_logits_ragged(q[sub], k, k_scale, w[sub], ks[sub], ke[sub], backend="torch")
        return _check_logits(ours()[sub], ref)

    peer = {}
    if status["DeepGEMM"]["ok"]:
        def make():
            fn = peers.deepgemm_ragged(q, k, k_scale, w, ks, ke)
            out = ours()
            return fn, _masked_cos(out, fn(), torch.isfinite(out))
        peer["DeepGEMM"] = make
    pairs = int((ke - ks).sum())
    return [("", Bench(ours, check, peer, bytes=q.numel() + 4 * w.numel() + 132 * N + 4 * pairs,
                       flops=2 * pairs * H * 128, dtype="fp8"))]


def _setup_topk(p: dict, dev, status) -> list[tuple[str, Bench]]:
    from flashdsa import ops
    R, L, k = p["R"], p["L"], p["k"]
    g = torch.Generator(device=dev).manual_seed(R + L)
    x = randn((R, L), g, dev)
    lengths = torch.full((R,), L, dtype=torch.int32, device=dev)
    pt = torch.randperm(R * -(-L // 64), generator=g, device=dev).view(R, -1).to(torch.int32) if p["pages"] else None
    ours = lambda: ops.topk_transform(x, lengths, k, page_table=pt, backend="triton")  # noqa: E731

    def check():
        sub = rows_subset(R, 16, dev)
        ref = ops.topk_transform(x[sub], lengths[sub], k, page_table=None if pt is None else pt[sub], backend="torch")
        return _check_same(ours()[sub], ref)

    peer = _topk_peers(x, lengths, k, status) if pt is None else {}
    return [("", Bench(ours, check, peer, bytes=4 * R * L + 4 * R * k))]


def _attention_work(n_valid: int, h: int, row_bytes: int, q: torch.Tensor, idx: torch.Tensor) -> dict:
    rows = q.numel() // q.shape[-1]
    return dict(bytes=n_valid * row_bytes + 2 * q.numel() + rows * (2 * 512 + 4) + 4 * idx.numel(),
                flops=2 * h * (576 + 512) * n_valid, dtype="bf16")


def _setup_decode(p: dict, dev, status) -> list[tuple[str, Bench]]:
    """Sparse MLA decode over fp8 656-B pages (``fmt`` "fp8") or bf16 pages ("bf16"); FlashMLA always reads
    fp8 pages of the same tokens (its sparse decode has no bf16 cache: SGLang's bf16-cache decode on the
    H200 is the case this compares)."""
    from flashdsa import ops
    B, s_q, h, topk, ctx, fmt = p["B"], p["s_q"], p["h"], p["topk"], p["ctx"], p.get("fmt", "fp8")
    g = torch.Generator(device=dev).manual_seed(ctx)
    per_req = -(-ctx // 64)
    cache = mla_cache(B * per_req, g, dev, fmt)
    bt = torch.randperm(B * per_req, generator=g, device=dev).view(B, per_req)
    idx = decode_slots(bt, ctx, s_q, topk, g)
    q = randn((B, s_q, h, 576), g, dev, torch.bfloat16)
    # the default backend on CUDA: on sm_90 the Gluon kernel, elsewhere the Triton ones (ops.sparse_mla_decode's
    # rule); the Triton kernels on the CPU (interpreted: the CPU default is the torch reference itself)
    backend = None if q.is_cuda else "triton"
    ours = lambda: ops.sparse_mla_decode(q, cache, idx, SM_SCALE, backend=backend)  # noqa: E731

    def check():
        sub = rows_subset(B, 4, dev)
        out, lse = ours()
        return _check_attention(out[sub], lse[sub], *ops.sparse_mla_decode(q[sub], cache, idx[sub], SM_SCALE,
                                                                         backend="torch"))

    peer = {}
    if status["FlashMLA"]["ok"] and h in (64, 128):
        seqlens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        # the same tokens as fp8 pages: a generator in the state ``cache`` was drawn from
        peer_cache = cache if fmt == "fp8" else mla_cache(B * per_req, torch.Generator(device=dev).manual_seed(ctx),
                                                           dev)
        peer["FlashMLA" if fmt == "fp8" else "FlashMLA (fp8 pages)"] = _flashmla_decode(q, peer_cache, idx, SM_SCALE,
                                                                                         seqlens, ours)
    row_bytes = MLA_FP8_BYTES if fmt == "fp8" else MLA_BF16_BYTES
    return [("", Bench(ours, check, peer, **_attention_work(idx.numel(), h, row_bytes, q, idx)))]


def _setup_prefill(p: dict, dev, status) -> list[tuple[str, Bench]]:
    from flashdsa import ops
    T, N, h, topk = p["T"], p["N"], p["h"], p["topk"]
    g = torch.Generator(device=dev).manual_seed(T + N)
    kv, q = randn((N, 576), g, dev, torch.bfloat16), randn((T, h, 576), g, dev, torch.bfloat16)
    idx = prefill_indices(T, N, topk, g, dev)
    # the default backend on CUDA (on sm_90 the bf16 Gluon kernel where it applies, elsewhere Triton); the
    # Triton kernels on the CPU (interpreted)
    backend = None if q.is_cuda else "triton"
    ours = lambda: ops.sparse_mla_prefill(q, kv, idx, SM_SCALE, backend=backend)  # noqa: E731

    def check():
        sub = rows_subset(T, 16, dev)
        out, lse = ours()
        return _check_attention(out[sub], lse[sub], *ops.sparse_mla_prefill(q[sub], kv, idx[sub], SM_SCALE,
                                                                          backend="torch"))

    peer = {}
    if status["FlashMLA"]["ok"] and h % 64 == 0 and topk % 128 == 0:
        def make():
            fn = peers.flashmla_prefill(q, kv, idx, SM_SCALE)
            out = ours()[0]
            return fn, _masked_cos(out.float(), fn()[0], torch.ones_like(out, dtype=torch.bool))
        peer["FlashMLA"] = make
    return [("", Bench(ours, check, peer, **_attention_work(idx.numel(), h, 1152, q, idx)))]


def selection_inputs(B: int, ctx: int, H: int, dev) -> tuple:
    """Decode selection's inputs at next_n 1, seeded by ``ctx``: ``(q [B, 1, H, 128] fp8, index cache, weights
    [B, H] f32, context_lens [B, 1] i32, block table [B, pages] i32, max_len, seq [B])``, contexts ~U(0.7, 1.3)
    x ctx (``paged_batch``)."""
    from flashdsa.quant import FP8
    g = torch.Generator(device=dev).manual_seed(ctx + 17)
    seq, bt, P = paged_batch(B, ctx, 1, g, dev)
    cache = index_cache(P, g, dev)
    q, w = randn((B, 1, H, 128), g, dev, FP8), randn((B, H), g, dev)
    return q, cache, w, seq.view(B, 1).to(torch.int32), bt, bt.shape[1] * 64, seq


def _setup_selection(p: dict, dev, status) -> list[tuple[str, Bench]]:
    """Decode selection at next_n 1: paged logits -> top-k -> physical slots, ours as the runner chains them
    (``indexer_logits_paged`` then ``topk_transform`` through the block table), against DeepGEMM's paged
    logits -> sgl-kernel's ``fast_topk_transform_fused`` (what SGLang's DSA decode runs; its page table is
    per token). Checked: the logits against the torch reference (a few requests), and the slots against the
    torch top-k on our logits; the peer's slots are compared with ours as sets (information)."""
    from flashdsa import ops
    B, ctx, H, k = p["B"], p["ctx"], p["H"], p.get("k", 2048)
    q, cache, w, lens, bt, max_len, seq = selection_inputs(B, ctx, H, dev)
    rows_len = lens.view(-1).contiguous()
    backend = None if q.is_cuda else "triton"

    def logits():
        return ops.indexer_logits_paged(q, cache, w, lens, bt, max_len, backend=backend)

    def ours():
        return ops.topk_transform(logits(), rows_len, k, page_table=bt, backend=backend)

    def check():
        sub = rows_subset(B, 4, dev)
        ref = ops.indexer_logits_paged(q[sub], cache, w[sub], lens[sub], bt[sub], max_len, backend="torch")
        x = logits()
        got = _check_logits(x[sub], ref)
        same = _check_same(ours()[sub], ops.topk_transform(x[sub], rows_len[sub], k, page_table=bt[sub],
                                                           backend="torch"))
        return {"ok": got["ok"] and same["ok"], "summary": f"logits {got['summary']}; slots {same['summary']}"}

    peer = {}
    if status["DeepGEMM"]["ok"] and status["fast_topk_transform_fused"]["ok"] and k == 2048:
        def make():
            dg = _deepgemm_paged(q, cache, w, lens, bt, max_len, logits)()[0]
            topk = peers.fast_topk_transform_fused(rows_len, _token_table(bt, max_len), k)
            chain = lambda: topk(dg())  # noqa: E731
            return chain, _same_slot_sets(chain(), ours())
        peer["DeepGEMM+fast_topk_transform_fused"] = make
    pairs = int(lens.sum())
    return [("", Bench(ours, check, peer,
                       bytes=q.numel() + 4 * w.numel() + 132 * int(seq.sum()) + 2 * 4 * pairs + 4 * B * k,
                       flops=2 * pairs * H * 128, dtype="fp8"))]


def _setup_layer(p: dict, dev, status) -> list[tuple[str, Bench]]:
    """One decode step of one layer on a KVPool, through the layer's own step (``DSAAttention.score_paged``
    -> ``topk_paged`` -> ``attend``, what ``DSAAttention.forward`` runs at decode) on random inputs."""
    import dataclasses

    from flashdsa.cache.metadata import DECODE, build_decode
    from flashdsa.cache.pool import KVPool
    from flashdsa.config import DSAConfig
    from flashdsa.layers.attention import DSAAttention
    from flashdsa.layers.indexer import IndexerOutput
    from flashdsa.quant import FP8
    cfg = DSAConfig.preset(p["preset"]).replace(num_hidden_layers=1)  # the caches of one layer
    B, ctx, page, topk = p["B"], p["ctx"], cfg.page_size, cfg.index_topk
    H_I, h = cfg.index_n_heads, cfg.num_attention_heads
    g = torch.Generator(device=dev).manual_seed(ctx)
    with torch.device("meta"):  # the step's stages read the caches and the inputs, not the weights
        attn = DSAAttention(cfg, 0)
    pool = KVPool(cfg, B * -(-(ctx + 1) // page), "fp8", dev)
    alloc, reqs = pool.allocator, list(range(B))
    for r in reqs:
        alloc.allocate(r, 0)
    for start in range(0, ctx, 16 * page):  # requests grow in turns, so their pages interleave
        for r in reqs:
            alloc.extend(r, min(16 * page, ctx - start))

    def write(slots):  # random MLA rows and indexer keys through the pool's writers
        for i in range(0, slots.numel(), CHUNK_PAGES * 64):
            s = slots[i:i + CHUNK_PAGES * 64]
            pool.write(0, s, randn((s.numel(), 576), g, dev, torch.bfloat16), randn((s.numel(), 128), g, dev, FP8),
                       torch.rand(s.numel(), generator=g, device=dev) + 0.5)
    write(torch.cat([alloc.slots(r) for r in reqs]))
    for r in reqs:
        alloc.extend(r, 1)  # this step's token, written before attending as the layer does
    meta = build_decode(alloc, reqs, 1, DECODE)  # default backends (sparse MLA: Gluon on sm_90)
    if torch.device(dev).type != "cuda":  # the CPU default is the torch reference itself: interpret the kernels
        meta = dataclasses.replace(meta, backend="triton")
    write(meta.slot_mapping)
    idx = IndexerOutput(randn((B, H_I, 128), g, dev, FP8), randn((B, H_I), g, dev) * H_I ** -0.5, None, None)
    q = randn((B, h, 576), g, dev, torch.bfloat16)
    lens, bt, max_len = meta.context_lens, meta.block_table, meta.max_context_len
    sub = rows_subset(B, 4, dev)
    # the torch reference on a few requests: the same step with the rows' metadata and backend="torch"
    ref_meta = dataclasses.replace(meta, context_lens=lens[sub], block_table=bt[sub], backend="torch")
    ref_idx = IndexerOutput(idx.q[sub], idx.weights[sub], None, None)

    def indexer():
        return attn.score_paged(idx, meta, pool)

    def select(logits):
        return attn.topk_paged(logits, meta, pool)

    def attend(sel):
        return attn.attend(q, sel, meta, pool)

    logits = indexer()  # the fixed inputs of the later stages
    sel = select(logits)
    done: dict[str, dict] = {}

    def checked(name, fn):
        def run():
            done[name] = fn()
            return done[name]
        return run

    def check_attention():
        out, lse = attend(sel)
        return _check_attention(out[sub], lse[sub], *attn.attend(q[sub], sel[sub], ref_meta, pool))

    mla = pool.mla_pages(0)
    stages = {
        "indexer": Bench(indexer, checked("indexer", lambda: _check_logits(
            indexer()[sub], attn.score_paged(ref_idx, ref_meta, pool))),
            bytes=idx.q.numel() + 4 * idx.weights.numel() + 132 * int(lens.sum()) + 4 * int(lens.sum()),
            flops=2 * int(lens.sum()) * H_I * 128, dtype="fp8"),
        "top-k": Bench(lambda: select(logits), checked("top-k", lambda: _check_same(
            select(logits)[sub], attn.topk_paged(logits[sub], ref_meta, pool))), bytes=4 * logits.numel() + 4 * B * topk),
        "attention": Bench(lambda: attend(sel), checked("attention", check_attention),
                           **_attention_work(sel.numel(), h, 656, q, sel)),
    }
    seqlens = lens.view(-1).contiguous()
    q_fp8, w = idx.q.view(B, 1, H_I, 128), idx.weights
    if status["DeepGEMM"]["ok"]:
        stages["indexer"].peers["DeepGEMM"] = _deepgemm_paged(q_fp8, pool.index_cache(0), w, lens, bt, max_len, indexer)
    if status["fast_topk_transform_fused"]["ok"] and topk == 2048:
        def make_topk():  # SGLang's decode call: top-k with the slot translation fused, like ours
            fn = peers.fast_topk_transform_fused(seqlens, _token_table(bt, max_len), topk)
            return (lambda: fn(logits)), _same_slot_sets(fn(logits), select(logits))
        stages["top-k"].peers["fast_topk_transform_fused"] = make_topk
    elif status["fast_topk"]["ok"] and topk == 2048:  # an sgl-kernel without it: positions, untranslated
        stages["top-k"].peers["fast_topk"] = _topk_peers(logits, seqlens, topk, status)["fast_topk"]
    if status["FlashMLA"]["ok"] and h in (64, 128):
        stages["attention"].peers["FlashMLA"] = _flashmla_decode(q.view(B, 1, h, 576), mla, sel.view(B, 1, topk),
                                                                 attn.softmax_scale, seqlens,
                                                                 lambda: (attend(sel)[0].view(B, 1, h, -1),))

    def step():
        return attend(select(indexer()))

    def step_check():
        bad = [n for n in stages if not done.get(n, {}).get("ok")]
        return {"ok": not bad, "summary": "stages ok" if not bad else f"failed: {', '.join(bad)}"}

    total = Bench(step, step_check, bytes=sum(s.bytes for s in stages.values()),
                  flops=sum(s.flops for s in stages.values()), parts=tuple(stages.values()))
    if all(s.peers for s in stages.values()):
        def make_chain():  # the peers' three ops back to back
            fns = [make()[0] for s in stages.values() for make in s.peers.values()]
            return (lambda: [f() for f in fns]), {"summary": "the three in a row"}
        total.peers["+".join(p for s in stages.values() for p in s.peers)] = make_chain
    return [(f": {n}", b) for n, b in stages.items()] + [(": step", total)]


SETUPS = {"paged": _setup_paged, "ragged": _setup_ragged, "topk": _setup_topk, "selection": _setup_selection,
          "decode": _setup_decode, "prefill": _setup_prefill, "layer": _setup_layer}


# ---- timing and ceilings ---------------------------------------------------------------------------

def measure_ceilings(dev) -> dict:
    """The card's copy bandwidth (1 GiB device-to-device, bytes read + written) and bf16 / fp8 matmul
    rates (8192³) in this run: the roofline's ceilings."""
    from flashdsa.quant import FP8
    out: dict[str, Any] = {}
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    out["copy_GBps"] = 2 * src.numel() / do_bench_us(lambda: dst.copy_(src)) / 1e3
    src = dst = None  # free the 2 GiB now (the lambda above is done with them)
    m = 8192
    a, b = torch.randn(m, m, device=dev, dtype=torch.bfloat16), torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    out["bf16_TFLOPs"] = 2 * m ** 3 / do_bench_us(lambda: a @ b) / 1e6
    try:
        a8, b8, one = a.to(FP8), b.to(FP8).t(), torch.ones((), device=dev)  # mat2 column-major, as _scaled_mm wants
        out["fp8_TFLOPs"] = 2 * m ** 3 / do_bench_us(
            lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) / 1e6
    except Exception as e:  # noqa: BLE001
        out["fp8_TFLOPs"], out["fp8_note"] = None, f"torch._scaled_mm failed: {e!r}"[:160]
    return out


def roof_us(b: Bench, ceilings: dict) -> float | None:
    """max(bytes / copy bandwidth, FLOPs / the matmul rate of b.dtype), in µs (a composite: the sum of its parts')."""
    if not ceilings.get("copy_GBps"):
        return None
    if b.parts:
        return sum(roof_us(p, ceilings) for p in b.parts)
    t = b.bytes / ceilings["copy_GBps"] / 1e3
    rate = ceilings.get(f"{b.dtype}_TFLOPs") if b.dtype else None
    return max(t, b.flops / rate / 1e6) if rate and b.flops else t


# ---- the driver --------------------------------------------------------------------------------------

class _Progress:
    """A progress bar on stderr (tqdm if it imports, else a ``[i/n] case`` line) with notes printed above it."""

    def __init__(self, n: int):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=n, file=sys.stderr, unit="case", leave=False, mininterval=0.5)
        except ImportError:
            self.bar = None
        self.i, self.n = 0, n

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(label)
        else:
            print(f"\r[{self.i + 1}/{self.n}] {label}\033[K", end="", file=sys.stderr, flush=True)

    def done(self, notes: list[str]) -> None:
        self.i += 1
        for line in notes:
            if self.bar is not None:
                self.bar.write(line, file=sys.stderr)
            else:
                print(f"\r\033[K{line}", file=sys.stderr, flush=True)
        if self.bar is not None:
            self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def _note(row: dict) -> str:
    """One line per finished row, so a run cut short still shows what it measured."""
    parts = [f"{row['case']}: ours {row['ours_us']:.1f} us" if row.get("ours_us") else row["case"] + ":"]
    parts += [f"{p['name']} {p['us']:.1f} us" for p in row.get("peers", []) if p.get("us")]
    return ", ".join(parts) + f" | {'ok' if row['check'].get('ok') else 'FAIL'} ({row['check'].get('summary', '')})"


def run_case(case: Case, dev, status: dict, ceilings: dict | None, graph: bool = True) -> list[dict]:
    """Rows of one case: checked against the reference, then (``ceilings`` given: on CUDA) timed with its peers."""
    from flashdsa import ops
    from flashdsa._checks import value_checks_enabled
    base = {"op": case.op, "kind": case.kind, "params": dict(case.params)}
    if case.sweep:
        base.update(sweep=case.sweep, context=case.params["ctx"])
    try:
        benches = SETUPS[case.kind](case.params, dev, status)
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
        return [{**base, "case": case.name, "error": f"setup: {e!r}"[:300],
                 "check": {"ok": False, "summary": f"setup failed: {type(e).__name__}"}}]
    rows = []
    for suffix, b in benches:
        row = {**base, "case": case.name + suffix, "peers": []}
        try:
            row["check"] = b.check()
        except Exception as e:  # noqa: BLE001
            row["check"] = {"ok": False, "summary": f"error: {type(e).__name__}", "error": repr(e)[:300]}
        if ceilings is not None:
            checks_were_on = value_checks_enabled()
            ops.set_value_checks(False)  # the production decode setting: no host reads in the timed calls
            try:
                us = time_us(b.ours, graph)
                row.update(ours_us=us, GBps=b.bytes / us / 1e3, TFLOPs=b.flops / us / 1e6 if b.flops else None,
                           roof_us=roof_us(b, ceilings))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"timing ours: {e!r}"[:300]
            for name, make in b.peers.items():
                try:
                    fn, info = make()
                    p_us = time_us(fn, graph)
                    row["peers"].append({"name": name, "us": p_us, "check": info,
                                         "ratio": row["ours_us"] / p_us if "ours_us" in row else None})
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    row["peers"].append({"name": name, "error": f"{type(e).__name__}: {e}"[:200]})
            ops.set_value_checks(checks_were_on)
        rows.append(row)
    return rows


def device_info(dev) -> dict:
    info = {"device": str(dev), "torch": torch.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=p.name, capability=f"sm_{p.major}{p.minor}", sms=p.multi_processor_count,
                    memory_GiB=round(p.total_memory / 2 ** 30, 1), cuda=torch.version.cuda)
    else:
        info["name"] = "cpu"
    return info


def format_table(rows: list[dict], timed: bool = True) -> str:
    """One line per (case, peer): op | case | ours_us | peer | peer_us | ours/peer | GB/s | TFLOP/s | roof_us |
    check (``timed=False``: op | case | check), as a Markdown table."""
    def f(v, spec=".4g"):
        return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)

    def chk(c):
        return ("ok" if c.get("ok") else "FAIL") + (f" ({c['summary']})" if c.get("summary") else "")

    lines = []
    for r in rows:
        head = [r["op"], r["case"]]
        check = chk(r["check"]) + (f" [{r['error'][:60]}]" if r.get("error") else "")
        if not timed:
            lines.append(head + [check])
            continue
        ours = [f(r.get("ours_us"), ".1f")]
        tail = [f(r.get("GBps"), ".0f"), f(r.get("TFLOPs"), ".1f"), f(r.get("roof_us"), ".1f"), check]
        peers = r.get("peers") or [{}]
        for p in peers:
            pc = p.get("check", {}).get("summary", "") if "error" not in p else p["error"][:40]
            name = (p.get("name", "-") + (f" ({pc})" if pc else "")) if p else "-"
            lines.append(head + ours + [name, f(p.get("us"), ".1f"), f(p.get("ratio"), ".2f")] + tail)
    cols = ["op", "case", "check"] if not timed else \
        ["op", "case", "ours_us", "peer", "peer_us", "ours/peer", "GB/s", "TFLOP/s", "roof_us", "check"]
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]
    # a header rule makes the table a Markdown table as printed (for BENCHMARKS.md)
    out = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip(), " | ".join("-" * w for w in widths)]
    out += [" | ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def write_json(report: dict, path: str) -> None:
    """The report to ``path``; ``"-"`` (``--json`` alone) prints it to stdout."""
    if path == "-":
        print(json.dumps(report, indent=1, default=str), flush=True)
        return
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1, default=str)


def plot(rows: list[dict], ceilings: dict, path: str, title: str = "") -> bool:
    """Time vs context for the two sweeps (ours, each peer, the roofline); False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(PLOT_SWEEPS), figsize=(6 * len(PLOT_SWEEPS), 4.2))
    for ax, (sweep, label) in zip(axes, PLOT_SWEEPS.items()):
        pts = sorted((r for r in rows if r.get("sweep") == sweep and r.get("ours_us")), key=lambda r: r["context"])
        ax.set_title(label, fontsize=10)
        if not pts:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
            continue
        x = [r["context"] for r in pts]
        ax.plot(x, [r["ours_us"] for r in pts], "o-", color="C0", label="flashdsa (Triton)")
        names = list(dict.fromkeys(p["name"] for r in pts for p in r["peers"] if p.get("us")))
        for i, name in enumerate(names):
            xy = [(r["context"], p["us"]) for r in pts for p in r["peers"] if p["name"] == name and p.get("us")]
            ax.plot(*zip(*xy), "s-", color=f"C{i + 1}", label=name)
        roof = [(r["context"], r["roof_us"]) for r in pts if r.get("roof_us")]
        if roof:
            ax.plot(*zip(*roof), "k--", label=f"roofline ({_ceilings_text(ceilings)})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [_ctx_name(c) for c in x])
        ax.set_xlabel("context (tokens per request)")
        ax.set_ylabel("µs (median)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _ceilings_text(c: dict) -> str:
    rate = lambda key: "-" if not c.get(key) else f"{c[key]:.0f}"  # noqa: E731
    return (f"measured copy {c.get('copy_GBps', 0) / 1e3:.2f} TB/s, bf16 mm {rate('bf16_TFLOPs')}, "
            f"fp8 mm {rate('fp8_TFLOPs')} TFLOP/s")


def _check_out_path(name: str, path: str | None) -> None:
    if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"{name}: the folder of {path!r} does not exist")


def _use_interpreter() -> None:
    """Triton's interpreter for CPU tensors; it must be on before our kernels are defined (first import)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    # a kernel module imported without the interpreter holds JITFunctions (interpreted ones are another class)
    jit = sys.modules.get("triton.runtime.jit")
    kernel_modules = [mod for name, mod in list(sys.modules.items()) if name.startswith("flashdsa.ops.")]
    if jit and any(isinstance(v, jit.JITFunction) for mod in kernel_modules for v in vars(mod).values()):
        raise ValueError("cpu-check: Triton kernels were already compiled for the GPU in this process; "
                         "run it in a fresh one (or set TRITON_INTERPRET=1)")
    os.environ["TRITON_INTERPRET"] = "1"


def replay(report_path: str, plot_path: str | None = None, out=None) -> int:
    """The table (and the plot) of a saved ``--json`` report, measuring nothing: plot a GPU run elsewhere."""
    say = lambda s="": print(s, file=out or sys.stdout, flush=True)  # noqa: E731
    try:
        with open(report_path) as fh:
            report = json.load(fh)
        rows, info = report["rows"], report["device"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"from-json: cannot read a flashdsa bench report from {report_path!r} ({e})") from e
    say(f"flashdsa bench (from {report_path}): {info.get('name')} | {report.get('date')}")
    if report.get("ceilings"):
        say(f"ceilings: {_ceilings_text(report['ceilings'])}")
    say(format_table(rows, timed=bool(report.get("measured"))))
    if plot_path:
        if not report.get("measured"):
            say("no plot: nothing was timed")
        elif plot(rows, report["ceilings"], plot_path, f"flashdsa bench on {info.get('name')}, "
                                                       f"{str(report.get('date'))[:10]}"):
            say(f"wrote {plot_path}")
        else:
            say("no plot: matplotlib does not import (pip install matplotlib)")
    return 0 if report.get("ok") else 1


def run_bench(ops: str | tuple[str, ...] = OPS, quick: bool = False, json_path: str | None = None,
              plot_path: str | None = None, peer_libs: str | None = None, cpu_check: bool = False,
              graph: bool = True, from_json: str | None = None, out=None) -> int:
    """``flashdsa bench``. Returns the exit code: 0, or 1 if a check failed. ValueError for bad arguments.
    ``json_path`` "-": the JSON report to stdout (the text goes to ``out``)."""
    out = out or sys.stdout
    ops = parse_ops(ops) if isinstance(ops, str) else parse_ops(",".join(ops))
    _check_out_path("json", json_path)
    _check_out_path("plot", plot_path)
    if peer_libs is not None and not os.path.isdir(peer_libs):
        raise ValueError(f"peer-libs: no such folder: {peer_libs!r}")
    if from_json is not None:
        return replay(from_json, plot_path, out)
    say = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    report: dict[str, Any] = {"flashdsa": _version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                              "args": {"ops": list(ops), "quick": quick, "cpu_check": cpu_check, "graph": graph,
                                       "peer_libs": peer_libs}}
    status = peer_status(peer_libs)
    report["peers"] = status
    peers_line = " | ".join(f"{n} {'yes' if s['ok'] else 'no'}" for n, s in status.items())
    timed = torch.cuda.is_available() and not cpu_check

    if not timed and not cpu_check:  # CPU: say what we would measure and why we cannot
        todo = cases(ops, quick)
        dev = device_info(torch.device("cpu"))
        report.update(device=dev, measured=False, rows=[], ok=True,
                      reason="no CUDA device: Triton kernels and the peers need a GPU",
                      cases=[{"op": c.op, "case": c.name, "peers": peers_of(c)} for c in todo])
        say("flashdsa bench: no CUDA device here, so nothing can be timed.")
        say(f"  would time {len(todo)} case(s) of {', '.join(ops)}{' (--quick)' if quick else ''}:")
        width = max(len(c.name) for c in todo) if todo else 0
        for c in todo:
            say(f"    {c.op:<11}{c.name:<{width}}  vs {peers_of(c)}")
        if "host" in ops:
            say(f"    {'host':<11}host us per plain call of each op, contexts "
                f"{', '.join(_ctx_name(c) for c in _host_ctx(quick))}  vs DeepGEMM, fast_topk_v2, FlashMLA")
        say("  cannot measure on CPU: kernel times, the card's copy bandwidth and matmul rates (the roofline),")
        say("  the peers' times (DeepGEMM, FlashMLA and fast_topk are CUDA kernels).")
        say("  peers importable here: " + "; ".join(f"{n}: {'yes' if s['ok'] else 'no (' + s['why'] + ')'}"
                                                    for n, s in status.items()))
        say("  correctness on CPU: flashdsa bench --cpu-check [--quick] (tiny shapes, Triton interpreter vs torch)")
        if json_path:
            write_json(report, json_path)
            say(f"  wrote {json_path}")
        if plot_path:
            say("  no plot: nothing was timed")
        return 0

    if cpu_check:
        _use_interpreter()
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
    todo = cases(ops, quick, tiny=cpu_check)
    info = device_info(dev)
    report["device"] = info
    t0 = time.time()
    ceilings = measure_ceilings(dev) if timed else None
    report["ceilings"] = ceilings
    if timed:
        say(f"flashdsa bench: {info['name']} ({info['capability']}, {info['sms']} SMs) | torch {info['torch']} | "
            f"triton {info['triton']} | {report['date']}")
        say(f"ceilings: {_ceilings_text(ceilings)}")
        say(f"peers: {peers_line}")
    rows: list[dict] = []
    progress = _Progress(len(todo))
    for c in todo:
        progress.start(f"{c.op}: {c.name}")
        new = run_case(c, dev, status, ceilings, graph)
        progress.done([_note(r) for r in new] if timed else [])
        rows += new
        if timed:
            torch.cuda.empty_cache()
    progress.close()
    if "host" in ops:
        report["host"] = _host(dev, timed, quick, status, say)
    ok = all(r["check"].get("ok") for r in rows)
    report.update(measured=timed, rows=rows, ok=ok, seconds=round(time.time() - t0, 1))

    if timed:
        if rows:
            say(format_table(rows))
            say("ours/peer < 1: ours faster. GB/s, TFLOP/s: ours, valid work only. roof_us: max(bytes / copy, "
                "FLOPs / matmul rate) at the measured ceilings. Times: median of do_bench" +
                (" over a CUDA-graph replay." if graph else ", plain calls."))
        if "host" in ops:
            say("host cost of plain calls (us of host time a call, best of 9 batches, GPU kept busy; ours with the "
                "default value checks):")
            say(report["host"]["table"])
            for v in report["host"]["verdicts"]:
                say(f"{'PASS' if v['ok'] else 'FAIL'}  {v['text']}")
    else:
        say(format_table(rows, timed=False))
        n_ok = sum(bool(r["check"].get("ok")) for r in rows)
        say(f"cpu-check: {n_ok}/{len(rows)} ok (tiny shapes, Triton interpreter vs torch reference; nothing timed)"
            f" in {report['seconds']} s")
    if json_path:
        write_json(report, json_path)
        say(f"wrote {json_path}")
    if plot_path:
        if not timed:
            say("no plot: nothing was timed")
        elif plot(rows, ceilings, plot_path, title=f"flashdsa bench on {info['name']}, {report['date'][:10]}"):
            say(f"wrote {plot_path}")
        else:
            say("no plot: matplotlib does not import (pip install matplotlib)")
    return 0 if ok else 1


def _host_ctx(quick: bool) -> tuple[int, ...]:
    return HOST_CTX[-1:] if quick else HOST_CTX


def _host(dev: torch.device, timed: bool, quick: bool, status: dict, say) -> dict:
    """The ``host`` op: flashdsa.testing.host_cost on the GPU; nothing under --cpu-check (host times of the
    interpreter mean nothing, and every op's correctness is the other cases' business)."""
    if not timed:
        say("host: nothing to check on the CPU (host times only; benchmarks/bench_host.py --smoke runs the path)")
        return {"measured": False}
    from flashdsa.testing import host_cost
    say(f"host: timing plain calls at contexts {', '.join(_ctx_name(c) for c in _host_ctx(quick))} ...")
    rows, verdicts = host_cost.measure("cuda", _host_ctx(quick), dg=status["DeepGEMM"]["ok"],
                                       sgl=status["fast_topk"]["ok"] and status["FlashMLA"]["ok"])
    return {"measured": True, "rows": rows, "table": host_cost.table(rows),
            "verdicts": [{"text": t, "ok": ok} for t, ok in verdicts]}


def _version() -> str:
    from flashdsa import __version__
    return __version__
