"""Byte layouts of the two paged KV caches (docs/DSA.md §4), their writers and readers.

Indexer cache, one page of 64 tokens = 8448 bytes (DeepGEMM's paged layout)::

    bytes [0, 8192)     64 x 128 float8_e4m3fn keys, token-major (token t at bytes 128 t .. 128 t + 127)
    bytes [8192, 8448)  64 x float32 scales (token t at 8192 + 4 t)

MLA cache, per token, three deployment formats (``MLA_FORMATS``) and one for exactness studies, each in two
widths: a row of D = 512 + R dims with R = 64 rope dims (V3.2, GLM-5) or R = 0 (NoPE: GLM-5.3-Flash):

                 R = 64   R = 0
    "bf16"       1152 B   1024 B: D bf16 (512 latent, then the R rope dims)
    "fp8"         656 B    528 B: 512 e4m3 latent | 4 fp32 scales (one per 128 latent dims) | R bf16 rope
                                  (FlashMLA's layout; the NoPE row is the same without its rope tail)
    "fp8_raw"     576 B    512 B: D e4m3, one per-tensor fp32 scale held by the pool
    "fp32"       2304 B   2048 B: D fp32 — an fp32 model's cache rows kept as the model computes them, so that
                                  attention over them is exact to fp32 rounding (``flashdsa.hf``'s default for
                                  fp32 models)

Every width is distinct per dtype, so a cache's format and R are read off its dtype and last dim
(:func:`mla_cache_layout`).

Slot of token p of a request: ``block_table[p // 64] * 64 + p % 64``; the page is ``slot // 64``.
"""

from __future__ import annotations

import math

import torch

from flashdsa._checks import check_finite, check_slots
from flashdsa._library import op
from flashdsa.quant import FP8, FP8_MAX, act_quant

PAGE_SIZE = 64
INDEX_DIM = 128
INDEX_KEY_BYTES = PAGE_SIZE * INDEX_DIM            # 8192: the keys part of a page
INDEX_PAGE_BYTES = INDEX_KEY_BYTES + PAGE_SIZE * 4  # 8448
INDEX_BYTES_PER_TOKEN = INDEX_PAGE_BYTES // PAGE_SIZE  # 132

