"""Decode from CUDA graphs (``apply(cuda_graphs=True)``, the default): the patch's graph bookkeeping
(:class:`_GraphDecode`, a base of :class:`flashdsa.hf.patch.Patch`) and the captured step (:class:`_DecodeGraph`).

Why capture the step ourselves (a design decision): transformers' own route to graphed decode — a static
cache plus ``torch.compile(mode="reduce-overhead")`` — needs a cache whose every step is traceable tensor
indexing; ours reserves pages and builds a block table on the host, which no trace can hold. So the patch
captures the step itself, the way flashdsa's engine does (:class:`flashdsa.engine.graph.DecodeGraph`): on a
plain decode step (one new real token per live row, batch <= 16, token ids in, nothing asked of the decoder
but its last hidden state) the decoder's whole forward — HF's embedding, norms and MLPs, flashdsa's
attention — is captured once per (batch size, block-table width) and replayed for every later step with
the token ids, HF's position ids and the batch metadata copied into the graph's buffers first. The width
is a power of two >= 16 pages covering the rows (capped at the pool): the indexer scores that many
positions (-inf past each row's length), so a row that outgrows it gets a wider graph. generate() and the
caches are unchanged (prefill, padded steps and anything unusual run eagerly); left-padded batches replay
graphs too. A model that cannot be captured (a host sync in a custom module) warns once and decodes
eagerly; ``model.to(...)`` and a new pool drop the graphs. On CPU, with ``backend="torch"``, exact kpool
(GLM-5.3-Flash) or ``record=True``, every step is eager. ``get_patch(model).cuda_graphs = False`` (or ``apply(...,
cuda_graphs=False)``) opts out.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from flashdsa.hf.cache import FlashDSACache, _Forward, _NoMasks

_GRAPH_MAX_BATCH = 16   # decode batches up to this size replay graphs ("batch 1 and small batches")
_GRAPH_MIN_PAGES = 16   # the narrowest block table a graph gets (1024 tokens)
_DECODE_KWARGS = {"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "inputs_embeds",
                  "use_cache"}


class _GraphDecode:
    """The CUDA-graph half of :class:`~flashdsa.hf.patch.Patch` (its base): which forwards a graph runs, and
    running them. Reads and updates the patch's ``cuda_graphs``, ``graphs``, ``graph_replays``,
    ``graph_failure``, ``calls`` and ``_fwd``."""

    def _graph_pages(self, kwargs: dict, cache: FlashDSACache, real, B: int, S: int,
                     device: torch.device) -> int | None:
        """The block-table width (pages) of the graph that will run this forward, or None to run it eagerly.

        A graph runs plain decode steps: one new real token per live row, token ids (or embeddings) in, nothing
        asked of the
        decoder but its last hidden state. The width is a power of two >= 16 pages covering every row after
        this step, capped at the pool: one graph per (batch, width), a new one only when a row outgrows it.
        """
        if not (self.cuda_graphs and self.graph_failure is None and _graphs_possible(device)):
            return None
        if self.indexer == "exact" and self.config.index_kpool > 1:
            return None  # exact kpool re-pools each request's context with host-side lengths: not capturable
        if self.backend == "torch" or self.record or S != 1 or real is not None or cache.rows is None:
            return None
        # anything else asked of the decoder must be off (GLM-5.3-Flash's wrapper passes output_router_logits=False)
        if B > _GRAPH_MAX_BATCH or any(kwargs[k] not in (None, False) for k in set(kwargs) - _DECODE_KWARGS):
            return None
        # token ids, or the embeddings a multimodal wrapper (GLM-5.3-Flash) hands its language model
        ins = [kwargs.get(k) for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None]
        if len(ins) != 1 or not isinstance(ins[0], torch.Tensor):
            return None
        pos = kwargs.get("position_ids")
        if pos is not None and not (isinstance(pos, torch.Tensor) and tuple(pos.shape) in ((B, 1), (1, 1))):
            return None
        hf = self.model.config
        if getattr(hf, "output_attentions", False) or getattr(hf, "output_hidden_states", False):
            return None
        lens = cache.seq_lens()
        if min(lens) == 0:  # a row without tokens yet (all padding so far): an extend step, not decode
            return None
        need = -(-(max(lens) + 1) // self.config.page_size)
        return min(max(_GRAPH_MIN_PAGES, 1 << (need - 1).bit_length()), self.runner.pool.num_pages)

    def _decoder_forward(self, orig, *args, **kwargs):
        """The decoder's forward, as the patch installs it: eager, or a decode step from a CUDA graph."""
        fwd = self._fwd
        if fwd is None or fwd.graph_pages is None:
            return orig(*args, **kwargs)
        key = (len(fwd.cache.rows), fwd.graph_pages)
        if self.hybrid:
            # the linear-attention layers' state lives in the cache object: a graph per cache, the last one kept
            key += (fwd.cache.uid,)
            for old in [k for k in self.graphs if k[2:] != key[2:]]:
                del self.graphs[old]
        graph = self.graphs.get(key)
        if graph is not None and graph.weights != self._weights():
            self.graphs.clear()  # the weights moved (model.to(...)): the graphs read the old ones
            graph = None
        if graph is None:
            try:
                graph = new_graph(self, lambda: _DecodeGraph(self, orig, fwd, kwargs), "the decode step", 2)
            finally:
                self._fwd = fwd
            if graph is None:
                return orig(*args, **kwargs)
            self.graphs[key] = graph
        out = graph.replay(fwd, kwargs)
        self.graph_replays += 1
        for i in range(len(self.calls)):
            self.calls[i] += 1
        return out

    def _weights(self) -> tuple:
        """Addresses a graph depends on that ``model.to(...)`` changes (the first and last attention layers')."""
        a, b = self.attentions[0], self.attentions[-1]
        return (a.q_a_proj.weight.data_ptr(), a.kv_b_proj.weight.data_ptr(), b.o_proj.weight.data_ptr(),
                a.q_a_proj.weight.dtype)


