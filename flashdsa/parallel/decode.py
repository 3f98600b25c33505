"""Decode context parallelism (DCP, docs/DSA.md §8): the KV sharded over the ranks, partial attention merged.

Every rank runs every query row (the projections are replicated) but holds only its shard of each
request's KV, MLA rows and index keys alike (:class:`~flashdsa.parallel.split.KVShards`: position t on
rank ``(t // block) % p``), so KV memory per rank falls to ~1/p and so does the indexer's scan. Per layer:

    store     each rank writes the new tokens it owns
    select    local logits over its keys -> its exact top-k (scores and global positions)
              -> all-gather -> the exact top-k of the union -> the rank's own winners, as local slots
    attend    sparse MLA over its own winners -> partial (out, lse)
    combine   all-gather the partials -> merge_attention in rank order: every rank the same bits

Why the merge is exact: order keys by (score desc, position asc) — the order of ``topk_transform``, ties
to the smaller position. The global top-k restricted to rank r's keys is within rank r's own top-k (at
most k-1 keys of rank r precede any of them), so the union of the per-rank top-ks holds the global
top-k, and the same op over the union, in position order, picks it with the same ties. The logits are
the same numbers as one process's (each is one query-key dot product), so the selection is bitwise one
process's. The attention then differs from one process's only by the rounding of the partial outputs to
bf16 before the merge: at most ~3 ulp(bf16) of max |V| (tests/parallel derive it).

Skip-top-k layers reuse the localised slots as they are (every layer's caches share the page ids).
Extend (prefill and chunked prefill on a sharded prefix) runs the same way over the ragged keys; the
dense fallback is off. Bytes per rank per layer with an indexer, R query rows: top-k candidates
``(p-1) R k 8`` (fp32 score + int32 position) and partial attention ``(p-1) R h (2 * 512 + 4)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

from flashdsa import ops
from flashdsa.cache.allocator import PageAllocator, Reservation, slots_from_pages
from flashdsa.cache.metadata import DECODE, EXTEND, MODES, BatchMetadata
from flashdsa.layers.indexer import exact_logits_ragged
from flashdsa.parallel.base import Parallel, ParallelPlan
from flashdsa.parallel.comm import Comm, layout, pack_rows, unpack_rows
from flashdsa.parallel.split import KVShards


@dataclass(frozen=True)
class ShardedReservation:
    """What :meth:`ShardedAllocator.reserve` did: the local reservation and the global lengths before."""

    local: Reservation
    before: tuple[tuple[Hashable, int | None], ...]


class ShardedAllocator:
    """A rank's view of requests whose tokens are spread over the ranks.

    Lengths are global (``seq_len``, ``reserve``, ``truncate`` count every rank's tokens); the pages are
    this rank's (``local``, a :class:`PageAllocator`, holds ``shards.count(seq_len)`` tokens per request).
    All or nothing like the page allocator.
    """

    def __init__(self, local: PageAllocator, shards: KVShards):
        self.local, self.shards = local, shards
        self.page_size, self.device = local.page_size, local.device
        self._lens: dict[Hashable, int] = {}

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._lens

    def seq_len(self, req_id: Hashable) -> int:
        self.local.seq_len(req_id)  # ValueError naming req_id when it is not live
        return self._lens[req_id]

    def pages(self, req_id: Hashable) -> tuple[int, ...]:
        return self.local.pages(req_id)

    def block_table(self, req_ids, max_pages: int | None = None) -> torch.Tensor:
        return self.local.block_table(req_ids, max_pages)

    def reserve(self, new_tokens: dict[Hashable, int]) -> ShardedReservation:
        for r, n in new_tokens.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"new_tokens[{r!r}]: expected an int >= 0, got {n!r}")
        before = tuple((r, self._lens.get(r)) for r in new_tokens)
        count = self.shards.count
        local = self.local.reserve({r: count((b or 0) + new_tokens[r]) - count(b or 0) for r, b in before})
        for r, b in before:
            self._lens[r] = (b or 0) + new_tokens[r]
        return ShardedReservation(local, before)

    def undo(self, reservation: ShardedReservation) -> None:
        self.local.undo(reservation.local)
        for r, b in reservation.before:
            if b is None:
                del self._lens[r]
            else:
                self._lens[r] = b

    def truncate(self, req_id: Hashable, n_tokens: int) -> None:
        n = self.seq_len(req_id)
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 0 <= n_tokens <= n:
            raise ValueError(f"n_tokens: expected an int in [0, seq_len ({n})] for request {req_id!r}, "
                             f"got {n_tokens!r}")
        self.local.truncate(req_id, self.shards.count(n_tokens))
        self._lens[req_id] = n_tokens

    def free(self, req_id: Hashable) -> None:
        self.local.free(req_id)
        del self._lens[req_id]


class ShardedPlan(ParallelPlan):
    """One batch under DCP: ``store_rows [n] int64`` the query rows whose KV this rank stores, in the
    order of ``batch.slot_mapping``. With ``keep_positions`` set (checks), ``positions[layer]`` keeps each
    row's merged top-k as global positions ``[R, topk] int64`` (ascending, -1 padded)."""

    shards_kv = True

    def __init__(self, comm: Comm, shards: KVShards, store_rows: torch.Tensor):
        super().__init__(comm)
        self.shards, self.store_rows = shards, store_rows
        self.keep_positions = False  # off by default: 8 R k bytes a layer, 2 GiB at 128K rows x top-2048
        self.positions: dict[int, torch.Tensor] = {}

    def exchange(self, kv_rows: torch.Tensor, idx):
        keep = self.store_rows
        if idx is None:
            return kv_rows.index_select(0, keep), None
        k_scale = None if idx.k_scale is None else idx.k_scale.index_select(0, keep)
        return kv_rows.index_select(0, keep), idx._replace(k=idx.k.index_select(0, keep), k_scale=k_scale)

    def select(self, layer, idx, batch: BatchMetadata, pool) -> torch.Tensor:
        """The layer's top-k over the whole sharded KV, as this rank's slots: ``[R, topk] int32``, -1 where
        the winner lives on another rank (or for padding). Decode: slots of the local pages; extend: rows
        of the local gathered KV (``batch.kv_slots`` order)."""
        topk = layer.index_topk
        if batch.mode == EXTEND:
            pos, score = self._topk_ragged(layer, idx, batch, pool)
        else:
            logits = layer.score_paged(idx, batch, pool)
            pos = ops.topk_transform(logits, batch.context_lens.view(-1), topk, backend=batch.backend)
            score = logits.gather(1, pos.clamp(min=0).long())
        g = torch.where(pos >= 0, self.shards.to_global(pos.long()), -1)
        merged = self._merge(score, g, topk, batch.backend)
        if self.keep_positions:
            self.positions[layer.layer_id] = merged
        return self._localize(merged, batch, pool)

    def _topk_ragged(self, layer, idx, batch: BatchMetadata, pool) -> tuple[torch.Tensor, torch.Tensor]:
        """Local top-k of extend rows: row-relative local positions ``[R, k] int32`` and their logits."""
        lid, topk = layer.layer_id, layer.index_topk
        if idx.exact:
            keys = pool.exact_index_cache(lid, idx.k.dtype)[batch.kv_slots]
            score = lambda r0, r1: exact_logits_ragged(idx.q[r0:r1], keys, idx.weights[r0:r1],  # noqa: E731
                                                       batch.ks[r0:r1], batch.ke[r0:r1])
        else:
            k_fp8, k_scale = pool.read_index(lid, batch.kv_slots)
            score = lambda r0, r1: ops.indexer_logits_ragged(  # noqa: E731
                idx.q[r0:r1], k_fp8, k_scale, idx.weights[r0:r1], batch.ks[r0:r1], batch.ke[r0:r1],
                backend=batch.backend)
        R, N = idx.q.shape[0], batch.kv_slots.shape[0]
        pos = torch.full((R, topk), -1, dtype=torch.int32, device=idx.q.device)
        val = torch.full((R, topk), float("-inf"), dtype=torch.float32, device=idx.q.device)
        if N == 0:  # this rank holds no key of any request yet
            return pos, val
        step = max(1, batch.max_logits_bytes // (4 * N))  # rows whose [rows, N] logits fit the budget
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            logits = score(r0, r1)
            ks, lens = batch.ks[r0:r1], batch.ke[r0:r1] - batch.ks[r0:r1]
            p = ops.topk_transform(logits, lens, topk, row_starts=ks, backend=batch.backend)
            pos[r0:r1] = p
            # a row without local keys may start at N: clamp its (unused) column into the buffer
            col = (ks[:, None] + p.clamp(min=0)).long().clamp(max=N - 1)
            val[r0:r1] = torch.where(p >= 0, logits.gather(1, col), float("-inf"))
        return pos, val

    def _merge(self, score: torch.Tensor, g: torch.Tensor, topk: int, backend: str | None) -> torch.Tensor:
        mine = torch.stack((score.contiguous().view(torch.int32), g.to(torch.int32)), dim=-1)  # [R, k, 2]
        every = self.comm.all_gather(mine, "the top-k candidates")                               # [p, R, k, 2]
        self._received("topk_candidates", (self.comm.world - 1) * mine.numel() * mine.element_size())
        return merge_topk(every[..., 0].contiguous().view(torch.float32), every[..., 1].long(), topk, backend)

    def _localize(self, merged: torch.Tensor, batch: BatchMetadata, pool) -> torch.Tensor:
        own = (merged >= 0) & (self.shards.owner(merged) == self.shards.rank)
        i = torch.where(own, self.shards.local(merged), 0)
        if batch.mode == EXTEND:
            out = batch.ks[:, None].long() + i
        else:
            ps = pool.page_size
            table = batch.block_table.long().repeat_interleave(batch.context_lens.shape[1], dim=0)
            out = table.gather(1, i // ps) * ps + i % ps
        return torch.where(own, out, -1).to(torch.int32)

    def combine(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        # Merged in fp32 and in rank order on every rank, so every rank ends with the same bits.
        mine = pack_rows(out, lse)
        every = self.comm.all_gather(mine, "the partial attention outputs")
        self._received("partial_attention", (self.comm.world - 1) * mine.numel())
        parts = [unpack_rows(every[r], layout(out, lse)) for r in range(self.comm.world)]
        acc, acc_lse = parts[0][0].float(), parts[0][1]
        for o, l in parts[1:]:
            acc, acc_lse = ops.merge_attention(acc, acc_lse, o.float(), l)
        return acc.to(out.dtype)


def merge_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int, backend: str | None = None) -> torch.Tensor:
    """The exact top-k of the union of every rank's top-k (module docstring).

    Args:
        scores:    ``[p, R, k] float32`` each rank's candidates' logits.
        positions: ``[p, R, k] int64`` their global positions (distinct across ranks), -1 = no candidate.

    Returns ``[R, topk] int64``: global positions, ascending, -1 padded — what ``topk_transform`` returns
    for the whole row, ties to the smaller position.
    """
    p, R, k = scores.shape
    sc = scores.permute(1, 0, 2).reshape(R, p * k)
    gp = positions.permute(1, 0, 2).reshape(R, p * k)
    # the union in position order (none last), so topk_transform's "smaller position wins" is global
    order = torch.where(gp >= 0, gp, torch.iinfo(torch.int64).max).argsort(dim=1, stable=True)
    sc, gp = sc.gather(1, order).contiguous(), gp.gather(1, order)
    pick = ops.topk_transform(sc, (gp >= 0).sum(1).to(torch.int32), topk, backend=backend)
    return torch.where(pick >= 0, gp.gather(1, pick.clamp(min=0).long()), -1)


@dataclass(frozen=True)
class DecodeContextParallel(Parallel):
    """DCP over ``comm``'s ranks: each request's KV sharded in blocks of ``block`` tokens (module doc)."""

    block: int = 1
    shards_kv = True

    def __post_init__(self) -> None:
        KVShards(1, 0, self.block)  # ValueError naming block

    @property
    def shards(self) -> KVShards:
        return KVShards(self.world, self.rank, self.block)

    def allocator(self, local: PageAllocator) -> ShardedAllocator:
        return ShardedAllocator(local, self.shards)

    def build(self, alloc: ShardedAllocator, req_ids: list, counts: list[int], mode: str, *,
              max_pages: int | None = None, backend: str | None = None,
              max_logits_bytes: int = 1 << 30, kpool: None = None) -> BatchMetadata:
        """The batch's metadata on this rank, its tokens already reserved in ``alloc`` (``Runner.prepare``).
        ``kpool`` is None: the runner refuses kpool with DCP."""
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        next_n = counts[0] if counts else 1
        if mode != EXTEND and (next_n < 1 or (mode == DECODE and next_n != 1) or len(set(counts)) > 1):
            raise ValueError(f"new_tokens: {mode} needs the same count >= 1 per request (1 for decode), got {counts}")
        sh, ps, dev = alloc.shards, alloc.page_size, alloc.device
        seq = [alloc.seq_len(r) for r in req_ids]
        positions = torch.cat([torch.arange(s - n, s, dtype=torch.int64) for s, n in zip(seq, counts)]
                              + [torch.zeros(0, dtype=torch.int64)])
        own = (sh.owner(positions) == sh.rank).nonzero().squeeze(1)
        slot_mapping = torch.cat([slots_from_pages(alloc.pages(r), sh.count(s - n), sh.count(s), ps)
                                  for r, s, n in zip(req_ids, seq, counts)] + [torch.zeros(0, dtype=torch.int64)])
        seen = sh.counts(positions + 1)  # this rank's keys each row may see
        block_table = alloc.block_table(req_ids, max_pages)
        plan = ShardedPlan(self.comm, sh, own.to(dev))
        common = dict(req_ids=list(req_ids), positions=positions.to(dev), slot_mapping=slot_mapping.to(dev),
                      block_table=block_table, backend=backend, parallel=plan)
        if mode != EXTEND:
            return BatchMetadata(mode=mode, next_n=next_n, context_lens=seen.view(-1, next_n).to(torch.int32).to(dev),
                                 max_context_len=block_table.shape[1] * ps, **common)
        kv_lens = [sh.count(s) for s in seq]
        offsets = torch.tensor([0] + kv_lens, dtype=torch.int64).cumsum(0)
        ks = torch.repeat_interleave(offsets[:-1], torch.tensor(counts, dtype=torch.int64))
        kv_slots = torch.cat([slots_from_pages(alloc.pages(r), 0, n, ps) for r, n in zip(req_ids, kv_lens)]
                             + [torch.zeros(0, dtype=torch.int64)])
        cu_q = torch.tensor([0] + list(counts), dtype=torch.int64).cumsum(0).to(torch.int32)
        return BatchMetadata(mode=EXTEND, cu_seqlens_q=cu_q.to(dev), cu_seqlens_kv=offsets.to(torch.int32).to(dev),
                             kv_slots=kv_slots.to(dev), ks=ks.to(torch.int32).to(dev),
                             ke=(ks + seen).to(torch.int32).to(dev), use_dense=False,
                             max_logits_bytes=max_logits_bytes, **common)

