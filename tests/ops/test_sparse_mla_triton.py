"""Triton sparse MLA (decode over paged caches, prefill over gathered KV) against the fp32 reference.

Without a GPU the kernels run in Triton's interpreter on small shapes; the interpreter keeps P in fp32
(its bf16 dot is wrong), so these runs check the logic (gathers, masks, splits, layouts, empty rows)
tightly, and the GPU-only cases check the compiled numerics at the sizes that matter. Tolerances are
FlashMLA's own: out within 1e-3 + 2/128 relative and cosine diff 5e-6 (prefill 8e-4, 3/128, 7e-6),
lse within 1e-6 + 8/65536 relative.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from flashdsa.cache.layouts import PAGE_SIZE, decode_mla, encode_mla
from flashdsa.ops import merge_attention, sparse_mla_decode, sparse_mla_prefill
from flashdsa.ops.sparse_mla import reference
from flashdsa.ops.sparse_mla import triton as tri
from flashdsa.testing.compare import assert_close
from flashdsa.testing.inputs import poison_torch_empty, rows_subset

SM_SCALE = 576 ** -0.5
RAW_SCALE = 0.013        # not a power of two: dequantisation rounds
INT32_MAX = 2 ** 31 - 1
DECODE_TOL = dict(atol=1e-3, rtol=2.01 / 128, max_cos_diff=5e-6)
PREFILL_TOL = dict(atol=8e-4, rtol=3.01 / 128, max_cos_diff=7e-6)
LSE_TOL = dict(atol=1e-6, rtol=8.01 / 65536)


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    poison_torch_empty(monkeypatch)


def make_cache(fmt: str, pages: int, device, scale: float = RAW_SCALE, rope: int = 64):
    """A paged MLA cache of ``pages`` pages filled with random tokens (never zeros); ``rope`` 0: NoPE rows."""
    kv = torch.randn(pages * PAGE_SIZE, 512 + rope, device=device).to(torch.bfloat16)
    rows = encode_mla(kv, fmt, scale if fmt == "fp8_raw" else None)
    return rows.view(pages, PAGE_SIZE, rows.shape[-1])


def make_indices(shape, n_slots: int, device, *, invalid: float = 0.2, empty_row: bool = True):
    """Slot lists with duplicates, -1 padding, other negatives and slots past the cache; the first row
    (if asked) has no valid slot at all."""
    idx = torch.randint(0, n_slots, shape, device=device, dtype=torch.int64)
    bad = torch.rand(shape, device=device) < invalid
    junk = torch.tensor([-1, -1, -1, -7, n_slots, n_slots + 63, INT32_MAX], device=device)
    idx = torch.where(bad, junk[torch.randint(0, len(junk), shape, device=device)], idx)
    if shape[-1] > 3:
        idx[..., 1] = idx[..., 2]  # a duplicate slot counts twice
    flat = idx.view(-1, shape[-1])
    if empty_row:
        flat[0] = -1
    return idx.to(torch.int32)


def check(out, lse, ref_out, ref_lse, tol=DECODE_TOL, rows=None, scale=None):
    """``tol`` (FlashMLA's elementwise and cosine tolerance) where the lists are long; with ``rows`` (the cache or
    KV the call read; ``scale``: fp8_raw's) the elementwise bound of :func:`check_rounded` instead, which holds
    for lists of any length (compiled kernels round P to bf16; the interpreter keeps it in fp32)."""
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    if rows is not None:
        flat = rows.reshape(-1, rows.shape[-1])
        v = flat.float() if rows.dtype == torch.bfloat16 else decode_mla(flat, scale).float()
        return check_rounded(out, lse, ref_out, ref_lse, v[:, :512].abs().max().item(), tol["max_cos_diff"])
    assert_close(lse, ref_lse, name="lse", **LSE_TOL)
    assert_close(out, ref_out, name="out", **tol)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(out[empty].float(), torch.zeros_like(out[empty].float())), "empty rows must give out = 0"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


def check_rounded(out, lse, ref_out, ref_lse, v_max: float, max_cos_diff: float = 7e-6):
    """The bound from the numerics, for lists of any length: the kernels round P to bf16 (|dp| <= 2^-8 p) and
    the output to bf16 (2^-8 |out|), so ``|out - ref| <= 2^-8 (max |v| + |ref|)`` elementwise (DECODE_TOL's
    FlashMLA-style 1e-3 + 2/128 |ref| holds where long lists average the rounding out, not on 64 tokens)."""
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close(lse, ref_lse, name="lse", **LSE_TOL)
    err = (out.float() - ref_out.float()).abs()
    bound = 2.0 ** -8 * (v_max + ref_out.float().abs()) + 1e-6
    assert (err <= bound).all(), f"out: |out - ref| {err.max().item():.3g} exceeds 2^-8 (max|v| + |ref|)"
    assert_close(out, ref_out, name="out", atol=float("inf"), max_cos_diff=max_cos_diff)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(out[empty].float(), torch.zeros_like(out[empty].float())), "empty rows must give out = 0"


# ---- decode -------------------------------------------------------------------------------------------

DECODE_CASES = [
    # fmt, B, s_q, h_q, topk, pages
    pytest.param("fp8", 2, 1, 16, 100, 3, id="fp8-B2-s1-H16-k100"),
    pytest.param("fp8", 1, 3, 3, 65, 2, id="fp8-B1-s3-H3-k65"),
    pytest.param("fp8", 3, 1, 1, 5, 1, id="fp8-B3-s1-H1-k5"),
    pytest.param("fp8", 2, 2, 64, 64, 3, id="fp8-B2-s2-H64-k64"),
    pytest.param("fp8", 1, 1, 128, 130, 4, id="fp8-B1-s1-H128-k130"),
    pytest.param("bf16", 2, 2, 16, 130, 3, id="bf16-B2-s2-H16-k130"),
    pytest.param("bf16", 1, 4, 32, 5, 2, id="bf16-B1-s4-H32-k5"),
    pytest.param("bf16", 1, 1, 1, 63, 1, id="bf16-B1-s1-H1-k63"),
    pytest.param("bf16", 1, 1, 128, 63, 2, id="bf16-B1-s1-H128-k63"),
    pytest.param("fp8_raw", 1, 2, 16, 64, 2, id="raw-B1-s2-H16-k64"),
    pytest.param("fp8_raw", 1, 1, 64, 1, 1, id="raw-B1-s1-H64-k1"),
    pytest.param("fp8_raw", 1, 1, 100, 70, 2, id="raw-B1-s1-H100-k70"),
]


def decode_both(device, fmt, B, s_q, h_q, topk, pages, rope=64):
    """A random cache of ``rope`` rope dims, q and slot lists (the first row empty), decoded by the Triton
    kernels and the torch reference -> (cache, q, idx, kv_scale, (out, lse), (ref_out, ref_lse))."""
    cache = make_cache(fmt, pages, device, rope=rope)
    q = torch.randn(B, s_q, h_q, 512 + rope, device=device).to(torch.bfloat16)
    idx = make_indices((B, s_q, topk), pages * PAGE_SIZE, device)
    kv_scale = RAW_SCALE if fmt == "fp8_raw" else None
    out, lse = sparse_mla_decode(q, cache, idx, SM_SCALE, kv_scale=kv_scale, backend="triton")
    ref_out, ref_lse = sparse_mla_decode(q, cache, idx, SM_SCALE, kv_scale=kv_scale, backend="torch")
    assert out.shape == (B, s_q, h_q, 512) and lse.shape == (B, s_q, h_q)
    assert torch.isneginf(ref_lse[0, 0]).all()  # the all-invalid row really is empty
    return cache, q, idx, kv_scale, (out, lse), (ref_out, ref_lse)


@pytest.mark.parametrize("fmt,B,s_q,h_q,topk,pages", DECODE_CASES)
def test_decode_matches_reference(device, fmt, B, s_q, h_q, topk, pages):
    cache, _, _, kv_scale, got, ref = decode_both(device, fmt, B, s_q, h_q, topk, pages)
    check(*got, *ref, rows=cache, scale=kv_scale)


NOPE_CASES = [
    # fmt, B, s_q, h_q, topk, pages: NoPE rows (GLM-5.3-Flash), q of 512 dims, every format and tiling
    pytest.param("fp8", 2, 1, 16, 100, 3, id="nope-fp8-B2-s1-H16-k100"),
    pytest.param("fp8", 1, 2, 64, 65, 2, id="nope-fp8-B1-s2-H64-k65"),
    pytest.param("fp8", 1, 1, 128, 130, 3, id="nope-fp8-B1-s1-H128-k130"),
    pytest.param("bf16", 2, 1, 16, 64, 2, id="nope-bf16-B2-s1-H16-k64"),
    pytest.param("bf16", 1, 2, 64, 63, 2, id="nope-bf16-B1-s2-H64-k63"),
    pytest.param("fp8_raw", 1, 1, 20, 70, 2, id="nope-raw-B1-s1-H20-k70"),
    pytest.param("fp32", 1, 1, 16, 65, 2, id="nope-fp32-B1-s1-H16-k65"),
]


@pytest.mark.parametrize("fmt,B,s_q,h_q,topk,pages", NOPE_CASES)
def test_nope_decode_matches_reference(device, fmt, B, s_q, h_q, topk, pages):
    """NoPE rows (528-B fp8, 512-dim bf16 / raw / fp32) against the reference, and against the 576-dim rows
    with a zero rope part (what NoPE models were stored as before: the same scores)."""
    cache, q, idx, kv_scale, (out, lse), (ref_out, ref_lse) = decode_both(device, fmt, B, s_q, h_q, topk, pages, 0)
    assert cache.shape[-1] == {"fp8": 528, "bf16": 512, "fp8_raw": 512, "fp32": 512}[fmt]
    if fmt == "fp32":
        assert_close(out, ref_out, name="out", atol=1e-5, rtol=1e-5)
        assert_close(lse, ref_lse, name="lse", **LSE_TOL)
    else:
        check(out, lse, ref_out, ref_lse, rows=cache, scale=kv_scale)
    # the same tokens in 576-dim rows with a zero rope part and a zero-padded q: the same attention
    rows = decode_mla(cache.reshape(-1, cache.shape[-1]), kv_scale).float()
    wide = encode_mla(torch.cat((rows, rows.new_zeros(rows.shape[0], 64)), 1), fmt, kv_scale)
    q_wide = torch.cat((q, q.new_zeros(*q.shape[:-1], 64)), -1)
    wide_out, wide_lse = sparse_mla_decode(q_wide, wide.view(pages, PAGE_SIZE, -1), idx, SM_SCALE,
                                           kv_scale=kv_scale, backend="torch")
    assert_close(wide_out, ref_out, name="out vs 576-dim rows", atol=1e-6, rtol=1e-6)
    assert_close(wide_lse, ref_lse, name="lse vs 576-dim rows", atol=1e-6, rtol=1e-6)


def test_nope_prefill_matches_reference(device):
    T, N, h_q, topk = 3, 130, 64, 65
    kv = torch.randn(N, 512, device=device).to(torch.bfloat16)
    q = torch.randn(T, h_q, 512, device=device).to(torch.bfloat16)
    idx = make_indices((T, topk), N, device)
    out, lse = sparse_mla_prefill(q, kv, idx, SM_SCALE, backend="triton")
    ref_out, ref_lse = sparse_mla_prefill(q, kv, idx, SM_SCALE, backend="torch")
    assert out.shape == (T, h_q, 512)
    check_rounded(out, lse, ref_out, ref_lse, kv.float().abs().max().item())


@pytest.mark.parametrize("q_dim,rows", [(576, 528), (512, 656), (512, 576), (576, 512)])
def test_q_width_must_match_the_rows(q_dim, rows):
    """A 512-dim q over 576-dim rows (or the reverse) is a caller's error, named before any kernel runs."""
    dtype = torch.uint8 if rows in (528, 656) else torch.bfloat16
    cache = torch.zeros(1, PAGE_SIZE, rows, dtype=dtype)
    q = torch.randn(1, 1, 4, q_dim).to(torch.bfloat16)
    idx = torch.zeros(1, 1, 4, dtype=torch.int32)
    want = {528: 512, 656: 576, 576: 576, 512: 512}[rows]
    with pytest.raises(ValueError, match=f"^q: expected last dim {want} "):
        sparse_mla_decode(q, cache, idx, SM_SCALE)
    if dtype == torch.bfloat16:
        with pytest.raises(ValueError, match=f"^q: expected last dim {want} "):
            sparse_mla_prefill(q[0], cache[0], idx[0], SM_SCALE)


# every kernel variant and split count on one odd shape (h_q 20: a partial head block; d_v 200: a
# partial value chunk); the launch configurations are what the benchmark sweeps
Config = tri.SparseMLAConfig
VARIANTS = [
    pytest.param(None, id="default"),
    pytest.param(Config(kernel="small_h"), id="small_h"),
    pytest.param(Config(kernel="small_h", block_h=32, num_splits=3), id="small_h-BH32-split3"),
    pytest.param(Config(kernel="heads_m", block_h=16, block_n=32), id="heads_m-BH16-BN32"),
    pytest.param(Config(kernel="heads_m", block_h=32, block_dv=256, num_splits=2), id="heads_m-BH32-DV256-split2"),
    pytest.param(Config(kernel="heads_m", block_h=64, block_dv=128, block_n=16), id="heads_m-BH64-DV128-BN16"),
    pytest.param(Config(kernel="heads_m", block_h=16, block_n=16, slots_ahead=False), id="heads_m-BH16-in-step-slots"),
    pytest.param(Config(kernel="small_h", slots_ahead=True, num_splits=2), id="small_h-slots-ahead-split2"),
    pytest.param(Config(kernel="wide", block_h=16, block_n=32), id="wide-BH16-BN32"),
    pytest.param(Config(kernel="wide", block_h=32, block_n=16, slots_ahead=False, num_splits=3),
                 id="wide-BH32-BN16-split3"),
]


@pytest.mark.parametrize("d_v", [512, 200])
@pytest.mark.parametrize("config", VARIANTS)
def test_decode_kernel_variants(device, config, d_v):
    fmt, B, s_q, h_q, topk, pages = "fp8", 1, 2, 20, 130, 3
    cache = make_cache(fmt, pages, device)
    q = torch.randn(B, s_q, h_q, 576, device=device).to(torch.bfloat16)
    idx = make_indices((B, s_q, topk), pages * PAGE_SIZE, device)
    out, lse = tri.sparse_mla_decode(q, cache, idx, SM_SCALE, d_v, None, config)
    ref_out, ref_lse = reference.sparse_mla_decode(q, cache, idx, SM_SCALE, d_v, None)
    assert out.shape == (B, s_q, h_q, d_v)
    check(out, lse, ref_out, ref_lse, rows=cache)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_decode_split_with_empty_splits(device, splits):
    """Splits whose slots are all invalid contribute lse -inf and nothing else; rows empty in every
    split still give 0 / -inf after the combine."""
    cache = make_cache("bf16", 2, device)
    q = torch.randn(2, 1, 16, 576, device=device).to(torch.bfloat16)
    idx = make_indices((2, 1, 320), 2 * PAGE_SIZE, device, invalid=0.0)
    idx[1, 0, 64:256] = -1  # the middle splits of row 1 are empty
    out, lse = tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, Config(num_splits=splits))
    ref_out, ref_lse = reference.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None)
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()
    check(out, lse, ref_out, ref_lse, rows=cache)


