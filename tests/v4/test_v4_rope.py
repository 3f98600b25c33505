"""V4's RoPE on the trailing channels (flashdsa/v4/rope.py): the kernel (the interpreter here, compiled with
``-m gpu``) against the torch ops, which are HF's ``apply_rotary_pos_emb``.

Bound: both rotate in fp32 and round once to the output dtype; the kernel may fuse a product into an FMA (one
rounding fewer), so the fp32 results differ by ~1 ulp of fp32 and the rounded outputs by at most one ulp of the
output dtype: 2^-7 of the pair's magnitude in bf16 (7 stored fraction bits), 2^-22 in fp32 (two fp32 ulp)."""

from __future__ import annotations

import pytest
import torch

from flashdsa.testing.inputs import poison_torch_empty
from flashdsa.v4.rope import rope_tail, rope_tail_torch


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    poison_torch_empty(monkeypatch)


def _check(device):
    g = torch.Generator().manual_seed(2)
    for shape, R, dtype, inverse, out_dtype in [((5, 4, 64), 16, torch.bfloat16, False, None),
                                                 ((3, 1, 512), 64, torch.float32, True, torch.float32),
                                                 ((6, 16, 128), 64, torch.bfloat16, False, None),
                                                 ((2, 8, 512), 64, torch.bfloat16, True, torch.float32),
                                                 ((4, 128), 128, torch.float32, False, None)]:
        x = torch.randn(shape, generator=g).to(device, dtype)
        pos = torch.randint(0, 1 << 20, (shape[0], 1), generator=g).float()
        f = pos * (1e4 ** -(torch.arange(R // 2) / (R // 2)))
        cos, sin = f.cos().to(device, dtype), f.sin().to(device, dtype)
        want = rope_tail_torch(x, cos, sin, inverse, out_dtype)
        got = rope_tail(x, cos, sin, inverse, out_dtype, backend="triton")
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got[..., :-R], want[..., :-R])  # the leading channels are copied
        ulp = 2 ** -7 if got.dtype == torch.bfloat16 else 2 ** -22  # one ulp: <= 2^-7 of the value in bf16
        pair = want[..., -R:].float().reshape(*shape[:-1], R // 2, 2).abs().amax(-1, keepdim=True)
        err = (got[..., -R:].float() - want[..., -R:].float()).reshape(pair.shape[:-1] + (2,)).abs()
        assert (err <= ulp * pair + 1e-30).all(), (shape, float(err.max()))


@pytest.mark.interpreter
def test_kernel_matches_the_torch_ops():
    _check("cpu")


@pytest.mark.gpu
def test_compiled_kernel_matches_the_torch_ops():
    _check("cuda")


def test_refusals():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="^backend:"):
        rope_tail(x, torch.zeros(2, 2), torch.zeros(2, 2), backend="gluon")
    with pytest.raises(ValueError, match="^cos:"):
        rope_tail(x, torch.zeros(2, 5), torch.zeros(2, 5))
