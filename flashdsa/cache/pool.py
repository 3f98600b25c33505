"""Paged KV pool: per layer one MLA cache and, for layers that compute top-k, one indexer cache.

All caches share one page allocator, so one page id addresses the same tokens in every cache of every
layer, and one block table per batch serves all layers. Shapes (P pages, page_size = 64 c, c = kpool)::

    MLA cache, per layer       [P, page_size, 576] bf16 | [P, page_size, 656] u8 ("fp8") | [P, page_size, 576] u8 ("fp8_raw")
                               | [P, page_size, 576] f32 ("fp32": exactness studies of fp32 models, 2304 B a token);
                               a NoPE model's (qk_rope_head_dim 0) rows have no rope part: 512 | 528 | 512 | 512
    indexer cache, top-k layer [P, 8448] u8: 64 keys per page (layouts.py); skip-top-k layers have none

Token p of a request (MLA):        slot = block_table[p // (64 c)] * 64 c + p % (64 c)
Pooled key g of a request (index): slot = block_table[g // 64] * 64 + g % 64
Pooled key g covers tokens g c .. g c + c - 1, so page j holds tokens j 64 c .. (j + 1) 64 c - 1 and
their pooled keys j 64 .. j 64 + 63: the same page id serves both caches. With c = 1 a pooled key is a
token and both slot formulas agree.

Memory per page: ``num_layers * page_size * mla_bytes + num_topk_layers * 8448``; per token divide by
page_size (the indexer costs 132 / c bytes per token per top-k layer).

kpool keeps per request what a group needs before it is full (SPEC §7; SGLang keeps it in its KV pool per
request slot too): the tail ring, per top-k layer ``[R, S, 2, 128]`` in the model dtype — request row r
holds the key (``[.., 0, :]``, after LayerNorm and RoPE, not rotated) and the pooling gate (``[.., 1, :]``)
of position p at ``[r, p % S]``, ``S = c + max_next_n - 1``. A request gets its row on its first
reservation and gives it back with :meth:`free`. :meth:`reserve` / :meth:`undo` / :meth:`truncate` keep
the ring right: a failed forward's writes are put back (the rows it could overwrite are saved first),
and a truncation must leave its unfinished group's tokens among the last S written (ValueError else;
always true for drafts of a verify of at most ``max_next_n`` tokens).

An indexer run in exact precision (``Indexer(precision="exact")``: float keys, fp32 scores) cannot use the
fp8 pages: its keys go to a float store per top-k layer, ``[P * page_size, 128]`` in the model dtype,
addressed by MLA slot and made on the layer's first exact write (``exact_index_cache``). It is counted in
``memory_bytes`` from then on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable

import torch

from flashdsa.cache import layouts
from flashdsa.cache.allocator import BLOCK_TABLE_PAD, PageAllocator, Reservation, check_span, slots_from_pages
from flashdsa.config import DSAConfig
from flashdsa._checks import check_finite, check_slots
from flashdsa.quant import FP8

_MLA_DTYPE = {"bf16": torch.bfloat16, "fp8": torch.uint8, "fp8_raw": torch.uint8, "fp32": torch.float32}


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def page_bytes(config: DSAConfig, kv_format: str) -> int:
    """Bytes one page costs across all layers: MLA rows of every layer + one indexer page per top-k layer."""
    if kv_format not in layouts.ALL_MLA_FORMATS:
        _fail("kv_format", f"one of {layouts.ALL_MLA_FORMATS}", repr(kv_format))
    mla = config.num_hidden_layers * config.page_size * layouts.mla_row_bytes(kv_format, config.qk_rope_head_dim)
    return mla + len(config.topk_layers) * layouts.INDEX_PAGE_BYTES


@dataclass(frozen=True)
class PoolReservation(Reservation):
    """A :class:`Reservation` plus what :meth:`KVPool.undo` puts back for kpool: per request of the batch,
    ``(req_id, row, hi before, row newly given, saved ring rows {layer: [S, 2, 128]} or None)``."""

    tails: tuple = ()


class KVPool:
    """The paged MLA and indexer caches of every layer, plus the page allocator that hands out their pages.

    Args:
        config:    the model; uses ``num_hidden_layers``, ``topk_layers``, ``page_size`` (64 c), ``index_kpool``.
        num_pages: pages per cache (>= 1); capacity ``num_pages * page_size`` tokens.
        kv_format: MLA cache format, "bf16" (1152 B/token), "fp8" (656 B, FlashMLA), "fp8_raw" (576 B) or
                   "fp32" (2304 B: an fp32 model's rows unrounded, for exactness studies); a NoPE model
                   (``qk_rope_head_dim`` 0) gets the rows without a rope part: 1024 / 528 / 512 / 2048 B.
        device:    where the caches live.
        kv_scale:  the per-tensor fp32 scale of "fp8_raw" (required there, must be None otherwise).
        max_requests: kpool: live requests with a tail ring row (default 256).
        max_next_n:   kpool: the longest verify after which any draft count may be kept (truncate); the
                      ring keeps the last ``c + max_next_n - 1`` positions of a request (default 8).

    Caches start zeroed. ``allocator`` reserves pages per request; ``block_table`` / ``slots`` /
    ``index_slots`` turn them into the addresses the ops and writers take. With kpool, reserve through
    :meth:`reserve` (and :meth:`undo`, :meth:`truncate`, :meth:`free`), which also keep the tail ring.
    """

    def __init__(self, config: DSAConfig, num_pages: int, kv_format: str = "fp8",
                 device: torch.device | str = "cpu", kv_scale: float | None = None, *,
                 max_requests: int = 256, max_next_n: int = 8):
        if not isinstance(config, DSAConfig):
            _fail("config", "a DSAConfig", type(config).__name__)
        why = layouts.mla_rows_fit(config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim)
        if why is not None:
            raise ValueError(f"config: the cache layouts are fixed: expected {why}")
        if config.layer_types is not None:
            _fail("config", "the DSA layers alone (config.dsa_stack()): a pool holds DSA layers only",
                  f"layer_types {list(config.layer_types)}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            _fail("num_pages", "an int >= 1", repr(num_pages))
        if kv_format not in layouts.ALL_MLA_FORMATS:
            _fail("kv_format", f"one of {layouts.ALL_MLA_FORMATS}", repr(kv_format))
        if kv_format == "fp8_raw":
            if kv_scale is None or not (isinstance(kv_scale, (int, float)) and math.isfinite(kv_scale) and kv_scale > 0):
                _fail("kv_scale", "a finite float > 0 for kv_format 'fp8_raw'", kv_scale)
            kv_scale = float(kv_scale)
        elif kv_scale is not None:
            _fail("kv_scale", f"None for kv_format {kv_format!r} (only 'fp8_raw' has a per-tensor scale)", kv_scale)
        for name, v in (("max_requests", max_requests), ("max_next_n", max_next_n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(name, "an int >= 1", repr(v))

        self.config = config
        self.num_pages = num_pages
        self.kv_format = kv_format
        self.kv_scale = kv_scale
        self.device = torch.device(device)
        self.page_size = config.page_size
        self.kpool = config.index_kpool
        self.num_layers = config.num_hidden_layers
        self.mla_dim = layouts.MLA_LATENT + config.qk_rope_head_dim  # a row's dims: 576, or 512 for NoPE
        self.allocator = PageAllocator(num_pages, self.page_size, self.device)
        shape = (num_pages, self.page_size, layouts.mla_row_width(kv_format, config.qk_rope_head_dim))
        self.mla_caches: list[torch.Tensor] = [
            self._new_mla_cache(shape, _MLA_DTYPE[kv_format]) for _ in range(self.num_layers)]
        self.index_caches: dict[int, torch.Tensor] = {
            layer: torch.zeros(num_pages, layouts.INDEX_PAGE_BYTES, dtype=torch.uint8, device=self.device)
            for layer in config.topk_layers}
        self.exact_index_caches: dict = {}  # layer (or (layer, "gate")) -> store, made on first use
        # kpool's tail ring (module docstring): made on a layer's first pooled write, in the model dtype
        self.tail_requests = max_requests  # (OffloadKVPool's max_requests counts its buffers)
        self.tail_len = self.kpool + max_next_n - 1
        self.tail_rings: dict[int, torch.Tensor] = {}
        self._tails: dict[Hashable, list[int]] = {}  # req_id -> [ring row, 1 + the last position written]
        self._free_rows: list[int] = list(range(max_requests - 1, -1, -1))  # pop() gives the lowest row

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

    def exact_index_cache(self, layer: int, dtype: torch.dtype, gate: bool = False) -> torch.Tensor:
        """The layer's float key store ``[P * page_size, 128]`` of ``dtype`` for an exact-precision indexer,
        addressed by MLA slot; made (zeroed) on first use, or remade if ``dtype`` changed (the keys of the
        old dtype were written by an indexer that no longer runs). ``gate=True``: kpool's second store, every
        token's pooling gate (exact kpool pools at selection time). ValueError for a skip-top-k layer."""
        self.index_cache(layer)  # the same rule: only top-k layers keep indexer keys
        key = (layer, "gate") if gate else layer
        store = self.exact_index_caches.get(key)
        if store is None or store.dtype != dtype:
            store = torch.zeros(self.num_pages * self.page_size, layouts.INDEX_DIM, dtype=dtype, device=self.device)
            self.exact_index_caches[key] = store
        return store

    def tail_ring(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """kpool: the layer's tail ring ``[max_requests, tail_len, 2, 128]`` of ``dtype`` (module docstring);
        made on first use, or remade if ``dtype`` changed. ValueError without kpool or on a skip-top-k layer."""
        self.index_cache(layer)
        if self.kpool == 1:
            _fail("layer", "a pool with index_kpool > 1 (only kpool keeps a tail ring)", f"index_kpool {self.kpool}")
        ring = self.tail_rings.get(layer)
        if ring is None or ring.dtype != dtype:
            ring = torch.zeros(self.tail_requests, self.tail_len, 2, layouts.INDEX_DIM, dtype=dtype, device=self.device)
            self.tail_rings[layer] = ring
        return ring

    def write_tail(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                   gate: torch.Tensor) -> None:
        """kpool: store N tokens' keys ``k [N, 128]`` and gates ``gate [N, 128]`` (model dtype) at ring
        ``[rows[i], positions[i] % tail_len]``; the (row, slot) pairs must be distinct."""
        ring = self.tail_ring(layer, k.dtype)
        idx = (rows.long(), positions.long() % self.tail_len)
        ring[idx] = torch.stack((k, gate.to(k.dtype)), dim=1)

    def tail_rows(self, req_ids) -> list[int]:
        """kpool: the ring row of each request (given by :meth:`reserve`)."""
        return [self._tails[r][0] for r in req_ids]

    # ---- reservations (the allocator's, plus kpool's tail ring) ---------------------------------
    def reserve(self, new_tokens: dict[Hashable, int]) -> Reservation:
        """``allocator.reserve`` (all or nothing) and, with kpool, a ring row for every request of the batch.

        Also saves the ring rows a forward of these tokens could overwrite while the request's unfinished
        group still needs them (a write of more than ``tail_len - (seq_len % c)`` tokens), so that
        :meth:`undo` puts back the pool exactly. ValueError (nothing changed) when the rows run out.
        """
        if self.kpool == 1:
            return self.allocator.reserve(new_tokens)
        alloc, c, S = self.allocator, self.kpool, self.tail_len
        for r in [r for r in self._tails if r not in alloc]:  # requests freed through the allocator directly
            self._free_rows.append(self._tails.pop(r)[0])
        new = [r for r in new_tokens if r not in self._tails]
        if len(new) > len(self._free_rows):
            _fail("new_tokens", f"at most {len(self._free_rows)} new request(s): kpool keeps a tail ring row for "
                  f"each of at most max_requests = {self.tail_requests} live requests", f"{len(new)} new")
        steps = alloc.reserve(new_tokens)
        tails = []
        for r, n in new_tokens.items():
            fresh = r not in self._tails
            if fresh:
                self._tails[r] = [self._free_rows.pop(), 0]
            row, hi = self._tails[r]
            end = alloc.seq_len(r)
            start = end - n
            saved = None
            if start % c and end - start // c * c > S:  # the write wraps onto the unfinished group's tokens
                saved = {layer: ring[row].clone() for layer, ring in self.tail_rings.items()}
            tails.append((r, row, hi, fresh, saved))
            self._tails[r][1] = max(hi, end)
        return PoolReservation(steps.steps, tuple(tails))

    def undo(self, reservation: Reservation) -> None:
        """Take back a :meth:`reserve`: the allocator's pages and lengths, and kpool's rows and saved ring (what
        a later call reads is as before; :meth:`truncate` may keep fewer old positions than it did)."""
        self.allocator.undo(reservation)
        for r, row, hi, fresh, saved in reversed(getattr(reservation, "tails", ())):
            if fresh:
                del self._tails[r]
                self._free_rows.append(row)
            elif saved is not None:
                for layer, rows in saved.items():
                    self.tail_rings[layer][row] = rows
                self._tails[r][1] = hi
            # else the forward may have written the ring past the old length, over positions older than its
            # unfinished group (never over that group: nothing saved means no wrap onto it). Keeping the
            # higher mark counts those positions as lost, so truncate never relies on them.

    def truncate(self, req_id: Hashable, n_tokens: int) -> list[int]:
        """``allocator.truncate``; with kpool, ValueError (nothing changed) unless the tokens of the request's
        new unfinished group are still in its ring (the last ``tail_len`` positions it wrote)."""
        if (self.kpool > 1 and req_id in self._tails and isinstance(n_tokens, int)
                and 0 <= n_tokens <= self.allocator.seq_len(req_id)):  # else the allocator says what is wrong
            start = n_tokens // self.kpool * self.kpool
            hi = self._tails[req_id][1]
            if start < n_tokens and start < hi - self.tail_len:
                _fail("n_tokens", f"a length whose unfinished group starts at >= {hi - self.tail_len} (kpool keeps the "
                      f"raw keys of the last {self.tail_len} positions written: c + max_next_n - 1), or a multiple of "
                      f"index_kpool ({self.kpool})", n_tokens)
        return self.allocator.truncate(req_id, n_tokens)

    def free(self, req_id: Hashable) -> list[int]:
        """``allocator.free``, and the request's ring row back to kpool's free rows."""
        pages = self.allocator.free(req_id)
        if req_id in self._tails:
            self._free_rows.append(self._tails.pop(req_id)[0])
        return pages

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
            kv:            ``[N, mla_dim]`` float: 512 latent + 64 rope (NoPE: the 512 latent dims).
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
        if not (isinstance(kv, torch.Tensor) and kv.dim() == 2 and kv.shape[1] == self.mla_dim
                and kv.is_floating_point() and kv.shape[0] == slots.shape[0]):
            _fail("kv", f"a float tensor [{slots.shape[0]}, {self.mla_dim}] (one row per slot)",
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
        """Dequantised MLA rows: ``slots [N] -> [N, mla_dim] bf16`` (fp32 for the "fp32" format)."""
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
        ``kpool_tail`` (kpool's tail rings made so far: per request, not per token), ``total`` (ints, all
        layers), and per token of capacity ``mla_per_token``, ``index_per_token``, ``exact_index_per_token``,
        ``total_per_token`` (floats: the indexer costs 132 / c per token per top-k layer)."""
        row = layouts.mla_row_bytes(self.kv_format, self.config.qk_rope_head_dim)
        mla = self.num_layers * self.num_pages * self.page_size * row
        index = len(self.index_caches) * self.num_pages * layouts.INDEX_PAGE_BYTES
        exact = sum(t.numel() * t.element_size() for t in self.exact_index_caches.values())
        tail = sum(t.numel() * t.element_size() for t in self.tail_rings.values())
        total = mla + index + exact + tail
        tokens = self.num_pages * self.page_size
        return {"mla": mla, "index": index, "exact_index": exact, "kpool_tail": tail, "total": total,
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
