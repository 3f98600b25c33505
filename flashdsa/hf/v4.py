"""``flashdsa.hf.apply`` on DeepSeek-V4 (transformers ``deepseek_v4``) (issue #43).

Every attention layer's forward runs :class:`flashdsa.v4.V4LayerStep` with the layer's own weights: flashdsa's
compressor, the entry selection (``indexer="exact"``: HF's, so HF's numbers; ``"fp8"``: flashdsa's e4m3
indexer and fp8 rows, the deployment numerics) and flashdsa's attention core over the window and the selected
(CSA) or all (HCA) entries. The batch's V4 state (:class:`~flashdsa.v4.layer.V4State`: window ring, entries,
indexer keys, compressor rings, every row in the same launches) lives beside HF's cache layer of that layer
(``cache.layers[i]``); HF's own cache layer still counts each step's tokens (``get_seq_length``, which
generate() reads) but its compressor buffers stay empty. A new cache takes over the buffers of one that is gone
(same batch size, dtype and device): stale rows are never read (every slot a query can see is written first).

**Decode from CUDA graphs** (``cuda_graphs=True``, the default; on CUDA with the Triton backends): a plain decode
step (one token id a row, batch <= 16, nothing asked of the decoder but its last hidden state) runs the decoder's
whole forward — HF's embedding, hyper-connections, norms and MoE, flashdsa's attention through
``V4LayerStep.decode(capturable=True)`` — from a graph captured once per (batch, reserved tokens) (``graphs``'
keys) on the cache's buffers and replayed with the token ids and the position copied in; the host then advances
the states' and HF's cache layers' lengths. The buffers are reserved for a power of two >= 1024 tokens: a batch
that outgrows them gets larger buffers and a new graph. A model part that cannot be captured (HF's "eager"
experts read the routing back to the host; whether its default "grouped_mm" does on a GPU is what the GPU test
finds out) makes the patch warn once and decode eagerly.

Left-padded batches (generate()'s) are HF's numbers too: each row's leading padding tokens (from the 2-D
``attention_mask``) are kept in the state; what HF's V4 does with them — pooled into entries, never seen in a
window, each row's own position ids for RoPE and for which entries a query sees — the layer step does
(:meth:`flashdsa.v4.V4LayerStep.__call__`). Not yet (clear errors): other masks than left padding, a cache that
was cropped or reused mid-sequence.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

import torch

from flashdsa.hf.graphs import _capture, _graphs_possible, new_graph
from flashdsa.v4.layer import PRECISIONS, V4LayerStep

_GRAPH_MAX_BATCH = 16     # decode batches up to this size replay graphs
_GRAPH_MIN_TOKENS = 1024  # the least a graph's buffers are reserved for
_DECODE_KWARGS = {"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "inputs_embeds",
                  "use_cache", "return_dict"}


@dataclass
class V4Patch:
    """What :func:`apply_v4` installed (``get_patch(model)``): ``steps[i]`` layer i's step, ``calls[i]`` its
    forwards through flashdsa (graph replays included), ``graphs`` the captured decode steps by key, and why
    capturing failed (``graph_failure``, then every step is eager). The other fields are the ones ``unapply``
    reads."""
    model: torch.nn.Module
    indexer: str
    backend: str | None
    steps: list[V4LayerStep]
    calls: list[int]
    cuda_graphs: bool = True
    graph_failure: str | None = None
    graph_replays: int = 0
    closed: bool = False
    runner: None = None
    graphs: dict = field(default_factory=dict)
    _slabs: dict = field(default_factory=dict)  # (B, dtype, device) -> [owner cache (weakref), states a layer]
    _capturing: bool = False
    _pads: torch.Tensor | None = None  # the current forward's leading padding a row (the pre-hook's)
    _patched: list = field(default_factory=list)
    _hooks: list = field(default_factory=list)
    _fwd: None = None


def _padding(patch: V4Patch):
    """The decoder's pre-hook: each row's leading padding tokens from a 2-D ``attention_mask`` (what a new
    cache's states take); a mask that is not left padding (zeros, then ones, in every row) is refused."""
    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        patch._pads = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
            m = mask.bool()
            if not torch.equal(m, m.cummax(dim=1).values):
                raise NotImplementedError("attention_mask: flashdsa's DeepSeek-V4 takes left-padded batches (each row "
                                          "zeros, then ones, as generate() pads decoder-only models); got another "
                                          "pattern")
            patch._pads = (~m).sum(dim=1)
    return hook


def _cache_of(kwargs: dict):
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _new_state(patch: V4Patch, i: int, cache, B: int, dtype: torch.dtype, device: torch.device):
    """Layer i's state for a new cache: the buffers of a cache that is gone, when one of this shape is, else new."""
    key = (B, dtype, device)
    slab = patch._slabs.get(key)
    owner = slab[0]() if slab is not None else None
    if cache is not None and slab is not None and (owner is None or owner is cache):
        slab[0] = weakref.ref(cache)
        if slab[1][i] is not None:
            return replace(slab[1][i], length=0, pads=_pads(patch, device))
    state = patch.steps[i].empty_state(B, dtype, device, pads=_pads(patch, device))
    if cache is not None:
        if slab is None or slab[0]() is not cache:
            slab = patch._slabs[key] = [weakref.ref(cache), [None] * len(patch.steps)]
        slab[1][i] = state
    return state


def _pads(patch: V4Patch, device: torch.device) -> torch.Tensor | None:
    return None if patch._pads is None else patch._pads.to(device=device, dtype=torch.long)


def _keep(patch: V4Patch, i: int, cache, state) -> None:
    """Store layer i's new state with the cache (and as its slab's buffers: they may have grown)."""
    cache.layers[patch.steps[i].attn.layer_idx].__dict__["_flashdsa_v4"] = state
    for slab in patch._slabs.values():
        if slab[0]() is cache:
            slab[1][i] = state


def _layer_forward(patch: V4Patch, i: int):
    step = patch.steps[i]
    attn = step.attn

    def forward(hidden_states, position_embeddings, position_ids, attention_mask=None, cache=None, **kwargs):
        if cache is None:  # the name transformers used before `cache` (its layers may still pass it)
            cache = kwargs.pop("past_key_values", None)
        B, S, _ = hidden_states.shape
        cos, sin = position_embeddings[attn.rope_layer_type]  # [1 | B, S, R / 2]: a padded row's own positions
        pos = position_ids
        if patch._capturing:  # a graph's decode step: the state was checked and reserved by the caller
            state = cache.layers[attn.layer_idx].__dict__["_flashdsa_v4"]
            out, _ = step.decode(hidden_states, pos, cos, sin, state, capturable=True)
            patch.calls[i] += 1
            return out, None
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
            state = _new_state(patch, i, cache, B, hidden_states.dtype, hidden_states.device)
        out, state = step(hidden_states, pos, cos, sin, state)
        if cache is not None:
            _keep(patch, i, cache, state)
        patch.calls[i] += 1
        return out, None
    return forward


def _graph_states(patch: V4Patch, kwargs: dict) -> list | None:
    """The layers' states if this decoder forward is a decode step a graph can run, else None (eager)."""
    if not (patch.cuda_graphs and patch.graph_failure is None) or patch.backend == "torch":
        return None
    ids, cache = kwargs.get("input_ids"), _cache_of(kwargs)
    if not isinstance(ids, torch.Tensor) or not _graphs_possible(ids.device) or ids.dim() != 2 or ids.shape[1] != 1:
        return None
    if ids.shape[0] > _GRAPH_MAX_BATCH or cache is None or kwargs.get("inputs_embeds") is not None:
        return None
    if any(kwargs[k] not in (None, False) for k in set(kwargs) - _DECODE_KWARGS):
        return None  # something else asked of the decoder (attentions, hidden states, router logits)
    cfg = patch.model.config
    if getattr(cfg, "output_attentions", False) or getattr(cfg, "output_hidden_states", False):
        return None
    pos = kwargs.get("position_ids")
    if pos is not None and not (isinstance(pos, torch.Tensor) and tuple(pos.shape) in ((ids.shape[0], 1), (1, 1))):
        return None
    states = []
    for step in patch.steps:
        layer = cache.layers[step.attn.layer_idx]
        state = layer.__dict__.get("_flashdsa_v4")
        seen = layer.get_seq_length()
        if state is None or seen == 0 or state.length != seen or state.batch != ids.shape[0]:
            return None  # the eager path says what is wrong, or starts the state
        if not isinstance(getattr(layer, "cumulative_length", None), int):
            return None  # not a cache layer whose length the host can advance after a replay (DynamicCache's)
        states.append(state)
    return states


def _decoder_forward(patch: V4Patch, orig, *args, **kwargs):
    """The decoder's forward, as the patch installs it: eager, or a decode step from a CUDA graph."""
    states = _graph_states(patch, kwargs) if not args else None
    if states is None:
        return orig(*args, **kwargs)
    cache = _cache_of(kwargs)
    length = states[0].length
    reserved = max(_GRAPH_MIN_TOKENS, 1 << length.bit_length())  # > length: room for this step
    for i, step in enumerate(patch.steps):
        grown = step.reserve(states[i], reserved)
        if grown is not states[i]:  # new buffers: the cache (and its slab) keep them from now on
            states[i] = grown
            _keep(patch, i, cache, grown)
    key, buffers = (len(states[0].rows), reserved), tuple(s.rows.data_ptr() for s in states)
    graph = patch.graphs.get(key)
    if graph is not None and graph.weights != _weights(patch):
        patch.graphs.clear()  # the weights moved (model.to(...)): the graphs read the old ones
        graph = None
    if graph is None or graph.buffers != buffers:  # new, or another live cache's buffers: capture on these
        for old in [k for k in patch.graphs if k[0] == key[0]]:  # this batch size's outgrown or other buffers
            del patch.graphs[old]
        graph = new_graph(patch, lambda: _V4Graph(patch, orig, kwargs, cache, buffers), "the DeepSeek-V4 decode step",
                          3)
        if graph is None:
            return orig(*args, **kwargs)
        patch.graphs[key] = graph
    out = graph.replay(kwargs, cache)
    for i, step in enumerate(patch.steps):
        _advance(cache, step.attn.layer_idx)
        _keep(patch, i, cache, replace(states[i], length=length + 1))
        patch.calls[i] += 1
    patch.graph_replays += 1
    return out


def _weights(patch: V4Patch) -> tuple:
    """Addresses a graph depends on that ``model.to(...)`` changes (the first and last layers', the head's)."""
    first, last = patch.steps[0].attn, patch.steps[-1].attn
    base = getattr(patch.model, "model", patch.model)
    return (first.q_a_proj.weight.data_ptr(), last.o_b_proj.weight.data_ptr(), base.embed_tokens.weight.data_ptr(),
            first.q_a_proj.weight.dtype)


def _advance(cache, layer_idx: int) -> None:
    """HF's cache layer counts the replayed token (what the eager forward's ``cache.update`` does)."""
    cache.layers[layer_idx].cumulative_length += 1


class _V4Graph:
    """The decoder's forward for one decode step of B rows, captured once and replayed per token (module
    docstring). The token ids and the position are copied into its buffers before each replay; the layers'
    state buffers are the ones reserved at capture (the key of the graph)."""

    def __init__(self, patch: V4Patch, orig, kwargs: dict, cache, buffers: tuple):
        self.buffers = buffers  # the layers' state buffers it reads and writes (their addresses)
        self.weights = _weights(patch)
        ids = kwargs["input_ids"]
        with torch.inference_mode(False):  # later steps may copy into them outside inference mode
            self.ids = ids.clone()
            self.pos = torch.empty(ids.shape[0], 1, dtype=torch.long, device=ids.device)
        self._position(kwargs, cache)
        cache_key = "cache" if "cache" in kwargs or "past_key_values" not in kwargs else "past_key_values"
        # a dict mask: HF's decoder takes it as built and makes none (the attention reads no mask)
        static = {"input_ids": self.ids, "position_ids": self.pos, "attention_mask": {"all": None}, "use_cache": True}
        # run() reads the cache from here, set only while the graph is made or replayed: a stand-in of _capture
        # that re-runs the call (the CPU test of this path) sees the current cache, and nothing here keeps a
        # finished request's cache (whose buffers the next request takes over) alive
        self._cache = [cache]

        def run():
            patch._capturing = True
            try:
                with torch.no_grad():
                    return orig(**static, **{cache_key: self._cache[0]})
            finally:
                patch._capturing = False

        # the warm-up runs write this position's slots; the replay writes them again with the same values
        try:
            self.graph, out = _capture(run, ids.device)
        finally:
            self._cache[0] = None
        self.out_type = type(out)
        self.cache_key = next((k for k, v in out.items() if v is cache), None)
        self.hidden = out["last_hidden_state"]

    def _position(self, kwargs: dict, cache) -> None:
        pos = kwargs.get("position_ids")
        if pos is None:
            self.pos.fill_(cache.get_seq_length())
        else:
            self.pos.copy_(pos.expand(self.pos.shape))

    def replay(self, kwargs: dict, cache):
        self.ids.copy_(kwargs["input_ids"])
        self._position(kwargs, cache)
        self._cache[0] = cache
        try:
            self.graph.replay()
        finally:
            self._cache[0] = None
        out = {"last_hidden_state": self.hidden.clone()}  # the buffer is the next replay's output too
        if self.cache_key is not None:
            out[self.cache_key] = cache
        return self.out_type(**out)


def apply_v4(model, indexer: str = "exact", backend: str | None = None, cuda_graphs: bool = True) -> V4Patch:
    """Patch a ``DeepseekV4ForCausalLM`` (or its ``DeepseekV4Model``) in place; see the module docstring."""
    if indexer not in PRECISIONS:
        raise ValueError(f"indexer: expected one of {PRECISIONS}, got {indexer!r}")
    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs: expected a bool, got {cuda_graphs!r}")
    base = getattr(model, "model", model)
    layers = [layer.self_attn for layer in base.layers]
    patch = V4Patch(model, indexer, backend, [V4LayerStep(a, backend, indexer) for a in layers], [0] * len(layers),
                    cuda_graphs)
    for i, attn in enumerate(layers):
        attn.forward = _layer_forward(patch, i)
        patch._patched.append(attn)
    orig = base.forward

    def decoder_forward(*args, **kwargs):
        return _decoder_forward(patch, orig, *args, **kwargs)
    base.forward = decoder_forward
    patch._patched.append(base)
    patch._hooks.append(base.register_forward_pre_hook(_padding(patch), with_kwargs=True))
    model.__dict__["_flashdsa_patch"] = patch
    return patch
