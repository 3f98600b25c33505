"""The Gluon sparse-MLA kernels (``ops/sparse_mla/gluon.py``, ``gluon_bf16.py``, sm_90) and the rules that
pick them, over 576-dim rows (fp8 656 B, bf16) and NoPE rows (rope 0: fp8 528 B, bf16 512, a 512-dim q).

Triton's interpreter cannot run Gluon, so the kernels' own tests need an sm_90 GPU (``-m gpu``): the fp32
reference on dequantised inputs, NaN-poisoned outputs, ragged -1 padding, other negatives and slots past
the cache, rows with no valid slot, s_q 1 / 2 / 4, h_q 64 / 128 / 192, short and long top-k lists, and the
planned second launch, each for both row widths. On the CPU: the rules, the error of a forced
``backend="gluon"`` they do not apply to, the gather layouts' bank conflicts and loads, and both kernels
compiled for sm_90 (ptxas included) with and without the rope.

Tolerance, from the numerics: the kernel rounds P to bf16 (|dp| <= 2^-8 p, as FlashMLA does) and the
output to bf16 (2^-8 |out|), the rest is fp32, so ``|out - ref| <= 2^-8 (max |v| + |ref|)`` elementwise,
with FlashMLA's cosine diff (5e-6) and lse tolerance on top. (FlashMLA's elementwise 1e-3 + 2/128 |ref|
holds on long lists, where the rounding errors average out; on 64-token lists at h_q 64 it measured
1.4e-3 on a 0.012 element here, inside the bound above.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch
from test_sparse_mla_triton import DECODE_TOL, SM_SCALE, make_cache, make_indices
from test_sparse_mla_triton import check as check_rows

from flashdsa.cache.layouts import PAGE_SIZE, quantize_mla_656
from flashdsa.ops import sparse_mla_decode, sparse_mla_prefill
from flashdsa.ops._gluon import GluonKernels
from flashdsa.ops.sparse_mla import gluon, gluon_bf16

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon kernel needs an sm_90 GPU")


def check(out, lse, ref_out, ref_lse, cache):
    """The bound of the module docstring, FlashMLA's cosine diff and lse tolerance, exact empty rows
    (test_sparse_mla_triton's check over the rows read). ``cache``: the paged cache, or prefill's [N, D] bf16 KV
    (D 576, NoPE 512)."""
    check_rows(out, lse, ref_out, ref_lse, DECODE_TOL, rows=cache)


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    from flashdsa.testing.inputs import poison_torch_empty
    poison_torch_empty(monkeypatch)


def _inputs(device, B, s_q, h_q, topk, pages, fmt="fp8", rope=64):
    """q [B, s_q, h_q, 512 + rope] bf16, a paged cache of ``pages`` pages of ``fmt`` rows with ``rope`` rope dims
    (0: NoPE), indices [B, s_q, topk] int32 (make_indices: row 0 all invalid, ragged -1, slots past the cache)."""
    cache = make_cache(fmt, pages, device, rope=rope)
    q = torch.randn(B, s_q, h_q, 512 + rope, device=device).to(torch.bfloat16)
    idx = make_indices((B, s_q, topk), pages * PAGE_SIZE, device)
    return q, cache, idx


FP8_WHY = "the fp8 656-B or 528-B (NoPE) cache"


@pytest.mark.parametrize("rope", [64, 0])
@pytest.mark.parametrize("fmt,h_q,d_v,why", [
    ("fp8", 64, 512, "an sm_90 GPU"), ("bf16", 64, 512, "an sm_90 GPU"), ("fp8_raw", 64, 512, FP8_WHY),
    ("fp32", 64, 512, FP8_WHY), ("fp8", 32, 512, "an sm_90 GPU"), ("bf16", 32, 512, "h_q a multiple of 64"),
    ("fp8", 128, 256, "d_v 512"), ("bf16", 128, 256, "d_v 512")])
def test_rule_says_why_not(fmt, h_q, d_v, why, rope):
    """``unsupported`` names the first requirement a call misses, for 576-dim and NoPE rows alike (on the CPU
    the fp8 656-B / 528-B and bf16 caches miss only the GPU); a forced backend="gluon" raises it."""
    q, cache, idx = _inputs("cpu", 1, 1, h_q, 8, 1, fmt, rope)
    if fmt == "fp32":
        q = q.float()
    if fmt == "bf16":
        assert why in gluon_bf16.unsupported(q, cache, d_v)
    else:
        assert why in gluon.unsupported(q, cache, fmt, d_v)
    kw = dict(kv_scale=0.5) if fmt == "fp8_raw" else {}
    with pytest.raises(ValueError,
                       match=f"^backend: expected 'gluon' for a call it supports: it needs .*{re.escape(why)}"):
        sparse_mla_decode(q, cache, idx, SM_SCALE, d_v, backend="gluon", **kw)


@pytest.mark.parametrize("rope", [64, 0])
def test_prefill_rule_takes_transposed_kv(rope):
    """KV rows with a non-unit inner stride are copied first (as the Triton path does): only the device is
    then missing on the CPU, not alignment."""
    q = torch.randn(3, 64, 512 + rope).to(torch.bfloat16)
    kv = torch.randn(512 + rope, 101).to(torch.bfloat16).t()
    assert "an sm_90 GPU" in gluon_bf16.unsupported(q, kv, 512)


@pytest.mark.parametrize("rope", [64, 0])
@pytest.mark.parametrize("h_q,d_v,kv_dtype,why", [
    (64, 512, torch.bfloat16, "an sm_90 GPU"), (96, 512, torch.bfloat16, "h_q a multiple of 64"),
    (64, 128, torch.bfloat16, "d_v 512"), (64, 512, torch.float32, "bf16 KV")])
def test_prefill_rule_says_why_not(h_q, d_v, kv_dtype, why, rope):
    q = torch.randn(3, h_q, 512 + rope).to(torch.float32 if kv_dtype == torch.float32 else torch.bfloat16)
    kv = torch.randn(100, 512 + rope).to(kv_dtype)
    idx = torch.randint(0, 100, (3, 16), dtype=torch.int32)
    assert why in gluon_bf16.unsupported(q, kv, d_v)
    with pytest.raises(ValueError, match=f"^backend: expected 'gluon' for a call it supports: it needs .*{why}"):
        sparse_mla_prefill(q, kv, idx, SM_SCALE, d_v, backend="gluon")


def test_kernel_args_take_the_rope_from_q():
    """The launchers compile ROPE from q's last dim (64 for 576, 0 for 512) and refuse a cache whose rows do
    not match it (the op raises on that before any kernel: this guards direct launches)."""
    def fp8_args(d, width):
        q, out = torch.empty(1, 1, 64, d, dtype=torch.bfloat16), torch.empty(1, 1, 64, 512, dtype=torch.bfloat16)
        cache, idx = torch.empty(2, 64, width, dtype=torch.uint8), torch.empty(1, 1, 64, dtype=torch.int32)
        return gluon.kernel_args(q, cache, idx, SM_SCALE, out, torch.empty(1, 1, 64))[1]

    def bf16_args(d, width):
        q3, kv = torch.empty(2, 64, d, dtype=torch.bfloat16), torch.empty(100, width, dtype=torch.bfloat16)
        return gluon_bf16.kernel_args(q3, kv, 64 * width, width, 100, torch.empty(2, 16, dtype=torch.int32), SM_SCALE,
                                      torch.empty(2, 64, 512, dtype=torch.bfloat16), torch.empty(2, 64))[1]

    assert fp8_args(576, 656)["ROPE"] == 64 and fp8_args(512, 528)["ROPE"] == 0
    assert bf16_args(576, 576)["ROPE"] == 64 and bf16_args(512, 512)["ROPE"] == 0
    for args, d, width in ((fp8_args, 512, 656), (fp8_args, 576, 528), (bf16_args, 512, 576), (bf16_args, 576, 512)):
        with pytest.raises(AssertionError):
            args(d, width)


DECODE_CASES = [
    # B, s_q, h_q, topk, pages
    pytest.param(2, 1, 64, 64, 3, id="B2-s1-H64-k64"),
    pytest.param(1, 1, 128, 130, 4, id="B1-s1-H128-k130"),
    pytest.param(2, 2, 128, 2048, 40, id="B2-s2-H128-k2048"),
    pytest.param(3, 4, 64, 100, 5, id="B3-s4-H64-k100"),
    pytest.param(2, 1, 192, 1, 1, id="B2-s1-H192-k1"),
    pytest.param(4, 1, 128, 2048, 64, id="B4-s1-H128-k2048"),
    pytest.param(2, 1, 0, 64, 3, id="B2-s1-H0-k64"),  # no heads: nothing to launch
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("rope", [64, 0])
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("B,s_q,h_q,topk,pages", DECODE_CASES)
def test_gluon_decode_matches_reference(B, s_q, h_q, topk, pages, fmt, rope):
    """Both kernels over 576-dim rows and NoPE rows (fp8 528 B, bf16 512, a 512-dim q) against the reference."""
    q, cache, idx = _inputs("cuda", B, s_q, h_q, topk, pages, fmt, rope)
    if fmt == "bf16":
        assert gluon_bf16.unsupported(q, cache, 512) is None
    else:
        assert gluon.unsupported(q, cache, "fp8", 512) is None
    ref_out, ref_lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="torch")
    assert torch.isneginf(ref_lse[0, 0]).all()  # the all-invalid row really is empty
    for _ in range(2):  # the second call launches from the plan
        out, lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="gluon")
        assert out.shape == (B, s_q, h_q, 512) and lse.shape == (B, s_q, h_q)
        check(out, lse, ref_out, ref_lse, cache)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("rope", [64, 0])
def test_gluon_decode_with_scales_not_powers_of_two(rope):
    """Scales that are not powers of two (a cache quantised with amax / 448, not flashdsa's ue8m0): the
    kernel dequantises with the reference's arithmetic for any scale, so it is within the bound of the
    reference on the cache as it is (FlashMLA's bf16 scale multiply would need every scale rounded to bf16).
    The 656-B rows and the 528-B NoPE ones (the same scales at byte 512)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    pages = 40
    kv = torch.randn(pages * PAGE_SIZE, 512 + rope, device="cuda", generator=g).to(torch.bfloat16)
    cache = quantize_mla_656(kv, ue8m0=False).view(pages, PAGE_SIZE, -1)
    scales = cache[..., 512:528].contiguous().view(torch.float32)
    assert (torch.frexp(scales).mantissa.abs() != 0.5).any()  # really not powers of two
    assert cache.shape[-1] == 528 + 2 * rope
    q = torch.randn(2, 2, 128, 512 + rope, device="cuda", generator=g).to(torch.bfloat16)
    idx = make_indices((2, 2, 2048), pages * PAGE_SIZE, "cuda")
    out, lse = gluon.sparse_mla_decode_gluon(q, cache, idx, SM_SCALE)
    ref_out, ref_lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="torch")
    check(out, lse, ref_out, ref_lse, cache)


# Triton's linear layouts of the gather's layouts and of the shared tile, read in a child process: Triton
# 3.9's bindings leak a few ir.attribute objects there, and nanobind reports them at interpreter exit
_LINEAR_SCRIPT = r"""
import json
from triton._C.libtriton import gluon_ir, ir
from flashdsa.ops.sparse_mla import gluon
ctx = ir.context()
ir.load_dialects(ctx)
builder = gluon_ir.GluonOpBuilder(ctx)
out = {}
for name, layout, shape in [("smem128", gluon.tile_smem(64, 128), [64, 128]),
                            ("smem64", gluon.tile_smem(64, 64), [64, 64]),
                            ("gather", gluon.gather_layout(), [64, 128]), ("rope", gluon.rope_layout(), [64, 64]),
                            ("scales", gluon.scales_layout(), [64, 4])]:
    ll = builder.to_linear_layout(layout._to_ir(builder), shape)
    out[name] = {k: getattr(ll, k) for k in ("reg_bases", "lane_bases", "warp_bases", "offset_bases") if hasattr(ll, k)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def linear():
    """name -> the bases of Triton's linear layout (register / lane / warp bits, or a shared layout's offset
    bits -> (row, col)) of the shipped gather layouts and of the [64, 128] / [64, 64] shared tiles."""
    if tuple(int(x) for x in __import__("triton").__version__.split(".")[:2]) < (3, 9):
        pytest.skip("linear layouts from Python need Triton >= 3.9 (3.6 asserts in C++)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _LINEAR_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return {name: types.SimpleNamespace(**bases) for name, bases in json.loads(r.stdout).items()}


def _xor_at(*pairs):
    """(row, col) of the element at (bases, index) pairs: the XOR of each set bit's basis."""
    r = c = 0
    for bases, i in zip(pairs[::2], pairs[1::2]):
        for bit, (dr, dc) in enumerate(bases):
            if i >> bit & 1:
                r, c = r ^ dr, c ^ dc
    return r, c


def _phase_wavefronts(regs, smem, shape) -> int:
    """The most 16-B stores of one 8-lane phase that hit the same 4-bank group when a register tensor of
    linear layout ``regs`` is stored (16 B a store: 8 consecutive bf16) into the [rows, cols] bf16 tile of
    shared linear layout ``smem`` (``gluon.tile_smem``): 1 is conflict-free. Shared memory serves 16-B
    accesses 8 lanes at a time."""
    offset = {_xor_at(smem.offset_bases, o): o for o in range(shape[0] * shape[1])}
    worst = 0
    for w in range(1 << len(regs.warp_bases)):
        for store in range((1 << len(regs.reg_bases)) // 8):
            for phase in range((1 << len(regs.lane_bases)) // 8):
                hits: dict = {}
                for lane in range(8 * phase, 8 * phase + 8):
                    cells = [_xor_at(regs.reg_bases, 8 * store + j, regs.lane_bases, lane, regs.warp_bases, w)
                             for j in range(8)]
                    offs = [offset[cell] for cell in cells]
                    assert offs == list(range(offs[0], offs[0] + 8)), "a store of 8 contiguous bf16"
                    group = offs[0] * 2 // 16 % 8
                    hits[group] = hits.get(group, 0) + 1
                worst = max(worst, max(hits.values()))
    return worst


def test_gather_layouts_store_without_bank_conflicts(linear):
    """The producer's dequantised latent tile and its rope tile are stored without bank conflicts (8 lanes
    a row would write the same bank groups in both 64-column halves of the latent tile: 2-way, what ncu
    measured on the H200 for the first layout)."""
    assert _phase_wavefronts(linear["gather"], linear["smem128"], (64, 128)) == 1
    assert _phase_wavefronts(linear["rope"], linear["smem64"], (64, 64)) == 1


def _lines_per_load(ll, elem: int) -> tuple[int, int]:
    """Distinct rows (each a separate gathered row: its own lines) that one warp's load instruction touches,
    and the bytes of each: (rows, bytes a row)."""
    rows = {}
    for lane in range(1 << len(ll.lane_bases)):
        for reg in range(1 << 3):   # the first 8 registers: the elements of one 16-B (or 8-B) load
            r, c = _xor_at(ll.reg_bases, reg, ll.lane_bases, lane)
            rows.setdefault(r, set()).add(c * elem // 16)
    return len(rows), max(len(v) for v in rows.values()) * 16


def test_gather_layouts_load_whole_lines_and_share_rows(linear):
    """A warp's load instruction covers 4 rows x 128 bytes of the latent and of the rope (8 rows x 64 bytes,
    a rows-first layout's, measured slower), and the latent, rope and scales layouts put every row in the
    same threads (the row pointers are shared without a shuffle), the scales' with all four of a row's
    scales in each of those threads."""
    lat, rope, sc = linear["gather"], linear["rope"], linear["scales"]
    assert _lines_per_load(lat, 1) == (4, 128)
    assert _lines_per_load(rope, 2) == (4, 128)
    for lane in range(32):
        for w in range(4):
            rows_lat = {_xor_at(lat.reg_bases, r, lat.lane_bases, lane, lat.warp_bases, w)[0] for r in range(64)}
            rows_rope = {_xor_at(rope.reg_bases, r, rope.lane_bases, lane, rope.warp_bases, w)[0] for r in range(32)}
            assert rows_lat == rows_rope
            cells = {_xor_at(sc.reg_bases, r, sc.lane_bases, lane, sc.warp_bases, w) for r in range(16)}
            assert {r for r, _ in cells} == rows_lat and cells == {(r, c) for r in rows_lat for c in range(4)}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("rope", [64, 0])
def test_default_backend_is_gluon_where_it_applies(monkeypatch, rope):
    """On sm_90 the default picks the Gluon fp8 kernel for h_q 128 at any batch (B 64 whole lists, B 2 the list
    split over CTAs, h_q 16 in a 64-head CTA), over the 656-B and the 528-B NoPE cache; the same bits as
    forcing the backend."""
    q, cache, idx = _inputs("cuda", 64, 1, 128, 256, 8, rope=rope)
    for b in (64, 2):
        qb, ib = q[:b].contiguous(), idx[:b].contiguous()
        forced = sparse_mla_decode(qb, cache, ib, SM_SCALE, backend="gluon")
        default = sparse_mla_decode(qb, cache, ib, SM_SCALE)
        assert torch.equal(forced[0], default[0]) and torch.equal(forced[1], default[1])
    calls = []
    real = gluon.sparse_mla_decode
    monkeypatch.setattr(gluon, "sparse_mla_decode", lambda *a, **k: calls.append(a[0].shape[:3]) or real(*a, **k))
    sparse_mla_decode(q, cache, idx, SM_SCALE)
    sparse_mla_decode(q[:2].contiguous(), cache, idx[:2].contiguous(), SM_SCALE)
    sparse_mla_decode(q[:, :, :16].contiguous(), cache, idx, SM_SCALE)
    assert calls == [(64, 1, 128), (2, 1, 128), (64, 1, 16)]


def test_decode_splits_make_one_wave():
    """The split rule (a pure function): slices double while the CTAs stay within one wave of the SMs, up to
    16, each slice >= 128 tokens."""
    assert [gluon.decode_splits(b, 128, 2048, 132) for b in (1, 2, 4, 8, 16, 32, 64)] == [16, 16, 16, 8, 4, 2, 1]
    assert [gluon.decode_splits(b, 16, 2048, 132) for b in (1, 16, 64, 128)] == [16, 8, 2, 1]
    assert gluon.decode_splits(1, 64, 2063, 132) == 16          # kpool's list: padded to 16 equal slices
    assert gluon.decode_splits(1, 128, 300, 132) == 2           # slices of >= 128 tokens
    assert gluon.decode_splits(1, 128, 255, 132) == 1
    assert gluon.decode_splits(1, 128, 2048, 1) == 1


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("rope", [64, 0])
@pytest.mark.parametrize("B,h_q", [(1, 16), (64, 16), (3, 32), (2, 96)])
def test_gluon_decode_pads_heads(B, h_q, rope):
    """h_q not a multiple of 64 runs in whole 64-head CTAs (heads >= h_q read as 0, never stored): the
    reference's numbers for the h_q heads asked, with and without a split of the list, NaN-poisoned outputs,
    576-dim and NoPE rows."""
    q, cache, idx = _inputs("cuda", B, 1, h_q, 2048, 40, rope=rope)
    ref_out, ref_lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="torch")
    for splits in (None, 1):
        out, lse = gluon.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, splits)
        assert out.shape == (B, 1, h_q, 512)
        check(out, lse, ref_out, ref_lse, cache)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("rope", [64, 0])
@pytest.mark.parametrize("splits,topk", [(2, 2048), (3, 2048), (16, 2048), (16, 2063), (4, 130)])
def test_gluon_decode_splits_match_reference(splits, topk, rope):
    """The list in ``splits`` slices (bf16 partials merged by the combine kernel) against the fp32
    reference, NaN-poisoned outputs, the all-invalid row empty, lists that do not divide (padded), 576-dim
    and NoPE rows."""
    q, cache, idx = _inputs("cuda", 2, 2, 128, topk, 40, rope=rope)
    ref_out, ref_lse = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="torch")
    assert torch.isneginf(ref_lse[0, 0]).all()
    for _ in range(2):
        out, lse = gluon.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, splits)
        check(out, lse, ref_out, ref_lse, cache)


