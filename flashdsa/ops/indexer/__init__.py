"""Lightning-indexer logits: ragged (prefill / extend) and paged (decode / MTP verify)."""

from __future__ import annotations

import torch

from flashdsa.cache.layouts import INDEX_PAGE_BYTES, PAGE_SIZE
from flashdsa.ops._common import check_range, check_tensor, fail, pick_backend, value_checks_enabled
from flashdsa.ops.indexer import reference
from flashdsa.quant import FP8

_RAGGED = {"torch": reference.indexer_logits_ragged}
_PAGED = {"torch": reference.indexer_logits_paged}


def indexer_logits_ragged(q_fp8: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                          ks: torch.Tensor, ke: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Indexer logits of T queries against N concatenated keys (prefill / extend).

    Args:
        q_fp8:   ``[T, H, D] float8_e4m3fn`` queries (after RoPE, Hadamard, act_quant).
        k_fp8:   ``[N, D] float8_e4m3fn`` keys of all requests, concatenated.
        k_scale: ``[N] float32`` per-key dequantisation scale.
        weights: ``[T, H] float32`` head gates with q_scale, H^-0.5 and D^-0.5 folded in.
        ks, ke:  ``[T] int32``; row i scores keys in ``[ks[i], ke[i])``, ``0 <= ks <= ke <= N``.

    Returns:
        ``[T, N] float32``: ``k_scale[s] * sum_h weights[i, h] * relu(q[i, h] . k[s])`` inside the
        row's range, ``-inf`` everywhere else.
    """
    check_tensor("q_fp8", q_fp8, dtype=FP8, ndim=3)
    T, H, D = q_fp8.shape
    dev = q_fp8.device
    check_tensor("k_fp8", k_fp8, dtype=FP8, shape=(None, D), device=dev)
    N = k_fp8.shape[0]
    check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(N,), device=dev)
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H), device=dev)
    check_tensor("ks", ks, dtype=torch.int32, shape=(T,), device=dev)
    check_tensor("ke", ke, dtype=torch.int32, shape=(T,), device=dev)
    check_range("ks", ks, 0, N)
    check_range("ke", ke, 0, N)
    check_range("ke - ks", ke - ks, 0, None, what="ke >= ks, i.e. values")
    impl = pick_backend(backend, _RAGGED, dev, "indexer_logits_ragged")
    return impl(q_fp8, k_fp8, k_scale, weights, ks, ke)


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

    Returns:
        ``[B * n, max_context_len] float32``, ``-inf`` at and past each row's length.
    """
    check_tensor("q_fp8", q_fp8, dtype=FP8, ndim=4)
    B, n, H, D = q_fp8.shape
    dev = q_fp8.device
    if D != 128:
        fail("q_fp8", "head dim 128 (the indexer page layout holds 128-dim keys)", D)
    check_tensor("index_cache", index_cache, dtype=torch.uint8, shape=(None, INDEX_PAGE_BYTES), device=dev)
    check_tensor("weights", weights, dtype=torch.float32, shape=(B * n, H), device=dev)
    check_tensor("context_lens", context_lens, dtype=torch.int32, shape=(B, n), device=dev)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=dev)
    if block_table.shape[0] != B:
        fail("block_table", f"{B} rows (one per request)", block_table.shape[0])
    if isinstance(max_context_len, bool) or not isinstance(max_context_len, int) or max_context_len < 0:
        fail("max_context_len", "a non-negative int", max_context_len)
    maxp = block_table.shape[1]
    check_range("context_lens", context_lens, 0, min(max_context_len, maxp * PAGE_SIZE))
    impl = pick_backend(backend, _PAGED, dev, "indexer_logits_paged")
    if block_table.numel() and value_checks_enabled(block_table):
        # Only pages a row can reach must be valid; rows of a padded batch may hold junk past their length.
        lens = context_lens.amax(dim=1) if n else torch.zeros(B, dtype=torch.int32, device=dev)
        used = torch.arange(maxp, device=dev)[None, :] * PAGE_SIZE < lens[:, None]
        check_range("block_table", block_table[used], 0, index_cache.shape[0] - 1, what="page ids")
    return impl(q_fp8, index_cache, weights, context_lens, block_table, max_context_len)
