"""The fp32 MLA format (an fp32 model's cache rows, 2304 B a token) through sparse MLA decode / prefill and
the dense fallback, both backends, against a float64 brute force.

Tolerance, from the numerics: with fp32 operands, fp32 products and fp32 accumulation, out differs from
the float64 result by rounding alone — measured ~1e-7 max|v| on these shapes; a K = 576 dot's statistical
rounding bound is sqrt(K) 2^-24 ~ 1.4e-6 of its magnitude. Rounding the operands to tf32 (what a Triton
fp32 ``tl.dot`` does by default) moves out by 7.8e-5 max|v| on the same data, bf16 by 7.5e-4. The bound
used, 2^-18 max|v| (3.8e-6), passes the first and fails the other two, so it checks that the kernels
really compute in IEEE fp32; lse within 2^-18 absolute likewise (tf32: ~1e-4).
"""

from __future__ import annotations

import pytest
import torch

from flashdsa import ops
from flashdsa.cache.layouts import PAGE_SIZE, encode_mla
from flashdsa.ops.sparse_mla import triton as tri
from flashdsa.testing.inputs import poison_torch_empty, rows_subset

SM_SCALE = 576 ** -0.5
TOL = 2.0 ** -18
BACKENDS = ["torch", "triton"]


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    poison_torch_empty(monkeypatch)


def brute(q: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, d_v: int = 512):
    """float64 attention of ``q [R, h, 576]`` over ``rows[idx[r]]`` (skips: < 0 or >= N) -> out, lse."""
    R, h, _ = q.shape
    out = torch.zeros(R, h, d_v, dtype=torch.float64)
    lse = torch.full((R, h), float("-inf"), dtype=torch.float64)
    for r in range(R):
        sel = idx[r].long()
        sel = sel[(sel >= 0) & (sel < rows.shape[0])]
        if sel.numel() == 0:
            continue
        k = rows[sel].double()
        s = q[r].double() @ k.T * SM_SCALE
        lse[r] = torch.logsumexp(s, -1)
        out[r] = torch.softmax(s, -1) @ k[:, :d_v]
    return out, lse


