"""kpool (SPEC §7): pooled indexer keys. ``kpool_compress`` makes the pooled key of every group a batch
touches; ``kpool_expand`` turns the selected groups of each query row into its token slots, the
unfinished tail group always included. The group selection itself is ``topk_transform`` (exact,
deterministic) over the logits of the pooled keys."""

from __future__ import annotations

import torch

from flashdsa._library import op
from flashdsa.cache.layouts import PAGE_SIZE
from flashdsa.ops._common import (check_int, check_range, check_tensor, check_translation, check_translation_values,
                                  dense, fail, pick_backend, raise_deferred, value_checks_enabled)
from flashdsa.ops.indexer_quant import HEAD_DIM, ROPE_HALF, indexer_quant
from flashdsa.ops.kpool import reference

_INDEX = (torch.int32, torch.int64)


def _triton_pool(*args):
    # imported on first use: importing triton is slow and CPU-only users never need it
    from flashdsa.ops.kpool import triton as impl
    return impl.pool_keys(*args)


def _triton_expand(*args):
    from flashdsa.ops.kpool import triton as impl
    return impl.expand(*args)


_POOL = {"torch": reference.pool_keys, "triton": _triton_pool}
_EXPAND = {"torch": reference.expand, "triton": _triton_expand}


def _compress_fake(k, gate, ring, ape, positions, rows, first, anchors, *, backend=None):
    G = anchors.shape[0]
    return k.new_empty((G, k.shape[1]), dtype=torch.float8_e4m3fn), k.new_empty((G,), dtype=torch.float32)


