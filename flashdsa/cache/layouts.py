"""Byte layouts of the two paged KV caches (docs/DSA.md §4), their writers and readers.

Indexer cache, one page of 64 tokens = 8448 bytes (DeepGEMM's paged layout)::

    bytes [0, 8192)     64 x 128 float8_e4m3fn keys, token-major (token t at bytes 128 t .. 128 t + 127)
    bytes [8192, 8448)  64 x float32 scales (token t at 8192 + 4 t)

MLA cache, per token, three deployment formats (``MLA_FORMATS``) and one for exactness studies:

    "bf16"     1152 B: 576 bf16 (512 latent + 64 rope)
    "fp8"       656 B: 512 e4m3 latent | 4 fp32 scales (one per 128 latent dims) | 64 bf16 rope   (FlashMLA)
    "fp8_raw"   576 B: 576 e4m3, one per-tensor fp32 scale held by the pool
    "fp32"     2304 B: 576 fp32 — an fp32 model's cache rows kept as the model computes them, so that
               attention over them is exact to fp32 rounding (``flashdsa.hf``'s default for fp32 models)

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



def mla_rows_fit(kv_lora_rank: int, qk_rope_head_dim: int, index_head_dim: int) -> str | None:
    """None if a model's MLA and indexer fit these rows, else why not. A NoPE model (``qk_rope_head_dim`` 0,
    GLM-5.3-Flash) is stored in the same 576-dim rows with a zero rope part: its q . k is the same sum
    (0 x 0 terms), every kernel unchanged, at 64 / 576 more bytes and FLOPs than 512-dim rows would take."""
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

def _check_kv(kv: torch.Tensor) -> None:
    _check(isinstance(kv, torch.Tensor) and kv.dim() == 2 and kv.shape[1] == MLA_DIM and kv.is_floating_point(),
           "kv", f"a float tensor [N, {MLA_DIM}]", _describe(kv))


def quantize_mla_656(kv: torch.Tensor, ue8m0: bool = True) -> torch.Tensor:
    """``kv [N, 576] bf16 -> [N, 656] u8``: e4m3 latent with one scale per 128 dims, rope kept in bf16.

    The scales are powers of two (ue8m0) by default, as FlashMLA's test quantiser makes them, so the
    dequantised latent is exactly representable in bf16.
    """
    _check_kv(kv)
    n = kv.shape[0]
    latent_fp8, scale = act_quant(kv[:, :MLA_LATENT], block=128, ue8m0=ue8m0)  # [N, 512], [N, 4]
    out = torch.empty(n, MLA_FP8_BYTES, dtype=torch.uint8, device=kv.device)
    out[:, :MLA_LATENT] = latent_fp8.view(torch.uint8)
    out[:, MLA_LATENT:MLA_LATENT + 16] = scale.contiguous().view(torch.uint8)
    out[:, MLA_LATENT + 16:] = kv[:, MLA_LATENT:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def mla_656_fields(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``[..., 656] u8`` into ``latent [..., 512] e4m3``, ``scale [..., 4] f32``, ``rope [..., 64] bf16``."""
    _check(packed.dtype == torch.uint8 and packed.shape[-1] == MLA_FP8_BYTES, "kv_cache",
           f"uint8 [..., {MLA_FP8_BYTES}]", f"{packed.dtype} {list(packed.shape)}")
    packed = packed.contiguous()
    latent = packed[..., :MLA_LATENT].view(FP8)
    scale = packed[..., MLA_LATENT:MLA_LATENT + 16].contiguous().view(torch.float32)
    rope = packed[..., MLA_LATENT + 16:].contiguous().view(torch.bfloat16)
    return latent, scale, rope


def dequantize_mla_656(packed: torch.Tensor) -> torch.Tensor:
    """``[..., 656] u8 -> [..., 576] bf16``: latent * its per-128 scale, rope as stored."""
    latent, scale, rope = mla_656_fields(packed)
    lat = (latent.float().unflatten(-1, (4, 128)) * scale.unsqueeze(-1)).flatten(-2)
    return torch.cat((lat.to(torch.bfloat16), rope), dim=-1)


def quantize_mla_576(kv: torch.Tensor, scale: float) -> torch.Tensor:
    """``kv [N, 576] -> [N, 576] u8`` (raw e4m3 of every dim, rope too) with one per-tensor ``scale`` > 0."""
    _check_kv(kv)
    _check_scale("fp8_raw", scale)
    return (kv.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)


