"""Sparse MLA decode over the fp8 656-B paged cache (and its 528-B NoPE rows) as a warp-specialised Gluon
kernel for Hopper (sm_90), after FlashMLA's sm90 sparse fp8 decode schedule (issue #16).
``flashdsa.ops.sparse_mla_decode`` runs it where :func:`unsupported` says it applies; the interpreter cannot
run Gluon, so CI covers the Triton path and ``-m gpu`` tests this one. Math: ``reference.py``, the latent
dequantised with its arithmetic for any scale (e4m3 -> fp32, times the fp32 scale, rounded once to bf16); P
is rounded to bf16 for P V.

One CTA owns one query row and 64 heads (h_q 128: two CTAs, next to each other in the grid so the second
one's gathers hit L2) and walks the top-k list in steps of 64 tokens with three warpgroups
(``gl.warp_specialize``, 12 warps at ``maxnreg`` 168, registers moved by setmaxnreg):

* producer (worker, 152 registers): loads step i + 1's slots during step i; issues all of a step's 16-B
  gathers (:func:`gather_layout`) before it waits for a free buffer (``k_free``), so their latency runs
  under the consumers' work; dequantises into the buffer's tiles (4 x [64, 128] latent + [64, 64] rope,
  bf16, NVMMA-swizzled) and a [64] 0 / -inf mask, then ``k_ready``; last, asks L2 for step i + 2's rows.
* consumer 0 (default partition, 192 registers): S = Q K^T [64 heads, 64 tokens] over 576 dims (36 async
  m64n64k16 wgmma, Q and K from shared memory, one wait), the online softmax in the exp2 domain, then
  O[:, :256] += P V with P from registers; while that P V runs it hands P and the rescale factor to
  consumer 1 through shared memory (``p_ready`` / ``p_free``).
* consumer 1 (worker, 160 registers): O[:, 256:] += P V with P and V from shared memory; it never computes S.

Shared memory 230,720 B: Q 72 KB (O leaves through it at the end, as whole 16-B stores) + 2 x 72.5 KB of
K/V + 8 KB of P; a third K/V buffer does not fit in 227 KB. A buffer is free (``k_free``, count 256) when
every thread of both consumers has arrived after its P V on it, each thread by itself (``_release``): one
thread after a barrier among the warpgroup's warps made the fastest warp wait for the slowest (+4 %).
Triton's shared-memory hazard analysis places the other barriers among a partition's warps, and the code
is shaped around it (``ops/_gluon_sync.py``): it fences stores per allocation, so each latent group has its
own (the producer meets 2 barriers a step, not 5); Q's stores get one explicit barrier before the loop,
not one in front of every step's S; and the barrier after the one-thread ``p_ready`` arrive falls behind
the P V wait, where the warps are in step (consumer 0 meets 2 a step, consumer 1 one).

NoPE rows (``ROPE`` 0: 528 B, q of 512 dims; GLM-5.3-Flash) run the same schedule with the rope left out
at compile time: no rope tiles (shared memory 206,192 B), no rope loads in the producer or ``load_q``, S
over the 512 latent dims (32 wgmma), 5 lines a row asked into L2 instead of 6. The ROPE 64 kernel is the
SASS it was before the constexpr existed. (Not timed yet.)

What bounds it: the consumers. Alone (no gathers, no dequantisation) they took 99.6-101.7 us at B 64 h 128
top-2048, ~3.2 us a step against ~1.2 us of tensor work: QK as m64n64k16 with both operands in shared
memory uses all of its bandwidth, and the softmax sits between QK and P V (FlashMLA: 2.95 us a step). The
producer adds ~10 us, its gathers and shared stores (the dequantisation's arithmetic costs nothing there).
Measured on the H200 (Triton 3.6, CUDA-graph replay, 2026-12-02, two runs): B 64 s_q 1 h 128 top-2048
102.2 / 102.3 us against FlashMLA's 94.6 / 94.7 (1.08x), B 64 s_q 2 1.09x, B 128 s_q 2 h 64 0.91x.
What was tried and lost: sparse_mla/README.md. ``benchmarks/gluon_sparse_mla_probe.py`` checks this kernel
against ``reference.py`` and times it next to FlashMLA; ``--compile-only`` compiles it without a GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from flashdsa.cache.layouts import MLA_FP8_BYTES, MLA_FP8_NOPE_BYTES
from flashdsa.ops._gluon import compile_sm90 as compile_sm90_kernel
from flashdsa.ops._gluon_sync import release as _release, warps_barrier as _warps_barrier
from flashdsa.ops._launch import KernelLauncher, aligned, capability
from flashdsa.ops._triton_utils import cdiv, num_sms
from flashdsa.ops.sparse_mla.triton import combine_splits

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)
BLOCK_H = gl.constexpr(64)   # heads per CTA: the wgmma M side of one warpgroup
BLOCK_N = gl.constexpr(64)   # selected tokens per step
NBUF = gl.constexpr(2)       # K/V buffers (a third does not fit)
PREFETCH = gl.constexpr(2)   # a row is asked into L2 this many steps before its gather (3: slower)
MAXNREG = 168  # 12 warps x 32 threads x 168 registers = 64,512 <= 65,536: one CTA per SM
# consumer 1 needs 160 (152 spills), consumer 0 192, the producer gets the rest of 3 x 168
REGS_C1 = gl.constexpr(160)
REGS_PROD = gl.constexpr(152)


# ---- layouts ------------------------------------------------------------------------------------------

@gluon.constexpr_function
def mma_layout(n):
    # wgmma accumulator of one warpgroup (4 warps along M = 64 rows), instruction m64 n k16
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def gather_layout():
    """[64 rows, 128 bytes] of one latent group, 16 B a thread (one 16-B global load), stored dequantised (16
    bf16 a thread as two 16-B stores) into the 128-B-swizzled [64, 128] bf16 tile, whose two 64-column
    halves lie 8 KB apart on the same banks. A warp's load covers 4 rows x 128 bytes, with the lanes
    reordered: lanes 0-3 hold columns 0-63 of row 0, lanes 4-7 the same columns of row 1, lanes 8-15
    columns 64-127 of both. Shared memory serves a 16-B store in phases of 8 lanes; a phase's two rows
    differ in the swizzle's low bit, so its 8 lanes hit 8 bank groups: no conflict, and no more rows' lines
    per load than 8 threads a row would touch. tests/ops/test_sparse_mla_gluon.py derives both from
    Triton's linear layouts."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [16, 0], [32, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [0, 64], [2, 0]],
        warp_bases=[[4, 0], [8, 0]], block_bases=[], shape=[64, 128])


