"""FlashMLA's 656-B fp8 row (:func:`flashdsa.cache.layouts.quantize_mla_656`) in one Triton launch, bit for bit.

The torch composition is ~16 small kernels a call (act_quant's blocks, amax, the UE8M0 rounding by frexp, the
cast, three field copies); a V4 fp8 decode step encodes two rows a request per compressed layer (the token's and
a closing window's entry). One program takes BLOCK_R rows:

    latent [512] -> 4 blocks of 128: scale = ue8m0(max(amax, 1e-4) / 448), e4m3(x / scale)   bytes 0..511
    the 4 scales, fp32                                                                           bytes 512..527
    rope [64] -> bf16 (round to nearest even from fp32)                                          bytes 528..655

NoPE rows (``kv [N, 512]``, ROPE 0) are the 528-B row without its rope part.

The same bits as the reference for the reasons ``flashdsa/ops/indexer_quant/triton.py`` gives (it shares its
cast helpers): the scale read off amax's exponent and mantissa bits (no fp32 division), x / scale as x times
the exact reciprocal of a power of two, casts that round to nearest even (the hardware's on the GPU, integer
code in the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.ops._triton_utils import interpreting
from flashdsa.cache.layouts import MLA_DIM, MLA_FP8_BYTES, MLA_LATENT, mla_row_width
from flashdsa.ops.indexer_quant.triton import _e4m3_bits, _load_f32, _round_bf16, _ue8m0_scale
from flashdsa.quant import AMAX_FLOOR, FP8_MAX

assert FP8_MAX == 448.0  # the scale rule (_ue8m0_scale) reads amax's bits against 1.75 * 2^8
assert (MLA_DIM, MLA_LATENT, MLA_FP8_BYTES) == (576, 512, 656)  # the kernel's offsets below


@triton.jit
def mla_656_kernel(kv, out, N, AMAX_FLOOR: tl.constexpr, BF16: tl.constexpr, SOFT_CASTS: tl.constexpr,
                   BLOCK_R: tl.constexpr, ROPE: tl.constexpr):
    D: tl.constexpr = 512 + ROPE          # kv's row
    W: tl.constexpr = 528 + 2 * ROPE      # out's row
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < N
    r64 = r.to(tl.int64)
    d = tl.arange(0, 128)
    for blk in tl.static_range(4):
        x = _load_f32(kv + r64[:, None] * D + blk * 128 + d[None, :], rm[:, None], BF16)
        scale, inv = _ue8m0_scale(tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR))
        q = _e4m3_bits(x * inv[:, None], SOFT_CASTS)
        tl.store(out + r64[:, None] * W + blk * 128 + d[None, :], q, mask=rm[:, None])
        p_s = (out + r64 * W + 512).to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(p_s + blk, scale, mask=rm)
    if ROPE > 0:
        j = tl.arange(0, ROPE)
        y = _load_f32(kv + r64[:, None] * D + 512 + j[None, :], rm[:, None], BF16)
        if not BF16:
            y = _round_bf16(y, SOFT_CASTS)
        hi = (y.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
        p_r = (out + r64 * W + 528).to(tl.pointer_type(tl.int16), bitcast=True)
        tl.store(p_r[:, None] + j[None, :], hi, mask=rm[:, None])


def quantize_mla_656_triton(kv: torch.Tensor) -> torch.Tensor:
    """``kv [N, 576]`` bf16 / fp32 -> ``[N, 656] uint8`` (NoPE: ``[N, 512] -> [N, 528]``):
    :func:`~flashdsa.cache.layouts.quantize_mla_656`'s bits (UE8M0 scales) in one launch."""
    if kv.dim() != 2 or kv.shape[1] not in (MLA_DIM, MLA_LATENT) or kv.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"kv: expected [N, {MLA_DIM}] or [N, {MLA_LATENT}] (NoPE) bfloat16 or float32, got "
                         f"{kv.dtype} {list(kv.shape)}")
    kv = kv.contiguous()
    N, rope = kv.shape[0], kv.shape[1] - MLA_LATENT
    out = torch.empty(N, mla_row_width("fp8", rope), dtype=torch.uint8, device=kv.device)
    if N:
        bf16 = kv.dtype == torch.bfloat16
        block = 4
        src = kv.view(torch.int16) if bf16 else kv  # bf16 read as its bits and widened by a shift (exact)
        mla_656_kernel[(triton.cdiv(N, block),)](src, out, N, AMAX_FLOOR=AMAX_FLOOR, BF16=bf16,
                                                 SOFT_CASTS=interpreting(), BLOCK_R=block, ROPE=rope, num_warps=4)
    return out
