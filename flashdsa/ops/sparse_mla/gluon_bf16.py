"""Sparse MLA over bf16 KV rows (prefill's gathered KV, the bf16 paged cache) as a warp-specialised Gluon
kernel for Hopper (sm_90), after FlashMLA's sm90 sparse prefill schedule (issue #16). Math: ``reference.py``;
P is rounded to bf16 for the P V product, as FlashMLA does.

One CTA owns one query row and 64 heads and walks the top-k list in PAIRS of 64-token blocks with three
warpgroups (``gl.warp_specialize``, registers moved by setmaxnreg: 208 / 208 / 88):

* producer (worker): copies the rows of block 2j into buffer 0 and of block 2j + 1 into buffer 1 with
  ``cp.async`` (16 B a thread, zero-filled for skipped slots, no registers held), each buffer in two halves
  with their own barriers, L = latent dims 0..255 and R = dims 256..511 + rope, in the order the consumers
  free them (0L, 1R, 0R, 1L), so a half is refilled as soon as its last reader is done with it; every
  producer thread's ``cp.async.mbarrier.arrive`` signals a half ready. Slots are loaded a pair ahead.
* consumer 0 (default partition) computes S over block 2j, consumer 1 (worker) over block 2j + 1: each a
  full [64 heads, 64 tokens] x 576 QK (36 async m64n64k16 wgmma). The running row max is chained through
  shared memory (consumer 0 publishes its block's max, consumer 1 takes the max with its own and publishes
  the pair's), so both halves of O see one max per pair. Consumer 0 owns O[:, :256], consumer 1 O[:, 256:]:
  each multiplies its own P (registers) by its half of its own block's V and the other's P (shared memory)
  by its half of the other block's V, so both do the same tensor work (gluon.py's consumer 1 only P V).
* P of block 2j is staged in buffer 0's rope tile (consumer 0's QK, its only reader, is done by then;
  FlashMLA's trick), P of block 2j + 1 in a tile of its own.
* NoPE rows (``ROPE`` 0: [.., 512] bf16, q of 512 dims; GLM-5.3-Flash): the same schedule with the rope
  left out at compile time (no rope copies, no Q rope tile, each QK 32 wgmma); P of block 2j keeps an
  8-KB tile where buffer 0's rope tile was, freed as before (its reader's release of half 0R precedes the
  refill whose ready barrier consumer 0 waits for before its next store). Shared memory 214,432 B.

Shared memory 230,832 B: Q 72 KB + 2 x 72 KB of K/V + 8 KB of P + the max / sum exchange and barriers.
Each consumer computes its skip mask from the indices itself (a [64] load issued before it waits for the
rows), so nothing but cp.async writes the K/V buffers. Each consumer loads half of Q (every load before
its stores) and at the end writes its half of O through its half of the Q tiles, as whole 16-B stores:
that took the fixed cost of 8192 CTAs from 542 to 362 us (FlashMLA 267-276). Buffer indices are values of
the loop counter (``j >> 30``, always 0): with constant indices LLVM hoists every wgmma's shared-memory
descriptor out of the loop (1.2 KB of spills; 12 B without).

What bounds it: the consumers alone (no copies) take 3700 us at T 4096 N 8K h 128, 0.94x FlashMLA's whole
kernel; the copies add ~1150 us, and not by their latency (every row hot in L2 removes only ~150 us).
Measured on the H200 (Triton 3.6, CUDA-graph replay, 2026-12-02, two runs, top-2048): prefill T 4096 h 128
N 8K 4734 / 4780 us against FlashMLA's 4060 / 4069 (0.86 / 0.85x its throughput), N 32K h 64 0.92 / 0.95x;
decode over the bf16 cache B 64 h 128 89.7 / 90.5 us (FlashMLA's fp8 decode on the same slots 94.6-94.9).
What was tried and lost: sparse_mla/README.md. ``benchmarks/gluon_prefill_probe.py`` checks this kernel
against ``reference.py`` and times it next to FlashMLA; ``--compile-only`` compiles it without a GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from flashdsa.ops._gluon import compile_sm90 as compile_sm90_kernel
from flashdsa.ops._launch import KernelLauncher, aligned, capability
from flashdsa.ops._triton_utils import cdiv
from flashdsa.ops.sparse_mla.gluon import BLOCK_H, BLOCK_N, LN2, LOG2E, MAXNREG, load_q, mma_layout, store_o, tile_smem

# global -> shared cp.async: ``async_copy_global_to_shared`` in Triton 3.6, renamed ``async_load`` by 3.9
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# consumer 1 gets REGS_C1, consumer 0 3 x MAXNREG - REGS_C1 - REGS_PROD = 208; the producer 88 (72: 80 B of spills)
REGS_C1 = gl.constexpr(208)
REGS_PROD = gl.constexpr(88)


@gluon.jit
def _klat(k_lat, b, g: gl.constexpr):
    # the [64, 128] bf16 latent tile of group g in K/V buffer b. One allocation for all: gluon.py's one per
    # group (fewer barriers among the producer's warps between its cp.async groups) was no faster here
    return k_lat.index(b * 4 + g)


# ---- producer -----------------------------------------------------------------------------------------

@gluon.jit
def _slots(p_idx, blk, topk, L: gl.constexpr):
    # [64] raw slots of block blk in layout L (-1 past the list)
    o_n = blk * BLOCK_N + gl.arange(0, BLOCK_N, L)
    return gl.load(p_idx + o_n, mask=o_n < topk, other=-1)


@gluon.jit
def _copy_half(k_lat, k_rope, buf, RIGHT: gl.constexpr, slot, n_slots, kv, stride_kv_page, stride_kv_row, free, ready,
               phase, ROPE: gl.constexpr):
    """Wait until half (buf, RIGHT) is free, then cp.async the rows of ``slot`` ([64], SliceLayout(1, LG)) into
    that half's dims (the right half's rope only where ROPE) and have its ``ready`` barrier track the copies
    (count 128: every producer thread arrives). Skipped slots (-1 past the list, < 0, >= n_slots) are masked:
    cp.async zero-fills them, nothing is read."""
    LG: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])   # [64 rows, 128 bf16]: 16 B a thread
    # [64 rows, 64 bf16] of rope, 8 B a thread: the same rows per thread as LG, so no layout conversion
    LR: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    valid = (slot >= 0) & (slot < n_slots)
    slot = gl.where(valid, slot, 0)
    p_row = kv + (slot // 64).to(gl.int64) * stride_kv_page + (slot % 64).to(gl.int64) * stride_kv_row
    o_c = gl.arange(0, 128, gl.SliceLayout(0, LG))
    h = buf * 2 + RIGHT
    mbarrier.wait(free.index(h), phase)
    g0: gl.constexpr = 2 * RIGHT
    for g in gl.static_range(2):
        _cp_async(_klat(k_lat, buf, g0 + g), p_row[:, None] + (g0 + g) * 128 + o_c[None, :], mask=valid[:, None])
    if RIGHT:
        if ROPE:
            o_r = gl.arange(0, 64, gl.SliceLayout(0, LR))
            p_r = gl.convert_layout(p_row, gl.SliceLayout(1, LR))
            v_r = gl.convert_layout(valid, gl.SliceLayout(1, LR))
            _cp_async(k_rope.index(buf), p_r[:, None] + 512 + o_r[None, :], mask=v_r[:, None])
    async_copy.mbarrier_arrive(ready.index(h), increment_count=False)


@gluon.jit
def _producer(kv, idx, stride_kv_page, stride_kv_row, stride_i_row, n_slots, topk, n_pairs, n_hb, k_lat, k_rope,
              ready, free, ROPE: gl.constexpr):
    SG: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))   # _copy_half's rows
    i_row = (gl.program_id(0) // n_hb).to(gl.int64)
    p_idx = idx + i_row * stride_i_row
    s_a = _slots(p_idx, 0, topk, SG)
    s_b = _slots(p_idx, 1, topk, SG)
    for j in range(n_pairs):
        ph = (j & 1) ^ 1   # a fresh barrier's "previous phase" has completed: the first waits pass
        # the next pair's slots first: their load latency is then not in front of a refill (loaded after
        # this pair's copies instead: +1 %; loaded per half right before its wait, the first version: +15 %)
        n_a = _slots(p_idx, 2 * j + 2, topk, SG)
        n_b = _slots(p_idx, 2 * j + 3, topk, SG)
        # the order the halves are freed in: 0L (consumer 0's own P V), 1R (consumer 1's own P V),
        # 0R (consumer 1's P V on the other P; buffer 0's rope tile held that P), 1L (consumer 0's)
        _copy_half(k_lat, k_rope, 0, False, s_a, n_slots, kv, stride_kv_page, stride_kv_row, free, ready, ph, ROPE)
        _copy_half(k_lat, k_rope, 1, True, s_b, n_slots, kv, stride_kv_page, stride_kv_row, free, ready, ph, ROPE)
        _copy_half(k_lat, k_rope, 0, True, s_a, n_slots, kv, stride_kv_page, stride_kv_row, free, ready, ph, ROPE)
        _copy_half(k_lat, k_rope, 1, False, s_b, n_slots, kv, stride_kv_page, stride_kv_row, free, ready, ph, ROPE)
        s_a = n_a
        s_b = n_b


# ---- consumers ----------------------------------------------------------------------------------------

@gluon.jit
def _tile0(q_rope, ROPE: gl.constexpr):
    # Q's [64, 64] rope tile for load_q; ROPE 0: there is none (q_rope is ())
    t = q_rope
    if ROPE:
        t = q_rope.index(0)
    return t


@gluon.jit
def _bias(p_idx, blk, topk, n_slots, L: gl.constexpr):
    # [64] additive score mask of block blk (0 valid, -inf skipped) in layout L
    slot = _slots(p_idx, blk, topk, L)
    return gl.where((slot >= 0) & (slot < n_slots), 0.0, float("-inf"))


@gluon.jit
def _qk_half(s, q_lat, q_rope, k_lat, k_rope, buf, z, RIGHT: gl.constexpr, ready, phase, FIRST: gl.constexpr,
             ROPE: gl.constexpr):
    """Wait for half (buf, RIGHT) of the K tile, then issue its share of S += Q K^T (async, not waited): two
    latent groups, and the right half's rope where ROPE. ``z`` is 0 as a value of the loop counter (see
    :func:`_c0_pair`): it keeps Q's descriptors in the loop."""
    mbarrier.wait(ready.index(buf * 2 + RIGHT), phase)
    # cp.async wrote the tile through the generic proxy; wgmma reads it through the async proxy
    fence_async_shared()
    g0: gl.constexpr = 2 * RIGHT
    s = warpgroup_mma(q_lat.index(g0 + z), _klat(k_lat, buf, g0).permute((1, 0)), s, use_acc=not FIRST,
                      is_async=True)
    s = warpgroup_mma(q_lat.index(g0 + 1 + z), _klat(k_lat, buf, g0 + 1).permute((1, 0)), s, is_async=True)
    if RIGHT:
        if ROPE:
            s = warpgroup_mma(q_rope.index(z), k_rope.index(buf).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _exp_scores(s, bias, qk_scale, m_run):
    """p = exp2(s * qk_scale + bias - m) for the row max m = max(m_run, rowmax). Returns (p fp32, m, the m
    exp2 was taken against). A head with only skipped tokens so far keeps m = -inf; exp2 is then taken
    against 0, so -inf - -inf never makes a NaN and its p stays 0."""
    s = s * qk_scale + bias[None, :]
    m_new = gl.maximum(m_run, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    return gl.exp2(s - m_use[:, None]), m_new, m_use


@gluon.jit
def _finish(out, lse, stride_o_row, stride_o_h, stride_l_row, h_q, i_row, i_hb, o_a, o_b, m_i, l_i, l_s, l_bar,
            q_lat, WG: gl.constexpr):
    """Sum the two consumers' softmax denominators (each holds its own blocks' share, both against the
    same final max) through shared memory, then store this consumer's half of out (value dims 256 WG ..,
    and, consumer 0, lse)."""
    M64: gl.constexpr = mma_layout(64)
    M128: gl.constexpr = mma_layout(128)
    l_s.index(WG).store(l_i)
    mbarrier.arrive(l_bar.index(WG), count=1)
    mbarrier.wait(l_bar.index(1 - WG), 0)
    l_tot = l_i + l_s.index(1 - WG).load(gl.SliceLayout(1, M64))
    # empty rows (no valid index): l = 0 -> out 0 (O is 0), lse -inf
    empty = l_tot == 0.0
    l_safe = gl.where(empty, 1.0, l_tot)
    if WG == 0:
        o_hl = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, M64))
        gl.store(lse + i_row * stride_l_row + o_hl, gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2),
                 mask=o_hl < h_q)
    inv = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, M128))
    # through this consumer's half of the Q tiles (free: the other consumer has finished too, l_bar)
    store_o(out, i_row, i_hb, stride_o_row, stride_o_h, h_q, o_a, o_b, inv, 256 * WG, q_lat)


