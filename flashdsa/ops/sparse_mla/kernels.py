"""Sparse MLA kernels: flash attention over the gathered top-k rows of a paged cache (fp8 656 B, bf16, raw fp8
576 B) or of gathered bf16 KV, one algorithm in three tilings plus the split-K combine. ``triton.py`` configures
and launches them.

Absorbed / MQA form: every query head of a row attends to the SAME selected tokens, so a program owns
one query row and a block of heads, gathers BLOCK_N selected KV rows per step once, dequantises them
once and uses the same tiles as K (576 dims: 512 latent + 64 rope; 512 for NoPE rows, ROPE 0) and as V
(the first d_v latent dims). ``sparse_mla_fwd_kernel`` puts the heads on the tensor-core M side with the latent in four
128-dim chunks (bf16 at h_q > 32, fp8 at h_q <= 64); ``sparse_mla_fwd_wide_kernel`` is the same with
the latent as one 512-dim tile (fp8 at h_q > 64); ``sparse_mla_fwd_small_h_kernel`` computes the
transposed product so that 16 or 32 heads still use wgmma (bf16). Few rows with long top-k lists split
the list over programs (flash-decoding) and ``sparse_mla_combine_kernel`` merges the partial (out, lse)
pairs. The fp32 format (FMT 3: fp32 rows and queries, for exactness studies of fp32 models) runs the
same code with fp32 tiles and IEEE fp32 products (``_mma``). Design, measurements and roofline: README.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

# cache formats (constexpr FMT); the 656-B row is 512 e4m3 | 4 fp32 scales at 512 | 64 bf16 rope at 528
# (NoPE, constexpr ROPE 0: 528 B, no rope; the other formats' NoPE rows are their first 512 dims).
# FMT 3 (fp32 rows, fp32 q) is the exact path: every product in IEEE fp32, P kept in fp32.
CACHE_FORMATS = {"bf16": 0, "fp8": 1, "fp8_raw": 2, "fp32": 3}


@triton.jit
def _dot_in(x, UPCAST: tl.constexpr):
    # bf16 tensor-core operand; fp32 in the interpreter, whose bf16 tl.dot is wrong (values already
    # rounded to bf16, so the numerics match the compiled kernel up to summation order)
    if UPCAST:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _mma(a, b, acc, FMT: tl.constexpr):
    # fp32 operands (FMT 3) multiply in IEEE fp32: tf32 would round them to 10 mantissa bits, the very
    # error the fp32 path exists to avoid. The other formats' bf16 operands are unaffected by the flag.
    if FMT == 3:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _mma0(a, b, FMT: tl.constexpr):
    # _mma without an accumulator (the first product of a step)
    if FMT == 3:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _cast(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 -> dtype, rounding to nearest even. The interpreter truncates fp32 -> bf16, so there the
    rounding is done on the bits (finite values), and tests can demand the compiled kernel's numerics."""
    if UPCAST and dtype == tl.bfloat16:
        b_bits = x.to(tl.uint32, bitcast=True)
        b_bits = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) & 0xFFFF0000
        return b_bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def _load_chunk(p_row, valid, d0, kv_scale, FMT: tl.constexpr, UPCAST: tl.constexpr):
    """Latent dims [d0, d0 + 128) of BLOCK_N gathered rows -> [BLOCK_N, 128] bf16 (fp32 rows: fp32),
    dequantised.

    d0 is a multiple of 128; p_row [BLOCK_N] points at each row's first element (bf16 / fp32) or byte (fp8).
    The tile is 128 wide so that fp8 dequantisation stays in a few registers per thread.
    """
    o_d = d0 + tl.arange(0, 128)
    if FMT == 0 or FMT == 3:
        # [BLOCK_N, 128] bf16 | fp32
        b_k = tl.load(p_row[:, None] + o_d[None, :], mask=valid[:, None], other=0.0)
    elif FMT == 1:
        # [BLOCK_N] fp32 scale of this 128-dim block, at byte 512 + 4 (d0 // 128) of the 656-B row
        b_s = tl.load((p_row + 512 + 4 * (d0 // 128)).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
        # [BLOCK_N, 128] e4m3 bytes, dequantised in fp32 and rounded once to bf16 like the reference
        b_u = tl.load(p_row[:, None] + o_d[None, :], mask=valid[:, None], other=0)
        b_k = _cast(b_u.to(tl.float8e4nv, bitcast=True).to(tl.float32) * b_s[:, None], tl.bfloat16, UPCAST)
    else:
        # [BLOCK_N, 128] e4m3 bytes, one per-tensor scale
        b_u = tl.load(p_row[:, None] + o_d[None, :], mask=valid[:, None], other=0)
        b_k = _cast(b_u.to(tl.float8e4nv, bitcast=True).to(tl.float32) * kv_scale, tl.bfloat16, UPCAST)
    return b_k


@triton.jit
def _load_rope(p_row, valid, kv_scale, FMT: tl.constexpr, UPCAST: tl.constexpr):
    """Rope dims (64) of BLOCK_N gathered rows -> [BLOCK_N, 64] bf16 (fp32 rows: fp32)."""
    o_r = tl.arange(0, 64)
    if FMT == 0 or FMT == 3:
        # [BLOCK_N, 64] bf16 | fp32 at elements 512..575
        b_r = tl.load(p_row[:, None] + 512 + o_r[None, :], mask=valid[:, None], other=0.0)
    elif FMT == 1:
        # [BLOCK_N, 64] bf16 at bytes 528..655 (never quantised)
        p_r = (p_row + 528).to(tl.pointer_type(tl.bfloat16))
        b_r = tl.load(p_r[:, None] + o_r[None, :], mask=valid[:, None], other=0.0)
    else:
        # [BLOCK_N, 64] e4m3 bytes at 512..575
        b_u = tl.load(p_row[:, None] + 512 + o_r[None, :], mask=valid[:, None], other=0)
        b_r = _cast(b_u.to(tl.float8e4nv, bitcast=True).to(tl.float32) * kv_scale, tl.bfloat16, UPCAST)
    return b_r


@triton.jit
def _load_slots(p_idx, k0, k_end, BLOCK_N: tl.constexpr):
    """Slots k0 .. k0 + BLOCK_N of a row's top-k list [BLOCK_N] int32; -1 past k_end."""
    o_n = k0 + tl.arange(0, BLOCK_N)
    return tl.load(p_idx + o_n, mask=o_n < k_end, other=-1)


@triton.jit
def _slot_rows(b_slot, n_slots, kv, stride_kv_page, stride_kv_row):
    """Slots [BLOCK_N] -> (row pointers [BLOCK_N], valid [BLOCK_N]).

    -1, any negative slot, a slot >= n_slots and positions past the list are invalid: their pointer is
    clamped to slot 0 and every load of them is masked, so they are never dereferenced.
    """
    valid = (b_slot >= 0) & (b_slot < n_slots)
    b_slot = tl.where(valid, b_slot, 0)
    p_row = kv + (b_slot // 64).to(tl.int64) * stride_kv_page + (b_slot % 64).to(tl.int64) * stride_kv_row
    return p_row, valid


@triton.jit
def _step_rows(b_slot, p_idx, k0, k_end, n_slots, kv, stride_kv_page, stride_kv_row, BLOCK_N: tl.constexpr,
               SLOTS_AHEAD: tl.constexpr):
    """Row pointers and validity of step k0 -> (p_row, valid, slots carried to the next step).

    SLOTS_AHEAD: b_slot holds this step's slots (loaded one step earlier) and the next step's are loaded
    now. The gathers then depend on a loop-carried value instead of a load of the same step, so Triton's
    pipeliner can issue them num_stages - 1 steps ahead; with the slots loaded in-step, it issues a
    step's gathers at the end of the previous step, after its math (no overlap). Ahead pays with
    num_stages >= 3 (the fp8 decode default); at 2 stages it only costs registers (bf16 prefill keeps
    in-step slots). Timings: README.md "Measured".
    """
    if SLOTS_AHEAD:
        p_row, valid = _slot_rows(b_slot, n_slots, kv, stride_kv_page, stride_kv_row)
        b_slot = _load_slots(p_idx, k0 + BLOCK_N, k_end, BLOCK_N)
    else:
        p_row, valid = _slot_rows(_load_slots(p_idx, k0, k_end, BLOCK_N), n_slots, kv, stride_kv_page,
                                  stride_kv_row)
    return p_row, valid, b_slot


@triton.jit
def _online_softmax(b_s, b_m, b_l, AXIS: tl.constexpr):
    """One step of the online softmax in the exp2 domain over AXIS of the (already -inf masked) scores.

    Returns (p, alpha, m_new, l_new). A head that has seen only invalid tokens keeps m = -inf; exp2 is
    then taken against 0, so -inf - -inf never makes a NaN and its p, alpha, l stay 0.
    """
    b_m_new = tl.maximum(b_m, tl.max(b_s, AXIS))
    b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp2(b_m - b_m_use)
    if AXIS == 1:
        b_p = tl.exp2(b_s - b_m_use[:, None])
    else:
        b_p = tl.exp2(b_s - b_m_use[None, :])
    b_l = b_l * b_alpha + tl.sum(b_p, AXIS)
    return b_p, b_alpha, b_m_new, b_l


@triton.jit
def _p_operand(b_p, FMT: tl.constexpr, UPCAST: tl.constexpr):
    # P in bf16 for the tensor cores, as FlashMLA does (kept fp32 in the interpreter and on the fp32 path)
    if UPCAST or FMT == 3:
        return b_p
    else:
        return b_p.to(tl.bfloat16)


@triton.jit
def sparse_mla_fwd_kernel(
    q, kv, idx, out, lse,
    stride_q_row, stride_q_h,
    stride_kv_page, stride_kv_row,
    stride_i_row,
    stride_o_row, stride_o_split, stride_o_h,
    stride_l_row, stride_l_split,
    n_slots, h_q, topk, tokens_per_split, num_splits, num_head_blocks,
    qk_scale, kv_scale,
    D_V: tl.constexpr, FMT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, SLOTS_AHEAD: tl.constexpr,
    UPCAST: tl.constexpr, ROPE: tl.constexpr,
):
    """Heads on the M side: one (query row, BLOCK_H heads, BLOCK_DV value dims, top-k split) per program.

    q    [R, h_q, 512 + ROPE] bf16, fp32 with FMT 3 (unit stride last)     idx [R, topk] int32 slots
    kv   paged rows: slot -> kv + (slot // 64) * stride_kv_page + (slot % 64) * stride_kv_row;
         bf16 / fp32 elements (FMT 0 / 3) or bytes of a 656-B (FMT 1) / 576-B (FMT 2) row; ROPE 0 (NoPE):
         the rows without their rope part (528-B FMT 1, 512-B FMT 2, 512 elements FMT 0 / 3)
    out  [R, num_splits, h_q, D_V] (q's dtype final or fp32 partial, unit stride last)
    lse  [R, num_splits, h_q] fp32, natural log; -inf where the row (split) has no valid index
    qk_scale = sm_scale * log2(e): the softmax runs in the exp2 domain.

    The latent is handled as four 128-dim chunks at dims (d_own + 128 j) % 512: all four (and the rope)
    make the score, the first BLOCK_DV / 128 are also this program's V (BLOCK_DV = 512: all of it;
    256 or 128 split the value dims over programs that each still compute the whole score).
    """
    # value chunks per program: BLOCK_DV // 128; value parts per row: cdiv(D_V, BLOCK_DV)
    i_hb = tl.program_id(0) % num_head_blocks
    i_rest = tl.program_id(0) // num_head_blocks
    i_dv = i_rest % ((D_V + BLOCK_DV - 1) // BLOCK_DV)
    i_rest = i_rest // ((D_V + BLOCK_DV - 1) // BLOCK_DV)
    i_split = i_rest % num_splits
    i_row = (i_rest // num_splits).to(tl.int64)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < h_q
    d_own = i_dv * BLOCK_DV
    c0 = d_own
    c1 = (d_own + 128) % 512
    c2 = (d_own + 256) % 512
    c3 = (d_own + 384) % 512
    o_c = tl.arange(0, 128)
    o_r = tl.arange(0, 64)

    # queries of this row and head block, loaded once: [BLOCK_H, 128] x 4, [BLOCK_H, 64]
    p_q = q + i_row * stride_q_row + o_h[:, None].to(tl.int64) * stride_q_h
    b_q0 = _dot_in(tl.load(p_q + c0 + o_c[None, :], mask=m_h[:, None], other=0.0), UPCAST)
    b_q1 = _dot_in(tl.load(p_q + c1 + o_c[None, :], mask=m_h[:, None], other=0.0), UPCAST)
    b_q2 = _dot_in(tl.load(p_q + c2 + o_c[None, :], mask=m_h[:, None], other=0.0), UPCAST)
    b_q3 = _dot_in(tl.load(p_q + c3 + o_c[None, :], mask=m_h[:, None], other=0.0), UPCAST)
    if ROPE > 0:
        b_qr = _dot_in(tl.load(p_q + 512 + o_r[None, :], mask=m_h[:, None], other=0.0), UPCAST)

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_acc2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_acc3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)

    k_start = i_split * tokens_per_split
    k_end = tl.minimum(k_start + tokens_per_split, topk)
    p_idx = idx + i_row * stride_i_row
    b_slot = _load_slots(p_idx, k_start, k_end, BLOCK_N)
    for k0 in range(k_start, k_end, BLOCK_N):
        p_row, valid, b_slot = _step_rows(b_slot, p_idx, k0, k_end, n_slots, kv, stride_kv_page, stride_kv_row,
                                          BLOCK_N, SLOTS_AHEAD)
        # [BLOCK_N, 128] x 4 latent chunks (K, and V for the first BLOCK_DV // 128), [BLOCK_N, 64] rope; bf16
        b_k0 = _dot_in(_load_chunk(p_row, valid, c0, kv_scale, FMT, UPCAST), UPCAST)
        b_k1 = _dot_in(_load_chunk(p_row, valid, c1, kv_scale, FMT, UPCAST), UPCAST)
        b_k2 = _dot_in(_load_chunk(p_row, valid, c2, kv_scale, FMT, UPCAST), UPCAST)
        b_k3 = _dot_in(_load_chunk(p_row, valid, c3, kv_scale, FMT, UPCAST), UPCAST)

        # [BLOCK_H, BLOCK_N] scores over the 512 + ROPE dims, fp32 accumulation
        if ROPE > 0:
            b_kr = _dot_in(_load_rope(p_row, valid, kv_scale, FMT, UPCAST), UPCAST)
            b_s = _mma(b_q0, tl.trans(b_k0), _mma0(b_qr, tl.trans(b_kr), FMT), FMT)
        else:
            b_s = _mma0(b_q0, tl.trans(b_k0), FMT)
        b_s = _mma(b_q1, tl.trans(b_k1), b_s, FMT)
        b_s = _mma(b_q2, tl.trans(b_k2), b_s, FMT)
        b_s = _mma(b_q3, tl.trans(b_k3), b_s, FMT)
        b_s = tl.where(valid[None, :], b_s * qk_scale, float("-inf"))
        b_p, b_alpha, b_m, b_l = _online_softmax(b_s, b_m, b_l, 1)
        b_p = _p_operand(b_p, FMT, UPCAST)

        # [BLOCK_H, 128] += [BLOCK_H, BLOCK_N] @ [BLOCK_N, 128], for the BLOCK_DV // 128 value chunks
        b_acc0 = _mma(b_p, b_k0, b_acc0 * b_alpha[:, None], FMT)
        if BLOCK_DV > 128:
            b_acc1 = _mma(b_p, b_k1, b_acc1 * b_alpha[:, None], FMT)
        if BLOCK_DV > 256:
            b_acc2 = _mma(b_p, b_k2, b_acc2 * b_alpha[:, None], FMT)
            b_acc3 = _mma(b_p, b_k3, b_acc3 * b_alpha[:, None], FMT)

    # empty rows (no valid index): out 0 (acc is 0), lse -inf
    b_empty = b_l == 0.0
    b_l = tl.where(b_empty, 1.0, b_l)
    if i_dv == 0:
        b_lse = tl.where(b_empty, float("-inf"), (b_m + tl.log2(b_l)) * 0.6931471805599453)  # ln 2
        tl.store(lse + i_row * stride_l_row + i_split * stride_l_split + o_h, b_lse, mask=m_h)
    p_o = out + i_row * stride_o_row + i_split * stride_o_split + o_h[:, None].to(tl.int64) * stride_o_h
    b_rcp = 1.0 / b_l[:, None]
    tl.store(p_o + c0 + o_c[None, :], _cast(b_acc0 * b_rcp, out.dtype.element_ty, UPCAST),
             mask=m_h[:, None] & (c0 + o_c[None, :] < D_V))
    if BLOCK_DV > 128:
        tl.store(p_o + c1 + o_c[None, :], _cast(b_acc1 * b_rcp, out.dtype.element_ty, UPCAST),
                 mask=m_h[:, None] & (c1 + o_c[None, :] < D_V))
    if BLOCK_DV > 256:
        tl.store(p_o + c2 + o_c[None, :], _cast(b_acc2 * b_rcp, out.dtype.element_ty, UPCAST),
                 mask=m_h[:, None] & (c2 + o_c[None, :] < D_V))
        tl.store(p_o + c3 + o_c[None, :], _cast(b_acc3 * b_rcp, out.dtype.element_ty, UPCAST),
                 mask=m_h[:, None] & (c3 + o_c[None, :] < D_V))


@triton.jit
def _load_latent(p_row, valid, kv_scale, BLOCK_N: tl.constexpr, FMT: tl.constexpr, UPCAST: tl.constexpr):
    """All 512 latent dims of BLOCK_N gathered rows -> [BLOCK_N, 512] bf16 (fp32 rows: fp32), dequantised
    (one tile, so that the score and value products are one tensor-core op each)."""
    o_d = tl.arange(0, 512)
    if FMT == 0 or FMT == 3:
        # [BLOCK_N, 512] bf16 | fp32
        b_k = tl.load(p_row[:, None] + o_d[None, :], mask=valid[:, None], other=0.0)
    elif FMT == 1:
        # [BLOCK_N, 4] fp32 scales at byte 512 of each row, one per 128 dims
        o_g = tl.arange(0, 4)
        p_s = (p_row + 512).to(tl.pointer_type(tl.float32))
        b_sc = tl.load(p_s[:, None] + o_g[None, :], mask=valid[:, None], other=0.0)
        # [BLOCK_N, 512] e4m3 bytes -> fp32, scaled per 128-dim group, rounded once to bf16
        b_u = tl.load(p_row[:, None] + o_d[None, :], mask=valid[:, None], other=0)
        b_f = tl.reshape(b_u.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BLOCK_N, 4, 128]) * b_sc[:, :, None]
        b_k = _cast(tl.reshape(b_f, [BLOCK_N, 512]), tl.bfloat16, UPCAST)
    else:
        # [BLOCK_N, 512] e4m3 bytes, one per-tensor scale
        b_u = tl.load(p_row[:, None] + o_d[None, :], mask=valid[:, None], other=0)
        b_k = _cast(b_u.to(tl.float8e4nv, bitcast=True).to(tl.float32) * kv_scale, tl.bfloat16, UPCAST)
    return b_k


@triton.jit
def sparse_mla_fwd_wide_kernel(
    q, kv, idx, out, lse,
    stride_q_row, stride_q_h,
    stride_kv_page, stride_kv_row,
    stride_i_row,
    stride_o_row, stride_o_split, stride_o_h,
    stride_l_row, stride_l_split,
    n_slots, h_q, topk, tokens_per_split, num_splits, num_head_blocks,
    qk_scale, kv_scale,
    D_V: tl.constexpr, FMT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SLOTS_AHEAD: tl.constexpr, UPCAST: tl.constexpr,
    ROPE: tl.constexpr,
):
    """The contract of :func:`sparse_mla_fwd_kernel` (all D_V value dims per program) with the 512
    latent dims as one tile: three tensor-core ops per step (rope scores, latent scores, P V as
    m64n256 wgmma) instead of nine, so three shared-memory fence / issue / drain rounds instead of nine.
    fp8 rows are dequantised as one [BLOCK_N, 512] tile scaled per 128-dim group through a
    [BLOCK_N, 4, 128] view. The default for fp8 decode at h_q > 64, where it beats the chunked kernel;
    bf16 prefill keeps the chunked kernel (the wide one spills there and is slower; README.md "Measured")."""
    i_hb = tl.program_id(0) % num_head_blocks
    i_rest = tl.program_id(0) // num_head_blocks
    i_split = i_rest % num_splits
    i_row = (i_rest // num_splits).to(tl.int64)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < h_q
    o_d = tl.arange(0, 512)
    o_r = tl.arange(0, 64)

    # [BLOCK_H, 512], [BLOCK_H, 64] queries, loaded once
    p_q = q + i_row * stride_q_row + o_h[:, None].to(tl.int64) * stride_q_h
    b_q = _dot_in(tl.load(p_q + o_d[None, :], mask=m_h[:, None], other=0.0), UPCAST)
    if ROPE > 0:
        b_qr = _dot_in(tl.load(p_q + 512 + o_r[None, :], mask=m_h[:, None], other=0.0), UPCAST)

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, 512], dtype=tl.float32)

    k_start = i_split * tokens_per_split
    k_end = tl.minimum(k_start + tokens_per_split, topk)
    p_idx = idx + i_row * stride_i_row
    b_slot = _load_slots(p_idx, k_start, k_end, BLOCK_N)
    for k0 in range(k_start, k_end, BLOCK_N):
        p_row, valid, b_slot = _step_rows(b_slot, p_idx, k0, k_end, n_slots, kv, stride_kv_page, stride_kv_row,
                                          BLOCK_N, SLOTS_AHEAD)
        # [BLOCK_N, 512] latent (K and V), [BLOCK_N, 64] rope; bf16
        b_k = _dot_in(_load_latent(p_row, valid, kv_scale, BLOCK_N, FMT, UPCAST), UPCAST)
        if ROPE > 0:
            b_kr = _dot_in(_load_rope(p_row, valid, kv_scale, FMT, UPCAST), UPCAST)
            b_s = _mma(b_q, tl.trans(b_k), _mma0(b_qr, tl.trans(b_kr), FMT), FMT)
        else:
            b_s = _mma0(b_q, tl.trans(b_k), FMT)
        b_s = tl.where(valid[None, :], b_s * qk_scale, float("-inf"))
        b_p, b_alpha, b_m, b_l = _online_softmax(b_s, b_m, b_l, 1)
        b_acc = _mma(_p_operand(b_p, FMT, UPCAST), b_k, b_acc * b_alpha[:, None], FMT)

    b_empty = b_l == 0.0
    b_l = tl.where(b_empty, 1.0, b_l)
    b_lse = tl.where(b_empty, float("-inf"), (b_m + tl.log2(b_l)) * 0.6931471805599453)  # ln 2
    tl.store(lse + i_row * stride_l_row + i_split * stride_l_split + o_h, b_lse, mask=m_h)
    p_o = out + i_row * stride_o_row + i_split * stride_o_split + o_h[:, None].to(tl.int64) * stride_o_h
    tl.store(p_o + o_d[None, :], _cast(b_acc * (1.0 / b_l[:, None]), out.dtype.element_ty, UPCAST),
             mask=m_h[:, None] & (o_d[None, :] < D_V))


@triton.jit
def sparse_mla_fwd_small_h_kernel(
    q, kv, idx, out, lse,
    stride_q_row, stride_q_h,
    stride_kv_page, stride_kv_row,
    stride_i_row,
    stride_o_row, stride_o_split, stride_o_h,
    stride_l_row, stride_l_split,
    n_slots, h_q, topk, tokens_per_split, num_splits, num_head_blocks,
    qk_scale, kv_scale,
    D_V: tl.constexpr, FMT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SLOTS_AHEAD: tl.constexpr, UPCAST: tl.constexpr,
    ROPE: tl.constexpr,
):
    """Heads on the N side, for few heads (tensor-parallel shards of 16 or 32): the contract of
    :func:`sparse_mla_fwd_kernel`, computed transposed, ``S^T = K Q^T`` [BLOCK_N, BLOCK_H] and
    ``O^T += V^T P^T`` [128, BLOCK_H] per value chunk, so the tensor-core M side is the gathered tokens
    (and the value dims) instead of a handful of heads. All D_V value dims in one program.
    """
    i_hb = tl.program_id(0) % num_head_blocks
    i_rest = tl.program_id(0) // num_head_blocks
    i_split = i_rest % num_splits
    i_row = (i_rest // num_splits).to(tl.int64)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < h_q
    o_c = tl.arange(0, 128)
    o_r = tl.arange(0, 64)

    # Q^T of this row and head block: [128, BLOCK_H] x 4, [64, BLOCK_H]
    p_q = q + i_row * stride_q_row + o_h[None, :].to(tl.int64) * stride_q_h
    b_q0 = _dot_in(tl.load(p_q + o_c[:, None], mask=m_h[None, :], other=0.0), UPCAST)
    b_q1 = _dot_in(tl.load(p_q + 128 + o_c[:, None], mask=m_h[None, :], other=0.0), UPCAST)
    b_q2 = _dot_in(tl.load(p_q + 256 + o_c[:, None], mask=m_h[None, :], other=0.0), UPCAST)
    b_q3 = _dot_in(tl.load(p_q + 384 + o_c[:, None], mask=m_h[None, :], other=0.0), UPCAST)
    if ROPE > 0:
        b_qr = _dot_in(tl.load(p_q + 512 + o_r[:, None], mask=m_h[None, :], other=0.0), UPCAST)

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc0 = tl.zeros([128, BLOCK_H], dtype=tl.float32)
    b_acc1 = tl.zeros([128, BLOCK_H], dtype=tl.float32)
    b_acc2 = tl.zeros([128, BLOCK_H], dtype=tl.float32)
    b_acc3 = tl.zeros([128, BLOCK_H], dtype=tl.float32)

    k_start = i_split * tokens_per_split
    k_end = tl.minimum(k_start + tokens_per_split, topk)
    p_idx = idx + i_row * stride_i_row
    b_slot = _load_slots(p_idx, k_start, k_end, BLOCK_N)
    for k0 in range(k_start, k_end, BLOCK_N):
        p_row, valid, b_slot = _step_rows(b_slot, p_idx, k0, k_end, n_slots, kv, stride_kv_page, stride_kv_row,
                                          BLOCK_N, SLOTS_AHEAD)
        # [BLOCK_N, 128] x 4 latent chunks, [BLOCK_N, 64] rope; bf16
        b_k0 = _dot_in(_load_chunk(p_row, valid, 0, kv_scale, FMT, UPCAST), UPCAST)
        b_k1 = _dot_in(_load_chunk(p_row, valid, 128, kv_scale, FMT, UPCAST), UPCAST)
        b_k2 = _dot_in(_load_chunk(p_row, valid, 256, kv_scale, FMT, UPCAST), UPCAST)
        b_k3 = _dot_in(_load_chunk(p_row, valid, 384, kv_scale, FMT, UPCAST), UPCAST)

        # [BLOCK_N, BLOCK_H] transposed scores
        if ROPE > 0:
            b_kr = _dot_in(_load_rope(p_row, valid, kv_scale, FMT, UPCAST), UPCAST)
            b_s = _mma(b_k0, b_q0, _mma0(b_kr, b_qr, FMT), FMT)
        else:
            b_s = _mma0(b_k0, b_q0, FMT)
        b_s = _mma(b_k1, b_q1, b_s, FMT)
        b_s = _mma(b_k2, b_q2, b_s, FMT)
        b_s = _mma(b_k3, b_q3, b_s, FMT)
        b_s = tl.where(valid[:, None], b_s * qk_scale, float("-inf"))
        b_p, b_alpha, b_m, b_l = _online_softmax(b_s, b_m, b_l, 0)
        b_p = _p_operand(b_p, FMT, UPCAST)

        # [128, BLOCK_H] += [128, BLOCK_N] @ [BLOCK_N, BLOCK_H] per value chunk
        b_acc0 = _mma(tl.trans(b_k0), b_p, b_acc0 * b_alpha[None, :], FMT)
        if D_V > 128:
            b_acc1 = _mma(tl.trans(b_k1), b_p, b_acc1 * b_alpha[None, :], FMT)
        if D_V > 256:
            b_acc2 = _mma(tl.trans(b_k2), b_p, b_acc2 * b_alpha[None, :], FMT)
        if D_V > 384:
            b_acc3 = _mma(tl.trans(b_k3), b_p, b_acc3 * b_alpha[None, :], FMT)

    b_empty = b_l == 0.0
    b_l = tl.where(b_empty, 1.0, b_l)
    b_lse = tl.where(b_empty, float("-inf"), (b_m + tl.log2(b_l)) * 0.6931471805599453)  # ln 2
    tl.store(lse + i_row * stride_l_row + i_split * stride_l_split + o_h, b_lse, mask=m_h)
    # out[h, d] = acc^T[d, h] / l[h]
    p_o = out + i_row * stride_o_row + i_split * stride_o_split + o_h[None, :].to(tl.int64) * stride_o_h
    b_rcp = 1.0 / b_l[None, :]
    tl.store(p_o + o_c[:, None], _cast(b_acc0 * b_rcp, out.dtype.element_ty, UPCAST),
             mask=m_h[None, :] & (o_c[:, None] < D_V))
    if D_V > 128:
        tl.store(p_o + 128 + o_c[:, None], _cast(b_acc1 * b_rcp, out.dtype.element_ty, UPCAST),
                 mask=m_h[None, :] & (128 + o_c[:, None] < D_V))
    if D_V > 256:
        tl.store(p_o + 256 + o_c[:, None], _cast(b_acc2 * b_rcp, out.dtype.element_ty, UPCAST),
                 mask=m_h[None, :] & (256 + o_c[:, None] < D_V))
    if D_V > 384:
        tl.store(p_o + 384 + o_c[:, None], _cast(b_acc3 * b_rcp, out.dtype.element_ty, UPCAST),
                 mask=m_h[None, :] & (384 + o_c[:, None] < D_V))


@triton.jit
def sparse_mla_combine_kernel(
    part_out, part_lse, out, lse,
    stride_po_row, stride_po_split, stride_po_h,
    stride_pl_row, stride_pl_split,
    stride_o_row, stride_o_h, stride_l_row,
    h_q, num_splits, num_head_blocks,
    D_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Merge the splits of one (row, head block, BLOCK_D columns): lse = logsumexp_s lse_s, out = sum_s
    exp(lse_s - lse) out_s. One program per BLOCK_D columns too: at batch 1 a row has only h_q / BLOCK_H head
    blocks, too few programs to read the partials at speed (2 programs took 15 us at h_q 128, 8 splits).

    part_out [R, S, h_q, D_V] fp32 or bf16 (normalised partials), part_lse [R, S, h_q] fp32 natural log
    out [R, h_q, D_V] bf16, lse [R, h_q] fp32; splits with lse -inf weigh 0, all empty -> 0 / -inf.
    """
    n_dp: tl.constexpr = (D_V + BLOCK_D - 1) // BLOCK_D
    i_dp = tl.program_id(0) % n_dp
    i_hb = (tl.program_id(0) // n_dp) % num_head_blocks
    i_row = (tl.program_id(0) // n_dp // num_head_blocks).to(tl.int64)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < h_q
    o_s = tl.arange(0, BLOCK_S)

    # [BLOCK_S, BLOCK_H] partial lse
    b_ls = tl.load(part_lse + i_row * stride_pl_row + o_s[:, None] * stride_pl_split + o_h[None, :],
                   mask=(o_s[:, None] < num_splits) & m_h[None, :], other=float("-inf"))
    b_max = tl.max(b_ls, 0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_sum = tl.sum(tl.exp(b_ls - b_max[None, :]), 0)
    b_empty = b_sum == 0.0
    b_lse = tl.where(b_empty, float("-inf"), b_max + tl.log(tl.where(b_empty, 1.0, b_sum)))
    tl.store(lse + i_row * stride_l_row + o_h, b_lse, mask=m_h & (o_h * 0 + i_dp == 0))  # one column part writes it
    b_lse_use = tl.where(b_empty, 0.0, b_lse)

    o_d = i_dp * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D_V
    b_acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for i_s in range(0, num_splits):
        # [BLOCK_H] weight of split i_s (0 for an empty split: exp(-inf))
        b_w = tl.exp(tl.load(part_lse + i_row * stride_pl_row + i_s * stride_pl_split + o_h,
                             mask=m_h, other=float("-inf")) - b_lse_use)
        # [BLOCK_H, BLOCK_D]
        b_o = tl.load(part_out + i_row * stride_po_row + i_s * stride_po_split
                      + o_h[:, None].to(tl.int64) * stride_po_h + o_d[None, :],
                      mask=m_h[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_acc += b_w[:, None] * b_o
    tl.store(out + i_row * stride_o_row + o_h[:, None].to(tl.int64) * stride_o_h + o_d[None, :],
             _cast(b_acc, out.dtype.element_ty, UPCAST), mask=m_h[:, None] & m_d[None, :])
