"""Byte layouts of the paged caches (flashdsa.cache.layouts), checked byte by byte: where every key,
scale and rope value sits, round trips, writers that touch only their slots, and every ValueError."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from flashdsa.cache import layouts as L
from flashdsa.quant import FP8, act_quant

# e4m3fn grid (finite values) for building exactly representable inputs
_GRID = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).double()
_GRID = _GRID[~torch.isnan(_GRID)]


def _f32_bytes(v: float) -> list[int]:
    return list(struct.pack("<f", v))


def _bf16_bytes(t: torch.Tensor) -> list[int]:
    """Little-endian bytes of bf16 values, from the upper half of their fp32 bit patterns."""
    out = []
    for v in t.float().tolist():
        out += list(struct.pack("<f", v)[2:])
    return out


def _pow2_ceil(s: float) -> float:
    p = 2.0 ** -150
    while p < s:
        p *= 2.0
    return p


def _random_bytes(*shape) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.int32).to(torch.uint8)


def _random_keys(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    k_fp8, s = act_quant(torch.randn(n, 128) * 3)
    return k_fp8, s[:, 0] * torch.rand(n).add(0.5)  # arbitrary positive fp32 scales, not powers of two


# ---- constants -------------------------------------------------------------------------------------

def test_bytes_per_token_constants():
    assert L.INDEX_PAGE_BYTES == 8448 and L.INDEX_KEY_BYTES == 8192 and L.INDEX_BYTES_PER_TOKEN == 132
    assert L.MLA_BF16_BYTES == 1152 and L.MLA_FP8_BYTES == 656 and L.MLA_FP8_RAW_BYTES == 576
    assert L.BYTES_PER_TOKEN == {"bf16": 1152, "fp8": 656, "fp8_raw": 576, "fp32": 2304, "index": 132}
    assert L.MLA_FP32_BYTES == 2304 and L.ALL_MLA_FORMATS == L.MLA_FORMATS + ("fp32",)
    assert L.PAGE_SIZE == 64 and L.MLA_DIM == 576 and L.MLA_LATENT == 512


# ---- indexer pages ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 200], ids=lambda n: f"N{n}")
def test_pack_index_pages_byte_positions(n):
    k_fp8, k_scale = _random_keys(n)
    pages = L.pack_index_pages(k_fp8, k_scale)
    assert pages.dtype == torch.uint8 and pages.shape == (math.ceil(n / 64), 8448)
    kb = k_fp8.view(torch.uint8)
    expect = torch.zeros_like(pages)  # unused tail of the last page is zero
    for t in range(n):
        page, row = t // 64, t % 64
        expect[page, 128 * row:128 * row + 128] = kb[t]
        expect[page, 8192 + 4 * row:8192 + 4 * row + 4] = torch.tensor(_f32_bytes(k_scale[t].item()), dtype=torch.uint8)
    assert torch.equal(pages, expect)
    k2, s2 = L.unpack_index_pages(pages, n)
    assert torch.equal(k2.view(torch.uint8), kb) and torch.equal(s2, k_scale)
    if n:
        # default n = 64 P: the zero tail comes back as zeros
        k3, s3 = L.unpack_index_pages(pages)
        assert k3.shape == (64 * pages.shape[0], 128)
        assert torch.equal(k3[:n].view(torch.uint8), kb) and (k3[n:].view(torch.uint8) == 0).all()
        assert (s3[n:] == 0).all()


def test_index_page_views_share_storage():
    cache = _random_bytes(3, 8448)
    keys, scales = L.index_page_views(cache)
    assert keys.dtype == FP8 and keys.shape == (3, 64, 128)
    assert scales.dtype == torch.float32 and scales.shape == (3, 64)
    scales[2, 5] = 1.5
    assert cache[2, 8192 + 20:8192 + 24].tolist() == _f32_bytes(1.5)
    keys[1, 63, 127] = 2.0
    assert cache[1, 128 * 63 + 127].item() == torch.tensor(2.0).to(FP8).view(torch.uint8).item()


@pytest.mark.parametrize("n_pages,n", [(1, 1), (3, 64), (5, 65), (7, 200)], ids=["P1-N1", "P3-N64", "P5-N65", "P7-N200"])
def test_store_index_keys_touches_only_its_slots(n_pages, n):
    cache = _random_bytes(n_pages, 8448)
    before = cache.clone()
    slots = torch.randperm(n_pages * 64)[:n]
    k_fp8, k_scale = _random_keys(n)
    L.store_index_keys(cache, slots.to(torch.int32), k_fp8, k_scale)
    expect = before.clone()
    for i, s in enumerate(slots.tolist()):
        page, row = s // 64, s % 64
        expect[page, 128 * row:128 * row + 128] = k_fp8[i].view(torch.uint8)
        expect[page, 8192 + 4 * row:8192 + 4 * row + 4] = torch.tensor(_f32_bytes(k_scale[i].item()), dtype=torch.uint8)
    assert torch.equal(cache, expect)
    k2, s2 = L.gather_index_keys(cache, slots)
    assert torch.equal(k2.view(torch.uint8), k_fp8.view(torch.uint8)) and torch.equal(s2, k_scale)


def test_store_index_keys_empty():
    cache = _random_bytes(2, 8448)
    before = cache.clone()
    k, s = _random_keys(0)
    L.store_index_keys(cache, torch.zeros(0, dtype=torch.int64), k, s)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("bad", [
    torch.zeros(2, 8448, dtype=torch.int8), torch.zeros(2, 8447, dtype=torch.uint8),
    torch.zeros(8448, dtype=torch.uint8), torch.zeros(2, 64, 132, dtype=torch.uint8),
    torch.zeros(8448, 2, dtype=torch.uint8).t(),
], ids=["int8", "width", "1d", "3d", "strided"])
def test_index_cache_errors(bad):
    with pytest.raises(ValueError, match="index_cache"):
        L.index_page_views(bad)
    k, s = _random_keys(1)
    with pytest.raises(ValueError, match="index_cache"):
        L.store_index_keys(bad, torch.zeros(1, dtype=torch.int32), k, s)


def test_store_index_keys_errors():
    cache = torch.zeros(2, 8448, dtype=torch.uint8)
    k, s = _random_keys(3)
    slots = torch.tensor([0, 5, 127])
    with pytest.raises(ValueError, match="slots"):
        L.store_index_keys(cache, slots.float(), k, s)
    with pytest.raises(ValueError, match="slots"):
        L.store_index_keys(cache, slots.view(3, 1), k, s)
    with pytest.raises(ValueError, match="slots"):
        L.store_index_keys(cache, torch.tensor([0, 5, 128]), k, s)
    with pytest.raises(ValueError, match="slots"):
        L.store_index_keys(cache, torch.tensor([0, -1, 5]), k, s)
    with pytest.raises(ValueError, match="k_fp8"):
        L.store_index_keys(cache, slots, k[:2], s)
    with pytest.raises(ValueError, match="k_fp8"):
        L.store_index_keys(cache, slots, k.float(), s)
    with pytest.raises(ValueError, match="k_scale"):
        L.store_index_keys(cache, slots, k, s[:2])
    with pytest.raises(ValueError, match="k_scale"):
        L.store_index_keys(cache, slots, k, s.double())
    assert (cache == 0).all()  # nothing written on any failed call


def test_pack_unpack_errors():
    k, s = _random_keys(4)
    with pytest.raises(ValueError, match="k_fp8"):
        L.pack_index_pages(k.float(), s)
    with pytest.raises(ValueError, match="k_fp8"):
        L.pack_index_pages(k.view(4, 2, 64), s)
    with pytest.raises(ValueError, match="k_fp8"):
        L.pack_index_pages(torch.zeros(4, 64, dtype=FP8), s)
    with pytest.raises(ValueError, match="k_scale"):
        L.pack_index_pages(k, s[:3])
    with pytest.raises(ValueError, match="k_scale"):
        L.pack_index_pages(k, s.bfloat16())
    pages = L.pack_index_pages(k, s)
    with pytest.raises(ValueError, match="n"):
        L.unpack_index_pages(pages, 65)
    with pytest.raises(ValueError, match="n"):
        L.unpack_index_pages(pages, -1)


# ---- MLA 656 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 5, 64], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_mla_656_byte_layout(n, dtype):
    kv = (torch.randn(n, 576) * torch.exp(torch.randn(n, 1) * 2)).to(dtype)
    kv[0, 3] = 0.0
    packed = L.quantize_mla_656(kv)
    assert packed.dtype == torch.uint8 and packed.shape == (n, 656)
    q_ref, _ = act_quant(kv[:, :512].float())
    for t in range(n):
        row = packed[t].tolist()
        # scales: bytes 512..527, 4 little-endian fp32 = 2^ceil(log2(max(amax, 1e-4) / 448)) per 128 dims
        for j in range(4):
            amax = max(kv[t, 128 * j:128 * (j + 1)].float().abs().max().item(), 1e-4)
            s = _pow2_ceil(torch.tensor(amax, dtype=torch.float32).div(448.0).item())  # fp32 divide, then ue8m0
            assert row[512 + 4 * j:516 + 4 * j] == _f32_bytes(s), (t, j)
        # latent: bytes 0..511 are the e4m3 codes of the block-quantised latent
        assert row[:512] == q_ref[t].view(torch.uint8).tolist()
        # rope: bytes 528..655 are the bf16 rope, bit-identical
        assert row[528:] == _bf16_bytes(kv[t, 512:].bfloat16())
    latent, scale, rope = L.mla_656_fields(packed)
    assert latent.dtype == FP8 and latent.shape == (n, 512)
    assert scale.dtype == torch.float32 and scale.shape == (n, 4)
    assert rope.dtype == torch.bfloat16 and torch.equal(rope, kv[:, 512:].bfloat16())


def test_mla_656_dequant_tolerance():
    kv = (torch.randn(50, 576) * torch.exp(torch.randn(50, 1))).bfloat16()
    deq = L.dequantize_mla_656(L.quantize_mla_656(kv))
    assert deq.dtype == torch.bfloat16 and deq.shape == (50, 576)
    assert torch.equal(deq[:, 512:], kv[:, 512:])  # rope never quantised
    x = kv[:, :512].float()
    scale = torch.stack([x[:, 128 * j:128 * (j + 1)].abs().amax(1) for j in range(4)], 1) / 448
    se = scale.repeat_interleave(128, 1) * 2  # ue8m0 scale <= 2x the exact one
    err = (deq[:, :512].float() - x).abs()
    assert (err <= 2.0 ** -4 * x.abs() + 2.0 ** -10 * se + 1e-30).all()


def test_mla_656_exact_when_representable():
    n = 8
    k = torch.randint(-10, 6, (n, 4)).double()
    grid = _GRID[_GRID.abs() <= 448]
    lat = grid[torch.randint(0, grid.numel(), (n, 512))].view(n, 4, 128)
    lat[:, :, 0] = 448.0  # pin every block's amax to 448 * 2^k: the ue8m0 scale is exactly 2^k
    lat = (lat * (2.0 ** k)[..., None]).view(n, 512)
    kv = torch.cat([lat, torch.randn(n, 64, dtype=torch.float64)], 1).bfloat16()
    assert torch.equal(kv[:, :512].double(), lat)  # representable in bf16
    packed = L.quantize_mla_656(kv)
    assert torch.equal(L.mla_656_fields(packed)[1].double(), 2.0 ** k)
    assert torch.equal(L.dequantize_mla_656(packed), kv)


def test_mla_656_rope_specials_bit_identical():
    kv = torch.randn(3, 576).bfloat16()
    kv[0, 512:516] = torch.tensor([0.0, -0.0, 1e-40, -3.4e38]).bfloat16()
    packed = L.quantize_mla_656(kv)
    assert torch.equal(packed[:, 528:], kv[:, 512:].contiguous().view(torch.uint8))


# ---- MLA 576 raw -----------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [1.0, 0.01, 3.7])
def test_mla_576_raw(scale):
    kv = (torch.randn(20, 576) * 2).bfloat16()
    kv[0, 0] = 1e4  # clamped to ±448 * scale
    kv[0, 1] = -1e4
    packed = L.quantize_mla_576(kv, scale)
    assert packed.dtype == torch.uint8 and packed.shape == (20, 576)
    codes = packed.view(FP8).float()
    assert torch.isfinite(codes).all() and codes.abs().max() <= 448
    assert codes[0, 0].item() == 448 and codes[0, 1].item() == -448
    want = (kv.float() / scale).clamp(-448, 448)
    ok = torch.ones_like(want, dtype=torch.bool)
    ok[0, :2] = False
    err = (codes - want).abs()
    assert (err[ok] <= 2.0 ** -4 * want.abs()[ok] + 2.0 ** -10).all()
    deq = L.dequantize_mla_576(packed, scale)
    assert deq.dtype == torch.bfloat16 and torch.equal(deq, (codes.double() * scale).float().bfloat16())


def test_mla_576_round_trip_exact_when_representable():
    grid = _GRID[_GRID.abs() <= 448]
    kv = (grid[torch.randint(0, grid.numel(), (10, 576))] * 0.25).bfloat16()
    assert torch.equal(L.dequantize_mla_576(L.quantize_mla_576(kv, 0.25), 0.25), kv)
    assert torch.equal(L.decode_mla(L.encode_mla(kv, "fp8_raw", 0.25), 0.25), kv)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_mla_576_bad_scale(scale):
    with pytest.raises(ValueError, match="scale"):
        L.quantize_mla_576(torch.randn(2, 576), scale)


# ---- formats, encode / decode ----------------------------------------------------------------------

def test_mla_row_widths():
    want = {("bf16", 64): (576, 1152), ("fp8", 64): (656, 656), ("fp8_raw", 64): (576, 576), ("fp32", 64): (576, 2304),
            ("bf16", 0): (512, 1024), ("fp8", 0): (528, 528), ("fp8_raw", 0): (512, 512), ("fp32", 0): (512, 2048)}
    for (fmt, rope), (width, nbytes) in want.items():
        assert (L.mla_row_width(fmt, rope), L.mla_row_bytes(fmt, rope)) == (width, nbytes)
    with pytest.raises(ValueError, match="^rope: expected one of"):
        L.mla_row_width("fp8", 32)
    with pytest.raises(ValueError, match="^fmt: expected one of"):
        L.mla_row_width("fp4")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_raw", "fp32"])
def test_nope_rows_are_the_rows_without_their_rope_part(fmt):
    """A NoPE row (512 dims) holds the same latent bytes as the 576-dim row of the same latent: fp8's scales
    come from the latent alone, so the 528-B row is the 656-B row's first 528 bytes."""
    scale = 0.25 if fmt == "fp8_raw" else None
    kv = torch.randn(70, 576) * 3
    wide, nope = L.encode_mla(kv, fmt, scale), L.encode_mla(kv[:, :512], fmt, scale)
    assert nope.shape == (70, L.mla_row_width(fmt, 0))
    assert torch.equal(nope, wide[:, :nope.shape[1]])
    assert torch.equal(L.decode_mla(nope, scale), L.decode_mla(wide, scale)[:, :512])
    cache = torch.full((2, 64, nope.shape[1]), 7, dtype=nope.dtype)
    L.store_mla(cache, torch.arange(3, 73), kv[:, :512], scale)
    assert torch.equal(L.gather_mla(cache, torch.arange(3, 73), scale), L.decode_mla(nope, scale))
    assert (cache.view(-1, nope.shape[1])[:3] == 7).all()  # nothing else written
    with pytest.raises(ValueError, match=r"^kv: expected a float tensor \[N, 512\]"):
        L.store_mla(cache, torch.arange(3), kv[:3], scale)  # 576-dim rows into a NoPE cache