@gluon.jit
def _c0_pair(j, s, bias, m_i, l_i, o0, o1, qk_scale, k_lat, k_rope, p1_s, m_s, m_bar, s_bar, free):
    """Consumer 0 on pair j from its S = Q K_{2j}^T (complete): softmax, the pair's max from consumer 1, O[:, :256]
    += P0 V0 (local P) and P1 V1 (consumer 1's P, issued and NOT waited: 2 wgmma groups in flight)."""
    M64: gl.constexpr = mma_layout(64)
    M128: gl.constexpr = mma_layout(128)
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M128, k_width=2)
    ph = j & 1
    # buffer 0 / 1 as values of j (always 0 / 1): with constant buffer indices LLVM hoists every wgmma's
    # shared-memory descriptor out of the loop (~50 64-bit values live: 1.2 KB of spills)
    b0 = j >> 30
    b1 = b0 + 1
    p, m0, m_use = _exp_scores(s, bias, qk_scale, m_i)
    # publish this block's max for consumer 1 (which takes the pair's max and publishes it back)
    m_s.index(0).store(m0)
    mbarrier.arrive(m_bar.index(0), count=1)
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    a_o = gl.convert_layout(alpha, gl.SliceLayout(1, M128))
    o0 = o0 * a_o[:, None]
    o1 = o1 * a_o[:, None]
    pa = gl.convert_layout(p.to(gl.bfloat16), PA)
    o0 = warpgroup_mma(pa, _klat(k_lat, b0, 0), o0, is_async=True)
    o1 = warpgroup_mma(pa, _klat(k_lat, b0, 1), o1, is_async=True)
    # the pair's max from consumer 1: P rescaled to it, rounded to bf16 once (from fp32), staged for
    # consumer 1 in buffer 0's rope tile (this QK, its only reader, has completed)
    mbarrier.wait(m_bar.index(1), ph)
    m1 = m_s.index(1).load(gl.SliceLayout(1, M64))
    m1_use = gl.where(m1 == float("-inf"), 0.0, m1)
    sc = gl.exp2(m0 - m1_use)   # m0 = -inf: p is 0 and sc 0 (never exp2 of a huge positive)
    k_rope.index(b0).store((p * sc[:, None]).to(gl.bfloat16))
    fence_async_shared()
    mbarrier.arrive(s_bar.index(0), count=1)
    l_i = l_i * sc
    o0, o1, pa = warpgroup_mma_wait(0, deps=(o0, o1, pa))
    mbarrier.arrive(free.index(0), count=1)   # 0L: its last reader done
    a_o = gl.convert_layout(sc, gl.SliceLayout(1, M128))
    o0 = o0 * a_o[:, None]
    o1 = o1 * a_o[:, None]
    # O[:, :256] += P1 V1[:, :256], P1 from consumer 1 through shared memory
    mbarrier.wait(s_bar.index(1), ph)
    o0 = warpgroup_mma(p1_s, _klat(k_lat, b1, 0), o0, is_async=True)
    o1 = warpgroup_mma(p1_s, _klat(k_lat, b1, 1), o1, is_async=True)
    return m1, l_i, o0, o1


