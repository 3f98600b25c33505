"""The lightning indexer layer (SPEC §3): projections, RoPE, Hadamard, fp8 and the folded head gate.

Parameter names follow the Hugging Face DeepSeek-V3.2 checkpoint (``self_attn.indexer.*``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from flashdsa.config import DSAConfig
from flashdsa.quant import act_quant, hadamard, indexer_rope


class IndexerOutput(NamedTuple):
    q_fp8: torch.Tensor    # [T, H, D] float8_e4m3fn
    weights: torch.Tensor  # [T, H] float32, q_scale * H^-0.5 * D^-0.5 folded in
    k_fp8: torch.Tensor    # [T, D] float8_e4m3fn, the new tokens' keys (to be written to the cache)
    k_scale: torch.Tensor  # [T] float32


class Indexer(nn.Module):
    """``x [T, hidden]``, ``qr [T, q_lora_rank]`` (the normed MLA query latent) -> :class:`IndexerOutput`."""

    def __init__(self, cfg: DSAConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.interleave = cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=torch.float32)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> IndexerOutput:
        T = x.shape[0]
        q = self.wq_b(qr).view(T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x).float()).to(x.dtype)
        # RoPE on the first rope_dim dims ([rope | nope]), then the Hadamard rotation, in bf16 as deployed.
        q = hadamard(indexer_rope(q, cos, sin, self.interleave).to(x.dtype))
        k = hadamard(indexer_rope(k, cos, sin, self.interleave).to(x.dtype))
        q_fp8, q_scale = act_quant(q, block=self.head_dim)
        k_fp8, k_scale = act_quant(k, block=self.head_dim)
        w = self.weights_proj(x).float() * self.n_heads ** -0.5 * q_scale[..., 0] * self.head_dim ** -0.5
        return IndexerOutput(q_fp8, w, k_fp8, k_scale[..., 0])