PREFILL_CASES = [
    # T, N, h_q, topk
    pytest.param(5, 300, 64, 64, id="T5-N300-H64-k64"),
    pytest.param(3, 4096, 128, 2048, id="T3-N4096-H128-k2048"),
    pytest.param(7, 1000, 128, 130, id="T7-N1000-H128-k130"),
    pytest.param(2, 64, 192, 1, id="T2-N64-H192-k1"),
    pytest.param(4, 5000, 64, 2047, id="T4-N5000-H64-k2047"),
    pytest.param(3, 100, 0, 16, id="T3-N100-H0-k16"),  # no heads: nothing to launch
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("rope", [64, 0])
@pytest.mark.parametrize("T,N,h_q,topk", PREFILL_CASES)
def test_gluon_prefill_matches_reference(T, N, h_q, topk, rope):
    """Prefill over gathered bf16 KV of 576 dims or NoPE's 512 (a 512-dim q), also read in place from a wider
    buffer (row stride 640); chunked calls give the one-shot call's bits."""
    d = 512 + rope
    q = torch.randn(T, h_q, d, device="cuda").to(torch.bfloat16)
    wide = torch.randn(N, 640, device="cuda").to(torch.bfloat16)
    idx = make_indices((T, topk), N, "cuda")
    # contiguous, a wider buffer read in place, and a transposed buffer (copied first, like the Triton path)
    for kv in (wide[:, :d].contiguous(), wide[:, :d], wide[:, :d].t().contiguous().t()):
        assert gluon_bf16.unsupported(q, kv, 512) is None
        ref_out, ref_lse = sparse_mla_prefill(q, kv, idx, SM_SCALE, backend="torch")
        assert torch.isneginf(ref_lse[0]).all()  # the all-invalid row really is empty
        for _ in range(2):  # the second call launches from the plan
            out, lse = sparse_mla_prefill(q, kv, idx, SM_SCALE, backend="gluon")
            assert out.shape == (T, h_q, 512) and lse.shape == (T, h_q)
            check(out, lse, ref_out, ref_lse, kv)
        tail = sparse_mla_prefill(q[1:], kv, idx[1:], SM_SCALE, backend="gluon")
        assert torch.equal(tail[0], out[1:]) and torch.equal(tail[1], lse[1:])


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("rope", [64, 0])
def test_default_backend_is_gluon_for_bf16_where_it_applies(monkeypatch, rope):
    """bf16 pages and prefill KV (576-dim and NoPE rows): the default picks the bf16 Gluon kernel at h_q 64 / 128
    (decode: at B 64, where its CTAs cover a third of the SMs), Triton at h_q 16."""
    q, cache, idx = _inputs("cuda", 64, 1, 128, 256, 8, "bf16", rope)
    kv = cache.view(-1, 512 + rope)
    qp, ip = q[:, 0].contiguous(), idx[:, 0].contiguous()
    calls = []
    for name in ("sparse_mla_decode", "sparse_mla_prefill"):
        real = getattr(gluon_bf16, name)
        monkeypatch.setattr(gluon_bf16, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    out = sparse_mla_decode(q, cache, idx, SM_SCALE)
    sparse_mla_decode(q[:, :, :16].contiguous(), cache, idx, SM_SCALE)
    pre = sparse_mla_prefill(qp, kv, ip, SM_SCALE)
    sparse_mla_prefill(qp[:, :16].contiguous(), kv, ip, SM_SCALE)
    assert calls == ["sparse_mla_decode", "sparse_mla_prefill"]
    # the same rows through the paged and the flat view: the same kernel, the same bits
    assert torch.equal(out[0][:, 0], pre[0]) and torch.equal(out[1][:, 0], pre[1])


def test_failed_first_launch_falls_back_to_triton_once(monkeypatch):
    """A Gluon kernel whose first launch raises (a Triton whose Gluon API moved): a RuntimeWarning, the Triton
    result for that call, and the rule names the failure from then on; the other Gluon kernel is unaffected.
    After a kernel has run once, its errors propagate (they are not a version problem)."""
    import flashdsa.ops.sparse_mla as S
    monkeypatch.setattr(S, "_GLUONS", GluonKernels(lambda name: S._module(name)))
    calls = []

    def broken(*args):
        raise TypeError("an API this Triton does not have")

    fakes = {S._GLUON_BF16: types.SimpleNamespace(sparse_mla_prefill=broken, unsupported=lambda *a: None),
             S._GLUON_FP8: types.SimpleNamespace(sparse_mla_decode=lambda *a: calls.append("fp8") or "fp8 ok",
                                                 unsupported=lambda *a: None)}
    monkeypatch.setattr(S, "_module", lambda name: fakes[name])
    with pytest.warns(RuntimeWarning, match=r"sparse_mla_prefill: the Gluon kernel \(gluon_bf16.py\) failed .*TypeError"):
        got = S._run_gluon(S._GLUON_BF16, "prefill", lambda *a: "triton result", 1, 2)
    assert got == "triton result"
    assert "its first launch failed: TypeError" in S._gluon_unsupported(S._GLUON_BF16)
    assert S._gluon_unsupported(S._GLUON_FP8) is None
    assert S._run_gluon(S._GLUON_FP8, "decode", lambda *a: "unused") == "fp8 ok" and S.gluon_decode_ran()
    fakes[S._GLUON_FP8].sparse_mla_decode = broken
    with pytest.raises(TypeError):
        S._run_gluon(S._GLUON_FP8, "decode", lambda *a: "unused")


_COMPILE_SCRIPT = r'''
from flashdsa.ops.sparse_mla import gluon, gluon_bf16
# the rope's wgmma of one QK (k 64 in steps of 16) times the kernel's QK sites: gluon.py's consumer 0, both
# of gluon_bf16.py's consumers
ROPE_WGMMA = {gluon: 4, gluon_bf16: 8}
for mod in (gluon, gluon_bf16):
    ks = {}
    for rope in (64, 0):
        k = ks[rope] = mod.compile_sm90(rope)
        what = (mod.__name__, rope)
        assert k.asm["cubin"] and "setmaxnreg" in k.asm["ptx"], what
        assert k.metadata.shared <= 227 * 1024, (what, k.metadata.shared)
        notes = ptxas_notes(k)
        # C7513-C7515: ptxas serialised the wgmma (what an accumulator or operand held across an async wgmma does)
        assert not any(f"C751{i}" in notes for i in (3, 4, 5)), (what, notes[-2000:])
    # NoPE: no rope tiles and no rope wgmma
    assert ks[0].metadata.shared < ks[64].metadata.shared, mod.__name__
    wgmma = {r: k.asm["ptx"].count("wgmma.mma_async") for r, k in ks.items()}
    assert wgmma[64] - wgmma[0] == ROPE_WGMMA[mod], (mod.__name__, wgmma)
print("compiled")
'''


def test_gluon_kernels_compile_for_hopper():
    """The default decode (fp8 pages) and bf16 kernels compile for sm_90 through Triton's code generator and
    ptxas without a GPU (CI has none), over 576-dim rows and NoPE rows (ROPE 0), fit in shared memory, have
    their setmaxnreg register moves, and ptxas does not serialise their wgmma; the NoPE kernels hold no rope
    tiles and issue no rope wgmma."""
    pytest.importorskip("triton.experimental.gluon")
    from test_indexer_triton import PTXAS_NOTES, compile_without_interpreter
    compile_without_interpreter(PTXAS_NOTES + _COMPILE_SCRIPT)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("rope", [64, 0])
def test_gluon_kernels_repeat_and_rows_do_not_depend_on_s_q(rope):
    """Same input, same bits (10 repeats), for the fp8 decode and the bf16 prefill kernel; and, for one split
    count, a decode row's bits do not depend on the rows beside it (s_q 2 against two calls of s_q 1). The
    default split count follows the number of query rows (``gluon.decode_splits``, as FlashMLA's follows the
    batch), so by default a row of verify (s_q 2) and of decode (s_q 1) may differ by the partials' bf16
    rounding. (Checked on the H200 on 2026-12-03 with 30 repeats before the split existed.) 576-dim and NoPE
    rows."""
    q, cache, idx = _inputs("cuda", 3, 2, 128, 2048, 64, rope=rope)
    first = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="gluon")
    for _ in range(10):
        again = sparse_mla_decode(q, cache, idx, SM_SCALE, backend="gluon")
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    for splits in (1, 4):
        both = gluon.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, splits)
        one = [gluon.sparse_mla_decode(q[:, j:j + 1].contiguous(), cache, idx[:, j:j + 1].contiguous(), SM_SCALE,
                                       512, None, splits) for j in range(2)]
        assert torch.equal(torch.cat([s[0] for s in one], 1), both[0])
    d = 512 + rope
    qp, kv = (torch.randn(n, *s, device="cuda").to(torch.bfloat16) for n, s in ((700, (128, d)), (3000, (d,))))
    ip = make_indices((700, 2048), 3000, "cuda")
    first = sparse_mla_prefill(qp, kv, ip, SM_SCALE, backend="gluon")
    for _ in range(10):
        again = sparse_mla_prefill(qp, kv, ip, SM_SCALE, backend="gluon")
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
