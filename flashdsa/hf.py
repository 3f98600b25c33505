"""Hugging Face transformers integration: run HF's own DSA models through flashdsa, patched in place.

    from transformers import AutoModelForCausalLM
    import flashdsa.hf

    model = AutoModelForCausalLM.from_pretrained(...)      # DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM
    flashdsa.hf.apply(model, indexer="fp8")                # or "exact"; kv_format="auto", cuda_graphs=True
    model.generate(input_ids, max_new_tokens=64)           # unchanged

After :func:`apply`, every attention layer (``model.model.layers[i].self_attn``) runs flashdsa's path with
the layer's own weights: indexer -> exact top-k -> sparse MLA (or the dense fallback while every context
fits in ``index_topk``) over flashdsa's paged caches: :class:`flashdsa.layers.DSAAttention`'s step, the
same code our own engine runs, on batches the :class:`flashdsa.engine.Runner` prepares. The MLP / MoE,
norms, embeddings and LM head stay HF's.
Per layer the adapter is a :class:`flashdsa.layers.DSAAttention` whose submodules ARE the HF layer's
(``q_a_proj`` … ``o_proj``, ``indexer.wq_b`` …): no weight is copied, ``model.to(...)`` moves both.

Numerics:
    * ``indexer="exact"``: the indexer of :mod:`flashdsa.layers.indexer` in exact precision — no Hadamard,
      no fp8, fp32 scores ``sum_h w relu(q . k / sqrt(D))`` — the numbers HF's indexer computes, so the
      same tokens are selected. ``indexer="fp8"``: the deployment numerics of docs/DSA.md §3 (DeepGEMM's).
    * RoPE comes from HF's own ``position_embeddings`` (cos / sin of HF's ``position_ids``, YaRN attention
      factor included). MLA RoPE uses interleaved pairs (HF's ``apply_rotary_pos_emb_interleave`` writes the
      same pairs de-interleaved; only q . k matters and q and k share one layout). Indexer RoPE: NeoX pairs
      for V3.2, interleaved for GLM (``DSAConfig.indexer_rope_interleave``).
    * GLM's ``indexer_types``: a "shared" layer has no indexer (in HF as here) and reuses the previous
      layer's selection.
    * The attention runs at the model's precision (``kv_format="auto"``): for an fp32 model the absorbed
      query, the MLA cache rows (the "fp32" format, 2304 B a token) and the attention kernels are fp32
      (IEEE products), so ``indexer="exact"`` reproduces HF's fp32 logits to fp32 rounding (~1e-6 of their
      maximum on the tests' models) and its greedy tokens; otherwise bf16 rows and query, as deployed,
      whose distance from HF's fp32 answer is that of HF's own bf16 run. ``kv_format="bf16"`` on an fp32
      model rounds the attention to bf16 (2-3e-2 of the logits' maximum on the same models).

The cache (a design decision): flashdsa's own. ``model(...)`` and ``model.generate(...)`` hand a
:class:`FlashDSACache` around — a ``transformers.Cache`` whose KV lives in flashdsa's paged pool
(:class:`flashdsa.cache.KVPool`: the MLA rows and the indexer keys of every layer, one page allocator),
owned by the patched model and sized by ``max_tokens``. Why not store into HF's cache objects: HF's
``DynamicCache`` holds per-layer ``[B, 1, T, 512]`` latents and ``[B, T, 128]`` indexer keys, grown by
``torch.cat`` every step; the sparse kernels need the paged layouts (fp8 656-B rows, 8448-B indexer
pages) and a block table, so using HF's tensors would mean re-packing the whole context every layer and
step. So no HF cache holds KV here; generate() still works unchanged because the cache object it passes
around is ours:

    * no cache given (``model(ids)``, or ``use_cache=False``): a new ``FlashDSACache`` (temporary with
      ``use_cache=False``: its pages are freed when the forward returns);
    * an EMPTY HF cache (what ``generate()`` creates each call, or ``DynamicCache()`` of the user): a new
      ``FlashDSACache`` takes its place (``outputs.cache`` is it; generate() carries ``outputs.cache`` to the
      next step), remembered per HF object, so passing the same HF object again continues the sequence.
      A new generate() call makes a new HF cache, hence a fresh sequence: nothing leaks between calls;
    * a ``FlashDSACache`` (``outputs.cache``, or ``FlashDSACache(model)``): continued;
    * a non-empty HF cache (KV computed by unpatched attention): ValueError.
Positions line up because ``get_seq_length()`` of our cache counts the columns seen (pads included, as
HF's caches do), so HF derives the same ``position_ids`` as with its own cache. A cache's pages return to
the pool when it is garbage-collected or ``reset()``.

Batches: any batch size; padding given by a 2-D ``attention_mask`` (left padding, as generate() makes)
is supported — a padded position is never written to the cache and never attended (its hidden state
out of attention is zero; HF's is garbage, and neither is used). Other 4-D / custom masks: ValueError.
``crop`` (assisted decoding's rollback) works, padded rows included. Not supported (clear errors): beam
search / contrastive search (``reorder_cache`` / ``batch_select_indices``), static / compiled caches
(4-D masks), kpool, training (inference only: raises with grad enabled in train mode).

Decode in CUDA graphs (a design decision, ``apply(cuda_graphs=True)``, the default). transformers' own
route to graphed decode — a static cache plus ``torch.compile(mode="reduce-overhead")`` — needs a cache
whose every step is traceable tensor indexing; ours reserves pages and builds a block table on the host,
which no trace can hold. So the patch captures the step itself, the way flashdsa's engine does
(:class:`flashdsa.engine.graph.DecodeGraph`): on a plain decode step (one new real token per live row,
batch <= 16, token ids in, nothing asked of the decoder but its last hidden state) the decoder's whole
forward — HF's embedding, norms and MLPs, flashdsa's attention — is captured once per (batch size,
block-table width) and replayed for every later step with the token ids, HF's position ids and the
batch metadata copied into the graph's buffers first. The width is a power of two >= 16 pages covering
the rows (capped at the pool): the indexer scores that many positions (-inf past each row's length), so
a row that outgrows it gets a wider graph. generate() and the caches are unchanged (prefill, padded
steps and anything unusual run eagerly); left-padded batches replay graphs too. A model that cannot be
captured (a host sync in a custom module) warns once and decodes eagerly; ``model.to(...)`` and a new
pool drop the graphs. On CPU, with ``backend="torch"`` or ``record=True``, every step is eager.
``get_patch(model).cuda_graphs = False`` (or ``apply(..., cuda_graphs=False)``) opts out.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import warnings
import weakref
from dataclasses import dataclass, field

import torch

try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:  # pragma: no cover - the optional dependency is missing
    raise ImportError("flashdsa.hf needs transformers >= 5.23: pip install 'transformers>=5.23' (in a checkout: "
                      "pip install -e '.[hf]')") from e

from flashdsa.cache.allocator import OutOfPagesError
from flashdsa.cache.layouts import INDEX_DIM, MLA_DIM
from flashdsa.config import DSAConfig, is_dsa
from flashdsa.cache.metadata import DECODE, BatchMetadata
from flashdsa.engine.runner import Runner
from flashdsa.layers.attention import DSAAttention
from flashdsa.layers.indexer import PRECISIONS

__all__ = ["apply", "unapply", "get_patch", "FlashDSACache", "Patch"]

_MIN_TRANSFORMERS = (5, 23)
_MLA_PARTS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
              "o_proj")
_INDEXER_PARTS = ("wq_b", "wk", "k_norm", "weights_proj")
KV_FORMATS = ("auto", "bf16", "fp8", "fp32")
_uids = itertools.count()


def _version(v: str) -> tuple[int, int]:
    parts = v.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


# ---- the cache --------------------------------------------------------------------------------------

class _Length:
    """Columns seen by a cache, shared by the cache and its layers (no reference cycle, so a dropped
    cache is freed — and its pages returned — at once)."""

    def __init__(self):
        self.seen = 0


class _FlashDSALayer(CacheLayerMixin):
    """One layer's face of a :class:`FlashDSACache`: lengths only, the KV is in flashdsa's pool."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, length: _Length):
        super().__init__()
        self._length = length
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("FlashDSACache: the KV lives in flashdsa's paged pool; an attention layer that is not "
                           "patched by flashdsa.hf.apply tried to write into it")

    def get_seq_length(self) -> int:
        return self._length.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:  # the cache resets (Cache.reset is overridden)
        pass

    def crop(self, tokens_to_remove: int) -> None:  # the cache crops (Cache.crop is overridden)
        pass


