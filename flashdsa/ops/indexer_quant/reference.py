"""The indexer's deployment numerics (docs/DSA.md §3) as flashdsa.quant composes them: RoPE, rounding to the
model dtype, Hadamard rotation, block fp8 quantisation. Plain PyTorch, the definition the kernel matches."""

from __future__ import annotations

import torch

from flashdsa.quant import act_quant, hadamard, indexer_rope


def indexer_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, ..., 128]`` (model dtype), ``cos, sin [T, 32] f32`` -> ``[T, ..., 128] e4m3``, ``[T, ...] f32``."""
    y = rope_model_dtype(x, cos, sin, interleave)
    # hadamard returns the model dtype: its fp32 result is rounded once more before act_quant
    x_fp8, scale = act_quant(hadamard(y), block=x.shape[-1])
    return x_fp8, scale[..., 0]


def rope_model_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The first step alone: ``x [T, ..., 128]`` rotated (fp32) and rounded to x's dtype."""
    return indexer_rope(x, cos, sin, interleave).to(x.dtype)
