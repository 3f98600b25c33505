"""Host offload of the MLA cache ("HiSparse", docs/DSA.md §8): every token's MLA row lives in host memory,
the device keeps per request and layer a small buffer of the rows sparse MLA reads this step.

Where the bytes are (L layers, S = pool slots, R request buffers of N rows each)::

    host    mla_caches[l]   [P, page_size, width]   the pool's format (bf16 / fp8 656 / fp8_raw), pinned when
                                                   CUDA; addressed by pool slot exactly as KVPool's
    device  index caches    unchanged (the indexer scores every key every step)
            buffers[l]      [R * N, width]          request b owns rows b N .. b N + N - 1 (N >= index_topk)
            ResidentMap     row_of_slot [L, S + 1] int32, slot_of_row / last_used [L, R N + 1]

A decode / verify step, per layer, after its top-k (:meth:`OffloadKVPool.mla_for_attention`)::

    1. per request: the union of its next_n rows' selected slots, deduplicated
    2. hits (resident slots) get this step's LRU stamp, so nothing below can evict them
    3. misses go to the request's empty rows first, then to its least recently used ones
    4. copy: host rows of the misses -> pinned staging -> device rows, on a side stream on CUDA;
       the attention's stream waits for it
    5. translate the selection from pool slots to device rows: what sparse_mla_decode reads

The layer hands the POOL slots on to a skip-top-k layer, which translates them through its own buffer.

Writes quantise on the device and land on the host (through pinned memory, flushed before the next host
read of the layer); any device copy of a written slot is dropped first, so no row can serve bytes older
than the host's (a slot rewritten after an undone forward, a page another request reused). Extend reads
its gathered KV from the host. ``free`` drops the request's rows and buffer, ``truncate`` the rows of the
dropped tokens.

Bitwise the same as the on-device pool: rows are copied byte for byte and sparse MLA reads the same bytes
in the same order. Turned off with offload: the dense fallback (docs/DSA.md §6: the Runner sets dense_threshold
0) and CUDA-graph capture (each layer's swap-in needs a host sync: the host gathers the rows to copy).
The swap-in sits between a layer's top-k and its attention, and the next layer's indexer needs this
layer's output, so there is nothing to overlap it with inside one step; the side stream keeps it off the
compute stream's queue, ordered by stream waits both ways. A copy kernel that reads pinned host memory from the
device (zero-copy, SGLang's swap-in kernel) would remove the per-layer sync; not built.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

from flashdsa.cache import layouts
from flashdsa.cache.allocator import slots_from_pages
from flashdsa.cache.metadata import EXTEND, BatchMetadata
from flashdsa.cache.pool import KVPool
from flashdsa.config import DSAConfig


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class OffloadConfig:
    """Host offload of the MLA cache.

    Args:
        device_buffer: device rows per request and layer, a multiple of 64 and >= the tokens a query row selects
                       (``index_topk``, plus ``index_kpool - 1`` with kpool), at most the pool's tokens; None
                       means twice the tokens a row selects. A step's selection must fit: decode needs
                       ``min(index_topk, context)`` rows, MTP verify with next_n rows per request up to ``next_n
                       * index_topk`` (a batch that might not fit is refused before any row moves). Rows beyond
                       the selection keep recently used tokens, so the next step swaps fewer in.
        max_requests:  requests holding a device buffer at once (the buffers are allocated up front:
                       ``max_requests * device_buffer * layers * row bytes`` on the device).

    ``max_requests * device_buffer`` must stay below 2**31: the resident map and the translated selections
    address the device rows as int32.
    """

    device_buffer: int | None = None
    max_requests: int = 16

    def __post_init__(self):
        b = self.device_buffer
        if b is not None and not (_is_int(b) and b >= layouts.PAGE_SIZE and b % layouts.PAGE_SIZE == 0):
            _fail("device_buffer", f"None or a multiple of {layouts.PAGE_SIZE} (>= {layouts.PAGE_SIZE})", repr(b))
        if not (_is_int(self.max_requests) and self.max_requests >= 1):
            _fail("max_requests", "an int >= 1", repr(self.max_requests))
        if b is not None and b * self.max_requests >= 2 ** 31:
            _fail("device_buffer", f"max_requests ({self.max_requests}) x device_buffer < 2**31 (the device rows are "
                  f"addressed as int32)", repr(b))

    def rows(self, index_topk: int, kpool: int = 1, capacity: int | None = None) -> int:
        """Device rows per request and layer for a model selecting ``index_topk`` tokens (plus ``kpool - 1``, the
        unfinished tail group, with kpool), in a pool of ``capacity`` tokens (None: unchecked)."""
        selected = index_topk + kpool - 1
        n = 2 * selected if self.device_buffer is None else self.device_buffer
        n = -(-n // layouts.PAGE_SIZE) * layouts.PAGE_SIZE
        if n < selected:
            what = f"index_topk ({index_topk})" if kpool == 1 else \
                f"index_topk + index_kpool - 1 ({index_topk} + {kpool} - 1 = {selected})"
            _fail("device_buffer", f">= {what}, the tokens one query row selects: one step's selection must fit", n)
        # a request never holds more tokens than the pool, so rows past that would never be filled
        if capacity is not None and self.device_buffer is not None and n > capacity:
            _fail("device_buffer", f"<= {capacity}, the pool's tokens (no request can hold more)", n)
        return n


class ResidentMap:
    """Which pool slot each device row holds, per layer, with LRU stamps; request buffers of ``rows`` rows.

    Args:
        num_layers: L.   num_slots: S, the pool's slots.   num_buffers: R.   rows: N per buffer.

    Tensors on ``device`` (the lookups and updates run where the selection is, without a host round trip)::

        row_of_slot [L, S + 1]     int32  device row holding slot s, -1 if none; entry S stays -1 (masked lookups)
        slot_of_row [L, R N + 1]   int32  slot held by row r, -1 if empty; entry R N is a sink for masked writes
        last_used   [L, R N + 1]   int64  the layer's step count when r was last selected; -1 when empty

    Invariant (:meth:`check`): ``slot_of_row[l, r] == s >= 0`` exactly when ``row_of_slot[l, s] == r``, and
    every resident row lies in the buffer of a live request.
    """

    def __init__(self, num_layers: int, num_slots: int, num_buffers: int, rows: int,
                 device: torch.device | str = "cpu"):
        for name, v in (("num_layers", num_layers), ("num_slots", num_slots), ("num_buffers", num_buffers),
                        ("rows", rows)):
            if not (_is_int(v) and v >= 1):
                _fail(name, "an int >= 1", repr(v))
        self.num_layers, self.num_slots, self.num_buffers, self.rows = num_layers, num_slots, num_buffers, rows
        self.device = torch.device(device)
        self.sink = num_buffers * rows
        self.row_of_slot = torch.full((num_layers, num_slots + 1), -1, dtype=torch.int32, device=self.device)
        self.slot_of_row = torch.full((num_layers, self.sink + 1), -1, dtype=torch.int32, device=self.device)
        self.last_used = torch.full((num_layers, self.sink + 1), -1, dtype=torch.int64, device=self.device)
        self._steps = [0] * num_layers
        self._buffer: dict[Hashable, int] = {}
        self._free: deque[int] = deque(range(num_buffers))

    # ---- request buffers ---------------------------------------------------------------------------
    def buffer(self, req_id: Hashable) -> int | None:
        """The request's buffer id (rows ``id * rows .. id * rows + rows - 1``), None if it holds none."""
        return self._buffer.get(req_id)

    @property
    def num_free_buffers(self) -> int:
        return len(self._free)

    def acquire(self, req_ids: Iterable[Hashable]) -> None:
        """A buffer for every request that holds none yet; all or nothing (ValueError if too few are free)."""
        new = [r for r in dict.fromkeys(req_ids) if r not in self._buffer]
        if len(new) > len(self._free):
            raise ValueError(f"max_requests: expected a free device buffer for each of {len(new)} new request(s), "
                             f"got {len(self._free)} of {self.num_buffers} free (each live request that decoded "
                             f"holds one until it is freed); raise OffloadConfig.max_requests")
        for r in new:
            self._buffer[r] = self._free.popleft()

    def release(self, req_id: Hashable) -> None:
        """Empty the request's rows in every layer and give its buffer back; nothing if it holds none."""
        b = self._buffer.pop(req_id, None)
        if b is None:
            return
        rows = slice(b * self.rows, (b + 1) * self.rows)
        held = self.slot_of_row[:, rows].long()
        self.row_of_slot.scatter_(1, torch.where(held >= 0, held, self.num_slots), -1)
        self.slot_of_row[:, rows] = -1
        self.last_used[:, rows] = -1
        self._free.append(b)

    def drop(self, slots: torch.Tensor, layer: int | None = None) -> None:
        """Forget the device copies of ``slots [M] int`` (all layers, or one): their rows become empty."""
        if slots.numel() == 0:
            return
        ls = slice(None) if layer is None else slice(layer, layer + 1)
        s = slots.reshape(-1).to(self.device, torch.int64)
        r = self.row_of_slot[ls][:, s].long()
        r = torch.where(r >= 0, r, self.sink)
        self.slot_of_row[ls].scatter_(1, r, -1)  # basic slices are views: in place
        self.last_used[ls].scatter_(1, r, -1)
        self.row_of_slot[ls, s] = -1

    # ---- one layer's step ------------------------------------------------------------------------
    def swap_in(self, layer: int, sel: torch.Tensor, buffers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Make every slot selected by each request resident in its buffer; returns what to copy.

        Args:
            sel:     ``[B, m] int`` pool slots each request selected this step (-1 = none; repeats allowed).
            buffers: ``[B] int64`` the requests' buffer ids, distinct.

        Returns ``(rows [M] int64, slots [M] int64)``: the host rows of ``slots`` go to the device ``rows``
        (request-major). Selected rows that were resident stay where they are. ValueError, with nothing
        changed, if a request selects more distinct slots than its buffer holds.
        """
        S, N = self.num_slots, self.rows
        s = torch.sort(torch.where(sel >= 0, sel.long(), S), dim=1).values
        uniq = s < S
        uniq[:, 1:] &= s[:, 1:] != s[:, :-1]
        row = self.row_of_slot[layer][s].long()
        hit, miss = uniq & (row >= 0), uniq & (row < 0)
        need = miss.sum(1)
        most, k = torch.stack([uniq.sum(1).max(), need.max()]).tolist()
        if most > N:
            raise ValueError(f"device_buffer: a request selects {most} distinct tokens in one step but its device "
                             f"buffer holds {N} rows; raise OffloadConfig.device_buffer")
        self._steps[layer] += 1
        now = self._steps[layer]
        last = self.last_used[layer]
        last[torch.where(hit, row, self.sink)] = now
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        if k == 0:
            return empty, empty
        # Oldest stamp first (empty rows are -1), ties by row; rows stamped `now` (hits) come last and
        # need <= N - hits keeps them out of the first `need` picks.
        buffers = buffers.long()
        order = last[: self.sink].view(self.num_buffers, N)[buffers] * N + torch.arange(N, device=self.device)
        pick = torch.topk(order, k, dim=1, largest=False, sorted=True).indices
        take = torch.arange(k, device=self.device) < need[:, None]
        rows = (pick + buffers[:, None] * N)[take]
        slots = torch.sort(torch.where(miss, s, S), dim=1).values[:, :k][take]
        old = self.slot_of_row[layer][rows].long()
        self.row_of_slot[layer][torch.where(old >= 0, old, S)] = -1
        self.slot_of_row[layer][rows] = slots.int()
        self.row_of_slot[layer][slots] = rows.int()
        last[rows] = now
        return rows, slots

    def translate(self, layer: int, sel: torch.Tensor) -> torch.Tensor:
        """Pool slots -> device rows of the layer's buffers: ``sel [...] int`` -> ``[...] int32``, -1 kept."""
        return self.row_of_slot[layer][torch.where(sel >= 0, sel.long(), self.num_slots)]

    # ---- checks and accounting ---------------------------------------------------------------------
    def check(self) -> None:
        """Assert the invariant of the class docstring (tests; reads the tensors on the host)."""
        ros, sor = self.row_of_slot.cpu(), self.slot_of_row.cpu()
        assert (ros[:, -1] == -1).all(), "the lookup sink holds a row"
        owned = torch.zeros(self.sink, dtype=torch.bool)
        for b in self._buffer.values():
            owned[b * self.rows:(b + 1) * self.rows] = True
        for layer in range(self.num_layers):
            rows = (sor[layer, :-1] >= 0).nonzero().flatten()
            slots = sor[layer, rows].long()
            assert torch.equal(ros[layer, slots].long(), rows), f"layer {layer}: slot_of_row and row_of_slot disagree"
            assert int((ros[layer, :-1] >= 0).sum()) == rows.numel(), f"layer {layer}: a slot maps to an empty row"
            assert owned[rows].all(), f"layer {layer}: a resident row outside every live request's buffer"

    def resident_rows(self, layer: int | None = None) -> int:
        """Rows holding a slot (one layer or all)."""
        sor = self.slot_of_row[:, :-1] if layer is None else self.slot_of_row[layer, :-1]
        return int((sor >= 0).sum())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.row_of_slot, self.slot_of_row, self.last_used))