def new_graph(patch, make, what: str, stacklevel: int):
    """``make()`` a captured decode step for ``patch`` (the DSA or the V4 patch), its forward counters
    (``calls``) kept as they were: warm-up and capture are not forwards of the model. A step that cannot be
    captured (a host sync, a data-dependent shape) sets ``patch.graph_failure``, warns once (``what`` names the
    step; ``stacklevel`` as the caller's own ``warnings.warn`` would take it) and gives None: decode eagerly."""
    calls = list(patch.calls)
    try:
        return make()
    except Exception as e:
        patch.graph_failure = f"{type(e).__name__}: {e}"
    finally:
        patch.calls[:] = calls
    warnings.warn(f"flashdsa.hf: capturing {what} in a CUDA graph failed ({patch.graph_failure}); decoding eagerly "
                  "from now on", RuntimeWarning, stacklevel=stacklevel + 1)
    return None


def _graphs_possible(device: torch.device) -> bool:
    return device.type == "cuda"


def _capture(run, device: torch.device):
    """Warm ``run`` up on a side stream (Triton compiles, the allocator settles), then capture one call of it
    in a CUDA graph. Returns ``(graph, output of the captured call)``."""
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
    return graph, out


def _linear_state(cache: FlashDSACache) -> list[torch.Tensor]:
    """The tensors HF's linear-attention cache layers change in a decode step (none without such layers)."""
    out = []
    for layer in cache._linear_layers():
        if not isinstance(getattr(layer, "cumulative_length_linear", None), torch.Tensor):
            # transformers < 5.25: the layer keeps host-side flags and may replace its state tensors, which a
            # graph cannot follow
            raise ValueError("CUDA graphs of a hybrid stack need transformers >= 5.25 (linear-attention cache "
                             "layers whose state stays at fixed addresses)")
        out.append(layer.cumulative_length_linear)
        for states in (layer.conv_states, layer.recurrent_states):
            out += [t for t in states.values() if t is not None]
    return out