@gluon.constexpr_function
def rope_layout():
    """[64 rows, 64 bf16] of rope, 16 B a thread, with the rows of :func:`gather_layout` in the same threads
    (the row pointers pass between the two without a shuffle through shared memory); columns 0-63 of a row
    over lanes 0-3 and 8-11, so a phase's two rows again hit 8 bank groups."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [16, 0], [32, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [0, 8], [2, 0]],
        warp_bases=[[4, 0], [8, 0]], block_bases=[], shape=[64, 64])


@gluon.constexpr_function
def scales_layout():
    """[64 rows, 4] fp32: a row's four scales (bytes 512-527, 16-B aligned) in one thread as one 16-B load,
    rows in the threads of :func:`gather_layout` (replicated over its column lanes), so each [64] column
    split off it is already in the gather layout's row slice."""
    z = [0, 0]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [16, 0], [32, 0]],
                                      lane_bases=[z, z, [1, 0], z, [2, 0]],
                                      warp_bases=[[4, 0], [8, 0]], block_bases=[], shape=[64, 4])


@gluon.constexpr_function
def tile_smem(rows, cols):
    # bf16 tile read by wgmma (128-B swizzle)
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


# ---- producer -----------------------------------------------------------------------------------------

@gluon.jit
def _prefetch_rows(p_row, valid, o_l, ROPE: gl.constexpr):
    """Ask L2 for the 128-B lines of each valid row (``prefetch.global.L2``: an LSU op, no register result,
    nothing to wait for): 6 of a 656-B row, 5 of a 528-B NoPE row. p_row / valid [64] in SliceLayout(1, L),
    o_l = 128 * arange(8) in SliceLayout(0, L); a row starts 16-B aligned (at most 112 B into its first
    line), so its bytes lie in the lines of the offsets below its width (0..640, NoPE 0..512)."""
    ROW: gl.constexpr = 528 + 2 * ROPE
    m = valid[:, None] & (o_l[None, :] < ROW)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [p_row[:, None] + o_l[None, :], m.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _slots(p_idx, k0, topk, n_slots, kv, stride_kv_page, stride_kv_row, L: gl.constexpr):
    """[64] slots of the step at k0 in layout L -> (row pointers, valid). -1 past the list; skipped slots
    point at slot 0 and every load of them is masked (zeros), so a NaN there cannot reach P V via 0 * NaN."""
    o_n = k0 + gl.arange(0, BLOCK_N, L)
    b_slot = gl.load(p_idx + o_n, mask=o_n < topk, other=-1)
    valid = (b_slot >= 0) & (b_slot < n_slots)
    b_slot = gl.where(valid, b_slot, 0)
    return kv + (b_slot // 64).to(gl.int64) * stride_kv_page + (b_slot % 64).to(gl.int64) * stride_kv_row, valid


@gluon.jit
def _gather(p_row, valid, o_c, o_r, SR: gl.constexpr, ROPE: gl.constexpr):
    """One step's loads of the rows at ``p_row`` (``valid`` masks; [64] in the latent layout): [64, 128] u8 x 4
    latent groups, the [64, 4] f32 scales (byte 512, :func:`scales_layout`) split into four [64] columns,
    [64, 64] bf16 rope (byte 528, rows in layout SR; ROPE 0: (), the row ends at the scales)."""
    p_lat = p_row[:, None] + o_c[None, :]
    m_lat = valid[:, None]
    b_u0 = gl.load(p_lat, mask=m_lat, other=0)
    b_u1 = gl.load(p_lat + 128, mask=m_lat, other=0)
    b_u2 = gl.load(p_lat + 256, mask=m_lat, other=0)
    b_u3 = gl.load(p_lat + 384, mask=m_lat, other=0)
    LS: gl.constexpr = scales_layout()
    SS: gl.constexpr = gl.SliceLayout(1, LS)
    p_sc = (gl.convert_layout(p_row, SS) + 512).to(gl.pointer_type(gl.float32))
    o_s = gl.arange(0, 4, gl.SliceLayout(0, LS))
    b_sc = gl.load(p_sc[:, None] + o_s[None, :], mask=gl.convert_layout(valid, SS)[:, None], other=0.0)
    # [64, 4] -> (scale 0 and 2, scale 1 and 3) -> the four columns
    s02, s13 = gl.split(b_sc.reshape([64, 2, 2]))
    b_s0, b_s2 = gl.split(s02)
    b_s1, b_s3 = gl.split(s13)
    SG: gl.constexpr = p_row.type.layout
    b_s0 = gl.convert_layout(b_s0, SG)
    b_s1 = gl.convert_layout(b_s1, SG)
    b_s2 = gl.convert_layout(b_s2, SG)
    b_s3 = gl.convert_layout(b_s3, SG)
    if ROPE:
        p_rope = (gl.convert_layout(p_row, SR) + 528).to(gl.pointer_type(gl.bfloat16))
        b_rope = gl.load(p_rope[:, None] + o_r[None, :], mask=gl.convert_layout(valid, SR)[:, None], other=0.0)
    else:
        b_rope = ()  # no value (a None cannot be returned in a tuple)
    return b_u0, b_u1, b_u2, b_u3, b_s0, b_s1, b_s2, b_s3, b_rope


@gluon.jit
def _dequant(b_u, b_sc):
    """[64, 128] e4m3 bytes times their row's fp32 scale [64] -> [64, 128] bf16, reference.py's rounding: per
    two elements one e4m3x2 -> f16x2 unpack, two f16 -> f32, two FMUL and one f32x2 -> bf16x2 pack."""
    return (b_u.to(gl.float8e4nv, bitcast=True).to(gl.float32) * b_sc[:, None]).to(gl.bfloat16)


@gluon.jit
def _stage(tiles, valid, k_lat, k_rope, k_bias, k_ready, b, ROPE: gl.constexpr):
    """Dequantise a step's :func:`_gather` tiles into buffer ``b`` with the [64] additive score mask (0 valid,
    -inf skipped), then publish it to the consumers (ROPE 0: no rope tile, ``k_rope`` ())."""
    b_u0, b_u1, b_u2, b_u3, b_s0, b_s1, b_s2, b_s3, b_rope = tiles
    k_lat[0].index(b).store(_dequant(b_u0, b_s0))
    k_lat[1].index(b).store(_dequant(b_u1, b_s1))
    k_lat[2].index(b).store(_dequant(b_u2, b_s2))
    k_lat[3].index(b).store(_dequant(b_u3, b_s3))
    if ROPE:
        k_rope.index(b).store(b_rope)
    k_bias.index(b).store(gl.where(valid, 0.0, float("-inf")))
    # generic-proxy stores -> async-proxy (wgmma) reads
    fence_async_shared()
    mbarrier.arrive(k_ready.index(b), count=1)


@gluon.jit
def _producer(kv, idx, stride_kv_page, stride_kv_row, stride_i_row, n_slots, topk, n_steps, n_hb,
              k_lat, k_rope, k_bias, k_ready, k_free, ROPE: gl.constexpr):
    """Gather, dequantise and stage the K/V tile of every step, the slot loads out of the gathers' critical
    path: step i + 1's row pointers come from slots loaded during step i, and step i + PREFETCH's rows are
    asked into L2 at the end of step i (their slots loaded at its top, so that load's latency hides under
    the dequantisation). The gathered bytes are not carried across iterations: a u8 tensor carried by the
    loop costs a 32-bit register per byte (ptxas spilled 4.6 KB when it was tried)."""
    LG: gl.constexpr = gather_layout()   # [64 rows, 128 bytes]
    LR: gl.constexpr = rope_layout()     # [64 rows, 64 bf16]
    LP: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])   # [64 rows, 8 lines] L2 prefetches
    SG: gl.constexpr = gl.SliceLayout(1, LG)
    SR: gl.constexpr = gl.SliceLayout(1, LR)
    i_row = (gl.program_id(0) // n_hb).to(gl.int64)
    p_idx = idx + i_row * stride_i_row
    o_c = gl.arange(0, 128, gl.SliceLayout(0, LG))
    o_r = gl.arange(0, 64, gl.SliceLayout(0, LR))

    o_l = gl.arange(0, 8, gl.SliceLayout(0, LP)) * 128
    for j in range(1, PREFETCH):
        p_pf, v_pf = _slots(p_idx, j * BLOCK_N, topk, n_slots, kv, stride_kv_page, stride_kv_row,
                            gl.SliceLayout(1, LP))
        _prefetch_rows(p_pf, v_pf, o_l, ROPE)
    p_row, valid = _slots(p_idx, 0, topk, n_slots, kv, stride_kv_page, stride_kv_row, SG)
    for i in range(n_steps):
        b = i % NBUF
        # next step's row pointers (carried), this iteration's L2 prefetch slots
        p_row_n, valid_n = _slots(p_idx, (i + 1) * BLOCK_N, topk, n_slots, kv, stride_kv_page, stride_kv_row, SG)
        p_pf, v_pf = _slots(p_idx, (i + PREFETCH) * BLOCK_N, topk, n_slots, kv, stride_kv_page, stride_kv_row,
                            gl.SliceLayout(1, LP))
        tiles = _gather(p_row, valid, o_c, o_r, SR, ROPE)
        mbarrier.wait(k_free.index(b), ((i // NBUF) & 1) ^ 1)
        _stage(tiles, valid, k_lat, k_rope, k_bias, k_ready, b, ROPE)
        _prefetch_rows(p_pf, v_pf, o_l, ROPE)
        p_row = p_row_n
        valid = valid_n


# ---- consumer 0: S, softmax, O[:, :256] ---------------------------------------------------------------

@gluon.jit
def _scores(q_lat, q_rope, k_lat, k_rope, b, zero_s, ROPE: gl.constexpr):
    # [64 heads, 64 tokens] = Q_rope K_rope^T + sum_g Q_g K_g^T, five async wgmma groups (ROPE 0: the four
    # latent ones), none waited here
    if ROPE:
        s = warpgroup_mma(q_rope, k_rope.index(b).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        for g in gl.static_range(4):
            s = warpgroup_mma(q_lat.index(g), k_lat[g].index(b).permute((1, 0)), s, is_async=True)
    else:
        s = warpgroup_mma(q_lat.index(0), k_lat[0].index(b).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        for g in gl.static_range(1, 4):
            s = warpgroup_mma(q_lat.index(g), k_lat[g].index(b).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax(s, bias, qk_scale, m_i, l_i):
    """One online-softmax step in the exp2 domain on S [64, 64] (fp32, -inf masked by ``bias``).

    Returns (p bf16, alpha, m, l). A head that has seen only skipped tokens keeps m = -inf; exp2 is then
    taken against 0, so -inf - -inf never makes a NaN and its p, alpha and l stay 0."""
    s = s * qk_scale + bias[None, :]
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p.to(gl.bfloat16), alpha, m_new, l_i


@gluon.jit
def _hand_p(p16, alpha, i, p_s, alpha_s, p_ready, p_free):
    # consumer 1's P V on the previous P has completed (p_free) -> overwrite P and alpha, signal p_ready
    mbarrier.wait(p_free, (i & 1) ^ 1)
    p_s.store(p16)
    alpha_s.store(alpha)
    # consumer 1 reads P with wgmma (async proxy): order these generic stores before it
    fence_async_shared()
    mbarrier.arrive(p_ready, count=1)


@gluon.jit
def _rescale(o0, o1, alpha, p16, M128: gl.constexpr, PA: gl.constexpr):
    # O *= alpha (before the P V wgmma is issued: nothing touches an accumulator in flight), P as the
    # register A operand of the P V wgmma
    a_o = gl.convert_layout(alpha, gl.SliceLayout(1, M128))
    return o0 * a_o[:, None], o1 * a_o[:, None], gl.convert_layout(p16, PA)


@gluon.jit
def load_q(q, stride_q_row, stride_q_h, h_q, i_row, i_hb, q_lat, q_rope, PART: gl.constexpr = 0,
           ROPE: gl.constexpr = 64):
    """Q of this row and head block (q's rows: 512 latent dims, then ROPE rope dims) into shared memory, once:
    ``q_lat`` [4, 64, 128] bf16 (latent), ``q_rope`` [64, 64] bf16 (a tile; ROPE 0: (), nothing read), then
    ``fence_async_shared`` for the wgmma reads. Every load is issued before the first store: one DRAM
    latency instead of five (with O's 16-B stores, :func:`store_o`, 180 us less fixed cost over
    gluon_bf16.py's 8192 CTAs). PART 0 loads it all; gluon_bf16.py's consumers load half each, PART 1 latent
    groups 0 and 1, PART 2 groups 2 and 3 and the rope. Heads >= h_q read as 0."""
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])   # [64, 128] bf16
    LQR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])   # [64, 64] bf16
    o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LQ))
    o_c = gl.arange(0, 128, gl.SliceLayout(0, LQ))
    p_q = q + i_row * stride_q_row + o_h.to(gl.int64)[:, None] * stride_q_h + o_c[None, :]
    m_q = (o_h < h_q)[:, None]
    if ROPE:
        o_hr = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LQR))
        o_r = gl.arange(0, 64, gl.SliceLayout(0, LQR))
        p_r = q + i_row * stride_q_row + o_hr.to(gl.int64)[:, None] * stride_q_h + 512 + o_r[None, :]
        m_r = (o_hr < h_q)[:, None]
    if PART != 2:
        b_q0 = gl.load(p_q, mask=m_q, other=0.0)
        b_q1 = gl.load(p_q + 128, mask=m_q, other=0.0)
    if PART != 1:
        b_q2 = gl.load(p_q + 256, mask=m_q, other=0.0)
        b_q3 = gl.load(p_q + 384, mask=m_q, other=0.0)
        if ROPE:
            b_qr = gl.load(p_r, mask=m_r, other=0.0)
    if PART != 2:
        q_lat.index(0).store(b_q0)
        q_lat.index(1).store(b_q1)
    if PART != 1:
        q_lat.index(2).store(b_q2)
        q_lat.index(3).store(b_q3)
        if ROPE:
            q_rope.store(b_qr)
    fence_async_shared()


