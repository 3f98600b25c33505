"""What both indexer kernels (``paged.py``, ``ragged.py``) share: the inner step, the fp16 upcast of e4m3
bytes for GPUs without fp8 dots, the -inf fill and the output buffer.

The inner step scores a block of ``BLOCK_N`` keys as the M side of an fp8 tensor-core dot against query
rows x ``HP`` heads folded into the N side,

    s[t, g * HP + h] = k[t] . q[g, h]            # tl.dot([BLOCK_N, D] e4m3, [D, rows * HP] e4m3) -> fp32
    logit[t, g]      = k_scale[t] * sum_h w[g, h] * relu(s[t, g * HP + h])

so the head sum runs along the dot's N dim (inside a thread and its quad on Hopper, no shared memory) and
each key is loaded once for all rows. Padded heads / rows have q = w = 0 and add exactly 0. Derivation,
roofline and measurements: README.md next to this file.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One dot's N side (G rows x HP heads) is capped so the fp32 accumulator stays <= 128 registers a thread.
MAX_DOT_N = 256


def fp8_dot_supported(device: torch.device) -> bool:
    """e4m3 x e4m3 tensor-core dots need sm_89+ (Ada, Hopper, Blackwell); older GPUs upcast to fp16."""
    if device.type != "cuda":
        return True  # the interpreter computes fp8 dots exactly
    from flashdsa.ops._launch import capability
    return capability(device) >= (8, 9)


def logits_buffer(out: torch.Tensor | None, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """``out`` checked to be a ``shape`` float32 buffer on ``device`` with unit last stride, or a new one."""
    if out is None:
        return torch.empty(*shape, dtype=torch.float32, device=device)
    bad_stride = out.dim() == 2 and out.stride(-1) != 1 and shape[1] > 1
    if out.dtype != torch.float32 or tuple(out.shape) != shape or out.device != device or bad_stride:
        raise ValueError(f"out: expected float32 {list(shape)} on {device} with unit last stride, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}, strides {out.stride()}")
    return out


@triton.jit
def e4m3_bits_to_f16(x):
    """uint8 e4m3fn bits -> the same value in fp16, exactly (for GPUs without fp8 conversions).

    Moving sign | exponent | mantissa into fp16's fields gives value * 2^(7 - 15) for normals and
    subnormals alike (both formats place the binary point the same way); * 256 undoes the bias gap.
    """
    b = x.to(tl.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def gated_relu_sum(b_k, b_qt, b_w, G: tl.constexpr, HP: tl.constexpr):
    """``b_k [BLOCK_N, D]``, ``b_qt [D, G * HP]`` (same dtype), ``b_w [G * HP] f32`` -> ``[BLOCK_N, G] f32``:
    ``sum_h w[g, h] * relu(k[t] . q[g, h])``."""
    # [BLOCK_N, G * HP]; fp32 accumulation on the tensor cores
    b_s = tl.dot(b_k, b_qt)
    b_s = tl.maximum(b_s, 0.0) * b_w[None, :]
    # row g's heads are the contiguous columns g * HP .. g * HP + HP - 1 (a free reshape of the
    # accumulator's layout: no data moves)
    return tl.sum(tl.reshape(b_s, [b_k.shape[0], G, HP]), axis=2)


@triton.jit
def fill_neg_inf(p_rows, m_rows, start, stop, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """Store -inf at columns [start, stop) of G rows (``p_rows [G]`` row pointers, ``m_rows [G]`` valid)."""
    o_n = tl.arange(0, BLOCK_N)
    b_inf = tl.full([G, BLOCK_N], float("-inf"), tl.float32)
    for t0 in range(start, stop, BLOCK_N):
        o_t = t0 + o_n
        tl.store(p_rows[:, None] + o_t[None, :], b_inf, mask=m_rows[:, None] & (o_t[None, :] < stop))