class _DecodeGraph:
    """The decoder's forward for one decode step of B rows with a ``[B, pages]`` block table, captured once in
    a CUDA graph (HF's embedding, norms and MLPs, flashdsa's attention) and replayed per token.

    Before each replay the step's inputs are copied into the graph's buffers: token ids and HF's position ids
    ``[B, 1]``, and the batch metadata (``positions``, ``slot_mapping``, ``block_table [B, pages]``,
    ``context_lens [B, 1]``) that :meth:`FlashDSACache._advance` built for the step with the same width.
    Everything else it reads stays where it was at capture: the weights (``Patch._weights`` notices when
    they move) and the pool's caches (a new pool drops the graphs). Nothing inside the graph depends on a
    value read on the host, so the one graph serves every cache object and every length up to the width —
    except in a hybrid stack (GLM-5.3-Flash), whose linear-attention layers' state tensors belong to the cache
    object: there a graph serves one cache (the patch keeps the latest cache's graphs).
    """

    def __init__(self, patch, orig, fwd: _Forward, kwargs: dict):  # patch: flashdsa.hf.patch.Patch
        m = fwd.meta
        # ordinary tensors even under torch.inference_mode(): later steps may copy into them outside it
        with torch.inference_mode(False):
            self.meta = dataclasses.replace(m, positions=m.positions.clone(), slot_mapping=m.slot_mapping.clone(),
                                            block_table=m.block_table.clone(), context_lens=m.context_lens.clone())
            self.name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
            self.ids = kwargs[self.name].clone()   # token ids [B, 1], or embeddings [B, 1, hidden]
            self.pos = torch.empty(self.ids.shape[:2], dtype=torch.long, device=self.ids.device)
        self._positions(kwargs.get("position_ids"), fwd.cache)
        off = {k: v for k, v in kwargs.items() if k not in _DECODE_KWARGS}  # None / False (_graph_pages)
        static = dict(off, **{self.name: self.ids}, position_ids=self.pos, attention_mask=_NoMasks(),
                      use_cache=kwargs.get("use_cache"), **{patch.cache_kw: fwd.cache})

        def run():
            # a fresh _Forward each run: the RoPE tables and the shared-layer selection are made inside
            patch._fwd = _Forward(self.meta, fwd.cache, None, False, fwd.graph_pages)
            with torch.no_grad():
                return orig(**static)

        self.weights = patch._weights()
        # A hybrid stack's linear-attention layers step their state (in place: HF keeps it at static addresses
        # for graphs) on every run, the warm-up's too: put it back, the replay that follows makes the step.
        state = [(t, t.clone()) for t in _linear_state(fwd.cache)]
        try:
            self.graph, out = _capture(run, self.ids.device)
        finally:
            for t, saved in state:
                t.copy_(saved)
        extra = [k for k, v in out.items() if v is not None and k != "last_hidden_state" and v is not fwd.cache]
        if extra:
            raise ValueError(f"the decoder returned {extra}; a graph replays the last hidden state only")
        # keep the output's type and key names, never the capture's cache object (its pages must be freed)
        self.out_type = type(out)
        self.cache_key = next((k for k, v in out.items() if v is fwd.cache), None)
        self.hidden = out["last_hidden_state"]

    def _positions(self, position_ids: torch.Tensor | None, cache: FlashDSACache) -> None:
        if position_ids is None:  # HF's default: the columns seen so far (what get_seq_length() counts)
            self.pos.fill_(cache.seen)
        else:
            self.pos.copy_(position_ids)

    def replay(self, fwd: _Forward, kwargs: dict):
        m, new = self.meta, fwd.meta
        for name in ("positions", "slot_mapping", "block_table", "context_lens"):
            getattr(m, name).copy_(getattr(new, name))
        m.index_columns = new.index_columns  # host-side only: exact top-k reads it off CUDA, never in a graph
        self.ids.copy_(kwargs[self.name])
        self._positions(kwargs.get("position_ids"), fwd.cache)
        self.graph.replay()
        out = {"last_hidden_state": self.hidden.clone()}  # the buffer is the next replay's output too
        if self.cache_key is not None:
            out[self.cache_key] = fwd.cache
        return self.out_type(**out)
