"""dense_mla_prefill, Triton backend (the sparse prefill kernel over every visible key) against the fp32
torch reference: causal masks with cached prefixes, requests without new queries, chunked index lists,
poisoned outputs. Runs under TRITON_INTERPRET=1 on CPU; a v32-sized case on the GPU.

The tolerance on ``out``: on the GPU the kernel rounds the softmax weights P to bf16 for the PV dot
(as FlashMLA does) and rounds out to bf16, so |out - ref| <= 2^-9 sum_i p_i |v_i| + 2^-9 |out| <=
2^-8 max|v|. Causal rows that see a handful of keys do not average that error away (the sparse kernel's
tests, with ~100 random keys a row, do): a fixed atol of 8e-4 failed 6 of these cases on the H200,
exactly the 6 a torch emulation of those numerics fails, while the emulation stays within 2^-8 max|v|
(up to 0.93 of it) and its cosine diff within 2.7e-6. A wrong visible key moves out by O(p v), far above."""

from __future__ import annotations

import pytest
import torch

from flashdsa import ops
from flashdsa.ops.dense_mla import triton as tri
from flashdsa.testing.compare import assert_close
from flashdsa.testing.inputs import poison_torch_empty

SM_SCALE = 576 ** -0.5
P_BF16 = 2.0 ** -8  # bound of |out - ref| / max|v| from bf16 P and bf16 out (module docstring)
LSE_TOL = dict(atol=1e-6, rtol=8.01 / 65536)


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    poison_torch_empty(monkeypatch)


def _cu(lens, device):
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(device=device, dtype=torch.int32)


def _run(q_lens, kv_lens, h, device, d_v=512):
    g = torch.Generator().manual_seed(sum(q_lens) * 31 + sum(kv_lens) + h)
    q = torch.randn(sum(q_lens), h, 576, generator=g).to(device=device, dtype=torch.bfloat16)
    kv = torch.randn(sum(kv_lens), 576, generator=g).to(device=device, dtype=torch.bfloat16)
    cq, ck = _cu(q_lens, device), _cu(kv_lens, device)
    out, lse = ops.dense_mla_prefill(q, kv, cq, ck, SM_SCALE, d_v, backend="triton")
    ref_out, ref_lse = ops.dense_mla_prefill(q, kv, cq, ck, SM_SCALE, d_v, backend="torch")
    assert out.shape == ref_out.shape and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close(lse, ref_lse, name="lse", **LSE_TOL)
    assert_close(out, ref_out, name="out", atol=P_BF16 * float(kv[:, :d_v].float().abs().max()), rtol=0.0,
                 max_cos_diff=7e-6)
    return out, lse


CASES = [
    ([1], [1], 1),
    ([1], [70], 3),              # one query over a cached prefix
    ([5], [5], 16),              # no prefix
    ([3, 1, 4], [40, 1, 4], 3),
    ([0, 2, 1], [7, 65, 64], 16),  # a request with no new queries
    ([63, 1], [64, 130], 1),
]


@pytest.mark.parametrize("q_lens,kv_lens,h", CASES,
                         ids=["q" + ",".join(map(str, q)) + "-kv" + ",".join(map(str, k)) + f"-h{h}" for q, k, h in CASES])
def test_dense_triton_matches_reference(q_lens, kv_lens, h):
    _run(q_lens, kv_lens, h, "cuda" if torch.cuda.is_available() else "cpu")


def test_dense_triton_d_v_and_empty_batch():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _run([2, 3], [2, 9], 2, dev, d_v=128)
    q = torch.randn(0, 4, 576).to(device=dev, dtype=torch.bfloat16)
    kv = torch.randn(5, 576).to(device=dev, dtype=torch.bfloat16)
    out, lse = ops.dense_mla_prefill(q, kv, _cu([0], dev), _cu([5], dev), SM_SCALE, backend="triton")
    assert out.shape == (0, 4, 512) and lse.shape == (0, 4)


def test_dense_triton_chunks_its_index_lists(monkeypatch):
    """Index lists built a few rows at a time give the same bits as all at once (rows are independent)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    whole = _run([6, 3], [6, 20], 2, dev)
    monkeypatch.setattr(tri, "INDEX_BYTES", 4 * 64 * 2)  # two rows of width 64 per call
    parts = _run([6, 3], [6, 20], 2, dev)
    assert torch.equal(whole[0], parts[0]) and torch.equal(whole[1], parts[1])


@pytest.mark.gpu
def test_dense_triton_v32_sizes():
    """The fallback's real sizes: h 128, prompts up to index_topk (2048), one with a cached prefix."""
    _run([2048, 1000, 17], [2048, 1500, 17], 128, "cuda")
