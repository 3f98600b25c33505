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


def indexer_quant_weights(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, gate: torch.Tensor,
                          gate_scale: float, head_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's queries and head weights as its layer composes them: ``x [T, H, 128]`` quantised by
    :func:`indexer_quant`, ``w = ((gate.float() * gate_scale) * scale) * head_scale`` for ``gate [T, H]`` ->
    ``x_fp8 [T, H, 128] e4m3``, ``w [T, H] f32``."""
    x_fp8, scale = indexer_quant(x, cos, sin, interleave)
    return x_fp8, gate.float() * gate_scale * scale * head_scale

