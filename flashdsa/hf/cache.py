"""The cache of a patched model: :class:`FlashDSACache`, a ``transformers.Cache`` whose KV lives in flashdsa's
paged pool (:class:`flashdsa.cache.KVPool`: the MLA rows and the indexer keys of every layer, one page
allocator), owned by the patched model and sized by ``apply(max_tokens=...)``.

Why not store into HF's cache objects (a design decision): HF's ``DynamicCache`` holds per-layer
``[B, 1, T, 512]`` latents and ``[B, T, 128]`` indexer keys, grown by ``torch.cat`` every step; the sparse
kernels need the paged layouts (fp8 656-B rows, 8448-B indexer pages) and a block table, so using HF's
tensors would mean re-packing the whole context every layer and step. So no HF cache holds KV here;
``model(...)`` and ``generate()`` still work unchanged because the cache object they pass around is ours
(which one a forward gets: ``Patch._cache_for``):

    * no cache given (``model(ids)``, or ``use_cache=False``): a new ``FlashDSACache`` (temporary with
      ``use_cache=False``: its pages are freed when the forward returns);
    * an EMPTY HF cache (what ``generate()`` creates each call, or ``DynamicCache()`` of the user): a new
      ``FlashDSACache`` takes its place (``outputs.cache`` is it; generate() carries ``outputs.cache`` to the
      next step), remembered per HF object, so passing the same HF object again continues the sequence.
      A new generate() call makes a new HF cache, hence a fresh sequence: nothing leaks between calls;
    * a ``FlashDSACache`` (``outputs.cache``, or ``FlashDSACache(model)``): continued;
    * a non-empty HF cache (KV computed by unpatched attention): ValueError.

Positions line up because ``get_seq_length()`` counts the columns seen (pads included, as HF's caches do),
so HF derives the same ``position_ids`` as with its own cache; each row holds only its real tokens (a
padded column is counted, never written). A cache's pages return to the pool when it is garbage-collected
or ``reset()``.

Here too: what one forward hands the patched layers (``_Forward``, ``_NoMasks``), shared by the eager path
(:mod:`flashdsa.hf.patch`) and the CUDA graphs (:mod:`flashdsa.hf.graphs`).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

from flashdsa.cache.allocator import OutOfPagesError
from flashdsa.cache.metadata import DECODE, BatchMetadata
from flashdsa.engine.runner import Runner

_uids = itertools.count()


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


def get_patch(model):
    """The :class:`~flashdsa.hf.patch.Patch` :func:`flashdsa.hf.apply` installed on ``model``, or None."""
    return getattr(model, "__dict__", {}).get("_flashdsa_patch")


class FlashDSACache(Cache):
    """A ``transformers.Cache`` whose KV lives in the paged pool of a model patched by
    :func:`flashdsa.hf.apply`.

    One request of the pool per batch row, created on the first forward. ``get_seq_length()`` is the
    number of columns seen (padding included, as HF's caches count); each row holds only its real tokens.
    Pages go back to the pool on ``reset()`` or when the object is garbage-collected.
    """

    def __init__(self, model):
        # a patched model, or the Patch itself (whose .model holds it)
        patch = get_patch(model) or get_patch(getattr(model, "model", None))
        if patch is None:
            raise ValueError("model: expected a model patched by flashdsa.hf.apply(model)")
        self._length = _Length()
        # a hybrid stack's linear-attention layers keep their conv / recurrent state in HF's own layer objects
        dsa = set(patch.hf_layers)
        super().__init__(layers=[_FlashDSALayer(self._length) if i in dsa else LinearAttentionLayer()
                                 for i in range(patch.num_hf_layers)])
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
        for layer in self._linear_layers():
            layer.reset()

    def _linear_layers(self) -> list:
        return [layer for layer in self.layers if isinstance(layer, LinearAttentionLayer)]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (HF's convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove: expected a count <= 0 (HF's crop convention), got {tokens_to_remove}")
        keep = self.seen + tokens_to_remove
        if tokens_to_remove == 0 or self.rows is None:
            return
        if self._linear_layers():
            raise NotImplementedError("FlashDSACache: crop of a hybrid stack (its linear-attention layers keep a "
                                      "recurrent state, which cannot be rolled back) is not supported")
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
        """The forward failed: give its reservation back, so the cache is exactly as before it (its pages;
        a hybrid stack's linear-attention layers may have stepped their state: HF's, not rolled back)."""
        if self._pending is not None:
            runner.undo(self._pending)
        if self._real.shape[1] == 0 and self.rows is not None:  # the failed forward was the first one
            self._finalizer.detach()
            for r in self.rows:
                if r in runner.alloc:
                    runner.free(r)
            self.rows, self._finalizer = None, None
        self._pending = self._new_real = None


# ---- what one forward hands the layers ---------------------------------------------------------------

class _NoMasks(dict):
    """Given as HF's ``attention_mask`` mapping: every layer gets None, so HF builds no [B, 1, S, T] mask
    (flashdsa's attention takes causality and padding from its own metadata)."""

    def __missing__(self, key):
        return None


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