def test_decode_all_invalid_and_zero_topk(device):
    cache = make_cache("fp8", 1, device)
    q = torch.randn(2, 1, 16, 576, device=device).to(torch.bfloat16)
    for idx in (torch.full((2, 1, 70), -1, dtype=torch.int32, device=device),
                torch.full((2, 1, 70), PAGE_SIZE, dtype=torch.int32, device=device),
                torch.empty((2, 1, 0), dtype=torch.int32, device=device)):
        out, lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="triton")
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isneginf(lse).all()


def test_decode_no_rows(device):
    cache = make_cache("fp8", 1, device)
    q = torch.randn(0, 1, 16, 576, device=device).to(torch.bfloat16)
    out, lse = sparse_mla_decode(q, cache, torch.zeros(0, 1, 8, dtype=torch.int32, device=device), SM_SCALE,
                                 backend="triton")
    assert out.shape == (0, 1, 16, 512) and lse.shape == (0, 1, 16)


def test_decode_is_deterministic(device):
    cache = make_cache("fp8", 2, device)
    q = torch.randn(2, 2, 16, 576, device=device).to(torch.bfloat16)
    idx = make_indices((2, 2, 100), 2 * PAGE_SIZE, device)
    a = tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, Config(num_splits=2))
    b = tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, Config(num_splits=2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_decode_strided_cache_and_query(device):
    """A cache that is a slice of a bigger pool (page stride > 64 rows) and a non-contiguous q."""
    pool = make_cache("fp8", 6, device)
    cache = pool[1::2]                                   # pages 1, 3, 5: page stride 2 * 64 * 656
    q = torch.randn(2, 1, 16, 640, device=device).to(torch.bfloat16)[..., 32:608]  # head stride 640
    idx = make_indices((2, 1, 90), 3 * PAGE_SIZE, device)
    out, lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="triton")
    ref_out, ref_lse = sparse_mla_decode(q, cache.contiguous(), idx, SM_SCALE, backend="torch")
    check(out, lse, ref_out, ref_lse, rows=pool)