def check(out, lse, want_out, want_lse, vmax: float):
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse).cpu(), empty), "empty rows differ"
    assert (out[empty.to(out.device)] == 0).all(), "empty rows must give out = 0"
    err = (out.double().cpu() - want_out).abs().max().item()
    assert err <= TOL * vmax, f"out: {err:.3g} > {TOL * vmax:.3g} (2^-18 max|v|)"
    lerr = (lse.double().cpu()[~empty] - want_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    assert lerr <= TOL, f"lse: {lerr:.3g} > 2^-18"


def _indices(shape, n, device, g):
    idx = torch.randint(-3, n + 3, shape, generator=g).to(torch.int32)  # skips on both sides
    idx.view(-1, shape[-1])[0] = -1                                     # an empty row
    return idx.to(device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,s_q,h_q,topk,pages,d_v", [
    pytest.param(2, 1, 20, 130, 3, 512, id="B2-s1-H20-k130"),
    pytest.param(1, 3, 4, 65, 2, 200, id="B1-s3-H4-k65-dv200"),
    pytest.param(3, 1, 1, 16, 1, 512, id="B3-s1-H1-k16"),
])
def test_decode_fp32_cache(device, backend, B, s_q, h_q, topk, pages, d_v):
    g = torch.Generator().manual_seed(B * 100 + h_q)
    kv = torch.randn(pages * PAGE_SIZE, 576, generator=g)
    cache = encode_mla(kv, "fp32").view(pages, PAGE_SIZE, 576).to(device)
    q = torch.randn(B, s_q, h_q, 576, generator=g).to(device)
    idx = _indices((B, s_q, topk), pages * PAGE_SIZE, device, g)
    out, lse = ops.sparse_mla_decode(q, cache, idx, SM_SCALE, d_v, backend=backend)
    assert out.shape == (B, s_q, h_q, d_v)
    want = brute(q.reshape(-1, h_q, 576).cpu(), kv, idx.reshape(-1, topk).cpu(), d_v)
    check(out.reshape(-1, h_q, d_v), lse.reshape(-1, h_q), *want, float(kv[:, :d_v].abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_fp32_kv(device, backend):
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(150, 576, generator=g).to(device)
    q = torch.randn(5, 16, 576, generator=g).to(device)
    idx = _indices((5, 90), 150, device, g)
    out, lse = ops.sparse_mla_prefill(q, kv, idx, SM_SCALE, backend=backend)
    check(out, lse, *brute(q.cpu(), kv.cpu(), idx.cpu()), float(kv[:, :512].abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_fp32_kv(device, backend):
    g = torch.Generator().manual_seed(6)
    q_lens, kv_lens = [3, 0, 2], [40, 7, 66]
    kv = torch.randn(sum(kv_lens), 576, generator=g).to(device)
    q = torch.randn(sum(q_lens), 4, 576, generator=g).to(device)
    cq = torch.tensor([0, 3, 3, 5], dtype=torch.int32, device=device)
    ck = torch.tensor([0, 40, 47, 113], dtype=torch.int32, device=device)
    out, lse = ops.dense_mla_prefill(q, kv, cq, ck, SM_SCALE, backend=backend)
    # the same causal attention as index lists: query i of request b sees its first kv_len - q_len + i + 1 keys
    rows = []
    for nq, nk, k0 in zip(q_lens, kv_lens, [0, 40, 47]):
        rows += [torch.cat((torch.arange(k0, k0 + nk - nq + i + 1), torch.full((66 - nk + nq - i - 1,), -1)))
                 for i in range(nq)]
    check(out, lse, *brute(q.cpu(), kv.cpu(), torch.stack(rows)), float(kv[:, :512].abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_query_widens_exactly(device, backend):
    """A bf16 query next to fp32 KV is widened (exactly), so it gives the fp32 query's numbers bit for bit;
    an fp32 query next to a bf16 / fp8 cache is refused (rounding it is the caller's decision)."""
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(2, PAGE_SIZE, 576, generator=g).to(device)
    q = torch.randn(1, 1, 8, 576, generator=g).to(device).bfloat16()
    idx = _indices((1, 1, 40), 2 * PAGE_SIZE, device, g)[..., 1:].contiguous()
    a = ops.sparse_mla_decode(q, cache, idx, SM_SCALE, backend=backend)
    b = ops.sparse_mla_decode(q.float(), cache, idx, SM_SCALE, backend=backend)
    assert a[0].dtype == torch.float32 and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="q: expected dtype torch.bfloat16 with a bf16 cache"):
        ops.sparse_mla_decode(q.float(), cache.bfloat16(), idx, SM_SCALE, backend=backend)
    with pytest.raises(ValueError, match="q: expected dtype torch.bfloat16 with a fp8 cache"):
        ops.sparse_mla_decode(q.float(), torch.zeros(2, PAGE_SIZE, 656, dtype=torch.uint8, device=device), idx,
                              SM_SCALE, backend=backend)


def test_fp32_default_launch():
    """The fp32 path's own tiles (small: IEEE fp32 dots run on the FMA units from registers), never the
    bf16 / fp8 defaults', and no slots-ahead pipelining."""
    cfg = tri.launch_config(128, "fp32", 1, 2048, torch.device("cpu"))
    assert (cfg.kernel, cfg.block_h, cfg.block_n, cfg.num_stages, cfg.slots_ahead) == ("heads_m", 16, 16, 1, False)


# ---- GPU sizes ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B,h_q", [(1, 16), (8, 128), (2, 4)])
def test_decode_fp32_gpu_sizes(B, h_q):
    """Compiled kernels at a decode shape (topk 2048, split-K): IEEE fp32, not tf32 (module docstring)."""
    g = torch.Generator().manual_seed(B + h_q)
    pages, topk = 256, 2048
    kv = torch.randn(pages * PAGE_SIZE, 576, generator=g)
    cache = kv.view(pages, PAGE_SIZE, 576).cuda()
    q = torch.randn(B, 1, h_q, 576, generator=g).cuda()
    idx = torch.randint(0, pages * PAGE_SIZE, (B, 1, topk), generator=g).to(torch.int32).cuda()
    out, lse = ops.sparse_mla_decode(q, cache, idx, SM_SCALE, backend="triton")
    rows = rows_subset(B, 4).cpu()
    want = brute(q[:, 0].cpu()[rows], kv, idx[:, 0].cpu()[rows])
    check(out[:, 0][rows.cuda()], lse[:, 0][rows.cuda()], *want, float(kv[:, :512].abs().max()))


@pytest.mark.gpu
def test_prefill_and_dense_fp32_gpu_sizes():
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(4096, 576, generator=g)
    q = torch.randn(256, 16, 576, generator=g)
    idx = torch.randint(0, 4096, (256, 2048), generator=g).to(torch.int32)
    out, lse = ops.sparse_mla_prefill(q.cuda(), kv.cuda(), idx.cuda(), SM_SCALE, backend="triton")
    rows = rows_subset(256, 6).cpu()
    check(out.cpu()[rows], lse.cpu()[rows], *brute(q[rows], kv, idx[rows]), float(kv[:, :512].abs().max()))
    cq = torch.tensor([0, 256], dtype=torch.int32).cuda()
    ck = torch.tensor([0, 1024], dtype=torch.int32).cuda()
    out, lse = ops.dense_mla_prefill(q.cuda(), kv[:1024].cuda(), cq, ck, SM_SCALE, backend="triton")
    causal = torch.stack([torch.where(torch.arange(1024) <= 768 + i, torch.arange(1024), -1) for i in range(256)])
    check(out.cpu()[rows], lse.cpu()[rows], *brute(q[rows], kv[:1024], causal[rows]), float(kv[:, :512].abs().max()))
