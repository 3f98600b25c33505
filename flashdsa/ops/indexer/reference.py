"""Lightning-indexer logits in plain PyTorch, fp32 (docs/DSA.md §3 step 6).

    logit[t, s] = k_scale[s] * sum_h weights[t, h] * ReLU(q_fp8[t, h] . k_fp8[s])

fp8 operands are upcast to fp32 exactly; the dot, ReLU, head sum and key scale follow the order the
kernels use. Rows are processed in chunks so the [rows, H, keys] intermediate stays under ~256 MB.
"""

from __future__ import annotations

import torch

from flashdsa.cache.layouts import PAGE_SIZE, index_page_views

_CHUNK_BYTES = 256 << 20


def _scores(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``q [t, H, D] f32, k [n, D] f32, k_scale [n], weights [t, H] -> [t, n] f32``."""
    s = torch.einsum("thd,nd->thn", q, k).relu_()
    return torch.einsum("thn,th->tn", s, weights) * k_scale[None, :]


def indexer_logits_ragged(q_fp8, k_fp8, k_scale, weights, ks, ke):
    T, H, _ = q_fp8.shape
    N = k_fp8.shape[0]
    out = torch.full((T, N), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    k = k_fp8.float()
    pos = torch.arange(N, device=q_fp8.device)
    step = max(1, _CHUNK_BYTES // max(1, 4 * H * N))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        logits = _scores(q_fp8[t0:t1].float(), k, k_scale, weights[t0:t1])
        visible = (pos[None, :] >= ks[t0:t1, None]) & (pos[None, :] < ke[t0:t1, None])
        out[t0:t1] = torch.where(visible, logits, float("-inf"))
    return out


def indexer_logits_paged(q_fp8, index_cache, weights, context_lens, block_table, max_context_len):
    B, n, H, _ = q_fp8.shape
    keys, scales = index_page_views(index_cache)
    out = torch.full((B * n, max_context_len), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    lens = context_lens.cpu()
    for b in range(B):
        L = int(lens[b].max()) if n else 0
        if L == 0:
            continue
        pages = block_table[b, : (L + PAGE_SIZE - 1) // PAGE_SIZE].long()
        k = keys[pages].reshape(-1, keys.shape[-1])[:L].float()
        k_scale = scales[pages].reshape(-1)[:L]
        logits = _scores(q_fp8[b].float(), k, k_scale, weights[b * n:(b + 1) * n])
        # Row (b, j) sees positions < context_lens[b, j]: a draft never sees the drafts after it.
        visible = torch.arange(L, device=q_fp8.device)[None, :] < context_lens[b, :, None]
        out[b * n:(b + 1) * n, :L] = torch.where(visible, logits, float("-inf"))
    return out
