"""Indexer keys into their 8448-B pages (:func:`flashdsa.cache.layouts.store_index_keys`) in one Triton launch.

The torch path is five small kernels a call (the slots widened to int64, page and row, two indexed writes);
an eager decode step stores one key a token at every top-k layer. A program takes BLOCK_N slots and copies
each key's 128 bytes to ``page * 8448 + row * 128`` and its fp32 scale to ``page * 8448 + 8192 + row * 4``:
plain copies, so the same bytes as the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.cache.layouts import INDEX_DIM, INDEX_KEY_BYTES, INDEX_PAGE_BYTES, PAGE_SIZE
from flashdsa.ops._launch import KernelLauncher, aligned

BLOCK_N = 16


@triton.jit
def index_store_kernel(cache, slots, k, s_k, scale, s_scale, N, PAGE: tl.constexpr, PAGE_BYTES: tl.constexpr,
                       KEY_BYTES: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    slot = tl.load(slots + n, mask=nm, other=0).to(tl.int64)
    base = (slot // PAGE) * PAGE_BYTES
    row = slot % PAGE
    d = tl.arange(0, D)
    key = tl.load(k + n.to(tl.int64)[:, None] * s_k + d[None, :], mask=nm[:, None])
    tl.store(cache + (base + row * D)[:, None] + d[None, :], key, mask=nm[:, None])
    sc = tl.load(scale + n.to(tl.int64) * s_scale, mask=nm)
    tl.store((cache + base + KEY_BYTES + row * 4).to(tl.pointer_type(tl.float32)), sc, mask=nm)


def store_index_keys_triton(index_cache: torch.Tensor, slots: torch.Tensor, k_fp8: torch.Tensor,
                            k_scale: torch.Tensor) -> None:
    """Arguments as ``layouts.store_index_keys``, already checked; ``slots`` on the cache's device."""
    N = slots.shape[0]
    if N == 0:
        return
    k = k_fp8.view(torch.uint8)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if slots.stride(0) != 1:
        slots = slots.contiguous()
    ptrs = (index_cache.data_ptr(), slots.data_ptr(), k.data_ptr(), k_scale.data_ptr())
    key = (index_cache.device, N, slots.dtype, k.stride(0), k_scale.stride(0)) if aligned(*ptrs) else None

    def build():
        return (triton.cdiv(N, BLOCK_N),), dict(
            cache=index_cache, slots=slots, k=k, s_k=k.stride(0), scale=k_scale, s_scale=k_scale.stride(0), N=N,
            PAGE=PAGE_SIZE, PAGE_BYTES=INDEX_PAGE_BYTES, KEY_BYTES=INDEX_KEY_BYTES, D=INDEX_DIM, BLOCK_N=BLOCK_N,
            num_warps=4)

    _LAUNCH(key, ptrs, build)


_LAUNCH = KernelLauncher(index_store_kernel, ("cache", "slots", "k", "scale"))
