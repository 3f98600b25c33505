"""Paged indexer logits (decode, MTP verify / draft extend): B requests x n draft rows against their keys in
the paged indexer cache, two kernels with one contract.

``indexer_logits_paged_tma_kernel`` copies each page's keys with one TMA load (the default on sm_90, and run
in the interpreter with ``PagedConfig(tma=True)``); ``indexer_logits_paged_kernel`` gathers them with pointer
loads (other GPUs incl. the fp16-upcast path before sm_89, and the interpreter by default). A program's G
draft rows are split into 1, 2 or 4 dots of GS rows that share the step's keys (``_row_logits``: narrower
accumulators, and a padded row's dot is compiled out); the inner step is ``common.py``'s.

The kernels write every output element (logits below each row's length, -inf elsewhere), use no atomics and
a fixed reduction order: the same input and launch shape give the same bits. The launch shapes:
``paged_config.py``; design and measurements: README.md next to this file.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashdsa._checks import error_flag
from flashdsa.cache.layouts import INDEX_KEY_BYTES, INDEX_PAGE_BYTES, PAGE_SIZE
from flashdsa.ops._device_checks import PAGED_CODE0, flag_range, flag_word
from flashdsa.ops._common import remember
from flashdsa.ops._launch import Address, KernelLauncher, aligned, capability
from flashdsa.ops._triton_utils import cdiv, interpreting
from flashdsa.ops.indexer.common import (MAX_DOT_N, e4m3_bits_to_f16, fill_neg_inf, fp8_dot_supported, gated_relu_sum,
                                         logits_buffer)
# the launch configuration; PagedConfig, paged_config and MAX_DOT_N are what tests and benchmarks reach here
from flashdsa.ops.indexer.paged_config import PagedConfig, PagedShape, paged_config

# an indexer page as rows of one key (128 B): 64 rows of keys, then 2 of scales (TMA kernel's cache view)
PAGE_ROWS = INDEX_PAGE_BYTES // (INDEX_KEY_BYTES // PAGE_SIZE)  # 66


@triton.jit
def _head_sum_chain(b_r, b_w, BLOCK_N: tl.constexpr, GS: tl.constexpr):
    """``b_r [BLOCK_N, GS * 64]`` (relu'd scores), ``b_w [GS * 64]`` -> ``[BLOCK_N, GS]``: the head sum as one
    fma chain per thread.

    A Hopper accumulator gives a thread columns ``8 * blk + 2 * (lane % 4) + reg``: the reshapes / permute
    / splits below only relabel those registers (no data moves) and peel the 8 column blocks ``blk`` into
    8 tensors, so ``s = r_0 w_0 + r_1 w_1 + ...`` is 1 multiply and 7 fmas per register pair instead of the
    multiply / fma pairs and add tree of ``tl.sum`` over 64 heads. The quad (``lane % 4``) and the two
    registers are summed after. Same value up to fp32 rounding order.
    """
    # [BLOCK_N, GS, 8 (lane, reg), 8 (blk)] -> split the blk bits, highest first
    r = tl.reshape(tl.permute(tl.reshape(b_r, [BLOCK_N, GS, 8, 8]), [0, 1, 3, 2]), [BLOCK_N, GS, 8, 2, 2, 2])
    w = tl.reshape(tl.permute(tl.reshape(b_w, [GS, 8, 8]), [0, 2, 1]), [GS, 8, 2, 2, 2])
    r0, r1 = tl.split(r)
    w0, w1 = tl.split(w)
    r00, r01 = tl.split(r0)
    r10, r11 = tl.split(r1)
    w00, w01 = tl.split(w0)
    w10, w11 = tl.split(w1)
    ra, rb = tl.split(r00)
    rc, rd = tl.split(r01)
    re, rf = tl.split(r10)
    rg, rh = tl.split(r11)
    wa, wb = tl.split(w00)
    wc, wd = tl.split(w01)
    we, wf = tl.split(w10)
    wg, wh = tl.split(w11)
    # [BLOCK_N, GS, 8]
    s = ra * wa[None]
    s += rb * wb[None]
    s += rc * wc[None]
    s += rd * wd[None]
    s += re * we[None]
    s += rf * wf[None]
    s += rg * wg[None]
    s += rh * wh[None]
    return tl.sum(s, axis=2)


@triton.jit
def _draft_rows(q, w, context_lens, out, i_b64, j0, o_d, stride_qn, stride_qh, stride_w, stride_o,
                NEXT_N: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, GS: tl.constexpr, FP8_DOT: tl.constexpr):
    """Draft rows ``j0 .. j0 + GS - 1`` of one request (``q`` already offset to it): ``q^T [D, GS * HP]``,
    gates ``[GS * HP] f32``, lengths ``[GS] i32``, output row pointers ``[GS]`` and row mask ``[GS]``.
    Padded heads / rows get q = w = 0 (they add exactly 0) and length 0."""
    o_j = j0 + tl.arange(0, GS)
    m_j = o_j < NEXT_N
    b_len = tl.load(context_lens + i_b64 * NEXT_N + o_j, mask=m_j, other=0)
    p_rows = out + (i_b64 * NEXT_N + o_j) * stride_o
    # [GS * HP] (row, head) pairs folded into the dot's N side
    o_r = tl.arange(0, GS * HP)
    r_j = j0 + o_r // HP
    r_h = o_r % HP
    m_r = (r_j < NEXT_N) & (r_h < H)
    # [D, GS * HP], loaded already transposed: Triton then copies it to shared memory once, before the
    # loop (a tl.trans of a [GS * HP, D] tile is re-stored to shared memory every step)
    b_qt = tl.load(q + r_j[None, :] * stride_qn + r_h[None, :] * stride_qh + o_d[:, None], mask=m_r[None, :], other=0.0)
    if not FP8_DOT:
        b_qt = e4m3_bits_to_f16(b_qt)
    # [GS * HP]
    b_w = tl.load(w + (i_b64 * NEXT_N + r_j) * stride_w + r_h, mask=m_r, other=0.0)
    return b_qt, b_w, b_len, p_rows, m_j


@triton.jit
def _draft_groups(q, w, context_lens, out, i_b64, j0, o_d, stride_qn, stride_qh, stride_w, stride_o,
                  NEXT_N: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, GS: tl.constexpr, SUB: tl.constexpr,
                  FP8_DOT: tl.constexpr):
    """:func:`_draft_rows` of the program's SUB sub-groups (rows j0 + s * GS ..), as 4 tuples
    ``(q^T, gates, lengths, row pointers, row mask)``, and the group's reach (its longest length). Sub-groups
    past SUB or NEXT_N alias sub-group 0: every use of them is compiled out under the same condition."""
    g0 = _draft_rows(q, w, context_lens, out, i_b64, j0, o_d, stride_qn, stride_qh, stride_w, stride_o,
                     NEXT_N, H, HP, GS, FP8_DOT)
    reach = tl.max(g0[2], axis=0)
    g1 = g0
    g2 = g0
    g3 = g0
    if SUB > 1 and GS < NEXT_N:
        g1 = _draft_rows(q, w, context_lens, out, i_b64, j0 + GS, o_d, stride_qn, stride_qh, stride_w, stride_o,
                         NEXT_N, H, HP, GS, FP8_DOT)
        reach = tl.maximum(reach, tl.max(g1[2], axis=0))
    if SUB > 2 and 2 * GS < NEXT_N:
        g2 = _draft_rows(q, w, context_lens, out, i_b64, j0 + 2 * GS, o_d, stride_qn, stride_qh, stride_w,
                         stride_o, NEXT_N, H, HP, GS, FP8_DOT)
        reach = tl.maximum(reach, tl.max(g2[2], axis=0))
    if SUB > 3 and 3 * GS < NEXT_N:
        g3 = _draft_rows(q, w, context_lens, out, i_b64, j0 + 3 * GS, o_d, stride_qn, stride_qh, stride_w,
                         stride_o, NEXT_N, H, HP, GS, FP8_DOT)
        reach = tl.maximum(reach, tl.max(g3[2], axis=0))
    return g0, g1, g2, g3, reach


@triton.jit
def _lens_bad(flag, grp, hi, code0):
    """The device check of a sub-group's lengths (``grp``, a :func:`_draft_rows` tuple): each in [0, hi], a
    bad one flagged (error words code0 + 0 / + 1). Returns 1 if one was bad, else 0 (int32)."""
    return tl.max(flag_range(flag, grp[2], grp[4], 0, hi, code0).to(tl.int32), axis=0)


@triton.jit
def _program_ok(q, g0, g1, g2, g3, i_c, stride_qn, stride_qh, hi, flag, code0,
                NEXT_N: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, GS: tl.constexpr,
                SUB: tl.constexpr):
    """The device value checks of a program's draft rows (default mode, ``CHECK``), from the lengths it
    loaded anyway (a second load of them before the queries' raised the kernel's register count by a
    third): 1 if all are in [0, hi], else 0 (the program's rows then read no key) with the error stored
    in ``flag``. The chunk-0 programs also flag an e4m3 NaN code in the request's queries (``q`` offset to
    it). Page ids: :func:`_chunk_pages_ok`. Error words ``code0 + i`` in the order of
    ``_device_checks.PAGED_CHECKS``."""
    bad = _lens_bad(flag, g0, hi, code0)
    if SUB > 1 and GS < NEXT_N:
        bad = tl.maximum(bad, _lens_bad(flag, g1, hi, code0))
    if SUB > 2 and 2 * GS < NEXT_N:
        bad = tl.maximum(bad, _lens_bad(flag, g2, hi, code0))
    if SUB > 3 and 3 * GS < NEXT_N:
        bad = tl.maximum(bad, _lens_bad(flag, g3, hi, code0))
    if i_c == 0:
        # 16 heads at a time: a [HP, D] byte tile would take a register a byte, and a kernel's register
        # allocation is its maximum anywhere
        o_h = tl.arange(0, 16)
        o_d = tl.arange(0, D)
        nan = tl.zeros([16, D], tl.int1)
        for r in range(0, NEXT_N * HP, 16):
            j = r // HP
            h = r % HP + o_h
            b = tl.load(q + j * stride_qn + h[:, None] * stride_qh + o_d[None, :], mask=(h < H)[:, None], other=0.0)
            nan = nan | ((b.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F)
        flag_word(flag, tl.max(nan.to(tl.int32), axis=None) > 0, 0, code0 + 4)
    return bad == 0


@triton.jit
def _chunk_pages_ok(flag, p_bt, c0, end, reach, last_page, code0, PAGE: tl.constexpr, CP: tl.constexpr):
    """The page ids a program reads (columns [c0, min(end, reach)), at most CP pages; entries past the
    reach are never read) in [0, last_page]; a bad one is flagged (error words code0 + 2 / + 3). Returns 1
    if all are good: one vector load before the loop, so the loop itself is the unchecked kernel's."""
    o_p = tl.arange(0, CP)
    m_p = o_p < tl.cdiv(tl.maximum(tl.minimum(end, reach) - c0, 0), PAGE)
    ids = tl.load(p_bt + c0 // PAGE + o_p, mask=m_p, other=0)
    bad = flag_range(flag, ids, m_p, 0, last_page, code0 + 2)
    return tl.max(bad.to(tl.int32), axis=0) == 0


@triton.jit
def _program_span(q, w, context_lens, out, max_len, stride_qb, stride_qn, stride_qh, stride_w, stride_o,
                  p_bt, flag, hi, last_page, code0,
                  NEXT_N: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                  GS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, FP8_DOT: tl.constexpr,
                  CHECK: tl.constexpr, PAGE: tl.constexpr):
    """What program (g, b, c) of either paged kernel works on: the 4 sub-group tuples and reach of
    :func:`_draft_groups` for draft rows g * G .., request b (int64), the head-dim offsets ``o_d [D]``, and
    its output columns [c0, c1), of which [c0, end) are scored: whole BLOCK_N steps up to the group's
    reach (the tail past it is -inf only). With ``CHECK`` a program with a bad length has reach 0, one
    with a bad page id among the pages it reads has end c0."""
    i_g, i_b, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b64 = i_b.to(tl.int64)
    j0 = i_g * G
    q += i_b64 * stride_qb
    o_d = tl.arange(0, D)
    g0, g1, g2, g3, reach = _draft_groups(q, w, context_lens, out, i_b64, j0, o_d, stride_qn, stride_qh, stride_w,
                                          stride_o, NEXT_N, H, HP, GS, G // GS, FP8_DOT)
    if CHECK:
        ok = _program_ok(q, g0, g1, g2, g3, i_c, stride_qn, stride_qh, hi, flag, code0, NEXT_N, H, HP, D, GS, G // GS)
        reach = tl.where(ok, reach, 0)
    c0 = i_c * CHUNK
    c1 = tl.minimum(c0 + CHUNK, max_len)
    end = c0 + tl.cdiv(tl.maximum(tl.minimum(c1, reach) - c0, 0), BLOCK_N) * BLOCK_N
    if CHECK:
        # a bad page id is never read: the program's whole chunk then scores -inf
        CP: tl.constexpr = triton.next_power_of_2(CHUNK // PAGE)
        end = tl.where(_chunk_pages_ok(flag, p_bt, c0, end, reach, last_page, code0, PAGE, CP), end, c0)
    return g0, g1, g2, g3, reach, i_b64, o_d, c0, c1, end


@triton.jit
def _fill_groups(g0, g1, g2, g3, start, stop, BLOCK_N: tl.constexpr, NEXT_N: tl.constexpr, GS: tl.constexpr,
                 SUB: tl.constexpr):
    """-inf at columns [start, stop) of every sub-group's rows (the chunk's tail past the group's reach)."""
    fill_neg_inf(g0[3], g0[4], start, stop, BLOCK_N, GS)
    if SUB > 1 and GS < NEXT_N:
        fill_neg_inf(g1[3], g1[4], start, stop, BLOCK_N, GS)
    if SUB > 2 and 2 * GS < NEXT_N:
        fill_neg_inf(g2[3], g2[4], start, stop, BLOCK_N, GS)
    if SUB > 3 and 3 * GS < NEXT_N:
        fill_neg_inf(g3[3], g3[4], start, stop, BLOCK_N, GS)


@triton.jit
def _score_rows(b_k, b_ks, grp, o_t, c1, GS: tl.constexpr, HP: tl.constexpr, CHAIN: tl.constexpr):
    """Score one step's keys ``b_k [BLOCK_N, D]`` (scales ``b_ks [BLOCK_N]``, positions ``o_t``) for the GS draft
    rows of ``grp`` (a :func:`_draft_rows` tuple) and store them: ``k_scale * sum_h w * relu(k . q)`` below
    each row's length, -inf from it on."""
    b_qt, b_w, b_len, p_rows, m_j = grp
    b_l = _row_logits(b_k, b_ks, b_qt, b_w, b_len, o_t, GS, HP, CHAIN)
    # not _store_logits(.., False): it builds the mask after the pointers, which reschedules the measured
    # n = 1 kernel's SASS
    tl.store(p_rows[None, :] + o_t[:, None], b_l, mask=m_j[None, :] & (o_t[:, None] < c1))


@triton.jit
def _row_logits(b_k, b_ks, b_qt, b_w, b_len, o_t, GS: tl.constexpr, HP: tl.constexpr, CHAIN: tl.constexpr):
    """``[BLOCK_N, GS]`` logits of keys ``b_k [BLOCK_N, D]`` (scales ``b_ks``, positions ``o_t``) for GS draft rows,
    -inf at and past each row's length."""
    if CHAIN:
        # [BLOCK_N, GS * HP]; fp32 accumulation on the tensor cores
        b_l = _head_sum_chain(tl.maximum(tl.dot(b_k, b_qt), 0.0), b_w, b_k.shape[0], GS)
    else:
        b_l = gated_relu_sum(b_k, b_qt, b_w, GS, HP)
    # [BLOCK_N, GS]; k_scale > 0 leaves the relu and the head sum: one multiply per (key, row)
    b_l = b_l * b_ks[:, None]
    # per-row causal length: draft j never sees draft j + 1 (and junk past a length is discarded here)
    return tl.where(o_t[:, None] < b_len[None, :], b_l, float("-inf"))


@triton.jit
def _store_logits(p_rows, m_j, o_t, c1, b_l, ASM_STORE: tl.constexpr):
    """Store ``b_l [BLOCK_N, GS]`` at columns ``o_t`` (< c1) of the rows ``p_rows [GS]`` (valid: ``m_j``).

    ``ASM_STORE`` stores straight from the dot accumulator's layout with a predicated ``st.global`` (the
    4 threads of a quad hold the same logit and write the same word); ``tl.store`` would first move the
    tile through shared memory for coalescing, at 2 CTA barriers a store. Not for the interpreter.
    """
    p_out = p_rows[None, :] + o_t[:, None]
    m_out = m_j[None, :] & (o_t[:, None] < c1)
    if ASM_STORE:
        # the value goes in as its int32 bits: triton 3.6 refuses a pointer and a float in one inline-asm call
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
                                  "=r,l,r,r", [p_out, b_l.to(tl.int32, bitcast=True), m_out.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(p_out, b_l, mask=m_out)


@triton.jit
def indexer_logits_paged_kernel(
    q,             # [B, NEXT_N, H, D] e4m3 (uint8 bits when not FP8_DOT)
    keys,          # [P, 8448] the cache viewed as e4m3 bytes (uint8 when not FP8_DOT)
    scales,        # [P, 2112] the same cache viewed as fp32
    w,             # [B * NEXT_N, H] f32
    context_lens,  # [B, NEXT_N] i32, contiguous
    block_table,   # [B, maxp] i32
    out,           # [B * NEXT_N, max_len] f32
    max_len,
    stride_qb, stride_qn, stride_qh,
    stride_w, stride_bt, stride_o,
    flag, hi, last_page, code0,  # the device value checks (CHECK), see _program_ok
    NEXT_N: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
    G: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    PAGE: tl.constexpr, PAGE_BYTES: tl.constexpr, KEY_BYTES: tl.constexpr, FP8_DOT: tl.constexpr,
    CHAIN: tl.constexpr, NUM_STAGES: tl.constexpr, CHECK: tl.constexpr,
):
    """Program (g, b, c): draft rows g * G .. g * G + G - 1 of request b, output columns [c * CHUNK, (c + 1) * CHUNK).

    Each key block of the chunk is loaded once and scored for all G rows and all heads, as G / GS dots of
    GS rows each (1, 2 or 4 sub-groups: a narrower dot needs fewer accumulator registers; sub-groups past
    NEXT_N are compiled out). Columns past the group's longest row are only filled with -inf (no key is
    read there). The row groups of one (b, c) are adjacent program ids: they run at the same time, and
    all but the first read the pages from L2.
    """
    SUB: tl.constexpr = G // GS
    g0, g1, g2, g3, reach, i_b64, o_d, c0, c1, end = _program_span(
        q, w, context_lens, out, max_len, stride_qb, stride_qn, stride_qh, stride_w, stride_o,
        block_table + tl.program_id(1).to(tl.int64) * stride_bt, flag, hi, last_page, code0,
        NEXT_N, H, HP, D, G, GS, BLOCK_N, CHUNK, FP8_DOT, CHECK, PAGE)
    o_n = tl.arange(0, BLOCK_N)
    # num_stages on the loop itself makes Triton pipeline the scale and page-id loads too (by default
    # it pipelines only loads that feed a dot), so the page ids, keys and scales of the next
    # NUM_STAGES - 1 steps are in flight while this step computes
    for t0 in tl.range(c0, end, BLOCK_N, num_stages=NUM_STAGES):
        o_t = tl.multiple_of(t0, BLOCK_N) + o_n
        # [BLOCK_N] page of each position; positions past reach read page 0 instead of junk table entries
        i_p = tl.load(block_table + i_b64 * stride_bt + o_t // PAGE, mask=o_t < reach, other=0).to(tl.int64)
        o_in = o_t % PAGE
        # [BLOCK_N, D] keys, 128 contiguous bytes a token
        b_k = tl.load(keys + i_p[:, None] * PAGE_BYTES + o_in[:, None] * D + o_d[None, :])
        # [BLOCK_N] per-key scales after the page's keys
        b_ks = tl.load(scales + i_p * (PAGE_BYTES // 4) + KEY_BYTES // 4 + o_in)
        if not FP8_DOT:
            b_k = e4m3_bits_to_f16(b_k)
        _score_rows(b_k, b_ks, g0, o_t, c1, GS, HP, CHAIN)
        if SUB > 1 and GS < NEXT_N:
            _score_rows(b_k, b_ks, g1, o_t, c1, GS, HP, CHAIN)
        if SUB > 2 and 2 * GS < NEXT_N:
            _score_rows(b_k, b_ks, g2, o_t, c1, GS, HP, CHAIN)
        if SUB > 3 and 3 * GS < NEXT_N:
            _score_rows(b_k, b_ks, g3, o_t, c1, GS, HP, CHAIN)
    _fill_groups(g0, g1, g2, g3, end, c1, BLOCK_N, NEXT_N, GS, SUB)


@triton.jit
def _score_page(key_desc, scales, p_bt, t0, reach, o_n, g0, g1, g2, g3, c1,
                NEXT_N: tl.constexpr, GS: tl.constexpr, SUB: tl.constexpr, HP: tl.constexpr, PAGE: tl.constexpr,
                PAGE_ROWS: tl.constexpr, PAGE_WORDS: tl.constexpr, KEY_WORDS: tl.constexpr, CHAIN: tl.constexpr,
                ASM_STORE: tl.constexpr):
    """Score and store the page holding positions ``t0 .. t0 + PAGE - 1`` (``t0`` a multiple of PAGE) for
    all the program's draft rows. A page past ``reach`` reads page 0 instead of a junk table entry (never
    stored as a logit: every row masks it to -inf)."""
    # scalar page id: one TMA copy per page, no per-element address arithmetic
    i_p = tl.load(p_bt + t0 // PAGE, mask=t0 < reach, other=0)
    # [PAGE, D] keys: rows i_p * PAGE_ROWS .. + PAGE - 1 of the cache viewed as [P * PAGE_ROWS, D] e4m3
    b_k = key_desc.load([i_p * PAGE_ROWS, 0])
    # [PAGE] per-key scales after the page's keys (cp.async; by TMA too it measured 15 % slower)
    b_ks = tl.load(scales + i_p.to(tl.int64) * PAGE_WORDS + KEY_WORDS + o_n)
    # positions relative to t0: the per-element masks compare the page offset o_n against per-row scalars
    # (32-bit, one compare) instead of the absolute position against the row length
    _score_page_rows(b_k, b_ks, g0, t0, o_n, c1, GS, HP, CHAIN, ASM_STORE)
    if SUB > 1 and GS < NEXT_N:
        _score_page_rows(b_k, b_ks, g1, t0, o_n, c1, GS, HP, CHAIN, ASM_STORE)
    if SUB > 2 and 2 * GS < NEXT_N:
        _score_page_rows(b_k, b_ks, g2, t0, o_n, c1, GS, HP, CHAIN, ASM_STORE)
    if SUB > 3 and 3 * GS < NEXT_N:
        _score_page_rows(b_k, b_ks, g3, t0, o_n, c1, GS, HP, CHAIN, ASM_STORE)


@triton.jit
def _score_page_rows(b_k, b_ks, grp, t0, o_n, c1, GS: tl.constexpr, HP: tl.constexpr, CHAIN: tl.constexpr,
                     ASM_STORE: tl.constexpr):
    """One page's keys ``b_k [PAGE, D]`` (scales ``b_ks``) scored for the GS draft rows of ``grp`` and stored
    at the page's columns ``t0 + o_n``."""
    b_qt, b_w, b_len, p_rows, m_j = grp
    b_l = _row_logits(b_k, b_ks, b_qt, b_w, b_len - t0, o_n, GS, HP, CHAIN)
    _store_logits(p_rows + t0, m_j, o_n, c1 - t0, b_l, ASM_STORE)


@triton.jit
def indexer_logits_paged_tma_kernel(
    q,             # [B, NEXT_N, H, D] e4m3
    key_desc,      # TMA descriptor of the cache viewed as [P * PAGE_ROWS, D] e4m3, block [PAGE, D]
    scales,        # [P, PAGE_WORDS] the same cache viewed as fp32
    w,             # [B * NEXT_N, H] f32
    context_lens,  # [B, NEXT_N] i32, contiguous
    block_table,   # [B, maxp] i32
    out,           # [B * NEXT_N, max_len] f32
    max_len,
    stride_qb, stride_qn, stride_qh,
    stride_w, stride_bt, stride_o,
    flag, hi, last_page, code0,  # the device value checks (CHECK), see _program_ok
    NEXT_N: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
    G: tl.constexpr, GS: tl.constexpr, PAGES: tl.constexpr, CHUNK: tl.constexpr,
    PAGE: tl.constexpr, PAGE_ROWS: tl.constexpr, PAGE_WORDS: tl.constexpr, KEY_WORDS: tl.constexpr,
    CHAIN: tl.constexpr, NUM_STAGES: tl.constexpr, ASM_STORE: tl.constexpr, CHECK: tl.constexpr,
):
    """The paged kernel with the keys copied by TMA (sm_90+; the interpreter runs it too): program
    (g, b, c) as in :func:`indexer_logits_paged_kernel`, ``PAGES`` (1 or 2) whole pages a loop step.

    A page's 64 keys are one contiguous [64, 128] e4m3 tile: row ``i_p * 66`` of the cache viewed as
    [P * 66, 128] (8448 B = 66 rows of 128 B; the scales are rows 64-65). So one TMA copy per page,
    addressed by the scalar page id, replaces the per-element address arithmetic of the pointer
    kernel, and Triton pipelines it with mbarriers straight into the swizzled shared tile wgmma reads.
    With ``ASM_STORE`` the logits leave from the accumulator's registers (see :func:`_store_logits`).
    """
    SUB: tl.constexpr = G // GS
    BLOCK_N: tl.constexpr = PAGES * PAGE
    g0, g1, g2, g3, reach, i_b64, o_d, c0, c1, end = _program_span(
        q, w, context_lens, out, max_len, stride_qb, stride_qn, stride_qh, stride_w, stride_o,
        block_table + tl.program_id(1).to(tl.int64) * stride_bt, flag, hi, last_page, code0,
        NEXT_N, H, HP, D, G, GS, BLOCK_N, CHUNK, True, CHECK, PAGE)
    p_bt = block_table + i_b64 * stride_bt
    o_n = tl.arange(0, PAGE)
    for t0 in tl.range(c0, end, BLOCK_N, num_stages=NUM_STAGES):
        t0 = tl.multiple_of(t0, BLOCK_N)
        _score_page(key_desc, scales, p_bt, t0, reach, o_n, g0, g1, g2, g3, c1,
                    NEXT_N, GS, SUB, HP, PAGE, PAGE_ROWS, PAGE_WORDS, KEY_WORDS, CHAIN, ASM_STORE)
        if PAGES > 1:
            _score_page(key_desc, scales, p_bt, t0 + PAGE, reach, o_n, g0, g1, g2, g3, c1,
                        NEXT_N, GS, SUB, HP, PAGE, PAGE_ROWS, PAGE_WORDS, KEY_WORDS, CHAIN, ASM_STORE)
    _fill_groups(g0, g1, g2, g3, end, c1, BLOCK_N, NEXT_N, GS, SUB)


def _use_tma(cfg: PagedConfig, index_cache: torch.Tensor, fp8_dot: bool) -> bool:
    """The TMA kernel: by default on sm_90 (where it was measured), on request (``tma=True``) on any sm_90+
    GPU or in the interpreter. It needs fp8 dots, whole-page steps, a 16-byte aligned cache and page rows
    (66 P) that fit TMA's int32 coordinates; without them the pointer kernel runs."""
    dev = index_cache.device
    if cfg.tma is False or not fp8_dot or cfg.block_n not in (None, PAGE_SIZE, 2 * PAGE_SIZE):
        return False
    if dev.type == "cuda":
        cap = capability(dev)
        if cap < (9, 0) or (cfg.tma is None and cap != (9, 0)):
            return False
    elif not cfg.tma:
        return False
    pages = index_cache.shape[0]
    return index_cache.data_ptr() % 16 == 0 and 0 < pages * PAGE_ROWS < 2 ** 31


class _Launch(NamedTuple):
    """What a launch of one shape needs besides the tensors (built once per shape, see _launch_shape)."""
    tma: bool
    fp8_dot: bool
    shape: PagedShape
    grid: tuple[int, int, int]
    options: dict


_SHAPES: dict = {}
_TMA = KernelLauncher(indexer_logits_paged_tma_kernel,
                      ("q", "key_desc", "scales", "w", "context_lens", "block_table", "out", "flag"))
_PTR = KernelLauncher(indexer_logits_paged_kernel, ("q", "keys", "scales", "w", "context_lens", "block_table", "out",
                                                    "flag"))
_DESCS: dict = {}


def _launch_shape(key, cfg: PagedConfig, q_fp8, index_cache, max_context_len) -> _Launch:
    """The launch of ``key``'s shape: kernel choice, tiles, grid and launch options (cached per key: a
    function of shapes, the config and the device only)."""
    hit = _SHAPES.get(key)
    if hit is not None:
        return hit
    B, n, H, _ = q_fp8.shape
    fp8_dot = fp8_dot_supported(q_fp8.device) if cfg.fp8_dot is None else cfg.fp8_dot
    tma = _use_tma(cfg, index_cache, fp8_dot)
    if cfg.tma and not tma:
        raise ValueError("config: tma=True needs fp8 dots, block_n 64 or 128, an sm_90+ GPU (or the interpreter) "
                         "and a 16-byte aligned cache of < 2^31 / 66 pages")
    shape = paged_config(B, n, H, max_context_len, q_fp8.device, cfg, tma)
    grid = (cdiv(n, shape.G), B, cdiv(max_context_len, shape.chunk))
    options = {"num_warps": shape.num_warps, "num_stages": cfg.num_stages}
    if cfg.max_regs is not None:
        options["maxnreg"] = cfg.max_regs
    return remember(_SHAPES, key, _Launch(tma, fp8_dot, shape, grid, options), 1024)


def _key_desc(index_cache: torch.Tensor, cached: bool) -> TensorDescriptor:
    """TMA descriptor of the cache viewed as [P * 66, 128] e4m3: the [64, 128] block at row 66 p is page p's
    keys. ``cached``: one per (address, P), holding no reference to the cache (for planned launches)."""
    P, D = index_cache.shape[0], INDEX_KEY_BYTES // PAGE_SIZE
    if not cached:
        return TensorDescriptor(index_cache.view(torch.float8_e4m3fn).view(P * PAGE_ROWS, D),
                                shape=[P * PAGE_ROWS, D], strides=[D, 1], block_shape=[PAGE_SIZE, D])
    ptr = index_cache.data_ptr()
    desc = _DESCS.get((ptr, P))
    if desc is None:
        desc = remember(_DESCS, (ptr, P), TensorDescriptor(Address(ptr, torch.float8_e4m3fn), shape=[P * PAGE_ROWS, D],
                                                           strides=[D, 1], block_shape=[PAGE_SIZE, D]), 64)
    return desc


def indexer_logits_paged(q_fp8: torch.Tensor, index_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                         config: PagedConfig | None = None, out: torch.Tensor | None = None,
                         check: bool = False) -> torch.Tensor:
    """Paged indexer logits; arguments as :func:`flashdsa.ops.indexer_logits_paged` (shapes validated there).

    ``q_fp8 [B, n, H, 128] e4m3``, ``index_cache [P, 8448] u8``, ``weights [B * n, H] f32``,
    ``context_lens [B, n] i32``, ``block_table [B, maxp] i32`` -> ``[B * n, max_context_len] f32``.
    ``config`` overrides the launch (tests, benchmarks); ``out`` is an optional preallocated
    ``[B * n, max_context_len] f32`` buffer (every element is written); ``check``: the kernel checks the
    values first (the default mode's device checks, :func:`_program_ok`). Dispatch: the TMA kernel on
    sm_90 (see :func:`_use_tma`), the pointer kernel elsewhere.

    Host path: the launch of a shape (kernel, tiles, grid) is worked out once and the kernel launched from
    a plan (``ops/_launch.py``) whenever the pointers are 16-byte aligned.
    """
    B, n, H, D = q_fp8.shape
    dev = q_fp8.device
    out = logits_buffer(out, (B * n, max_context_len), dev)
    if out.numel() == 0:
        return out
    cfg = config or _DEFAULT
    if not index_cache.is_contiguous():
        index_cache = index_cache.contiguous()
    qs, ws, bts = q_fp8.stride(), weights.stride(), block_table.stride()
    if qs[-1] != 1:
        q_fp8 = q_fp8.contiguous()
        qs = q_fp8.stride()
    if ws[-1] != 1:
        weights = weights.contiguous()
        ws = weights.stride()
    if bts[-1] != 1:
        block_table = block_table.contiguous()
        bts = block_table.stride()
    if not context_lens.is_contiguous():
        context_lens = context_lens.contiguous()
    P = index_cache.shape[0]
    cache_ptr = index_cache.data_ptr()
    flag = error_flag(dev) if check else context_lens  # unused (compiled out) without checks: any pointer
    ptrs = (q_fp8.data_ptr(), cache_ptr, weights.data_ptr(), context_lens.data_ptr(), block_table.data_ptr(),
            out.data_ptr(), flag.data_ptr())
    # everything but the pointers: shapes, strides, ints, the config, the device, and the cache's
    # alignment (it decides TMA)
    key = (dev, B, n, H, qs, P, ws[0], block_table.shape[1], bts[0], max_context_len, out.stride(0), config,
           not cache_ptr & 15, check)
    tma, fp8_dot, shape, grid, options = _launch_shape(key, cfg, q_fp8, index_cache, max_context_len)
    if not aligned(*ptrs):
        key = None  # Triton specialises on each pointer's alignment: its own launch

    def checks():
        return dict(flag=flag, hi=min(max_context_len, block_table.shape[1] * PAGE_SIZE), last_page=P - 1,
                    code0=PAGED_CODE0, CHECK=check)

    if tma:
        def build():
            G, GS, HP, bn, chunk, chain, _ = shape
            return grid, dict(
                q=q_fp8, key_desc=_key_desc(index_cache, False), scales=index_cache.view(torch.float32), w=weights,
                context_lens=context_lens, block_table=block_table, out=out, max_len=max_context_len,
                stride_qb=q_fp8.stride(0), stride_qn=q_fp8.stride(1), stride_qh=q_fp8.stride(2),
                stride_w=weights.stride(0), stride_bt=block_table.stride(0), stride_o=out.stride(0),
                NEXT_N=n, H=H, HP=HP, D=D, G=G, GS=GS, PAGES=bn // PAGE_SIZE, CHUNK=chunk,
                PAGE=PAGE_SIZE, PAGE_ROWS=PAGE_ROWS, PAGE_WORDS=INDEX_PAGE_BYTES // 4, KEY_WORDS=INDEX_KEY_BYTES // 4,
                CHAIN=chain, NUM_STAGES=cfg.num_stages, ASM_STORE=cfg.asm_store and not interpreting(), **checks(),
                **options)

        desc = _key_desc(index_cache, True) if key is not None else None
        _TMA(key, (ptrs[0], desc, cache_ptr, *ptrs[2:]), build)
        return out

    def build():
        G, GS, HP, bn, chunk, chain, _ = shape
        keys = index_cache.view(torch.float8_e4m3fn) if fp8_dot else index_cache
        q_in = q_fp8 if fp8_dot else q_fp8.view(torch.uint8)
        return grid, dict(
            q=q_in, keys=keys, scales=index_cache.view(torch.float32), w=weights,
            context_lens=context_lens, block_table=block_table, out=out, max_len=max_context_len,
            stride_qb=q_in.stride(0), stride_qn=q_in.stride(1), stride_qh=q_in.stride(2),
            stride_w=weights.stride(0), stride_bt=block_table.stride(0), stride_o=out.stride(0),
            NEXT_N=n, H=H, HP=HP, D=D, G=G, GS=GS, BLOCK_N=bn, CHUNK=chunk,
            PAGE=PAGE_SIZE, PAGE_BYTES=INDEX_PAGE_BYTES, KEY_BYTES=INDEX_KEY_BYTES, FP8_DOT=fp8_dot,
            CHAIN=chain, NUM_STAGES=cfg.num_stages, **checks(), **options)

    _PTR(key, (ptrs[0], cache_ptr, cache_ptr, *ptrs[2:]), build)
    return out


_DEFAULT = PagedConfig()