# ---- prefill ------------------------------------------------------------------------------------------

PREFILL_CASES = [
    # T, N, h_q, topk
    pytest.param(5, 200, 16, 100, id="T5-N200-H16-k100"),
    pytest.param(1, 1, 3, 1, id="T1-N1-H3-k1"),
    pytest.param(3, 63, 64, 64, id="T3-N63-H64-k64"),
    pytest.param(2, 65, 100, 65, id="T2-N65-H100-k65"),
]


@pytest.mark.parametrize("T,N,h_q,topk", PREFILL_CASES)
def test_prefill_matches_reference(device, T, N, h_q, topk):
    kv = torch.randn(N, 576, device=device).to(torch.bfloat16)
    q = torch.randn(T, h_q, 576, device=device).to(torch.bfloat16)
    idx = make_indices((T, topk), N, device, empty_row=T > 1)
    out, lse = sparse_mla_prefill(q, kv, idx, SM_SCALE, backend="triton")
    ref_out, ref_lse = sparse_mla_prefill(q, kv, idx, SM_SCALE, backend="torch")
    assert out.shape == (T, h_q, 512) and lse.shape == (T, h_q)
    check(out, lse, ref_out, ref_lse, PREFILL_TOL, rows=kv)


def test_prefill_strided_kv(device):
    """kv rows with a stride larger than 576 (a view into a wider buffer)."""
    wide = torch.randn(100, 640, device=device).to(torch.bfloat16)
    kv = wide[:, 32:608]
    q = torch.randn(3, 16, 576, device=device).to(torch.bfloat16)
    idx = make_indices((3, 70), 100, device)
    out, lse = sparse_mla_prefill(q, kv, idx, SM_SCALE, d_v=128, backend="triton")
    ref_out, ref_lse = sparse_mla_prefill(q, kv.contiguous(), idx, SM_SCALE, d_v=128, backend="torch")
    check(out, lse, ref_out, ref_lse, PREFILL_TOL, rows=kv)


