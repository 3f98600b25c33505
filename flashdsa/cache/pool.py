"""Paged KV pool: per layer one MLA cache and, for layers that compute top-k, one indexer cache.

All caches share one page allocator, so one page id addresses the same tokens in every cache of every
layer, and one block table per batch serves all layers. Shapes (P pages, page_size = 64 c, c = kpool)::

    MLA cache, per layer       [P, page_size, 576] bf16 | [P, page_size, 656] u8 ("fp8") | [P, page_size, 576] u8 ("fp8_raw")
    indexer cache, top-k layer [P, 8448] u8: 64 keys per page (layouts.py); skip-top-k layers have none

Token p of a request (MLA):        slot = block_table[p // (64 c)] * 64 c + p % (64 c)
Pooled key g of a request (index): slot = block_table[g // 64] * 64 + g % 64
Pooled key g covers tokens g c .. g c + c - 1, so page j holds tokens j 64 c .. (j + 1) 64 c - 1 and
their pooled keys j 64 .. j 64 + 63: the same page id serves both caches. With c = 1 a pooled key is a
token and both slot formulas agree.

Memory per page: ``num_layers * page_size * mla_bytes + num_topk_layers * 8448``; per token divide by
page_size (the indexer costs 132 / c bytes per token per top-k layer).

An indexer run in exact precision (``Indexer(precision="exact")``: float keys, fp32 scores) cannot use the
fp8 pages: its keys go to a float store per top-k layer, ``[P * page_size, 128]`` in the model dtype,
addressed by MLA slot and made on the layer's first exact write (``exact_index_cache``). It is counted in
``memory_bytes`` from then on.
"""

from __future__ import annotations

import math
from typing import Hashable

import torch

from flashdsa.cache import layouts
from flashdsa.cache.allocator import BLOCK_TABLE_PAD, PageAllocator, check_span, slots_from_pages
from flashdsa.config import DSAConfig
from flashdsa._checks import check_finite, check_slots
from flashdsa.quant import FP8

_MLA_DTYPE = {"bf16": torch.bfloat16, "fp8": torch.uint8, "fp8_raw": torch.uint8}
_MLA_WIDTH = {"bf16": layouts.MLA_DIM, "fp8": layouts.MLA_FP8_BYTES, "fp8_raw": layouts.MLA_FP8_RAW_BYTES}


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def page_bytes(config: DSAConfig, kv_format: str) -> int:
    """Bytes one page costs across all layers: MLA rows of every layer + one indexer page per top-k layer."""
    if kv_format not in layouts.MLA_FORMATS:
        _fail("kv_format", f"one of {layouts.MLA_FORMATS}", repr(kv_format))
    mla = config.num_hidden_layers * config.page_size * layouts.BYTES_PER_TOKEN[kv_format]
    return mla + len(config.topk_layers) * layouts.INDEX_PAGE_BYTES


