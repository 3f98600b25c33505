"""V4's RoPE on the trailing channels of a head (HF's ``apply_rotary_pos_emb``): the torch ops, and one Triton
launch for the fp8 mode.

V4 lays a head out as ``[nope | rope]`` and rotates interleaved pairs (2i, 2i + 1) of the trailing ``R``
channels in fp32, back to the input's dtype. In torch that is ~10 small kernels a call (slice, reshape, the
pair split, four products, stack, cat, cast), and a decode step makes four such calls (the query, the key row,
the indexer's query, the output rotated back): the kernel does a call in one launch. Its products may fuse
into FMAs (another rounding than torch's separate multiply and add), so exact mode keeps the torch ops for HF's
bits and fp8 mode takes the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.ops._common import pick_backend
from flashdsa.quant import apply_rope


@triton.jit
def rope_tail_kernel(x, cos, sin, out, K, D: tl.constexpr, R: tl.constexpr, NEG: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program a head row ``i`` (of K a cos row): the first D - R channels copied, the pairs rotated."""
    i = tl.program_id(0).to(tl.int64)
    m = i // K
    DT = out.dtype.element_ty
    c = tl.arange(0, BLOCK_D)
    keep = c < D - R
    tl.store(out + i * D + c, tl.load(x + i * D + c, mask=keep).to(DT), mask=keep)
    j = tl.arange(0, BLOCK_R)
    jm = j < R // 2
    cs = tl.load(cos + m * (R // 2) + j, mask=jm, other=0.0).to(tl.float32)
    sn = tl.load(sin + m * (R // 2) + j, mask=jm, other=0.0).to(tl.float32)
    if NEG:
        sn = -sn
    p = i * D + (D - R) + 2 * j
    a = tl.load(x + p, mask=jm, other=0.0).to(tl.float32)
    b = tl.load(x + p + 1, mask=jm, other=0.0).to(tl.float32)
    tl.store(out + p, (a * cs - b * sn).to(DT), mask=jm)
    tl.store(out + p + 1, (b * cs + a * sn).to(DT), mask=jm)


def rope_tail_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [M, ..., D]`` with RoPE on its trailing ``R = 2 * cos.shape[-1]`` channels at ``cos, sin [M, R / 2]``
    (row m's position; any float dtype, used in fp32), in fp32, then ``out_dtype`` (default x's); ``inverse``
    rotates by -position (sin negated)."""
    half = cos.shape[-1]
    r, M = 2 * half, x.shape[0]
    tail = x[..., -r:].reshape(M, *x.shape[1:-1], r)
    s = sin.reshape(M, half).float()
    rot = apply_rope(tail, cos.reshape(M, half).float(), -s if inverse else s, True)
    dt = out_dtype or x.dtype
    return torch.cat((x[..., :-r].to(dt), rot.view(x.shape[:-1] + (r,)).to(dt)), dim=-1)


def rope_tail_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`rope_tail_torch` in one launch (any product rounding: FMAs allowed)."""
    M, D = x.shape[0], x.shape[-1]
    R = 2 * cos.shape[-1]
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    rows = x.numel() // D
    if rows:
        rope_tail_kernel[(rows,)](x, cos.reshape(M, R // 2).contiguous(), sin.reshape(M, R // 2).contiguous(), out,
                                  rows // M, D=D, R=R, NEG=inverse, BLOCK_D=triton.next_power_of_2(D),
                                  BLOCK_R=triton.next_power_of_2(max(R // 2, 1)), num_warps=4)
    return out


_IMPLS = {"torch": rope_tail_torch, "triton": rope_tail_triton}


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
              out_dtype: torch.dtype | None = None, *, backend: str | None = None) -> torch.Tensor:
    """:func:`rope_tail_torch` (``backend`` "torch", HF's bits) or the kernel ("triton"; None: the kernel on CUDA)."""
    impl = pick_backend(backend, _IMPLS, x.device, "rope_tail")
    if not 0 < 2 * cos.shape[-1] <= x.shape[-1]:
        raise ValueError(f"cos: expected R / 2 with 0 < R <= the head dim {x.shape[-1]}, got {cos.shape[-1]}")
    return impl(x, cos, sin, inverse, out_dtype)