@pytest.mark.gpu
def test_prefill_rows_do_not_depend_on_the_batch():
    """A row's bits are the same whether it runs among 3000 rows or among 10 (no split-K in prefill),
    so chunked prefill equals one-shot prefill. With split-K for small row counts the last 10 rows
    differed by 0.0078 on the H200; the interpreter rounds both ways to the same bf16, hence GPU-only."""
    kv = torch.randn(6000, 576, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(3000, 128, 576, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 6000, (3000, 2048), device="cuda", dtype=torch.int32)
    all_rows, all_lse = sparse_mla_prefill(q, kv, idx, 0.1, backend="triton")
    few, few_lse = sparse_mla_prefill(q[2990:], kv, idx[2990:], 0.1, backend="triton")
    assert torch.equal(few, all_rows[2990:]) and torch.equal(few_lse, all_lse[2990:])


# ---- merging partial results --------------------------------------------------------------------------

def test_split_attention_merges_to_the_whole(device):
    """Attention over disjoint halves of the slot list, merged with the returned lse, is the attention
    over the whole list (what DCP does across ranks); an empty half changes nothing, bit for bit."""
    cache = make_cache("fp8", 3, device)
    q = torch.randn(2, 1, 16, 576, device=device).to(torch.bfloat16)
    idx = make_indices((2, 1, 128), 3 * PAGE_SIZE, device, empty_row=False)
    out, lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="triton")
    parts = [idx[..., :50].contiguous(), idx[..., 50:].contiguous()]
    a, b = (sparse_mla_decode(q, cache, i, SM_SCALE, backend="triton") for i in parts)
    m_out, m_lse = merge_attention(a[0], a[1], b[0], b[1])
    assert_close(m_lse, lse, name="lse", **LSE_TOL)
    # the parts are bf16, so the merge is exact only up to half an ulp of the parts' magnitudes
    ulp = 2.0 ** -8 * float(torch.maximum(a[0].abs().max(), b[0].abs().max()))
    assert_close(m_out, out, name="out", atol=ulp, max_cos_diff=5e-5)
    ra, rb = (sparse_mla_decode(q, cache, i, SM_SCALE, backend="torch") for i in parts)
    r_out, r_lse = merge_attention(ra[0], ra[1], rb[0], rb[1])
    check(m_out.to(torch.bfloat16), m_lse, r_out, r_lse, rows=cache)

    none = sparse_mla_decode(q, cache, torch.full_like(idx, -1), SM_SCALE, backend="triton")
    e_out, e_lse = merge_attention(out, lse, none[0], none[1])
    assert torch.equal(e_out, out) and torch.equal(e_lse, lse)