@gluon.jit
def _consumer0(q, idx, out, lse, stride_q_row, stride_q_h, stride_i_row, stride_o_row, stride_o_h, stride_l_row,
               n_slots, h_q, topk, n_pairs, n_hb, qk_scale, q_lat, q_rope, k_lat, k_rope, p1_s, m_s, l_s, ready, free,
               q_bar, m_bar, s_bar, l_bar, ROPE: gl.constexpr):
    M64: gl.constexpr = mma_layout(64)
    M128: gl.constexpr = mma_layout(128)
    t = gl.program_id(0)
    i_hb = t % n_hb
    i_row = (t // n_hb).to(gl.int64)
    p_idx = idx + i_row * stride_i_row
    # latent groups 0 and 1 of Q; consumer 1 loads the rest, and both wait for both halves
    load_q(q, stride_q_row, stride_q_h, h_q, i_row, i_hb, q_lat, _tile0(q_rope, ROPE), 1, ROPE)
    mbarrier.arrive(q_bar, count=1)
    mbarrier.wait(q_bar, 0)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, M64))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, M64))
    o0 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    o1 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    for j in range(n_pairs):
        b0 = j >> 30
        bias = _bias(p_idx, 2 * j, topk, n_slots, gl.SliceLayout(0, M64))
        # made in the loop: a zero accumulator carried across it would hold 32 registers
        s = _qk_half(gl.zeros([BLOCK_H, BLOCK_N], gl.float32, M64), q_lat, q_rope, k_lat, k_rope, b0, b0, False,
                     ready, j & 1, True, ROPE)
        s = _qk_half(s, q_lat, q_rope, k_lat, k_rope, b0, b0, True, ready, j & 1, False, ROPE)
        s = warpgroup_mma_wait(0, deps=(s,))
        m_i, l_i, o0, o1 = _c0_pair(j, s, bias, m_i, l_i, o0, o1, qk_scale, k_lat, k_rope, p1_s, m_s, m_bar, s_bar,
                                    free)
        o0, o1 = warpgroup_mma_wait(0, deps=(o0, o1))
        mbarrier.arrive(free.index(2), count=1)   # 1L
    _finish(out, lse, stride_o_row, stride_o_h, stride_l_row, h_q, i_row, i_hb, o0, o1, m_i, l_i, l_s, l_bar, q_lat, 0)