def test_mla_cache_format():
    assert L.mla_cache_format(torch.zeros(2, 64, 576, dtype=torch.bfloat16)) == "bf16"
    assert L.mla_cache_format(torch.zeros(2, 64, 656, dtype=torch.uint8)) == "fp8"
    assert L.mla_cache_format(torch.zeros(2, 64, 576, dtype=torch.uint8)) == "fp8_raw"
    assert L.mla_cache_format(torch.zeros(2, 64, 576, dtype=torch.float32)) == "fp32"
    # NoPE rows (no rope part): every width distinct per dtype
    assert L.mla_cache_layout(torch.zeros(2, 64, 512, dtype=torch.bfloat16)) == ("bf16", 0)
    assert L.mla_cache_layout(torch.zeros(2, 64, 528, dtype=torch.uint8)) == ("fp8", 0)
    assert L.mla_cache_layout(torch.zeros(2, 64, 512, dtype=torch.uint8)) == ("fp8_raw", 0)
    assert L.mla_cache_layout(torch.zeros(2, 64, 512, dtype=torch.float32)) == ("fp32", 0)
    assert L.mla_cache_layout(torch.zeros(2, 64, 656, dtype=torch.uint8)) == ("fp8", 64)
    for bad in (torch.zeros(2, 64, 576, dtype=torch.float16), torch.zeros(2, 64, 656, dtype=torch.bfloat16),
                torch.zeros(2, 64, 576, dtype=torch.float64), torch.zeros(2, 64, 528, dtype=torch.float32),
                torch.zeros(2, 64, 1024, dtype=torch.uint8), torch.zeros(2, 64, 528, dtype=torch.bfloat16),
                torch.zeros(2, 64, 600, dtype=torch.uint8), torch.zeros(2, 64, 576, dtype=torch.float8_e4m3fn)):
        with pytest.raises(ValueError, match="kv_cache"):
            L.mla_cache_format(bad)


