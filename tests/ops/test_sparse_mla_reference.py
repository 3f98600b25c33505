"""Sparse MLA decode / prefill and merge_attention (torch backend) against a float64 brute force that
loops over rows and heads on the KV dequantised straight from the cache bytes: skipped indices (-1 and
>= N), all-invalid rows (out exactly 0, lse -inf), duplicates counting twice, h_q 1 / 3 / 16, s_q 1..4,
odd topk, the three cache formats; merge of a split key set == the whole; every ValueError."""

from __future__ import annotations

import functools
import math
import struct

import pytest
import torch

from flashdsa import ops
from flashdsa.cache import layouts
from flashdsa.ops import merge_attention

# Every call runs the PyTorch reference: the CPU default, explicit so a CUDA machine tests the same code
# (a call's own backend= still wins, for the error tests).
sparse_mla_decode = functools.partial(ops.sparse_mla_decode, backend="torch")
sparse_mla_prefill = functools.partial(ops.sparse_mla_prefill, backend="torch")

NEG_INF = float("-inf")


# ---- independent dequantisation of cache rows (from bytes) ------------------------------------------

def _dequant_rows(rows: torch.Tensor, fmt: str, kv_scale: float | None) -> torch.Tensor:
    """``rows [N, width]`` of one cache format -> ``[N, 576] float64``, decoded field by field."""
    if fmt == "bf16":
        return rows.double()
    out = torch.empty(rows.shape[0], 576, dtype=torch.float64)
    for i in range(rows.shape[0]):
        r = rows[i]
        if fmt == "fp8":
            scales = struct.unpack("<4f", bytes(r[512:528].tolist()))
            lat = r[:512].view(torch.float8_e4m3fn).double().view(4, 128)
            out[i, :512] = (lat * torch.tensor(scales, dtype=torch.float64)[:, None]).flatten()
            out[i, 512:] = r[528:656].contiguous().view(torch.bfloat16).double()
        else:
            out[i] = r.view(torch.float8_e4m3fn).double() * kv_scale
    return out


def _brute(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int):
    """``q [T, h, 576]``, ``kv [N, 576] f64``, ``indices [T, k]`` -> out [T, h, d_v] f64, lse [T, h] f64.

    Loops over rows and heads; every listed valid index counts (duplicates twice)."""
    T, h, _ = q.shape
    N = kv.shape[0]
    out = torch.zeros(T, h, d_v, dtype=torch.float64)
    lse = torch.full((T, h), NEG_INF, dtype=torch.float64)
    for t in range(T):
        sel = [i for i in indices[t].tolist() if 0 <= i < N]
        if not sel:
            continue
        K = kv[sel]  # [m, 576], duplicates kept
        for hh in range(h):
            s = (K @ q[t, hh].double()) * sm_scale
            m = float(s.max())
            e = torch.exp(s - m)
            z = float(e.sum())
            lse[t, hh] = m + math.log(z)
            out[t, hh] = (e / z) @ K[:, :d_v]
    return out, lse


def _check(out, lse, want_out, want_lse):
    """bf16 output: |out - want| <= 2^-8 |want| + 2e-4; lse in fp32; -inf and exact zeros where empty."""
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty), "lse -inf pattern differs"
    assert torch.isfinite(lse[~empty]).all() and torch.isfinite(out.float()).all()
    assert (out[empty].float() == 0).all(), "an all-invalid row must give out = 0 exactly"
    err = (out.double() - want_out).abs()
    assert (err <= 2.0 ** -8 * want_out.abs() + 2e-4).all(), f"out max err {float(err.max())}"
    lerr = (lse.double() - want_lse).abs()[~empty]
    assert (lerr <= 1e-4 + 1e-6 * want_lse.abs()[~empty]).all(), f"lse max err {float(lerr.max()) if lerr.numel() else 0}"