def dequantize_mla_576(packed: torch.Tensor, scale: float) -> torch.Tensor:
    """``[..., 576] u8 -> [..., 576] bf16``."""
    _check(packed.dtype == torch.uint8 and packed.shape[-1] == MLA_FP8_RAW_BYTES, "kv_cache",
           f"uint8 [..., {MLA_FP8_RAW_BYTES}]", f"{packed.dtype} {list(packed.shape)}")
    _check_scale("fp8_raw", scale)
    return (packed.view(FP8).float() * scale).to(torch.bfloat16)


def mla_cache_format(kv_cache: torch.Tensor, name: str = "kv_cache") -> str:
    """Which MLA format a paged cache holds, from its dtype and last dim: 'bf16', 'fp8', 'fp8_raw' or
    'fp32' (ValueError naming ``name`` for anything else)."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() == 0:
        raise ValueError(f"{name}: expected a tensor [..., width], got {_describe(kv_cache)}")
    if kv_cache.dtype == torch.bfloat16 and kv_cache.shape[-1] == MLA_DIM:
        return "bf16"
    if kv_cache.dtype == torch.float32 and kv_cache.shape[-1] == MLA_DIM:
        return "fp32"
    if kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == MLA_FP8_BYTES:
        return "fp8"
    if kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == MLA_FP8_RAW_BYTES:
        return "fp8_raw"
    raise ValueError(f"{name}: expected bf16 [..., {MLA_DIM}], uint8 [..., {MLA_FP8_BYTES}], uint8 "
                     f"[..., {MLA_FP8_RAW_BYTES}] or float32 [..., {MLA_DIM}], got {kv_cache.dtype} "
                     f"{list(kv_cache.shape)}")


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
    fp32 [N, 576]. ``scale``: the per-tensor scale of "fp8_raw", None for the other formats."""
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
    """Token rows of any MLA format -> ``[..., 576]`` bf16, or fp32 for the fp32 format (format read off
    dtype and width; ``scale`` as in :func:`encode_mla`)."""
    fmt = mla_cache_format(rows, "rows")
    _check_scale(fmt, scale)
    if fmt in ("bf16", "fp32"):
        return rows
    if fmt == "fp8":
        return dequantize_mla_656(rows)
    return dequantize_mla_576(rows, scale)


def _check_paged_mla(kv_cache: torch.Tensor, page_size: int | None) -> str:
    """Format of a paged MLA cache ``[P, page_size, width]`` (any page size when None); ValueError otherwise."""
    fmt = mla_cache_format(kv_cache)
    _check(kv_cache.dim() == 3 and (page_size is None or kv_cache.shape[1] == page_size), "kv_cache",
           f"[P, {page_size or 'page_size'}, width]", list(kv_cache.shape))
    return fmt


@op("store_mla", lambda kv_cache, slots, kv, scale=None: None, mutates_args=("kv_cache",))
def store_mla(kv_cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, scale: float | None = None) -> None:
    """Quantise (per the cache's format) and write N tokens at N distinct slots; nothing else changes.

    ``kv_cache: [P, 64, 576] bf16 | [P, 64, 656] u8 | [P, 64, 576] u8 | [P, 64, 576] f32``, written in place through its
    strides (a slice of a bigger pool is fine, an expanded view is not); ``slots [N] int`` with slot
    ``page * 64 + row``; ``kv [N, 576]`` float. Every argument is checked before anything is written.
    """
    fmt = _check_paged_mla(kv_cache, PAGE_SIZE)
    _check(all(st != 0 or n <= 1 for n, st in zip(kv_cache.shape, kv_cache.stride())), "kv_cache",
           "a tensor that can be written in place (no expanded, stride-0 dims)", f"strides {kv_cache.stride()}")
    _check_kv(kv)
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
    ``[0, P * page_size)`` -> ``[N, 576] bf16`` (fp32 for an fp32 cache)."""
    _check_paged_mla(kv_cache, None)
    page_size = kv_cache.shape[1]
    check_slots("slots", slots, kv_cache.shape[0] * page_size)
    slots = slots.to(kv_cache.device, torch.int64)
    return decode_mla(kv_cache[slots // page_size, slots % page_size], scale)