@gluon.jit
def _consumer1(q, idx, out, lse, stride_q_row, stride_q_h, stride_i_row, stride_o_row, stride_o_h, stride_l_row,
               n_slots, h_q, topk, n_pairs, n_hb, qk_scale, q_lat, q_rope, k_lat, k_rope, p1_s, m_s, l_s, ready, free,
               q_bar, m_bar, s_bar, l_bar, ROPE: gl.constexpr):
    M64: gl.constexpr = mma_layout(64)
    M128: gl.constexpr = mma_layout(128)
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M128, k_width=2)
    t = gl.program_id(0)
    i_hb = t % n_hb
    i_row = (t // n_hb).to(gl.int64)
    p_idx = idx + i_row * stride_i_row
    load_q(q, stride_q_row, stride_q_h, h_q, i_row, i_hb, q_lat, _tile0(q_rope, ROPE), 2, ROPE)
    mbarrier.arrive(q_bar, count=1)
    mbarrier.wait(q_bar, 0)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, M64))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, M64))
    o2 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    o3 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    for j in range(n_pairs):
        ph = j & 1
        b0 = j >> 30   # 0 and 1, see _c0_pair
        b1 = b0 + 1
        bias = _bias(p_idx, 2 * j + 1, topk, n_slots, gl.SliceLayout(0, M64))
        # the right half first: it is freed first (by this consumer's own P V)
        s = _qk_half(gl.zeros([BLOCK_H, BLOCK_N], gl.float32, M64), q_lat, q_rope, k_lat, k_rope, b1, b0, True, ready,
                     ph, True, ROPE)
        s = _qk_half(s, q_lat, q_rope, k_lat, k_rope, b1, b0, False, ready, ph, False, ROPE)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.wait(m_bar.index(0), ph)
        m0 = m_s.index(0).load(gl.SliceLayout(1, M64))
        p, m1, m_use = _exp_scores(s, bias, qk_scale, m0)
        m_s.index(1).store(m1)
        mbarrier.arrive(m_bar.index(1), count=1)
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m1
        a_o = gl.convert_layout(alpha, gl.SliceLayout(1, M128))
        o2 = o2 * a_o[:, None]
        o3 = o3 * a_o[:, None]
        p16 = p.to(gl.bfloat16)
        pa = gl.convert_layout(p16, PA)
        o2 = warpgroup_mma(pa, _klat(k_lat, b1, 2), o2, is_async=True)
        o3 = warpgroup_mma(pa, _klat(k_lat, b1, 3), o3, is_async=True)
        # P1 for consumer 0. Its P1 V1 of the previous pair has completed: consumer 0 waits for it before it
        # computes the softmax whose max (m_bar 0) this consumer waited for above.
        p1_s.store(p16)
        fence_async_shared()
        mbarrier.arrive(s_bar.index(1), count=1)
        o2, o3, pa = warpgroup_mma_wait(0, deps=(o2, o3, pa))
        mbarrier.arrive(free.index(3), count=1)   # 1R
        # O[:, 256:] += P0 V0[:, 256:], P0 from consumer 0 in buffer 0's rope tile
        mbarrier.wait(s_bar.index(0), ph)
        o2 = warpgroup_mma(k_rope.index(b0), _klat(k_lat, b0, 2), o2, is_async=True)
        o3 = warpgroup_mma(k_rope.index(b0), _klat(k_lat, b0, 3), o3, is_async=True)
        o2, o3 = warpgroup_mma_wait(0, deps=(o2, o3))
        mbarrier.arrive(free.index(1), count=1)   # 0R (and P0 with it)
    _finish(out, lse, stride_o_row, stride_o_h, stride_l_row, h_q, i_row, i_hb, o2, o3, m_i, l_i, l_s, l_bar, q_lat, 1)


