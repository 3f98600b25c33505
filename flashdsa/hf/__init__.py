"""Hugging Face transformers integration: run HF's own DSA models through flashdsa, patched in place.

    from transformers import AutoModelForCausalLM
    import flashdsa.hf

    model = AutoModelForCausalLM.from_pretrained(...)      # DeepSeek-V3.2, GLM-5 or GLM-5.3-Flash
    flashdsa.hf.apply(model, indexer="fp8")                # or "exact"; kv_format="auto", cuda_graphs=True
    model.generate(input_ids, max_new_tokens=64)           # unchanged

After :func:`apply`, every attention layer (``model.model.layers[i].self_attn``) runs flashdsa's path with
the layer's own weights: indexer -> exact top-k -> sparse MLA over flashdsa's paged caches, the same layer
step our own engine runs. The MLP / MoE, norms, embeddings and LM head stay HF's. ``indexer="exact"``
selects HF's tokens and, on an fp32 model, reproduces HF's logits to fp32 rounding; ``"fp8"`` is the
deployment numerics (docs/DSA.md §3).

The KV lives in a :class:`FlashDSACache` (a ``transformers.Cache`` over flashdsa's pool, sized by
``max_tokens``) that ``model(...)`` and ``generate()`` hand around; an empty HF cache is replaced by one.
Batches: any size; padding given by a 2-D ``attention_mask`` (left padding, as generate() makes) is never
written nor attended; ``crop`` works. Not supported (clear errors): beam / contrastive search, static or
compiled caches (4-D masks), training (inference only). Decode steps of up to 16 rows replay CUDA
graphs on CUDA. :func:`unapply` restores HF's attention.

GLM-5.3-Flash (``Glm5NextForConditionalGeneration``): its DSA layers (NoPE MLA, kpool) run through flashdsa,
its KDA linear-attention layers stay HF's with their state in HF's own cache layers inside the
``FlashDSACache`` (crop is refused there: a recurrent state cannot be rolled back). ``indexer="exact"`` pools
and selects as HF's ``Glm5NextTextIndexer`` (the same tokens, ties included).

DeepSeek-V4 (``DeepseekV4ForCausalLM``): ``indexer="exact"`` or ``"fp8"``, one request a batch row at a time,
unpadded batches, eagerly (:mod:`flashdsa.hf.v4`, issue #43).

The parts: :mod:`flashdsa.hf.patch` (apply / unapply, adopting HF's modules, the numerics),
:mod:`flashdsa.hf.cache` (the cache, and why it is ours), :mod:`flashdsa.hf.graphs` (decode from CUDA graphs).
"""

try:  # the parts import these too; failing here says what to install
    import transformers  # noqa: F401
    from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: F401
except ImportError as e:  # pragma: no cover - the optional dependency is missing
    raise ImportError("flashdsa.hf needs transformers >= 5.23: pip install 'transformers>=5.23' (in a checkout: "
                      "pip install -e '.[hf]')") from e

from flashdsa.hf.cache import FlashDSACache
from flashdsa.hf.patch import KV_FORMATS, Patch, apply, get_patch, unapply

__all__ = ["apply", "unapply", "get_patch", "FlashDSACache", "Patch"]
