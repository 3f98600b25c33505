"""Per-batch metadata: what the paged caches hold for one batch, built once on the host from the page
allocator and shared by every layer of the forward pass.

Vocabulary as in the serving engines: ``positions`` (absolute position of each new token),
``slot_mapping`` (where its KV goes), ``block_table`` (pages of each request), ``cu_seqlens_q`` /
``cu_seqlens_kv``, ``context_lens`` (per query row: how many keys it may see).

It lives next to the caches it describes: the layer (``layers.attention``) reads it, the engine builds
it (``Runner.prepare``), and neither needs the other to do so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashdsa.cache.allocator import PageAllocator, slots_from_pages

if TYPE_CHECKING:  # the plans live above the caches (flashdsa.parallel imports this module)
    from flashdsa.parallel.base import ParallelPlan

EXTEND, DECODE, TARGET_VERIFY, DRAFT_EXTEND = "extend", "decode", "target_verify", "draft_extend"
MODES = (EXTEND, DECODE, TARGET_VERIFY, DRAFT_EXTEND)


@dataclass
class BatchMetadata:
    """Everything a layer needs besides its own weights and caches.

    Common:  ``positions [T] int64``, ``slot_mapping [T] int64``, ``block_table [B, maxp] int32``.
    extend:  ``cu_seqlens_q / cu_seqlens_kv [B + 1] int32``; ``kv_slots [N] int64`` (every request's whole
             KV, concatenated, for the gather); ``ks, ke [T] int32`` each query's key range in that
             gathered buffer; ``use_dense`` (the fallback of docs/DSA.md §6); ``bounds_host [2, T] int32`` ks and
             ke on the host as :func:`build_extend` made them, handed to ``indexer_topk_ragged`` so that it reads
             nothing back (None: it reads ks / ke; whoever replaces ks / ke replaces or drops it).
    decode / target_verify / draft_extend: ``next_n`` rows per request; ``context_lens [B, next_n] int32``
             with ``context_lens[b, j] = seq_len[b] - next_n + j + 1``; ``max_context_len`` (the width of
             the logits; fixed to the block table's capacity under CUDA graphs).
    How to run: ``backend`` of the ops ("torch" / "triton", None = per device); ``max_logits_bytes`` the
             largest indexer-logits buffer one prefill chunk of query rows may use.
    Several ranks: ``parallel`` the batch's plan (``flashdsa.parallel``; None = one process), which the
             layer calls around its store and attention. Prefill CP: ``positions``, ``ks``, ``ke``,
             ``cu_seqlens_q`` are this rank's query rows, ``slot_mapping`` every new token's (each rank
             writes the whole sequence). DCP: every rank runs every query row and its caches hold its
             shard of the KV: ``slot_mapping`` (its own new tokens), ``block_table``, ``kv_slots``,
             ``ks / ke`` and ``context_lens`` address that shard.
    Exact-precision top-k (``Indexer(precision="exact")``): ``index_columns [B, W] int64`` or None — HF's
             row layout, for HF's ``torch.topk`` ties (``flashdsa.hf`` sets it): the position each of the
             W columns of HF's forward holds, -1 for padding. None: ties go to the smaller position.
    kpool (``kpool`` = c > 1, :func:`add_kpool`): ``kpool_rows [T] int64`` each token's tail ring row,
             ``kpool_first [T] int64`` the batch index of its request's first new token, ``kpool_anchors
             [G] int64`` the tokens that pool their group (the last new token of every group touched),
             ``kpool_tail_tokens [K] int64`` the tokens whose raw keys go to the ring (the last
             ``tail_len`` of each request). extend also: ``kpool_slots [M] int64`` the index slots of every
             request's complete groups, concatenated (the pooled keys the rows score), and ``kpool_ks,
             kpool_ke [T] int32`` each row's range in them (``ke - ks = (position + 1) // c``). Decode
             derives its pooled lengths from ``context_lens // c``; all its kpool fields stay the same
             from step to step of one batch (CUDA graphs need not refresh them), and
             ``kpool_every_token`` says every new token is an anchor and goes to the ring (no gathers).
    """

    mode: str
    req_ids: list
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    next_n: int = 1
    context_lens: torch.Tensor | None = None
    max_context_len: int = 0
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    kv_slots: torch.Tensor | None = None
    ks: torch.Tensor | None = None
    ke: torch.Tensor | None = None
    bounds_host: torch.Tensor | None = None
    use_dense: bool = False
    backend: str | None = None
    max_logits_bytes: int = 1 << 30
    parallel: ParallelPlan | None = None
    kpool: int = 1
    kpool_rows: torch.Tensor | None = None
    kpool_first: torch.Tensor | None = None
    kpool_anchors: torch.Tensor | None = None
    kpool_tail_tokens: torch.Tensor | None = None
    kpool_slots: torch.Tensor | None = None
    kpool_ks: torch.Tensor | None = None
    kpool_ke: torch.Tensor | None = None
    kpool_every_token: bool = False
    index_columns: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def build_extend(alloc: PageAllocator, req_ids: list, q_lens: list[int], *, dense_threshold: int,
                 dense_allowed: bool = True, max_dense_tokens: int = 1 << 16, backend: str | None = None,
                 max_logits_bytes: int = 1 << 30) -> BatchMetadata:
    """Metadata for an extend (prefill chunk) whose tokens are already reserved in ``alloc``.

    Request b's new tokens are the LAST ``q_lens[b]`` of its ``alloc.seq_len``. Dense fallback when every
    request's kv length <= ``dense_threshold``, the gathered KV fits ``max_dense_tokens`` and the caller
    allows it (bf16/fp8 cache, no CP, no offload). ``backend``, ``max_logits_bytes``: as in
    :class:`BatchMetadata`.
    """
    dev = alloc.device
    kv_lens = [alloc.seq_len(r) for r in req_ids]
    positions, slot_mapping, kv_slots, ks, ke = [], [], [], [], []
    offset = 0
    for r, q_len, kv_len in zip(req_ids, q_lens, kv_lens):
        if not 0 <= q_len <= kv_len:
            raise ValueError(f"q_lens: expected 0 <= q_len <= seq_len ({kv_len}) for request {r!r}, got {q_len}")
        pos = torch.arange(kv_len - q_len, kv_len, dtype=torch.int64)
        positions.append(pos)
        pages = alloc.pages(r)
        slot_mapping.append(slots_from_pages(pages, kv_len - q_len, kv_len, alloc.page_size))
        kv_slots.append(slots_from_pages(pages, 0, kv_len, alloc.page_size))
        ks.append(torch.full((q_len,), offset, dtype=torch.int32))
        ke.append((offset + pos + 1).to(torch.int32))
        offset += kv_len
    bounds = torch.stack((torch.cat(ks), torch.cat(ke)))
    cu_q = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_kv = torch.tensor([0] + kv_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    use_dense = dense_allowed and max(kv_lens, default=0) <= dense_threshold and offset <= max_dense_tokens
    return BatchMetadata(
        mode=EXTEND, req_ids=list(req_ids), positions=torch.cat(positions).to(dev),
        slot_mapping=torch.cat(slot_mapping).to(dev), block_table=alloc.block_table(req_ids),
        cu_seqlens_q=cu_q.to(dev), cu_seqlens_kv=cu_kv.to(dev), kv_slots=torch.cat(kv_slots).to(dev),
        ks=bounds[0].to(dev), ke=bounds[1].to(dev), bounds_host=bounds, use_dense=use_dense, backend=backend,
        max_logits_bytes=max_logits_bytes)


def build_decode(alloc: PageAllocator, req_ids: list, next_n: int = 1, mode: str = DECODE,
                 max_pages: int | None = None, backend: str | None = None) -> BatchMetadata:
    """Metadata for decode (next_n = 1) or target_verify / draft_extend (next_n tokens per request),
    whose ``next_n`` new tokens per request are already reserved in ``alloc``.

    Row (b, j) — token j of request b — sits at position ``seq_len - next_n + j`` and sees keys
    ``0 .. seq_len - next_n + j``: ``context_lens[b, j] = seq_len - next_n + j + 1``. ``backend``: as in
    :class:`BatchMetadata`.
    """
    if mode not in (DECODE, TARGET_VERIFY, DRAFT_EXTEND):
        raise ValueError(f"mode: expected decode, target_verify or draft_extend, got {mode!r}")
    if next_n < 1 or (mode == DECODE and next_n != 1):
        raise ValueError(f"next_n: expected 1 for decode and >= 1 otherwise, got {next_n}")
    dev = alloc.device
    seq = torch.tensor([alloc.seq_len(r) for r in req_ids], dtype=torch.int64)
    if (seq < next_n).any():
        raise ValueError(f"req_ids: every request needs >= next_n ({next_n}) reserved tokens, got seq_lens {seq.tolist()}")
    j = torch.arange(next_n, dtype=torch.int64)
    positions = (seq[:, None] - next_n + j[None, :]).flatten()
    slot_mapping = torch.cat([slots_from_pages(alloc.pages(r), int(s) - next_n, int(s), alloc.page_size)
                              for r, s in zip(req_ids, seq)]) if req_ids else torch.zeros(0, dtype=torch.int64)
    block_table = alloc.block_table(req_ids, max_pages)
    return BatchMetadata(
        mode=mode, req_ids=list(req_ids), positions=positions.to(dev), slot_mapping=slot_mapping.to(dev),
        block_table=block_table, next_n=next_n, context_lens=(positions + 1).view(-1, next_n).to(torch.int32).to(dev),
        max_context_len=block_table.shape[1] * alloc.page_size, backend=backend)


def add_kpool(meta: BatchMetadata, alloc: PageAllocator, c: int, rows: list[int], tail_len: int) -> BatchMetadata:
    """Fill ``meta``'s kpool fields (:class:`BatchMetadata`) for pooled indexer keys of ``c`` tokens.

    ``rows``: each request's tail ring row (``KVPool.tail_rows``); ``tail_len``: the ring's positions per
    row. The batch's tokens are each request's last new tokens, consecutive, in ``meta.req_ids`` order.
    """
    dev = alloc.device
    if meta.mode == EXTEND:
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).tolist()
    else:
        q_lens = [meta.next_n] * len(meta.req_ids)
    tok_rows, first, anchors, tail, slots, ks, ke = [], [], [], [], [], [], []
    t0 = m0 = 0
    for r, row, n in zip(meta.req_ids, rows, q_lens):
        end = alloc.seq_len(r)
        pos = torch.arange(end - n, end, dtype=torch.int64)
        tok_rows.append(torch.full((n,), row, dtype=torch.int64))
        first.append(torch.full((n,), t0, dtype=torch.int64))
        # the last new token of each group: the group's last token, or the request's last new token
        anchors.append(t0 + ((pos % c == c - 1) | (pos == end - 1)).nonzero()[:, 0])
        tail.append(t0 + (pos >= end - tail_len).nonzero()[:, 0])
        if meta.mode == EXTEND:
            groups = end // c  # complete groups once this chunk is written
            slots.append(slots_from_pages(alloc.pages(r), 0, groups, alloc.page_size // c))
            ks.append(torch.full((n,), m0, dtype=torch.int32))
            ke.append((m0 + (pos + 1) // c).to(torch.int32))
            m0 += groups
        t0 += n

    def cat(parts: list[torch.Tensor], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return (torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)).to(dev)

    meta.kpool = c
    meta.kpool_rows, meta.kpool_first = cat(tok_rows), cat(first)
    meta.kpool_anchors, meta.kpool_tail_tokens = cat(anchors), cat(tail)
    meta.kpool_every_token = meta.mode == DECODE  # one token per request: its own group's anchor, in the ring
    if meta.mode == EXTEND:
        meta.kpool_slots = cat(slots)
        meta.kpool_ks, meta.kpool_ke = cat(ks, torch.int32), cat(ke, torch.int32)
    return meta
