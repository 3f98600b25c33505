"""The fused query / cache-row prologue (flashdsa/layers/mla_rows.py): the kernel (the interpreter here, compiled
with ``-m gpu``) against the torch ops it replaces.

Bounds. The query, the rope part of the row and the NoPE zeros are the same fp32 products and sums rounded once,
with FMA contraction off: bitwise equal. The latent RMSNorm sums its squares in another order and rounds its
``1 / sqrt`` once (torch: ``rsqrt``), so the fp32 normed value differs by a few fp32 ulps; rounded to the model
dtype that is at most one ulp of it (2^-7 of the value in bf16: 7 stored fraction bits), and HF's form then
multiplies by the weight and rounds again: at most one more ulp. So the latent part is within 2 ulps of the
model dtype (2^-6 of the value in bf16, 2^-21 in fp32).
"""

from __future__ import annotations

import pytest
import torch

from flashdsa.config import DSAConfig
from flashdsa.layers.attention import DSAAttention, RMSNorm
from flashdsa.layers.mla_rows import mla_rows, mla_rows_torch, norm_form, rms_norm
from flashdsa.ops import _launch
from flashdsa.testing.inputs import poison_torch_empty

hf_v32 = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    poison_torch_empty(monkeypatch)


def _norm(kind: str, dtype, g, device, D: int = 512):
    if kind == "ours":
        n = RMSNorm(D, 1e-6)
    else:
        n = hf_v32.DeepseekV32RMSNorm(D, 1e-6)
        n.weight.data = n.weight.data.to(torch.float32 if kind == "hf-fp32-weight" else dtype)
    n.weight.data = torch.randn(D, generator=g).to(n.weight.dtype) * 0.5 + 1
    return n.to(device)


