"""flashdsa.testing's own helpers, where a bug would hide failures elsewhere: a comparison that cannot
fail, a tie-safe top-k check that accepts a wrong pick, inputs that are not what their layout says, a
poisoned buffer that is not poisoned, a timing module that needs a GPU to import, a host-cost run that
leaves the value-check setting changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashdsa.cache.layouts import MLA_FP8_BYTES, dequantize_mla_656, index_page_views
from flashdsa.testing.compare import assert_close, cos_diff, masked_cos_diff, topk_order_keys, topk_tie_safe
from flashdsa.testing.inputs import (decode_slots, index_cache, mla_cache, paged_batch, poison, poison_torch_empty,
                                     prefill_indices, ragged_ranges, rows_subset)

# ---- comparisons -------------------------------------------------------------------------------------


def test_cos_diff_identical_opposite_orthogonal_scaled():
    a = torch.randn(100, dtype=torch.float64)
    assert cos_diff(a, a.clone()) == 0.0
    assert cos_diff(a, -a) == pytest.approx(2.0)
    b = torch.zeros_like(a)
    b[0], a2 = 1.0, a.clone()
    a2[0] = 0.0
    assert cos_diff(a2, b) == pytest.approx(1.0)  # orthogonal
    assert cos_diff(a, 2 * a) == pytest.approx(1 - 4 / 5)  # 1 - 2ab / (a² + b²) sees the scale, unlike cosine
    assert cos_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert cos_diff(a.float(), (a + 1e-3 * torch.randn(100, dtype=torch.float64)).float()) > 0


def test_cos_diff_skips_non_finite_pairs_and_masked_sees_only_valid():
    a = torch.randn(50)
    b = a.clone()
    a[3], b[7] = float("inf"), float("nan")  # dropped from both
    assert cos_diff(a, b) == 0.0
    valid = torch.arange(50) < 25
    c = torch.where(valid, a, torch.randn(50))  # garbage past the valid part
    assert masked_cos_diff(c, a, valid) == 0.0 and cos_diff(c, a) > 1e-3
    assert masked_cos_diff(-a, a, valid) == pytest.approx(2.0)


def test_assert_close_catches_each_kind_of_mismatch():
    ref = torch.randn(4, 8)
    ref[0, 0], ref[1, 1], ref[2, 2] = float("-inf"), float("inf"), float("nan")
    assert_close(ref.clone(), ref, atol=0.0, max_cos_diff=0.0)  # identical, non-finite positions included
    for pos, val, what in [((3, 3), float("-inf"), "-inf"), ((0, 0), 0.0, "-inf"), ((3, 3), float("inf"), r"\+inf"),
                           ((2, 2), 1.0, "NaN"), ((3, 4), float("nan"), "NaN")]:
        out = ref.clone()
        out[pos] = val
        with pytest.raises(AssertionError, match=f"{what} pattern differs"):
            assert_close(out, ref, atol=1e9)
    out = ref.clone()
    out[3, 5] += 0.01
    with pytest.raises(AssertionError, match=r"at \[3, 5\]"):  # names the worst element
        assert_close(out, ref, atol=1e-3, name="x")
    assert_close(out, ref, atol=0.0, rtol=0.011 / float(ref[3, 5].abs()))  # within rtol |ref| there
    with pytest.raises(AssertionError, match="cosine"):
        assert_close(torch.where(torch.isfinite(ref), -ref, ref), ref, atol=1e9, max_cos_diff=1e-3)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(ref[:2], ref, atol=1.0)


def _top(x: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Positions [R, k] of the k best candidates, ascending, -1 padded (a correct answer)."""
    s = torch.where(torch.arange(x.shape[1])[None, :] < lengths[:, None], x, float("-inf"))
    top = torch.topk(s, min(k, x.shape[1]), dim=1).indices
    top = torch.where(torch.arange(top.shape[1])[None, :] < lengths[:, None].clamp(max=k), top, 2 ** 30)
    top = torch.sort(top, dim=1).values
    return torch.nn.functional.pad(torch.where(top < 2 ** 30, top, -1), (0, k - top.shape[1]), value=-1)