@gluon.jit
def _consumer0(q, out, lse, stride_q_row, stride_q_h, stride_o_row, stride_o_h, stride_l_row, h_q, n_hb, n_steps,
               q_split, qk_scale, q_lat, q_rope, k_lat, k_rope, k_bias, p_s, alpha_s, fin_s, k_ready, k_free, p_ready,
               p_free, fin, ROPE: gl.constexpr):
    M64: gl.constexpr = mma_layout(64)
    M128: gl.constexpr = mma_layout(128)
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M128, k_width=2)
    i_hb = gl.program_id(0) % n_hb
    i_row = (gl.program_id(0) // n_hb).to(gl.int64)
    load_q(q, stride_q_row, stride_q_h, h_q, i_row // q_split, i_hb, q_lat, q_rope, 0, ROPE)
    # Q's stores must reach every warp's first S wgmma. Left to Triton's shared-memory hazard analysis, that
    # barrier lands in front of the S wgmma inside the loop (it cannot tell iteration 0 apart) and runs every
    # step; here it runs once.
    _warps_barrier()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, M64))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, M64))
    o0 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    o1 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    zero_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, M64)

    for i in range(n_steps):
        b = i % NBUF
        mbarrier.wait(k_ready.index(b), (i // NBUF) & 1)
        s = _scores(q_lat, q_rope, k_lat, k_rope, b, zero_s, ROPE)
        s = warpgroup_mma_wait(0, deps=(s,))
        p16, alpha, m_i, l_i = _softmax(s, k_bias.index(b).load(gl.SliceLayout(0, M64)), qk_scale, m_i, l_i)
        o0, o1, pa = _rescale(o0, o1, alpha, p16, M128, PA)
        o0 = warpgroup_mma(pa, k_lat[0].index(b), o0, is_async=True)
        o1 = warpgroup_mma(pa, k_lat[1].index(b), o1, is_async=True)
        # P handed to consumer 1 while this P V runs: the barrier Triton puts after the p_ready arrive then
        # falls after the wgmma wait (warps in step) instead of in front of its issue
        _hand_p(p16, alpha, i, p_s, alpha_s, p_ready, p_free)
        o0, o1, pa = warpgroup_mma_wait(0, deps=(o0, o1, pa))
        _release(k_free.index(b), True)

    # empty rows (no valid index): l = 0 -> out 0 (O is 0), lse -inf
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    inv = 1.0 / l_safe
    fin_s.store(inv)
    mbarrier.arrive(fin, count=1)
    o_hl = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, M64))
    gl.store(lse + i_row * stride_l_row + o_hl, gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2),
             mask=o_hl < h_q)
    store_o(out, i_row, i_hb, stride_o_row, stride_o_h, h_q, o0, o1, gl.convert_layout(inv, gl.SliceLayout(1, M128)),
            0, q_lat)


