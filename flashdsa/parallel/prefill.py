"""Prefill context parallelism (docs/DSA.md §8): split the query tokens, gather the keys once per layer.

Each rank computes the projections, the MLA cache rows and the indexer keys of ITS share of the new
tokens (:mod:`flashdsa.parallel.split`: interleave or zigzag). In every layer one all-gather brings the
cache rows and index keys of all new tokens to every rank (padded to equal counts, then unpadded and put
back in batch order); each rank writes the whole sequence into its caches and runs indexer -> top-k ->
sparse MLA for its own queries against it. Decode then runs replicated: every rank holds the whole KV.

What travels, per new token and layer (``(p-1) ceil(T/p)`` tokens received per rank):

    MLA cache row       576 bf16 = 1152 B       (the 512 latent after its norm + 64 RoPE'd dims)
    index key, fp8      128 e4m3 + 1 f32 = 132 B (after RoPE and Hadamard, quantised)
    index key, exact    128 bf16 = 256 B          (precision="exact": there is no quantised form)

docs/DSA.md §8 gathers the bf16 key before quantisation (256 B). act_quant's block is the whole 128-dim key,
so a token's fp8 key and scale depend on that token alone: quantising on the owner and gathering
(fp8, scale) is bitwise the same as gathering bf16 and quantising on every rank, with 132 / 256 = 52 % of
the bytes and no repeated quantisation. kpool (docs/DSA.md §7) pools c neighbouring tokens, which a split
puts on different ranks, so it gathers before pooling: the rotated bf16 key and the bf16 pooling gate
(2 x 256 B a token), then every rank pools, rotates and quantises the whole sequence as one process does,
and keeps the same tail rings.

The dense fallback is off under CP (docs/DSA.md §6): its kernel takes each request's queries as one contiguous
stretch at the end of its KV, which a split is not. For contexts <= top-k the sparse path selects every
visible key, which is the same attention.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from flashdsa.cache.metadata import EXTEND, BatchMetadata, add_kpool, build_decode, build_extend
from flashdsa.parallel.base import Parallel, ParallelPlan
from flashdsa.parallel.comm import Comm, layout, pack_rows, unpack_rows
from flashdsa.parallel.split import SPLITS, token_owners


class PrefillPlan(ParallelPlan):
    """One extend batch under prefill CP.

    Args:
        comm:   the group.
        owners: ``[T] int64`` (host) the rank that computes each new token, batch order.

    ``rows [t] int64``: the batch rows this rank computes, ascending. ``pad``: the most tokens any rank
    owns (the all-gather's rows per rank). ``src [T] int64``: where token j sits in the gathered
    ``[world * pad]`` rows. ``new_positions [T] int64``: every new token's position (set by :meth:`localize`;
    the metadata's ``positions`` are this rank's rows).
    """

    def __init__(self, comm: Comm, owners: torch.Tensor):
        super().__init__(comm)
        world, rank = comm.world, comm.rank
        counts = torch.bincount(owners, minlength=world)
        self.pad = int(counts.max()) if owners.numel() else 0
        one_hot = torch.nn.functional.one_hot(owners, world)
        within = (one_hot.cumsum(0) - 1).gather(1, owners[:, None]).squeeze(1)  # rank of j among its owner's
        self.src = (owners * self.pad + within).to(comm.device)
        self.rows = (owners == rank).nonzero().squeeze(1).to(comm.device)
        self.new_positions: torch.Tensor | None = None

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.index_select(0, self.rows.to(rows.device))

    def gather(self, parts: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        """This rank's ``[t, ...]`` tensors -> every rank's, ``[T, ...]`` in batch order (one all-gather)."""
        packed = pack_rows(*parts)
        t, width = packed.shape
        padded = torch.zeros(self.pad, width, dtype=torch.uint8, device=packed.device)
        padded[:t] = packed
        every = self.comm.all_gather(padded, what).view(-1, width)
        return unpack_rows(every.index_select(0, self.src.to(every.device)), layout(*parts))

    def received(self, t: torch.Tensor) -> int:
        """Bytes of ``t [n, ...]``'s kind one all-gather brings this rank: (p - 1) ranks x pad rows."""
        return (self.comm.world - 1) * self.pad * math.prod(t.shape[1:]) * t.element_size()

    def exchange(self, kv_rows: torch.Tensor, idx):
        # One collective for all: the MLA rows, then the index key and its scale (kpool: the un-pooled key
        # and its gate, pooled on every rank after it, like the quantisation).
        if idx is None:
            keys = []
        elif idx.pooled:
            keys = [idx.k, idx.gate]
        else:
            keys = [idx.k] + ([] if idx.k_scale is None else [idx.k_scale])
        full = self.gather([kv_rows, *keys], f"the cache rows{' and index keys' if keys else ''}")
        self._received("mla", self.received(kv_rows))
        if keys:
            self._received("indexer", sum(self.received(k) for k in keys))
        if idx is None:
            return full[0], None
        if idx.pooled:
            return full[0], idx._replace(k=full[1], gate=full[2])
        return full[0], idx._replace(k=full[1], k_scale=full[2] if len(full) > 2 else None)

    def unshard(self, x: torch.Tensor) -> torch.Tensor:
        self._received("hidden", self.received(x))
        return self.gather([x], "the final hidden states")[0]

    def localize(self, meta: BatchMetadata, q_lens: list[int]) -> BatchMetadata:
        """The full extend metadata -> this rank's: its query rows (positions, key ranges, cu_seqlens_q;
        kpool: their pooled key ranges); ``slot_mapping`` and kpool's store fields stay the whole batch's
        (every rank writes every new token's KV), and :attr:`new_positions` keeps every new token's position
        (kpool's pooling and tail ring)."""
        rows = self.rows.to(meta.positions.device)
        request = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens, dtype=torch.int64))
        per_request = torch.bincount(request[self.rows.cpu()], minlength=len(q_lens))
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), per_request.cumsum(0)]).to(torch.int32)
        self.new_positions = meta.positions
        pooled = {} if meta.kpool_ks is None else {"kpool_ks": meta.kpool_ks[rows], "kpool_ke": meta.kpool_ke[rows]}
        bounds = None if meta.bounds_host is None else meta.bounds_host[:, self.rows.cpu()]
        return dataclasses.replace(meta, positions=meta.positions[rows], ks=meta.ks[rows], ke=meta.ke[rows],
                                   bounds_host=bounds, cu_seqlens_q=cu_q.to(meta.positions.device), use_dense=False,
                                   parallel=self, **pooled)


