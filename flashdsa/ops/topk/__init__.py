"""Exact top-k over indexer logits, with the position -> slot translation fused in."""

from __future__ import annotations

import functools
import importlib

import torch

from flashdsa._library import op
from flashdsa.cache.layouts import PAGE_SIZE
from flashdsa.ops._common import (DEVICE, HOST, check_int, check_mode_and_capture, check_no_overlap, check_range,
                                  check_tensor, check_translation, check_translation_values, dense, facts, fail,
                                  pick_backend, raise_deferred, remember, value_check_mode)
from flashdsa.ops.topk import reference
# imported on first use: importing triton is slow and CPU-only users never need it
_module = functools.cache(importlib.import_module)


def _triton_topk(logits, lengths, topk, page_table, row_starts, out_offsets, page_size, check=False, out=None):
    return _launch().topk_transform(logits, lengths, topk, page_table, row_starts, out_offsets, page_size,
                                    check=check, out=out)


_IMPLS = {"torch": reference.topk_transform, "triton": _triton_topk}


def _topk_fake(logits, lengths, topk=2048, *, page_table=None, row_starts=None, out_offsets=None,
               page_size=PAGE_SIZE, backend=None):
    return logits.new_empty((logits.shape[0], topk), dtype=torch.int32)


@op("topk_transform", _topk_fake, out="out")
def topk_transform(logits: torch.Tensor, lengths: torch.Tensor, topk: int = 2048, *,
                   page_table: torch.Tensor | None = None, row_starts: torch.Tensor | None = None,
                   out_offsets: torch.Tensor | None = None, page_size: int = PAGE_SIZE,
                   backend: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact top-k of each row's candidates, translated to what the attention reads.

    Row r's candidates are ``logits[r, row_starts[r] : row_starts[r] + lengths[r]]`` at row-relative
    positions ``p = 0 .. lengths[r] - 1``.

    Order and ties: larger score first; NaN counts as -inf; -0.0 == +0.0; among equal scores the
    smaller position wins. So every selected score >= every unselected candidate score, for any input,
    and the same input always gives the same bits. Both backends give bitwise the same output; the
    Triton one (default on CUDA) is a radix select on the scores' order-preserving integer image
    that resolves the boundary bucket completely (no candidate cap, see README.md), with no host
    sync and scratch sized from shapes only (CUDA-graph capturable).

    Args:
        logits:      ``[R, L] float32``, unit stride along L (any row stride: it is read in place).
        lengths:     ``[R] int32``, ``0 <= lengths[r]`` and ``row_starts[r] + lengths[r] <= L``.
        topk:        k >= 1.
        page_table:  ``[R / g, maxp] int32`` (g = 1, or next_n when R = B * next_n verify rows share
                     their request's table: row r reads row ``r // g``). Output = physical slot
                     ``page_table[r // g, p // page_size] * page_size + p % page_size``.
        row_starts:  ``[R] int32`` offset of each row's candidates in ``logits`` (default 0).
        out_offsets: ``[R] int32``; output = ``p + out_offsets[r]`` (ragged prefill: index into the
                     gathered KV). Exclusive with ``page_table``.
        page_size:   tokens per page of ``page_table`` (64; 64 * c with kpool).
        out:         optional ``[R, topk] int32`` contiguous buffer to write the result into (and return),
                     e.g. a CUDA-graph engine's static buffer: no allocation a call; it must not overlap
                     the inputs. Under torch.compile the op's result is copied into it.

    The metadata tensors may be strided views (``context_lens[:, 0]``); they are made contiguous first.
    Value checks (the ranges above, the page table's reach and page ids): for the Triton kernel on CUDA
    by the kernel itself, before it reads through a row's values (no extra launch, no host sync), a
    deferred ValueError (``flashdsa._checks``); a row with a bad value then selects nothing (all -1).

    Returns:
        ``[R, topk] int32``: the selected candidates in ascending position order, then -1 padding
        (a row with fewer than topk candidates returns all of them).
    """
    raise_deferred()
    if out is not None and isinstance(out, torch.Tensor):  # the kernel would read what it writes
        check_no_overlap("out", out, logits=logits, lengths=lengths, page_table=page_table, row_starts=row_starts,
                         out_offsets=out_offsets)
    # Fast path: a call whose every host-known fact (types, dtypes, shapes, strides, devices, the ints, the
    # logits' alignment, the check mode) equals an earlier call's that passed the checks below and ran the
    # Triton kernel passes them again: launch at once (the checks, dispatch and launch-shape lookup it skips
    # cost ~4 us of Python a call on a desktop CPU, more on the H200's host).
    try:
        mode, capturing = check_mode_and_capture(lengths)
        # logits' and lengths' facts written out (``facts`` for the optional ones): two calls less on the
        # hottest host path of a decode step
        key = (type(logits), logits.dtype, logits.shape, logits.stride(), logits.device, not logits.data_ptr() & 15,
               type(lengths), lengths.dtype, lengths.shape, lengths.stride(), lengths.device,
               facts(page_table), facts(row_starts), facts(out_offsets), type(topk), topk, type(page_size),
               page_size, backend, mode)
        if out is not None:
            key = (key, facts(out))
        entry = _FAST.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks below say what is wrong
        entry = key = None
    if entry is not None and _IMPLS["triton"] is _triton_topk:  # (tests stand other kernels in there)
        return _launch().run(entry, logits, lengths, page_table, row_starts, out_offsets, out, capturing=capturing)
    check_tensor("logits", logits, dtype=torch.float32, ndim=2, contiguous_last=True)
    R, L = logits.shape
    dev = logits.device
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(R,), device=dev)
    check_int("topk", topk, 1)
    check_int("page_size", page_size, 1)
    if row_starts is not None:
        check_tensor("row_starts", row_starts, dtype=torch.int32, shape=(R,), device=dev)
    check_translation(R, dev, page_table, out_offsets)
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(R, topk), device=dev)
        if not out.is_contiguous():
            fail("out", "a contiguous tensor", f"strides {out.stride()}")
    given = (lengths, page_table, row_starts, out_offsets)
    lengths, page_table, row_starts, out_offsets = dense(*given)
    impl = pick_backend(backend, _IMPLS, dev, "topk_transform")
    mode = value_check_mode(lengths, impl is _triton_topk)
    if mode is HOST:
        _check_values(L, lengths, page_table, row_starts, out_offsets, page_size)
    elif impl is _triton_topk and R and key is not None and all(
            a is b for a, b in zip(given, (lengths, page_table, row_starts, out_offsets))):
        # remembered only where nothing was made contiguous (the key fixes the strides, so a later call with
        # this key needs no copy either)
        entry = remember(_FAST, key, _launch().launch_entry(logits, topk, page_table, row_starts, out_offsets,
                                                            page_size, check=mode is DEVICE), 256)
        return _launch().run(entry, logits, lengths, page_table, row_starts, out_offsets, out)
    if impl is _triton_topk:
        # DEVICE: checked by the kernel itself, row by row, before it reads anything through the row's values
        return impl(logits, lengths, topk, page_table, row_starts, out_offsets, page_size, check=mode is DEVICE,
                    out=out)
    res = impl(logits, lengths, topk, page_table, row_starts, out_offsets, page_size)
    return res if out is None else out.copy_(res)


# call signature (see the fast path) -> launch entry
_FAST: dict = {}


def _launch():
    return _module("flashdsa.ops.topk.launch")


def _check_values(L, lengths, page_table, row_starts, out_offsets, page_size) -> None:
    """The value checks on the host (a sync per check on CUDA)."""
    check_range("lengths", lengths, 0, L)
    if row_starts is not None:
        check_range("row_starts", row_starts, 0, L)
        check_range("row_starts + lengths", row_starts + lengths, None, L)
    if out_offsets is not None:
        check_range("out_offsets", out_offsets, 0, None)
    check_translation_values(lengths, page_table, out_offsets, page_size)
