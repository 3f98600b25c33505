"""Who owns which token: the prefill splits of the query tokens and the decode sharding of the KV.

Prefill CP splits a batch's new tokens (requests concatenated, ``q_lens[b]`` each) over p ranks:

    interleave   token j of the batch -> rank j % p
    zigzag       each request in 2p contiguous chunks; rank r takes chunks r and 2p-1-r, so every rank
                 holds an early (cheap) and a late (expensive) stretch of the causal sequence

Both keep every rank within one token of T / p, so the padded all-gather moves ``(p-1) ceil(T/p)`` rows per
rank. Zigzag's chunks are ``n // 2p`` tokens, and the ``n % 2p`` spare tokens of a request lengthen the
chunks of the ranks next in a round-robin that runs over the whole batch (the engines give them to the
first chunks of every request, which leaves rank 0 up to B tokens ahead). A request shorter than 2p has
empty chunks; a rank may own no token at all.

Decode CP (DCP) shards each request's KV by position in blocks of ``block`` tokens (1 by default, vLLM's
interleave size; ``block = 64`` gives every page to one rank):

    owner(t) = (t // block) % p        local(t) = (t // (block p)) * block + t % block

``local`` numbers a rank's own tokens 0, 1, 2, ... in position order, so local order is global order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPLITS = ("interleave", "zigzag")


def _check_world(world: int) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world: expected an int >= 1, got {world!r}")


def token_owners(q_lens: list[int], world: int, split: str) -> torch.Tensor:
    """The rank that computes each new token: ``[sum(q_lens)] int64`` in batch order (see the module doc)."""
    _check_world(world)
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in q_lens):
        raise ValueError(f"q_lens: expected ints >= 0, got {q_lens!r}")
    T = sum(q_lens)
    if split == "interleave":
        return torch.arange(T, dtype=torch.int64) % world
    owners, spare = [], 0  # spare: the rank whose chunk takes the batch's next spare token
    chunk_owner = [k if k < world else 2 * world - 1 - k for k in range(2 * world)]
    for n in q_lens:
        sizes = [n // (2 * world)] * (2 * world)
        for j in range(n % (2 * world)):
            r = (spare + j) % world
            # a rank's first spare lengthens its early chunk, a second (n % 2p > p) its late one
            sizes[r if j < world else 2 * world - 1 - r] += 1
        spare = (spare + n % (2 * world)) % world
        owners += [chunk_owner[k] for k, size in enumerate(sizes) for _ in range(size)]
    return torch.tensor(owners, dtype=torch.int64)


@dataclass(frozen=True)
class KVShards:
    """Rank ``rank`` of ``world`` holds the KV of positions t with ``(t // block) % world == rank``."""

    world: int
    rank: int
    block: int = 1

    def __post_init__(self) -> None:
        _check_world(self.world)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"rank: expected an int in [0, {self.world}), got {self.rank!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block: expected an int >= 1 (tokens per shard block), got {self.block!r}")

    def owner(self, t: torch.Tensor) -> torch.Tensor:
        """``t [...] int`` positions -> the rank holding each, same shape."""
        return (t // self.block) % self.world

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """Positions this rank owns -> their local indices (meaningless for positions it does not own)."""
        return (t // (self.block * self.world)) * self.block + t % self.block

    def to_global(self, i: torch.Tensor) -> torch.Tensor:
        """This rank's local indices -> positions."""
        return (i // self.block) * (self.block * self.world) + self.rank * self.block + i % self.block

    def count(self, n: int) -> int:
        """How many of positions ``0 .. n - 1`` this rank owns."""
        cycle = self.block * self.world
        return (n // cycle) * self.block + min(max(n % cycle - self.rank * self.block, 0), self.block)

    def counts(self, n: torch.Tensor) -> torch.Tensor:
        """:meth:`count` of every element of ``n [...] int``."""
        cycle = self.block * self.world
        return (n // cycle) * self.block + (n % cycle - self.rank * self.block).clamp(0, self.block)
