"""Triton topk_transform against the torch reference, bit for bit.

Rows are adversarial (all equal, two values, heavy ties at the k-th value, 16 / 256 levels, narrow
ranges, -inf runs, denormals, NaN, -0.0 / +0.0, +inf) with lengths 0, < k, = k, = k + 1 and longer;
hypothesis draws the row kinds, lengths, k, the output mode (plain / out_offsets / page table shared
by g rows), row_starts, a strided logits view and the launch config. Small buffers (U of 256, W of
16 or 256, samples of 32) make every path reachable on rows of a few thousand: the sampled threshold, its
two misses (forced), levels on the row, on U and on W, early exits, warp segments spanning several
tiles, radix levels in registers and streamed from memory (one-warp programs), and split mode (a row's
compaction over several programs, the last of them to arrive selecting and emitting, one launch) next to
the fused kernel. Outputs are poisoned (INT32_MAX) so an unwritten slot fails; runs repeat bit for bit.
Realistic sizes (k = 2048, rows of 8K / 32K / 128K) and CUDA-graph capture are GPU-only.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashdsa import ops
from flashdsa.ops._triton_utils import num_sms
from flashdsa.ops.topk import _IMPLS, launch, split
from flashdsa.ops.topk.reference import topk_transform as ref_impl
from flashdsa.testing.compare import topk_order_keys, topk_tie_safe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ("randn", "equal", "two", "levels16", "levels256", "ties_at_k", "narrow", "neginf_runs",
         "denormal", "nan", "signed_zero", "posinf", "allnan", "mostly_equal")

# Launch configs: changes to launch.default_config() of the call's shape (``kind`` picks the kernel).
# Buffer sizes for the interpreter: small enough that rows of ~1000-3000 reach every path.
SMALL = dict(cand=256, lg_sample=5, block=128)  # U of 256 slots, 32 samples
# Compaction tiles of num_warps * unroll * 128 scores: 2 warps, 1 tile -> a row of 3000 is several tiles
# and split chunks of 256.
TILES = dict(num_warps=2, unroll=1)
KNOBS = {
    "default": {},
    "small": SMALL,
    "small-b8": dict(SMALL, bits=8, bits_w=8, bits_s=8, block=64),
    "small-b3": dict(SMALL, bits=3, bits_w=3, bits_s=3, block=256),
    "small-w16": dict(SMALL, wcap=16),    # W smaller than most buckets: more levels on U first
    "small-tiles": dict(SMALL, num_warps=4, unroll=1),  # a warp's segment over several tiles
    "miss-high": dict(SMALL, force="sample_max"),  # guess = largest sampled key: < k candidates, some above
    "miss-none": dict(SMALL, force="no_guess"),    # no guess: every key a candidate, more than U holds
    "miss-low": dict(SMALL, force="sample_min"),   # guess = smallest sampled key: > U candidates, some below
    "split": dict(SMALL, kind="split", chunks=3, **TILES),  # split mode: a row's compaction over 3 programs
    "split-zeroed": dict(SMALL, kind="split", chunks=3, cached_counters=False, **TILES),  # zeroed counters
    "split-miss-high": dict(SMALL, kind="split", chunks=4, force="sample_max", **TILES),
    "split-default": dict(kind="split", chunks=2),
    # 8-warp programs (the fallback's step 128 NW, as by default), radix levels in registers
    "regs-default": dict(stream=False, num_warps=8, block=1024),
    "split-regs": dict(kind="split", chunks=2, stream=False, num_warps=8),
    # one-warp programs: the radix levels stream U / W (and, sample_stream, the sample) from memory
    "stream": dict(SMALL, stream=True, num_warps=1),
    "stream-sample": dict(SMALL, stream=True, num_warps=1, sample_stream=True),
    "stream-w16": dict(SMALL, stream=True, num_warps=1, wcap=16, lg_sample=3),
    "stream-miss-low": dict(SMALL, stream=True, num_warps=1, force="sample_min"),
    "stream-1warp": dict(stream=True, num_warps=1, block=128),   # the fallback's step 128 NW
    "move-32": dict(SMALL, move_step=32),   # [NW, 32] list entries moved to U a step (default 128 / 64)
    "split-stream": dict(SMALL, kind="split", chunks=3, sample_stream=True, **TILES),   # the sample streamed
    "split-finish-stream": dict(SMALL, kind="split", chunks=2, stream=True, **TILES),   # the finisher streamed
    # a program a row held in registers (rows.py): 2048-bucket levels, and 3-bit ones (many levels each row)
    "rows": dict(kind="rows", num_warps=4),
    "rows-b3": dict(kind="rows", num_warps=2, bits=3),
    # the levels' ranges (by default the buckets' min / max only for buckets of over 1/32 of the row): every
    # bucket's min / max (narrow 2), and none, the whole key range from the start (narrow 0: at most
    # ceil(32 / bits) levels, 3-bit ones run 11)
    "rows-n2": dict(kind="rows", num_warps=4, narrow=2),
    "rows-n2-b3": dict(kind="rows", num_warps=2, bits=3, narrow=2),
    "rows-full-b3": dict(kind="rows", num_warps=2, bits=3, narrow=0),
}


def _config(logits, k, knobs, device=DEVICE) -> launch.TopkConfig:
    """launch.default_config() of this call's shape (the kind knobs["kind"] if given), changed by knobs. Knobs
    without a kind are the fused kernel's (the rows kernel, which shapes of 2K-4K default to, ignores them); no
    knobs at all: the default launch, whatever kernel it picks."""
    R, L = logits.shape
    kind = knobs.get("kind", "fused" if knobs else None)
    default = launch.default_config(R, L, k, num_sms(torch.device(device)), kind)
    return dataclasses.replace(default, **knobs)


def _row(kind: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """n float32 scores of one adversarial kind."""
    u = torch.rand(n, generator=g)
    if kind == "randn" or n == 0:
        return torch.randn(n, generator=g)
    if kind == "equal":
        return torch.full((n,), 0.7)
    if kind == "two":
        return torch.where(u < 0.5, 1.0, -2.0)
    if kind == "mostly_equal":  # one value, 1 % of the keys above it and 4 % below
        return torch.where(u < 0.01, torch.randn(n, generator=g) + 5, torch.where(u > 0.96, -5.0, 0.25))
    if kind == "levels16":
        return (u * 16).floor() / 16
    if kind == "levels256":
        return (u * 256).floor() - 128
    if kind == "ties_at_k":  # the k-th value repeated many times around the boundary
        x = torch.randn(n, generator=g)
        x[torch.randperm(n, generator=g)[: max(1, n // 3)]] = float(x.sort(descending=True).values[min(k, n) - 1])
        return x
    if kind == "narrow":  # a few distinct fp32 values one ulp apart
        return 1000 + u * 1e-3
    if kind == "neginf_runs":
        x = torch.randn(n, generator=g)
        x[(torch.arange(n) // 7) % 3 != 0] = float("-inf")
        return x
    if kind == "denormal":
        return torch.randint(-40, 40, (n,), generator=g).float() * 1e-44
    if kind == "nan":
        x = torch.randn(n, generator=g)
        x[u < 0.3] = float("nan")
        x[(u >= 0.3) & (u < 0.45)] = float("-inf")
        return x
    if kind == "signed_zero":
        x = torch.where(u < 0.5, 0.0, -0.0)
        x[u > 0.9] = -1e-45
        return x
    if kind == "posinf":
        x = torch.randn(n, generator=g)
        x[u < 0.05] = float("inf")
        return x
    if kind == "allnan":
        return torch.full((n,), float("nan"))
    raise ValueError(kind)


def _case(R, L, k, kinds, lengths, seed, *, mode="plain", g=1, starts=False, stride_pad=0):
    """Inputs of one call: logits (maybe a strided view), lengths, and the translation arguments."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.full((R, L + stride_pad), float("nan"))
    row_starts = None
    for r in range(R):
        n = lengths[r]
        s0 = int(torch.randint(0, L - n + 1, (1,), generator=gen)) if starts else 0
        base[r, s0:s0 + n] = _row(kinds[r % len(kinds)], n, k, gen)
        if starts:
            row_starts = [] if row_starts is None else row_starts
            row_starts.append(s0)
    logits = base[:, :L]
    kw = {}
    if starts:
        kw["row_starts"] = torch.tensor(row_starts, dtype=torch.int32)
    if mode == "offsets":
        kw["out_offsets"] = torch.randint(0, 10 ** 6, (R,), generator=gen, dtype=torch.int32)
    elif mode == "pages":
        ps = 64
        maxp = (L + ps - 1) // ps + 1
        kw["page_table"] = torch.randint(0, 10 ** 5, (R // g, maxp), generator=gen, dtype=torch.int32)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    return logits, lengths, kw


def _run_both(logits, lengths, k, kw, knobs, device=DEVICE):
    """(triton output into a poisoned buffer, reference output), both on CPU."""
    to = functools.partial(torch.Tensor.to, device=device)
    args = [to(logits), to(lengths), k, to(kw["page_table"]) if "page_table" in kw else None,
            to(kw["row_starts"]) if "row_starts" in kw else None,
            to(kw["out_offsets"]) if "out_offsets" in kw else None, 64]
    out = torch.full((logits.shape[0], k), torch.iinfo(torch.int32).max, dtype=torch.int32, device=device)
    got = launch.topk_transform(*args, out=out, config=_config(logits, k, knobs, device))
    ref = ref_impl(logits, lengths, k, kw.get("page_table"), kw.get("row_starts"), kw.get("out_offsets"), 64)
    return got.cpu(), ref


def _assert_same(got, ref, note=""):
    if not torch.equal(got, ref):
        bad = (got != ref).any(dim=1).nonzero().flatten().tolist()
        r = bad[0]
        col = int((got[r] != ref[r]).nonzero()[0])
        raise AssertionError(f"{note} rows {bad[:8]} differ; row {r} from col {col}: "
                             f"got {got[r, col:col + 6].tolist()} want {ref[r, col:col + 6].tolist()}")


# ---- every adversarial kind, every path ---------------------------------------------------------------

@pytest.mark.parametrize("knobs", list(KNOBS), ids=[f"knobs-{n}" for n in KNOBS])
def test_adversarial_kinds(knobs):
    # one call per knob set: 14 kinds x lengths {0, <k, =k, =k+1, 2k+3, 1500, 3000} spread over rows
    k = 100
    lens = [3000, 1500, 2 * k + 3, k + 1, k, 37, 0, 3000, 2999, 1500, 3000, 640, 3000, 2996]
    kinds = list(KINDS)
    logits, lengths, kw = _case(len(kinds), 3000, k, kinds, lens, seed=1)
    got, ref = _run_both(logits, lengths, k, kw, KNOBS[knobs])
    _assert_same(got, ref, knobs)


@pytest.mark.parametrize("k", [1, 7, 64])
def test_small_k(k):
    kinds = ["randn", "equal", "levels16", "nan", "neginf_runs", "two"]
    lens = [2000, 2000, 2000, 900, 2000, k + 1]
    logits, lengths, kw = _case(len(kinds), 2000, k, kinds, lens, seed=k)
    for name in ("default", "small", "miss-high", "miss-low"):
        got, ref = _run_both(logits, lengths, k, kw, KNOBS[name])
        _assert_same(got, ref, f"k={k} {name}")


def test_k2048_short_rows():
    # the hot k with rows the interpreter can afford: 0, < k, = k, = k + 1, and a few thousand
    k = 2048
    lens = [0, 5, 2047, 2048, 2049, 3000, 5000]
    kinds = ["randn", "levels256", "ties_at_k", "equal", "randn", "narrow", "randn"]
    logits, lengths, kw = _case(len(lens), 5000, k, kinds, lens, seed=7, mode="offsets")
    got, ref = _run_both(logits, lengths, k, kw, {})
    _assert_same(got, ref)


@pytest.mark.parametrize("mode,g", [("plain", 1), ("offsets", 1), ("pages", 1), ("pages", 3)],
                         ids=["plain", "offsets", "pages-g1", "pages-g3"])
def test_translations_and_row_starts(mode, g):
    k = 64
    R = 6
    lens = [1000, 63, 64, 65, 700, 0]
    kinds = ["randn", "levels16", "two", "randn", "nan", "equal"]
    logits, lengths, kw = _case(R, 1200, k, kinds, lens, seed=3, mode=mode, g=g, starts=True, stride_pad=5)
    for name in ("default", "small"):
        got, ref = _run_both(logits, lengths, k, kw, KNOBS[name])
        _assert_same(got, ref, f"{mode} {name}")


def test_page_size_other_than_64():
    k = 50
    logits, lengths, kw = _case(2, 1000, k, ["randn", "levels16"], [1000, 700], seed=5)
    table = torch.randint(0, 1000, (2, 8), dtype=torch.int32)
    out = torch.full((2, k), torch.iinfo(torch.int32).max, dtype=torch.int32)
    got = launch.topk_transform(logits, lengths, k, table, None, None, 256, out=out,
                                config=_config(logits, k, SMALL))
    _assert_same(got, ref_impl(logits, lengths, k, table, None, None, 256))


def test_public_api_backend_triton_is_deterministic():
    # through the public function (validation + dispatch), twice, same bits
    logits, lengths, kw = _case(3, 1500, 100, ["levels256", "randn", "ties_at_k"], [1500, 1200, 101], seed=11,
                                mode="pages", g=3)
    a = ops.topk_transform(logits, lengths, 100, backend="triton", **kw)
    b = ops.topk_transform(logits, lengths, 100, backend="triton", **kw)
    assert torch.equal(a, b)
    _assert_same(a, ops.topk_transform(logits, lengths, 100, backend="torch", **kw))


def test_triton_is_the_cuda_default():
    assert "triton" in _IMPLS
    from flashdsa.ops._common import pick_backend
    assert pick_backend(None, _IMPLS, torch.device("cuda"), "topk_transform") is _IMPLS["triton"]


@pytest.mark.parametrize("mode,g", [("plain", 1), ("offsets", 1), ("pages", 2)], ids=["plain", "offsets", "pages-g2"])
@pytest.mark.parametrize("chunks", [2, 4])
def test_split_one_launch(mode, g, chunks):
    # split mode's single launch: ragged rows, rows of length <= k mixed in (copied by chunk 0 alone, no
    # arrival), every translation; the arrival counters are back at zero after each call, so a second
    # call (same cached counters) gives the same bits
    k = 64
    lens = [1500, 40, 1437, 64, 65, 0, 1500, 999]
    kinds = ["randn", "levels16", "ties_at_k", "two", "randn", "equal", "nan", "levels256"]
    logits, lengths, kw = _case(len(lens), 1500, k, kinds, lens, seed=17 + chunks, mode=mode, g=g, starts=True)
    knobs = dict(SMALL, kind="split", chunks=chunks, **TILES)
    got, ref = _run_both(logits, lengths, k, kw, knobs)
    _assert_same(got, ref, f"{mode} chunks={chunks}")
    assert all(not bool(buf.any()) for buf in split._ARRIVE.values()), "arrival counters not reset"
    again, _ = _run_both(logits, lengths, k, kw, knobs)
    assert torch.equal(again, got)


def test_kernel_choice_rule():
    # H200 (132 SMs), top-2048: few rows of 2K-16K take the rows kernel (2K-4K since 2026-12-04: 9-14 us against
    # the fused / split kernels' 17-28), longer ones split, many rows of 2K-4K the rows kernel too, other many rows
    # or short ones the fused kernel
    kind = lambda R, L, k=2048: launch.default_config(R, L, k, 132).kind  # noqa: E731
    assert [kind(1, L) for L in (2048, 2112, 4096, 8256, 16384, 16448)] == ["fused", "rows", "rows", "rows", "rows",
                                                                          "split"]
    assert kind(132, 3072) == "rows" and kind(4, 1000, 64) == "fused"
    # many rows: the rows kernel up to 4K only (4096 rows x 4096: 127.5 us against the fused kernel's 304.9; x 8K
    # it was 1.16x slower)
    assert kind(4096, 4096) == "rows" and kind(4096, 4160) == "fused" and kind(133, 2048) == "fused"
    # the rows kernel: 8 warps; past 4K the row as two tiles (8256: 8192 + 2048 key slots, 20-25 % faster)
    cfg = lambda L: launch.default_config(64, L, 2048, 132)  # noqa: E731
    assert [(cfg(L).num_warps, cfg(L).tiles) for L in (2560, 4096, 4160, 8256)] == [(8, 1), (8, 1), (8, 2), (8, 2)]


def test_split_chunks_rule():
    # H200 (132 SMs): many rows keep a chunk per 32K of row (more were slower at 64 rows); rows too few to
    # fill the SMs so get a chunk per 4K of row while (row, chunk) programs stay within one wave, <= 16
    chunks = lambda R, L: launch.default_config(R, L, 2048, 132, kind="split").chunks
    assert [chunks(64, L) for L in (32768, 131072)] == [2, 4]
    assert [chunks(R, 32768) for R in (1, 4, 16, 33, 66, 132)] == [8, 8, 8, 4, 2, 2]
    assert [chunks(R, 131072) for R in (1, 4, 16)] == [16, 16, 8]
    assert chunks(1, 4096) == 2 and chunks(200, 131072) == 2
    for R in range(1, 133):
        for L in (4096, 20000, 32768, 65536, 131072):
            c = chunks(R, L)
            assert 2 <= c <= 16 and c & (c - 1) == 0
            assert c == 2 or R * c <= 4 * 132  # never more than the 4-programs-an-SM budget


def test_registered_op_keeps_no_counters(monkeypatch):
    # Called as the registered op (what a compiled graph runs), split mode takes fresh arrival counters:
    # torch.compile's CUDA-graph trees route their warm-up's allocations into a private pool and check that
    # only their outputs stay there, which the per-stream cached counters would not. Eager calls cache
    # them. Same bits either way.
    monkeypatch.setattr(split, "_ARRIVE", {})
    R, L, k = 2, 16448, 64  # past the rows kernel's 16K: split mode, the one with arrival counters
    assert launch.default_config(R, L, k, num_sms(torch.device(DEVICE))).kind == "split"
    g = torch.Generator().manual_seed(5)
    x = torch.randn(R, L, generator=g).to(DEVICE)
    n = torch.tensor([L, L - 7], dtype=torch.int32, device=DEVICE)
    via_op = torch.ops.flashdsa.topk_transform(x, n, k, None, None, None, 64, "triton")
    assert split._ARRIVE == {}
    eager = ops.topk_transform(x, n, k, backend="triton")
    assert len(split._ARRIVE) == 1
    assert torch.equal(via_op, eager)
    assert torch.equal(eager.cpu(), ref_impl(x.cpu(), n.cpu(), k, None, None, None, 64))


@pytest.mark.parametrize("cached", [True, False], ids=["cached-counters", "zeroed-counters"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_split_finisher_selects_from_all_chunks(chunks, cached):
    # the finisher takes the fast path on every chunk's candidates (the row fallback, exact whatever the
    # chunks wrote, would hide a finisher that read too early): stop_after="select" ends it before the
    # emit with T + need in slot 0 (the fallback writes nothing there). The answer is "keys > T and the
    # first need keys == T": T = the k-th largest key with need = its copies taken, or, when its bucket
    # was taken whole, any T between the (k+1)-th largest key and the k-th one with need = 0.
    k, R, L = 64, 4, 1500
    logits, lengths, _ = _case(R, L, k, ["randn", "levels256"], [L] * R, seed=23)
    out = torch.full((R, k), torch.iinfo(torch.int32).max, dtype=torch.int32, device=DEVICE)
    cfg = _config(logits, k, dict(kind="split", chunks=chunks, cached_counters=cached, stop_after="select",
                                  **TILES))
    launch.topk_transform(logits.to(DEVICE), lengths.to(DEVICE), k, None, None, None, 64, out=out, config=cfg)
    got = out[:, 0].cpu().long()
    top = topk_order_keys(logits).sort(dim=1, descending=True).values.long()
    kth, next_key = top[:, k - 1], top[:, k]
    need = k - (top > kth[:, None]).sum(dim=1)
    ok = (got == kth + need) | ((got >= next_key) & (got < kth))
    assert bool(ok.all()), (got.tolist(), kth.tolist(), need.tolist())


TIE_KINDS = ["equal", "two", "allnan", "signed_zero", "ties_at_k", "levels16"]
# U of 1024 holds every warp list (no list overflows) but not a row of 3000: rows whose keys mostly tie
# with the guess take the tie-capped move (fused, split-2: chunks of 1500) or the tie-capped gather of the
# chunks (split-3: chunks of 1000 fit U, their sum does not)
# (hypothesis draws these too, with the tie-capped compaction on: the 4-warp fused default has it off)
TIE_KNOBS = {"fused": dict(cand=1024, lg_sample=5, block=128, kind="fused", num_warps=4, unroll=1, ties=True),
             "split-2": dict(cand=1024, lg_sample=5, block=128, kind="split", chunks=2, ties=True, **TILES),
             "split-3": dict(cand=1024, lg_sample=5, block=128, kind="split", chunks=3, ties=True, **TILES)}


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "no-ties"])
@pytest.mark.parametrize("knobs", list(TIE_KNOBS))
def test_ties_beyond_u_take_the_capped_path(knobs, ties):
    # Rows of 3000 whose k-th key has hundreds to thousands of copies: more candidates reach the guess
    # than U holds, but only the first k - #(key > T) copies can be selected, so U gets those (and every
    # key above) and the row is selected there, not by the row fallback (several passes over the row).
    # The output equals the reference; and with stop_after="select" every row's slot 0 holds T + need
    # (see test_split_finisher_selects_from_all_chunks), which the fallback never writes.
    k, L = 100, 3000
    R = len(TIE_KINDS)
    logits, lengths, kw = _case(R, L, k, TIE_KINDS, [L] * R, seed=31)
    knob = dict(TIE_KNOBS[knobs], ties=ties)   # no-ties: every equal key listed, the capped move / gather
    got, ref = _run_both(logits, lengths, k, kw, knob)
    _assert_same(got, ref, knobs)
    out = torch.full((R, k), torch.iinfo(torch.int32).max, dtype=torch.int32, device=DEVICE)
    cfg = _config(logits, k, dict(knob, stop_after="select"))
    launch.topk_transform(logits.to(DEVICE), lengths.to(DEVICE), k, None, None, None, 64, out=out, config=cfg)
    got = out[:, 0].cpu().long()
    top = topk_order_keys(logits).sort(dim=1, descending=True).values.long()
    kth = top[:, k - 1]
    need = k - (top > kth[:, None]).sum(dim=1)
    # U may hold exactly the selection (k keys: the capped copies), so its select may take the last
    # bucket whole: then need = 0 and T is anything from the largest key below the k-th one (k-th - 1
    # when there is none) up to k-th - 1
    below = torch.where(top < kth[:, None], top, -2 ** 40).max(dim=1).values
    below = torch.where(below == -2 ** 40, kth - 1, below)
    ok = (got == kth + need) | ((got >= below) & (got < kth))
    assert bool(ok.all()), [(kind, g) for kind, g, o in zip(TIE_KINDS, got.tolist(), ok.tolist()) if not o]


@pytest.mark.parametrize("knobs", list(TIE_KNOBS))
def test_mostly_equal_rows_list_a_warps_first_k_equal_keys(knobs):
    # Rows whose sample says a warp's segment holds more than k keys equal to the guess: the compaction
    # lists every key above it but only a warp's first k equal ones (`ties`). The count after the
    # compaction shows it ran (at most num_warps * (k + #above) a program, against the whole row without
    # it), and the output is the reference's bits either way (also with the capped move / gather after it).
    k, L = 100, 3000
    kinds = ["equal", "mostly_equal", "signed_zero", "allnan", "randn"]
    R = len(kinds)
    logits, lengths, kw = _case(R, L, k, kinds, [L] * R, seed=37)
    above = (topk_order_keys(logits) > topk_order_keys(logits).sort(dim=1, descending=True).values[:, k - 1:k])
    counts = {}
    for ties in (True, False):
        knob = dict(TIE_KNOBS[knobs], ties=ties)
        got, ref = _run_both(logits, lengths, k, kw, knob)
        _assert_same(got, ref, f"{knobs} ties={ties}")
        out = torch.full((R, k), -1, dtype=torch.int32, device=DEVICE)
        cfg = _config(logits, k, dict(knob, stop_after="compaction"))
        launch.topk_transform(logits.to(DEVICE), lengths.to(DEVICE), k, None, None, None, 64, out=out, config=cfg)
        chunks = cfg.chunks if cfg.kind == "split" else 1
        counts[ties] = out[:, :chunks].cpu().long().sum(dim=1)
    lists = TIE_KNOBS[knobs].get("chunks", 1) * TIE_KNOBS[knobs]["num_warps"]
    for r, kind in enumerate(kinds[:4]):
        bound = lists * k + int(above[r].sum())
        assert counts[True][r] <= bound < counts[False][r], (kind, bound, counts)
    assert counts[True][4] == counts[False][4], counts   # random rows: no ties, the same lists


def test_whole_chunk_row_loads():
    # 128-bit row loads read to the length rounded up to 4 (VEC): only when every row is whole 16-byte
    # chunks, and the scores read past a row's length (+inf here) never count
    x = torch.randn(3, 72)
    assert launch._whole_chunks(x, None) and launch._whole_chunks(x[:, 4:68], None)
    assert not launch._whole_chunks(x[:, :63], None)                        # length not a multiple of 4
    assert not launch._whole_chunks(x[:, 2:66], None)                       # rows start off a 16-byte boundary
    assert not launch._whole_chunks(x, torch.zeros(3, dtype=torch.int32))   # ragged rows start anywhere
    k, L = 64, 1500
    lens = [1499, 1001, 1498, 1497, 65]
    logits, lengths, kw = _case(len(lens), L, k, ["randn", "levels16", "two", "randn", "randn"], lens, seed=29)
    for r, n in enumerate(lens):
        logits[r, n:] = float("inf")
    for knobs in (dict(SMALL), dict(SMALL, kind="split", chunks=3, **TILES)):
        got, ref = _run_both(logits, lengths, k, kw, dict(knobs, vec=True))
        _assert_same(got, ref, str(knobs))


def test_grid_smaller_than_rows():
    # one program walks several rows: scratch reuse between rows must not leak
    kinds = ["equal", "randn", "levels16", "nan", "randn", "two", "narrow", "randn", "levels256"]
    lens = [1500, 1500, 1500, 40, 1500, 1500, 1500, 0, 1500]
    logits, lengths, kw = _case(len(kinds), 1500, 64, kinds, lens, seed=13)
    got, ref = _run_both(logits, lengths, 64, kw, dict(SMALL, grid=2))
    _assert_same(got, ref)


# ---- hypothesis ---------------------------------------------------------------------------------------

ALL_KNOBS = {**KNOBS, **{f"ties-{name}": knobs for name, knobs in TIE_KNOBS.items()}}  # + the tie-capped paths

@st.composite
def _calls(draw):
    k = draw(st.sampled_from([1, 7, 64, 100]))
    R = draw(st.integers(1, 4))
    L = draw(st.sampled_from([k, k + 1, 2 * k + 1, 777, 2500]))
    length_kind = st.sampled_from(["full", "full", "zero", "k", "k+1", "lt_k", "any"])
    lens = []
    for _ in range(R):
        lk = draw(length_kind)
        n = {"full": L, "zero": 0, "k": k, "k+1": k + 1, "lt_k": max(0, k - 3)}.get(lk)
        lens.append(min(L, n if n is not None else draw(st.integers(0, L))))
    kinds = [draw(st.sampled_from(KINDS)) for _ in range(R)]
    mode = draw(st.sampled_from(["plain", "offsets", "pages"]))
    g = draw(st.sampled_from([d for d in (1, 2, 3, 4) if R % d == 0])) if mode == "pages" else 1
    return dict(R=R, L=L, k=k, lens=lens, kinds=kinds, mode=mode, g=g, starts=draw(st.booleans()),
                pad=draw(st.sampled_from([0, 3])), knobs=draw(st.sampled_from(list(ALL_KNOBS))),
                seed=draw(st.integers(0, 2 ** 20)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=_calls())
def test_hypothesis_matches_reference(c):
    logits, lengths, kw = _case(c["R"], c["L"], c["k"], c["kinds"], c["lens"], c["seed"], mode=c["mode"],
                                g=c["g"], starts=c["starts"], stride_pad=c["pad"])
    got, ref = _run_both(logits, lengths, c["k"], kw, ALL_KNOBS[c["knobs"]])
    _assert_same(got, ref, str(c))


def test_rows_kernel_two_tiles():
    """A row just past a power of two held as two tiles (half the power and a smaller one): the same bits as the
    reference for every adversarial kind, ragged lengths across the tiles' boundary, both level ranges."""
    assert launch.rows_tiles(8256, 16, 2) == (8192, 2048) and launch.rows_tiles(8192, 16, 2) == (8192, 0)
    assert launch.rows_tiles(12288, 16, 2) == (8192, 4096) and launch.rows_tiles(12289, 16, 2) == (16384, 0)
    assert launch.rows_tiles(8256, 16, 1) == (16384, 0) and launch.rows_tiles(2112, 16, 2) == (4096, 0)
    k, L = 64, 1100
    assert launch.rows_tiles(L, 2, 2) == (1024, 256)
    kinds = list(KINDS)
    lens = [L, L - 1, 1024, 1025, 1023, k + 1, k, 0, 700] * 2
    logits, lengths, kw = _case(len(lens), L, k, kinds, lens, seed=11, mode="pages")
    for narrow, bits in ((1, 11), (2, 3), (0, 3)):
        got, ref = _run_both(logits, lengths, k, kw, dict(kind="rows", num_warps=2, bits=bits, narrow=narrow, tiles=2))
        _assert_same(got, ref, f"rows two tiles narrow{narrow} bits{bits}")


def test_rows_kernel_refuses_rows_past_16k():
    # the rows kernel packs two counts of at most its block in an int32: an explicit config past 16K is an error
    logits = torch.randn(2, launch.ROWS_MAX_L + 1)
    cfg = launch.default_config(2, logits.shape[1], 64, 4, kind="rows")
    with pytest.raises(ValueError, match="kind 'rows' takes rows of at most 16384"):
        launch.topk_transform(logits, torch.tensor([10, 20], dtype=torch.int32), 64, None, None, None, 64, config=cfg)


@pytest.mark.parametrize("field,value", [("narrow", 3), ("narrow", -1), ("bits", 12), ("bits", 0)])
def test_rows_config_refuses_bad_knobs(field, value):
    # the rows kernel's own knobs: a ValueError naming the field before anything is compiled
    cfg = dataclasses.asdict(launch.default_config(2, 8192, 64, 4, kind="rows"))
    with pytest.raises(ValueError, match=f"TopkConfig.{field}: expected"):
        launch.TopkConfig(**dict(cfg, **{field: value}))


@pytest.mark.parametrize("mode", ["pages", "offsets"])
def test_rows_kernel_device_checks(mode):
    # the rows kernel's CHECK path (the default mode's device value checks): good rows give the reference's
    # bits; a row with a bad value selects nothing and the error surfaces as the ValueError naming it
    from flashdsa import _checks
    k, L = 64, 700
    lens = [L, 300, k, 0, 9]
    logits, lengths, kw = _case(len(lens), L, k, ["randn", "levels16", "equal"], lens, seed=3, mode=mode)
    cfg = launch.default_config(len(lens), L, k, 4, kind="rows")
    to = functools.partial(torch.Tensor.to, device=DEVICE)
    args = (kw.get("page_table"), None, kw.get("out_offsets"))
    args = tuple(None if a is None else to(a) for a in args)
    good = launch.topk_transform(to(logits), to(lengths), k, *args, 64, config=cfg, check=True)
    _checks.check_errors()
    _assert_same(good.cpu(), ref_impl(logits, lengths, k, kw.get("page_table"), None, kw.get("out_offsets"), 64))
    bad = lengths.clone()
    bad[1] = L + 1   # past the logits' width
    out = launch.topk_transform(to(logits), to(bad), k, *args, 64, config=cfg, check=True)
    with pytest.raises(ValueError, match="lengths"):
        _checks.check_errors()
    assert bool((out[1] == -1).all()) and torch.equal(out[0].cpu(), good[0].cpu())


# ---- GPU: realistic sizes ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("R,L", [(64, 32768), (8, 131072), (256, 8192)], ids=["64x32K", "8x128K", "256x8K"])
@pytest.mark.parametrize("kind", ["randn", "levels256", "levels16", "equal", "narrow", "nan"])
def test_gpu_realistic(R, L, kind):
    k = 2048
    gen = torch.Generator().manual_seed(R + L)
    lens = [L] * (R - 2) + [L - 1000, k + 1]
    logits = torch.stack([_row(kind, L, k, gen) for _ in range(R)]).cuda()
    lengths = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = launch.topk_transform(logits, lengths, k, None, None, None, 64)
    ref = ref_impl(logits, lengths, k, None, None, None, 64)
    _assert_same(out.cpu(), ref.cpu(), f"{R}x{L} {kind}")
    assert topk_tie_safe(logits, lengths, out, k, ascending=True)[0], f"{R}x{L} {kind}"
    assert torch.equal(out, launch.topk_transform(logits, lengths, k, None, None, None, 64))


GPU_MODES = [dict(kind="fused", num_warps=1, stream=True, sample_stream=True, block=128),
             dict(kind="fused", num_warps=4, stream=True, sample_stream=True, block=512),
             dict(kind="fused", num_warps=8, stream=False, maxnreg=64, grid=64),
             dict(kind="split", chunks=8, num_warps=8, stream=False),
             dict(kind="split", chunks=16, num_warps=2, sample_stream=True, stream=True, cand=8192, block=256)]


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", GPU_MODES,
                         ids=["fused-stream1", "fused-stream4", "fused-regs", "split8-regs", "split16-stream"])
@pytest.mark.parametrize("kind", ["randn", "levels16", "narrow"])
def test_gpu_modes(knobs, kind):
    # both kernels, levels in registers and streamed, at k = 2048 whatever default_config() picks
    k, R, L = 2048, 64, 32768
    gen = torch.Generator().manual_seed(L)
    logits = torch.stack([_row(kind, L, k, gen) for _ in range(R)]).cuda()
    lengths = torch.randint(k - 5, L + 1, (R,), generator=gen, dtype=torch.int32).cuda()
    out = launch.topk_transform(logits, lengths, k, None, None, None, 64, config=_config(logits, k, knobs))
    _assert_same(out.cpu(), ref_impl(logits, lengths, k, None, None, None, 64).cpu(), f"{knobs} {kind}")


@pytest.mark.gpu
@pytest.mark.parametrize("L", [2112, 4096, 8192, 8256, 10649, 16384])
@pytest.mark.parametrize("mode", ["plain", "pages"])
@pytest.mark.parametrize("bits", [11, 8, 3])
def test_gpu_rows_kernel(L, mode, bits):
    # the rows kernel's shared-memory histograms (inline PTX: compiled only, the interpreter counts with
    # tl.histogram): every kind of row, ragged lengths with the edge cases, 8- and 16-warp programs
    k = 2048
    kinds = list(KINDS)
    lens = [L, L - 1, k + 1, k, 63, 0, min(4 * k + 3, L - 2), L // 2] * 4 + [L] * 32
    logits, lengths, kw = _case(len(lens), L, k, kinds, lens, seed=L + bits, mode=mode)
    for nw, narrow, tiles in ((8, 2, 1), (16, 2, 1), (8, 1, 1), (16, 1, 1), (16, 0, 1), (16, 1, 2), (8, 2, 2)):
        knobs = dict(kind="rows", num_warps=nw, bits=bits, narrow=narrow, tiles=tiles)
        got, ref = _run_both(logits, lengths, k, kw, knobs)
        _assert_same(got, ref, f"rows nw{nw} bits{bits} narrow{narrow} tiles{tiles} L{L} {mode}")


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    k, R, L = 2048, 16, 40000
    logits = torch.randn(R, L, device="cuda")
    lengths = torch.randint(0, L + 1, (R,), dtype=torch.int32, device="cuda")
    table = torch.randint(0, 10 ** 5, (R, (L + 63) // 64), dtype=torch.int32, device="cuda")
    ops.set_value_checks(False)
    try:
        ops.topk_transform(logits, lengths, k, page_table=table)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.topk_transform(logits, lengths, k, page_table=table)
        for kind in ("randn", "levels16", "equal"):
            gen = torch.Generator().manual_seed(len(kind))
            logits.copy_(torch.stack([_row(kind, L, k, gen) for _ in range(R)]))
            lengths.copy_(torch.randint(0, L + 1, (R,), generator=gen, dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            _assert_same(out.cpu(), ref_impl(logits, lengths, k, table, None, None, 64).cpu(), kind)
    finally:
        ops.set_value_checks(True)


def test_outgrown_counters_stay_alive(monkeypatch):
    """More rows than the cached arrival counters hold: a larger buffer replaces them, and the old one is
    kept alive (a CUDA graph captured with it replays on its address), never handed back to the allocator."""
    monkeypatch.setattr(split, "_ARRIVE", {})
    monkeypatch.setattr(split, "_OUTGROWN", [])
    dev = torch.device(DEVICE)
    small = split.arrive_counters(dev, 8, True)
    assert split.arrive_counters(dev, 1024, True) is small
    large = split.arrive_counters(dev, 1025, True)
    assert large is not small and large.numel() >= 1025 and not large.any()
    assert len(split._OUTGROWN) == 1 and split._OUTGROWN[0] is small
    assert split.arrive_counters(dev, 1025, True) is large