@gluon.jit
def store_o(out, i_row, i_hb, stride_o_row, stride_o_h, h_q, o_a, o_b, inv, d0: gl.constexpr, q_lat):
    """out[row, heads, d0 : d0 + 256] = (O / l) in bf16 through the Q tiles d0 / 128 and d0 / 128 + 1 (the
    caller knows every QK reading them is done: here ``fin``, in gluon_bf16.py the sum exchange), so that
    the global stores are whole 16-B pieces of 256-B rows (the accumulator layout holds 4-B pieces)."""
    LO: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])   # [64, 128] bf16
    q_lat.index(d0 // 128).store((o_a * inv[:, None]).to(gl.bfloat16))
    q_lat.index(d0 // 128 + 1).store((o_b * inv[:, None]).to(gl.bfloat16))
    o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LO))
    o_d = gl.arange(0, 128, gl.SliceLayout(0, LO))
    p_o = out + i_row * stride_o_row + o_h.to(gl.int64)[:, None] * stride_o_h + d0 + o_d[None, :]
    m_o = (o_h < h_q)[:, None]
    gl.store(p_o, q_lat.index(d0 // 128).load(LO), mask=m_o)
    gl.store(p_o + 128, q_lat.index(d0 // 128 + 1).load(LO), mask=m_o)


# ---- consumer 1: O[:, 256:] ---------------------------------------------------------------------------

@gluon.jit
def _consumer1(out, stride_o_row, stride_o_h, h_q, n_hb, n_steps, k_lat, p_s, alpha_s, fin_s, k_free, p_ready,
               p_free, fin, q_lat):
    M128: gl.constexpr = mma_layout(128)
    i_hb = gl.program_id(0) % n_hb
    i_row = (gl.program_id(0) // n_hb).to(gl.int64)
    o2 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    o3 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    for i in range(n_steps):
        b = i % NBUF
        mbarrier.wait(p_ready, i & 1)
        a_o = alpha_s.load(gl.SliceLayout(1, M128))
        o2 = o2 * a_o[:, None]
        o3 = o3 * a_o[:, None]
        # P straight from shared memory, freed once this P V completed. (P loaded into registers first, to
        # free it earlier, needs 16 more registers: at 160 ptxas then serialises every wgmma.)
        o2 = warpgroup_mma(p_s, k_lat[2].index(b), o2, is_async=True)
        o3 = warpgroup_mma(p_s, k_lat[3].index(b), o3, is_async=True)
        o2, o3 = warpgroup_mma_wait(0, deps=(o2, o3))
        _release(p_free, True)
        _release(k_free.index(b), True)
    mbarrier.wait(fin, 0)
    store_o(out, i_row, i_hb, stride_o_row, stride_o_h, h_q, o2, o3, fin_s.load(gl.SliceLayout(1, M128)), 256, q_lat)


# ---- the kernel ---------------------------------------------------------------------------------------

# sizes that vary per call are not specialised (one compile serves every batch and top-k); the address
# strides stay specialised, so 16-byte alignment is known and the gathers are 16-byte loads
@gluon.jit(do_not_specialize=["stride_i_row", "stride_l_row", "n_slots", "h_q", "topk", "n_steps", "n_hb", "q_split"])
def sparse_mla_decode_ws_kernel(
    q, kv, idx, out, lse,
    stride_q_row, stride_q_h, stride_kv_page, stride_kv_row, stride_i_row, stride_o_row, stride_o_h, stride_l_row,
    n_slots, h_q, topk, n_steps, n_hb, q_split, qk_scale, ROPE: gl.constexpr,
):
    """Warp-specialised sparse MLA decode, one (row, 64 heads) per CTA (module docstring).

    Rows are slices of a query's top-k list (flash-decoding): row r reads query ``r // q_split`` (q_split 1:
    one row per query, the whole list). ROPE: the rows' rope dims, 64 or 0 (NoPE: no rope tiles, loads or
    wgmma); D = 512 + ROPE.
    q    [R / q_split, h_q, D] bf16 (unit stride last)    idx [R, topk] int32 slots (unit stride last)
    kv   [P, 64, 528 + 2 ROPE] uint8 cache (656 B, NoPE 528 B): slot -> kv + (slot // 64) * stride_kv_page +
         (slot % 64) * stride_kv_row; row = 512 e4m3 | 4 fp32 scales (one per 128 dims) | ROPE bf16 rope;
         strides multiples of 16
    out  [R, h_q, 512] bf16 (unit stride last)           lse [R, h_q] fp32, natural log
    n_steps = max(1, cdiv(topk, 64)); n_hb = cdiv(h_q, 64); qk_scale = sm_scale * log2(e).
    """
    T: gl.constexpr = tile_smem(BLOCK_N, 128)
    TR: gl.constexpr = tile_smem(BLOCK_N, 64)
    V1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], T)
    if ROPE:
        q_rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], TR)
    else:
        q_rope = ()  # no value (a None cannot be passed into the partitions)
    # one allocation per latent group g, [buffer, 64, 128] each: Triton's hazard analysis fences stores per
    # allocation, so the producer's warps meet no barrier between two groups' stores
    k_lat = (gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, 128], T),
             gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, 128], T),
             gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, 128], T),
             gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, 128], T))
    if ROPE:
        k_rope = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, 64], TR)
    else:
        k_rope = ()
    k_bias = gl.allocate_shared_memory(gl.float32, [NBUF, BLOCK_N], V1)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], TR)
    alpha_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], V1)
    fin_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], V1)
    k_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NBUF):
        mbarrier.init(k_ready.index(j), count=1)     # the producer
        mbarrier.init(k_free.index(j), count=256)    # every thread of both consumers (_release)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=128)                 # every thread of consumer 1
    mbarrier.init(fin, count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer0, (q, out, lse, stride_q_row, stride_q_h, stride_o_row, stride_o_h, stride_l_row, h_q, n_hb, n_steps,
                      q_split, qk_scale, q_lat, q_rope, k_lat, k_rope, k_bias, p_s, alpha_s, fin_s, k_ready, k_free,
                      p_ready, p_free, fin, ROPE)),
        (_consumer1, (out, stride_o_row, stride_o_h, h_q, n_hb, n_steps, k_lat, p_s, alpha_s, fin_s, k_free, p_ready,
                      p_free, fin, q_lat)),
        (_producer, (kv, idx, stride_kv_page, stride_kv_row, stride_i_row, n_slots, topk, n_steps, n_hb, k_lat, k_rope,
                     k_bias, k_ready, k_free, ROPE)),
    ], [4, 4], [REGS_C1, REGS_PROD])


