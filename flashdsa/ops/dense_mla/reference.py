"""Dense causal MLA (the fallback for short contexts) in plain PyTorch, fp32 math.

Request b has q_len queries at the END of its kv_len keys (a prefix of kv_len - q_len cached tokens):
query i sits at position kv_len - q_len + i and sees keys 0 .. kv_len - q_len + i.
"""

from __future__ import annotations

import torch


def dense_mla_prefill(q, kv, cu_seqlens_q, cu_seqlens_kv, sm_scale, d_v):
    T, h, _ = q.shape
    out = torch.zeros(T, h, d_v, dtype=torch.float32, device=q.device)
    lse = torch.full((T, h), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        nq, nk = q1 - q0, k1 - k0
        if nq == 0 or nk == 0:
            continue
        k = kv[k0:k1].float()
        s = torch.einsum("thd,nd->thn", q[q0:q1].float(), k) * sm_scale
        qpos = torch.arange(nk - nq, nk, device=q.device)
        visible = torch.arange(nk, device=q.device)[None, :] <= qpos[:, None]  # [nq, nk]
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        lse[q0:q1] = torch.logsumexp(s, dim=-1)
        out[q0:q1] = torch.einsum("thn,nd->thd", torch.softmax(s, dim=-1), k[:, :d_v])
    return out.to(q.dtype), lse
