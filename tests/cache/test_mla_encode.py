"""flashdsa.cache.mla_encode: FlashMLA's 656-B fp8 row in one Triton launch (the interpreter here, compiled with
``-m gpu``) against layouts.quantize_mla_656, bit for bit: random rows over many magnitudes, all-zero blocks
(the amax floor), amax exactly 448 * 2^k (the scale rule's edge) and just above, e4m3 subnormals, fp32 rope
values that round to bf16 both ways; NoPE rows (512 dims -> 528 B) too."""

from __future__ import annotations

import pytest
import torch

from flashdsa.cache.layouts import quantize_mla_656
from flashdsa.cache.mla_encode import quantize_mla_656_triton
from flashdsa.testing.inputs import poison_torch_empty


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    poison_torch_empty(monkeypatch)


def rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 576, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 1), generator=g).float())
    x[0, :128] = 0                       # an all-zero block: scale from the floor
    x[1, :128] = 0; x[1, 5] = 448.0      # amax exactly 448: scale 1
    x[2, 128:256] *= 1e-3; x[2, 130] = 448.0 * 2 ** -3 * (1 + 2 ** -20)  # just above 448 * 2^k
    x[3, 256:384] = torch.linspace(-1e-3, 1e-3, 128)  # e4m3 subnormals after scaling
    x[4, 512:] = 1 + torch.arange(64) * 2 ** -9      # fp32 rope values halfway between bf16s
    return x.to(dtype)


def _check(device):
    for width, dim in ((656, 576), (528, 512)):
        for dtype in (torch.bfloat16, torch.float32):
            for n in (1, 5, 37):
                x = rows(max(n, 5), dtype)[:n, :dim].to(device)
                want = quantize_mla_656(x)
                got = quantize_mla_656_triton(x)
                assert got.dtype == torch.uint8 and got.shape == (n, width)
                assert torch.equal(got, want), (dtype, n, (got != want).nonzero()[:5].tolist())


@pytest.mark.interpreter
def test_bits_equal_the_reference():
    _check("cpu")


@pytest.mark.gpu
def test_compiled_bits_equal_the_reference():
    _check("cuda")


def test_refuses_bad_rows():
    with pytest.raises(ValueError, match="^kv:"):
        quantize_mla_656_triton(torch.zeros(2, 513))
    assert quantize_mla_656_triton(torch.zeros(0, 576)).shape == (0, 656)
    assert quantize_mla_656_triton(torch.zeros(0, 512)).shape == (0, 528)