# ---- launcher -----------------------------------------------------------------------------------------

def kernel_args(q, cache_u8, indices, sm_scale, out, lse, splits: int = 1):
    """(grid, kwargs) of one launch of :func:`sparse_mla_decode_ws_kernel` over B * s_q queries (q [B, s_q, h_q,
    D] bf16, D 576 or 512; cache_u8 [P, 64, 656] or, NoPE, [P, 64, 528]), each one's top-k list in ``splits``
    slices (``out [B * s_q * splits, h_q, 512]``, ``lse [.., h_q]``: the partials) (also used by the sm_90
    compile check). ROPE is q's rope dims, which the cache's width must match."""
    B, s_q, h_q, _ = q.shape
    rope = q.shape[-1] - 512
    assert rope in (0, 64) and cache_u8.shape[-1] == 528 + 2 * rope, (q.shape, cache_u8.shape)
    R, topk = B * s_q * splits, indices.shape[-1] // splits
    n_hb = cdiv(h_q, 64)
    q3 = q.reshape(B * s_q, h_q, q.shape[-1])
    i2 = indices.reshape(R, topk)
    o3 = out.view(R, h_q, out.shape[-1])
    l2 = lse.view(R, h_q)
    return (R * n_hb,), dict(
        q=q3, kv=cache_u8, idx=i2, out=o3, lse=l2,
        stride_q_row=q3.stride(0), stride_q_h=q3.stride(1),
        stride_kv_page=cache_u8.stride(0), stride_kv_row=cache_u8.stride(1), stride_i_row=i2.stride(0),
        stride_o_row=o3.stride(0), stride_o_h=o3.stride(1), stride_l_row=l2.stride(0),
        n_slots=cache_u8.shape[0] * cache_u8.shape[1], h_q=h_q, topk=topk, n_steps=max(1, cdiv(topk, 64)),
        n_hb=n_hb, q_split=splits, qk_scale=sm_scale * LOG2E, ROPE=rope, num_warps=4, maxnreg=MAXNREG)