def test_encode_decode_errors():
    kv = torch.randn(3, 576)
    with pytest.raises(ValueError, match="fmt"):
        L.encode_mla(kv, "fp4")
    with pytest.raises(ValueError, match="scale"):
        L.encode_mla(kv, "fp8_raw")
    with pytest.raises(ValueError, match="scale"):
        L.decode_mla(L.encode_mla(kv, "fp8_raw", 1.0))
    for fmt in L.ALL_MLA_FORMATS:
        with pytest.raises(ValueError, match="^kv: expected a float tensor"):
            L.encode_mla(torch.randn(3, 540), fmt, 1.0 if fmt == "fp8_raw" else None)
        with pytest.raises(ValueError, match="kv"):
            L.encode_mla(torch.ones(3, 576, dtype=torch.int32), fmt, 1.0)
    with pytest.raises(ValueError, match="kv_cache"):
        L.mla_656_fields(torch.zeros(3, 576, dtype=torch.uint8))
    with pytest.raises(ValueError, match="kv_cache"):
        L.dequantize_mla_576(torch.zeros(3, 656, dtype=torch.uint8), 1.0)


# ---- store_mla / gather_mla ------------------------------------------------------------------------

def _cache(fmt: str, pages: int) -> torch.Tensor:
    raw = _random_bytes(pages, 64, L.BYTES_PER_TOKEN[fmt])
    return raw.view({"bf16": torch.bfloat16, "fp32": torch.float32}.get(fmt, torch.uint8))