def _inputs(T, H, rope, dtype, g, device):
    q = torch.randn(T, H, 128 + rope, generator=g).to(device, dtype)   # q_b_proj's output: [nope | rope]
    q_lat = torch.randn(T, H, 512, generator=g).to(device, dtype)
    kv = (torch.randn(T, 512 + rope, generator=g) * 3).to(device, dtype)
    ang = torch.randint(0, 1 << 16, (T, 1), generator=g).float() * (1e4 ** -(torch.arange(32) / 32))
    cs = torch.cat((ang.cos(), ang.cos()), dim=-1).to(device)           # HF's [T, 64]; the first half is ours
    sn = torch.cat((ang.sin(), ang.sin()), dim=-1).to(device)
    return q_lat, q[..., 128:], kv, cs[:, : rope // 2], sn[:, : rope // 2]


def _check(device):
    g = torch.Generator().manual_seed(3)
    cases = [(5, 16, 64, torch.bfloat16, torch.bfloat16, "hf"), (1, 128, 64, torch.bfloat16, torch.bfloat16, "hf"),
             (3, 3, 64, torch.float32, torch.float32, "hf"), (2, 20, 64, torch.bfloat16, torch.float32, "ours"),
             (4, 16, 0, torch.bfloat16, torch.bfloat16, "hf"), (2, 17, 64, torch.bfloat16, torch.bfloat16,
                                                                 "hf-fp32-weight"),
             (0, 16, 64, torch.bfloat16, torch.bfloat16, "hf")]
    for T, H, rope, dtype, out_dtype, kind in cases:
        norm = _norm(kind, dtype, g, device)
        args = _inputs(T, H, rope, dtype, g, device) + (out_dtype,)
        want_q, want_kv = mla_rows_torch(args[0], args[1], args[2], norm, *args[3:])
        got_q, got_kv = mla_rows(args[0], args[1], args[2], norm, *args[3:], backend="triton")
        D = 512 + rope  # NoPE rows have no rope part
        assert got_q.shape == (T, H, D) and got_kv.shape == (T, D) and got_q.dtype == got_kv.dtype == out_dtype
        assert torch.equal(got_q, want_q), (T, H, rope, kind)
        assert torch.equal(got_kv[:, 512:], want_kv[:, 512:]), (T, H, rope, kind)
        ulp = 2 ** -7 if torch.bfloat16 in (dtype, out_dtype) else 2 ** -22
        err = (got_kv[:, :512].float() - want_kv[:, :512].float()).abs()
        assert (err <= 2 * ulp * want_kv[:, :512].float().abs()).all(), (T, H, kind, float(err.max()))
        # a second call of the shape launches from the plan (ops/_launch.py; VERIFY: its arguments are Triton's)
        again = mla_rows(args[0], args[1], args[2], norm, *args[3:], backend="triton")
        assert torch.equal(again[0], got_q) and torch.equal(again[1], got_kv)


def _check_norm(device):
    """``rms_norm`` (the query latent's norm) against the module: the cache row's latent bound, for any width."""
    g = torch.Generator().manual_seed(5)
    for T, D, dtype, kind in [(5, 384, torch.bfloat16, "hf"), (1, 1536, torch.bfloat16, "hf"),
                              (3, 100, torch.float32, "hf"), (2, 64, torch.bfloat16, "ours"),
                              (4, 384, torch.bfloat16, "hf-fp32-weight"),
                              (0, 64, torch.bfloat16, "hf")]:
        norm = _norm(kind, dtype, g, device, D)
        x = (torch.randn(T, D, generator=g) * 3).to(device, dtype)
        want = norm(x)
        got = rms_norm(x, norm, backend="triton")
        assert got.dtype == want.dtype and got.shape == want.shape
        ulp = 2 ** -7 if want.dtype == torch.bfloat16 or dtype == torch.bfloat16 else 2 ** -22
        err = (got.float() - want.float()).abs()
        assert (err <= 2 * ulp * want.float().abs()).all(), (T, D, kind, float(err.max()))


@pytest.mark.interpreter
def test_kernel_matches_the_torch_ops():
    _check("cpu")
    _check_norm("cpu")


@pytest.mark.gpu
def test_compiled_kernel_matches_the_torch_ops(monkeypatch):
    monkeypatch.setattr(_launch, "VERIFY", True)
    _check("cuda")
    _check_norm("cuda")


def test_norm_forms():
    assert norm_form(RMSNorm(512)) == "fp32"
    assert norm_form(hf_v32.DeepseekV32RMSNorm(512)) == "hf"
    odd = hf_v32.DeepseekV32RMSNorm(512)
    odd.forward = lambda x: x  # a patched forward: the formula is no longer known
    assert norm_form(odd) is None
    assert norm_form(torch.nn.LayerNorm(512)) is None


def test_unknown_norm_runs_the_torch_ops(device):
    g = torch.Generator().manual_seed(4)
    norm = torch.nn.LayerNorm(512).to(device)
    args = _inputs(3, 16, 64, torch.float32, g, device) + (torch.bfloat16,)
    want = mla_rows_torch(args[0], args[1], args[2], norm, *args[3:])
    got = mla_rows(args[0], args[1], args[2], norm, *args[3:], backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_prepare_takes_the_kernel_only_where_asked(monkeypatch, device):
    """``fused_rows`` False (flashdsa.hf's exact mode) and backend "torch" keep the torch ops; the kernel runs
    for backend "triton" with ``fused_rows`` set."""
    import flashdsa.layers.mla_rows as mr
    ran = []
    monkeypatch.setitem(mr._IMPLS, "triton", lambda *a: ran.append(1) or mla_rows_torch(*a))
    cfg = DSAConfig.preset("v32").replace(num_hidden_layers=1, hidden_size=64, q_lora_rank=32)
    attn = DSAAttention(cfg, 0, dtype=torch.float32).to(device)
    x, cos, sin = (torch.randn(2, n, device=device) for n in (64, 32, 32))
    attn.prepare(x, cos, sin, "torch")
    attn.fused_rows = False
    attn.prepare(x, cos, sin, "triton")
    assert ran == []
    attn.fused_rows = True
    attn.prepare(x, cos, sin, "triton")
    assert ran == [1]
