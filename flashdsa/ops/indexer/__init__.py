"""Lightning-indexer logits: ragged (prefill / extend) and paged (decode / MTP verify), and the ragged
logits -> top-k composition under a memory budget."""

from __future__ import annotations

import functools
import importlib

import numpy as np
import torch

from flashdsa._checks import trusted_inputs, value_checks_enabled
from flashdsa._library import op
from flashdsa.cache.layouts import INDEX_PAGE_BYTES, PAGE_SIZE, check_index_cache
from flashdsa.ops._common import (DEVICE, HOST, INT32_MAX, check_finite, check_int, check_mode_and_capture, check_range,
                                  check_tensor, dense, device_checks, facts, fail, pick_backend, raise_deferred,
                                  remember, value_check_mode)
from flashdsa.ops._gluon import GluonKernels
from flashdsa.ops.indexer import reference
from flashdsa.ops.topk import topk_transform
from flashdsa.quant import FP8

# imported on first use: importing triton is slow and CPU-only users never need it
_module = functools.cache(importlib.import_module)


def _triton_ragged(*args, **kwargs):
    return _module("flashdsa.ops.indexer.ragged").indexer_logits_ragged(*args, **kwargs)


def _triton_paged(*args, **kwargs):
    return _module("flashdsa.ops.indexer.paged").indexer_logits_paged(*args, **kwargs)


# The Gluon paged kernel (sm_90, ``gluon.py``): the default where it applies from this next_n on (measured on
# the H200: 0.89-0.90x the Triton kernel's time at next_n 4, 1.00-1.04x at 1-3); it has no in-kernel value
# checks, so the default (device) mode runs a small check kernel before it (``_device_checks.check_paged``)
GLUON_PAGED_MIN_NEXT_N = 4
_GLUON = "flashdsa.ops.indexer.gluon"
_GLUONS = GluonKernels(lambda name: _module(name))  # whether it ran, why its first launch failed (ops/_gluon.py)


def _gluon_paged(q_fp8, index_cache, weights, context_lens, block_table, max_context_len):
    return _GLUONS.run(_GLUON, "indexer_logits_paged_planned", _triton_paged, q_fp8, index_cache, weights,
                       context_lens, block_table, max_context_len, op="indexer_logits_paged")


def _gluon_paged_unsupported(q_fp8, index_cache) -> str | None:
    return _GLUONS.unsupported(_GLUON, q_fp8, index_cache)


def _gluon_failed() -> bool:
    return _GLUON in _GLUONS.failed


_RAGGED = {"torch": reference.indexer_logits_ragged, "triton": _triton_ragged}
_PAGED = {"torch": reference.indexer_logits_paged, "triton": _triton_paged, "gluon": _gluon_paged}


def _check_ragged(q_fp8, k_fp8, k_scale, weights, ks, ke) -> tuple[int, int]:
    """Shapes, dtypes and devices of the ragged indexer inputs; returns (T, N)."""
    check_tensor("q_fp8", q_fp8, dtype=FP8, ndim=3)
    T, H, D = q_fp8.shape
    dev = q_fp8.device
    check_tensor("k_fp8", k_fp8, dtype=FP8, shape=(None, D), device=dev)
    N = k_fp8.shape[0]
    check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(N,), device=dev)
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H), device=dev)
    check_tensor("ks", ks, dtype=torch.int32, shape=(T,), device=dev)
    check_tensor("ke", ke, dtype=torch.int32, shape=(T,), device=dev)
    return T, N


def _ragged_fake(q_fp8, k_fp8, k_scale, weights, ks, ke, *, backend=None):
    return q_fp8.new_empty((q_fp8.shape[0], k_fp8.shape[0]), dtype=torch.float32)


