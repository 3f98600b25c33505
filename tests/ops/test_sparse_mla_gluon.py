"""The Gluon sparse-MLA decode kernel (``ops/sparse_mla/gluon.py``, sm_90) and the rule that picks it.

Triton's interpreter cannot run Gluon, so the kernel's own tests need an sm_90 GPU (``-m gpu``): the fp32
reference on dequantised inputs, NaN-poisoned outputs, ragged -1 padding, other negatives and slots past
the cache, rows with no valid slot, s_q 1 / 2 / 4, h_q 64 / 128 / 192, short and long top-k lists, and the
planned second launch. On the CPU: the rule and the error of a forced ``backend="gluon"`` it does not
apply to.

Tolerance, from the numerics: the kernel rounds P to bf16 (|dp| <= 2^-8 p, as FlashMLA does) and the
output to bf16 (2^-8 |out|), the rest is fp32, so ``|out - ref| <= 2^-8 (max |v| + |ref|)`` elementwise,
with FlashMLA's cosine diff (5e-6) and lse tolerance on top. (FlashMLA's elementwise 1e-3 + 2/128 |ref|
holds on long lists, where the rounding errors average out; on 64-token lists at h_q 64 it measured
1.4e-3 on a 0.012 element here, inside the bound above.)
"""

from __future__ import annotations

import pytest
import torch
from test_sparse_mla_triton import LSE_TOL, SM_SCALE, make_cache, make_indices

from flashdsa.cache.layouts import PAGE_SIZE, decode_mla
from flashdsa.ops import sparse_mla_decode
from flashdsa.ops.sparse_mla import gluon
from flashdsa.testing.compare import assert_close

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon kernel needs an sm_90 GPU")


def check(out, lse, ref_out, ref_lse, cache):
    """The bound of the module docstring, FlashMLA's cosine diff and lse tolerance, exact empty rows."""
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close(lse, ref_lse, name="lse", **LSE_TOL)
    v_max = decode_mla(cache.view(-1, cache.shape[-1]))[:, :512].abs().max().item()
    err = (out.float() - ref_out.float()).abs()
    bound = 2.0 ** -8 * (v_max + ref_out.float().abs()) + 1e-6
    assert (err <= bound).all(), f"out: |out - ref| {err.max().item():.3g} exceeds 2^-8 (max|v| + |ref|)"
    assert_close(out, ref_out, name="out", atol=float("inf"), max_cos_diff=5e-6)  # the cosine diff (bound above)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(out[empty].float(), torch.zeros_like(out[empty].float())), "empty rows must give out = 0"


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    from flashdsa.testing.inputs import poison_torch_empty
    poison_torch_empty(monkeypatch)


def _inputs(device, B, s_q, h_q, topk, pages, fmt="fp8"):
    cache = make_cache(fmt, pages, device)
    q = torch.randn(B, s_q, h_q, 576, device=device).to(torch.bfloat16)
    idx = make_indices((B, s_q, topk), pages * PAGE_SIZE, device)
    return q, cache, idx


@pytest.mark.parametrize("fmt,h_q,d_v,why", [
    ("fp8", 64, 512, "an sm_90 GPU"), ("bf16", 64, 512, "the fp8 656-B cache"),
    ("fp8", 32, 512, "h_q a multiple of 64"), ("fp8", 128, 256, "d_v 512")])
def test_rule_says_why_not(fmt, h_q, d_v, why):
    """``unsupported`` names the first requirement a call misses; a forced backend="gluon" raises it."""
    q, cache, idx = _inputs("cpu", 1, 1, h_q, 8, 1, fmt)
    assert why in gluon.unsupported(q, cache, fmt, d_v)
    with pytest.raises(ValueError, match=f"^backend: expected 'gluon' for a call it supports: it needs .*{why}"):
        sparse_mla_decode(q, cache, idx, SM_SCALE, d_v, backend="gluon")


DECODE_CASES = [
    # B, s_q, h_q, topk, pages
    pytest.param(2, 1, 64, 64, 3, id="B2-s1-H64-k64"),
    pytest.param(1, 1, 128, 130, 4, id="B1-s1-H128-k130"),
    pytest.param(2, 2, 128, 2048, 40, id="B2-s2-H128-k2048"),
    pytest.param(3, 4, 64, 100, 5, id="B3-s4-H64-k100"),
    pytest.param(2, 1, 192, 1, 1, id="B2-s1-H192-k1"),
    pytest.param(4, 1, 128, 2048, 64, id="B4-s1-H128-k2048"),
    pytest.param(2, 1, 0, 64, 3, id="B2-s1-H0-k64"),  # no heads: nothing to launch
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("B,s_q,h_q,topk,pages", DECODE_CASES)
def test_gluon_decode_matches_reference(B, s_q, h_q, topk, pages):
    q, cache, idx = _inputs("cuda", B, s_q, h_q, topk, pages)
    assert gluon.unsupported(q, cache, "fp8", 512) is None
    ref_out, ref_lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="torch")
    assert torch.isneginf(ref_lse[0, 0]).all()  # the all-invalid row really is empty
    for _ in range(2):  # the second call launches from the plan
        out, lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="gluon")
        assert out.shape == (B, s_q, h_q, 512) and lse.shape == (B, s_q, h_q)
        check(out, lse, ref_out, ref_lse, cache)


@pytest.mark.gpu
@needs_sm90
def test_default_backend_is_gluon_where_it_applies(monkeypatch):
    """On sm_90 the default picks Gluon for fp8 h_q 128 and Triton for h_q 16; the same bits as forcing it."""
    q, cache, idx = _inputs("cuda", 2, 1, 128, 256, 8)
    forced = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="gluon")
    default = sparse_mla_decode(q, cache, idx, SM_SCALE)
    assert torch.equal(forced[0], default[0]) and torch.equal(forced[1], default[1])
    calls = []
    real = gluon.sparse_mla_decode
    monkeypatch.setattr(gluon, "sparse_mla_decode", lambda *a, **k: calls.append(a[0].shape[2]) or real(*a, **k))
    sparse_mla_decode(q, cache, idx, SM_SCALE)
    sparse_mla_decode(q[:, :, :16].contiguous(), cache, idx, SM_SCALE)
    assert calls == [128]
