"""Numerics of the indexer (docs/DSA.md §3): block fp8 quantisation, the Hadamard rotation, indexer RoPE.

All math is fp32; results are returned in the dtype each function documents.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # keeps the scale of an all-zero block finite


def round_scale_ue8m0(s: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales UP to a power of two, exactly (``2**ceil(log2 s)`` without log2's rounding).

    frexp gives s = m * 2**e with m in [0.5, 1); s is already a power of two iff m == 0.5.
    """
    m, e = torch.frexp(s)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(s), e)


def act_quant(x: torch.Tensor, block: int = 128, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise fp8 quantisation along the last dim.

    Args:
        x: ``[..., D]`` float (any float dtype), ``D % block == 0``.
        block: elements per scale.
        ue8m0: round each scale up to a power of two (DeepSeek's UE8M0 scale format), kept as fp32.

    Returns:
        ``x_fp8 [..., D] float8_e4m3fn`` and ``scale [..., D // block] float32`` with
        ``x ≈ x_fp8 * scale`` per block; ``scale = max(amax, 1e-4) / 448`` (then rounded if ue8m0).
    """
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got {x.dtype}")
    if block <= 0 or x.shape[-1] % block:
        raise ValueError(f"block: the last dim of x ({x.shape[-1]}) must be a multiple of block ({block})")
    xb = x.float().unflatten(-1, (x.shape[-1] // block, block))
    amax = xb.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = round_scale_ue8m0(scale)
    q = (xb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2), scale


def act_dequant(x_fp8: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of :func:`act_quant`: ``[..., D] fp8`` and ``[..., D // block] f32`` -> ``[..., D] f32``."""
    xb = x_fp8.float().unflatten(-1, (x_fp8.shape[-1] // block, block))
    return (xb * scale.unsqueeze(-1)).flatten(-2)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard matrix in Sylvester order, ``[n, n]``, n a power of two."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"n: expected a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * n ** -0.5).to(dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Sylvester Walsh–Hadamard transform of the last dim (a power of two).

    ``x: [..., n]`` float -> same shape and dtype, computed in fp32 (fast butterflies, n log n).
    Equal to ``x @ hadamard_matrix(n)`` (the matrix is symmetric); dot products are unchanged.
    """
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"x: the last dim must be a power of two, got {n}")
    y = x.float()
    lead = y.shape[:-1]
    h = 1
    while h < n:
        # pair element i with i + h inside each block of 2h: (a, b) -> (a + b, a - b)
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return (y.reshape(*lead, n) * n ** -0.5).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, rope_dim: int = 64, theta: float = 10000.0,
                 inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for RoPE: ``positions [T] int`` -> ``cos, sin [T, rope_dim // 2] f32``.

    ``inv_freq [rope_dim // 2]`` overrides the plain ``theta ** (-2i / rope_dim)`` frequencies (YaRN).
    """
    if inv_freq is None:
        inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=positions.device) / rope_dim)
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate ``x [T, ..., R]`` (R = 2 * cos.shape[-1]) by position; returns fp32.

    ``interleave=False``: NeoX pairs (i, i + R/2). ``interleave=True``: GPT-J pairs (2i, 2i + 1).
    ``cos, sin: [T, R/2] f32`` broadcast over the middle dims.
    """
    x = x.float()
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


def indexer_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Indexer RoPE: rotate the FIRST ``2 * cos.shape[-1]`` dims of each head (layout ``[rope | nope]``).

    ``x: [T, ..., D]`` -> ``[T, ..., D]`` fp32; the nope dims pass through unchanged.
    """
    r = 2 * cos.shape[-1]
    return torch.cat((apply_rope(x[..., :r], cos, sin, interleave), x[..., r:].float()), dim=-1)
