"""DSA attention: MLA in its absorbed (MQA) form with the indexer choosing the keys.

Parameter names follow the Hugging Face DeepSeek-V3.2 checkpoint (``self_attn.*``)::

    q_a_proj [q_lora, hidden]  q_a_layernorm  q_b_proj [h * (nope + rope), q_lora]
    kv_a_proj_with_mqa [512 + rope, hidden]  kv_a_layernorm  kv_b_proj [h * (nope + v), 512]
    o_proj [hidden, h * v]     indexer.* (top-k layers only)

Absorbed form: ``kv_b_proj`` splits per head into W_uk [nope, 512] and W_uv [v, 512]. The query's
nope part is mapped into the latent space (``q_nope @ W_uk``) so every head attends over the same
576-dim cache rows (512 latent + 64 rope), and the attention output (512-dim latent) is mapped back
with W_uv before ``o_proj``. MLA's own RoPE uses interleaved pairs (DeepSeek's layout).
"""

from __future__ import annotations

import torch
from torch import nn

from flashdsa.config import DSAConfig
from flashdsa.layers.indexer import Indexer
from flashdsa.quant import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class DSAAttention(nn.Module):
    """Projections of one DSA attention layer. The attention itself runs in the engine (it needs the
    paged caches and the batch metadata): this module prepares its inputs and finishes its output."""

    def __init__(self, cfg: DSAConfig, layer_id: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.layer_id = layer_id
        self.h, self.nope, self.rope, self.v = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                                                cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.kv_lora_rank = cfg.kv_lora_rank
        self.softmax_scale = cfg.softmax_scale
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.h * (self.nope + self.rope), bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.kv_lora_rank + self.rope, bias=False, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.h * (self.nope + self.v), bias=False, dtype=dtype)
        self.o_proj = nn.Linear(self.h * self.v, cfg.hidden_size, bias=False, dtype=dtype)
        self.indexer = Indexer(cfg, dtype) if layer_id in cfg.topk_layers else None

    def _w_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.h, self.nope + self.v, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]  # W_uk [h, nope, 512], W_uv [h, v, 512]

    def prepare(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [T, hidden]`` -> (``q [T, h, 576] bf16`` absorbed query, ``kv [T, 576] bf16`` cache rows,
        ``qr [T, q_lora]`` the normed query latent the indexer reads)."""
        T = x.shape[0]
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr).view(T, self.h, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        w_uk, _ = self._w_kv_b()
        # In the weights' dtype (fp32 accumulation inside the GEMM): an fp32 copy of W_uk per call would
        # move 3x its bytes every decode step, and q is rounded to bf16 for the kernels anyway.
        q_lat = torch.einsum("thn,hnc->thc", q_nope.to(w_uk.dtype), w_uk)
        q_pe = apply_rope(q_pe, cos, sin, interleave=True)
        q_abs = torch.cat((q_lat, q_pe), dim=-1).to(torch.bfloat16)
        kv = self.kv_a_proj_with_mqa(x)
        c, k_pe = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        k_pe = apply_rope(k_pe, cos, sin, interleave=True)
        kv_rows = torch.cat((self.kv_a_layernorm(c).float(), k_pe), dim=-1).to(torch.bfloat16)
        return q_abs, kv_rows, qr

    def finish(self, out_latent: torch.Tensor) -> torch.Tensor:
        """``out_latent [T, h, 512] bf16`` -> ``[T, hidden]`` (W_uv per head, then o_proj)."""
        _, w_uv = self._w_kv_b()
        o = torch.einsum("thc,hvc->thv", out_latent.to(w_uv.dtype), w_uv).to(self.o_proj.weight.dtype)
        return self.o_proj(o.flatten(1))