# ---- launcher details ---------------------------------------------------------------------------------

def test_pick_num_splits():
    assert tri.pick_num_splits(128, 2048, 132) == 1          # B 64 x 2 head blocks fill 132 SMs
    assert tri.pick_num_splits(256, 2048, 132) == 1
    assert tri.pick_num_splits(64, 2048, 132, ctas_per_sm=2) == 4
    assert tri.pick_num_splits(2, 2048, 132) == 8            # capped at topk / 256
    assert tri.pick_num_splits(2, 100, 132) == 1             # too few tokens to split


def test_default_steps_down_when_out_of_shared_memory(device, monkeypatch):
    """Should a Triton version need more shared memory than the default's budget, the default steps
    down (fewer stages, then 32 tokens per step), warns once and remembers; an explicit config never does."""
    from triton.runtime.errors import OutOfResources
    real_launch, launched = tri._launch, []

    def launch(cfg, *args):
        launched.append(cfg)
        if cfg.num_stages > 1:
            raise OutOfResources(240000, 232448, "shared memory")
        return real_launch(cfg, *args)

    monkeypatch.setattr(tri, "_launch", launch)
    monkeypatch.setattr(tri, "_STEP_DOWN", {})
    cache = make_cache("bf16", 2, device)
    q = torch.randn(1, 2, 16, 576, device=device).to(torch.bfloat16)
    idx = make_indices((1, 2, 70), 2 * PAGE_SIZE, device)
    with pytest.warns(UserWarning, match="out of resources"):
        out, lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="triton")
    check(out, lse, *sparse_mla_decode(q, cache, idx, SM_SCALE, backend="torch"), rows=cache)
    assert [c.num_stages for c in launched] == [2, 1]
    # on CUDA the step-down skips the configuration Triton miscompiles (small_h, one stage, 64 tokens)
    assert launched[1].block_n == (32 if device == "cuda" else 64)
    sparse_mla_decode(q, cache, idx, SM_SCALE, backend="triton")   # remembered: no second failure
    assert [c.num_stages for c in launched] == [2, 1, 1]
    with pytest.raises(OutOfResources):
        tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, Config(num_stages=2))


