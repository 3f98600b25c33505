"""The indexer-key store kernel (flashdsa/cache/index_store.py; the interpreter here, compiled with ``-m gpu``):
the same bytes as the torch path of ``layouts.store_index_keys``, every other byte of the cache untouched."""

from __future__ import annotations

import pytest
import torch

from flashdsa.cache import layouts
from flashdsa.cache.index_store import store_index_keys_triton
from flashdsa.ops import _launch
from flashdsa.quant import FP8


def _case(N: int, pages: int, g: torch.Generator, slot_dtype, strided: bool):
    cache = torch.randint(0, 256, (pages, layouts.INDEX_PAGE_BYTES), dtype=torch.uint8, generator=g)
    slots = torch.randperm(pages * 64, generator=g)[:N].to(slot_dtype)
    k = torch.randn(N, 256 if strided else 128, generator=g)[:, :128].to(FP8)
    scale = torch.rand(2 * N if strided else N, generator=g)[:: 2 if strided else 1] + 0.5
    return cache, slots, k, scale


def _check(device):
    g = torch.Generator().manual_seed(6)
    for N, pages, slot_dtype, strided in [(1, 2, torch.int32, False), (17, 3, torch.int64, True),
                                          (64, 4, torch.int32, True), (130, 5, torch.int32, False),
                                          (0, 1, torch.int64, False)]:
        cache, slots, k, scale = _case(N, pages, g, slot_dtype, strided)
        want = cache.clone()
        layouts.store_index_keys(want, slots, k, scale)  # CPU tensors: the torch path
        got = cache.to(device)
        if device == "cpu":
            store_index_keys_triton(got, slots, k, scale)
        else:
            for _ in range(2):  # the second call from the plan (VERIFY: Triton's own arguments)
                layouts.store_index_keys(got, slots.to(device), k.to(device), scale.to(device))
        assert torch.equal(got.cpu(), want), (N, slot_dtype, strided)


@pytest.mark.interpreter
def test_kernel_writes_the_torch_paths_bytes():
    _check("cpu")


@pytest.mark.gpu
def test_compiled_kernel_writes_the_torch_paths_bytes(monkeypatch):
    monkeypatch.setattr(_launch, "VERIFY", True)
    _check("cuda")