def _indices(rows: int, topk: int, N: int, gen: torch.Generator) -> torch.Tensor:
    """Random valid indices with duplicates, sprinkled with -1 and >= N; row 0 all -1, row 1 all >= N."""
    idx = torch.randint(0, N, (rows, topk), generator=gen)
    skip = torch.rand(rows, topk, generator=gen) < 0.25
    junk = torch.tensor([-1, N, N + 1, 2 ** 31 - 1])[torch.randint(0, 4, (rows, topk), generator=gen)]
    idx = torch.where(skip, junk, idx)
    if rows > 2:
        idx[0] = -1
        idx[1] = torch.tensor([N, 2 ** 31 - 1] * topk)[:topk]
    if rows > 3 and topk > 1:
        idx[2, :] = idx[2, 0].clamp(0, N - 1)  # one slot listed topk times
    return idx.to(torch.int32)


# ---- decode ----------------------------------------------------------------------------------------

def _cache(fmt: str, P: int, kv_scale: float | None):
    """A paged cache of format ``fmt`` with every slot written through store_mla, except slot 0 which
    holds NaN/inf-like garbage (skipped indices must not read it into the result)."""
    kv = (torch.randn(P * 64, 576) * 1.5).bfloat16()
    if fmt == "bf16":
        cache = torch.empty(P, 64, 576, dtype=torch.bfloat16)
    else:
        cache = torch.empty(P, 64, layouts.BYTES_PER_TOKEN[fmt], dtype=torch.uint8)
    layouts.store_mla(cache, torch.arange(P * 64), kv, kv_scale)
    flat = cache.view(P * 64, -1)
    if fmt == "bf16":
        flat[0] = float("nan")
    else:
        flat.view(torch.uint8)[0] = 0x7F  # e4m3 NaN everywhere (and a NaN scale / rope for 656)
    return cache


DECODE_SHAPES = [(1, 1, 1, 1), (2, 1, 3, 7), (2, 2, 16, 33), (1, 4, 3, 64), (3, 3, 1, 5)]


@pytest.mark.parametrize("fmt,kv_scale", [("bf16", None), ("fp8", None), ("fp8_raw", 0.0625)],
                         ids=["bf16", "fp8-656", "fp8-raw"])
@pytest.mark.parametrize("B,s_q,h_q,topk", DECODE_SHAPES, ids=[f"B{b}-sq{s}-h{h}-k{k}" for b, s, h, k in DECODE_SHAPES])
def test_decode_vs_brute_force(fmt, kv_scale, B, s_q, h_q, topk):
    gen = torch.Generator().manual_seed(B * 1000 + s_q * 100 + h_q * 10 + topk)
    P = 3
    cache = _cache(fmt, P, kv_scale)
    N = P * 64
    q = torch.randn(B, s_q, h_q, 576, generator=gen).bfloat16()
    idx = _indices(B * s_q, topk, N, gen)
    idx[idx == 0] = 1  # slot 0 is garbage: only ever reached as a skip stand-in
    sm_scale = 576 ** -0.5 * 1.5
    out, lse = sparse_mla_decode(q, cache, idx.view(B, s_q, topk), sm_scale, kv_scale=kv_scale, backend="torch")
    assert out.shape == (B, s_q, h_q, 512) and lse.shape == (B, s_q, h_q)
    kv = _dequant_rows(cache.view(N, -1), fmt, kv_scale)
    want_out, want_lse = _brute(q.view(B * s_q, h_q, 576), kv, idx, sm_scale, 512)
    _check(out.view(B * s_q, h_q, 512), lse.view(B * s_q, h_q), want_out, want_lse)
    out2, lse2 = sparse_mla_decode(q, cache, idx.view(B, s_q, topk), sm_scale, kv_scale=kv_scale, backend="torch")
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2)


