"""Page allocator: a free list of fixed-size KV pages and one block table per request (nano-vllm style).

A request's tokens fill its pages in order; token p lives in page ``pages[p // page_size]`` at row
``p % page_size``, so its physical slot (a row of the flattened cache ``[P * page_size, width]``) is::

    slot(p) = block_table[p // page_size] * page_size + p % page_size

``page_size`` is 64 tokens, 64 * c with kpool (``DSAConfig.page_size``). Every cache of every layer is
addressed through the same page ids, so one block table per batch serves all layers.

Out of pages raises :class:`OutOfPagesError` before anything changes; ``free`` returns exactly the
request's pages to the free list, ``truncate`` the pages past a shorter length. ``reserve`` grows a whole
batch at once (all or nothing) and returns a :class:`Reservation` that ``undo`` takes back exactly: the
allocator is then as it was, free list order included (an engine's forward that fails after reserving).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

BLOCK_TABLE_PAD = 0  # default filler of block_table rows past a request's pages (see block_table)


class OutOfPagesError(RuntimeError):
    """Not enough free pages for an allocate / extend; the allocator was left unchanged."""

    def __init__(self, req_id: Hashable, needed: int, free: int):
        super().__init__(f"out of KV pages: request {req_id!r} needs {needed} more page(s), {free} free")
        self.req_id, self.needed, self.free = req_id, needed, free


@dataclass(frozen=True)
class Reservation:
    """What :meth:`PageAllocator.reserve` did, for :meth:`PageAllocator.undo`: per request in order, its
    length before (None: the request was created) and the pages taken for it."""

    steps: tuple[tuple[Hashable, int | None, tuple[int, ...]], ...]


class PageAllocator:
    """Hands out page ids ``0 .. num_pages - 1`` to requests; plain Python, no device work.

    Args:
        num_pages: pages in the pool (>= 0).
        page_size: tokens per page (64, or 64 * c with kpool).
        device:    where ``slots`` and ``block_table`` put their tensors.
    """

    def __init__(self, num_pages: int, page_size: int = 64, device: torch.device | str = "cpu"):
        for name, v, lo in (("num_pages", num_pages, 0), ("page_size", page_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self._free: deque[int] = deque(range(num_pages))  # freed pages go to the back, allocation takes the front
        self._pages: dict[Hashable, list[int]] = {}        # req_id -> its pages in token order
        self._lens: dict[Hashable, int] = {}               # req_id -> tokens reserved

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def free_page_ids(self) -> tuple[int, ...]:
        """The free list, in the order pages will be handed out."""
        return tuple(self._free)

    @property
    def req_ids(self) -> list[Hashable]:
        """Live requests, in allocation order."""
        return list(self._pages)

    def __contains__(self, req_id: Hashable) -> bool:
        return _hashable(req_id) and req_id in self._pages

    def pages_for(self, n_tokens: int) -> int:
        """Pages that hold ``n_tokens`` tokens: ``ceil(n_tokens / page_size)``."""
        return -(-n_tokens // self.page_size)

    def pages(self, req_id: Hashable) -> tuple[int, ...]:
        """The request's page ids in token order (its block table row)."""
        return tuple(self._pages[self._check_live(req_id)])

    def seq_len(self, req_id: Hashable) -> int:
        """Tokens reserved for the request (``allocate`` + every ``extend``)."""
        return self._lens[self._check_live(req_id)]

    # ---- changes -------------------------------------------------------------------------------
    def allocate(self, req_id: Hashable, n_tokens: int) -> list[int]:
        """Reserve ``n_tokens`` (>= 0) for a new request; returns its pages.

        Raises ValueError if ``req_id`` is already live, OutOfPagesError (nothing changed) if too few pages.
        """
        if _check_id(req_id) in self._pages:
            raise ValueError(f"req_id: expected a request that is not live, got {req_id!r} (already allocated)")
        _check_count("n_tokens", n_tokens)
        new = self._take(req_id, self.pages_for(n_tokens))
        self._pages[req_id], self._lens[req_id] = new, n_tokens
        return list(new)

    def extend(self, req_id: Hashable, n_new_tokens: int) -> list[int]:
        """Reserve ``n_new_tokens`` (>= 0) more tokens; adds pages only when the last one is full.

        Returns the pages added (often none). OutOfPagesError (nothing changed) if too few pages.
        """
        self._check_live(req_id)
        _check_count("n_new_tokens", n_new_tokens)
        n = self._lens[req_id] + n_new_tokens
        new = self._take(req_id, self.pages_for(n) - len(self._pages[req_id]))
        self._pages[req_id].extend(new)
        self._lens[req_id] = n
        return new

    def truncate(self, req_id: Hashable, n_tokens: int) -> list[int]:
        """Shrink the request to its first ``n_tokens`` (``0 <= n_tokens <= seq_len``), e.g. rejected MTP drafts.

        Pages no longer needed go back to the free list; returns them (often none).
        """
        n = self.seq_len(req_id)
        _check_count("n_tokens", n_tokens)
        if n_tokens > n:
            raise ValueError(f"n_tokens: expected at most seq_len ({n}) of request {req_id!r}, got {n_tokens}")
        pages = self._pages[req_id]
        keep = self.pages_for(n_tokens)
        dropped = pages[keep:]
        del pages[keep:]
        self._lens[req_id] = n_tokens
        self._free.extend(dropped)
        return dropped

    def free(self, req_id: Hashable) -> list[int]:
        """Release the request; its pages go back to the free list. Returns them."""
        pages = self._pages.pop(self._check_live(req_id))
        del self._lens[req_id]
        self._free.extend(pages)
        return pages

    def reserve(self, new_tokens: dict[Hashable, int]) -> Reservation:
        """Grow a batch: ``new_tokens[req]`` (>= 0) more tokens per request; a request not yet live is created.

        All or nothing: every count is checked and the pages needed by the whole batch are counted first
        (ValueError / OutOfPagesError, nothing changed). Returns the :class:`Reservation` for :meth:`undo`.
        """
        need = 0
        for r, n in new_tokens.items():
            _check_count(f"new_tokens[{r!r}]", n)
            cur, have = (self._lens[r], len(self._pages[r])) if r in self._pages else (0, 0)
            need += self.pages_for(cur + n) - have
        if need > len(self._free):
            raise OutOfPagesError(list(new_tokens), need, len(self._free))
        steps = []
        for r, n in new_tokens.items():
            before = self._lens.get(r)
            added = self.extend(r, n) if before is not None else self.allocate(r, n)
            steps.append((r, before, tuple(added)))
        return Reservation(tuple(steps))

    def undo(self, reservation: Reservation) -> None:
        """Take back a :meth:`reserve` (the latest change to these requests): lengths, pages and the free
        list's order are restored."""
        for r, before, added in reversed(reservation.steps):
            pages = self._pages[self._check_live(r)]
            if tuple(pages[len(pages) - len(added):]) != added:
                raise ValueError(f"reservation: request {r!r} changed since it was reserved; cannot undo")
            del pages[len(pages) - len(added):]
            self._free.extendleft(reversed(added))  # back to the front, in the order they were taken
            if before is None:
                del self._pages[r], self._lens[r]
            else:
                self._lens[r] = before

    # ---- tensors -------------------------------------------------------------------------------
    def slots(self, req_id: Hashable, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Physical slots of the request's tokens ``start .. end - 1``: ``[end - start] int64``.

        ``slot(p) = pages[p // page_size] * page_size + p % page_size``; needs ``0 <= start <= end <= seq_len``.
        """
        n = self.seq_len(req_id)
        end = n if end is None else end
        check_span(start, end, n, f"seq_len ({n}) of request {req_id!r}")
        return slots_from_pages(self._pages[req_id], start, end, self.page_size).to(self.device)

    def block_table(self, req_ids: Iterable[Hashable], max_pages: int | None = None,
                    pad: int = BLOCK_TABLE_PAD) -> torch.Tensor:
        """``[B, maxp] int32``: row b = the pages of ``req_ids[b]``, then ``pad``.

        ``maxp = max_pages`` if given (ValueError if a request has more pages), else the largest page
        count, at least 1 so the table is never empty. The default ``pad = 0`` is a real page id:
        a kernel that reads past a request's length (prefetch, CUDA-graph padding rows) stays in
        bounds; nothing may WRITE through padding. Pass ``pad=-1`` to make such reads fail loudly.
        One table per batch serves every layer and both caches.
        """
        req_ids = list(req_ids)
        if isinstance(pad, bool) or not isinstance(pad, int) or not -2 ** 31 <= pad < 2 ** 31:
            raise ValueError(f"pad: expected an int32 page id (0, or -1 to make padded reads fail), got {pad!r}")
        rows = [self._pages[self._check_live(r)] for r in req_ids]
        widest = max((len(p) for p in rows), default=0)
        if max_pages is None:
            max_pages = max(widest, 1)
        elif isinstance(max_pages, bool) or not isinstance(max_pages, int) or max_pages < widest:
            raise ValueError(f"max_pages: expected an int >= {widest} (the most pages of any request), got {max_pages!r}")
        table = torch.full((len(rows), max_pages), pad, dtype=torch.int32)
        for b, p in enumerate(rows):
            table[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
        return table.to(self.device)

    # ---- internals -----------------------------------------------------------------------------
    def _check_live(self, req_id: Hashable) -> Hashable:
        if _check_id(req_id) not in self._pages:
            raise ValueError(f"req_id: expected a live request, got {req_id!r} (never allocated or already freed)")
        return req_id

    def _take(self, req_id: Hashable, n: int) -> list[int]:
        # Check first, then pop: a failed call leaves the allocator as it was.
        if n > len(self._free):
            raise OutOfPagesError(req_id, n, len(self._free))
        return [self._free.popleft() for _ in range(n)]


def slots_from_pages(pages, start: int, end: int, page_size: int) -> torch.Tensor:
    """``[end - start] int64`` slots of positions ``start .. end - 1`` through one block-table row ``pages``."""
    pos = torch.arange(start, end, dtype=torch.int64)
    table = torch.as_tensor(list(pages), dtype=torch.int64)
    return table[pos // page_size] * page_size + pos % page_size


def check_span(start, end, n: int, what: str) -> None:
    """ValueError unless ``start`` and ``end`` are ints with ``0 <= start <= end <= n`` (``what`` names n)."""
    ints = all(not isinstance(v, bool) and isinstance(v, int) for v in (start, end))
    if not ints or not 0 <= start <= end <= n:
        raise ValueError(f"start, end: expected ints with 0 <= start <= end <= {what}, "
                         f"got start={start!r}, end={end!r}")


def _hashable(req_id) -> bool:
    try:
        hash(req_id)
    except TypeError:
        return False
    return True


def _check_id(req_id: Hashable) -> Hashable:
    if not _hashable(req_id):
        raise ValueError(f"req_id: expected a hashable id (str, int, tuple, ...), got {type(req_id).__name__} "
                         f"{req_id!r}")
    return req_id


def _check_count(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
