"""A small DSA transformer: embedding, layers of RMSNorm + DSA attention + RMSNorm + SwiGLU MLP, LM head.

Weights are random (seeded) — the model exists to drive the DSA path the way a serving engine does,
with the real layer shapes of a preset. Parameter names follow the HF DeepSeek-V3.2 checkpoint
(``model.layers.{i}.self_attn.*``), with a dense MLP in place of the MoE.
"""

from __future__ import annotations

import torch
from torch import nn

from flashdsa.config import DSAConfig
from flashdsa.layers import DSAAttention, RMSNorm, RotaryEmbedding


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSAConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSAAttention(cfg, layer_id, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype)


class DSAModel(nn.Module):
    """Weights only; :class:`flashdsa.engine.runner.Runner` runs the forward over the paged caches."""

    def __init__(self, cfg: DSAConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg)

    @classmethod
    def random(cls, cfg: DSAConfig, seed: int = 0, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.bfloat16) -> "DSAModel":
        """Seeded random weights, scaled so activations stay O(1) through the layers (kpool's gate scores
        ``index_kpool_compress_gate @ x`` too, its place term ``index_kpool_compress_ape`` about half of them)."""
        device = torch.device(device)
        # Drawn on the target device: a big preset's weights are too slow to draw on the CPU.
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.device("meta"):
            model = cls(cfg, dtype)
        model = model.to_empty(device=device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                w = torch.randn(p.shape, generator=gen, device=device)
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    w = 1 + 0.1 * w
                elif name.endswith("k_norm.bias"):
                    w = 0.1 * w
                elif name.endswith("index_kpool_compress_ape"):
                    w = 0.5 * w  # a place term as large as the gate scores' spread, so both shape the pooling
                elif p.dim() == 2 and "embed" not in name:
                    w = w * p.shape[1] ** -0.5
                p.copy_(w.to(p.dtype))
        model.rotary = RotaryEmbedding(cfg).to(device)
        return model.eval()
