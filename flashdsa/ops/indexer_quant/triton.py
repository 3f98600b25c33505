"""The indexer's RoPE -> Hadamard -> block fp8 quantisation in one Triton kernel, bit for bit the reference.

One program takes ``BLOCK_R`` rows of 128 (a row = one head of one token) and keeps them in registers:

    y = model_dtype(rope(x))             # first 64 dims rotated, [rope | nope]
    z = model_dtype(H128 y / sqrt(128))  # 7 butterfly stages, fp32
    scale = ue8m0(max(amax(z), 1e-4) / 448);  z_fp8 = e4m3(z / scale)   # |z / scale| <= 448

A row is held as four streams of 32 dims chosen so that the RoPE pairs and two of the seven Hadamard
stages meet element-wise (no data moves between threads); the other five stages run inside each stream.

Why the bits equal ``reference.indexer_quant`` (README.md has the details):
- RoPE: ``a * c - b * s`` and ``b * c + a * s``, the reference's two rounded products and one add; the
  launch passes ``enable_fp_fusion=False`` so the compiler cannot contract them into an FMA.
- Hadamard: every stage of the reference (pair dims i and i + h inside blocks of 2h into (a + b, a - b),
  h = 1, 2, .., 64, in that order), with the same operands: each output's addition tree is the same.
- Scale: the reference's ``2^ceil(log2(fl(amax / 448)))`` (frexp's rule) is read off amax's exponent
  and mantissa bits, no division (an fp32 ``/`` is approximate on the GPU and would round
  ``amax = 448 * 2^k`` a power too far up); dividing by a power of two is a multiplication by its exact
  reciprocal.
- Casts to bf16 / e4m3 round to nearest even, as torch's do: the hardware conversions on the GPU, or
  integer code (``SOFT_CASTS``, the interpreter's default: its own bf16 / fp8 casts do not round to
  nearest even; on the GPU a test hook of :class:`IndexerQuantConfig`). bf16 inputs are read as int16
  bits and widened with a shift.
Finite inputs are assumed (NaN / inf follow no contract); with ``CHECK`` (the default mode's device checks)
the kernel flags NaN / inf and values past the op's bounds in the rows it reads (``flashdsa._checks``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashdsa._checks import error_flag, finite_text
from flashdsa.ops._device_checks import first_code, flag_word
from flashdsa.ops._launch import KernelLauncher, aligned
from flashdsa.ops._triton_utils import cdiv, interpreting
from flashdsa.ops.indexer_quant import COS_BOUND, X_BOUND
from flashdsa.quant import AMAX_FLOOR, FP8, FP8_MAX

D = 128           # head dim = one act_quant block; RoPE on its first D / 2 dims (32 pairs)
BLOCK_R = 16      # rows per program on the GPU
BLOCK_R_INTERPRET = 256  # the interpreter's cost is per program: fewer, bigger ones
NUM_WARPS = 2
assert FP8_MAX == 448.0  # = 1.75 * 2^8: the kernel's scale rule reads amax's bits against this
# indexer_quant's value checks, in its kernel (CHECK): the host check's errors, in its order
QUANT_CODE0 = first_code("indexer_quant", *((name, finite_text(bound), "NaN / inf or a larger value")
                                            for name, bound in (("x", X_BOUND), ("cos", COS_BOUND), ("sin", COS_BOUND))))


@triton.jit
def _butterfly(b_y, BLOCK_R: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    """One Hadamard stage on ``[BLOCK_R, D]`` fp32: dims i and i + HALF of each block of 2 * HALF
    become (a + b, a - b)."""
    # [BLOCK_R, D / (2 HALF), HALF, 2]: the pair axis last, where split / join work (how the
    # elements move between threads is left to Triton's layouts)
    b_y = tl.permute(tl.reshape(b_y, [BLOCK_R, D // (2 * HALF), 2, HALF]), (0, 1, 3, 2))
    b_a, b_b = tl.split(b_y)
    b_y = tl.permute(tl.join(b_a + b_b, b_a - b_b), (0, 1, 3, 2))
    return tl.reshape(b_y, [BLOCK_R, D])


@triton.jit
def _round_bf16(b_v, SOFT_CASTS: tl.constexpr):
    """fp32 -> the nearest bf16 (ties to even), returned as fp32."""
    if SOFT_CASTS:
        # add half an ulp of bf16 (less one, plus the kept lsb: ties go to even), drop the low 16 bits
        b_bits = b_v.to(tl.int32, bitcast=True)
        b_bits = b_bits + 0x7FFF + ((b_bits >> 16) & 1)
        return ((b_bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        return b_v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _e4m3_bits(b_v, SOFT_CASTS: tl.constexpr):
    """fp32 with |v| <= 448 -> the nearest float8_e4m3fn (ties to even), as its uint8 bits."""
    if SOFT_CASTS:
        b_bits = b_v.to(tl.int32, bitcast=True)
        b_sign = (b_bits >> 24) & 0x80
        b_abs = b_bits & 0x7FFFFFFF
        # normals (|v| >= 2^-6, fp32 exponent >= 121): round the 23 mantissa bits to 3, ties to even; a
        # carry into the exponent is the right answer. Rebias 127 -> 7.
        b_norm = ((b_abs + 0x7FFFF + ((b_abs >> 20) & 1)) >> 20) - ((127 - 7) << 3)
        # subnormals: multiples of 2^-9; adding 2^23 makes the fp32 adder round |v| * 2^9 to an integer,
        # ties to even (8 = 2^-6 is the smallest normal's code, also right)
        b_sub = ((tl.abs(b_v) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        return (tl.where(b_abs < (121 << 23), b_sub, b_norm) | b_sign).to(tl.uint8)
    else:
        return b_v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _ue8m0_scale(b_amax):
    """act_quant's UE8M0 scale of a block whose amax (floored) is ``b_amax`` fp32, and its exact reciprocal.

    The reference rounds s = fl(amax / 448) up to a power of two 2^k, the smallest with fl(amax / 448) <= 2^k,
    i.e. (no fp32 lies between 448 * 2^k and the rounding boundary above it, see README.md) with amax <= 448 *
    2^k = 1.75 * 2^(k + 8). From amax's bits 1.m * 2^E: k = E - 8 if 1.m <= 1.75 (mantissa bits <= 0x600000),
    else E - 7. No division. 1 / 2^(E - 127) = 2^(127 - E) exactly, so z * inv == z / scale bit for bit; |z| <=
    amax <= 448 * 2^k, so the reference's clamp to ±448 never bites and callers need none."""
    b_bits = b_amax.to(tl.int32, bitcast=True)
    b_exp = (b_bits >> 23) - 8 + ((b_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return (b_exp << 23).to(tl.float32, bitcast=True), ((254 - b_exp) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_f32(p, mask, BF16: tl.constexpr):
    """Load fp32, or bf16 stored as int16 bits and widened to fp32 exactly (a shift)."""
    b = tl.load(p, mask=mask, other=0)
    if BF16:
        b = (b.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return b


@triton.jit
def _model_bits(b_v, BF16: tl.constexpr):
    """A model-dtype-exact fp32 value as what the output holds: fp32 itself, or bf16's int16 bits."""
    if BF16:
        return (b_v.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    else:
        return b_v


@triton.jit
def _hadamard32(b_y, BLOCK_R: tl.constexpr, Q: tl.constexpr):
    """Butterfly stages 1, 2, .., Q / 2 along the last dim of ``[BLOCK_R, Q]`` (unnormalised)."""
    b_y = _butterfly(b_y, BLOCK_R, Q, 1)
    b_y = _butterfly(b_y, BLOCK_R, Q, 2)
    b_y = _butterfly(b_y, BLOCK_R, Q, 4)
    b_y = _butterfly(b_y, BLOCK_R, Q, 8)
    b_y = _butterfly(b_y, BLOCK_R, Q, 16)
    return b_y


@triton.jit
def _out_of_bound(b, bound):
    """1 if ``b`` (a 2-D block, 0 where masked) holds a NaN or a value with ``|v| > bound`` (inf too)."""
    return tl.max(tl.max(((b != b) | (tl.abs(b) > bound)).to(tl.int32), axis=1), axis=0) > 0


@triton.jit
def indexer_quant_fwd_kernel(x, cos, sin, x_fp8, scale, R, H,
                             stride_xt, stride_xh, stride_xd, stride_ct, stride_cd, stride_st, stride_sd,
                             flag, code0, gate, w, stride_gt, stride_gh, gate_scale, head_scale,
                             GATE: tl.constexpr, GATE_BF16: tl.constexpr,
                             INTERLEAVE: tl.constexpr, BF16: tl.constexpr, SOFT_CASTS: tl.constexpr,
                             BLOCK_R: tl.constexpr, D: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                             H_SCALE: tl.constexpr, ROPE_ONLY: tl.constexpr, CHECK: tl.constexpr,
                             X_MAX: tl.constexpr, C_MAX: tl.constexpr, ROPE: tl.constexpr):
    # A row's 128 dims as four streams of Q = 32 (k = 0..3), so RoPE pairs and the first / last
    # Hadamard stages meet element-wise, without moving data between threads:
    #   NeoX:  stream k holds dims 32k + j: RoPE pairs (0, 1); stages h = 1..16 inside each stream,
    #          h = 32 pairs streams (0, 1) and (2, 3), h = 64 pairs (0, 2) and (1, 3).
    #   GPT-J: stream k holds dims 64 (k // 2) + 2j + k % 2: RoPE pairs (0, 1); h = 1 pairs streams
    #          (0, 1) and (2, 3), h = 2..32 run inside each stream, h = 64 pairs (0, 2) and (1, 3).
    Q: tl.constexpr = D // 4
    i_r = tl.program_id(0)
    # row r = t * H + h; every stream is exactly Q wide, so only rows need a mask
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = (o_r < R)[:, None]
    o_t = (o_r // H).to(tl.int64)
    o_h = (o_r % H).to(tl.int64)
    o_j = tl.arange(0, Q)
    if INTERLEAVE:
        o_0 = 2 * o_j
        o_1 = 2 * o_j + 1
        o_2 = 2 * Q + 2 * o_j
        o_3 = 2 * Q + 2 * o_j + 1
    else:
        o_0 = o_j
        o_1 = Q + o_j
        o_2 = 2 * Q + o_j
        o_3 = 3 * Q + o_j

    p_x = (x + o_t * stride_xt + o_h * stride_xh)[:, None]
    # [BLOCK_R, Q] each: the RoPE pairs (a, b), the nope dims, the pairs' cos / sin
    b_a = _load_f32(p_x + o_0[None, :] * stride_xd, m_r, BF16)
    b_b = _load_f32(p_x + o_1[None, :] * stride_xd, m_r, BF16)
    b_n0 = _load_f32(p_x + o_2[None, :] * stride_xd, m_r, BF16)
    b_n1 = _load_f32(p_x + o_3[None, :] * stride_xd, m_r, BF16)
    if CHECK:
        # the value checks, error codes code0 + 0 / 1 / 2 (x, cos, sin); masked rows loaded as 0
        bad_x = _out_of_bound(b_a, X_MAX) | _out_of_bound(b_b, X_MAX) | _out_of_bound(b_n0, X_MAX)
        flag_word(flag, bad_x | _out_of_bound(b_n1, X_MAX), 0, code0)
    if ROPE:
        b_c = tl.load(cos + o_t[:, None] * stride_ct + o_j[None, :] * stride_cd, mask=m_r, other=0.0)
        b_s = tl.load(sin + o_t[:, None] * stride_st + o_j[None, :] * stride_sd, mask=m_r, other=0.0)
        if CHECK:
            flag_word(flag, _out_of_bound(b_c, C_MAX), 0, code0 + 1)
            flag_word(flag, _out_of_bound(b_s, C_MAX), 0, code0 + 2)
        # the reference's a * c - b * s and b * c + a * s: two rounded products, then one add / sub
        # (no FMA: the launch turns contraction off); then rounded to the model dtype as the layer does
        b_ra = b_a * b_c - b_b * b_s
        b_rb = b_b * b_c + b_a * b_s
        if BF16:
            b_ra = _round_bf16(b_ra, SOFT_CASTS)
            b_rb = _round_bf16(b_rb, SOFT_CASTS)
    else:
        # NoPE (GLM-5.3-Flash: cos / sin [T, 0]): no rotation, the values as loaded (already the model dtype's)
        b_ra = b_a
        b_rb = b_b

    if ROPE_ONLY:
        # kpool's key: rotated and rounded to the model dtype, stored as it is ([rope | nope], x's dtype;
        # bf16 as its int16 bits: the values are bf16-exact, so the high half is the bf16)
        p_y = x_fp8 + o_r.to(tl.int64)[:, None] * D
        tl.store(p_y + o_0[None, :], _model_bits(b_ra, BF16), mask=m_r)
        tl.store(p_y + o_1[None, :], _model_bits(b_rb, BF16), mask=m_r)
        tl.store(p_y + o_2[None, :], _model_bits(b_n0, BF16), mask=m_r)
        tl.store(p_y + o_3[None, :], _model_bits(b_n1, BF16), mask=m_r)
    else:
        # Sylvester Hadamard with the reference's stages in its order (that fixes every addition tree)
        if INTERLEAVE:
            b_0 = b_ra + b_rb
            b_1 = b_ra - b_rb
            b_2 = b_n0 + b_n1
            b_3 = b_n0 - b_n1
            b_0 = _hadamard32(b_0, BLOCK_R, Q)
            b_1 = _hadamard32(b_1, BLOCK_R, Q)
            b_2 = _hadamard32(b_2, BLOCK_R, Q)
            b_3 = _hadamard32(b_3, BLOCK_R, Q)
        else:
            b_ra = _hadamard32(b_ra, BLOCK_R, Q)
            b_rb = _hadamard32(b_rb, BLOCK_R, Q)
            b_n0 = _hadamard32(b_n0, BLOCK_R, Q)
            b_n1 = _hadamard32(b_n1, BLOCK_R, Q)
            b_0 = b_ra + b_rb
            b_1 = b_ra - b_rb
            b_2 = b_n0 + b_n1
            b_3 = b_n0 - b_n1
        # stage h = 64, the normalisation, and hadamard()'s rounding to the model dtype
        b_z0 = (b_0 + b_2) * H_SCALE
        b_z1 = (b_1 + b_3) * H_SCALE
        b_z2 = (b_0 - b_2) * H_SCALE
        b_z3 = (b_1 - b_3) * H_SCALE
        if BF16:
            b_z0 = _round_bf16(b_z0, SOFT_CASTS)
            b_z1 = _round_bf16(b_z1, SOFT_CASTS)
            b_z2 = _round_bf16(b_z2, SOFT_CASTS)
            b_z3 = _round_bf16(b_z3, SOFT_CASTS)

        # [BLOCK_R] per-row scale (_ue8m0_scale). (max is exact in any order: reduce the four streams
        # element-wise first, then across threads once)
        b_amax = tl.maximum(tl.maximum(tl.abs(b_z0), tl.abs(b_z1)), tl.maximum(tl.abs(b_z2), tl.abs(b_z3)))
        b_scale, b_inv = _ue8m0_scale(tl.maximum(tl.max(b_amax, axis=1), AMAX_FLOOR))
        b_inv = b_inv[:, None]

        p_q = x_fp8 + o_r.to(tl.int64)[:, None] * D
        tl.store(p_q + o_0[None, :], _e4m3_bits(b_z0 * b_inv, SOFT_CASTS), mask=m_r)
        tl.store(p_q + o_1[None, :], _e4m3_bits(b_z1 * b_inv, SOFT_CASTS), mask=m_r)
        tl.store(p_q + o_2[None, :], _e4m3_bits(b_z2 * b_inv, SOFT_CASTS), mask=m_r)
        tl.store(p_q + o_3[None, :], _e4m3_bits(b_z3 * b_inv, SOFT_CASTS), mask=m_r)
        tl.store(scale + o_r, b_scale, mask=o_r < R)
        if GATE:
            # the indexer's head weights, the layer's ops in their order: ((gate * H^-0.5) * scale) * D^-0.5,
            # each product rounded in fp32 (the constants are fp32, as torch rounds a Python scalar)
            o_rt = o_r // H
            b_g = _load_f32(gate + o_rt.to(tl.int64) * stride_gt + (o_r % H).to(tl.int64) * stride_gh, o_r < R,
                            GATE_BF16)
            tl.store(w + o_r, b_g * gate_scale * b_scale * head_scale, mask=o_r < R)


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class IndexerQuantConfig:
    """Launch configuration of :func:`indexer_quant_fwd_kernel`, what tests and benchmarks pass; ``None`` fields
    take the defaults. ``block_r`` and ``num_warps`` are tuning knobs; ``soft_casts=True`` on the GPU is a
    test hook (the interpreter's rounding code, compiled; the default launch compiles without it).
    """
    block_r: int | None = None       # rows per program, a power of two; None: BLOCK_R (interpreter: BLOCK_R_INTERPRET)
    num_warps: int = NUM_WARPS
    soft_casts: bool | None = None   # integer rounding to bf16 / e4m3 instead of the hardware conversions;
    #                                  None: only in the interpreter (its casts do not round to nearest even)

    def __post_init__(self):
        if self.block_r is not None and not _pow2(self.block_r):
            raise ValueError(f"config: expected block_r a power of two, got {self.block_r!r}")
        if not _pow2(self.num_warps):
            raise ValueError(f"config: expected num_warps a power of two, got {self.num_warps!r}")


def indexer_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, *,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  config: IndexerQuantConfig | None = None, check: bool = False,
                  gate: tuple[torch.Tensor, float, float] | None = None):
    """Launch :func:`indexer_quant_fwd_kernel` (inputs checked by ``flashdsa.ops.indexer_quant``).

    Args:
        x:          ``[T, ..., 128]`` bfloat16 / float32, any strides (viewed ``[T, H, 128]``).
        cos, sin:   ``[T, 32] float32``, any strides; ``[T, 0]`` for NoPE (no rotation: the Hadamard and the
                    quantisation alone).
        interleave: GPT-J pairs (True) or NeoX pairs (False).
        out:        optional contiguous ``(x_fp8 [T, ..., 128] e4m3, scale [T, ...] f32)`` to write into.
        config:     overrides the launch (tests, benchmarks).
        check:      the kernel also flags NaN / inf and out-of-bound values of x, cos and sin (the default
                    mode's device checks: deferred ValueError, ``flashdsa._checks``).
        gate:       ``(g [T, H] bfloat16 / float32, gate_scale, head_scale)`` (x ``[T, H, 128]``): also the
                    indexer's head weights ``w = ((g * gate_scale) * scale) * head_scale`` in fp32, the
                    layer's ops and roundings (:func:`flashdsa.ops.indexer_quant.indexer_quant_weights`).

    Returns:
        ``x_fp8 [T, ..., 128] float8_e4m3fn`` and ``scale [T, ...] float32`` (UE8M0 powers of two); with
        ``gate`` also ``w [T, H] float32``.
    """
    if out is None:
        out = (torch.empty(*x.shape, dtype=FP8, device=x.device),
               torch.empty(*x.shape[:-1], dtype=torch.float32, device=x.device))
    x_fp8, scale = out
    w = None if gate is None else torch.empty(*x.shape[:-1], dtype=torch.float32, device=x.device)
    _launch(_LAUNCH, x, cos, sin, interleave, x_fp8, torch.uint8, scale, False, config, check, gate, w)
    return (x_fp8, scale) if gate is None else (x_fp8, scale, w)


def indexer_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, *,
                 out: torch.Tensor | None = None, config: IndexerQuantConfig | None = None) -> torch.Tensor:
    """The same kernel's first step alone: ``x.dtype(indexer_rope(x, cos, sin, interleave))``, bit for bit
    (kpool pools the keys between the RoPE and the Hadamard). Arguments as :func:`indexer_quant`; ``out``:
    an optional contiguous ``[T, ..., 128]`` tensor of x's dtype. Returns it (new: contiguous)."""
    if out is None:
        out = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    bits = torch.int16 if x.dtype == torch.bfloat16 else None
    _launch(_ROPE, x, cos, sin, interleave, out, bits, out, True, config, False)  # no scale: its pointer is unused
    return out


def _launch(launcher, x, cos, sin, interleave, a, a_bits, b, rope_only, config, check, gate=None, w=None) -> None:
    """One launch writing ``a`` (e4m3, or the rotated rows; the kernel sees it as ``a_bits`` when not None)
    and ``b`` (the scales; unused rope-only); ``check``: with the value checks; ``gate`` (g, gate_scale,
    head_scale): also the head weights into ``w``."""
    T = x.shape[0]
    H = math.prod(x.shape[1:-1])
    R = T * H
    if R == 0:
        return
    x3 = x if x.dim() == 3 else x.reshape(T, H, D)  # a view unless the middle dims cannot merge
    bf16 = x.dtype == torch.bfloat16
    cfg = config or _DEFAULT
    rope = cos.shape[-1] > 0
    if not rope:  # NoPE: the tables are never read (compiled out); x stands in for their pointers
        cos = sin = x3
    flag = error_flag(x.device) if check else cos  # unused (compiled out) without checks: any pointer
    g, gate_scale, head_scale = gate if gate is not None else (b, 1.0, 1.0)  # no gate: compiled out
    if gate is None:
        w = b
    g_bf16 = g.dtype == torch.bfloat16
    ptrs = (x3.data_ptr(), cos.data_ptr(), sin.data_ptr(), a.data_ptr(), b.data_ptr(), flag.data_ptr(),
            g.data_ptr(), w.data_ptr())
    key = (x.device, T, H, x3.stride(), bf16, cos.stride(), sin.stride(), interleave, config, check, rope,
           gate is not None, g.stride(), g_bf16, gate_scale, head_scale) if aligned(*ptrs) else None

    def build():
        block_r = cfg.block_r or (BLOCK_R_INTERPRET if interpreting() else BLOCK_R)
        soft_casts = interpreting() if cfg.soft_casts is None else cfg.soft_casts
        kw = dict(
            # bf16 travels as its int16 bits: the kernel widens them to fp32 exactly with a shift
            x=x3.view(torch.int16) if bf16 else x3, cos=cos, sin=sin, x_fp8=a if a_bits is None else a.view(a_bits),
            scale=b,
            R=R, H=H, stride_xt=x3.stride(0), stride_xh=x3.stride(1), stride_xd=x3.stride(2),
            stride_ct=cos.stride(0), stride_cd=cos.stride(1), stride_st=sin.stride(0), stride_sd=sin.stride(1),
            INTERLEAVE=interleave, BF16=bf16, SOFT_CASTS=soft_casts, BLOCK_R=block_r, D=D,
            AMAX_FLOOR=AMAX_FLOOR, H_SCALE=D ** -0.5,
            # no mul + add -> FMA contraction: RoPE's a * c - b * s must round both products, as torch does
            num_warps=cfg.num_warps, enable_fp_fusion=False,
            # every argument by name, the constexpr too: a launch plan (ops/_launch.py) needs them all
            ROPE_ONLY=rope_only, flag=flag, code0=QUANT_CODE0, CHECK=check, X_MAX=X_BOUND, C_MAX=COS_BOUND,
            ROPE=rope, gate=g.view(torch.int16) if g_bf16 else g, w=w, stride_gt=g.stride(0),
            stride_gh=g.stride(1) if g.dim() > 1 else 0, gate_scale=gate_scale, head_scale=head_scale,
            GATE=gate is not None, GATE_BF16=g_bf16,
        )
        return (cdiv(R, block_r),), kw

    launcher(key, ptrs, build)


_DEFAULT = IndexerQuantConfig()
_POINTERS = ("x", "cos", "sin", "x_fp8", "scale", "flag", "gate", "w")
_LAUNCH = KernelLauncher(indexer_quant_fwd_kernel, _POINTERS)
_ROPE = KernelLauncher(indexer_quant_fwd_kernel, _POINTERS)