def test_topk_tie_safe_accepts_exact_and_rejects_wrong_picks():
    R, L, k = 4, 50, 8
    x = torch.randn(R, L)
    lengths = torch.tensor([50, 50, 20, 5])  # the last row: fewer candidates than k, -1 padded
    top = _top(x, lengths, k)
    assert topk_tie_safe(x, lengths, top, k, ascending=True) == (True, 1.0)
    lowest = torch.argsort(x[0, :20])[0]  # swap one pick for a candidate below the k-th score
    wrong = top.clone()
    wrong[0, 0] = lowest
    exact, recall = topk_tie_safe(x, lengths, wrong, k)
    assert not exact and recall == pytest.approx(7 / 8)
    dup = top.clone()
    dup[1, 1] = dup[1, 0]
    assert not topk_tie_safe(x, lengths, dup, k)[0]  # a duplicate pick
    short = top.clone()
    short[1, -1] = -1
    assert not topk_tie_safe(x, lengths, short, k)[0]  # one pick missing
    past = top.clone()
    past[2, 0] = 20 + int(torch.argmax(x[2, 20:]))  # the best score of the row, but past its length
    assert not topk_tie_safe(x, lengths, past, k)[0]
    for pad in (49, -7):  # padding other than -1 counts as a pick outside the row
        extra = top.clone()
        extra[3, 5] = pad
        assert not topk_tie_safe(x, lengths, extra, k)[0]
    assert topk_tie_safe(x, lengths, top.flip(1), k) == (True, 1.0)
    assert not topk_tie_safe(x, lengths, top.flip(1), k, ascending=True)[0]


def test_topk_tie_safe_ties_nan_and_empty_rows():
    k = 4
    x = torch.tensor([[1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 2.0],           # five tied at the k-th score
                      [float("nan"), 1.0, float("-inf"), 3.0, float("nan"), 0.0, 5.0]])
    lengths = torch.tensor([7, 7])
    for picks in ([1, 2, 3, 4], [2, 3, 4, 6], [1, 3, 4, 6]):   # any four of the tied ones
        assert topk_tie_safe(x[:1], lengths[:1], torch.tensor([picks]), k)[0]
    assert not topk_tie_safe(x[:1], lengths[:1], torch.tensor([[0, 1, 2, 3]]), k)[0]
    assert topk_tie_safe(x[1:], lengths[1:], torch.tensor([[1, 3, 5, 6]]), k)[0]
    assert not topk_tie_safe(x[1:], lengths[1:], torch.tensor([[0, 1, 3, 6]]), k)[0]  # NaN counts as -inf
    empty = torch.tensor([[-1, -1, -1, -1]])
    assert topk_tie_safe(x[:1], torch.tensor([0]), empty, k) == (True, 1.0)
    assert topk_tie_safe(torch.empty(1, 0), torch.tensor([0]), empty, k) == (True, 1.0)
    assert topk_tie_safe(torch.empty(0, 9), torch.empty(0, dtype=torch.long), torch.empty(0, k), k)[0]
    with pytest.raises(ValueError, match="idx"):
        topk_tie_safe(x, lengths, empty, k)  # one row of picks for two rows of scores


def test_topk_order_keys_follow_the_score_order():
    vals = torch.tensor([float("-inf"), -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, float("inf")])
    keys = topk_order_keys(vals)
    assert bool((keys[1:] > keys[:-1]).sum() == 8) and keys[4] == keys[5]  # -0.0 == +0.0, else increasing
    nan = topk_order_keys(torch.tensor([float("nan"), -float("nan")]))
    assert bool((nan == keys[0]).all())  # NaN of either sign = -inf
    x = torch.randn(1000)
    assert torch.equal(torch.argsort(topk_order_keys(x), stable=True), torch.argsort(x, stable=True))


# ---- inputs ------------------------------------------------------------------------------------------

def test_poison_and_poisoned_empty(monkeypatch):
    assert poison((2, 3)).isnan().all() and poison((4,), torch.bfloat16).isnan().all()
    assert (poison((5,), torch.int32) == 2 ** 31 - 1).all()
    poison_torch_empty(monkeypatch)
    assert torch.empty(3, 4).isnan().all() and (torch.empty(6, dtype=torch.uint8) == 255).all()


def test_rows_subset_spreads_and_includes_both_ends():
    assert rows_subset(100, 4).tolist() == [0, 33, 66, 99]
    assert rows_subset(3, 16).tolist() == [0, 1, 2]
    assert rows_subset(0, 4).numel() == 0