def _release(runner_ref: weakref.ref, rows: list) -> None:
    runner = runner_ref()
    if runner is None:
        return
    for r in rows:
        if r in runner.alloc:
            runner.free(r)
    rows.clear()


class FlashDSACache(Cache):
    """A ``transformers.Cache`` whose KV lives in the paged pool of a model patched by :func:`apply`.

    One request of the pool per batch row, created on the first forward. ``get_seq_length()`` is the
    number of columns seen (padding included, as HF's caches count); each row holds only its real tokens.
    Pages go back to the pool on ``reset()`` or when the object is garbage-collected.
    """

    def __init__(self, model):
        patch = get_patch(model) if not isinstance(model, Patch) else model
        if patch is None:
            raise ValueError("model: expected a model patched by flashdsa.hf.apply(model)")
        self._length = _Length()
        super().__init__(layers=[_FlashDSALayer(self._length) for _ in range(patch.config.num_hidden_layers)])
        self.patch = patch
        self.uid = next(_uids)
        self.rows: list | None = None         # request ids in the pool, one per batch row
        self._finalizer = None
        self._real = torch.zeros(0, 0, dtype=torch.bool)  # [B, seen] which columns hold real tokens (CPU)
        self._pending = None                  # the running forward's Reservation, until _commit / _abort
        self._new_real = None                 # [B, S] its columns' real tokens

    @property
    def seen(self) -> int:
        return self._length.seen

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._length.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._length.seen + query_length, 0

    def seq_lens(self) -> list[int]:
        """Real tokens cached per batch row."""
        if self.rows is None:
            return []
        alloc = self.patch.runner.alloc
        return [alloc.seq_len(r) for r in self.rows]

    def reset(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # frees the rows now (and only once)
        self.rows, self._finalizer = None, None
        self._length.seen = 0
        self._real = torch.zeros(0, 0, dtype=torch.bool)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (HF's convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove: expected a count <= 0 (HF's crop convention), got {tokens_to_remove}")
        keep = self.seen + tokens_to_remove
        if tokens_to_remove == 0 or self.rows is None:
            return
        if keep < 0:
            raise ValueError(f"tokens_to_remove: the cache holds {self.seen} columns, cannot drop {-tokens_to_remove}")
        runner = self.patch.runner
        for b, r in enumerate(self.rows):
            runner.truncate(r, int(self._real[b, :keep].sum()))
        self._real = self._real[:, :keep]
        self._length.seen = keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("FlashDSACache: beam search (reorder_cache) is not supported by flashdsa.hf")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("FlashDSACache: batch_repeat_interleave is not supported by flashdsa.hf")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("FlashDSACache: batch_select_indices is not supported by flashdsa.hf")

    def __repr__(self) -> str:
        return f"FlashDSACache(rows={len(self.rows or [])}, seen={self.seen}, seq_lens={self.seq_lens()})"

    # ---- one forward ------------------------------------------------------------------------------
    def _advance(self, runner: Runner, real: torch.Tensor | None, B: int, S: int,
                 max_pages: int | None = None) -> BatchMetadata:
        """Reserve the batch's new real tokens and build the metadata every layer shares (the runner decides
        decode vs extend; ``max_pages``: a decode step whose block table has this width, as a CUDA graph
        needs). Nothing changes until :meth:`_commit`; :meth:`_abort` takes it all back."""
        if self.rows is not None and len(self.rows) != B:
            raise ValueError(f"input_ids: this cache holds a batch of {len(self.rows)} rows, got {B}")
        rows = self.rows if self.rows is not None else [(self.uid, b) for b in range(B)]
        q_lens = [S] * B if real is None else real.sum(1).tolist()
        try:
            meta, self._pending = runner.prepare(dict(zip(rows, q_lens)), DECODE if max_pages else None,
                                                 max_pages=max_pages)
        except OutOfPagesError as e:
            raise OutOfPagesError(e.req_id, e.needed, e.free) from ValueError(
                f"flashdsa.hf: the pool holds {runner.pool.capacity_tokens} tokens; pass a larger max_tokens to "
                f"flashdsa.hf.apply(model, max_tokens=...)")
        if self.rows is None:
            self.rows = rows
            self._finalizer = weakref.finalize(self, _release, weakref.ref(runner), self.rows)
            self._real = torch.zeros(B, 0, dtype=torch.bool)
        self._new_real = torch.ones(B, S, dtype=torch.bool) if real is None else real
        # HF's row layout, for CPU torch.topk's ties (BatchMetadata.index_columns; CUDA's are flashdsa's own)
        if self.patch.indexer == "exact" and not meta.positions.is_cuda:
            columns = torch.cat((self._real, self._new_real), dim=1)  # padding included
            pos = torch.where(columns, columns.long().cumsum(1) - 1, -1)
            meta = dataclasses.replace(meta, index_columns=pos.to(meta.positions.device))
        return meta

    def _commit(self) -> None:
        """The forward is over: its columns count as seen. Not earlier, because HF derives the default
        ``position_ids`` from ``get_seq_length()`` inside the forward."""
        self._real = torch.cat((self._real, self._new_real), dim=1)
        self._length.seen = self._real.shape[1]
        self._pending = self._new_real = None

    def _abort(self, runner: Runner) -> None:
        """The forward failed: give its reservation back, so the cache is exactly as before it."""
        if self._pending is not None:
            runner.undo(self._pending)
        if self._real.shape[1] == 0 and self.rows is not None:  # the failed forward was the first one
            self._finalizer.detach()
            for r in self.rows:
                if r in runner.alloc:
                    runner.free(r)
            self.rows, self._finalizer = None, None
        self._pending = self._new_real = None


class _NoMasks(dict):
    """Given as HF's ``attention_mask`` mapping: every layer gets None, so HF builds no [B, 1, S, T] mask
    (flashdsa's attention takes causality and padding from its own metadata)."""

    def __missing__(self, key):
        return None


# ---- the patch --------------------------------------------------------------------------------------

@dataclass
class _Forward:
    """One model forward: the metadata every layer shares, the real tokens, the selection handed on."""

    meta: BatchMetadata
    cache: FlashDSACache
    tok_idx: torch.Tensor | None          # [T] positions of the real tokens in the flattened [B * S]; None: all
    temporary: bool
    graph_pages: int | None = None        # a decode step replayed from the CUDA graph of this block-table width
    cos: torch.Tensor | None = None       # [T, 32] f32, from HF's position_embeddings (first layer)
    sin: torch.Tensor | None = None
    prev: torch.Tensor | None = None      # the last selection, for the next shared layer


@dataclass(eq=False, repr=False)
class Patch:
    """What :func:`apply` installed on a model (``get_patch(model)``).

    ``calls[i]``: forwards of attention layer i through flashdsa (each layer once per model forward, a
    graph replay included). ``runner``: the :class:`Runner` owning the pool (made on the first forward, on
    the model's device); with ``record=True`` its ``selections`` hold each layer's last selection.
    ``cuda_graphs``: decode steps replay CUDA graphs (may be switched off at any time);
    ``graphs``: the captured ones by ``(batch, block-table pages)``; ``graph_replays``: steps they ran.
    """

    model: torch.nn.Module
    config: DSAConfig
    indexer: str
    kv_format: str
    max_tokens: int
    backend: str | None
    record: bool
    attentions: list[DSAAttention]
    cuda_graphs: bool = True
    calls: list[int] = field(default_factory=list)
    runner: Runner | None = None
    closed: bool = False
    graphs: dict = field(default_factory=dict)
    graph_replays: int = 0
    graph_failure: str | None = None      # why graphs are off for this patch (a capture that failed)
    _hf_caches: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    _hooks: list = field(default_factory=list)
    _patched: list = field(default_factory=list)
    _fwd: _Forward | None = None

    def __repr__(self) -> str:
        return (f"Patch({type(self.model).__name__}, indexer={self.indexer!r}, kv_format={self.kv_format!r}, "
                f"max_tokens={self.max_tokens}, cuda_graphs={self.cuda_graphs}, calls={self.calls}"
                f"{', closed' if self.closed else ''})")

    # ---- hooks on the decoder (model.model) ----------------------------------------------------------
    def _begin(self, module, args, kwargs):
        if self.closed:
            raise RuntimeError("flashdsa.hf: this patch was removed (unapply / a new apply)")
        if len(args) > 1:
            raise ValueError("flashdsa.hf: pass the decoder's arguments by keyword (input_ids=..., attention_mask=...)")
        if "past_key_values" in kwargs:  # HF's deprecated name
            kwargs["cache"] = kwargs.pop("past_key_values")
        ids = kwargs.get("input_ids", args[0] if args else None)
        ref = ids if ids is not None else kwargs.get("inputs_embeds")
        if ref is None:
            raise ValueError("input_ids / inputs_embeds: one of them is required")
        if torch.is_grad_enabled() and module.training:
            raise ValueError("flashdsa.hf is inference-only: call model.eval() or run under torch.no_grad()")
        B, S = ref.shape[:2]
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.model.config, "use_cache", True)
        cache, temporary = self._cache_for(kwargs.get("cache"), use_cache)
        kwargs["cache"] = cache
        real = self._real_tokens(kwargs.get("attention_mask"), cache, B, S)
        kwargs["attention_mask"] = _NoMasks()
        runner = self._runner_for(ref.device)
        if self.record:
            runner.selections = {}
        tok_idx = None if real is None else real.reshape(-1).nonzero().squeeze(1).to(ref.device)
        pages = self._graph_pages(kwargs, cache, real, B, S, ref.device)
        meta = cache._advance(runner, real, B, S, pages)  # the last step that can fail here: _end undoes it
        self._fwd = _Forward(meta, cache, tok_idx, temporary, pages)
        return args, kwargs

    def _end(self, module, args, kwargs, output):
        fwd, self._fwd = self._fwd, None
        if fwd is None:
            return
        # An always_call hook: after a forward that raised, torch calls it with output None.
        if output is None:
            fwd.cache._abort(self.runner)
        else:
            fwd.cache._commit()
        if fwd.temporary:
            fwd.cache.reset()

    def _cache_for(self, cache, use_cache: bool) -> tuple[FlashDSACache, bool]:
        if cache is None:
            return FlashDSACache(self), not use_cache
        if isinstance(cache, FlashDSACache):
            if cache.patch is not self:
                raise ValueError("cache: this FlashDSACache belongs to an earlier flashdsa.hf.apply of the model; "
                                 "start a new one")
            return cache, False
        if isinstance(cache, Cache):
            mine = self._hf_caches.get(cache)
            if mine is not None:
                return mine, False
            if cache.get_seq_length() == 0:
                mine = self._hf_caches[cache] = FlashDSACache(self)
                return mine, False
        raise ValueError(f"cache: a {type(cache).__name__} already holding {cache.get_seq_length()} tokens of KV "
                         "computed without flashdsa; pass no cache, an empty one, or a flashdsa.hf.FlashDSACache")

    @staticmethod
    def _real_tokens(mask, cache: FlashDSACache, B: int, S: int) -> torch.Tensor | None:
        """``[B, S] bool`` (CPU) of the new columns that hold real tokens, or None when all do."""
        if mask is None:
            return None
        if not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            raise ValueError("attention_mask: flashdsa.hf supports a 2-D [batch, past + new] padding mask (or "
                             f"none), got {type(mask).__name__} {list(getattr(mask, 'shape', []))} (a static / "
                             "compiled cache_implementation in generate() makes 4-D masks: use the default)")
        if mask.shape != (B, cache.seen + S):
            raise ValueError(f"attention_mask: expected shape [{B}, {cache.seen + S}] (cached columns + new ones), "
                             f"got {list(mask.shape)}")
        real = mask[:, -S:].bool().cpu() if S else torch.zeros(B, 0, dtype=torch.bool)
        return None if bool(real.all()) else real

    def _runner_for(self, device: torch.device) -> Runner:
        r = self.runner
        if r is not None and r.pool.device == device and r.pool.kv_format == self.cache_format():
            return r
        if r is not None and r.alloc.req_ids:
            raise ValueError(f"flashdsa.hf: the model moved to {device} / {self.cache_format()} caches while "
                             f"{r.pool.kv_format} caches on {r.pool.device} are live; drop or reset them first")
        num_pages = math.ceil(self.max_tokens / self.config.page_size)
        fmt = self.cache_format()
        self.graphs.clear()  # they read the old pool's caches
        self.runner = Runner.for_layers(self.config, device, num_pages, fmt, backend=self.backend,
                                        record=self.record)
        for attn in self.attentions:
            attn.mla_dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        return self.runner

    def cache_format(self) -> str:
        """The MLA cache format in use: ``kv_format`` as given, or for "auto" "fp32" while the model's
        attention weights are fp32 and "bf16" otherwise."""
        if self.kv_format != "auto":
            return self.kv_format
        return "fp32" if self.attentions[0].kv_a_proj_with_mqa.weight.dtype == torch.float32 else "bf16"

    # ---- the attention layers -----------------------------------------------------------------------
    def _attend(self, lid: int, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
        fwd = self._fwd
        if fwd is None:
            raise RuntimeError("flashdsa.hf: a patched attention layer ran outside its model's forward")
        B, S, D = hidden_states.shape
        x = hidden_states.reshape(B * S, D)
        if fwd.tok_idx is not None:
            x = x.index_select(0, fwd.tok_idx)
        if fwd.cos is None:
            fwd.cos, fwd.sin = (_rope_half(t, B, S, fwd.tok_idx) for t in position_embeddings)
        with torch.no_grad():
            out, fwd.prev = self.attentions[lid](x, fwd.cos, fwd.sin, fwd.meta, self.runner.pool, fwd.prev)
        if self.record:
            self.runner.selections[lid] = fwd.prev
        self.calls[lid] += 1
        if fwd.tok_idx is not None:
            full = out.new_zeros(B * S, D)
            full[fwd.tok_idx] = out
            out = full
        return out.view(B, S, D)

    # ---- CUDA-graph decode ----------------------------------------------------------------------------
    def _graph_pages(self, kwargs: dict, cache: FlashDSACache, real, B: int, S: int,
                     device: torch.device) -> int | None:
        """The block-table width (pages) of the graph that will run this forward, or None to run it eagerly.

        A graph runs plain decode steps: one new real token per live row, token ids in, nothing asked of the
        decoder but its last hidden state. The width is a power of two >= 16 pages covering every row after
        this step, capped at the pool: one graph per (batch, width), a new one only when a row outgrows it.
        """
        if not (self.cuda_graphs and self.graph_failure is None and _graphs_possible(device)):
            return None
        if self.backend == "torch" or self.record or S != 1 or real is not None or cache.rows is None:
            return None
        if B > _GRAPH_MAX_BATCH or set(kwargs) - _DECODE_KWARGS or kwargs.get("inputs_embeds") is not None:
            return None
        if not isinstance(kwargs.get("input_ids"), torch.Tensor):
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
        graph = self.graphs.get(key)
        if graph is not None and graph.weights != self._weights():
            self.graphs.clear()  # the weights moved (model.to(...)): the graphs read the old ones
            graph = None
        if graph is None:
            calls = list(self.calls)
            try:
                graph = _DecodeGraph(self, orig, fwd, kwargs)
            except Exception as e:  # a module that cannot be captured (a host sync, a data-dependent shape)
                self.graph_failure = f"{type(e).__name__}: {e}"
            finally:
                self.calls[:] = calls  # warm-up and capture are not forwards of the model
                self._fwd = fwd
            if graph is None:
                warnings.warn(f"flashdsa.hf: capturing the decode step in a CUDA graph failed ({self.graph_failure}); "
                              "decoding eagerly from now on", RuntimeWarning, stacklevel=2)
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


_GRAPH_MAX_BATCH = 16   # decode batches up to this size replay graphs ("batch 1 and small batches")
_GRAPH_MIN_PAGES = 16   # the narrowest block table a graph gets (1024 tokens)
_DECODE_KWARGS = {"input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "use_cache"}


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


class _DecodeGraph:
    """The decoder's forward for one decode step of B rows with a ``[B, pages]`` block table, captured once in
    a CUDA graph (HF's embedding, norms and MLPs, flashdsa's attention) and replayed per token.

    Before each replay the step's inputs are copied into the graph's buffers: token ids and HF's position ids
    ``[B, 1]``, and the batch metadata (``positions``, ``slot_mapping``, ``block_table [B, pages]``,
    ``context_lens [B, 1]``) that :meth:`FlashDSACache._advance` built for the step with the same width.
    Everything else it reads stays where it was at capture: the weights (``Patch._weights`` notices when
    they move) and the pool's caches (a new pool drops the graphs). Nothing inside the graph depends on a
    value read on the host, so the one graph serves every cache object and every length up to the width.
    """

    def __init__(self, patch: Patch, orig, fwd: _Forward, kwargs: dict):
        m = fwd.meta
        # ordinary tensors even under torch.inference_mode(): later steps may copy into them outside it
        with torch.inference_mode(False):
            self.meta = dataclasses.replace(m, positions=m.positions.clone(), slot_mapping=m.slot_mapping.clone(),
                                            block_table=m.block_table.clone(), context_lens=m.context_lens.clone())
            self.ids = kwargs["input_ids"].clone()
            self.pos = torch.empty_like(self.ids)
        self._positions(kwargs.get("position_ids"), fwd.cache)
        static = dict(input_ids=self.ids, position_ids=self.pos, attention_mask=_NoMasks(), cache=fwd.cache,
                      use_cache=kwargs.get("use_cache"))

        def run():
            # a fresh _Forward each run: the RoPE tables and the shared-layer selection are made inside
            patch._fwd = _Forward(self.meta, fwd.cache, None, False, fwd.graph_pages)
            with torch.no_grad():
                return orig(**static)

        self.weights = patch._weights()
        self.graph, out = _capture(run, self.ids.device)
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
        self.ids.copy_(kwargs["input_ids"])
        self._positions(kwargs.get("position_ids"), fwd.cache)
        self.graph.replay()
        out = {"last_hidden_state": self.hidden.clone()}  # the buffer is the next replay's output too
        if self.cache_key is not None:
            out[self.cache_key] = fwd.cache
        return self.out_type(**out)


def _rope_half(t: torch.Tensor, B: int, S: int, tok_idx: torch.Tensor | None) -> torch.Tensor:
    """HF's cos or sin ``[B or 1, S, R]`` (``cat(freqs, freqs)``) -> flashdsa's ``[T, R / 2] f32``."""
    t = t.expand(B, S, t.shape[-1]).reshape(B * S, t.shape[-1])[:, : t.shape[-1] // 2].float()
    return t if tok_idx is None else t.index_select(0, tok_idx)


def _attention_forward(patch: Patch, lid: int, returns_topk: bool):
    def forward(hidden_states, position_embeddings=None, attention_mask=None, cache=None, position_ids=None,
                **kwargs):
        out = patch._attend(lid, hidden_states, position_embeddings)
        # GLM's layers hand their top-k on (prev_topk_indices); flashdsa threads the selection itself
        return (out, None, None) if returns_topk else (out, None)
    return forward


# ---- public API -------------------------------------------------------------------------------------

def get_patch(model) -> Patch | None:
    """The :class:`Patch` :func:`apply` installed on ``model``, or None."""
    return model.__dict__.get("_flashdsa_patch")


def _decoder(model):
    base = getattr(model, "model", model)
    if not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        raise ValueError(f"model: expected an HF decoder-only model with .model.layers (or .layers), "
                         f"got {type(model).__name__}")
    return base


def _adopt(hf_attn, cfg: DSAConfig, lid: int, precision: str) -> DSAAttention:
    """A DSAAttention whose submodules are the HF layer's own (built on meta, then every part replaced)."""
    missing = [p for p in _MLA_PARTS + ("scaling",) if not hasattr(hf_attn, p)]
    if missing:
        raise ValueError(f"model: layer {lid}'s attention ({type(hf_attn).__name__}) is not DSA's MLA: it lacks "
                         f"{missing}")
    hf_indexer = getattr(hf_attn, "indexer", None)
    if (hf_indexer is not None) != (lid in cfg.topk_layers):
        raise ValueError(f"model: layer {lid} {'has' if hf_indexer is not None else 'lacks'} an indexer but the "
                         f"config says it {'computes' if lid in cfg.topk_layers else 'reuses'} top-k")
    with torch.device("meta"):
        attn = DSAAttention(cfg, lid)
    for name in _MLA_PARTS:
        setattr(attn, name, getattr(hf_attn, name))
    attn.softmax_scale = float(hf_attn.scaling)
    if attn.indexer is not None:
        missing = [p for p in _INDEXER_PARTS if not hasattr(hf_indexer, p)]
        if missing:
            raise ValueError(f"model: layer {lid}'s indexer lacks {missing}")
        for name in _INDEXER_PARTS:
            setattr(attn.indexer, name, getattr(hf_indexer, name))
        attn.indexer.precision = precision
    assert not any(p.is_meta for p in attn.parameters()), "every part of the adapter is the HF layer's"
    return attn


def apply(model, indexer: str = "fp8", *, kv_format: str = "auto", max_tokens: int = 32768,
          backend: str | None = None, record: bool = False, cuda_graphs: bool = True) -> Patch:
    """Patch an HF DSA model (``DeepseekV32ForCausalLM``, ``GlmMoeDsaForCausalLM``) in place.

    Args:
        model:      the HF model (the ``*ForCausalLM`` or its decoder ``*Model``).
        indexer:    "fp8" (deployment numerics, docs/DSA.md §3) or "exact" (fp32 scores, HF's numbers).
        kv_format:  MLA cache format: "auto" (default: the model's own precision — "fp32" for an fp32
                    model, "bf16" otherwise; decided on each new pool, i.e. after ``model.to(dtype)`` too),
                    "bf16", "fp8" (656-B FlashMLA rows) or "fp32" (2304-B rows; the absorbed query and
                    the attention kernels in fp32 too, IEEE products: exact to fp32 rounding).
        max_tokens: capacity of the paged pool in tokens, over all live sequences (each row rounds up to
                    64-token pages); made on the first forward, on the model's device.
        backend:    force flashdsa's op backend ("torch" / "triton"); default: Triton on CUDA.
        record:     keep each layer's last selection in ``get_patch(model).runner.selections`` (decode
                    then runs eagerly).
        cuda_graphs: replay decode steps of batches up to 16 rows from CUDA graphs (on CUDA, Triton
                    backends; see the module docstring). False: every step eagerly.

    Returns the :class:`Patch`. Applying again replaces the previous patch (same settings: a no-op in
    effect; caches of the old patch become invalid). ValueError for a model that is not DSA.
    """
    if _version(transformers.__version__) < _MIN_TRANSFORMERS:
        raise ImportError(f"flashdsa.hf needs transformers >= {'.'.join(map(str, _MIN_TRANSFORMERS))}, "
                          f"found {transformers.__version__}")
    if indexer not in PRECISIONS:
        raise ValueError(f"indexer: expected one of {PRECISIONS}, got {indexer!r}")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format: expected one of {KV_FORMATS}, got {kv_format!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected an int >= 1, got {max_tokens!r}")
    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs: expected a bool, got {cuda_graphs!r}")
    hf_config = getattr(model, "config", None)
    d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}
    if not is_dsa(d):
        raise ValueError(f"model: {type(model).__name__} is not a DSA model (flashdsa.hf patches DeepSeek-V3.2 / "
                         f"GLM-5 models: a DSA architecture with index_topk; got model_type "
                         f"{d.get('model_type')!r}, index_topk {d.get('index_topk')!r})")
    cfg = DSAConfig.from_hf(d)
    if cfg.kv_cache_dim != MLA_DIM or cfg.index_head_dim != INDEX_DIM:
        raise ValueError(f"model: flashdsa's caches need kv_lora_rank + qk_rope_head_dim = {MLA_DIM} and "
                         f"index_head_dim = {INDEX_DIM}, got {cfg.kv_cache_dim} and {cfg.index_head_dim}")
    if cfg.index_kpool > 1:
        raise ValueError("model: index_kpool > 1 is not supported by flashdsa.hf yet")
    base = _decoder(model)
    if len(base.layers) != cfg.num_hidden_layers:
        raise ValueError(f"model: {len(base.layers)} layers, the config says {cfg.num_hidden_layers}")
    if get_patch(model) is not None:
        unapply(model)
    attentions = [_adopt(layer.self_attn, cfg, i, indexer) for i, layer in enumerate(base.layers)]
    patch = Patch(model=model, config=cfg, indexer=indexer, kv_format=kv_format, max_tokens=max_tokens,
                  backend=backend, record=record, attentions=attentions, cuda_graphs=cuda_graphs,
                  calls=[0] * cfg.num_hidden_layers)
    for i, layer in enumerate(base.layers):
        hf_attn = layer.self_attn
        returns_topk = "prev_topk_indices" in inspect.signature(type(hf_attn).forward).parameters
        hf_attn.forward = _attention_forward(patch, i, returns_topk)
        patch._patched.append(hf_attn)
    base.forward = functools.partial(patch._decoder_forward, type(base).forward.__get__(base))
    patch._patched.append(base)
    patch._hooks = [base.register_forward_pre_hook(patch._begin, with_kwargs=True),
                    base.register_forward_hook(patch._end, with_kwargs=True, always_call=True)]
    model.__dict__["_flashdsa_patch"] = patch  # a plain attribute: not a submodule, not in the state dict
    return patch


def unapply(model) -> None:
    """Remove :func:`apply`'s patch: HF's attention again; the pool is dropped, its caches become invalid."""
    patch = get_patch(model)
    if patch is None:
        raise ValueError("model: not patched by flashdsa.hf.apply")
    for module in patch._patched:  # the attention layers and the decoder
        module.__dict__.pop("forward", None)
    for h in patch._hooks:
        h.remove()
    patch.graphs.clear()
    patch.closed, patch.runner, patch._fwd = True, None, None
    del model.__dict__["_flashdsa_patch"]
