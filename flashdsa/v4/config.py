"""DeepSeek-V4's attention configuration (transformers ``deepseek_v4``) as one frozen dataclass.

V4 is DSA's successor (issue #43): every layer attends to a sliding window of raw tokens plus, in its
compressed layers, entries that each stand for ``compress_rate`` tokens. Three layer types:

* ``sliding_attention``: the window alone;
* ``compressed_sparse_attention`` (CSA, rate 4): the window and the ``index_topk`` entries a lightning
  indexer picks from overlapping 2 x 4-token windows (its own 128-dim keys, ``index_n_heads`` heads);
* ``heavily_compressed_attention`` (HCA, rate 128): the window and every entry so far (dense).

The attention is MQA: one K = V head of ``head_dim`` (512) with RoPE on its trailing ``rope_head_dim`` (64)
channels, per-head sinks in the softmax denominator, a grouped low-rank output projection. What a token
costs in the caches (:meth:`V4Config.cache_bytes_per_token`) is the plan's figure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from flashdsa.config import read_config_json

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
V4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
_LEGACY_RATIO = {0: SLIDING, 4: CSA, 128: HCA}  # older configs' per-layer compress_ratios


def is_v4(hf_config: Mapping[str, Any]) -> bool:
    """True iff the HF config describes DeepSeek-V4 (``DeepseekV4ForCausalLM`` or model_type ``deepseek_v4``)."""
    archs = hf_config.get("architectures") or []
    return hf_config.get("model_type") == "deepseek_v4" or any(a in V4_ARCHITECTURES for a in archs)


@dataclass(frozen=True)
class V4Config:
    """The attention part of a DeepSeek-V4 config (transformers' ``DeepseekV4Config`` names and defaults:
    V4-Flash). ``layer_types`` per layer, ``compress_rates`` per compressed type."""

    num_hidden_layers: int = 43
    hidden_size: int = 4096
    num_attention_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    csa_rate: int = 4
    hca_rate: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    max_position_embeddings: int = 1048576

    def __post_init__(self) -> None:
        positive = ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                    "o_lora_rank", "sliding_window", "csa_rate", "hca_rate", "index_n_heads", "index_head_dim",
                    "index_topk", "max_position_embeddings")
        for key in positive:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key}: expected a positive integer, got {value!r}")
        if not self.layer_types:  # transformers' default: 2 HCA, then HCA / CSA interleaved
            n = self.num_hidden_layers
            object.__setattr__(self, "layer_types", tuple([HCA] * min(n, 2) + [
                CSA if i % 2 else HCA for i in range(max(n - 2, 0))]))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types: expected {self.num_hidden_layers} entries (num_hidden_layers), "
                             f"got {len(self.layer_types)}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"layer_types: expected entries of {LAYER_TYPES}, got {bad}")
        if not 0 <= self.rope_head_dim <= self.head_dim or self.rope_head_dim % 2:
            raise ValueError(f"rope_head_dim: expected an even number in [0, head_dim {self.head_dim}], "
                             f"got {self.rope_head_dim}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups: expected a divisor of num_attention_heads ({self.num_attention_heads}), "
                             f"got {self.o_groups}")
        if self.head_dim > 512:
            # the attention runs on flashdsa's MLA rows: K = V in the 512-dim latent part
            raise ValueError(f"head_dim: flashdsa's rows hold K = V heads of at most 512 dims, got {self.head_dim}")

    # ---- what the layers hold -------------------------------------------------------------------
    def rate(self, layer: int) -> int:
        """Tokens a compressed entry of ``layer`` stands for (0: a sliding layer, no entries)."""
        t = self.layer_types[layer]
        return self.csa_rate if t == CSA else self.hca_rate if t == HCA else 0

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    def cache_bytes_per_token(self, kv_bytes: int = 2, index_bytes: int = 2) -> dict[str, float]:
        """Bytes a context token costs each layer type once the context is long (the window's ring is a fixed
        ``sliding_window`` rows a request, not per token): CSA a ``head_dim`` entry and an ``index_head_dim``
        indexer key per ``csa_rate`` tokens, HCA one entry per ``hca_rate``; the compressor's pending partial
        window (fewer than 2 x rate tokens a request) aside. ``kv_bytes`` / ``index_bytes``: a stored element's
        bytes (2: bf16; an fp8 layout adds its scales, see docs)."""
        entry = self.head_dim * kv_bytes
        return {SLIDING: 0.0,
                CSA: (entry + self.index_head_dim * index_bytes) / self.csa_rate,
                HCA: entry / self.hca_rate}

    def window_bytes(self, kv_bytes: int = 2) -> int:
        """Bytes of one request's window ring in one layer (every layer type has one)."""
        return self.sliding_window * self.head_dim * kv_bytes

    def selected_entries(self, layer: int, context: int) -> int:
        """Keys one query attends to in ``layer`` at ``context`` tokens: the window plus the entries."""
        window = min(context, self.sliding_window)
        t = self.layer_types[layer]
        if t == CSA:
            return window + min(self.index_topk, context // self.csa_rate)
        if t == HCA:
            return window + context // self.hca_rate
        return window

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str) -> "V4Config":
        """From an HF ``deepseek_v4`` config dict (``DeepseekV4Config().to_dict()``), a ``config.json`` path or
        its folder. ValueError naming the key when the model is not V4 or a value is missing / inconsistent."""
        if not isinstance(config, Mapping):
            config = read_config_json(config)
        if not is_v4(config):
            raise ValueError(f"model_type: expected 'deepseek_v4' (or architectures {list(V4_ARCHITECTURES)}), got "
                             f"{config.get('model_type')!r} / {config.get('architectures')}")
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in config and config[f.name] is not None and f.name not in ("layer_types", "rope_head_dim"):
                kw[f.name] = config[f.name]
        types = config.get("layer_types")
        if types is None and config.get("compress_ratios") is not None:
            try:
                types = [_LEGACY_RATIO[r] for r in config["compress_ratios"]]
            except KeyError as e:
                raise ValueError(f"compress_ratios: expected entries of {sorted(_LEGACY_RATIO)}, got {e.args[0]!r}") \
                    from None
        if types is not None:
            kw["layer_types"] = tuple(types)
        rates = config.get("compress_rates") or {}
        if not isinstance(rates, Mapping):
            raise ValueError(f"compress_rates: expected a mapping of layer type to rate, got {rates!r}")
        kw["csa_rate"] = rates.get(CSA, config.get("compress_rate_csa", cls.csa_rate))
        kw["hca_rate"] = rates.get(HCA, config.get("compress_rate_hca", cls.hca_rate))
        if config.get("qk_rope_head_dim") is not None:
            kw["rope_head_dim"] = config["qk_rope_head_dim"]
        elif config.get("partial_rotary_factor") is not None:
            kw["rope_head_dim"] = int(kw.get("head_dim", cls.head_dim) * config["partial_rotary_factor"])
        rp = config.get("rope_parameters")
        if isinstance(rp, Mapping):
            if isinstance(rp.get("main"), Mapping):
                kw.setdefault("rope_theta", rp["main"].get("rope_theta", cls.rope_theta))
            if isinstance(rp.get("compress"), Mapping):
                kw.setdefault("compress_rope_theta", rp["compress"].get("rope_theta", cls.compress_rope_theta))
        if config.get("num_key_value_heads", 1) != 1:
            raise ValueError(f"num_key_value_heads: V4 attention is MQA (1), got {config['num_key_value_heads']}")
        return cls(**kw)

    @classmethod
    def preset(cls, name: str) -> "V4Config":
        """``v4-flash`` (transformers' defaults: DeepSeek-V4-Flash's shapes) or ``v4-tiny`` (test sizes)."""
        if name == "v4-flash":
            return cls()
        if name == "v4-tiny":
            return cls(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, head_dim=64, rope_head_dim=16,
                       q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8, csa_rate=4, hca_rate=8,
                       index_n_heads=2, index_head_dim=16, index_topk=4,
                       layer_types=(SLIDING, CSA, HCA), max_position_embeddings=4096)
        raise ValueError(f"preset: expected one of ['v4-flash', 'v4-tiny'], got {name!r}")