def test_miscompiled_config_is_refused_on_cuda(device):
    """The heads-on-N kernel at one stage with 64-token steps is miscompiled for sm_90 (triton.miscompiled):
    refused on CUDA with a ValueError naming config, before any launch; the interpreter runs it."""
    bad = Config(kernel="small_h", num_stages=1, block_n=64)
    assert tri.miscompiled(bad, torch.device("cuda")) is not None
    assert tri.miscompiled(bad, torch.device("cpu")) is None
    assert tri.miscompiled(replace(bad, block_n=32), torch.device("cuda")) is None
    assert tri.miscompiled(replace(bad, num_stages=2), torch.device("cuda")) is None
    cache = make_cache("bf16", 2, device)
    q = torch.randn(1, 1, 16, 576, device=device).to(torch.bfloat16)
    idx = make_indices((1, 1, 70), 2 * PAGE_SIZE, device)
    if device == "cuda":
        with pytest.raises(ValueError, match="^config: expected a configuration Triton compiles correctly"):
            tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, bad)
    else:
        out, lse = tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, bad)
        check(out, lse, *reference.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None), rows=cache)


def test_unknown_or_bad_config_is_rejected():
    """Before any launch: an unknown field is a TypeError, a bad value a ValueError naming the field."""
    with pytest.raises(TypeError):
        Config(blockh=16)
    for bad in (dict(block_dv=384), dict(block_n=8), dict(kernel="flash"), dict(slots_ahead=1)):
        with pytest.raises(ValueError, match=f"config: expected {next(iter(bad))}"):
            Config(**bad)


