"""Sparse MLA (absorbed / MQA form) in plain PyTorch, fp32 math.

For query row t and head h over the selected tokens i (index -1 or >= N is skipped)::

    s[h, i] = sm_scale * q[t, h, :576] . kv[idx[t, i], :576]
    lse[h]  = log(sum_i exp(s[h, i]))                 (natural log; -inf when nothing is valid)
    out[h]  = sum_i exp(s[h, i] - lse[h]) * kv[idx[t, i], :d_v]      (0 when nothing is valid)

A slot listed twice counts twice, as in FlashMLA.
"""

from __future__ import annotations

import torch

from flashdsa.cache.layouts import decode_mla

_CHUNK_BYTES = 256 << 20


def sparse_attention(q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                     d_v: int, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, h, 576]`` bf16 (fp32 with fp32 rows), ``kv_rows [N, width]`` (any MLA cache format, one row
    per slot), ``indices [T, k] int`` -> ``out [T, h, d_v]`` in q's dtype, ``lse [T, h] f32``."""
    T, h, d = q.shape
    N = kv_rows.shape[0]
    topk = indices.shape[1]
    if N == 0:  # every index is a skip; the stand-in gather below still needs one row to read
        kv_rows = kv_rows.new_zeros(1, kv_rows.shape[-1])
    out = torch.empty(T, h, d_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(T, h, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_BYTES // max(1, 4 * topk * (d + h)))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        idx = indices[t0:t1].long()
        valid = (idx >= 0) & (idx < N)
        k = decode_mla(kv_rows[torch.where(valid, idx, 0)], scale).float()  # [t, k, 576]
        # Skipped entries read row 0 as a stand-in: zero them, or NaN/inf there (an uninitialised
        # cache) would leak into every row with a skip through 0 * NaN.
        k = k.masked_fill(~valid[..., None], 0.0)
        s = torch.einsum("thd,tkd->thk", q[t0:t1].float(), k) * sm_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [t, h]
        # exp(-inf - (-inf)) would be NaN on empty rows; those rows get p = 0 instead.
        p = torch.where(valid[:, None, :], torch.exp(s - row_lse.nan_to_num(neginf=0.0)[..., None]), 0.0)
        out[t0:t1] = torch.einsum("thk,tkd->thd", p, k[..., :d_v])
        lse[t0:t1] = row_lse
    return out.to(q.dtype), lse


def sparse_mla_decode(q, kv_cache, indices, sm_scale, d_v, kv_scale):
    B, s_q, h_q, d = q.shape
    rows = kv_cache.reshape(-1, kv_cache.shape[-1])
    # the index width spelled out: -1 cannot be inferred from 0 rows (B = 0 or s_q = 0)
    idx = indices.reshape(B * s_q, indices.shape[-1])
    out, lse = sparse_attention(q.reshape(B * s_q, h_q, d), rows, idx, sm_scale, d_v, kv_scale)
    return out.view(B, s_q, h_q, d_v), lse.view(B, s_q, h_q)


def sparse_mla_prefill(q, kv, indices, sm_scale, d_v):
    return sparse_attention(q, kv, indices, sm_scale, d_v)


def merge_attention(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.nan_to_num(neginf=0.0)  # both parts empty: weights 0, out 0, lse -inf
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    out = wa * out_a.float() + wb * out_b.float()
    return out.to(out_a.dtype), lse


def attention_sinks(out, lse, sinks):
    """``out [..., h, d] / (1 + exp(sinks[h] - lse[..., h]))`` in fp32, in out's dtype (ops/sparse_mla/sinks.py)."""
    f = torch.where(torch.isneginf(lse), 0.0, torch.sigmoid(lse - sinks.float()))  # empty rows stay 0
    return (out.float() * f.unsqueeze(-1)).to(out.dtype)