# ---- the kernel ---------------------------------------------------------------------------------------

@gluon.jit(do_not_specialize=["stride_i_row", "stride_l_row", "n_slots", "h_q", "topk", "n_pairs", "n_hb", "n_tiles"])
def sparse_mla_bf16_ws_kernel(
    q, kv, idx, out, lse,
    stride_q_row, stride_q_h, stride_kv_page, stride_kv_row, stride_i_row, stride_o_row, stride_o_h, stride_l_row,
    n_slots, h_q, topk, n_pairs, n_hb, n_tiles, qk_scale, ROPE: gl.constexpr,
):
    """Warp-specialised sparse MLA over bf16 rows, one (query row, 64 heads) per CTA (module docstring).

    ROPE: the rows' rope dims, 64 or 0 (NoPE: no rope copies, tiles or wgmma); D = 512 + ROPE.
    q    [R, h_q, D] bf16 (unit stride last)             idx [R, topk] int32 slots (unit stride last)
    kv   bf16 rows of D: slot -> kv + (slot // 64) * stride_kv_page + (slot % 64) * stride_kv_row
         (element strides, multiples of 8: rows 16-byte aligned); prefill's [N, D] with page stride 64 x row
    out  [R, h_q, 512] bf16 (unit stride last)           lse [R, h_q] fp32, natural log
    n_pairs = max(1, cdiv(topk, 128)); n_hb = cdiv(h_q, 64); qk_scale = sm_scale * log2(e). n_tiles = R * n_hb,
    the grid, is not read: it keeps qk_scale's place in the parameter block, so the SASS is the one measured.
    """
    T: gl.constexpr = tile_smem(BLOCK_N, 128)
    TR: gl.constexpr = tile_smem(BLOCK_N, 64)
    V1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], T)
    if ROPE:
        q_rope = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, 64], TR)
    else:
        q_rope = ()  # no value (a None cannot be passed into the partitions)
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [8, BLOCK_N, 128], T)    # buffer b, latent group g: b * 4 + g
    if ROPE:
        k_rope = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, 64], TR)   # buffer 0's also stages P0
    else:
        k_rope = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 64], TR)   # P0's tile only
    p1_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], TR)
    m_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], V1)
    l_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], V1)
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())   # half h = buffer * 2 + right
    free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    m_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    s_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for h in gl.static_range(4):
        # every producer thread's cp.async arrive
        mbarrier.init(ready.index(h), count=128)
        mbarrier.init(free.index(h), count=1)      # the half's last reader
    for w in gl.static_range(2):
        mbarrier.init(m_bar.index(w), count=1)
        mbarrier.init(s_bar.index(w), count=1)
        mbarrier.init(l_bar.index(w), count=1)
    mbarrier.init(q_bar, count=2)   # each consumer's half of Q
    fence_async_shared()

    gl.warp_specialize([
        (_consumer0, (q, idx, out, lse, stride_q_row, stride_q_h, stride_i_row, stride_o_row, stride_o_h, stride_l_row,
                      n_slots, h_q, topk, n_pairs, n_hb, qk_scale, q_lat, q_rope, k_lat, k_rope, p1_s, m_s, l_s,
                      ready, free, q_bar, m_bar, s_bar, l_bar, ROPE)),
        (_consumer1, (q, idx, out, lse, stride_q_row, stride_q_h, stride_i_row, stride_o_row, stride_o_h, stride_l_row,
                      n_slots, h_q, topk, n_pairs, n_hb, qk_scale, q_lat, q_rope, k_lat, k_rope, p1_s, m_s, l_s,
                      ready, free, q_bar, m_bar, s_bar, l_bar, ROPE)),
        (_producer, (kv, idx, stride_kv_page, stride_kv_row, stride_i_row, n_slots, topk, n_pairs, n_hb, k_lat, k_rope,
                     ready, free, ROPE)),
    ], [4, 4], [REGS_C1, REGS_PROD])