@op("kpool_compress", _compress_fake)
def kpool_compress(k: torch.Tensor, gate: torch.Tensor, ring: torch.Tensor, ape: torch.Tensor,
                   positions: torch.Tensor, rows: torch.Tensor, first: torch.Tensor, anchors: torch.Tensor, *,
                   backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooled index key of the group of each anchor token, rotated and quantised for the indexer cache.

    A batch holds T new tokens of several requests, each request's tokens consecutive and in position
    order. For anchor ``t`` at position ``p``, the group is ``g = p // c`` and its members are positions
    ``g c .. p`` (a group still filling pools what it has; the full group once ``p = g c + c - 1``).
    A member at or after its request's first new position ``p0 = positions[first[t]]`` is new token
    ``first[t] + (member - p0)``; an earlier one is read from the request's ring row
    ``ring[rows[t], member % S]``. Then, per dim (fp32, ``reference.pool_keys``)::

        w_i = softmax_i(gate_i + ape[i])            over the members i = member - g c
        pooled = model_dtype(sum_i w_i k_i)
        k_fp8, k_scale = act_quant(model_dtype(hadamard(pooled)))    (indexer_quant with no RoPE)

    Args:
        k:         ``[T, 128]`` bfloat16 / float32 (the model dtype): the new tokens' index keys after
                   LayerNorm and RoPE, not rotated.
        gate:      ``[T, 128]`` ``k.dtype``: ``index_kpool_compress_gate`` applied to the tokens' hidden states.
        ring:      ``[R, S, 2, 128]`` ``k.dtype``: per request row, the key ``[.., 0, :]`` and gate
                   ``[.., 1, :]`` of position p at ``[row, p % S]`` (the pool's tail ring, written after this call).
        ape:       ``[c, 128] float32``: ``index_kpool_compress_ape``, the learned term of a token's place.
        positions: ``[T]`` int: absolute position of each new token.
        rows:      ``[T]`` int: the ring row of each new token's request.
        first:     ``[T]`` int: index in this batch of the first new token of each token's request.
        anchors:   ``[G]`` int: the tokens whose groups to pool (one per group; the engine takes the last
                   new token of every group the batch touches).
        backend:   "torch" | "triton" | None (Triton on CUDA).

    Returns:
        ``k_fp8 [G, 128] float8_e4m3fn`` and ``k_scale [G] float32``, as every index key is stored. The
        Triton pooling differs from the torch one by ``exp``'s last bit; each backend is deterministic.
        No host reads when value checks are off (CUDA-graph capturable).
    """
    raise_deferred()
    check_tensor("k", k, dtype=(torch.bfloat16, torch.float32), ndim=2)
    T, D = k.shape
    dev = k.device
    if D != HEAD_DIM:
        fail("k", f"[T, {HEAD_DIM}] (the indexer head dim)", list(k.shape))
    check_tensor("gate", gate, dtype=k.dtype, shape=(T, D), device=dev)
    check_tensor("ring", ring, dtype=k.dtype, shape=(None, None, 2, D), device=dev, contiguous_last=True)
    R, S = ring.shape[:2]
    check_tensor("ape", ape, dtype=torch.float32, ndim=2, device=dev)
    c = ape.shape[0]
    if ape.shape[1] != D or c < 1:
        fail("ape", f"[c, {D}] with c >= 1", list(ape.shape))
    if S < c:
        fail("ring", f"at least c = {c} positions per row (dim 1)", S)
    for name, t in (("positions", positions), ("rows", rows), ("first", first)):
        check_tensor(name, t, dtype=_INDEX, shape=(T,), device=dev)
    check_tensor("anchors", anchors, dtype=_INDEX, ndim=1, device=dev)
    positions, rows, first, anchors = dense(positions, rows, first, anchors)
    if anchors.numel() and value_checks_enabled(anchors):
        check_range("anchors", anchors, 0, T - 1)
        check_range("rows", rows, 0, R - 1)
        check_range("first", first, 0, T - 1)
        check_range("positions", positions, 0, None)
        p0 = positions[first.long()]
        check_range("first", first.long() - torch.arange(T, device=dev), None, 0, what="first[t] - t, i.e. values")
        # a member from this batch is first[t] + (member - p0): it must be the token at that position
        check_range("positions", positions - p0 - (torch.arange(T, device=dev) - first.long()), 0, 0,
                    what="positions[t] - positions[first[t]] - (t - first[t]), i.e. values")
    impl = pick_backend(backend, _POOL, dev, "kpool_compress")
    pooled = impl(k, gate, ring, ape, positions, rows, first, anchors)
    # indexer_quant's RoPE with cos = 1, sin = 0 leaves the values as they are: its Hadamard + act_quant alone
    G = pooled.shape[0]
    cos = torch.ones(G, ROPE_HALF, dtype=torch.float32, device=dev)
    sin = torch.zeros(G, ROPE_HALF, dtype=torch.float32, device=dev)
    return indexer_quant(pooled, cos, sin, False, backend=backend)


def _expand_fake(groups, lengths, c, *, page_table=None, out_offsets=None, page_size=PAGE_SIZE, backend=None):
    R, G = groups.shape
    return groups.new_empty((R, G * c + c - 1))


@op("kpool_expand", _expand_fake)
def kpool_expand(groups: torch.Tensor, lengths: torch.Tensor, c: int, *, page_table: torch.Tensor | None = None,
                 out_offsets: torch.Tensor | None = None, page_size: int = PAGE_SIZE,
                 backend: str | None = None) -> torch.Tensor:
    """Expand each row's selected groups to their c tokens and append the unfinished tail group.

    Row r sees ``lengths[r]`` tokens: ``n = lengths[r] // c`` complete groups (the candidates of the group
    top-k) and the tail ``n c .. lengths[r] - 1`` (fewer than c tokens, not yet pooled, always selected).
    With ``v = min(G, n)``::

        out[r, j c + i]      = token groups[r, j] c + i          j < v, i < c
        out[r, v c + u]      = token n c + u                      u < lengths[r] - n c
        out[r, the rest]     = -1

    translated as ``topk_transform`` translates: ``page_table[r // g, t // page_size] * page_size +
    t % page_size``, or ``t + out_offsets[r]``, or the position t itself. Rows from ``topk_transform``
    (ascending, -1 padded) give ascending rows. Deterministic, no host reads when value checks are off.

    Args:
        groups:      ``[R, G] int32``: the selected group ids, ``groups[r, :v]`` in ``[0, n)`` and
                     ``groups[r, v:] == -1`` (``topk_transform(logits, lengths // c, G)``'s output).
        lengths:     ``[R] int32`` tokens visible to each row (>= 0).
        c:           tokens per group (``index_kpool``, >= 1).
        page_table:  ``[R / g, maxp] int32`` (g = 1, or next_n for verify rows sharing their request's table).
        out_offsets: ``[R] int32`` (ragged prefill: rows of the gathered KV). Exclusive with ``page_table``.
        page_size:   tokens per page of ``page_table`` (64 c with kpool).

    Returns:
        ``[R, G c + c - 1] int32`` (``index_topk + c - 1`` columns for ``G = index_topk / c``).
    """
    raise_deferred()
    check_tensor("groups", groups, dtype=torch.int32, ndim=2)
    R, G = groups.shape
    dev = groups.device
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(R,), device=dev)
    check_int("c", c, 1)
    check_int("page_size", page_size, 1)
    check_translation(R, dev, page_table, out_offsets)
    groups, lengths, page_table, out_offsets = dense(groups, lengths, page_table, out_offsets)
    if R and value_checks_enabled(lengths):
        check_range("lengths", lengths, 0, None)
        n = (lengths // c).long()[:, None]
        v = n.clamp(max=G)
        j = torch.arange(G, device=dev)[None, :]
        g = groups.long()
        ok = torch.where(j < v, (g >= 0) & (g < n), g == -1)
        if not bool(ok.all()):
            r, col = (~ok).nonzero()[0].tolist()
            fail("groups", f"ids in [0, lengths // c) in the first min(G, lengths // c) columns of a row and -1 "
                 "after them", f"{int(g[r, col])} at row {r}, column {col} (lengths {int(lengths[r])})")
        check_translation_values(lengths, page_table, out_offsets, page_size)
    impl = pick_backend(backend, _EXPAND, dev, "kpool_expand")
    return impl(groups, lengths, c, page_table, out_offsets, page_size)
