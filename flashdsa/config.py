"""Model configuration: the DSA keys of a Hugging Face ``config.json`` as one frozen dataclass.

``DSAConfig.from_hf`` reads a config dict (or a path to ``config.json`` / its folder), checks every
key it uses, and derives what the rest of flashdsa needs: which layers compute top-k
(``topk_layers``), the page size with kpool (``index_kpool`` c, with ``index_kpool_compress`` and
``index_kpool_always_select_tail``, docs/DSA.md §7), the indexer RoPE pairing. Presets ``v32``, ``glm5`` and
``tiny`` build the same object without a file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

PAGE_SIZE = 64  # tokens per KV page without kpool (both caches)

# Architectures that can carry DSA; a model is DSA iff its architecture is here AND index_topk is set.
DSA_ARCHITECTURES = (
    "DeepseekV32ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV3ForCausalLMNextN",
    "GlmMoeDsaForCausalLM",
    "Glm5NextForConditionalGeneration",
)

# A config built in code (``DeepseekV32Config(...).to_dict()``) has ``architectures: None``; its
# ``model_type`` then names the architecture.
_ARCH_OF_MODEL_TYPE = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
                       "glm5_next": "Glm5NextForConditionalGeneration",
                       "glm5_next_text": "Glm5NextForConditionalGeneration"}
# Per-layer attention kinds of a hybrid stack (GLM-5.3-Flash's ``layer_types``): DSA layers are flashdsa's,
# the others (KDA linear attention) stay the model's. HF maps "full_attention" to "indexed_attention".
DSA_LAYER = "indexed_attention"
LAYER_TYPES = (DSA_LAYER, "linear_attention")
# Architectures whose indexer RoPE is interleaved by definition (HF's GLM config has no such key).
_INTERLEAVED_INDEXER_ROPE = ("GlmMoeDsaForCausalLM",)


def _text_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal config (GLM-5.3-Flash: ``glm5_next``) keeps the language model's keys in ``text_config``;
    flat checkpoints keep them at the top. The text keys, with the top level's architecture."""
    text = hf_config.get("text_config")
    if not isinstance(text, Mapping):
        return hf_config
    merged = dict(text)
    for key in ("architectures", "model_type"):
        if hf_config.get(key) is not None:
            merged[key] = hf_config[key]
    return merged


def _architectures(hf_config: Mapping[str, Any]) -> list[str]:
    archs = list(hf_config.get("architectures") or [])
    if not archs and hf_config.get("model_type") in _ARCH_OF_MODEL_TYPE:
        archs = [_ARCH_OF_MODEL_TYPE[hf_config["model_type"]]]
    return archs


def is_dsa(hf_config: Mapping[str, Any]) -> bool:
    """True iff the HF config describes a DSA model (docs/DSA.md §2: DSA architecture AND ``index_topk``).

    Without ``architectures`` (a config built in code), ``model_type`` "deepseek_v32" / "glm_moe_dsa" names it.
    """
    hf_config = _text_config(hf_config)
    archs = _architectures(hf_config)
    return any(a in DSA_ARCHITECTURES for a in archs) and hf_config.get("index_topk") is not None


def read_config_json(source: str | os.PathLike, name: str = "config") -> Mapping[str, Any]:
    """The object in a ``config.json`` (or a folder holding one); a ValueError naming ``name`` (the argument
    the caller took) and the file otherwise."""
    try:
        path = os.fspath(source)
    except TypeError:
        raise ValueError(f"{name}: expected a dict, a path to config.json or a model folder, got "
                         f"{type(source).__name__}") from None
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}: {os.fsdecode(path)} is not valid JSON ({e})") from None
    if not isinstance(config, Mapping):
        raise ValueError(f"{name}: {os.fsdecode(path)} holds a JSON {type(config).__name__}, expected an object "
                         "of config keys")
    return config


def _skip_rule(
    num_layers: int,
    indexer_types: tuple[str, ...] | None,
    pattern: str | None,
    freq: int | None,
    offset: int | None,
) -> list[bool]:
    """Per layer: True if the layer skips top-k (reuses the previous layer's). First rule that is set wins."""
    if indexer_types is not None:
        return [t == "shared" for t in indexer_types]
    if pattern is not None:
        return [c.upper() == "S" for c in pattern]
    if freq is not None and freq > 1:
        o = 2 if offset is None else offset  # without an offset the rule is max(L - 1, 0) % f
        return [max(layer - o + 1, 0) % freq != 0 for layer in range(num_layers)]
    return [False] * num_layers