def test_paged_batch_and_caches_in_our_layouts():
    g = torch.Generator().manual_seed(1)
    seq, bt, P = paged_batch(5, 300, 2, g, "cpu")
    pages = (seq + 63) // 64
    assert bt.dtype == torch.int32 and bt.shape == (5, int(pages.max())) and P == int(pages.sum())
    assert bool(((seq >= 210) & (seq <= 390)).all())
    used = torch.cat([bt[b, :int(pages[b])] for b in range(5)])
    assert sorted(used.tolist()) == list(range(P))  # every page once
    assert all(bool((bt[b, int(pages[b]):] == 0).all()) for b in range(5))
    keys, scales = index_page_views(index_cache(P, g, "cpu"))
    assert bool(((scales >= 0.5) & (scales < 1.5)).all()) and keys.float().std() > 0.5
    cache = mla_cache(3, g, "cpu")
    assert cache.shape == (3, 64, MLA_FP8_BYTES) and dequantize_mla_656(cache.view(-1, MLA_FP8_BYTES)).float().std() > 0.5


def test_decode_slots_and_prefill_indices():
    g = torch.Generator().manual_seed(2)
    bt = torch.randperm(12, generator=g).view(3, 4)
    idx = decode_slots(bt, 200, 2, 50, g)
    assert idx.dtype == torch.int32 and idx.shape == (3, 2, 50)
    pos = torch.empty_like(idx)
    for b in range(3):  # back from slots to positions: distinct, below ctx
        page = {int(p): j for j, p in enumerate(bt[b])}
        pos[b] = torch.tensor([[page[int(s) // 64] * 64 + int(s) % 64 for s in row] for row in idx[b]])
    assert bool((pos < 200).all()) and all(len(set(r.tolist())) == 50 for r in pos.view(6, 50))
    idx = prefill_indices(8, 100, 20, g, "cpu")
    lim = torch.clamp((torch.arange(8) + 1) * 100 // 8, min=20)
    assert idx.shape == (8, 20) and bool((idx.long() < lim[:, None]).all())
    assert all(len(set(r.tolist())) == 20 for r in idx)
    with pytest.raises(ValueError, match="topk"):
        prefill_indices(8, 10, 20, g, "cpu")
    with pytest.raises(ValueError, match="topk"):
        decode_slots(bt, 300, 1, 20, g)  # 4 pages hold 256 positions


def test_ragged_ranges_cover_the_edge_cases():
    ks, ke = ragged_ranges(40, 100, torch.Generator().manual_seed(3))
    assert ks.dtype == ke.dtype == torch.int32 and bool(((0 <= ks) & (ks <= ke) & (ke <= 100)).all())
    assert list(zip(ks[:5].tolist(), ke[:5].tolist())) == [(0, 100), (50, 50), (100, 100), (0, 1), (0, 0)]
    assert int((ke - ks)[5:].gt(1).sum()) > 25  # the rest random, mostly wider than one key
    assert ragged_ranges(2, 0, torch.Generator())[1].tolist() == [0, 0]


# ---- timing ------------------------------------------------------------------------------------------

def test_timing_imports_without_triton_or_cuda():
    code = ("import sys, flashdsa.testing.timing, flashdsa.testing.compare, flashdsa.testing.inputs, "
            "flashdsa.testing.peers; bad = [m for m in ('triton', 'deep_gemm', 'sgl_kernel') if m in sys.modules]; "
            "assert not bad, bad; import torch; assert not torch.cuda.is_initialized()")
    root = str(Path(__file__).resolve().parents[1])  # this checkout's flashdsa, not an installed one
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": root})


@pytest.mark.interpreter
def test_host_cost_runs_every_call_on_the_cpu():
    """``flashdsa.testing.host_cost`` (``flashdsa bench --ops host``, bench_host.py) end to end at tiny shapes
    in the interpreter: every call of ours runs in both check modes and gets a row, the value-check setting
    is restored, and the table prints them (CPU times mean nothing, so no verdicts)."""
    from flashdsa import ops
    from flashdsa._checks import value_check_setting
    from flashdsa.testing import host_cost
    ops.set_value_checks("sync")
    try:
        rows, verdicts = host_cost.measure("cpu", (200,), calls=1, B=2, H=8, h_q=16, topk=64, backend="triton")
        assert value_check_setting() == "sync"
    finally:
        ops.set_value_checks(True)
    assert verdicts == []
    assert [r["call"] for r in rows] == ["indexer_logits_paged", "topk_transform", "topk_transform (out=)",
                                        "topk_transform (page table)", "sparse_mla_decode", "indexer_quant (q)",
                                        "step"]
    assert all(r["host_us"] > 0 and r["host_us_checks_off"] > 0 for r in rows)
    table = host_cost.table(rows)
    assert all(r["call"] in table for r in rows)
