"""RoPE tables for MLA and the indexer (both rotate qk_rope_head_dim = 64 dims), YaRN included."""

from __future__ import annotations

import math

import torch
from torch import nn

from flashdsa.config import DSAConfig


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """DeepSeek's YaRN: interpolate low frequencies by ``factor``, keep high ones, ramp in between."""
    factor = float(scaling["factor"])
    orig = int(scaling.get("original_max_position_embeddings", 4096))
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))
    base = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1 = keep the original frequency (high freq), 0 = interpolate
    return base / factor * (1 - keep) + base * keep


class RotaryEmbedding(nn.Module):
    """cos / sin for positions: ``positions [T] int -> cos, sin [T, rope_dim // 2] float32``."""

    def __init__(self, cfg: DSAConfig):
        super().__init__()
        dim = cfg.qk_rope_head_dim
        rs = dict(cfg.rope_scaling or {})
        if rs.get("type", rs.get("rope_type")) == "yarn" and rs.get("factor", 1) > 1:
            inv = yarn_inv_freq(dim, cfg.rope_theta, rs)
        else:
            inv = cfg.rope_theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.to(torch.float64)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return ang.cos().float(), ang.sin().float()