def test_decode_fp8_raw_non_power_of_two_scale():
    """fp8 x 0.037 is not a bf16 value: the reference rounds the dequantised KV to bf16 (looser lse)."""
    gen = torch.Generator().manual_seed(5)
    cache = _cache("fp8_raw", 2, 0.037)
    q = torch.randn(2, 1, 4, 576, generator=gen).bfloat16()
    idx = torch.randint(1, 128, (2, 9), generator=gen).to(torch.int32)
    idx[1, ::2] = -1
    out, lse = sparse_mla_decode(q, cache, idx.view(2, 1, 9), 0.04, kv_scale=0.037, backend="torch")
    want_out, want_lse = _brute(q.view(2, 4, 576), _dequant_rows(cache.view(128, -1), "fp8_raw", 0.037), idx, 0.04, 512)
    fin = torch.isfinite(want_lse)
    assert fin.all()
    assert torch.allclose(lse.view(2, 4).double()[fin], want_lse[fin], atol=2e-2)
    assert torch.allclose(out.view(2, 4, 512).double(), want_out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("d_v", [1, 64, 128, 511], ids=lambda d: f"dv{d}")
def test_decode_d_v(d_v):
    gen = torch.Generator().manual_seed(d_v)
    cache = _cache("fp8", 2, None)
    q = torch.randn(2, 2, 3, 576, generator=gen).bfloat16()
    idx = torch.randint(1, 128, (4, 11), generator=gen).to(torch.int32)
    out, lse = sparse_mla_decode(q, cache, idx.view(2, 2, 11), 0.05, d_v, backend="torch")
    want_out, want_lse = _brute(q.view(4, 3, 576), _dequant_rows(cache.view(128, -1), "fp8", None), idx, 0.05, d_v)
    _check(out.view(4, 3, d_v), lse.view(4, 3), want_out, want_lse)


def test_decode_all_invalid_rows_exact():
    cache = _cache("bf16", 1, None)
    q = torch.randn(2, 3, 4, 576).bfloat16()
    idx = torch.full((2, 3, 5), -1, dtype=torch.int32)
    idx[1, 1] = torch.tensor([64, 65, 1000, -1, 2 ** 31 - 1])  # >= N = 64: skipped too
    idx[1, 2, 3] = 7  # one valid entry: lse = its score, out = its value
    out, lse = sparse_mla_decode(q, cache, idx, 0.1, backend="torch")
    empty = torch.ones(2, 3, dtype=torch.bool)
    empty[1, 2] = False
    assert torch.isneginf(lse[empty]).all()
    assert (out[empty].float() == 0).all() and not torch.signbit(out[empty].float()).any()
    v = cache.view(64, 576)[7].double()
    assert torch.allclose(lse[1, 2].double(), 0.1 * (q[1, 2].double() @ v), atol=1e-4)
    assert torch.equal(out[1, 2], cache.view(64, 576)[7, :512].expand(4, 512))


def test_duplicates_count_twice():
    kv = torch.randn(10, 576).bfloat16()
    q = torch.randn(1, 2, 576).bfloat16()
    one, lse1 = sparse_mla_prefill(q, kv, torch.tensor([[3, 5]], dtype=torch.int32), 0.05, backend="torch")
    two, lse2 = sparse_mla_prefill(q, kv, torch.tensor([[3, 3, 5, -1]], dtype=torch.int32), 0.05, backend="torch")
    s3 = 0.05 * (q[0].double() @ kv[3].double())
    s5 = 0.05 * (q[0].double() @ kv[5].double())
    want_lse = torch.logaddexp(s3 + math.log(2), s5)
    assert torch.allclose(lse2[0].double(), want_lse, atol=1e-5)
    assert torch.allclose(lse1[0].double(), torch.logaddexp(s3, s5), atol=1e-5)
    w3 = torch.exp(s3 + math.log(2) - want_lse)[:, None]
    want_out = w3 * kv[3, :512].double() + (1 - w3) * kv[5, :512].double()
    assert torch.allclose(two[0].double(), want_out, atol=2e-2, rtol=2 ** -8)
    assert not torch.allclose(one.float(), two.float(), atol=1e-3)


# ---- prefill ---------------------------------------------------------------------------------------

PREFILL_SHAPES = [(1, 1, 1, 1), (5, 3, 40, 7), (6, 16, 130, 33), (3, 3, 64, 64), (4, 1, 65, 130)]


@pytest.mark.parametrize("T,h_q,N,topk", PREFILL_SHAPES, ids=[f"T{t}-h{h}-N{n}-k{k}" for t, h, n, k in PREFILL_SHAPES])
def test_prefill_vs_brute_force(T, h_q, N, topk):
    gen = torch.Generator().manual_seed(T * 1000 + h_q * 100 + N + topk)
    kv = (torch.randn(N, 576, generator=gen) * 1.5).bfloat16()
    q = torch.randn(T, h_q, 576, generator=gen).bfloat16()
    idx = _indices(T, topk, N, gen)
    out, lse = sparse_mla_prefill(q, kv, idx, 0.06, backend="torch")
    assert out.shape == (T, h_q, 512) and lse.shape == (T, h_q)
    want_out, want_lse = _brute(q, kv.double(), idx, 0.06, 512)
    _check(out, lse, want_out, want_lse)


def test_prefill_empty_kv_and_zero_topk():
    q = torch.randn(2, 3, 576).bfloat16()
    out, lse = sparse_mla_prefill(q, torch.zeros(0, 576, dtype=torch.bfloat16),
                                  torch.full((2, 4), -1, dtype=torch.int32), 0.04, backend="torch")
    assert (out.float() == 0).all() and torch.isneginf(lse).all()
    out, lse = sparse_mla_prefill(q, torch.randn(3, 576).bfloat16(), torch.zeros(2, 0, dtype=torch.int32), 0.04,
                                  backend="torch")
    assert out.shape == (2, 3, 512) and (out.float() == 0).all() and torch.isneginf(lse).all()


def test_prefill_skip_ignores_garbage_rows():
    """A NaN / inf KV row that no valid index selects must not reach the output."""
    kv = torch.randn(8, 576).bfloat16()
    kv[0] = float("nan")
    kv[7] = float("inf")
    q = torch.randn(2, 2, 576).bfloat16()
    idx = torch.tensor([[1, -1, 2, 8], [-1, -1, -1, 100]], dtype=torch.int32)
    out, lse = sparse_mla_prefill(q, kv, idx, 0.05, backend="torch")
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse[0]).all() and torch.isneginf(lse[1]).all()
    want_out, want_lse = _brute(q, kv[:8].double().nan_to_num(), idx, 0.05, 512)
    _check(out, lse, want_out, want_lse)