# ---- launcher -----------------------------------------------------------------------------------------

def kernel_args(q3, kv, stride_kv_page, stride_kv_row, n_slots, i2, sm_scale, o3, l2):
    """(grid, kwargs) of one launch over R rows: q3 [R, h_q, D] bf16 (D 576, NoPE 512), kv bf16 rows of D, i2
    [R, topk] int32, o3 [R, h_q, 512] bf16, l2 [R, h_q] fp32. ROPE is q's rope dims."""
    R, h_q, _ = q3.shape
    rope = q3.shape[-1] - 512
    assert rope in (0, 64) and kv.shape[-1] == q3.shape[-1], (q3.shape, kv.shape)
    topk = i2.shape[-1]
    n_hb = cdiv(h_q, 64)
    return (R * n_hb,), dict(
        q=q3, kv=kv, idx=i2, out=o3, lse=l2, n_tiles=R * n_hb,
        stride_q_row=q3.stride(0), stride_q_h=q3.stride(1), stride_kv_page=stride_kv_page, stride_kv_row=stride_kv_row,
        stride_i_row=i2.stride(0), stride_o_row=o3.stride(0), stride_o_h=o3.stride(1), stride_l_row=l2.stride(0),
        n_slots=n_slots, h_q=h_q, topk=topk, n_pairs=max(1, cdiv(topk, 128)), n_hb=n_hb, qk_scale=sm_scale * LOG2E,
        ROPE=rope, num_warps=4, maxnreg=MAXNREG)