@op("indexer_logits_ragged", _ragged_fake)
def indexer_logits_ragged(q_fp8: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                          ks: torch.Tensor, ke: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Indexer logits of T queries against N concatenated keys (prefill / extend).

    Args:
        q_fp8:   ``[T, H, D] float8_e4m3fn`` queries (after RoPE, Hadamard, act_quant).
        k_fp8:   ``[N, D] float8_e4m3fn`` keys of all requests, concatenated.
        k_scale: ``[N] float32`` per-key dequantisation scale.
        weights: ``[T, H] float32`` head gates with q_scale, H^-0.5 and D^-0.5 folded in.
        ks, ke:  ``[T] int32``; row i scores keys in ``[ks[i], ke[i])``, ``0 <= ks <= ke <= N``.

    Any strides: q_fp8 and k_fp8 are read through theirs, the small per-row / per-key tensors made
    contiguous. An e4m3 NaN code in q_fp8 / k_fp8 is a ValueError when value checks are on (the kernels'
    fp8 conversions and ReLU do not propagate NaN as the reference does). Value checks (ks / ke ranges,
    NaN codes): on the device for the Triton kernel on CUDA, a deferred ValueError (``flashdsa._checks``).

    Returns:
        ``[T, N] float32``: ``k_scale[s] * sum_h weights[i, h] * relu(q[i, h] . k[s])`` inside the
        row's range, ``-inf`` everywhere else.
    """
    raise_deferred()
    T, N = _check_ragged(q_fp8, k_fp8, k_scale, weights, ks, ke)
    k_scale, weights, ks, ke = dense(k_scale, weights, ks, ke)
    impl = pick_backend(backend, _RAGGED, q_fp8.device, "indexer_logits_ragged")
    mode = value_check_mode(ks, impl is _triton_ragged)
    if mode is HOST:
        check_finite("q_fp8", q_fp8)
        check_finite("k_fp8", k_fp8)
        check_range("ks", ks, 0, N)
        check_range("ke", ke, 0, N)
        check_range("ke - ks", ke - ks, 0, None, what="ke >= ks, i.e. values")
    elif mode is DEVICE:
        ks, ke = device_checks().check_ragged(q_fp8, k_fp8, ks, ke)
    return impl(q_fp8, k_fp8, k_scale, weights, ks, ke)


def _paged_fake(q_fp8, index_cache, weights, context_lens, block_table, max_context_len, *, backend=None):
    return q_fp8.new_empty((q_fp8.shape[0] * q_fp8.shape[1], max_context_len), dtype=torch.float32)


@op("indexer_logits_paged", _paged_fake)
def indexer_logits_paged(q_fp8: torch.Tensor, index_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                         *, backend: str | None = None) -> torch.Tensor:
    """Indexer logits of B requests x n query rows against their paged keys (decode, MTP verify).

    Args:
        q_fp8:        ``[B, n, H, 128] float8_e4m3fn``; n = 1 for decode, next_n (any n >= 1) for verify.
        index_cache:  ``[P, 8448] uint8`` pages: 64 x 128 e4m3 keys, then 64 fp32 scales.
        weights:      ``[B * n, H] float32`` folded head gates, row ``b * n + j``.
        context_lens: ``[B, n] int32``; row (b, j) scores positions ``< context_lens[b, j]``. For verify
                      ``context_lens[b, j] = seq_len[b] - n + j + 1`` (draft j never sees draft j + 1).
        block_table:  ``[B, maxp] int32``; position p of request b lives at page ``block_table[b, p // 64]``.
        max_context_len: width of the output, ``>= context_lens.max()``.

    ``index_cache`` must be contiguous (it is read in place, never copied: ValueError otherwise); q_fp8
    may have any strides, the small tensors are made contiguous. NaN codes: a ValueError in q_fp8 (value
    checks on); keys must not hold them at reachable positions (not checked: that would read the whole
    cache; ``store_index_keys`` rejects them), else the backends may disagree. Value checks (lengths,
    reachable page ids, q NaN codes): for the Triton kernel on CUDA by the kernel itself (no extra
    launch, no host sync), a deferred ValueError (``flashdsa._checks``); nothing is read through a bad
    value: rows with a bad length (and the rows sharing their kernel program) score -inf, and so do the
    output columns a kernel program would have read through a bad page id (the Gluon path: the whole
    request's rows).

    Kernels: on an sm_90 GPU from next_n ``GLUON_PAGED_MIN_NEXT_N`` (4) on, the Gluon kernel
    (``indexer/gluon.py``, 0.89-0.90x the Triton kernel's time at next_n 4 on the H200; 64 heads, next_n
    <= 4, contiguous q), every other CUDA call the Triton kernel; ``backend="gluon"`` forces the Gluon
    kernel (next_n 1-4). The Gluon kernel has no in-kernel value checks: the default mode runs a small
    check kernel before it (one more launch), which reports the same deferred errors and gives every
    request with a bad length or reachable page id length 0 (all its rows -inf). The two kernels' logits
    agree within the fp8 dot's accumulation error, not bit for bit (their head sums run in other orders).

    Returns:
        ``[B * n, max_context_len] float32``, ``-inf`` at and past each row's length.
    """
    raise_deferred()
    # Fast path: a call whose every host-known fact (types, dtypes, shapes, strides, devices, q's and the cache's
    # alignment, the width, the backend, the check mode) equals an earlier checked call's runs the kernel that
    # call picked, with the same value checks, without the argument checks (the Python before the launcher:
    # ~10 -> ~4 us a call on a desktop CPU)
    try:
        mode = check_mode_and_capture(context_lens)[0]
        key = (facts(q_fp8), q_fp8.data_ptr() & 15, facts(index_cache), index_cache.data_ptr() & 15, facts(weights),
               facts(context_lens), facts(block_table), type(max_context_len), max_context_len, backend, mode)
        hit = _PAGED_FAST.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks below say what is wrong
        hit = key = None
    if hit is not None and _PAGED[hit[0]] is hit[1] and (hit[1] is not _gluon_paged or not _gluon_failed()):
        return _run_paged(hit[1], mode, q_fp8, index_cache, weights, context_lens, block_table, max_context_len)
    check_tensor("q_fp8", q_fp8, dtype=FP8, ndim=4)
    B, n, H, D = q_fp8.shape
    dev = q_fp8.device
    if D != 128:
        fail("q_fp8", "head dim 128 (the indexer page layout holds 128-dim keys)", D)
    check_tensor("index_cache", index_cache, dtype=torch.uint8, shape=(None, INDEX_PAGE_BYTES), device=dev)
    if not index_cache.is_contiguous() or index_cache.storage_offset() & 3:
        check_index_cache(index_cache)  # raises its ValueError (its messages cost a few µs to build)
    check_tensor("weights", weights, dtype=torch.float32, shape=(B * n, H), device=dev)
    check_tensor("context_lens", context_lens, dtype=torch.int32, shape=(B, n), device=dev)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=dev)
    if block_table.shape[0] != B:
        fail("block_table", f"{B} rows (one per request)", block_table.shape[0])
    check_int("max_context_len", max_context_len, 0)
    given = (weights, context_lens, block_table)
    weights, context_lens, block_table = dense(weights, context_lens, block_table)
    impl = pick_backend(backend, _PAGED, dev, "indexer_logits_paged")
    if impl is _triton_paged and backend is None and n >= GLUON_PAGED_MIN_NEXT_N \
            and _gluon_paged_unsupported(q_fp8, index_cache) is None:
        impl = _gluon_paged  # the dispatch rule (GLUON_PAGED_MIN_NEXT_N)
    elif impl is _gluon_paged:
        why = _gluon_paged_unsupported(q_fp8, index_cache)
        if why is not None:
            fail("backend", f"'gluon' for a call it supports: it needs {why}", "'gluon'")
    mode = value_check_mode(context_lens, impl is _triton_paged or impl is _gluon_paged)
    if mode is HOST:
        check_finite("q_fp8", q_fp8)
        maxp = block_table.shape[1]
        check_range("context_lens", context_lens, 0, min(max_context_len, maxp * PAGE_SIZE))
        if block_table.numel():
            # Only pages a row can reach must be valid; rows of a padded batch may hold junk past their length.
            lens = context_lens.amax(dim=1) if n else torch.zeros(B, dtype=torch.int32, device=dev)
            used = torch.arange(maxp, device=dev)[None, :] * PAGE_SIZE < lens[:, None]
            check_range("block_table", block_table[used], 0, index_cache.shape[0] - 1, what="page ids")
        return impl(q_fp8, index_cache, weights, context_lens, block_table, max_context_len)
    out = _run_paged(impl, mode, q_fp8, index_cache, weights, context_lens, block_table, max_context_len)
    name = next((k for k, f in _PAGED.items() if f is impl), None)
    # remembered where nothing was made contiguous and the kernel picked is the one that ran (a Gluon kernel
    # whose first launch failed fell back to Triton: not remembered)
    if key is not None and name is not None and all(a is b for a, b in zip(given, (weights, context_lens,
                                                                                 block_table))) \
            and not (impl is _gluon_paged and _gluon_failed()):
        remember(_PAGED_FAST, key, (name, impl), 256)
    return out


# indexer_logits_paged's call signature (see its fast path) -> (backend name, implementation)
_PAGED_FAST: dict = {}


def _run_paged(impl, mode, q_fp8, index_cache, weights, context_lens, block_table, max_context_len):
    """Run ``impl`` on checked arguments with the device value checks of ``mode`` (DEVICE) or none (None)."""
    if mode is DEVICE and impl is _gluon_paged:
        # the Gluon kernel has no in-kernel checks: a check kernel first, which hands it lengths with every
        # request that has a bad value zeroed (nothing is read for it)
        context_lens = device_checks().check_paged(q_fp8, context_lens, block_table, max_context_len,
                                                   index_cache.shape[0])
    elif mode is DEVICE:
        # checked by the kernel itself, request by request, before it reads through the request's values
        return impl(q_fp8, index_cache, weights, context_lens, block_table, max_context_len, check=True)
    return impl(q_fp8, index_cache, weights, context_lens, block_table, max_context_len)


def _row_chunks(ks: np.ndarray, ke: np.ndarray, cap: int) -> list[tuple[int, int, int, int]]:
    """Greedy split of rows into ``(r0, r1, lo, hi)`` with ``(r1 - r0) * (hi - lo) <= cap``, where
    ``[lo, hi)`` spans the key ranges of the chunk's non-empty rows (empty rows need no column)."""
    T = len(ks)
    nonempty = ke > ks
    if not nonempty.any():
        return [(0, T, 0, 0)] if T else []
    lo, hi = int(ks[nonempty].min()), int(ke[nonempty].max())
    if T * (hi - lo) <= cap:  # every row in one chunk (the common prefill chunk): what the scan below would find
        return [(0, T, lo, hi)]
    lo_src = np.where(nonempty, ks, np.iinfo(np.int64).max)
    hi_src = np.where(nonempty, ke, np.iinfo(np.int64).min)
    chunks = []
    r0 = 0
    while r0 < T:
        span = 1024  # rows looked at; doubled while they all fit, so the scan stays O(T log T)
        while True:
            stop = min(T, r0 + span)
            lo = np.minimum.accumulate(lo_src[r0:stop])
            hi = np.maximum.accumulate(hi_src[r0:stop])
            # 0 while only empty rows have been seen (hi - lo would wrap around: int64 min - int64 max)
            width = np.where(hi > lo, hi - lo, 0)
            # rows * width only grows with the row count, so the rows that fit are a prefix (>= 1 row:
            # every single row was checked against the budget)
            take = max(1, int((np.arange(1, stop - r0 + 1) * width <= cap).sum()))
            if take < stop - r0 or stop == T:
                break
            span *= 2
        r1 = r0 + take
        if width[take - 1] > 0:
            chunks.append((r0, r1, int(lo[take - 1]), int(hi[take - 1])))
        else:
            chunks.append((r0, r1, 0, 0))
        r0 = r1
    return chunks


def _topk_ragged_fake(q_fp8, k_fp8, k_scale, weights, ks, ke, topk, *, out_offsets=None, max_logits_bytes=1 << 30,
                      backend=None, host_bounds=None):
    return q_fp8.new_empty((q_fp8.shape[0], topk), dtype=torch.int32)


@op("indexer_topk_ragged", _topk_ragged_fake)
def indexer_topk_ragged(q_fp8: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                        ks: torch.Tensor, ke: torch.Tensor, topk: int, *, out_offsets: torch.Tensor | None = None,
                        max_logits_bytes: int = 1 << 30, backend: str | None = None,
                        host_bounds: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k keys of every ragged row (prefill / extend) without ever holding the [T, N] fp32 logits.

    Equal to ``topk_transform(indexer_logits_ragged(q_fp8, k_fp8, k_scale, weights, ks, ke), ke - ks, topk,
    row_starts=ks, out_offsets=out_offsets)``, computed over chunks of query rows: a chunk's logits cover
    only its key window ``[lo, hi)`` (the smallest ks to the largest ke of its rows, columns relative to
    lo) and ``rows x (hi - lo) x 4`` bytes never exceed ``max_logits_bytes``. Long prefill therefore
    needs a bounded buffer instead of ``4 T N`` bytes (4 GiB at 32K x 32K).

    Args:
        q_fp8, k_fp8, k_scale, weights, ks, ke: as :func:`indexer_logits_ragged`.
        topk:             k >= 1.
        out_offsets:      ``[T] int32`` or None; output = ``p + out_offsets[i]`` (index into a gathered KV).
        max_logits_bytes: the largest logits buffer one chunk may allocate; one row's range
                          (``4 (ke - ks)`` bytes) must fit, else ValueError.
        backend:          passed to both the logits and the top-k op.
        host_bounds:      ``[2, T]`` int32 / int64 CPU tensor or None: ``ks`` and ``ke`` as the caller holds
                          them on the host (an engine builds them there). Given, the op reads nothing back, so
                          the GPU is not drained before its launches (~250 us of host work a call waited
                          for on the H200). They must equal ``ks`` / ``ke``: compared with them when value
                          checks run (one device read), trusted otherwise.

    Returns:
        ``[T, topk] int32``: positions ``p`` relative to ``ks[i]`` (``0 <= p < ke[i] - ks[i]``), or
        ``p + out_offsets[i]``, ascending, -1 padded.

    Chunk bounds must be known on the host, so without ``host_bounds`` this op reads ks / ke back (one
    device sync) whatever the value-check setting; it is a prefill op and not CUDA-graph capturable. Its
    value checks run on the host, immediate (out_offsets once, the NaN codes of each chunk's rows and key
    window before the chunk's kernels), and the chunks' own launches skip theirs.
    """
    raise_deferred()
    T, N = _check_ragged(q_fp8, k_fp8, k_scale, weights, ks, ke)
    dev = q_fp8.device
    check_int("topk", topk, 1)
    if out_offsets is not None:
        check_tensor("out_offsets", out_offsets, dtype=torch.int32, shape=(T,), device=dev)
    k_scale, weights, ks, ke, out_offsets = dense(k_scale, weights, ks, ke, out_offsets)
    if isinstance(max_logits_bytes, bool) or not isinstance(max_logits_bytes, int) or max_logits_bytes < 4:
        fail("max_logits_bytes", "an int >= 4 (one fp32 logit)", max_logits_bytes)
    pick_backend(backend, _RAGGED, dev, "indexer_topk_ragged")  # reject a bad backend before any work
    if host_bounds is not None:
        check_tensor("host_bounds", host_bounds, dtype=(torch.int32, torch.int64), shape=(2, T),
                     device=torch.device("cpu"))
    out = torch.empty(T, topk, dtype=torch.int32, device=dev)
    if T == 0:
        return out
    # the one host read this op needs (and the range checks, which it makes unconditional), unless the caller
    # holds the bounds on the host already
    if host_bounds is None:
        ks_h, ke_h = torch.stack((ks, ke)).cpu().numpy().astype(np.int64)  # one transfer
    else:
        ks_h, ke_h = host_bounds.numpy().astype(np.int64)
        if value_checks_enabled(ks) and not torch.equal(torch.stack((ks, ke)).cpu().long(), host_bounds.long()):
            fail("host_bounds", "ks and ke as they are on the device", "values that differ from them")
    if ks_h.min() < 0 or ks_h.max() > N:
        fail("ks", f"values in [0, {N}]", f"[{ks_h.min()}, {ks_h.max()}]")
    if ke_h.min() < 0 or ke_h.max() > N:
        fail("ke", f"values in [0, {N}]", f"[{ke_h.min()}, {ke_h.max()}]")
    if (ke_h < ks_h).any():
        fail("ke - ks", "ke >= ks, i.e. values >= 0", int((ke_h - ks_h).min()))
    cap = max_logits_bytes // 4
    widest = int((ke_h - ks_h).max())
    if widest > cap:
        fail("max_logits_bytes", f"room for the widest row ({widest} keys = {4 * widest} bytes)", max_logits_bytes)
    if out_offsets is not None:  # what the chunks' top-k would check, on the host once
        check_range("out_offsets", out_offsets, 0, None)
        check_range("out_offsets", out_offsets.long() + (ke - ks) - 1, None, INT32_MAX,
                    what="out_offsets + lengths - 1")
    for r0, r1, lo, hi in _row_chunks(ks_h, ke_h, cap):
        # columns relative to the window; empty rows clamp to an empty range inside it. A window of every row
        # and key needs neither (ks / ke are in [0, N], checked above): two launches less in the one-chunk case,
        # whose host work the GPU waits for after the host read of ks / ke
        if (r0, r1, lo, hi) == (0, T, 0, N):
            ks_c, ke_c = ks, ke
        else:
            ks_c = (ks[r0:r1] - lo).clamp_(0, hi - lo)
            ke_c = (ke[r0:r1] - lo).clamp_(0, hi - lo)
        check_finite("q_fp8", q_fp8[r0:r1])
        check_finite("k_fp8", k_fp8[lo:hi])
        with trusted_inputs():  # checked above: ks_c / ke_c are in range by construction
            logits = indexer_logits_ragged(q_fp8[r0:r1], k_fp8[lo:hi], k_scale[lo:hi], weights[r0:r1], ks_c, ke_c,
                                           backend=backend)
            off = None if out_offsets is None else out_offsets[r0:r1]
            # rows that all start at the window's first key (one request's chunk) need no row_starts, and without
            # them the top-k reads whole 16-byte chunks (the rows kernel's 128-bit loads)
            live = ke_h[r0:r1] > ks_h[r0:r1]
            starts = None if (ks_h[r0:r1][live] == lo).all() else ks_c
            topk_transform(logits, ke_c - ks_c, topk, row_starts=starts, out_offsets=off, backend=backend,
                           out=out[r0:r1])
    return out
