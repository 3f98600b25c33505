"""Triton indexer kernels against the torch reference on the same fp8 inputs.

Paged: shuffled block tables, junk page ids past each request's pages, junk bytes (NaN keys and scales
included) in every page slot past a length, verify rows with per-row causal lengths, any next_n (one
and several row groups), padded head counts, launch shapes that give one page per program, several
steps per program and sub-page steps; both paged kernels (pointer gathers, and TMA page copies through
``PagedConfig(tma=True)``, the sm_90 default), compiled on a GPU in the ``gpu`` tests. Ragged: random
[ks, ke) incl. empty and full rows, causal prefill over cached prefixes, head dims other than 128, many
key chunks per row block. Outputs are
poisoned with NaN so an unwritten element fails; every case repeats bit for bit. The budgeted top-k
is checked against the unbudgeted composition with budgets that force many chunks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from flashdsa.cache.layouts import index_page_views
from flashdsa.ops import indexer as indexer_mod
from flashdsa.ops._common import pick_backend
from flashdsa.ops.indexer import (indexer_logits_paged, indexer_logits_ragged, indexer_topk_ragged,
                                  _row_chunks)
from flashdsa.ops.indexer import paged as KP
from flashdsa.ops.indexer import ragged as KR
from flashdsa.ops.topk import topk_transform
from flashdsa.quant import FP8, act_quant
from flashdsa.testing.compare import assert_close, cos_diff, masked_cos_diff
from flashdsa.testing.inputs import poison, ragged_ranges

# junk bytes past each length hold e4m3 NaN and inf / NaN scales; the interpreter's numpy warns about them
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")


def _fp8(*shape, gen=None, device="cpu", scale=4.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(FP8).to(device)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _check(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5, max_cos_diff: float = 1e-10) -> None:
    """Exact -inf / NaN pattern, then elementwise within ``rel`` of the largest logit (default: fp32
    reordering of the sums), then cosine."""
    fin = torch.isfinite(ref)
    mag = float(ref[fin].abs().max()) if fin.any() else 1.0
    assert_close(out, ref, atol=rel * mag + 1e-30, max_cos_diff=max_cos_diff)


# ---- paged --------------------------------------------------------------------------------------------

def _paged_cache(seq_lens: list[int], maxp: int, gen: torch.Generator, device="cpu"):
    """``(index_cache [P, 8448] u8, block_table [B, maxp] i32)``: pages shuffled over a pool with spares,
    valid keys / scales only at positions < seq_len, random bytes everywhere else (e4m3 NaN bytes and
    NaN / inf scales among them), random page ids (negative, huge) past each request's pages."""
    used = [(S + 63) // 64 for S in seq_lens]
    P = sum(used) + 3
    cache = torch.randint(0, 256, (P, 8448), generator=gen, dtype=torch.int32).to(torch.uint8)
    keys, scales = index_page_views(cache)
    perm = torch.randperm(P, generator=gen)
    bt = torch.randint(-10 ** 6, 10 ** 6, (len(seq_lens), maxp), generator=gen, dtype=torch.int32)
    i = 0
    for b, S in enumerate(seq_lens):
        bt[b, :used[b]] = perm[i:i + used[b]].to(torch.int32)
        i += used[b]
        pos = torch.arange(S)
        page = bt[b, :used[b]].long()[pos // 64]
        keys[page, pos % 64] = _fp8(S, 128, gen=gen)
        scales[page, pos % 64] = torch.rand(S, generator=gen) * 0.1 + 1e-3
    return cache.to(device), bt.to(device)


def _verify_lens(seq_lens: list[int], n: int) -> torch.Tensor:
    return torch.tensor([[max(0, S - n + j + 1) for j in range(n)] for S in seq_lens], dtype=torch.int32)


PAGED_CASES = [
    # (seq_lens, n, H, context_lens override, extra width, config)
    pytest.param([0, 1, 63, 64, 65, 130], 1, 4, None, 37, None, id="B6-n1-H4-lens0..130"),
    pytest.param([2, 63, 64, 65, 132], 2, 8, None, 0, KP.PagedConfig(block_n=64, chunk=64),
                 id="B5-n2-H8-one-page-per-program"),
    pytest.param([3, 129, 200], 3, 64, None, 5, KP.PagedConfig(block_n=64, chunk=128), id="B3-n3-H64-two-steps"),
    pytest.param([64, 129, 300], 3, 64, None, 0, None, id="B3-n3-H64-default-three-dots-chain"),
    pytest.param([130, 67], 4, 32, None, 64, None, id="B2-n4-H32"),
    pytest.param([300, 67, 0], 2, 64, None, 3, None, id="B3-n2-H64-default-two-page-steps"),
    pytest.param([70, 200, 5], 3, 64, None, 2, KP.PagedConfig(rows=1, chunk=256, programs_per_sm=4),
                 id="B3-n3-H64-one-row-per-group-two-page-steps"),
    pytest.param([130, 67], 5, 64, None, 1, None, id="B2-n5-H64-two-row-groups"),
    pytest.param([70, 5], 3, 1, None, 0, KP.PagedConfig(rows=1), id="B2-n3-H1-one-row-per-group"),
    pytest.param([65, 130, 1], 4, 3, [[0, 65, 1, 64], [130, 63, 0, 129], [1, 0, 1, 0]], 0,
                 KP.PagedConfig(block_n=16, chunk=32, rows=2), id="B3-n4-H3-arbitrary-lens-subpage-steps"),
    pytest.param([300], 1, 64, None, 0, KP.PagedConfig(block_n=64, chunk=256), id="B1-n1-H64-ctx300-exact-width"),
    pytest.param([0, 0], 2, 8, None, 70, None, id="B2-n2-H8-all-empty"),
    # G / GS dots a step sharing one key block, the head sum as an fma chain (64-head groups) or tl.sum
    pytest.param([130, 67], 4, 64, None, 3, KP.PagedConfig(sub_rows=2, chain=True),
                 id="B2-n4-H64-two-dots-chain"),
    pytest.param([129, 64, 1], 4, 64, None, 0, KP.PagedConfig(sub_rows=1, block_n=128, chunk=256, chain=False),
                 id="B3-n4-H64-four-dots-tree-two-page-steps"),
    pytest.param([300, 67, 0], 2, 64, None, 3, KP.PagedConfig(sub_rows=2, chain=False),
                 id="B3-n2-H64-one-dot-tree"),
    pytest.param([100, 65], 3, 32, None, 7, KP.PagedConfig(chain=True), id="B2-n3-H32-two-dots-no-chain-at-hp32"),
    pytest.param([130, 3], 6, 64, None, 2, KP.PagedConfig(sub_rows=1, chunk=128), id="B2-n6-H64-two-groups-four-dots"),
]


def _paged_inputs(seq_lens, n, H, lens, extra, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    maxp = max(1, (max(seq_lens) + 63) // 64) + 1
    cache, bt = _paged_cache(seq_lens, maxp, gen)
    ctx = _verify_lens(seq_lens, n) if lens is None else torch.tensor(lens, dtype=torch.int32)
    q = _fp8(B, n, H, 128, gen=gen)
    w = torch.randn(B * n, H, generator=gen)  # negative gates too
    width = max(seq_lens) + extra
    return [t.to(device) for t in (q, cache, w, ctx, bt)] + [width]


def _with_upcast(cases, upcast_ids):
    """Every case on the fp8 tensor-core path, plus a few on the fp16-upcast path (GPUs before sm_89)."""
    out = [pytest.param(*c.values, True, id=c.id) for c in cases]
    return out + [pytest.param(*c.values, False, id=c.id + "-fp16-upcast") for c in cases if c.id in upcast_ids]


@pytest.mark.parametrize("seq_lens,n,H,lens,extra,cfg,fp8_dot",
                         _with_upcast(PAGED_CASES, {"B5-n2-H8-one-page-per-program", "B2-n4-H32",
                                                       "B2-n4-H64-two-dots-chain"}))
@pytest.mark.interpreter
def test_paged_matches_reference(seq_lens, n, H, lens, extra, cfg, fp8_dot):
    q, cache, w, ctx, bt, width = _paged_inputs(seq_lens, n, H, lens, extra, seed=len(seq_lens) * 100 + n * 10 + H)
    cfg = replace(cfg or KP.PagedConfig(), fp8_dot=fp8_dot)
    out = KP.indexer_logits_paged(q, cache, w, ctx, bt, width, config=cfg, out=poison((q.shape[0] * n, width)))
    ref = indexer_logits_paged(q, cache, w, ctx, bt, width, backend="torch")
    _check(out, ref)
    again = KP.indexer_logits_paged(q, cache, w, ctx, bt, width, config=cfg, out=poison((q.shape[0] * n, width)))
    assert torch.equal(_bits(out), _bits(again))


# The TMA kernel (the default on sm_90) runs in the interpreter too: the same inputs (junk pages and page ids
# past each length included) through PagedConfig(tma=True); the interpreter stores with tl.store, the
# compiled kernel from registers (test_kernels_compile_for_hopper_and_ampere, the GPU tests).
PAGED_TMA_CASES = [
    pytest.param([0, 1, 63, 64, 65, 130], 1, 4, None, 37, KP.PagedConfig(tma=True), id="B6-n1-H4-lens0..130"),
    pytest.param([300, 67, 0], 2, 64, None, 3, KP.PagedConfig(tma=True, chunk=128), id="B3-n2-H64-two-dots"),
    pytest.param([64, 129, 300], 3, 64, None, 5, KP.PagedConfig(tma=True), id="B3-n3-H64-padded-dot-compiled-out"),
    pytest.param([130, 67], 4, 64, None, 64, KP.PagedConfig(tma=True, chunk=128), id="B2-n4-H64-one-256-column-dot"),
    pytest.param([130, 3], 5, 64, None, 2, KP.PagedConfig(tma=True), id="B2-n5-H64-two-row-groups"),
    pytest.param([129, 64, 1], 4, 64, None, 0, KP.PagedConfig(tma=True, block_n=128, chunk=256, sub_rows=1),
                 id="B3-n4-H64-two-pages-a-step-four-dots"),
    pytest.param([65, 130, 1], 4, 3, [[0, 65, 1, 64], [130, 63, 0, 129], [1, 0, 1, 0]], 0,
                 KP.PagedConfig(tma=True, chunk=64, rows=2), id="B3-n4-H3-arbitrary-lens-one-page-per-program"),
    pytest.param([100, 65], 2, 128, None, 7, KP.PagedConfig(tma=True), id="B2-n2-H128-one-256-column-dot"),
    pytest.param([200, 70], 3, 32, None, 1, KP.PagedConfig(tma=True, chunk=128, chain=True),
                 id="B2-n3-H32-two-dots-no-chain-at-hp32"),
    pytest.param([0, 0], 2, 8, None, 70, KP.PagedConfig(tma=True), id="B2-n2-H8-all-empty"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("seq_lens,n,H,lens,extra,cfg", PAGED_TMA_CASES)
def test_paged_tma_matches_reference(seq_lens, n, H, lens, extra, cfg, monkeypatch):
    # the pointer kernel must not run: a silent fallback would leave the TMA kernel untested
    monkeypatch.setattr(KP, "indexer_logits_paged_kernel", None)
    q, cache, w, ctx, bt, width = _paged_inputs(seq_lens, n, H, lens, extra, seed=len(seq_lens) * 100 + n * 10 + H + 1)
    out = KP.indexer_logits_paged(q, cache, w, ctx, bt, width, config=cfg, out=poison((q.shape[0] * n, width)))
    ref = indexer_logits_paged(q, cache, w, ctx, bt, width, backend="torch")
    _check(out, ref)
    again = KP.indexer_logits_paged(q, cache, w, ctx, bt, width, config=cfg, out=poison((q.shape[0] * n, width)))
    assert torch.equal(_bits(out), _bits(again))


@pytest.mark.interpreter
def test_paged_tma_dispatch():
    """The interpreter runs the pointer kernel unless asked for the TMA one; a TMA request it cannot honour
    (sub-page steps, the fp16-upcast path) is an error, not a silent fallback."""
    q, cache, w, ctx, bt, width = _paged_inputs([70, 5], 2, 8, None, 0, seed=3)
    assert not KP._use_tma(KP.PagedConfig(), cache, True)
    assert KP._use_tma(KP.PagedConfig(tma=True), cache, True)
    assert not KP._use_tma(KP.PagedConfig(tma=True), cache[:0], True)  # no pages: no descriptor
    for cfg, fp8_dot in [(KP.PagedConfig(tma=True, block_n=32), True), (KP.PagedConfig(tma=True), False)]:
        with pytest.raises(ValueError, match="tma"):
            KP.indexer_logits_paged(q, cache, w, ctx, bt, width, config=replace(cfg, fp8_dot=fp8_dot))
    want = KP.indexer_logits_paged(q, cache, w, ctx, bt, width)
    got = KP.indexer_logits_paged(q, cache, w, ctx, bt, width, config=KP.PagedConfig(tma=True))
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and cos_diff(got, want) < 1e-12


@pytest.mark.interpreter
def test_paged_public_op_dispatches_to_triton():
    q, cache, w, ctx, bt, width = _paged_inputs([65, 130], 2, 8, None, 3, seed=5)
    out = indexer_logits_paged(q, cache, w, ctx, bt, width, backend="triton")
    assert torch.equal(_bits(out), _bits(KP.indexer_logits_paged(q, cache, w, ctx, bt, width)))
    _check(out, indexer_logits_paged(q, cache, w, ctx, bt, width, backend="torch"))
    # the verify rows' causal lengths: draft j never sees position seq_len - n + j + 1
    for b in range(2):
        for j in range(2):
            L = int(ctx[b, j])
            assert torch.isfinite(out[b * 2 + j, :L]).all() and torch.isneginf(out[b * 2 + j, L:]).all()


@pytest.mark.interpreter
def test_paged_zero_width_and_no_rows():
    q, cache, w, ctx, bt, _ = _paged_inputs([0, 0], 2, 4, None, 0, seed=1)
    assert indexer_logits_paged(q, cache, w, ctx, bt, 0, backend="triton").shape == (4, 0)


def test_paged_tma_chunks_for_few_columns(monkeypatch):
    """On a 132-SM GPU (the H200) the TMA kernel's chunks: ~16 programs an SM of >= 8 pages where the columns
    allow (B 64 at 32K and beyond: as measured before), else ~4 an SM of 2 to 16 pages (latency batches)."""
    from flashdsa.ops.indexer import paged_config as PC
    monkeypatch.setattr(PC, "num_sms", lambda device: 132)
    chunk = lambda B, L: KP.paged_config(B, 1, 64, L, torch.device("cpu"), tma=True).chunk  # noqa: E731
    assert [chunk(B, 8448) for B in (1, 4, 16, 64, 128)] == [128, 128, 256, 1024, 512]
    assert [chunk(B, 8256) for B in (64, 128)] == [1024, 512]
    assert [chunk(B, 34944) for B in (1, 4, 16, 32, 64)] == [128, 256, 1024, 512, 1024]
    assert [chunk(B, 153600) for B in (1, 16, 64)] == [256, 1024, 4096]


def test_paged_config_covers_long_contexts():
    """The default split gives whole steps per chunk; pointer kernel: two pages a step up to 128 dot
    columns, 1 / 2 / 4 dots a step; TMA kernel: one page a step, a dot per row of 64 heads, one 256-column
    dot over 8 warps for a full group of 4 rows, chunks of >= 8 pages."""
    dev = torch.device("cpu")
    for B, n, L in [(64, 1, 42600), (128, 1, 85000), (1, 4, 300000), (64, 4, 42600), (64, 2, 2_000_000),
                    (64, 3, 42600), (1, 2, 100)]:
        for H in (64, 32, 128, 3):
            G, GS, HP, bn, chunk, chain, warps = KP.paged_config(B, n, H, L, dev)
            padded = G * HP == KP.MAX_DOT_N and n < G  # n = 3 at H 64: three 64-column dots, two pages a step
            assert G * HP <= KP.MAX_DOT_N and chunk % bn == 0 and 2 * bn <= chunk <= 64 * bn
            assert bn == (128 if G * HP <= 128 or padded else 64) and warps == 4
            assert G % GS == 0 and G // GS in (1, 2, 4) and (GS * HP == 64 if padded else True)
            assert chain == (HP == 64 and padded)  # measured on only there
            assert -(-L // chunk) <= 65535  # grid dim 2
            t = KP.paged_config(B, n, H, L, dev, tma=True)
            assert t.G == G and t.block_n == 64 and t.chunk % 64 == 0 and 128 <= t.chunk <= 64 * 64
            assert t.G % t.GS == 0 and t.G // t.GS in (1, 2, 4) and not t.chain
            assert t.GS == (G if G * HP == KP.MAX_DOT_N and not padded else max(1, min(G, 64 // HP)))
            assert t.num_warps == (8 if t.GS * HP == KP.MAX_DOT_N else 4)
            assert -(-L // t.chunk) <= 65535
    with pytest.raises(ValueError, match="sub_rows"):
        KP.paged_config(2, 4, 64, 100, dev, KP.PagedConfig(sub_rows=3))
    with pytest.raises(ValueError, match="block_n"):
        KP.paged_config(2, 4, 64, 100, dev, KP.PagedConfig(block_n=32), tma=True)


# ---- ragged -------------------------------------------------------------------------------------------

def _prefill_ranges(prefix: list[int], new: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Causal extend over cached prefixes: request r owns keys [start_r, start_r + prefix_r + new_r);
    its i-th new token (position prefix_r + i) sees [start_r, start_r + prefix_r + i + 1)."""
    ks, ke, start = [], [], 0
    for p, m in zip(prefix, new):
        ks += [start] * m
        ke += [start + p + i + 1 for i in range(m)]
        start += p + m
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32), start


RAGGED_CASES = [
    # (T, H, N, D, layout, config)
    pytest.param(7, 4, 65, 128, "random", None, id="T7-H4-N65"),
    pytest.param(70, 64, 200, 128, "prefill", None, id="T70-H64-N200-prefill"),
    pytest.param(33, 8, 130, 64, "random", None, id="T33-H8-N130-D64"),
    pytest.param(9, 3, 257, 96, "random", None, id="T9-H3-N257-D96"),
    pytest.param(65, 16, 64, 128, "random", KR.RaggedConfig(block_n=16, rows=2, chunk=32),
                 id="T65-H16-N64-small-tiles"),
    pytest.param(40, 32, 190, 128, "prefill", KR.RaggedConfig(block_n=32, chunk=64), id="T40-H32-N190-prefill-chunks"),
    pytest.param(5, 2, 1, 128, "random", None, id="T5-H2-N1"),
    pytest.param(4, 4, 0, 128, "random", None, id="T4-H4-N0"),
    pytest.param(0, 4, 10, 128, "random", None, id="T0-H4-N10"),
]


def _ragged_inputs(T, H, N, D, layout, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    if layout == "prefill":
        new = [T // 3, T // 3, T - 2 * (T // 3)]
        extra = N - T
        ks, ke, N = _prefill_ranges([extra // 2, 0, extra - extra // 2], new)
    else:
        ks, ke = ragged_ranges(T, N, gen)
    q = _fp8(T, H, D, gen=gen)
    k = _fp8(N, D, gen=gen)
    k_scale = torch.rand(N, generator=gen) * 0.1 + 1e-3
    w = torch.randn(T, H, generator=gen)
    return [t.to(device) for t in (q, k, k_scale, w, ks, ke)]


@pytest.mark.parametrize("T,H,N,D,layout,cfg,fp8_dot",
                         _with_upcast(RAGGED_CASES, {"T7-H4-N65", "T9-H3-N257-D96"}))
@pytest.mark.interpreter
def test_ragged_matches_reference(T, H, N, D, layout, cfg, fp8_dot):
    q, k, k_scale, w, ks, ke = _ragged_inputs(T, H, N, D, layout, seed=T * 1000 + H * 10 + N)
    shape = (T, k.shape[0])
    cfg = replace(cfg or KR.RaggedConfig(), fp8_dot=fp8_dot)
    out = KR.indexer_logits_ragged(q, k, k_scale, w, ks, ke, config=cfg, out=poison(shape))
    ref = indexer_logits_ragged(q, k, k_scale, w, ks, ke, backend="torch")
    _check(out, ref)
    again = KR.indexer_logits_ragged(q, k, k_scale, w, ks, ke, config=cfg, out=poison(shape))
    assert torch.equal(_bits(out), _bits(again))


@pytest.mark.interpreter
def test_ragged_public_op_dispatches_to_triton():
    q, k, k_scale, w, ks, ke = _ragged_inputs(20, 8, 90, 128, "prefill", seed=3)
    out = indexer_logits_ragged(q, k, k_scale, w, ks, ke, backend="triton")
    assert torch.equal(_bits(out), _bits(KR.indexer_logits_ragged(q, k, k_scale, w, ks, ke)))
    _check(out, indexer_logits_ragged(q, k, k_scale, w, ks, ke, backend="torch"))


@pytest.mark.interpreter
def test_ragged_strided_inputs():
    """Non-contiguous q / weights (views into bigger buffers) give the same logits."""
    q, k, k_scale, w, ks, ke = _ragged_inputs(12, 4, 50, 128, "random", seed=9)
    q_big = _fp8(12, 6, 128)
    q_big[:, 1:5] = q
    w_big = torch.randn(12, 7)
    w_big[:, 2:6] = w
    out = indexer_logits_ragged(q_big[:, 1:5], k, k_scale, w_big[:, 2:6], ks, ke, backend="triton")
    assert torch.equal(_bits(out), _bits(KR.indexer_logits_ragged(q, k, k_scale, w, ks, ke)))


def test_triton_is_registered_and_default_on_cuda():
    cuda = torch.device("cuda")
    assert pick_backend(None, indexer_mod._RAGGED, cuda, "x") is indexer_mod._RAGGED["triton"]
    assert pick_backend(None, indexer_mod._PAGED, cuda, "x") is indexer_mod._PAGED["triton"]
    assert pick_backend(None, indexer_mod._PAGED, torch.device("cpu"), "x") is indexer_mod._PAGED["torch"]


def test_out_buffer_is_checked():
    q, k, k_scale, w, ks, ke = _ragged_inputs(4, 2, 8, 128, "random", seed=2)
    with pytest.raises(ValueError, match="out"):
        KR.indexer_logits_ragged(q, k, k_scale, w, ks, ke, out=torch.empty(4, 9))
    with pytest.raises(ValueError, match="out"):
        KR.indexer_logits_ragged(q, k, k_scale, w, ks, ke, out=torch.empty(8, 4).t())


# ---- budgeted ragged top-k ----------------------------------------------------------------------------

def _unbudgeted(q, k, k_scale, w, ks, ke, topk, out_offsets, backend):
    logits = indexer_logits_ragged(q, k, k_scale, w, ks, ke, backend=backend)
    return topk_transform(logits, ke - ks, topk, row_starts=ks, out_offsets=out_offsets)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("offsets", [False, True], ids=["positions", "out-offsets"])
def test_topk_ragged_budget_matches_unbudgeted(backend, offsets, monkeypatch):
    q, k, k_scale, w, ks, ke = _ragged_inputs(60, 4, 180, 128, "prefill", seed=11)
    # an empty row far from its neighbours must not widen its chunk's window
    ks[30] = ke[30] = 170
    out_offsets = torch.randint(0, 5000, (60,), dtype=torch.int32) if offsets else None
    want = _unbudgeted(q, k, k_scale, w, ks, ke, 8, out_offsets, backend)
    budget = 4 * 400  # 400 logits: at most a few rows a chunk
    calls = []
    real = indexer_mod.indexer_logits_ragged

    def spy(q_c, k_c, *args, **kwargs):
        calls.append((q_c.shape[0], k_c.shape[0]))
        return real(q_c, k_c, *args, **kwargs)

    monkeypatch.setattr(indexer_mod, "indexer_logits_ragged", spy)
    got = indexer_topk_ragged(q, k, k_scale, w, ks, ke, 8, out_offsets=out_offsets, max_logits_bytes=budget,
                              backend=backend)
    assert len(calls) >= 5 and sum(t for t, _ in calls) == 60
    assert all(4 * t * n <= budget for t, n in calls), calls
    assert torch.equal(got, want)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_topk_ragged_host_bounds(backend, monkeypatch):
    """ks / ke handed over on the host: the same answer, the chunk plan made from them (no read of the device
    copies with value checks off: host ke past the rows' own widen the chunks' key windows, and the rows, read
    from the device copies, still select the same), a mismatch caught with value checks on, bad ones refused by
    name."""
    from flashdsa import ops
    q, k, k_scale, w, ks, ke = _ragged_inputs(60, 4, 180, 128, "prefill", seed=12)
    out_offsets = torch.randint(0, 5000, (60,), dtype=torch.int32)
    budget = 4 * 400
    want = _unbudgeted(q, k, k_scale, w, ks, ke, 8, out_offsets, backend)
    bounds = torch.stack((ks, ke))
    run = lambda hb: indexer_topk_ragged(q, k, k_scale, w, ks, ke, 8, out_offsets=out_offsets,  # noqa: E731
                                         max_logits_bytes=budget, backend=backend, host_bounds=hb)
    assert torch.equal(run(bounds), want) and torch.equal(run(bounds.long()), want)
    wide = torch.stack((ks, torch.full_like(ke, 180)))
    with pytest.raises(ValueError, match="host_bounds: expected ks and ke as they are on the device"):
        run(wide)
    calls = []
    real = indexer_mod.indexer_logits_ragged

    def spy(q_c, k_c, *args, **kwargs):
        calls.append(k_c.shape[0])
        return real(q_c, k_c, *args, **kwargs)
    monkeypatch.setattr(indexer_mod, "indexer_logits_ragged", spy)
    run(bounds)
    own, calls[:] = list(calls), []
    ops.set_value_checks(False)
    try:
        assert torch.equal(run(wide), want)  # trusted: windows from the host copy, rows from the device's
    finally:
        ops.set_value_checks(True)
    assert calls != own and sum(calls) > sum(own)
    for bad, what in ((bounds[:, :5], "shape"), (bounds.float(), "dtype"), (bounds[0], "shape")):
        with pytest.raises(ValueError, match=f"host_bounds: expected {what}"):
            run(bad)


def test_topk_ragged_default_budget_is_one_chunk():
    q, k, k_scale, w, ks, ke = _ragged_inputs(30, 4, 90, 128, "random", seed=4)
    got = indexer_topk_ragged(q, k, k_scale, w, ks, ke, 5)
    assert torch.equal(got, _unbudgeted(q, k, k_scale, w, ks, ke, 5, None, None))


def test_topk_ragged_budget_errors():
    q, k, k_scale, w, ks, ke = _ragged_inputs(6, 2, 40, 128, "random", seed=6)
    widest = int((ke - ks).max())
    with pytest.raises(ValueError, match="max_logits_bytes"):
        indexer_topk_ragged(q, k, k_scale, w, ks, ke, 4, max_logits_bytes=4 * widest - 4)
    indexer_topk_ragged(q, k, k_scale, w, ks, ke, 4, max_logits_bytes=4 * widest)  # exactly fits
    for bad in (0, 3, True, 1.5e9):
        with pytest.raises(ValueError, match="max_logits_bytes"):
            indexer_topk_ragged(q, k, k_scale, w, ks, ke, 4, max_logits_bytes=bad)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk_ragged(q, k, k_scale, w, ks, ke, 0)
    with pytest.raises(ValueError, match="out_offsets"):
        indexer_topk_ragged(q, k, k_scale, w, ks, ke, 4, out_offsets=torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="ke"):
        indexer_topk_ragged(q, k, k_scale, w, ks, ke + 100, 4)
    with pytest.raises(ValueError, match="backend"):
        indexer_topk_ragged(q, k, k_scale, w, ks, ke, 4, backend="cuda")


def test_topk_ragged_no_rows():
    q, k, k_scale, w, ks, ke = _ragged_inputs(0, 2, 10, 128, "random", seed=0)
    assert indexer_topk_ragged(q, k, k_scale, w, ks, ke, 4).shape == (0, 4)


def test_row_chunks_respect_the_cap():
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(50):
        T = int(rng.integers(1, 40))
        a, b = rng.integers(0, 100, T), rng.integers(0, 100, T)
        cases.append((np.minimum(a, b), np.maximum(a, b), int(rng.integers(1, 6))))
    # long causal prefill: chunks of more than the first 1024-row scan window
    causal_ke = np.arange(5000) + 1
    cases += [(np.zeros(5000, dtype=np.int64), causal_ke, 4000), (np.zeros(5000, dtype=np.int64), causal_ke, 1)]
    for ks, ke, mult in cases:
        T = len(ks)
        cap = int(max((ke - ks).max(), 1) * mult)
        chunks = _row_chunks(ks, ke, cap)
        assert chunks[0][0] == 0 and chunks[-1][1] == T
        for (r0, r1, lo, hi), nxt in zip(chunks, chunks[1:] + [(T,)]):
            assert r1 == nxt[0] and r1 > r0 and (r1 - r0) * (hi - lo) <= cap
            m = ke[r0:r1] > ks[r0:r1]
            assert (ks[r0:r1][m] >= lo).all() and (ke[r0:r1][m] <= hi).all()
    # rows that fit at once are one chunk over their keys; only empty rows: one chunk of no keys (the op still
    # launches it, to write their -1 rows)
    ks, ke = np.array([3, 5, 7, 7]), np.array([9, 5, 12, 7])
    assert _row_chunks(ks, ke, 4 * 9) == [(0, 4, 3, 12)] and _row_chunks(ks, ke, 4 * 9 - 1) != [(0, 4, 3, 12)]
    assert _row_chunks(np.array([4, 2]), np.array([4, 2]), 1) == [(0, 2, 0, 0)]


# ---- GPU sizes ----------------------------------------------------------------------------------------

def _quantised(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., 128]`` -> e4m3 values and their per-row scale (docs/DSA.md §3 act_quant)."""
    x_fp8, s = act_quant(x, block=128)
    return x_fp8, s[..., 0]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_paged_gpu_against_fp32_and_reference(n):
    """B 16, ctx ~U(0.7, 1.3) * 8K, H 64: vs the torch reference on the same fp8 inputs (tight) and vs
    fp32 math on the dequantised inputs (cosine diff < 1e-3, DeepGEMM's bar)."""
    dev = "cuda"
    B, H, avg = 16, 64, 8192
    gen = torch.Generator(device=dev).manual_seed(n)
    seq = torch.randint(int(0.7 * avg), int(1.3 * avg), (B,), generator=gen, device=dev)
    maxp = int((seq.max() + 63) // 64)
    P = B * maxp
    k_fp8, k_s = _quantised(torch.randn(P * 64, 128, device=dev, generator=gen))
    cache = torch.empty(P, 8448, dtype=torch.uint8, device=dev)
    keys, scales = index_page_views(cache)
    keys.copy_(k_fp8.view(P, 64, 128))
    scales.copy_(k_s.view(P, 64))
    bt = torch.randperm(P, device=dev, generator=gen).view(B, maxp).to(torch.int32)
    ctx = (seq[:, None] - n + 1 + torch.arange(n, device=dev)[None, :]).to(torch.int32)
    q_fp8 = torch.randn(B, n, H, 128, device=dev, generator=gen).to(FP8)
    w = torch.randn(B * n, H, device=dev, generator=gen)
    width = int(seq.max()) + 100
    out = indexer_logits_paged(q_fp8, cache, w, ctx, bt, width)
    ref = indexer_logits_paged(q_fp8, cache, w, ctx, bt, width, backend="torch")
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)) and not torch.isnan(out).any()
    assert cos_diff(out, ref) < 1e-6
    # fp32 on the dequantised keys: k_fp8 * k_scale, q as given
    kd = (keys.float() * scales[..., None]).view(P, 64, 128)
    fin = torch.isfinite(ref)
    for b in range(0, B, 5):
        L = int(seq[b])
        kb = kd[bt[b].long()].reshape(-1, 128)[:L]
        s = torch.einsum("jhd,nd->jhn", q_fp8[b].float(), kb).relu()
        want = torch.einsum("jhn,jh->jn", s, w[b * n:(b + 1) * n])
        got = out[b * n:(b + 1) * n, :L]
        m = fin[b * n:(b + 1) * n, :L]
        assert masked_cos_diff(got, want, m) < 1e-3
    assert torch.equal(_bits(out), _bits(indexer_logits_paged(q_fp8, cache, w, ctx, bt, width)))


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("n,H,cfg", [
    (1, 64, None), (2, 64, None), (3, 64, None), (4, 64, None), (5, 64, None), (2, 32, None), (2, 128, None),
    (2, 64, {"block_n": 128}), (4, 64, {"sub_rows": 1, "num_warps": 4}),
], ids=["n1", "n2", "n3", "n4", "n5", "n2-H32", "n2-H128", "n2-two-pages", "n4-four-dots"])
def test_paged_gpu_both_kernels_junk_pages(n, H, cfg, tma):
    """Both paged kernels, compiled (the TMA one stores from registers), on pages holding junk (NaN keys /
    scales) past every length and junk page ids past each request's pages, chunks of many steps."""
    seq_lens = [3000, 1, 64, 65, 700, 0, 2049]
    q, cache, w, ctx, bt, width = _paged_inputs(seq_lens, n, H, None, 77, seed=n * 7 + H, device="cuda")
    config = KP.PagedConfig(tma=tma, **(cfg or {}))
    out = KP.indexer_logits_paged(q, cache, w, ctx, bt, width, config=config,
                                 out=poison((q.shape[0] * n, width), device="cuda"))
    ref = indexer_logits_paged(*(t.cpu() for t in (q, cache, w, ctx, bt)), width, backend="torch")
    # Hopper's fp8 wgmma accumulates in less than fp32 (bench_indexer: max error ~2e-4 of the largest
    # logit), so the interpreter's 1e-5 bound does not apply: exact inf / NaN pattern, 1e-3, cosine 1e-6
    _check(out.cpu(), ref, rel=1e-3, max_cos_diff=1e-6)
    again = KP.indexer_logits_paged(q, cache, w, ctx, bt, width, config=config)
    assert torch.equal(_bits(out), _bits(again))


@pytest.mark.gpu
def test_paged_gpu_cuda_graph_replay():
    """Decode is captured once and replayed with lengths and tables refreshed in place (docs/DSA.md §6)."""
    dev = "cuda"
    seq_lens = [300, 70, 129]
    q, cache, w, ctx, bt, width = _paged_inputs(seq_lens, 2, 64, None, 64, seed=8, device=dev)
    static_ctx = ctx.clone()
    indexer_logits_paged(q, cache, w, static_ctx, bt, width)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = indexer_logits_paged(q, cache, w, static_ctx, bt, width)
    for shrink in (0, 5, 64):
        static_ctx.copy_((ctx - shrink).clamp_(min=0))
        g.replay()
        ref = indexer_logits_paged(q, cache, w, static_ctx, bt, width, backend="torch")
        assert torch.equal(torch.isneginf(out), torch.isneginf(ref)) and cos_diff(out, ref) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dot", [True, False], ids=["fp8-dot", "fp16-upcast"])
def test_ragged_gpu_causal(fp8_dot):
    dev = "cuda"
    T, N, H = 1024, 4096, 64
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, H, 128, device=dev, generator=gen).to(FP8)
    k_fp8, k_s = _quantised(torch.randn(N, 128, device=dev, generator=gen))
    w = torch.randn(T, H, device=dev, generator=gen)
    ks = torch.zeros(T, dtype=torch.int32, device=dev)
    ke = (torch.arange(T, device=dev) + N - T + 1).to(torch.int32)
    cfg = KR.RaggedConfig(fp8_dot=fp8_dot)
    out = KR.indexer_logits_ragged(q, k_fp8, k_s, w, ks, ke, config=cfg)
    ref = indexer_logits_ragged(q, k_fp8, k_s, w, ks, ke, backend="torch")
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)) and not torch.isnan(out).any()
    assert cos_diff(out, ref) < 1e-6
    assert torch.equal(_bits(out), _bits(KR.indexer_logits_ragged(q, k_fp8, k_s, w, ks, ke, config=cfg)))


@pytest.mark.gpu
def test_topk_ragged_gpu_budget():
    dev = "cuda"
    T, N, H = 512, 2048, 64
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(T, H, 128, device=dev, generator=gen).to(FP8)
    k_fp8, k_s = _quantised(torch.randn(N, 128, device=dev, generator=gen))
    w = torch.randn(T, H, device=dev, generator=gen)
    ks = torch.zeros(T, dtype=torch.int32, device=dev)
    ke = (torch.arange(T, device=dev) + N - T + 1).to(torch.int32)
    want = _unbudgeted(q, k_fp8, k_s, w, ks, ke, 256, None, None)
    got = indexer_topk_ragged(q, k_fp8, k_s, w, ks, ke, 256, max_logits_bytes=64 * N * 4)
    assert torch.equal(got, want)


# ---- compiles for real GPUs (no GPU needed) -------------------------------------------------------------

_COMPILE_SCRIPT = r'''
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashdsa.ops.indexer import paged as KP
from flashdsa.ops.indexer import ragged as KR
from flashdsa.ops._triton_utils import next_pow2

# the device value checks' arguments (CHECK compiles them in)
CHECK_SIG = dict(flag="*i64", hi="i32", last_page="i32", code0="i32")

def paged(n, H, cap, fp8, check=False):
    cfg = KP.PagedConfig()
    G, GS, HP, bn, _, chain, warps = KP.paged_config(64, n, H, 32768, torch.device("cpu"), cfg)
    q = "*fp8e4nv" if fp8 else "*u8"
    sig = dict(q=q, keys=q, scales="*fp32", w="*fp32", context_lens="*i32", block_table="*i32", out="*fp32",
               max_len="i32", stride_qb="i32", stride_qn="i32", stride_qh="i32", stride_w="i32", stride_bt="i32",
               stride_o="i32", **CHECK_SIG)
    const = dict(NEXT_N=n, H=H, HP=HP, D=128, G=G, GS=GS, BLOCK_N=bn, CHUNK=16 * bn, PAGE=64,
                 PAGE_BYTES=8448, KEY_BYTES=8192, FP8_DOT=fp8, CHAIN=chain, NUM_STAGES=cfg.num_stages, CHECK=check)
    sig.update(dict.fromkeys(const, "constexpr"))
    # what the JIT specialises at launch: 16-byte aligned pointers and strides that are multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11)}
    triton.compile(ASTSource(KP.indexer_logits_paged_kernel, sig, const, attrs), target=GPUTarget("cuda", cap, 32),
                   options=dict(num_warps=warps, num_stages=cfg.num_stages))

def paged_tma(n, H, check=False):
    cfg = KP.PagedConfig()
    G, GS, HP, bn, _, chain, warps = KP.paged_config(64, n, H, 32768, torch.device("cpu"), cfg, tma=True)
    sig = dict(q="*fp8e4nv", key_desc="tensordesc<fp8e4nv[64, 128]>", scales="*fp32", w="*fp32",
               context_lens="*i32", block_table="*i32", out="*fp32", max_len="i32", stride_qb="i32",
               stride_qn="i32", stride_qh="i32", stride_w="i32", stride_bt="i32", stride_o="i32", **CHECK_SIG)
    const = dict(NEXT_N=n, H=H, HP=HP, D=128, G=G, GS=GS, PAGES=bn // 64, CHUNK=16 * bn, PAGE=64, PAGE_ROWS=66,
                 PAGE_WORDS=2112, KEY_WORDS=2048, CHAIN=chain, NUM_STAGES=cfg.num_stages, ASM_STORE=cfg.asm_store,
                 CHECK=check)
    sig.update(dict.fromkeys(const, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 2, 3, 4, 5, 6, 8, 9, 10, 11)}
    triton.compile(ASTSource(KP.indexer_logits_paged_tma_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=cfg.num_stages))

def ragged(H, cap, fp8):
    cfg = KR.RaggedConfig()
    HP = max(16, next_pow2(H))
    q = "*fp8e4nv" if fp8 else "*u8"
    sig = dict(q=q, k=q, k_scale="*fp32", w="*fp32", ks="*i32", ke="*i32", out="*fp32", T="i32", N="i32",
               stride_qt="i32", stride_qh="i32", stride_k="i32", stride_w="i32", stride_o="i32")
    const = dict(H=H, HP=HP, D=128, DP=128, G=max(1, KR.MAX_DOT_N // HP), BLOCK_N=cfg.block_n,
                 CHUNK=64 * cfg.block_n, FP8_DOT=fp8, NUM_STAGES=cfg.num_stages)
    sig.update(dict.fromkeys(const, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12)}
    triton.compile(ASTSource(KR.indexer_logits_ragged_kernel, sig, const, attrs), target=GPUTarget("cuda", cap, 32),
                   options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))

for n in (1, 2, 3, 4):
    paged(n, 64, 90, True)
    paged_tma(n, 64)
paged_tma(2, 64, check=True)
paged(2, 32, 80, False, check=True)
ragged(64, 90, True)
ragged(32, 80, False)
print("compiled")
'''


# Prepended to a compile script that checks ptxas's notes: ``ptxas_notes(k)`` is ``ptxas -v``'s report (registers,
# spills, the C75xx notes) on the PTX of a kernel Triton compiled, from the ptxas Triton itself uses for sm_90
# (Triton 3.9 ships an older one beside it that rejects its PTX version), and fails if ptxas did not assemble it.
PTXAS_NOTES = r'''
import pathlib, subprocess, tempfile
from triton.backends.nvidia.compiler import get_ptxas
def ptxas_notes(k):
    with tempfile.TemporaryDirectory() as d:
        (pathlib.Path(d) / "k.ptx").write_text(k.asm["ptx"])
        r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(pathlib.Path(d) / "k.ptx"), "-o",
                            str(pathlib.Path(d) / "k.cubin")], capture_output=True, text=True)
    assert r.returncode == 0 and "Used" in r.stderr, r.stderr[-2000:]
    return r.stderr
'''


def compile_without_interpreter(script: str) -> None:
    """Run ``script`` in a child Python without ``TRITON_INTERPRET`` (the interpreter never compiles
    anything), the repository on its path; it must print "compiled"."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


def test_kernels_compile_for_hopper_and_ampere():
    """The default launch shapes compile for sm_90 (fp8 wgmma; the TMA paged kernel with its inline-PTX
    store) and sm_80 (fp16 upcast) through Triton's real code generator and ptxas, without a GPU."""
    compile_without_interpreter(_COMPILE_SCRIPT)