# ---- merge_attention -------------------------------------------------------------------------------

@pytest.mark.parametrize("split", ["half", "random", "all-left", "all-right"])
def test_merge_split_equals_whole(split):
    gen = torch.Generator().manual_seed(len(split))
    T, h, N, topk = 6, 3, 50, 20
    kv = torch.randn(N, 576, generator=gen).bfloat16()
    q = torch.randn(T, h, 576, generator=gen).bfloat16()
    idx = torch.randint(0, N, (T, topk), generator=gen).to(torch.int32)
    idx[0] = -1  # an empty row stays empty
    if split == "half":
        left = torch.arange(topk)[None, :].expand(T, topk) < topk // 2
    elif split == "random":
        left = torch.rand(T, topk, generator=gen) < 0.5
    else:
        left = torch.full((T, topk), split == "all-left")
    ia = torch.where(left, idx, -1)
    ib = torch.where(left, -1, idx)
    oa, la = sparse_mla_prefill(q, kv, ia, 0.05, backend="torch")
    ob, lb = sparse_mla_prefill(q, kv, ib, 0.05, backend="torch")
    out, lse = merge_attention(oa, la, ob, lb)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want_out, want_lse = _brute(q, kv.double(), idx, 0.05, 512)
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty) and (out[empty].float() == 0).all()
    assert torch.allclose(lse[~empty].double(), want_lse[~empty], atol=1e-4, rtol=1e-6)
    # each part was rounded to bf16 before the merge, and the merge result is rounded again
    bound = 2.0 ** -8 * (oa.double().abs() + ob.double().abs() + want_out.abs()) + 2e-4
    assert ((out.double() - want_out).abs() <= bound).all()
    if split == "all-left":  # an empty part contributes nothing, exactly
        assert torch.equal(out, oa) and torch.equal(lse, la)
    if split == "all-right":
        assert torch.equal(out, ob) and torch.equal(lse, lb)