def sparse_mla_decode_gluon(q: torch.Tensor, cache_u8: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                            d_v: int = 512, out: torch.Tensor | None = None,
                            lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode over the fp8 656-B (or 528-B NoPE) paged cache on Hopper (sm_90), Gluon, launched
    directly (the probe's and the tests' way in; the dispatch uses :func:`sparse_mla_decode`).

    Args:
        q:        ``[B, s_q, h_q, D] bfloat16`` absorbed queries (512 latent + R rope: D 576, NoPE D 512),
                  unit stride last.
        cache_u8: ``[P, 64, 528 + 2 R] uint8`` FlashMLA's fp8 layout (512 e4m3 | 4 fp32 scales | R bf16 rope:
                  656 B, NoPE 528 B), unit stride within a row, page / row strides multiples of 16 bytes.
        indices:  ``[B, s_q, topk] int32`` physical slots ``page * 64 + row``; -1, negative or >= 64 P = skip.
        sm_scale: softmax scale.
        d_v:      512 only (the whole latent is the value).
        out, lse: optional destinations (contiguous, the shapes below), e.g. NaN-poisoned by a test.

    Returns:
        ``out [B, s_q, h_q, 512] bfloat16`` and ``lse [B, s_q, h_q] float32`` (natural log). A row with no
        valid index gives out 0 and lse -inf.
    """
    B, s_q, h_q, d = q.shape
    assert d in (576, 512) and d_v == 512 and q.dtype == torch.bfloat16 and q.stride(-1) == 1
    assert cache_u8.dtype == torch.uint8 and cache_u8.dim() == 3 and cache_u8.shape[1:] == (64, 528 + 2 * (d - 512))
    assert cache_u8.stride(2) == 1 and cache_u8.stride(0) % 16 == 0 and cache_u8.stride(1) % 16 == 0
    assert indices.dtype == torch.int32 and indices.shape[:2] == (B, s_q) and indices.stride(-1) == 1
    if out is None:
        out = torch.empty(B, s_q, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(B, s_q, h_q, dtype=torch.float32, device=q.device)
    assert out.shape == (B, s_q, h_q, d_v) and out.is_contiguous()
    assert lse.shape == (B, s_q, h_q) and lse.is_contiguous()
    if B * s_q == 0 or h_q == 0:
        return out, lse
    grid, kw = kernel_args(q, cache_u8, indices, sm_scale, out, lse)
    sparse_mla_decode_ws_kernel[grid](**kw)
    return out, lse


def compiled_kernel(q, cache_u8, indices, sm_scale):
    """Launch once (q [B, s_q, h_q, D] bf16, cache_u8 [P, 64, 528 + 2 (D - 512)] uint8, indices [B, s_q, topk]
    int32) and return the compiled kernel (``n_regs``, ``n_spills``, ``metadata.shared``)."""
    B, s_q, h_q, _ = q.shape
    out = torch.empty(B, s_q, h_q, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, s_q, h_q, dtype=torch.float32, device=q.device)
    grid, kw = kernel_args(q, cache_u8, indices, sm_scale, out, lse)
    return sparse_mla_decode_ws_kernel[grid](**kw)


def compile_sm90(rope: int = 64):
    """The decode kernel compiled for sm_90 without a GPU (B 2, h_q 128, top-2048) for rows with ``rope`` rope
    dims (64: the 656-B cache, 0: the 528-B NoPE one): the CPU test's check and the probe's
    ``--compile-only``."""
    q = torch.empty(2, 1, 128, 512 + rope, dtype=torch.bfloat16)
    cache = torch.empty(64, 64, 528 + 2 * rope, dtype=torch.uint8)
    idx = torch.empty(2, 1, 2048, dtype=torch.int32)
    out, lse = torch.empty(2, 1, 128, 512, dtype=torch.bfloat16), torch.empty(2, 1, 128)
    _, kw = kernel_args(q, cache, idx, (512 + rope) ** -0.5, out, lse)
    return compile_sm90_kernel(sparse_mla_decode_ws_kernel, kw)


# ---- the dispatch's entry ------------------------------------------------------------------------------

_LAUNCHER = KernelLauncher(sparse_mla_decode_ws_kernel, ("q", "kv", "idx", "out", "lse"))


def unsupported(q: torch.Tensor, kv_cache: torch.Tensor, fmt: str, d_v: int) -> str | None:
    """Why this kernel cannot run a (validated) ``sparse_mla_decode`` call, or None when it can: an sm_90 GPU,
    the fp8 656-B cache (q [B, s_q, h_q, 576]) or its 528-B NoPE rows (q [.., 512]; the op checks that q's
    dims match the cache's) with 16-byte aligned rows, a bf16 query (any h_q: a CTA takes 64 heads, those
    >= h_q read as 0 and are not stored, as FlashMLA's callers pad to 64; measured faster than the Triton
    kernels' 16-head tiles even at h_q 16: README.md), d_v 512."""
    if fmt != "fp8":
        return f"the fp8 {MLA_FP8_BYTES}-B or {MLA_FP8_NOPE_BYTES}-B (NoPE) cache (got {fmt!r})"
    if d_v != 512:
        return f"d_v 512 (got {d_v})"
    if q.dtype != torch.bfloat16:
        return f"a bfloat16 q (got {q.dtype})"
    if q.device.type != "cuda" or capability(q.device) != (9, 0):
        return f"an sm_90 GPU (got {q.device})"
    if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16:
        return "16-byte aligned cache rows (data_ptr and page / row strides multiples of 16)"
    return None


def decode_splits(queries: int, h_q: int, topk: int, sms: int) -> int:
    """Slices of each query's top-k list (flash-decoding, merged by ``triton.combine_splits``) so the CTAs —
    one per (slice, 64 heads) — make up to one wave: doubled while that stays <= ``sms``, up to 16 slices of
    >= 128 tokens (a list that does not divide is padded with -1). h_q 128 top-2048 on 132 SMs: B 1-4 16,
    B 8 8, B 16 4, B 32 2, from B 64 1 (no split). On the H200 (benchmarks/sparse_decode_grid.py,
    2026-12-03) the fastest of 1-16 slices in each of the 12 cells B 1, 4, 16, 64 x h_q 16 (padded), 64, 128."""
    ctas, s = queries * cdiv(h_q, 64), 1
    while s < 16 and ctas * 2 * s <= sms and topk // (2 * s) >= 128:
        s *= 2
    return s


def sparse_mla_decode(q, kv_cache, indices, sm_scale, d_v, kv_scale, splits: int | None = None):
    """The Gluon backend of :func:`flashdsa.ops.sparse_mla_decode` (inputs validated there, and
    :func:`unsupported` None), launched from a plan (``ops/_launch.py``) after the first call of a shape:
    q [B, s_q, h_q, D] bf16 over kv_cache [P, 64, 656] uint8 (D 576) or [P, 64, 528] (NoPE, D 512), indices
    [B, s_q, topk] int32 -> out [B, s_q, h_q, 512] bf16, lse [B, s_q, h_q] fp32. ``splits``: top-k slices per
    query (None: :func:`decode_splits`); above 1 the kernel writes bf16 partials that ``triton.combine_splits``
    merges by their lse in fp32."""
    B, s_q, h_q, d = q.shape
    R, topk = B * s_q, indices.shape[-1]
    out = torch.empty(B, s_q, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, s_q, h_q, dtype=torch.float32, device=q.device)
    if R == 0 or h_q == 0:  # no program to launch (a grid of 0 is a launch error)
        return out, lse
    S = decode_splits(R, h_q, topk, num_sms(q.device)) if splits is None else splits
    q3 = q.reshape(R, h_q, d) if q.stride(-1) == 1 else q.reshape(R, h_q, d).contiguous()
    i2 = indices.reshape(R, topk)
    if S > 1 and topk % S:  # kpool's topk + c - 1: equal slices of a list padded with skipped slots
        i2 = torch.nn.functional.pad(i2, (0, S - topk % S), value=-1)
        topk = i2.shape[1]
    if i2.stride(-1) != 1 or (S > 1 and not i2.is_contiguous()):
        i2 = i2.contiguous()
    if S > 1:
        part_o = torch.empty(R, S, h_q, d_v, dtype=torch.bfloat16, device=q.device)
        part_l = torch.empty(R, S, h_q, dtype=torch.float32, device=q.device)
    else:
        part_o, part_l = out, lse
    ks = kv_cache.stride()
    ptrs = (q3.data_ptr(), kv_cache.data_ptr(), i2.data_ptr(), part_o.data_ptr(), part_l.data_ptr())
    key = (q.device, R, h_q, d, topk, q3.stride(), ks, i2.stride()[0], kv_cache.shape[0], sm_scale, S) \
        if aligned(*ptrs) else None

    def build():
        return kernel_args(q3.view(R, 1, h_q, d), kv_cache, i2.view(R, 1, topk), sm_scale, part_o, part_l, S)

    _LAUNCHER(key, ptrs, build)
    if S > 1:
        combine_splits(part_o, part_l, out.view(R, h_q, d_v), lse.view(R, h_q), key)
    return out, lse