@dataclass(frozen=True)
class DSAConfig:
    """The DSA-relevant part of a DeepSeek-V3.2 / GLM-5 / GLM-5.3-Flash config (docs/DSA.md §2). All sizes
    are per layer.

    MLA in absorbed form: the cache holds ``kv_lora_rank`` latent + ``qk_rope_head_dim`` rope dims per
    token (576 for both V3.2 and GLM-5), the value is the latent (``kv_lora_rank`` = 512). GLM-5.3-Flash
    is NoPE (``qk_rope_head_dim`` 0: 512 dims, no RoPE in MLA nor in the indexer) and a hybrid stack:
    ``layer_types`` names the DSA layers ("indexed_attention") among linear-attention ones; the caches and
    the engine take :meth:`dsa_stack`, the DSA layers alone.
    """

    architectures: tuple[str, ...]
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_rope_interleave: bool = False
    indexer_types: tuple[str, ...] | None = None
    index_topk_pattern: str | None = None
    index_topk_freq: int | None = None
    index_skip_topk_offset: int | None = None
    index_kpool: int = 1
    index_kpool_compress: bool = True
    index_kpool_always_select_tail: bool = True
    vocab_size: int = 129280
    intermediate_size: int = 18432
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = field(default=None, compare=False)
    max_position_embeddings: int = 163840
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        positive = (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
            "index_topk", "index_kpool", "vocab_size", "intermediate_size", "max_position_embeddings",
        )
        for key in positive:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key}: expected a positive integer, got {value!r}")
        rope = self.qk_rope_head_dim
        if isinstance(rope, bool) or not isinstance(rope, int) or rope < 0 or rope % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even integer >= 0 (0: NoPE), got {rope!r}")
        for key in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, key)
            number = not isinstance(value, bool) and isinstance(value, (int, float))
            if not (number and math.isfinite(value) and value > 0):
                raise ValueError(f"{key}: expected a finite number > 0, got {value!r}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, Mapping):
                raise ValueError(f"rope_scaling: expected a dict or null, got {self.rope_scaling!r}")
            for key in ("factor", "mscale_all_dim"):  # the keys softmax_scale reads
                value = self.rope_scaling.get(key)
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise ValueError(f"rope_scaling: expected a number for {key!r}, got {value!r}")
        if not all(isinstance(a, str) for a in self.architectures):
            raise ValueError(f"architectures: expected a list of names, got {self.architectures!r}")
        if not isinstance(self.indexer_rope_interleave, bool):
            raise ValueError(f"indexer_rope_interleave: expected true/false, got {self.indexer_rope_interleave!r}")
        if self.index_head_dim % 128 != 0 or self.index_head_dim < 64:
            raise ValueError(f"index_head_dim: expected a multiple of 128 (RoPE on the first 64 dims, "
                             f"act_quant blocks of 128), got {self.index_head_dim}")
        n = self.num_hidden_layers
        if self.indexer_types is not None:
            if len(self.indexer_types) != n:
                raise ValueError(f"indexer_types: expected {n} entries (num_hidden_layers), got {len(self.indexer_types)}")
            bad = [t for t in self.indexer_types if t not in ("full", "shared")]
            if bad:
                raise ValueError(f"indexer_types: expected 'full' or 'shared', got {bad}")
        if self.index_topk_pattern is not None:
            if not isinstance(self.index_topk_pattern, str):
                raise ValueError(f"index_topk_pattern: expected a string of 'F' / 'S', got {self.index_topk_pattern!r}")
            if len(self.index_topk_pattern) != n:
                raise ValueError(f"index_topk_pattern: expected {n} characters (num_hidden_layers), "
                                 f"got {len(self.index_topk_pattern)}")
            bad = sorted({c for c in self.index_topk_pattern if c.upper() not in "FS"})
            if bad:
                raise ValueError(f"index_topk_pattern: expected only 'F' (full) and 'S' (shared), got {bad}")
        if self.index_topk_freq is not None and (isinstance(self.index_topk_freq, bool) or not isinstance(self.index_topk_freq, int) or self.index_topk_freq < 1):
            raise ValueError(f"index_topk_freq: expected an integer >= 1, got {self.index_topk_freq!r}")
        if self.index_skip_topk_offset is not None and (isinstance(self.index_skip_topk_offset, bool) or not isinstance(self.index_skip_topk_offset, int) or self.index_skip_topk_offset < 0):
            raise ValueError(f"index_skip_topk_offset: expected an integer >= 0, got {self.index_skip_topk_offset!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != n:
                raise ValueError(f"layer_types: expected {n} entries (num_hidden_layers), got {len(self.layer_types)}")
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            if bad:
                raise ValueError(f"layer_types: expected each of {list(LAYER_TYPES)}, got {bad}")
            if DSA_LAYER not in self.layer_types:
                raise ValueError(f"layer_types: no {DSA_LAYER!r} layer, so nothing of this model is DSA")
        rule = _skip_rule(n, self.indexer_types, self.index_topk_pattern, self.index_topk_freq,
                          self.index_skip_topk_offset)
        dsa = self.dsa_layers
        for i in dsa:
            # HF hands a shared layer the selection of the decoder layer just before it
            if rule[i] and (i == 0 or i - 1 not in dsa):
                raise ValueError(f"indexer_types/index_topk_pattern/index_topk_freq: layer {i} reuses the previous "
                                 "layer's top-k ('shared'), but the layer before it is not a DSA layer with one")
        for key in ("index_kpool_compress", "index_kpool_always_select_tail"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key}: expected true/false, got {getattr(self, key)!r}")
        c = self.index_kpool
        if c > 1:
            # GLM-5.3's kpool (SGLang's IndexerKPool asserts the same): learned softmax-gate pooling, and the
            # unfinished tail group always selected. Other variants have no public definition to follow.
            if not self.index_kpool_compress:
                raise ValueError("index_kpool_compress: only the learned softmax-gate pooling (true) is built "
                                 f"for index_kpool = {c}, got false")
            if not self.index_kpool_always_select_tail:
                raise ValueError("index_kpool_always_select_tail: only true (the tail group, fewer than "
                                 f"index_kpool tokens, is always selected) is built for index_kpool = {c}, got false")
            if self.index_topk % c:
                raise ValueError(f"index_kpool: index_topk ({self.index_topk}) must be a multiple of index_kpool ({c})")
            if PAGE_SIZE % c:
                raise ValueError(f"index_kpool: {PAGE_SIZE} must be a multiple of index_kpool ({c})")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def dsa_layers(self) -> list[int]:
        """Sorted layer ids that are DSA attention: every layer, or the "indexed_attention" ones of
        ``layer_types``."""
        if self.layer_types is None:
            return list(range(self.num_hidden_layers))
        return [i for i, t in enumerate(self.layer_types) if t == DSA_LAYER]

    @property
    def skip_topk_layers(self) -> list[int]:
        """Sorted DSA layer ids that reuse the previous layer's top-k (no indexer, no indexer cache)."""
        rule = _skip_rule(self.num_hidden_layers, self.indexer_types, self.index_topk_pattern,
                          self.index_topk_freq, self.index_skip_topk_offset)
        return [i for i in self.dsa_layers if rule[i]]

    @property
    def topk_layers(self) -> list[int]:
        """Sorted DSA layer ids that run the indexer and compute top-k."""
        skip = set(self.skip_topk_layers)
        return [i for i in self.dsa_layers if i not in skip]

    def dsa_stack(self) -> "DSAConfig":
        """The DSA layers alone, renumbered 0 .. n-1 (the layers flashdsa's caches and engine hold): this
        config itself without ``layer_types``."""
        if self.layer_types is None:
            return self
        dsa, skip = self.dsa_layers, set(self.skip_topk_layers)
        return dataclasses.replace(self, num_hidden_layers=len(dsa), layer_types=None, index_topk_pattern=None,
                                   index_topk_freq=None, index_skip_topk_offset=None,
                                   indexer_types=tuple("shared" if i in skip else "full" for i in dsa))

    @property
    def kv_cache_dim(self) -> int:
        """Dims per token in the MLA cache: latent + rope (576 for V3.2 and GLM-5, 512 for NoPE GLM-5.3-Flash)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def selected_tokens(self) -> int:
        """The most tokens one query row attends: ``index_topk``, plus kpool's unfinished tail group (up to
        c - 1 tokens, docs/DSA.md §7)."""
        return self.index_topk + self.index_kpool - 1

    @property
    def page_size(self) -> int:
        """Tokens per KV page: 64, or 64 * c with kpool so an indexer page still holds 64 pooled keys."""
        return PAGE_SIZE * self.index_kpool

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale over the un-absorbed head dim (qk_nope + qk_rope), with the YaRN mscale."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling or {}
        factor = rs.get("factor")
        mscale_all_dim = rs.get("mscale_all_dim")
        if factor and mscale_all_dim and factor > 1:
            m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= m * m
        return scale

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | os.PathLike) -> "DSAConfig":
        """Build from an HF config dict, a ``config.json`` path, or a model folder holding one.

        Raises ValueError naming the key when the model is not DSA or a value is unknown/inconsistent.
        """
        if not isinstance(config, Mapping):
            config = read_config_json(config)
        config = _text_config(config)
        for key in ("architectures", "indexer_types", "layer_types"):
            if config.get(key) is not None and not isinstance(config[key], (list, tuple)):
                raise ValueError(f"{key}: expected a list, got {config[key]!r}")
        if not is_dsa(config):
            if config.get("index_topk") is None:
                raise ValueError("index_topk: missing, so this is not a DSA model "
                                 f"(architectures={config.get('architectures')})")
            raise ValueError(f"architectures: expected one of {list(DSA_ARCHITECTURES)}, "
                             f"got {config.get('architectures')} (model_type {config.get('model_type')!r})")
        required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                    "index_head_dim", "index_topk")
        for key in required:
            if config.get(key) is None:
                raise ValueError(f"{key}: missing from the config")
        if config.get("q_lora_rank") is None:
            raise ValueError("q_lora_rank: missing (DSA's indexer reads the MLA query latent, so q_lora_rank is required)")
        kw: dict[str, Any] = {f.name: config[f.name] for f in dataclasses.fields(cls)
                              if f.name in config and config[f.name] is not None}
        kw["architectures"] = tuple(_architectures(config))
        if "indexer_rope_interleave" not in kw and any(a in _INTERLEAVED_INDEXER_ROPE for a in kw["architectures"]):
            kw["indexer_rope_interleave"] = True  # GLM's indexer RoPE is GPT-J style; HF's config omits the key
        if "indexer_types" in kw:
            kw["indexer_types"] = tuple(kw["indexer_types"])
        if "layer_types" in kw:
            kw["layer_types"] = tuple("indexed_attention" if t == "full_attention" else t for t in kw["layer_types"])
        if "indexer_rope_interleave" in kw and not isinstance(kw["indexer_rope_interleave"], bool):
            raise ValueError(f"indexer_rope_interleave: expected true/false, got {kw['indexer_rope_interleave']!r}")
        # transformers >= 5 moved rope_theta / rope_scaling under rope_parameters.
        rp = config.get("rope_parameters")
        if isinstance(rp, Mapping):
            kw.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
            if rp.get("rope_type", "default") != "default":
                kw.setdefault("rope_scaling", dict(rp))
        return cls(**kw)

    @classmethod
    def preset(cls, name: str) -> "DSAConfig":
        """``v32`` (DeepSeek-V3.2), ``glm5`` (GLM-5), ``glm5-flash`` (GLM-5.3-Flash: the whole hybrid stack;
        ``dsa_stack()`` its DSA layers) or ``tiny`` (a small DSA model for CPU tests)."""
        if name not in PRESETS:
            raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
        return cls.from_hf(PRESETS[name])

    def replace(self, **changes: Any) -> "DSAConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, dict[str, Any]] = {
    "v32": dict(
        architectures=["DeepseekV32ForCausalLM"], num_hidden_layers=61, hidden_size=7168,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
        vocab_size=129280, intermediate_size=18432, rope_theta=10000.0, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    "glm5": dict(
        architectures=["GlmMoeDsaForCausalLM"], num_hidden_layers=78, hidden_size=6144,
        num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
        indexer_rope_interleave=True, vocab_size=154880, intermediate_size=12288,
        rope_theta=1000000.0, max_position_embeddings=202752,
    ),
    # GLM-5.3-Flash (transformers' glm5_next defaults, the released model's shapes): every 4th layer DSA
    # (NoPE MLA, kpool 16), the others KDA linear attention, which flashdsa does not run (dsa_stack()).
    "glm5-flash": dict(
        architectures=["Glm5NextForConditionalGeneration"], num_hidden_layers=45, hidden_size=4096,
        num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256,
        qk_rope_head_dim=0, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
        index_kpool=16, vocab_size=154880, intermediate_size=12288, rms_norm_eps=1e-5,
        max_position_embeddings=1048576,
        layer_types=["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(45)],
    ),
    # Small enough for CPU, still every DSA feature: sparse (topk < context), a skip-top-k layer,
    # the real 576-dim MLA cache and 128-dim indexer keys so the byte layouts are the real ones.
    "tiny": dict(
        architectures=["DeepseekV32ForCausalLM"], num_hidden_layers=4, hidden_size=256,
        num_attention_heads=4, q_lora_rank=96, kv_lora_rank=512, qk_nope_head_dim=32,
        qk_rope_head_dim=64, v_head_dim=32, index_n_heads=4, index_head_dim=128, index_topk=64,
        index_topk_freq=2, vocab_size=512, intermediate_size=512, rope_theta=10000.0,
        max_position_embeddings=4096,
    ),
}
