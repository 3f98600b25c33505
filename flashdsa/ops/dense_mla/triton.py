"""Dense causal MLA on the tensor cores: the sparse prefill kernel over each query's whole causal range.

The dense fallback runs while every context fits in ``index_topk`` (docs/DSA.md §6), so a query sees at most a
few thousand keys: the sparse prefill kernel (``ops/sparse_mla/kernels.py``, batch-invariant, bf16
operands with fp32 accumulation and softmax) given every visible key as its index list computes exactly
the causal attention, without a kernel of its own. The fp32 torch reference computes the same math with
fp32 einsums, ~20x the time on a GPU. Index lists are built per chunk of query rows so they stay under
``INDEX_BYTES`` whatever T is.
"""

from __future__ import annotations

import torch

from flashdsa.ops._triton_utils import cdiv
from flashdsa.ops.sparse_mla import triton as sparse

INDEX_BYTES = 64 << 20   # int32 index lists built at once: chunks of query rows
WIDTH_ALIGN = 64         # index-list width: the longest kv_len rounded up (a few Triton specialisations)


def dense_mla_prefill(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
                      sm_scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments as :func:`flashdsa.ops.dense_mla_prefill` (validated there).

    ``q [T, h_q, D]``, ``kv [N, D]`` (D 576, or 512 for NoPE rows) both bf16 or both fp32, ``cu_seqlens_q / cu_seqlens_kv [B + 1]
    int32`` -> ``out [T, h_q, d_v]`` in q's dtype, ``lse [T, h_q] f32``. Reads the offsets on the host
    (a prefill op).
    """
    T, h_q, _ = q.shape
    dev = q.device
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    q_lens = [b - a for a, b in zip(cq, cq[1:])]
    kv_lens = [b - a for a, b in zip(ck, ck[1:])]
    # per query row: the request's first key row, and how many keys it sees (its position + 1)
    start = torch.repeat_interleave(torch.tensor(ck[:-1], dtype=torch.int64), torch.tensor(q_lens, dtype=torch.int64))
    seen = torch.cat([torch.arange(kl - ql + 1, kl + 1) for ql, kl in zip(q_lens, kv_lens)] or [torch.zeros(0)])
    start, seen = start.to(dev), seen.to(device=dev, dtype=torch.int64)
    width = max(WIDTH_ALIGN, cdiv(max(kv_lens, default=0), WIDTH_ALIGN) * WIDTH_ALIGN)
    cols = torch.arange(width, device=dev)
    out = torch.empty(T, h_q, d_v, dtype=q.dtype, device=dev)
    lse = torch.empty(T, h_q, dtype=torch.float32, device=dev)
    rows = max(1, INDEX_BYTES // (4 * width))
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        # [rows, width] int32: every visible key of each row, -1 past it
        idx = torch.where(cols[None, :] < seen[r0:r1, None], start[r0:r1, None] + cols[None, :], -1).to(torch.int32)
        out[r0:r1], lse[r0:r1] = sparse.sparse_mla_prefill(q[r0:r1], kv, idx, sm_scale, d_v)
    return out, lse
