"""``flashdsa.hf.apply`` on DeepSeek-V4 (transformers ``deepseek_v4``) (issue #43, first step).

Every attention layer's forward runs :class:`flashdsa.v4.V4LayerStep` with the layer's own weights: flashdsa's
compressor, the entry selection (``indexer="exact"``: HF's, so HF's numbers; ``"fp8"``: flashdsa's e4m3
indexer and fp8 rows, the deployment numerics) and flashdsa's attention core over the window and the selected
(CSA) or all (HCA) entries. A request's V4 state (window rows, entries, indexer keys, open compressor windows) lives
beside HF's cache layer of that layer (``cache.layers[i]``), one state for the batch's rows (every row in the same
launches); HF's own cache layer still
takes each step's length (``get_seq_length``, which generate() reads) but its compressor buffers stay empty.

Not yet (clear errors): padded batches (HF's V4 compresses padding tokens into its entries: not reproduced), a cache
that was cropped or reused mid-sequence, CUDA graphs (every step runs eagerly).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashdsa.v4.layer import PRECISIONS, V4LayerStep


@dataclass
class V4Patch:
    """What :func:`apply_v4` installed (``get_patch(model)``): ``steps[i]`` layer i's step, ``calls[i]`` its
    forwards through flashdsa. The other fields are the ones ``unapply`` reads."""
    model: torch.nn.Module
    indexer: str
    backend: str | None
    steps: list[V4LayerStep]
    calls: list[int]
    closed: bool = False
    runner: None = None
    graphs: dict = field(default_factory=dict)
    _patched: list = field(default_factory=list)
    _hooks: list = field(default_factory=list)
    _fwd: None = None


def _refuse_padding(module, args, kwargs):
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise NotImplementedError("attention_mask: padded batches of DeepSeek-V4 are not supported by flashdsa yet "
                                  "(HF's V4 compresses padding tokens into its entries); run requests of equal "
                                  "length, or one at a time")


def _layer_forward(patch: V4Patch, i: int):
    step = patch.steps[i]
    attn = step.attn

    def forward(hidden_states, position_embeddings, position_ids, attention_mask=None, cache=None, **kwargs):
        if cache is None:  # the name transformers used before `cache` (its layers may still pass it)
            cache = kwargs.pop("past_key_values", None)
        B, S, _ = hidden_states.shape
        cos, sin = (t[0] for t in position_embeddings[attn.rope_layer_type])  # every row at the same positions
        pos = position_ids[0]
        state = None
        if cache is not None:
            layer = cache.layers[attn.layer_idx]
            seen = layer.get_seq_length()
            state = layer.__dict__.get("_flashdsa_v4") if seen else None  # an empty (or reset) cache: new rows
            if seen and state is None:
                raise NotImplementedError("cache: this cache holds tokens flashdsa did not see (made before "
                                          "flashdsa.hf.apply, or reused); start from an empty one")
            if state is not None and (state.batch != B or state.length != seen):
                raise NotImplementedError(f"cache: flashdsa's V4 state holds {state.batch} rows of {state.length} "
                                          f"tokens, the cache {B} of {seen} (cropped or reordered caches are not "
                                          "supported)")
            # HF's cache layer keeps the length generate() reads; its window rows are not read by us
            z = hidden_states.new_zeros(B, 1, S, attn.head_dim)
            cache.update(z, z, attn.layer_idx)
        if state is None:
            state = step.empty_state(B, hidden_states.dtype, hidden_states.device)
        out, state = step(hidden_states, pos, cos, sin, state)
        if cache is not None:
            cache.layers[attn.layer_idx].__dict__["_flashdsa_v4"] = state
        patch.calls[i] += 1
        return out, None
    return forward


def apply_v4(model, indexer: str = "exact", backend: str | None = None) -> V4Patch:
    """Patch a ``DeepseekV4ForCausalLM`` (or its ``DeepseekV4Model``) in place; see the module docstring."""
    if indexer not in PRECISIONS:
        raise ValueError(f"indexer: expected one of {PRECISIONS}, got {indexer!r}")
    base = getattr(model, "model", model)
    layers = [layer.self_attn for layer in base.layers]
    patch = V4Patch(model, indexer, backend, [V4LayerStep(a, backend, indexer) for a in layers], [0] * len(layers))
    for i, attn in enumerate(layers):
        attn.forward = _layer_forward(patch, i)
        patch._patched.append(attn)
    patch._hooks.append(base.register_forward_pre_hook(_refuse_padding, with_kwargs=True))
    model.__dict__["_flashdsa_patch"] = patch
    return patch