def test_merge_vs_formula_and_empty_parts():
    oa, ob = torch.randn(4, 5, 16), torch.randn(4, 5, 16)
    la, lb = torch.randn(4, 5) * 3, torch.randn(4, 5) * 3
    la[0] = NEG_INF
    lb[1] = NEG_INF
    la[2, :2] = NEG_INF
    lb[2, :2] = NEG_INF  # both empty
    oa[0] = 0.0  # an empty part's out is 0, as the ops return it
    out, lse = merge_attention(oa, la, ob, lb)
    assert out.dtype == torch.float32
    for i in range(4):
        for j in range(5):
            a, b = float(la[i, j]), float(lb[i, j])
            if a == NEG_INF and b == NEG_INF:
                assert lse[i, j].item() == NEG_INF and (out[i, j] == 0).all()
                continue
            m = max(a, b)
            l = m + math.log(math.exp(a - m) + math.exp(b - m))
            want = math.exp(a - l) * oa[i, j].double() + math.exp(b - l) * ob[i, j].double()
            assert abs(lse[i, j].item() - l) <= 1e-5 * max(1, abs(l))
            assert torch.allclose(out[i, j].double(), want, atol=1e-5)
    assert torch.equal(out[0], ob[0]) and torch.equal(out[1], oa[1])


def test_merge_errors():
    oa, la = torch.randn(2, 3, 8), torch.randn(2, 3)
    with pytest.raises(ValueError, match="out_a"):
        merge_attention(oa.tolist(), la, oa, la)
    with pytest.raises(ValueError, match="lse_a"):
        merge_attention(oa, la.double(), oa, la)
    with pytest.raises(ValueError, match="lse_a"):
        merge_attention(oa, la[:1], oa, la)
    with pytest.raises(ValueError, match="out_b"):
        merge_attention(oa, la, oa[..., :4], la)
    with pytest.raises(ValueError, match="out_b"):
        merge_attention(oa, la, "x", la)
    with pytest.raises(ValueError, match="lse_b"):
        merge_attention(oa, la, oa, la.bfloat16())
    with pytest.raises(ValueError, match="lse_b"):
        merge_attention(oa, la, oa, la[:, :2])


# ---- ValueErrors -----------------------------------------------------------------------------------

def _decode_args():
    return dict(q=torch.randn(2, 1, 4, 576).bfloat16(), kv_cache=torch.zeros(2, 64, 656, dtype=torch.uint8),
                indices=torch.zeros(2, 1, 8, dtype=torch.int32), sm_scale=0.1)