class OffloadKVPool(KVPool):
    """A :class:`KVPool` whose MLA rows live in host memory, with per-request device buffers (module docstring).

    Args: as :class:`KVPool`, plus ``offload`` (:class:`OffloadConfig`, default ``OffloadConfig()``).

    ``mla_caches`` are the host caches (pinned when ``device`` is CUDA); ``buffers[l]`` ``[R * N, width]`` the
    device rows, ``resident`` the :class:`ResidentMap`. ``stats[mode]`` counts ``steps`` and swapped-in
    ``rows`` (all layers and requests) per forward mode.
    """

    def __init__(self, config: DSAConfig, num_pages: int, kv_format: str = "fp8",
                 device: torch.device | str = "cpu", kv_scale: float | None = None,
                 offload: OffloadConfig | None = None, **kpool):
        offload = OffloadConfig() if offload is None else offload
        if not isinstance(offload, OffloadConfig):
            _fail("offload", "an OffloadConfig or None", type(offload).__name__)
        if isinstance(config, DSAConfig) and _is_int(num_pages):  # checked before the host caches are made
            offload.rows(config.index_topk, config.index_kpool, num_pages * config.page_size)
        # Pinned host memory makes the copies DMA transfers; without CUDA there is nothing to pin.
        self._pinned = torch.device(device).type == "cuda"
        super().__init__(config, num_pages, kv_format, device, kv_scale, **kpool)
        self.offload = offload
        # a row selects index_topk tokens, plus the tail group's c - 1 with kpool
        self.buffer_rows = n = offload.rows(config.index_topk, config.index_kpool)
        self.max_requests = r = offload.max_requests
        width, dtype = self.mla_caches[0].shape[-1], self.mla_caches[0].dtype
        self.buffers: list[torch.Tensor] = [torch.zeros(r * n, width, dtype=dtype, device=self.device)
                                            for _ in range(self.num_layers)]
        self.resident = ResidentMap(self.num_layers, num_pages * self.page_size, r, n, self.device)
        self.stats: dict[str, dict[str, int]] = {}
        # Host writes made on the device wait here until the layer's host rows are read (one sync instead of two).
        self._pending: list[list[tuple]] = [[] for _ in range(self.num_layers)]
        self._staging: torch.Tensor | None = None
        self._copy_stream = torch.cuda.Stream(self.device) if self._pinned else None
        self._staging_free = torch.cuda.Event() if self._pinned else None
        self._batch: BatchMetadata | None = None
        self._batch_buffers: torch.Tensor | None = None

    # ---- the hook the layer calls -----------------------------------------------------------------
    def mla_for_attention(self, layer: int, sel: torch.Tensor,
                          batch: BatchMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Swap the rows ``sel [B * n, topk] int32`` (pool slots, -1 = none) selects into the requests' device
        buffers and return ``(pages [R * N / 64, 64, width], rows [B * n, topk] int32)``: the layer's buffers as
        64-token pages and the selection as their rows (-1 kept).

        ValueError, before any row moves, inside CUDA-graph capture, for an extend batch, or for a batch that
        might not fit: a request's rows may select up to ``min(next_n * topk, seq_len)`` distinct tokens.
        """
        if self._pinned and torch.cuda.is_current_stream_capturing():
            raise ValueError("offload: the swap-in syncs with the host every layer and cannot be captured in a "
                             "CUDA graph; run decode eagerly with host offload")
        if batch.mode == EXTEND:
            _fail("batch", "a decode / verify batch (extend reads its gathered KV with read())", batch.mode)
        layer = self._check_layer(layer)
        B, n = batch.context_lens.shape
        buffers = self._buffers_for(batch, sel.shape[-1])
        rows, slots = self.resident.swap_in(layer, sel.view(B, -1), buffers)
        if rows.numel():
            self._copy_in(layer, slots, rows)
        self.stats[batch.mode]["rows"] += rows.numel()
        pages = self.buffers[layer].view(-1, layouts.PAGE_SIZE, self.buffers[layer].shape[-1])
        return pages, self.resident.translate(layer, sel)

    def _buffers_for(self, batch: BatchMetadata, topk: int) -> torch.Tensor:
        """``[B] int64`` buffer ids of the batch's requests, acquired at the batch's first layer."""
        if batch is self._batch:
            return self._batch_buffers
        n = batch.next_n
        for r in batch.req_ids:
            most = min(n * topk, self.allocator.seq_len(r))
            if most > self.buffer_rows:
                _fail("device_buffer", f">= {most} rows: request {r!r} has {self.allocator.seq_len(r)} tokens and "
                      f"{n} row(s) selecting up to {topk} each this step",
                      f"{self.buffer_rows} (raise OffloadConfig.device_buffer)")
        self.resident.acquire(batch.req_ids)
        ids = [self.resident.buffer(r) for r in batch.req_ids]
        self._batch, self._batch_buffers = batch, torch.tensor(ids, dtype=torch.int64).to(self.device)
        self.stats.setdefault(batch.mode, {"steps": 0, "rows": 0})["steps"] += 1
        return self._batch_buffers

    # ---- copies -----------------------------------------------------------------------------------
    def _copy_in(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Host rows of ``slots [M]`` into the device rows ``rows [M]`` of the layer's buffers."""
        staged = self._host_rows(layer, slots.cpu())
        buf = self.buffers[layer]
        if self._copy_stream is None:
            buf[rows] = staged
            return
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_stream(main)  # `rows` is made on main; earlier reads of these rows are done
            buf[rows] = staged.to(self.device, non_blocking=True)
            self._staging_free.record()
        rows.record_stream(self._copy_stream)
        main.wait_stream(self._copy_stream)  # the attention reads the rows after the copy

    def _host_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``[M, width]`` host rows of ``slots [M] int64`` (CPU), in pinned staging on CUDA (valid until the
        next call: the copy out of it records ``_staging_free``)."""
        self._flush(layer)
        host = self.mla_caches[layer].view(-1, self.mla_caches[layer].shape[-1])
        if not self._pinned:
            return host.index_select(0, slots)
        self._staging_free.synchronize()  # the previous copy out of the staging buffer is done
        m = slots.numel()
        if self._staging is None or self._staging.shape[0] < m:
            self._staging = torch.empty(max(m, 2 * (0 if self._staging is None else self._staging.shape[0])),
                                        host.shape[1], dtype=host.dtype, pin_memory=True)
        out = self._staging[:m]
        torch.index_select(host, 0, slots, out=out)
        return out

    def _store_mla(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        rows = layouts.encode_mla(kv, self.kv_format, self.kv_scale)
        self.resident.drop(slots, layer)  # a device copy of an older value must never be read again
        if self._pinned:  # to pinned host memory without waiting; _flush scatters it into the cache
            self._flush(layer)  # an earlier write still pending (bulk writes): at most one in flight per layer
            done = torch.cuda.Event()
            self._pending[layer].append((slots.to("cpu", non_blocking=True, copy=True),
                                         rows.to("cpu", non_blocking=True, copy=True), done))
            done.record()
        else:
            self._pending[layer].append((slots, rows, None))
            self._flush(layer)

    def _flush(self, layer: int) -> None:
        host = self.mla_caches[layer].view(-1, self.mla_caches[layer].shape[-1])
        for slots, rows, done in self._pending[layer]:
            if done is not None:
                done.synchronize()
            host[slots.long()] = rows
        self._pending[layer].clear()

    def _gather_mla(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        staged = self._host_rows(layer, slots.to("cpu", torch.int64))
        if not self._pinned:
            return layouts.decode_mla(staged, self.kv_scale)
        rows = staged.to(self.device, non_blocking=True)
        self._staging_free.record()
        return layouts.decode_mla(rows, self.kv_scale)

    def _new_mla_cache(self, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=self._pinned)

    def mla_cache(self, layer: int) -> torch.Tensor:
        """The layer's HOST MLA cache ``[P, page_size, width]``, with every write made so far."""
        cache = super().mla_cache(layer)
        self._flush(layer)
        return cache

    # ---- request ends -----------------------------------------------------------------------------
    def free(self, req_id: Hashable) -> list[int]:
        """Release the request: its pages (``allocator.free``), then its device rows and buffer."""
        pages = super().free(req_id)  # with kpool also its tail ring row
        self.resident.release(req_id)
        self._batch = None  # its buffer ids may be handed to another request
        return pages

    def truncate(self, req_id: Hashable, n_tokens: int) -> list[int]:
        """Keep the request's first ``n_tokens`` (``allocator.truncate``) and drop the device rows of the rest."""
        pages, old = self.allocator.pages(req_id), self.allocator.seq_len(req_id)
        dropped = super().truncate(req_id, n_tokens)  # checks n_tokens (and kpool's ring) before changing anything
        self.resident.drop(slots_from_pages(pages, n_tokens, old, self.page_size))
        return dropped

    # ---- memory -----------------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, float]:
        """:meth:`KVPool.memory_bytes` (``mla`` is now on the host) plus ``device_buffers``, ``resident_map``,
        ``device`` (indexer caches + float key stores + buffers + map) and ``host`` (the MLA caches);
        ``total`` and ``total_per_token`` count both."""
        m = super().memory_bytes()
        buffers = sum(b.numel() * b.element_size() for b in self.buffers)
        rmap = self.resident.nbytes()
        m.update(device_buffers=buffers, resident_map=rmap, host=m["mla"],
                 device=m["index"] + m["exact_index"] + m["kpool_tail"] + buffers + rmap)
        m["total"] = m["device"] + m["host"]
        m["total_per_token"] = m["total"] / self.capacity_tokens
        return m

    def __repr__(self) -> str:
        m = self.memory_bytes()
        return (f"OffloadKVPool({self.num_pages} pages x {self.page_size} tokens, {self.kv_format}, "
                f"{self.num_layers} layers; host {m['host'] / 2**20:.1f} MiB, device {m['device'] / 2**20:.1f} MiB "
                f"({self.max_requests} buffers x {self.buffer_rows} rows), {self.device})")