def compiled_kernel(q3, kv, idx, sm_scale):
    """Launch once over prefill-shaped inputs (q3 [T, h_q, D] bf16, kv [N, D] bf16, D 576 or 512; idx [T, topk]
    int32) and return the compiled kernel (``n_regs``, ``n_spills``, ``metadata.shared``)."""
    T, h_q, _ = q3.shape
    out = torch.empty(T, h_q, 512, dtype=torch.bfloat16, device=q3.device)
    lse = torch.empty(T, h_q, dtype=torch.float32, device=q3.device)
    grid, kw = kernel_args(q3, kv, 64 * kv.stride(0), kv.stride(0), kv.shape[0], idx, sm_scale, out, lse)
    return sparse_mla_bf16_ws_kernel[grid](**kw)


def compile_sm90(rope: int = 64):
    """The kernel compiled for sm_90 without a GPU (prefill-shaped: T 4, h_q 128, N 4096, top-2048) for rows
    with ``rope`` rope dims (64: 576-dim rows, 0: 512-dim NoPE rows): the CPU test's check and the prefill
    probe's ``--compile-only``."""
    q3 = torch.empty(4, 128, 512 + rope, dtype=torch.bfloat16)
    kv = torch.empty(4096, 512 + rope, dtype=torch.bfloat16)
    i2 = torch.empty(4, 2048, dtype=torch.int32)
    o3, l2 = torch.empty(4, 128, 512, dtype=torch.bfloat16), torch.empty(4, 128)
    _, kw = kernel_args(q3, kv, 64 * kv.stride(0), kv.stride(0), kv.shape[0], i2, (512 + rope) ** -0.5, o3, l2)
    return compile_sm90_kernel(sparse_mla_bf16_ws_kernel, kw)


