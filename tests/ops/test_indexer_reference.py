"""Indexer logits (torch backend) against a float64 brute force that loops over rows and heads and reads
the paged cache byte by byte; -inf exactly outside each row's range; per-row causal verify lengths;
every ValueError."""

from __future__ import annotations

import functools
import struct

import pytest
import torch

from flashdsa import ops
from flashdsa.quant import FP8
from flashdsa.testing.inputs import ragged_ranges

# Every call runs the PyTorch reference: the CPU default, explicit so a CUDA machine tests the same code
# (a call's own backend= still wins, for the error tests).
indexer_logits_paged = functools.partial(ops.indexer_logits_paged, backend="torch")
indexer_logits_ragged = functools.partial(ops.indexer_logits_ragged, backend="torch")
topk_transform = functools.partial(ops.topk_transform, backend="torch")

NEG_INF = float("-inf")


def _fp8(*shape, scale=4.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(FP8)


def _check(out: torch.Tensor, want: torch.Tensor, mag: torch.Tensor) -> None:
    """-inf exactly where the brute force has -inf; elsewhere finite and within fp32 rounding of the sum."""
    assert out.dtype == torch.float32 and out.shape == want.shape
    inf_out, inf_want = torch.isneginf(out), torch.isneginf(want)
    assert torch.equal(inf_out, inf_want), f"-inf pattern differs at {(inf_out != inf_want).nonzero()[:5].tolist()}"
    vis = ~inf_want
    assert torch.isfinite(out[vis]).all()
    err = (out.double() - want).abs()[vis]
    assert (err <= 1e-5 * mag[vis] + 1e-30).all(), f"max err {float(err.max())}"


# ---- ragged ----------------------------------------------------------------------------------------

def _ragged_brute(q_fp8, k_fp8, k_scale, weights, ks, ke):
    """Loops over rows and heads in float64; returns (logits, magnitude bound for the tolerance)."""
    T, H, _ = q_fp8.shape
    N = k_fp8.shape[0]
    q, k = q_fp8.double(), k_fp8.double()
    out = torch.full((T, N), NEG_INF, dtype=torch.float64)
    mag = torch.zeros(T, N, dtype=torch.float64)
    for t in range(T):
        a, b = int(ks[t]), int(ke[t])
        if a == b:
            continue
        acc = torch.zeros(b - a, dtype=torch.float64)
        m = torch.zeros(b - a, dtype=torch.float64)
        for h in range(H):
            dot = k[a:b] @ q[t, h]
            acc += float(weights[t, h]) * dot.clamp_min(0)
            m += abs(float(weights[t, h])) * (k[a:b].abs() @ q[t, h].abs())
        out[t, a:b] = acc * k_scale[a:b].double()
        mag[t, a:b] = m * k_scale[a:b].double()
    return out, mag


RAGGED_SHAPES = [(1, 1, 1), (4, 2, 63), (7, 4, 64), (9, 8, 65), (17, 3, 130), (3, 64, 40), (5, 2, 0), (0, 4, 10)]


@pytest.mark.parametrize("T,H,N", RAGGED_SHAPES, ids=[f"T{t}-H{h}-N{n}" for t, h, n in RAGGED_SHAPES])
def test_ragged_vs_brute_force(T, H, N):
    gen = torch.Generator().manual_seed(T * 1000 + H * 10 + N)
    q = _fp8(T, H, 128)
    k = _fp8(N, 128)
    k_scale = torch.rand(N, generator=gen) * 0.1 + 1e-3
    w = torch.randn(T, H, generator=gen)  # negative gates too: the sum must not be clamped
    ks, ke = ragged_ranges(T, N, gen)
    out = indexer_logits_ragged(q, k, k_scale, w, ks, ke, backend="torch")
    want, mag = _ragged_brute(q, k, k_scale, w, ks, ke)
    _check(out, want, mag)
    again = indexer_logits_ragged(q, k, k_scale, w, ks, ke)
    assert torch.equal(out.view(torch.int32), again.view(torch.int32))


def test_ragged_prefill_causal_multi_request():
    """ks = first key of the request, ke = position + 1: row never sees the next token or another request."""
    lens = [1, 63, 65]
    N = sum(lens)
    starts = [0, 1, 64]
    ks = torch.tensor([s for s, n in zip(starts, lens) for _ in range(n)], dtype=torch.int32)
    ke = torch.tensor([s + i + 1 for s, n in zip(starts, lens) for i in range(n)], dtype=torch.int32)
    q, k = _fp8(N, 4, 128), _fp8(N, 128)
    k_scale = torch.rand(N) + 0.5
    w = torch.rand(N, 4)  # positive gates + a positive key scale: visible logits are >= 0
    out = indexer_logits_ragged(q, k, k_scale, w, ks, ke)
    want, mag = _ragged_brute(q, k, k_scale, w, ks, ke)
    _check(out, want, mag)
    for i in range(N):
        assert torch.isneginf(out[i, :ks[i]]).all() and torch.isneginf(out[i, ke[i]:]).all()
        assert (out[i, ks[i]:ke[i]] >= 0).all()


def _ragged_args(T=3, H=2, N=10):
    return dict(q_fp8=_fp8(T, H, 128), k_fp8=_fp8(N, 128), k_scale=torch.rand(N), weights=torch.randn(T, H),
                ks=torch.zeros(T, dtype=torch.int32), ke=torch.full((T,), N, dtype=torch.int32))


@pytest.mark.parametrize("name,bad", [
    ("q_fp8", lambda a: a["q_fp8"].float()),
    ("q_fp8", lambda a: a["q_fp8"][0]),
    ("q_fp8", lambda a: [1, 2]),
    ("k_fp8", lambda a: a["k_fp8"].bfloat16()),
    ("k_fp8", lambda a: a["k_fp8"][:, :64]),
    ("k_fp8", lambda a: a["k_fp8"][None]),
    ("k_scale", lambda a: a["k_scale"].double()),
    ("k_scale", lambda a: a["k_scale"][:9]),
    ("k_scale", lambda a: a["k_scale"][:, None]),
    ("weights", lambda a: a["weights"].bfloat16()),
    ("weights", lambda a: a["weights"][:, :1]),
    ("weights", lambda a: a["weights"][:2]),
    ("ks", lambda a: a["ks"].long()),
    ("ks", lambda a: a["ks"][:2]),
    ("ks", lambda a: torch.tensor([0, -1, 0], dtype=torch.int32)),
    ("ks", lambda a: torch.tensor([0, 11, 0], dtype=torch.int32)),
    ("ke", lambda a: a["ke"].long()),
    ("ke", lambda a: a["ke"][None]),
    ("ke", lambda a: torch.tensor([10, 11, 10], dtype=torch.int32)),
    ("ke", lambda a: torch.tensor([10, -1, 10], dtype=torch.int32)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_ragged_errors(name, bad):
    a = _ragged_args()
    a[name] = bad(a)
    with pytest.raises(ValueError, match=name):
        indexer_logits_ragged(**a)


def test_ragged_ke_below_ks():
    a = _ragged_args()
    a["ks"] = torch.tensor([0, 5, 0], dtype=torch.int32)
    a["ke"] = torch.tensor([10, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="ke"):
        indexer_logits_ragged(**a)


def test_ragged_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        indexer_logits_ragged(**_ragged_args(), backend="cuda")


# ---- paged -----------------------------------------------------------------------------------------

def _paged_setup(seq_lens: list[int], maxp: int, gen: torch.Generator, junk_past_length=True):
    """Caches with shuffled block tables, page ids beyond the number of requests, random bytes elsewhere.

    Returns (index_cache [P, 8448] u8, block_table [B, maxp] i32). Only pages a request uses are written.
    """
    B = len(seq_lens)
    used = [(S + 63) // 64 for S in seq_lens]
    P = sum(used) + B + 5  # spare pages, so page ids run well past B
    perm = torch.randperm(P, generator=gen).tolist()
    block_table = torch.full((B, maxp), -7, dtype=torch.int32)
    if junk_past_length:
        block_table = torch.randint(-(10 ** 6), 10 ** 6, (B, maxp), generator=gen, dtype=torch.int32)
    cache = torch.randint(0, 256, (P, 8448), generator=gen, dtype=torch.int32).to(torch.uint8)  # poison
    i = 0
    for b, S in enumerate(seq_lens):
        for j in range(used[b]):
            block_table[b, j] = perm[i]
            i += 1
        for p in range(S):
            page, row = int(block_table[b, p // 64]), p % 64
            cache[page, 128 * row:128 * row + 128] = _fp8(128).view(torch.uint8)
            scale = float(torch.rand((), generator=gen)) * 0.1 + 1e-3
            cache[page, 8192 + 4 * row:8192 + 4 * row + 4] = torch.tensor(list(struct.pack("<f", scale)), dtype=torch.uint8)
    return cache, block_table


def _paged_brute(q_fp8, cache, weights, context_lens, block_table, width):
    """Reads each key and scale from the raw page bytes; loops over rows and heads in float64."""
    B, n, H, _ = q_fp8.shape
    out = torch.full((B * n, width), NEG_INF, dtype=torch.float64)
    mag = torch.zeros(B * n, width, dtype=torch.float64)
    for b in range(B):
        for j in range(n):
            r = b * n + j
            Lr = int(context_lens[b, j])
            if Lr == 0:
                continue
            keys, scales = [], []
            for p in range(Lr):
                page, row = int(block_table[b, p // 64]), p % 64
                keys.append(cache[page, 128 * row:128 * row + 128].view(FP8).double())
                scales.append(struct.unpack("<f", bytes(cache[page, 8192 + 4 * row:8192 + 4 * row + 4].tolist()))[0])
            k = torch.stack(keys)
            ks = torch.tensor(scales, dtype=torch.float64)
            acc = torch.zeros(Lr, dtype=torch.float64)
            m = torch.zeros(Lr, dtype=torch.float64)
            for h in range(H):
                qh = q_fp8[b, j, h].double()
                acc += float(weights[r, h]) * (k @ qh).clamp_min(0)
                m += abs(float(weights[r, h])) * (k.abs() @ qh.abs())
            out[r, :Lr] = acc * ks
            mag[r, :Lr] = m * ks
    return out, mag


@pytest.mark.parametrize("n", [1, 2, 3, 4], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("H", [1, 4], ids=lambda h: f"H{h}")
def test_paged_verify_rows_vs_brute_force(n, H):
    """context_lens[b, j] = seq_len[b] - n + j + 1 over seq lens that straddle page boundaries."""
    gen = torch.Generator().manual_seed(100 * n + H)
    seq_lens = [n, 63, 64, 65, 130 + n]
    B = len(seq_lens)
    maxp = 4
    cache, bt = _paged_setup(seq_lens, maxp, gen)
    ctx = torch.tensor([[S - n + j + 1 for j in range(n)] for S in seq_lens], dtype=torch.int32)
    for b, S in enumerate(seq_lens):
        assert ctx[b].tolist() == list(range(S - n + 1, S + 1))
    q = _fp8(B, n, H, 128)
    w = torch.randn(B * n, H, generator=gen)
    width = int(ctx.max()) + 5
    out = indexer_logits_paged(q, cache, w, ctx, bt, width, backend="torch")
    want, mag = _paged_brute(q, cache, w, ctx, bt, width)
    _check(out, want, mag)
    for b in range(B):
        for j in range(n):
            r = b * n + j
            # row j sees exactly seq_len - n + j + 1 positions: never draft j + 1
            assert torch.isfinite(out[r, :ctx[b, j]]).all()
            assert torch.isneginf(out[r, ctx[b, j]:]).all()
    # causal top-k of verify rows: no row selects a position at or past its own length
    sel = topk_transform(out, ctx.view(-1), 16)
    assert ((sel < ctx.view(-1, 1)) | (sel == -1)).all()
    assert torch.equal(out.view(torch.int32), indexer_logits_paged(q, cache, w, ctx, bt, width).view(torch.int32))


def test_paged_verify_row_equals_decode_row():
    """Verify row (b, j) must equal a decode call (n = 1) of the same query at length seq_len - n + j + 1."""
    gen = torch.Generator().manual_seed(7)
    n, H = 3, 2
    seq_lens = [70, 5]
    cache, bt = _paged_setup(seq_lens, 2, gen)
    ctx = torch.tensor([[S - n + j + 1 for j in range(n)] for S in seq_lens], dtype=torch.int32)
    q = _fp8(2, n, H, 128)
    w = torch.randn(2 * n, H, generator=gen)
    out = indexer_logits_paged(q, cache, w, ctx, bt, 70)
    for j in range(n):
        dec = indexer_logits_paged(q[:, j:j + 1].contiguous(), cache, w.view(2, n, H)[:, j].contiguous(),
                                   ctx[:, j:j + 1].contiguous(), bt, 70)
        assert torch.equal(out.view(2, n, 70)[:, j], dec)


@pytest.mark.parametrize("lens", [[0, 1, 63, 64, 65], [0], [1], [64, 64], [0, 0, 0]],
                         ids=["mixed", "zero", "one", "full-pages", "all-empty"])
def test_paged_decode_lengths(lens):
    gen = torch.Generator().manual_seed(len(lens) * 31 + sum(lens))
    B = len(lens)
    cache, bt = _paged_setup(lens, 3, gen)
    ctx = torch.tensor(lens, dtype=torch.int32).view(B, 1)
    q = _fp8(B, 1, 3, 128)
    w = torch.randn(B, 3, generator=gen)
    width = max(lens) + 2
    out = indexer_logits_paged(q, cache, w, ctx, bt, width)
    want, mag = _paged_brute(q, cache, w, ctx, bt, width)
    _check(out, want, mag)
    for b, S in enumerate(lens):
        assert torch.isneginf(out[b, S:]).all() and torch.isfinite(out[b, :S]).all()


def test_paged_arbitrary_row_lengths_and_exact_width():
    """Per-row lengths need not follow the verify formula (padded rows of 0 or 1); width == max length."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = [65, 130, 1]
    cache, bt = _paged_setup(seq_lens, 3, gen)
    ctx = torch.tensor([[0, 65, 1, 64], [130, 63, 0, 129], [1, 0, 1, 0]], dtype=torch.int32)
    q = _fp8(3, 4, 2, 128)
    w = torch.randn(12, 2, generator=gen)
    out = indexer_logits_paged(q, cache, w, ctx, bt, 130)
    want, mag = _paged_brute(q, cache, w, ctx, bt, 130)
    _check(out, want, mag)


def test_paged_zero_width_output():
    cache, bt = _paged_setup([0, 0], 1, torch.Generator().manual_seed(0))
    out = indexer_logits_paged(_fp8(2, 1, 2, 128), cache, torch.randn(2, 2), torch.zeros(2, 1, dtype=torch.int32), bt, 0)
    assert out.shape == (2, 0)


def _paged_args(B=2, n=2, H=2, maxp=2, P=4):
    bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)[:B, :maxp]
    return dict(q_fp8=_fp8(B, n, H, 128), index_cache=torch.zeros(P, 8448, dtype=torch.uint8),
                weights=torch.randn(B * n, H), context_lens=torch.full((B, n), 100, dtype=torch.int32),
                block_table=bt, max_context_len=128)


@pytest.mark.parametrize("name,bad", [
    ("q_fp8", lambda a: a["q_fp8"].bfloat16()),
    ("q_fp8", lambda a: a["q_fp8"][0]),
    ("q_fp8", lambda a: a["q_fp8"][..., :64]),
    ("index_cache", lambda a: a["index_cache"].view(torch.int8)),
    ("index_cache", lambda a: a["index_cache"][:, :8192]),
    ("index_cache", lambda a: a["index_cache"].view(4, 64, 132)),
    ("weights", lambda a: a["weights"].double()),
    ("weights", lambda a: a["weights"][:2]),  # [B, H] instead of [B * n, H]
    ("weights", lambda a: a["weights"].view(2, 2, 2)),
    ("context_lens", lambda a: a["context_lens"].long()),
    ("context_lens", lambda a: a["context_lens"][:, 0]),  # one length for all n rows: the known bug
    ("context_lens", lambda a: a["context_lens"][:1]),
    ("context_lens", lambda a: torch.tensor([[100, -1], [5, 5]], dtype=torch.int32)),
    ("context_lens", lambda a: torch.tensor([[100, 129], [5, 5]], dtype=torch.int32)),  # > max_context_len
    ("block_table", lambda a: a["block_table"].long()),
    ("block_table", lambda a: a["block_table"][0]),
    ("block_table", lambda a: a["block_table"][:1]),
    ("block_table", lambda a: torch.tensor([[3, 4], [0, 2]], dtype=torch.int32)),  # page 4 of 4 pages
    ("block_table", lambda a: torch.tensor([[3, 1], [-1, 2]], dtype=torch.int32)),
    ("max_context_len", lambda a: -1),
    ("max_context_len", lambda a: 128.0),
    ("max_context_len", lambda a: True),
    ("max_context_len", lambda a: torch.tensor(128)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_paged_errors(name, bad):
    a = _paged_args()
    a[name] = bad(a)
    with pytest.raises(ValueError, match=name):
        indexer_logits_paged(**a)


def test_paged_context_longer_than_block_table():
    a = _paged_args()
    a["context_lens"] = torch.tensor([[100, 129], [5, 5]], dtype=torch.int32)  # 2 pages hold 128
    a["max_context_len"] = 200
    with pytest.raises(ValueError, match="context_lens"):
        indexer_logits_paged(**a)


def test_paged_junk_past_length_is_allowed():
    a = _paged_args()
    a["context_lens"] = torch.tensor([[10, 64], [3, 3]], dtype=torch.int32)  # one page per request
    a["block_table"] = torch.tensor([[3, 99999], [0, -5]], dtype=torch.int32)
    out = indexer_logits_paged(**a)
    assert out.shape == (4, 128)


def test_paged_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        indexer_logits_paged(**_paged_args(), backend="numpy")