MLA_LATENT = 512
MLA_ROPE = 64
MLA_DIM = MLA_LATENT + MLA_ROPE  # 576
MLA_BF16_BYTES = 2 * MLA_DIM  # 1152
MLA_FP8_BYTES = MLA_LATENT + 4 * (MLA_LATENT // 128) + 2 * MLA_ROPE  # 656
MLA_FP8_RAW_BYTES = MLA_DIM  # 576
MLA_FP32_BYTES = 4 * MLA_DIM  # 2304
MLA_ROPES = (MLA_ROPE, 0)  # the row's rope dims: 64, or 0 for NoPE
MLA_FP8_NOPE_BYTES = MLA_FP8_BYTES - 2 * MLA_ROPE  # 528


def mla_row_width(fmt: str, rope: int = MLA_ROPE) -> int:
    """Last dim of a cache row of format ``fmt`` with ``rope`` rope dims, in the row tensor's elements (bytes
    for the uint8 formats): bf16 / fp8_raw / fp32 512 + rope, fp8 528 + 2 rope."""
    if fmt not in ALL_MLA_FORMATS:
        raise ValueError(f"fmt: expected one of {ALL_MLA_FORMATS}, got {fmt!r}")
    if rope not in MLA_ROPES:
        raise ValueError(f"rope: expected one of {MLA_ROPES} (rope dims of a cache row), got {rope!r}")
    return MLA_FP8_NOPE_BYTES + 2 * rope if fmt == "fp8" else MLA_LATENT + rope


def mla_row_bytes(fmt: str, rope: int = MLA_ROPE) -> int:
    """Bytes of one token's cache row (format ``fmt``, ``rope`` rope dims)."""
    return mla_row_width(fmt, rope) * {"bf16": 2, "fp32": 4}.get(fmt, 1)



def mla_rows_fit(kv_lora_rank: int, qk_rope_head_dim: int, index_head_dim: int) -> str | None:
    """None if a model's MLA and indexer fit these rows, else why not. A NoPE model (``qk_rope_head_dim`` 0,
    GLM-5.3-Flash) is stored in the NoPE rows (R = 0: 528 B fp8, 1024 B bf16)."""
    if kv_lora_rank != MLA_LATENT or qk_rope_head_dim not in (0, MLA_ROPE):
        return (f"kv_lora_rank = {MLA_LATENT} and qk_rope_head_dim = {MLA_ROPE} or 0 (NoPE), got {kv_lora_rank} "
                f"and {qk_rope_head_dim}")
    if index_head_dim != INDEX_DIM:
        return f"index_head_dim = {INDEX_DIM}, got {index_head_dim}"
    return None


MLA_FORMATS = ("bf16", "fp8", "fp8_raw")       # what serving sizes and plans for
ALL_MLA_FORMATS = MLA_FORMATS + ("fp32",)       # what the pool, the writers and the attention ops take
BYTES_PER_TOKEN = {"bf16": MLA_BF16_BYTES, "fp8": MLA_FP8_BYTES, "fp8_raw": MLA_FP8_RAW_BYTES,
                   "fp32": MLA_FP32_BYTES, "index": INDEX_BYTES_PER_TOKEN}


def _check(cond: bool, name: str, expected: str, got) -> None:
    if not cond:
        raise ValueError(f"{name}: expected {expected}, got {got}")


def _describe(t) -> str:
    return f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_device(cache: torch.Tensor, **rows: torch.Tensor) -> None:
    """The rows a writer stores live where the cache does (slots may live anywhere: they are moved)."""
    for name, t in rows.items():
        _check(t.device == cache.device, name, f"a tensor on {cache.device} (the cache's device)", t.device)


# ---- indexer cache ---------------------------------------------------------------------------------

def check_index_cache(index_cache: torch.Tensor, name: str = "index_cache") -> None:
    """ValueError naming ``name`` unless ``index_cache`` is a contiguous ``[P, 8448] uint8`` tensor whose
    start is 4-byte aligned: it is read and written in place, its scales as float32 (never copied)."""
    if not isinstance(index_cache, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(index_cache).__name__}")
    _check(index_cache.dtype == torch.uint8 and index_cache.dim() == 2 and index_cache.shape[1] == INDEX_PAGE_BYTES,
           name, f"uint8 [P, {INDEX_PAGE_BYTES}]", f"{index_cache.dtype} {list(index_cache.shape)}")
    _check(index_cache.is_contiguous(), name, "a contiguous tensor (caches are used in place, never copied)",
           f"strides {index_cache.stride()}")
    _check(index_cache.storage_offset() % 4 == 0, name, "a start 4-byte aligned in its storage (fp32 scales)",
           f"storage offset {index_cache.storage_offset()}")


def index_page_views(index_cache: torch.Tensor, name: str = "index_cache") -> tuple[torch.Tensor, torch.Tensor]:
    """Typed views into an indexer cache, sharing its storage.

    ``index_cache: [P, 8448] uint8`` (contiguous) -> ``keys [P, 64, 128] float8_e4m3fn``, ``scales [P, 64] float32``.
    """
    check_index_cache(index_cache, name)
    keys = index_cache[:, :INDEX_KEY_BYTES].view(FP8).view(-1, PAGE_SIZE, INDEX_DIM)
    scales = index_cache[:, INDEX_KEY_BYTES:].view(torch.float32)
    return keys, scales


def pack_index_pages(k_fp8: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """Pack N consecutive tokens' keys into pages: ``k_fp8 [N, 128] e4m3, k_scale [N] f32 -> [ceil(N/64), 8448] u8``.

    Token i goes to page i // 64, row i % 64; the unused tail of the last page is zero.
    """
    _check(k_fp8.dtype == FP8 and k_fp8.dim() == 2 and k_fp8.shape[1] == INDEX_DIM,
           "k_fp8", f"float8_e4m3fn [N, {INDEX_DIM}]", f"{k_fp8.dtype} {list(k_fp8.shape)}")
    _check(k_scale.dtype == torch.float32 and k_scale.shape == (k_fp8.shape[0],),
           "k_scale", f"float32 [{k_fp8.shape[0]}]", f"{k_scale.dtype} {list(k_scale.shape)}")
    n = k_fp8.shape[0]
    pages = torch.zeros(math.ceil(n / PAGE_SIZE), INDEX_PAGE_BYTES, dtype=torch.uint8, device=k_fp8.device)
    store_index_keys(pages, torch.arange(n, device=k_fp8.device), k_fp8, k_scale)
    return pages


def unpack_index_pages(pages: torch.Tensor, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_index_pages`: ``[P, 8448] u8 -> k_fp8 [n, 128], k_scale [n]`` (n defaults to 64 P)."""
    keys, scales = index_page_views(pages, "pages")
    n = keys.shape[0] * PAGE_SIZE if n is None else n
    _check(not isinstance(n, bool) and isinstance(n, int) and 0 <= n <= keys.shape[0] * PAGE_SIZE,
           "n", f"an int in 0..{keys.shape[0] * PAGE_SIZE}", repr(n))
    return keys.reshape(-1, INDEX_DIM)[:n].clone(), scales.reshape(-1)[:n].clone()


@op("store_index_keys", lambda index_cache, slots, k_fp8, k_scale: None, mutates_args=("index_cache",))
def store_index_keys(index_cache: torch.Tensor, slots: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor) -> None:
    """Write N indexer keys at N distinct slots; no other byte of the cache changes.

    ``index_cache [P, 8448] u8`` (contiguous), ``slots [N] int``, ``k_fp8 [N, 128] e4m3``, ``k_scale [N] f32``
    (any strides). Every argument is checked before anything is written.
    """
    keys, scales = index_page_views(index_cache)
    check_slots("slots", slots, keys.shape[0] * PAGE_SIZE, distinct=True)
    _check(isinstance(k_fp8, torch.Tensor) and k_fp8.shape == (slots.shape[0], INDEX_DIM) and k_fp8.dtype == FP8,
           "k_fp8", f"float8_e4m3fn [{slots.shape[0]}, {INDEX_DIM}]", _describe(k_fp8))
    _check(isinstance(k_scale, torch.Tensor) and k_scale.shape == (slots.shape[0],) and k_scale.dtype == torch.float32,
           "k_scale", f"float32 [{slots.shape[0]}]", _describe(k_scale))
    _check_device(index_cache, k_fp8=k_fp8, k_scale=k_scale)
    check_finite("k_fp8", k_fp8)  # a NaN key would make the indexer backends disagree (ops.indexer_logits_paged)
    if index_cache.is_cuda:  # one launch instead of five small kernels (cache/index_store.py: the same bytes)
        from flashdsa.cache.index_store import store_index_keys_triton  # (imports triton: on first use)
        return store_index_keys_triton(index_cache, slots.to(index_cache.device), k_fp8, k_scale)
    slots = slots.to(index_cache.device, torch.int64)
    page, row = slots // PAGE_SIZE, slots % PAGE_SIZE
    keys[page, row] = k_fp8
    scales[page, row] = k_scale


def gather_index_keys(index_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read keys back: ``slots [N] int -> k_fp8 [N, 128] e4m3, k_scale [N] f32``; slots in ``[0, 64 P)``."""
    keys, scales = index_page_views(index_cache)
    check_slots("slots", slots, keys.shape[0] * PAGE_SIZE)
    slots = slots.to(index_cache.device, torch.int64)
    return keys[slots // PAGE_SIZE, slots % PAGE_SIZE], scales[slots // PAGE_SIZE, slots % PAGE_SIZE]


# ---- MLA cache ---------------------------------------------------------------------------------------

def _check_kv(kv: torch.Tensor, rope: int | None = None) -> int:
    """kv [N, 512 + R] float with R in MLA_ROPES (== ``rope`` when given) -> R."""
    dims = [MLA_LATENT + r for r in (MLA_ROPES if rope is None else (rope,))]
    ok = isinstance(kv, torch.Tensor) and kv.dim() == 2 and kv.shape[1] in dims and kv.is_floating_point()
    _check(ok, "kv", f"a float tensor [N, {' or '.join(map(str, dims))}] (512 latent + the rope dims)", _describe(kv))
    return kv.shape[1] - MLA_LATENT


def quantize_mla_656(kv: torch.Tensor, ue8m0: bool = True) -> torch.Tensor:
    """``kv [N, 576] bf16 -> [N, 656] u8``: e4m3 latent with one scale per 128 dims, rope kept in bf16
    (``kv [N, 512]``, NoPE: ``[N, 528] u8``, the same row without its rope tail).

    The scales are powers of two (ue8m0) by default, as FlashMLA's test quantiser makes them, so the
    dequantised latent is exactly representable in bf16.
    """
    rope = _check_kv(kv)
    n = kv.shape[0]
    latent_fp8, scale = act_quant(kv[:, :MLA_LATENT], block=128, ue8m0=ue8m0)  # [N, 512], [N, 4]
    out = torch.empty(n, mla_row_width("fp8", rope), dtype=torch.uint8, device=kv.device)
    out[:, :MLA_LATENT] = latent_fp8.view(torch.uint8)
    out[:, MLA_LATENT:MLA_LATENT + 16] = scale.contiguous().view(torch.uint8)
    if rope:
        out[:, MLA_LATENT + 16:] = kv[:, MLA_LATENT:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def mla_656_fields(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``[..., 656] u8`` into ``latent [..., 512] e4m3``, ``scale [..., 4] f32``, ``rope [..., 64] bf16``
    (``[..., 528]``, NoPE: rope ``[..., 0]``)."""
    _check(packed.dtype == torch.uint8 and packed.shape[-1] in (MLA_FP8_BYTES, MLA_FP8_NOPE_BYTES), "kv_cache",
           f"uint8 [..., {MLA_FP8_BYTES} or {MLA_FP8_NOPE_BYTES}]", f"{packed.dtype} {list(packed.shape)}")
    packed = packed.contiguous()
    latent = packed[..., :MLA_LATENT].view(FP8)
    scale = packed[..., MLA_LATENT:MLA_LATENT + 16].contiguous().view(torch.float32)
    rope = packed[..., MLA_LATENT + 16:].contiguous().view(torch.bfloat16)
    return latent, scale, rope


def dequantize_mla_656(packed: torch.Tensor) -> torch.Tensor:
    """``[..., 656] u8 -> [..., 576] bf16``: latent * its per-128 scale, rope as stored (NoPE: 528 -> 512)."""
    latent, scale, rope = mla_656_fields(packed)
    lat = (latent.float().unflatten(-1, (4, 128)) * scale.unsqueeze(-1)).flatten(-2)
    return torch.cat((lat.to(torch.bfloat16), rope), dim=-1)


def quantize_mla_576(kv: torch.Tensor, scale: float) -> torch.Tensor:
    """``kv [N, D] -> [N, D] u8`` (raw e4m3 of every dim, rope too; D 576 or 512) with one per-tensor
    ``scale`` > 0."""
    _check_kv(kv)
    _check_scale("fp8_raw", scale)
    return (kv.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)


def dequantize_mla_576(packed: torch.Tensor, scale: float) -> torch.Tensor:
    """``[..., D] u8 -> [..., D] bf16`` (D 576 or 512)."""
    _check(packed.dtype == torch.uint8 and packed.shape[-1] in (MLA_FP8_RAW_BYTES, MLA_LATENT), "kv_cache",
           f"uint8 [..., {MLA_FP8_RAW_BYTES} or {MLA_LATENT}]", f"{packed.dtype} {list(packed.shape)}")
    _check_scale("fp8_raw", scale)
    return (packed.view(FP8).float() * scale).to(torch.bfloat16)


# (dtype, last dim) -> (format, rope dims); every entry distinct (module docstring)
_LAYOUTS = {(dtype, mla_row_width(fmt, rope)): (fmt, rope)
            for fmt, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp8", torch.uint8),
                               ("fp8_raw", torch.uint8))
            for rope in MLA_ROPES}


def mla_cache_layout(kv_cache: torch.Tensor, name: str = "kv_cache") -> tuple[str, int]:
    """(format, rope dims) of a paged MLA cache or of cache rows, from its dtype and last dim: format 'bf16',
    'fp8', 'fp8_raw' or 'fp32', rope 64 or 0 (NoPE). ValueError naming ``name`` for anything else."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() == 0:
        raise ValueError(f"{name}: expected a tensor [..., width], got {_describe(kv_cache)}")
    found = _LAYOUTS.get((kv_cache.dtype, kv_cache.shape[-1]))
    if found is None:
        raise ValueError(f"{name}: expected bf16 [..., {MLA_DIM} or {MLA_LATENT}], uint8 [..., {MLA_FP8_BYTES} or "
                         f"{MLA_FP8_NOPE_BYTES}] (fp8), uint8 [..., {MLA_FP8_RAW_BYTES} or {MLA_LATENT}] (fp8_raw) or "
                         f"float32 [..., {MLA_DIM} or {MLA_LATENT}], got {kv_cache.dtype} {list(kv_cache.shape)}")
    return found


def mla_cache_format(kv_cache: torch.Tensor, name: str = "kv_cache") -> str:
    """The format of :func:`mla_cache_layout`."""
    return mla_cache_layout(kv_cache, name)[0]


def _check_scale(fmt: str, scale) -> None:
    """fp8_raw needs its per-tensor scale (a finite float > 0); the other formats must not get one."""
    if fmt == "fp8_raw":
        _check(not isinstance(scale, bool) and isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0,
               "scale", "the pool's per-tensor scale for fp8_raw, a finite float > 0", repr(scale))
    else:
        _check(scale is None, "scale", f"None for the {fmt!r} format (only 'fp8_raw' has a per-tensor scale)",
               repr(scale))


def encode_mla(kv: torch.Tensor, fmt: str, scale: float | None = None) -> torch.Tensor:
    """``kv [N, 576]`` -> one token row per cache format: bf16 [N, 576], u8 [N, 656] / [N, 576] or
    fp32 [N, 576]; NoPE ``kv [N, 512]``: bf16 [N, 512], u8 [N, 528] / [N, 512], fp32 [N, 512].
    ``scale``: the per-tensor scale of "fp8_raw", None for the other formats."""
    if fmt not in ALL_MLA_FORMATS:
        raise ValueError(f"fmt: expected one of {ALL_MLA_FORMATS}, got {fmt!r}")
    _check_kv(kv)
    _check_scale(fmt, scale)
    if fmt == "bf16":
        return kv.to(torch.bfloat16)
    if fmt == "fp32":
        return kv.to(torch.float32)
    if fmt == "fp8":
        return quantize_mla_656(kv)
    return quantize_mla_576(kv, scale)


def decode_mla(rows: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Token rows of any MLA format -> ``[..., D]`` bf16 (D = 512 + the rows' rope dims), or fp32 for the fp32
    format (format and rope read off dtype and width; ``scale`` as in :func:`encode_mla`)."""
    fmt = mla_cache_format(rows, "rows")
    _check_scale(fmt, scale)
    if fmt in ("bf16", "fp32"):
        return rows
    if fmt == "fp8":
        return dequantize_mla_656(rows)
    return dequantize_mla_576(rows, scale)


def _check_paged_mla(kv_cache: torch.Tensor, page_size: int | None) -> tuple[str, int]:
    """(format, rope dims) of a paged MLA cache ``[P, page_size, width]`` (any page size when None); ValueError
    otherwise."""
    layout = mla_cache_layout(kv_cache)
    _check(kv_cache.dim() == 3 and (page_size is None or kv_cache.shape[1] == page_size), "kv_cache",
           f"[P, {page_size or 'page_size'}, width]", list(kv_cache.shape))
    return layout


@op("store_mla", lambda kv_cache, slots, kv, scale=None: None, mutates_args=("kv_cache",))
def store_mla(kv_cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, scale: float | None = None) -> None:
    """Quantise (per the cache's format) and write N tokens at N distinct slots; nothing else changes.

    ``kv_cache: [P, 64, 576] bf16 | [P, 64, 656] u8 | [P, 64, 576] u8 | [P, 64, 576] f32`` (NoPE: [P, 64, 512] bf16
    | [P, 64, 528] u8 | [P, 64, 512] u8 | [P, 64, 512] f32), written in place through its strides (a slice of a
    bigger pool is fine, an expanded view is not); ``slots [N] int`` with slot ``page * 64 + row``; ``kv [N, D]``
    float, D = 512 + the cache's rope dims. Every argument is checked before anything is written.
    """
    fmt, rope = _check_paged_mla(kv_cache, PAGE_SIZE)
    _check(all(st != 0 or n <= 1 for n, st in zip(kv_cache.shape, kv_cache.stride())), "kv_cache",
           "a tensor that can be written in place (no expanded, stride-0 dims)", f"strides {kv_cache.stride()}")
    _check_kv(kv, rope)
    check_slots("slots", slots, kv_cache.shape[0] * PAGE_SIZE, distinct=True)
    _check(slots.shape[0] == kv.shape[0], "slots", f"one slot per row of kv ({kv.shape[0]})", slots.shape[0])
    _check_device(kv_cache, kv=kv)
    rows = encode_mla(kv, fmt, scale)
    if kv_cache.is_contiguous():  # one flat row index: 3 kernels fewer than page and row
        slots = slots.to(kv_cache.device)
        if slots.dtype not in (torch.int32, torch.int64):  # index tensors: int32 / int64 (int16 slots are valid)
            slots = slots.long()
        kv_cache.view(-1, kv_cache.shape[-1])[slots] = rows
        return
    slots = slots.to(kv_cache.device, torch.int64)
    kv_cache[slots // PAGE_SIZE, slots % PAGE_SIZE] = rows


def gather_mla(kv_cache: torch.Tensor, slots: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Read and dequantise tokens: ``kv_cache [P, page_size, width]`` (any strides), ``slots [N] int`` in
    ``[0, P * page_size)`` -> ``[N, D] bf16`` (fp32 for an fp32 cache; D = 512 + the cache's rope dims)."""
    _check_paged_mla(kv_cache, None)
    page_size = kv_cache.shape[1]
    check_slots("slots", slots, kv_cache.shape[0] * page_size)
    slots = slots.to(kv_cache.device, torch.int64)
    return decode_mla(kv_cache[slots // page_size, slots % page_size], scale)
