"""DeepSeek-V4's lightning indexer over compressed keys: which entries a CSA query attends to.

Scores have DSA's form over entries instead of tokens (HF's ``DeepseekV4IndexerScorer``)::

    score[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e]) * d^-0.5,   w = weights_proj(x_t) * H^-0.5

and a query at position p may see entry e only once the entry's window is closed, ``e < (p + 1) // rate``
(HF's ``causal_threshold``). Each query keeps its ``topk`` best visible entries, -1 past the visible count.

Two paths, as for DSA's indexer (docs/DSA.md §3):

* :func:`select_exact` — HF's numbers: the scores in HF's op order in fp32 and ``torch.topk``'s picks (ties as
  torch breaks them), so exact mode selects what HF selects.
* :func:`select_fp8` — flashdsa's kernels: e4m3 queries and keys with per-key scales through
  ``ops.indexer_logits_ragged`` (every query row a range ``[0, (p + 1) // rate)`` of the entries), exact top-k
  with our deterministic tie rule through ``ops.topk_transform``. Its keys are the entries quantised once, as
  the paged indexer cache would store them (``quant.act_quant``, block-128 UE8M0 scales).
"""

from __future__ import annotations

import torch

from flashdsa import ops
from flashdsa.cache.layouts import INDEX_DIM
from flashdsa.quant import act_quant, hadamard


def visible_entries(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """``[T] int32``: how many entries query ``positions [T]`` may see, ``(p + 1) // rate``."""
    return ((positions.long() + 1) // rate).to(torch.int32)


def scores_exact(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                 rate: int) -> torch.Tensor:
    """``q [B, S, H, d]`` (RoPE applied), ``keys [B, E, d]``, ``weights [B, S, H]`` (already scaled by H^-0.5),
    ``positions [S]`` or ``[B, S]`` (position ids: a padded row's are its own) -> ``[B, S, E] float32`` scores in
    HF's ops and layout, -inf at entries the query cannot see yet."""
    s = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))  # [B, S, H, E]
    s = torch.relu(s) * q.shape[-1] ** -0.5
    s = (s * weights.float().unsqueeze(-1)).sum(dim=2)
    future = torch.arange(keys.shape[1], device=q.device) >= visible_entries(positions, rate).unsqueeze(-1)
    return s.masked_fill(future, float("-inf"))


def select_exact(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, rate: int,
                 topk: int) -> torch.Tensor:
    """HF's selection (shapes as :func:`scores_exact`): ``[B, S, topk] int32`` entry indices in ``torch.topk``'s
    order (best first), -1 for picks the query cannot see and past the entries there are."""
    s = scores_exact(q, keys, weights, positions, rate)
    k = min(topk, keys.shape[1])
    picks = s.topk(k, dim=-1).indices if k else s.new_zeros(*s.shape[:2], 0, dtype=torch.long)
    picks = torch.where(picks >= visible_entries(positions, rate).unsqueeze(-1).long(), -1, picks)
    return torch.nn.functional.pad(picks, (0, topk - k), value=-1).to(torch.int32)


def select_fp8(q_fp8: torch.Tensor, keys_fp8: torch.Tensor, key_scales: torch.Tensor, weights: torch.Tensor,
               positions: torch.Tensor, rate: int, topk: int, *, backend: str | None = None) -> torch.Tensor:
    """flashdsa's selection: ``q_fp8 [B, S, H, 128] e4m3``, ``keys_fp8 [B, E, 128] e4m3`` with ``key_scales
    [B, E] f32``, ``weights [B, S, H] f32`` (scaled by H^-0.5 and d^-0.5 already, as flashdsa folds them),
    ``positions [S]`` or ``[B, S]`` -> ``[B, S, topk] int32`` entry indices (the selected set in position order, -1
    padding), exact for the fp8 scores: every request's rows in one ragged launch over its own keys (the
    fused op: the logits' memory bounded, the rows' bounds read back once; decode scores paged keys instead)."""
    B, S, H, d = q_fp8.shape
    E = keys_fp8.shape[1]
    if E == 0:
        return torch.full((B, S, topk), -1, dtype=torch.int32, device=q_fp8.device)
    first = (E * torch.arange(B, device=q_fp8.device, dtype=torch.int32))[:, None]
    ks = first.expand(B, S).reshape(-1).contiguous()
    ke = (first + visible_entries(positions, rate).to(q_fp8.device).expand(B, S)).reshape(-1)
    picks = ops.indexer_topk_ragged(q_fp8.reshape(B * S, H, d), keys_fp8.reshape(B * E, d), key_scales.reshape(-1),
                                    weights.reshape(B * S, H), ks, ke, topk, backend=backend)
    return picks.view(B, S, topk)


def quantize(x: torch.Tensor, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys or queries for :func:`select_fp8`: ``x [..., d]`` (RoPE applied) rotated by the Hadamard
    transform (dot products unchanged, outliers spread: docs/DSA.md §3) and quantised to e4m3 with one UE8M0
    scale a row (d <= 128; d = 128 in the releases) -> ``(x_fp8 [..., d], scale [...] float32)``.

    d = 128 goes through ``ops.indexer_quant`` (DSA's indexer numerics, one launch on CUDA where the torch
    composition is ~70 small kernels) with an identity RoPE — V4 rotates before, on its trailing channels — so
    the rotated row is rounded to x's dtype before the e4m3 cast, as DSA's keys are."""
    d = x.shape[-1]
    if d > 128 or d & (d - 1):
        raise ValueError(f"x: expected a power-of-two head dim <= 128 (one scale a row), got {d}")
    if d == INDEX_DIM and x.dtype in (torch.bfloat16, torch.float32):
        rows = x.reshape(-1, d)
        ones = torch.ones(rows.shape[0], d // 4, dtype=torch.float32, device=x.device)
        x_fp8, scale = ops.indexer_quant(rows, ones, torch.zeros_like(ones), False, backend=backend)
        return x_fp8.view(x.shape), scale.view(x.shape[:-1])
    x_fp8, scale = act_quant(hadamard(x.float()), block=d)
    return x_fp8, scale[..., 0]
