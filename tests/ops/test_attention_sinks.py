"""ops.attention_sinks: the Triton kernel (the interpreter here) against the torch reference and against the
merge with an empty partial of lse = sink (its definition), on random rows including empty ones (lse -inf) and
heads without a sink (-inf)."""

from __future__ import annotations

import pytest
import torch

from flashdsa import ops
from flashdsa.testing.inputs import poison_torch_empty

BACKENDS = ["torch", "triton"]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    poison_torch_empty(monkeypatch)  # an element the kernel does not write fails


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 4, 64), (2, 5, 3, 100), (4, 64, 512), (2, 16, 600)])
def test_matches_the_merge_definition(backend, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    out = torch.randn(shape, generator=g).to(dtype)
    lse = torch.randn(shape[:-1], generator=g) * 4
    lse.view(-1)[:: 3] = float("-inf")  # rows that attended to nothing
    sinks = torch.randn(shape[-2], generator=g) * 2
    sinks[0] = float("-inf")  # a head without a sink
    got = ops.attention_sinks(out, lse, sinks, backend=backend)
    want, _ = ops.merge_attention(out, lse, torch.zeros_like(out), sinks.expand_as(lse).contiguous())
    assert got.dtype == dtype and got.shape == out.shape and not got.isnan().any()
    # the merge's factor exp(l - logaddexp(l, s)) carries the fp32 rounding of logaddexp (|L| ulp-sized, L its
    # value) into a relative error of about |L| * eps32; ours is 1 / (1 + exp(s - l)), a few eps32; then each
    # rounds to out's dtype once
    L = torch.logaddexp(lse, sinks).nan_to_num(neginf=0.0).abs().unsqueeze(-1)
    tol = ((L + 4) * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps) * out.float().abs()
    assert ((got.float() - want.float()).abs() <= tol).all()
    assert (got[torch.isneginf(lse)] == 0).all()
    assert torch.equal(got[..., 0, :][~torch.isneginf(lse[..., 0])], out[..., 0, :][~torch.isneginf(lse[..., 0])])


def test_backends_agree_bitwise_in_fp32_factor():
    g = torch.Generator().manual_seed(3)
    out, lse, sinks = torch.randn(5, 8, 32, generator=g), torch.randn(5, 8, generator=g), torch.randn(8, generator=g)
    a = ops.attention_sinks(out, lse, sinks, backend="triton")
    b = ops.attention_sinks(out, lse, sinks, backend="torch")
    assert (a - b).abs().max() <= 2 * torch.finfo(torch.float32).eps * out.abs().max()


@pytest.mark.parametrize("args, name", [
    ((torch.randn(2, 3, 4), torch.randn(2, 3), torch.randn(4)), "sinks"),
    ((torch.randn(2, 3, 4), torch.randn(2, 4), torch.randn(3)), "lse"),
    ((torch.randn(2, 3, 4), torch.randn(2, 3).double(), torch.randn(3)), "lse"),
    ((torch.randn(4), torch.randn(1), torch.randn(1)), "out"),
])
def test_bad_input_names_the_argument(args, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        ops.attention_sinks(*args)
