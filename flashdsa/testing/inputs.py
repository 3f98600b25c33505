"""Inputs: random tensors (never zeros) built on the device in our byte layouts (flashdsa.cache.layouts),
the batches that address them (block tables, decode slots, prefill indices), row subsamples for checking
big shapes against the reference, and poisoned output buffers so an unwritten element fails.

Every random builder draws from the ``torch.Generator`` it is given, in a fixed order, so the same seed
gives the same inputs.
"""

from __future__ import annotations

import torch

from flashdsa.cache.layouts import (INDEX_DIM, INDEX_PAGE_BYTES, MLA_LATENT, PAGE_SIZE, encode_mla, index_page_views,
                                    mla_row_width)

CHUNK_PAGES = 4096  # pages (256K tokens) generated per slice: bounds the fp32 temporaries of big caches


# ---- poisoned outputs --------------------------------------------------------------------------------

def poison(shape, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """An output buffer of ``shape`` and ``dtype`` full of NaN (integer dtypes: their largest value), so an
    element a kernel leaves unwritten fails the comparison."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).max, dtype=dtype, device=device)


def poison_torch_empty(monkeypatch) -> None:
    """Make every ``torch.empty`` an op allocates start as NaN (integers: their largest value; bool left as
    is), so an unwritten element fails. ``monkeypatch``: pytest's fixture (anything with ``setattr``), e.g.
    in an autouse fixture of a test module."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)
        return t

    monkeypatch.setattr(torch, "empty", empty)


# ---- random tensors ----------------------------------------------------------------------------------

def token_ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[n] int64`` random token ids below ``vocab`` (a prompt), from their own seeded generator."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def randn(shape, g: torch.Generator, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``shape`` standard-normal values drawn in float32 from ``g`` on ``device``, then cast to ``dtype``
    (float8_e4m3fn, bfloat16, ...)."""
    return torch.randn(shape, generator=g, device=device).to(dtype)


def rows_subset(n: int, most: int, device="cpu") -> torch.Tensor:
    """``[m] int64``: at most ``most`` distinct row ids spread evenly over ``0 .. n - 1``, first and last
    included (the rows of a big shape that are checked against the reference)."""
    return torch.linspace(0, n - 1, min(n, most), device=device).round().long().unique()


# ---- caches in our byte layouts ------------------------------------------------------------------------

def index_cache(P: int, g: torch.Generator, device) -> torch.Tensor:
    """``[P, 8448] uint8`` indexer pages (layouts.index_page_views): every key random float8_e4m3fn, every
    scale in [0.5, 1.5)."""
    cache = torch.empty(P, INDEX_PAGE_BYTES, dtype=torch.uint8, device=device)
    keys, scales = index_page_views(cache)
    for p0 in range(0, P, CHUNK_PAGES):
        p1 = min(P, p0 + CHUNK_PAGES)
        keys[p0:p1] = randn((p1 - p0, PAGE_SIZE, INDEX_DIM), g, device, keys.dtype)
    scales.copy_(torch.rand(P, PAGE_SIZE, generator=g, device=device) + 0.5)
    return cache


def mla_cache(P: int, g: torch.Generator, device, fmt: str = "fp8", rope: int = 64) -> torch.Tensor:
    """``[P, 64, 656] uint8`` MLA pages in FlashMLA's fp8 layout: layouts.quantize_mla_656 of random bf16
    rows ``[64 P, 576]``; ``fmt="bf16"``: those rows themselves, ``[P, 64, 576] bfloat16`` (the same
    tokens as the fp8 pages from a generator in the same state). ``rope`` 0: NoPE rows (``[P, 64, 528]``
    uint8, ``[P, 64, 512]`` bf16)."""
    if fmt not in ("fp8", "bf16"):
        raise ValueError(f"fmt: expected 'fp8' or 'bf16', got {fmt!r}")
    dim = MLA_LATENT + rope
    if fmt == "bf16":
        cache = torch.empty(P, PAGE_SIZE, dim, dtype=torch.bfloat16, device=device)
    else:
        cache = torch.empty(P, PAGE_SIZE, mla_row_width("fp8", rope), dtype=torch.uint8, device=device)
    for p0 in range(0, P, CHUNK_PAGES):
        p1 = min(P, p0 + CHUNK_PAGES)
        rows = randn(((p1 - p0) * PAGE_SIZE, dim), g, device, torch.bfloat16)
        cache[p0:p1] = encode_mla(rows, fmt).view(p1 - p0, PAGE_SIZE, -1)
    return cache


# ---- batches that address them ----------------------------------------------------------------------

def paged_batch(B: int, ctx: int, n: int, g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """B requests of ~U(0.7, 1.3) ctx tokens each (DeepGEMM's generator; at least ``n``, the rows of a
    verify step), each request's pages shuffled over one pool.

    Returns ``seq [B] int64`` (the lengths), ``block_table [B, maxp] int32`` (0 past each request's
    pages) and ``P``, the pool's page count (every page used once).
    """
    seq = torch.randint(max(n, int(0.7 * ctx)), max(n, int(1.3 * ctx)) + 1, (B,), generator=g, device=device)
    pages = (seq + PAGE_SIZE - 1) // PAGE_SIZE
    P, maxp = int(pages.sum()), int(pages.max())
    perm = torch.randperm(P, generator=g, device=device)
    first = torch.cumsum(pages, 0) - pages
    j = torch.arange(maxp, device=device)
    bt = torch.where(j[None, :] < pages[:, None], perm[(first[:, None] + j[None, :]).clamp(max=P - 1)], 0)
    return seq, bt.to(torch.int32).contiguous(), P


def decode_slots(block_table: torch.Tensor, ctx: int, s_q: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """``[B, s_q, topk] int32`` slots for sparse decode: per query row, ``topk`` distinct random positions
    below ``ctx`` (``topk <= ctx``), translated through ``block_table [B, >= ctx / 64]`` into slots
    ``page * 64 + position % 64``."""
    if not 0 <= topk <= ctx or block_table.shape[1] * PAGE_SIZE < ctx:
        raise ValueError(f"topk: expected 0 <= topk <= ctx = {ctx} with block_table [B, >= {-(-ctx // PAGE_SIZE)}], "
                         f"got topk {topk}, block_table {list(block_table.shape)}")
    B = block_table.shape[0]
    dev = block_table.device
    pos = torch.rand(B * s_q, ctx, generator=g, device=dev).argsort(dim=1)[:, :topk].reshape(B, s_q * topk)
    slots = block_table.long().gather(1, pos // PAGE_SIZE) * PAGE_SIZE + pos % PAGE_SIZE
    return slots.view(B, s_q, topk).to(torch.int32).contiguous()


def ragged_ranges(T: int, N: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``ks, ke [T] int32`` (CPU): random key ranges ``[ks, ke)`` within ``[0, N]``, the first rows the edge
    cases: the full range, empty ranges in the middle, at N and at 0, and a one-key range."""
    a = torch.randint(0, N + 1, (T,), generator=g)
    b = torch.randint(0, N + 1, (T,), generator=g)
    ks, ke = torch.minimum(a, b), torch.maximum(a, b)
    fixed = [(0, N), (N // 2, N // 2), (N, N), (0, min(1, N)), (0, 0)]
    for i, (s, e) in enumerate(fixed[:T]):
        ks[i], ke[i] = s, e
    return ks.to(torch.int32), ke.to(torch.int32)


def prefill_indices(T: int, N: int, topk: int, g: torch.Generator, device) -> torch.Tensor:
    """``[T, topk] int32`` causal-like indices for sparse prefill over N keys: query t picks ``topk``
    distinct keys among the first ``max(topk, N (t + 1) / T)`` (``topk <= N``)."""
    if not 0 <= topk <= N:
        raise ValueError(f"topk: expected 0 <= topk <= N = {N}, got {topk}")
    lim = torch.clamp((torch.arange(T, device=device) + 1) * N // T, min=min(topk, N))
    r = torch.rand(T, N, generator=g, device=device)
    r[torch.arange(N, device=device)[None, :] >= lim[:, None]] = 2.0  # past the limit: sorts last
    return r.argsort(dim=1)[:, :topk].to(torch.int32).contiguous()
