"""dense_mla_prefill (torch backend) against a float64 brute force looping over requests, queries and
heads: cached prefixes (kv_len > q_len), several requests, q_len 1 and 0; agreement with sparse MLA
over every visible key; every ValueError."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from flashdsa import ops

# Every call runs the PyTorch reference: the CPU default, explicit so a CUDA machine tests the same code
# (a call's own backend= still wins, for the error tests).
dense_mla_prefill = functools.partial(ops.dense_mla_prefill, backend="torch")
sparse_mla_prefill = functools.partial(ops.sparse_mla_prefill, backend="torch")

NEG_INF = float("-inf")


def _brute(q, kv, q_lens, kv_lens, sm_scale, d_v):
    T, h, _ = q.shape
    out = torch.zeros(T, h, d_v, dtype=torch.float64)
    lse = torch.full((T, h), NEG_INF, dtype=torch.float64)
    q0 = k0 = 0
    for nq, nk in zip(q_lens, kv_lens):
        for i in range(nq):
            pos = nk - nq + i  # absolute position of query i inside its request
            K = kv[k0:k0 + pos + 1].double()  # keys 0 .. pos
            for hh in range(h):
                s = (K @ q[q0 + i, hh].double()) * sm_scale
                m = float(s.max())
                e = torch.exp(s - m)
                z = float(e.sum())
                lse[q0 + i, hh] = m + math.log(z)
                out[q0 + i, hh] = (e / z) @ K[:, :d_v]
        q0 += nq
        k0 += nk
    return out, lse


def _cu(lens):
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)


CASES = [
    ([1], [1], 1),
    ([1], [70], 3),            # decode-like: one query over a cached prefix
    ([5], [5], 2),             # no prefix
    ([3, 1, 4], [40, 1, 4], 3),
    ([0, 2, 1], [7, 65, 64], 16),  # a request with no new queries
    ([64, 1], [65, 130], 1),
]


@pytest.mark.parametrize("q_lens,kv_lens,h", CASES,
                         ids=["q" + ",".join(map(str, q)) + "-kv" + ",".join(map(str, k)) + f"-h{h}" for q, k, h in CASES])
def test_dense_vs_brute_force(q_lens, kv_lens, h):
    gen = torch.Generator().manual_seed(sum(q_lens) * 100 + sum(kv_lens) + h)
    T, N = sum(q_lens), sum(kv_lens)
    q = torch.randn(T, h, 576, generator=gen).bfloat16()
    kv = (torch.randn(N, 576, generator=gen) * 1.5).bfloat16()
    sm_scale = 576 ** -0.5 * 2
    out, lse = dense_mla_prefill(q, kv, _cu(q_lens), _cu(kv_lens), sm_scale, backend="torch")
    assert out.dtype == torch.bfloat16 and out.shape == (T, h, 512)
    assert lse.dtype == torch.float32 and lse.shape == (T, h)
    want_out, want_lse = _brute(q, kv, q_lens, kv_lens, sm_scale, 512)
    assert torch.isfinite(lse).all() and torch.isfinite(out.float()).all()
    assert ((lse.double() - want_lse).abs() <= 1e-4 + 1e-6 * want_lse.abs()).all()
    assert ((out.double() - want_out).abs() <= 2.0 ** -8 * want_out.abs() + 2e-4).all()


def test_dense_d_v_and_first_query_sees_one_key():
    q_lens, kv_lens = [3], [3]
    q = torch.randn(3, 2, 576).bfloat16()
    kv = torch.randn(3, 576).bfloat16()
    out, lse = dense_mla_prefill(q, kv, _cu(q_lens), _cu(kv_lens), 0.05, 100)
    assert out.shape == (3, 2, 100)
    # query 0 sees only key 0: out = its value exactly, lse = its score
    assert torch.equal(out[0], kv[0, :100].expand(2, 100))
    assert torch.allclose(lse[0].double(), 0.05 * (q[0].double() @ kv[0].double()), atol=1e-5)
    want_out, want_lse = _brute(q, kv, q_lens, kv_lens, 0.05, 100)
    assert torch.allclose(out.double(), want_out, atol=2e-4, rtol=2 ** -8)


def test_dense_equals_sparse_over_visible_keys():
    q_lens, kv_lens = [2, 3], [10, 3]
    q = torch.randn(5, 4, 576).bfloat16()
    kv = torch.randn(13, 576).bfloat16()
    dense, dlse = dense_mla_prefill(q, kv, _cu(q_lens), _cu(kv_lens), 0.07)
    idx = torch.full((5, 10), -1, dtype=torch.int32)
    rows = [(0, 9), (0, 10), (10, 11), (10, 12), (10, 13)]  # [first key, last visible key + 1)
    for t, (a, b) in enumerate(rows):
        idx[t, :b - a] = torch.arange(a, b)
    sparse, slse = sparse_mla_prefill(q, kv, idx, 0.07)
    assert torch.allclose(dlse, slse, atol=1e-5)
    assert torch.allclose(dense.float(), sparse.float(), atol=2 ** -8, rtol=2 ** -7)


def test_dense_no_queries():
    out, lse = dense_mla_prefill(torch.zeros(0, 2, 576, dtype=torch.bfloat16), torch.randn(5, 576).bfloat16(),
                                 _cu([0]), _cu([5]), 0.1)
    assert out.shape == (0, 2, 512) and lse.shape == (0, 2)


# ---- ValueErrors -----------------------------------------------------------------------------------

def _args():
    return dict(q=torch.randn(4, 2, 576).bfloat16(), kv=torch.randn(9, 576).bfloat16(),
                cu_seqlens_q=_cu([1, 3]), cu_seqlens_kv=_cu([5, 4]), sm_scale=0.1)


@pytest.mark.parametrize("name,change", [
    ("q", dict(q=torch.randn(4, 2, 576))),
    ("q", dict(q=torch.randn(4, 576).bfloat16())),
    ("q", dict(q=torch.randn(4, 2, 512).bfloat16())),
    ("kv", dict(kv=torch.randn(9, 576).double())),
    ("kv", dict(kv=torch.randn(9, 512).bfloat16())),
    ("kv", dict(kv=torch.randn(9, 1, 576).bfloat16())),
    ("cu_seqlens_q", dict(cu_seqlens_q=_cu([1, 3]).long())),
    ("cu_seqlens_q", dict(cu_seqlens_q=_cu([1, 3])[None])),
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.zeros(0, dtype=torch.int32), cu_seqlens_kv=torch.zeros(0, dtype=torch.int32))),
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([1, 2, 4], dtype=torch.int32))),  # must start at 0
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32))),  # must end at T
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 5, 4], dtype=torch.int32))),  # decreasing
    ("cu_seqlens_kv", dict(cu_seqlens_kv=_cu([5, 4]).long())),
    ("cu_seqlens_kv", dict(cu_seqlens_kv=_cu([5, 2, 2]))),
    ("cu_seqlens_kv", dict(cu_seqlens_kv=torch.tensor([1, 5, 9], dtype=torch.int32))),
    ("cu_seqlens_kv", dict(cu_seqlens_kv=torch.tensor([0, 5, 8], dtype=torch.int32))),  # must end at N
    ("cu_seqlens_kv", dict(cu_seqlens_kv=torch.tensor([0, 7, 9], dtype=torch.int32))),  # kv_len 2 < q_len 3
    ("sm_scale", dict(sm_scale=0.0)),
    ("sm_scale", dict(sm_scale=-2)),
    ("sm_scale", dict(sm_scale=None)),
    ("d_v", dict(d_v=0)),
    ("d_v", dict(d_v=513)),
    ("d_v", dict(d_v=128.0)),
    ("backend", dict(backend="cpu")),
], ids=lambda v: v if isinstance(v, str) else "")
def test_dense_errors(name, change):
    a = _args()
    a.update(change)
    with pytest.raises(ValueError, match=name):
        dense_mla_prefill(**a)