@pytest.mark.parametrize("fmt", L.ALL_MLA_FORMATS)
@pytest.mark.parametrize("n_pages,n", [(1, 1), (2, 64), (4, 65), (5, 200)], ids=["P1-N1", "P2-N64", "P4-N65", "P5-N200"])
def test_store_mla_touches_only_its_slots(fmt, n_pages, n):
    cache = _cache(fmt, n_pages)
    before = cache.view(torch.uint8).clone()
    slots = torch.randperm(n_pages * 64)[:n]
    kv = (torch.randn(n, 576) * 2).bfloat16()
    scale = 0.05 if fmt == "fp8_raw" else None
    L.store_mla(cache, slots.to(torch.int32), kv, scale)
    rows = L.encode_mla(kv, fmt, scale).view(torch.uint8)  # [n, bytes per token]
    assert rows.shape[1] == L.BYTES_PER_TOKEN[fmt]
    after = cache.view(torch.uint8).reshape(n_pages * 64, -1)
    expect = before.reshape(n_pages * 64, -1).clone()
    for i, s in enumerate(slots.tolist()):
        expect[s] = rows[i]
    assert torch.equal(after, expect)
    got = L.gather_mla(cache, slots, scale)
    assert got.dtype == (torch.float32 if fmt == "fp32" else torch.bfloat16)
    assert torch.equal(got, L.decode_mla(L.encode_mla(kv, fmt, scale), scale))
    if fmt in ("bf16", "fp32"):
        assert torch.equal(got.float(), kv.float())