@dataclass(frozen=True)
class ContextParallel(Parallel):
    """Prefill CP over ``comm``'s ranks with ``split`` "interleave" or "zigzag" (:mod:`flashdsa.parallel.split`).

    Extend batches are split; decode / verify run replicated on every rank (each holds the whole KV).
    Every rank must be given the same batches (the runner checks that they agree).
    """

    split: str = "zigzag"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {self.split!r}")

    def build(self, alloc, req_ids: list, counts: list[int], mode: str, *, max_pages: int | None = None,
              backend: str | None = None, max_logits_bytes: int = 1 << 30,
              kpool: tuple[int, list[int], int] | None = None) -> BatchMetadata:
        """The batch's metadata on this rank (``Runner.prepare``): extend split by :class:`PrefillPlan`,
        the other modes as one process builds them. ``kpool``: ``(c, tail ring rows, tail_len)`` to fill the
        kpool fields (:func:`add_kpool`) of the whole batch before the split."""
        if mode != EXTEND:
            meta = build_decode(alloc, req_ids, counts[0] if counts else 1, mode, max_pages, backend=backend)
            return meta if kpool is None else add_kpool(meta, alloc, *kpool)
        meta = build_extend(alloc, req_ids, counts, dense_threshold=0, dense_allowed=False, backend=backend,
                            max_logits_bytes=max_logits_bytes)
        if kpool is not None:
            add_kpool(meta, alloc, *kpool)
        plan = PrefillPlan(self.comm, token_owners(counts, self.world, self.split))
        return plan.localize(meta, counts)