@pytest.mark.parametrize("name,change", [
    ("q", dict(q=torch.randn(2, 1, 4, 576).half())),
    ("q", dict(q=torch.randn(2, 4, 576).bfloat16())),
    ("q", dict(q=torch.randn(2, 1, 4, 512).bfloat16())),
    ("q", dict(q="q")),
    ("kv_cache", dict(kv_cache=torch.zeros(128, 656, dtype=torch.uint8))),
    ("kv_cache", dict(kv_cache=torch.zeros(2, 64, 576, dtype=torch.float16))),
    ("kv_cache", dict(kv_cache=torch.zeros(2, 64, 600, dtype=torch.uint8))),
    ("kv_cache", dict(kv_cache=torch.zeros(2, 32, 656, dtype=torch.uint8))),
    ("kv_cache", dict(kv_cache=torch.zeros(2, 64, 576, dtype=torch.float64))),
    ("q", dict(q=torch.randn(2, 1, 4, 576))),  # an fp32 q with a bf16 / fp8 cache is refused, not rounded
    ("kv_scale", dict(kv_cache=torch.zeros(2, 64, 576, dtype=torch.uint8))),  # raw fp8 needs kv_scale
    ("kv_scale", dict(kv_cache=torch.zeros(2, 64, 576, dtype=torch.uint8), kv_scale=0.0)),
    ("kv_scale", dict(kv_cache=torch.zeros(2, 64, 576, dtype=torch.uint8), kv_scale=-1.0)),
    ("kv_scale", dict(kv_cache=torch.zeros(2, 64, 576, dtype=torch.uint8), kv_scale=float("inf"))),
    ("kv_scale", dict(kv_cache=torch.zeros(2, 64, 576, dtype=torch.uint8), kv_scale="1")),
    ("indices", dict(indices=torch.zeros(2, 1, 8, dtype=torch.int64))),
    ("indices", dict(indices=torch.zeros(2, 2, 8, dtype=torch.int32))),
    ("indices", dict(indices=torch.zeros(2, 8, dtype=torch.int32))),
    ("indices", dict(indices=torch.zeros(3, 1, 8, dtype=torch.int32))),
    ("sm_scale", dict(sm_scale=0.0)),
    ("sm_scale", dict(sm_scale=-0.1)),
    ("sm_scale", dict(sm_scale=float("inf"))),
    ("sm_scale", dict(sm_scale=True)),
    ("sm_scale", dict(sm_scale=torch.tensor([0.1, 0.2]))),  # (a one-element tensor is a float, as torch.ops takes it)
    ("d_v", dict(d_v=0)),
    ("d_v", dict(d_v=513)),
    ("d_v", dict(d_v=512.0)),
    ("d_v", dict(d_v=True)),
    ("backend", dict(backend="cuda")),
], ids=lambda v: v if isinstance(v, str) else "")
def test_decode_errors(name, change):
    a = _decode_args()
    a.update(change)
    with pytest.raises(ValueError, match=name):
        sparse_mla_decode(**a)


def _prefill_args():
    return dict(q=torch.randn(3, 4, 576).bfloat16(), kv=torch.randn(10, 576).bfloat16(),
                indices=torch.zeros(3, 8, dtype=torch.int32), sm_scale=0.1)


@pytest.mark.parametrize("name,change", [
    ("q", dict(q=torch.randn(3, 4, 576))),
    ("q", dict(q=torch.randn(3, 1, 4, 576).bfloat16())),
    ("q", dict(q=torch.randn(3, 4, 512).bfloat16())),
    ("kv", dict(kv=torch.randn(10, 576).double())),
    ("kv", dict(kv=torch.randn(10, 512).bfloat16())),
    ("kv", dict(kv=torch.randn(10, 1, 576).bfloat16())),
    ("kv", dict(kv=torch.zeros(10, 656, dtype=torch.uint8))),
    ("indices", dict(indices=torch.zeros(3, 8, dtype=torch.int64))),
    ("indices", dict(indices=torch.zeros(4, 8, dtype=torch.int32))),
    ("indices", dict(indices=torch.zeros(3, 1, 8, dtype=torch.int32))),
    ("sm_scale", dict(sm_scale=0)),
    ("sm_scale", dict(sm_scale=float("nan"))),
    ("sm_scale", dict(sm_scale="0.1")),
    ("d_v", dict(d_v=-1)),
    ("d_v", dict(d_v=576)),
    ("backend", dict(backend="jax")),
], ids=lambda v: v if isinstance(v, str) else "")
def test_prefill_errors(name, change):
    a = _prefill_args()
    a.update(change)
    with pytest.raises(ValueError, match=name):
        sparse_mla_prefill(**a)