_LAUNCHER = KernelLauncher(sparse_mla_bf16_ws_kernel, ("q", "kv", "idx", "out", "lse"))


def unsupported(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> str | None:
    """Why this kernel cannot run a (validated) call over bf16 rows ``kv`` of D dims (prefill's [N, D] or the
    bf16 paged cache [P, 64, D]; D 576, or 512 for NoPE rows, q's last dim: the op checks that they match), or
    None when it can: an sm_90 GPU, bf16 KV with 16-byte aligned rows, a bf16 query with h_q a multiple of
    64, d_v 512."""
    if kv.dtype != torch.bfloat16:
        return f"bf16 KV (got {kv.dtype})"
    if d_v != 512:
        return f"d_v 512 (got {d_v})"
    if q.dtype != torch.bfloat16 or q.shape[-2] % 64:
        return f"a bfloat16 q with h_q a multiple of 64 (got {q.dtype}, h_q {q.shape[-2]})"
    if q.device.type != "cuda" or capability(q.device) != (9, 0):
        return f"an sm_90 GPU (got {q.device})"
    # rows with a non-unit inner stride are copied first (as the Triton path does), and a copy is aligned
    if kv.stride(-1) == 1 and (kv.data_ptr() % 16 or any(s % 8 for s in kv.stride()[:-1])):
        return "16-byte aligned KV rows (data_ptr and row / page strides multiples of 16 bytes)"
    return None


def _run(q3, kv, stride_kv_page, stride_kv_row, n_slots, i2, sm_scale, out3, lse2):
    R, h_q, d = q3.shape
    if R == 0 or h_q == 0:  # no program to launch (a grid of 0 is a launch error)
        return
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    if i2.stride(-1) != 1:
        i2 = i2.contiguous()
    ptrs = (q3.data_ptr(), kv.data_ptr(), i2.data_ptr(), out3.data_ptr(), lse2.data_ptr())
    key = (q3.device, R, h_q, d, i2.shape[1], q3.stride(), stride_kv_page, stride_kv_row, i2.stride(0), n_slots,
           sm_scale) if aligned(*ptrs) else None

    def build():
        return kernel_args(q3, kv, stride_kv_page, stride_kv_row, n_slots, i2, sm_scale, out3, lse2)

    _LAUNCHER(key, ptrs, build)


def sparse_mla_prefill(q, kv, indices, sm_scale, d_v):
    """The Gluon backend of :func:`flashdsa.ops.sparse_mla_prefill` (inputs validated there and
    :func:`unsupported` None): q [T, h_q, D] bf16, kv [N, D] bf16 (D 576, NoPE 512; rows with a non-unit inner
    stride are copied first), indices [T, topk] int32 -> out [T, h_q, 512] bf16, lse [T, h_q] fp32."""
    T, h_q, _ = q.shape
    out = torch.empty(T, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(T, h_q, dtype=torch.float32, device=q.device)
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    _run(q, kv, 64 * kv.stride(0), kv.stride(0), kv.shape[0], indices, sm_scale, out, lse)
    return out, lse


def sparse_mla_decode(q, kv_cache, indices, sm_scale, d_v, kv_scale):
    """The Gluon backend of :func:`flashdsa.ops.sparse_mla_decode` over the bf16 paged cache [P, 64, D] (D 576,
    NoPE 512; validated there, :func:`unsupported` None): q [B, s_q, h_q, D] bf16, indices [B, s_q, topk] int32
    -> out [B, s_q, h_q, 512] bf16, lse [B, s_q, h_q] fp32."""
    B, s_q, h_q, d = q.shape
    R, topk = B * s_q, indices.shape[-1]
    out = torch.empty(B, s_q, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, s_q, h_q, dtype=torch.float32, device=q.device)
    _run(q.reshape(R, h_q, d), kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[0] * 64,
         indices.reshape(R, topk), sm_scale, out.view(R, h_q, d_v), lse.view(R, h_q))
    return out, lse