def test_misaligned_fp8_cache_is_rejected(device):
    rows = make_cache("fp8", 1, device).view(-1)
    buf = torch.zeros(rows.numel() + 1, dtype=torch.uint8, device=device)
    buf[1:] = rows
    cache = buf[1:].view(1, PAGE_SIZE, 656)                 # rows start at an odd address
    q = torch.randn(1, 1, 4, 576, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache"):
        sparse_mla_decode(q, cache, torch.zeros(1, 1, 4, dtype=torch.int32, device=device), SM_SCALE,
                          backend="triton")


def test_raw_cache_needs_scale(device):
    cache = make_cache("fp8_raw", 1, device)
    q = torch.randn(1, 1, 4, 576, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="kv_scale"):
        sparse_mla_decode(q, cache, torch.zeros(1, 1, 4, dtype=torch.int32, device=device), SM_SCALE,
                          backend="triton")


# ---- GPU sizes ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "bf16", "fp8_raw"])
@pytest.mark.parametrize("B,s_q,h_q", [(64, 1, 128), (8, 2, 64), (64, 1, 16), (16, 4, 32)])
def test_decode_gpu_sizes(fmt, B, s_q, h_q):
    dev = "cuda"
    pages, topk = 512, 2048
    scale = RAW_SCALE if fmt == "fp8_raw" else None
    cache = make_cache(fmt, pages, dev)
    q = torch.randn(B, s_q, h_q, 576, device=dev).to(torch.bfloat16)
    idx = make_indices((B, s_q, topk), pages * PAGE_SIZE, dev, invalid=0.05)
    out, lse = sparse_mla_decode(q, cache, idx, SM_SCALE, kv_scale=scale, backend="triton")
    rows = rows_subset(B, 16)
    ref_out, ref_lse = sparse_mla_decode(q[rows], cache, idx[rows], SM_SCALE, kv_scale=scale, backend="torch")
    check(out[rows], lse[rows], ref_out, ref_lse)


@pytest.mark.gpu
def test_decode_gpu_every_head_count():
    dev = "cuda"
    cache = make_cache("fp8", 64, dev)
    for h_q in range(1, 129):
        q = torch.randn(3, 2, h_q, 576, device=dev).to(torch.bfloat16)
        idx = make_indices((3, 2, 300), 64 * PAGE_SIZE, dev)
        out, lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="triton")
        ref_out, ref_lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="torch")
        check(out, lse, ref_out, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [128, 64, 16])
def test_prefill_gpu_sizes(h_q):
    dev = "cuda"
    T, N, topk = 1024, 8192, 2048
    kv = torch.randn(N, 576, device=dev).to(torch.bfloat16)
    q = torch.randn(T, h_q, 576, device=dev).to(torch.bfloat16)
    idx = make_indices((T, topk), N, dev, invalid=0.05)
    out, lse = sparse_mla_prefill(q, kv, idx, SM_SCALE, backend="triton")
    rows = rows_subset(T, 16)
    ref_out, ref_lse = sparse_mla_prefill(q[rows], kv, idx[rows], SM_SCALE, backend="torch")
    check(out[rows], lse[rows], ref_out, ref_lse, PREFILL_TOL)
    assert math.isfinite(float(lse[1:].max()))