class KVPool:
    """The paged MLA and indexer caches of every layer, plus the page allocator that hands out their pages.

    Args:
        config:    the model; uses ``num_hidden_layers``, ``topk_layers``, ``page_size`` (64 c), ``index_kpool``.
        num_pages: pages per cache (>= 1); capacity ``num_pages * page_size`` tokens.
        kv_format: MLA cache format, "bf16" (1152 B/token), "fp8" (656 B, FlashMLA) or "fp8_raw" (576 B).
        device:    where the caches live.
        kv_scale:  the per-tensor fp32 scale of "fp8_raw" (required there, must be None otherwise).

    Caches start zeroed. ``allocator`` reserves pages per request; ``block_table`` / ``slots`` /
    ``index_slots`` turn them into the addresses the ops and writers take.
    """

    def __init__(self, config: DSAConfig, num_pages: int, kv_format: str = "fp8",
                 device: torch.device | str = "cpu", kv_scale: float | None = None):
        if not isinstance(config, DSAConfig):
            _fail("config", "a DSAConfig", type(config).__name__)
        if config.kv_cache_dim != layouts.MLA_DIM:
            _fail("config", f"kv_lora_rank + qk_rope_head_dim == {layouts.MLA_DIM} (the cache layouts are fixed)",
                  config.kv_cache_dim)
        if config.index_head_dim != layouts.INDEX_DIM:
            _fail("config", f"index_head_dim == {layouts.INDEX_DIM} (the indexer page layout is fixed)",
                  config.index_head_dim)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            _fail("num_pages", "an int >= 1", repr(num_pages))
        if kv_format not in layouts.MLA_FORMATS:
            _fail("kv_format", f"one of {layouts.MLA_FORMATS}", repr(kv_format))
        if kv_format == "fp8_raw":
            if kv_scale is None or not (isinstance(kv_scale, (int, float)) and math.isfinite(kv_scale) and kv_scale > 0):
                _fail("kv_scale", "a finite float > 0 for kv_format 'fp8_raw'", kv_scale)
            kv_scale = float(kv_scale)
        elif kv_scale is not None:
            _fail("kv_scale", f"None for kv_format {kv_format!r} (only 'fp8_raw' has a per-tensor scale)", kv_scale)

        self.config = config
        self.num_pages = num_pages
        self.kv_format = kv_format
        self.kv_scale = kv_scale
        self.device = torch.device(device)
        self.page_size = config.page_size
        self.kpool = config.index_kpool
        self.num_layers = config.num_hidden_layers
        self.allocator = PageAllocator(num_pages, self.page_size, self.device)
        shape = (num_pages, self.page_size, _MLA_WIDTH[kv_format])
        self.mla_caches: list[torch.Tensor] = [
            self._new_mla_cache(shape, _MLA_DTYPE[kv_format]) for _ in range(self.num_layers)]
        self.index_caches: dict[int, torch.Tensor] = {
            layer: torch.zeros(num_pages, layouts.INDEX_PAGE_BYTES, dtype=torch.uint8, device=self.device)
            for layer in config.topk_layers}
        self.exact_index_caches: dict[int, torch.Tensor] = {}  # made on first use (exact_index_cache)

    @classmethod
    def from_memory(cls, config: DSAConfig, bytes_budget: int, kv_format: str = "fp8",
                    device: torch.device | str = "cpu", kv_scale: float | None = None) -> "KVPool":
        """The largest pool whose caches fit in ``bytes_budget``: ``num_pages = bytes_budget // page_bytes``."""
        per_page = page_bytes(config, kv_format)
        if isinstance(bytes_budget, bool) or not isinstance(bytes_budget, int) or bytes_budget < per_page:
            _fail("bytes_budget", f"an int >= {per_page} (one page across all layers in {kv_format!r})",
                  repr(bytes_budget))
        return cls(config, bytes_budget // per_page, kv_format, device, kv_scale)

    # ---- caches --------------------------------------------------------------------------------
    def mla_cache(self, layer: int) -> torch.Tensor:
        """The layer's MLA cache ``[P, page_size, width]`` (see the module docstring for dtype and width)."""
        return self.mla_caches[self._check_layer(layer)]

    def mla_pages(self, layer: int) -> torch.Tensor:
        """The layer's MLA cache as 64-token pages ``[P * c, 64, width]`` (what ``ops.sparse_mla_decode`` reads;
        the same rows as :meth:`mla_cache`, so slots address both alike)."""
        cache = self.mla_cache(layer)
        return cache.view(-1, layouts.PAGE_SIZE, cache.shape[-1])

    def has_index_cache(self, layer: int) -> bool:
        return self._check_layer(layer) in self.index_caches

    def index_cache(self, layer: int) -> torch.Tensor:
        """The layer's indexer cache ``[P, 8448] u8``; ValueError for a skip-top-k layer (it has none)."""
        if not self.has_index_cache(layer):
            raise ValueError(f"layer: layer {layer} skips top-k (reuses the previous layer's selection) and has "
                             f"no indexer cache; layers with one: {sorted(self.index_caches)}")
        return self.index_caches[layer]

    def exact_index_cache(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """The layer's float key store ``[P * page_size, 128]`` of ``dtype`` for an exact-precision indexer,
        addressed by MLA slot; made (zeroed) on first use, or remade if ``dtype`` changed (the keys of the
        old dtype were written by an indexer that no longer runs). ValueError for a skip-top-k layer."""
        self.index_cache(layer)  # the same rule: only top-k layers keep indexer keys
        store = self.exact_index_caches.get(layer)
        if store is None or store.dtype != dtype:
            store = torch.zeros(self.num_pages * self.page_size, layouts.INDEX_DIM, dtype=dtype, device=self.device)
            self.exact_index_caches[layer] = store
        return store

    # ---- addresses -----------------------------------------------------------------------------
    def slots(self, req_id: Hashable, start: int = 0, end: int | None = None) -> torch.Tensor:
        """MLA slots of tokens ``start .. end - 1`` of a request: ``[end - start] int64`` (allocator.slots)."""
        return self.allocator.slots(req_id, start, end)

    def index_slots(self, req_id: Hashable, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Indexer slots of pooled keys ``start .. end - 1`` (tokens with c = 1): ``[end - start] int64``.

        ``slot(g) = pages[g // 64] * 64 + g % 64``; ``end`` defaults to ``ceil(seq_len / c)`` (the last,
        possibly unfinished, group has a row too) and may not exceed it.
        """
        n = -(-self.allocator.seq_len(req_id) // self.kpool)
        end = n if end is None else end
        check_span(start, end, n, f"ceil(seq_len / kpool) ({n}) of request {req_id!r}")
        return slots_from_pages(self.allocator.pages(req_id), start, end, layouts.PAGE_SIZE).to(self.device)

    def block_table(self, req_ids, max_pages: int | None = None, pad: int = BLOCK_TABLE_PAD) -> torch.Tensor:
        """``[B, maxp] int32`` for a batch, built once and shared by every layer and both caches
        (``allocator.block_table``: padded with ``pad``, 0 by default, a real page id)."""
        return self.allocator.block_table(req_ids, max_pages, pad)

    # ---- writes and reads ------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor, index_k_fp8: torch.Tensor | None = None,
              index_k_scale: torch.Tensor | None = None, index_slots: torch.Tensor | None = None) -> None:
        """Store N tokens' MLA rows (quantised per ``kv_format``) and, optionally, M indexer keys.

        Args:
            slots:         ``[N] int`` MLA slots (``slots()``), distinct (ValueError otherwise, when value
                           checks are on).
            kv:            ``[N, 576]`` float: 512 latent + 64 rope.
            index_k_fp8:   ``[M, 128] float8_e4m3fn`` indexer keys (M = N with c = 1; pooled keys with c > 1), no
                           NaN codes (ValueError when value checks are on).
            index_k_scale: ``[M] float32``, given together with ``index_k_fp8``.
            index_slots:   ``[M] int`` (``index_slots()``), distinct; defaults to ``slots`` when c = 1, required
                           when c > 1.

        Every argument is checked before any byte is written; only the given slots change.
        ValueError for index keys on a layer without an indexer cache.
        """
        self._check_layer(layer)
        check_slots("slots", slots, self.num_pages * self.page_size, distinct=True)
        if not (isinstance(kv, torch.Tensor) and kv.dim() == 2 and kv.shape[1] == layouts.MLA_DIM
                and kv.is_floating_point() and kv.shape[0] == slots.shape[0]):
            _fail("kv", f"a float tensor [{slots.shape[0]}, {layouts.MLA_DIM}] (one row per slot)",
                  _describe(kv))
        if (index_k_fp8 is None) != (index_k_scale is None):
            _fail("index_k_scale", "given together with index_k_fp8", "only one of them")
        if index_k_fp8 is None:
            if index_slots is not None:
                _fail("index_slots", "None when no index keys are given", "a tensor")
        else:
            index = self.index_cache(layer)
            if index_slots is None:
                if self.kpool > 1:
                    _fail("index_slots", f"the pooled keys' slots (index_slots()) with kpool {self.kpool}", None)
                index_slots = slots
            check_slots("index_slots", index_slots, self.num_pages * layouts.PAGE_SIZE, distinct=True)
            m = index_slots.shape[0]
            if not (isinstance(index_k_fp8, torch.Tensor) and index_k_fp8.dtype == FP8
                    and index_k_fp8.shape == (m, layouts.INDEX_DIM)):
                _fail("index_k_fp8", f"float8_e4m3fn [{m}, {layouts.INDEX_DIM}] (one row per index slot)",
                      _describe(index_k_fp8))
            if not (isinstance(index_k_scale, torch.Tensor) and index_k_scale.dtype == torch.float32
                    and index_k_scale.shape == (m,)):
                _fail("index_k_scale", f"float32 [{m}]", _describe(index_k_scale))
            check_finite("index_k_fp8", index_k_fp8)  # store_index_keys would refuse it after the MLA write
        self._store_mla(layer, slots, kv)
        if index_k_fp8 is not None:
            layouts.store_index_keys(index, index_slots.to(self.device), index_k_fp8, index_k_scale)

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Dequantised MLA rows: ``slots [N] -> [N, 576] bf16``."""
        check_slots("slots", slots, self.num_pages * self.page_size)
        return self._gather_mla(self._check_layer(layer), slots)

    def mla_for_attention(self, layer: int, sel: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """What sparse MLA decode reads for the selection ``sel [B * n, topk] int32`` (pool slots, -1 = none):
        ``(pages [P', 64, width], indices)`` with ``indices`` shaped like ``sel``. Here the layer's own pages and
        the slots as they are; an offloading pool (``flashdsa.cache.offload``) swaps the selected rows into a
        device buffer and hands its rows instead."""
        return self.mla_pages(layer), sel

    # Where the MLA rows live: on the device here; flashdsa.cache.offload keeps them on the host.
    def _new_mla_cache(self, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _store_mla(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        mla = self.mla_caches[layer]
        # store_mla addresses 64-token pages; [P, 64 c, W] viewed as [P c, 64, W] has the same flat rows.
        layouts.store_mla(mla.view(-1, layouts.PAGE_SIZE, mla.shape[-1]), slots.to(self.device), kv, self.kv_scale)

    def _gather_mla(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return layouts.gather_mla(self.mla_caches[layer], slots.to(self.device), self.kv_scale)

    def read_index(self, layer: int, index_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer keys: ``index_slots [M] -> k_fp8 [M, 128] e4m3, k_scale [M] f32``."""
        check_slots("index_slots", index_slots, self.num_pages * layouts.PAGE_SIZE)
        return layouts.gather_index_keys(self.index_cache(layer), index_slots.to(self.device))

    # ---- memory ----------------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, float]:
        """Bytes held, by cache: ``mla``, ``index``, ``exact_index`` (the float key stores made so far),
        ``total`` (ints, all layers), and the same per token of capacity as ``mla_per_token``,
        ``index_per_token``, ``exact_index_per_token``, ``total_per_token`` (floats: the indexer costs
        132 / c per token per top-k layer)."""
        mla = self.num_layers * self.num_pages * self.page_size * layouts.BYTES_PER_TOKEN[self.kv_format]
        index = len(self.index_caches) * self.num_pages * layouts.INDEX_PAGE_BYTES
        exact = sum(t.numel() * t.element_size() for t in self.exact_index_caches.values())
        total = mla + index + exact
        tokens = self.num_pages * self.page_size
        return {"mla": mla, "index": index, "exact_index": exact, "total": total,
                "mla_per_token": mla / tokens, "index_per_token": index / tokens,
                "exact_index_per_token": exact / tokens, "total_per_token": total / tokens}

    def bytes_per_token(self) -> float:
        """Cache bytes per token across all layers (MLA + indexer)."""
        return page_bytes(self.config, self.kv_format) / self.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def __repr__(self) -> str:
        m = self.memory_bytes()
        return (f"KVPool({self.num_pages} pages x {self.page_size} tokens, {self.kv_format}, "
                f"{self.num_layers} layers, {len(self.index_caches)} indexer caches, "
                f"{m['total'] / 2**20:.1f} MiB, {m['total_per_token']:.1f} B/token, {self.device})")

    def _check_layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            _fail("layer", f"an int in [0, {self.num_layers})", repr(layer))
        return layer


def _describe(t) -> str:
    return f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
