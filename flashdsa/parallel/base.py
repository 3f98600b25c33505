"""What the layer and the runner call when several ranks run one batch.

A parallel mode is a frozen config (:class:`Parallel`: the group, the split) that the runner holds, and a
per-batch plan (:class:`ParallelPlan`) that ``Parallel.build`` makes with the batch's metadata and hangs
on ``BatchMetadata.parallel``. The layer's DSA step calls the plan at three fixed points, so every
collective sits below the layer and the layer names no mode::

    prepare -> indexer -> plan.exchange(kv_rows, idx) -> store -> select -> attend -> plan.combine(out, lse) -> finish
                                                                  (plan.select when the KV is sharded)

and the runner calls ``plan.local(input_ids)`` before the first layer and ``plan.unshard(x)`` after the last.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch

from flashdsa.parallel.comm import Comm


class ParallelPlan:
    """One batch's parallel work; every hook defaults to "nothing to do".

    ``traffic`` records the bytes this rank received, per kind (``"mla"``, ``"indexer"``, ...), one entry
    per collective in call order.
    """

    shards_kv = False  # True: the layer asks select() for the top-k (this rank holds part of the keys)

    def __init__(self, comm: Comm):
        self.comm = comm
        self.traffic: dict[str, list[int]] = {}

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of the batch's new tokens ``[T, ...]`` this rank computes."""
        return rows

    def exchange(self, kv_rows: torch.Tensor, idx):
        """This rank's new cache rows ``[t, D]`` (D 576; 512 for NoPE) and :class:`~flashdsa.layers.IndexerOutput`
        (or None) -> the rows and index keys this rank stores at ``batch.slot_mapping``."""
        return kv_rows, idx

    def select(self, layer, idx, batch, pool) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """This rank's attention ``out [t, h, 512], lse [t, h]`` -> the output of its query rows."""
        return out

    def unshard(self, x: torch.Tensor) -> torch.Tensor:
        """The final hidden states of this rank's rows -> those of all ``T`` new tokens, batch order."""
        return x

    def _received(self, what: str, nbytes: int) -> None:
        self.traffic.setdefault(what, []).append(int(nbytes))


@dataclass(frozen=True)
class Parallel:
    """A parallel mode's configuration: the process group it runs over."""

    comm: Comm
    shards_kv = False  # (not a field) True: each rank's pool holds its shard of the KV (DCP)

    @property
    def world(self) -> int:
        return self.comm.world

    @property
    def rank(self) -> int:
        return self.comm.rank

    def allocator(self, local):
        """The allocator the runner reserves through (default: the pool's own)."""
        return local

    def together(self, prepare: Callable[[], tuple], undo: Callable, summary) -> tuple:
        """Run ``prepare() -> (metadata, reservation)`` on every rank so that all succeed or all fail.

        One small collective after it: every rank says whether it prepared, and what (a digest of
        ``summary``, the runner's arguments). If any rank failed or the ranks prepared different batches,
        every rank gives its reservation back (``undo``) and raises — the failed rank its own error, the
        others a ValueError naming it — so no rank goes on into a forward whose collectives would wait for
        a rank that is not coming.
        """
        out, error = None, None
        try:
            out = prepare()
        except Exception as e:  # noqa: BLE001 (re-raised below, after the other ranks were told)
            error = e
        digest = hashlib.sha256(repr(summary).encode()).hexdigest()[:16]
        mine = (None if error is None else f"{type(error).__name__}: {error}", digest)
        try:
            states = self.comm.all_gather_object(mine, "the batch each rank prepared")
        except BaseException:
            if out is not None:
                undo(out[1])
            raise
        failed = [(r, msg) for r, (msg, _) in enumerate(states) if msg is not None]
        disagree = len({d for _, d in states}) > 1
        if error is None and (failed or disagree):
            undo(out[1])
            if failed:
                r, msg = failed[0]
                raise ValueError(f"new_tokens: rank {r} of {len(states)} could not prepare this batch ({msg}); "
                                 f"nothing was reserved on rank {self.rank} either")
            raise ValueError(f"new_tokens: the ranks were given different batches (digests "
                             f"{[d for _, d in states]}); every rank must run the same batch")
        if error is not None:
            raise error
        return out