def test_store_mla_errors():
    cache = torch.zeros(2, 64, 656, dtype=torch.uint8)
    kv = torch.randn(3, 576)
    slots = torch.tensor([0, 1, 127])
    with pytest.raises(ValueError, match="slots"):
        L.store_mla(cache, slots.float(), kv)
    with pytest.raises(ValueError, match="slots"):
        L.store_mla(cache, slots[:2], kv)
    with pytest.raises(ValueError, match="slots"):
        L.store_mla(cache, slots.view(3, 1), kv)
    with pytest.raises(ValueError, match="slots"):
        L.store_mla(cache, torch.tensor([0, 1, 128]), kv)
    with pytest.raises(ValueError, match="slots"):
        L.store_mla(cache, torch.tensor([0, -1, 2]), kv)
    with pytest.raises(ValueError, match="kv_cache"):
        L.store_mla(torch.zeros(2, 32, 656, dtype=torch.uint8), slots, kv)
    with pytest.raises(ValueError, match="kv_cache"):
        L.store_mla(torch.zeros(128, 656, dtype=torch.uint8), slots, kv)
    with pytest.raises(ValueError, match="kv_cache"):
        L.store_mla(torch.zeros(2, 64, 640, dtype=torch.uint8), slots, kv)
    with pytest.raises(ValueError, match="kv"):
        L.store_mla(cache, slots, torch.randn(3, 512))
    with pytest.raises(ValueError, match="scale"):
        L.store_mla(torch.zeros(2, 64, 576, dtype=torch.uint8), slots, kv)
    assert (cache == 0).all()


def test_writers_name_a_device_mismatch():
    """Rows on another device than the cache: a ValueError naming them before anything is written (slots
    may live anywhere). The meta device stands in for a GPU."""
    cache = torch.zeros(2, 8448, dtype=torch.uint8)
    k, s = _random_keys(3)
    with pytest.raises(ValueError, match="k_fp8: expected a tensor on cpu"):
        L.store_index_keys(cache, torch.tensor([0, 1, 2]), k.to("meta"), s)
    with pytest.raises(ValueError, match="k_scale: expected a tensor on cpu"):
        L.store_index_keys(cache, torch.tensor([0, 1, 2]), k, s.to("meta"))
    mla = torch.zeros(2, 64, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv: expected a tensor on cpu"):
        L.store_mla(mla, torch.tensor([0, 1, 2]), torch.randn(3, 576, device="meta"))
    assert (cache == 0).all() and (mla == 0).all()
