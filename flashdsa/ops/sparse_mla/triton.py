"""Sparse MLA, the Triton backend: the launch configuration of the kernels in ``kernels.py`` (one frozen
:class:`SparseMLAConfig`, its defaults from :func:`launch_config`), the launcher, and the decode / prefill
entry points that ``flashdsa.ops.sparse_mla`` dispatches to. Design and measurements: README.md.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
from triton.runtime.errors import OutOfResources

from flashdsa.cache.layouts import MLA_LATENT, PAGE_SIZE, mla_cache_format
from flashdsa.ops._common import remember
from flashdsa.ops._launch import KernelLauncher, aligned
from flashdsa.ops._triton_utils import cdiv, next_pow2, num_sms, upcast_bf16
from flashdsa.ops.sparse_mla.kernels import (CACHE_FORMATS, sparse_mla_combine_kernel, sparse_mla_fwd_kernel,
                                             sparse_mla_fwd_small_h_kernel, sparse_mla_fwd_wide_kernel)

LOG2E = 1.4426950408889634
KERNELS = ("heads_m", "wide", "small_h")


def _pow2_tile(v) -> bool:
    # a tl.dot operand dimension: a power of two >= 16
    return isinstance(v, int) and not isinstance(v, bool) and v >= 16 and v & (v - 1) == 0


@dataclass(frozen=True)
class SparseMLAConfig:
    """Launch configuration of the sparse MLA kernels, what tests and benchmarks pass; ``None`` fields take
    :func:`launch_config`'s defaults for the shape. A config given to the launcher runs as asked: it never
    steps down when out of shared memory (the defaults do). All fields are tuning knobs; none is compiled
    into the default launches other than at its default value.
    """
    kernel: str | None = None       # "heads_m" (heads on M, four 128-dim latent chunks), "wide" (one
    #                                 512-dim latent tile), "small_h" (heads on N, the transposed product)
    block_h: int | None = None      # heads per program, a power of two >= 16
    block_n: int | None = None      # selected tokens per step, a power of two >= 16
    block_dv: int | None = None     # heads_m: value dims per program, 512 | 256 | 128 (the others recompute S)
    num_warps: int | None = None
    num_stages: int | None = None
    slots_ahead: bool | None = None  # load the next step's slots during this one (pays at >= 3 stages)
    num_splits: int | None = None   # top-k splits (flash-decoding), merged by the combine kernel

    def __post_init__(self):
        bad = []
        if self.kernel is not None and self.kernel not in KERNELS:
            bad.append(f"kernel one of {KERNELS}, got {self.kernel!r}")
        for name in ("block_h", "block_n"):
            v = getattr(self, name)
            if v is not None and not _pow2_tile(v):
                bad.append(f"{name} a power of two >= 16, got {v!r}")
        if self.block_dv is not None and self.block_dv not in (128, 256, 512):
            bad.append(f"block_dv 128 | 256 | 512, got {self.block_dv!r}")
        if self.slots_ahead is not None and not isinstance(self.slots_ahead, bool):
            bad.append(f"slots_ahead a bool, got {self.slots_ahead!r}")
        for name in ("num_warps", "num_stages", "num_splits"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad.append(f"{name} an int >= 1, got {v!r}")
        if bad:
            raise ValueError("config: expected " + "; ".join(bad))


_CONFIGS: dict = {}


def launch_config(h_q: int, fmt: str, rows: int, topk: int, device: torch.device,
                  config: SparseMLAConfig | None = None, split: bool = True) -> SparseMLAConfig:
    """:func:`default_launch_config`, remembered per arguments (it runs on every call's host path)."""
    key = (h_q, fmt, rows, topk, device, config, split)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = remember(_CONFIGS, key, default_launch_config(h_q, fmt, rows, topk, device, config, split), 1024)
    return cfg


def default_launch_config(h_q: int, fmt: str, rows: int, topk: int, device: torch.device,
                          config: SparseMLAConfig | None = None, split: bool = True) -> SparseMLAConfig:
    """The configuration a launch uses: ``config``'s fields where set, else the defaults for the shape,
    measured on an H200 (the reasoning and the numbers are in README.md). ``split=False``: no top-k split by
    default (prefill: a row's bits must not depend on the rows that share the call).

    * fp8 caches, h_q > 64: "wide" (the 512 latent dims as one tile: 3 tensor-core ops per step),
      64 heads x 64 tokens, 8 warps, 3 stages with slots ahead (the gathers overlap a step of math).
    * fp8 caches, 16 < h_q <= 64: the same tiles in the chunked heads-on-M kernel (64 heads even for
      17..32 heads: wgmma and pipelined gathers beat 16-head mma.sync tiles).
    * fp8 caches, h_q <= 16: heads on M with 16 heads and 32 tokens per step on 4 warps (mma.sync,
      ~227 registers, 2 CTAs per SM), 3 stages with slots ahead.
    * bf16 (prefill, bf16 paged cache): h_q > 32 heads-on-M 64 x 64 on 8 warps with 2 stages and the
      slots loaded in-step (3 stages of 64-token bf16 tiles do not fit in shared memory); h_q <= 32 the
      heads-on-N kernel (64 tokens are the tensor-core M side).
    * fp32 (exactness studies; IEEE fp32 products run on the FMA units, not the tensor cores): heads on M,
      16 heads x 16 tokens on 4 warps, one stage, slots in-step — small tiles, since fp32 FMA dots hold
      their operands in registers.

    The default split count comes from the default tiles, whatever ``config`` changes.
    """
    if fmt == "fp32":
        tiles = dict(kernel="heads_m", block_h=16, block_n=16, num_warps=4, num_stages=1)
        ctas_per_sm = 1
    elif fmt == "bf16":
        if h_q > 32:
            tiles = dict(kernel="heads_m", block_h=64, block_n=64, num_warps=8, num_stages=2)
        else:
            tiles = dict(kernel="small_h", block_h=16 if h_q <= 16 else 32, block_n=64, num_warps=4, num_stages=2)
        ctas_per_sm = 1
    elif h_q > 16:
        tiles = dict(kernel="wide" if h_q > 64 else "heads_m", block_h=64, block_n=64, num_warps=8, num_stages=3)
        ctas_per_sm = 1
    else:
        tiles = dict(kernel="heads_m", block_h=16, block_n=32, num_warps=4, num_stages=3)
        ctas_per_sm = 2
    programs = rows * cdiv(h_q, tiles["block_h"])
    # 16-head tiles (two CTAs an SM) gain from splits down to 128 tokens at B <= 4, the 64-head ones lose
    # there (H200, benchmarks/sparse_decode_grid.py, 2026-12-03: B1 h16 16 splits 38.7 vs 8 44.1 us; h64 48.5 vs 46.0)
    min_tokens = 128 if ctas_per_sm == 2 else 256
    splits = pick_num_splits(programs, topk, num_sms(device), ctas_per_sm, min_tokens) if split else 1
    default = SparseMLAConfig(**tiles, block_dv=512, slots_ahead=fmt not in ("bf16", "fp32"), num_splits=splits)
    if config is None:
        return default
    return replace(default, **{f.name: v for f in fields(config) if (v := getattr(config, f.name)) is not None})


def pick_num_splits(programs: int, topk: int, sms: int, ctas_per_sm: int = 1, min_tokens: int = 256) -> int:
    """Flash-decoding split count: the smallest one whose waves fill the machine to >= 90 % of the best
    count up to topk / min_tokens (each split keeps at least ``min_tokens`` selected tokens)."""
    max_splits = max(1, min(32, topk // min_tokens))
    if programs <= 0 or max_splits == 1:
        return 1
    slots = sms * ctas_per_sm

    def eff(s: int) -> float:
        waves = programs * s / slots
        return waves / math.ceil(waves)

    best = max(eff(s) for s in range(1, max_splits + 1))
    return next(s for s in range(1, max_splits + 1) if eff(s) >= 0.9 * best)


def sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, stride_kv_page: int, stride_kv_row: int, n_slots: int,
                   fmt: str, indices: torch.Tensor, sm_scale: float, d_v: int, kv_scale: float | None,
                   config: SparseMLAConfig | None = None, split: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Run sparse MLA over R query rows.

    ``q [R, h_q, 512 + R] bf16`` (R = 64 rope dims, or 0 for NoPE rows; fp32 with the fp32 format; unit stride
    last), ``kv`` the cache storage (bf16 /
    fp32 elements or uint8 bytes, addressed by ``slot -> (slot // 64) * stride_kv_page + (slot % 64) *
    stride_kv_row``), ``indices [R, topk] int32`` (unit stride last). Returns ``out [R, h_q, d_v]`` in q's
    dtype, ``lse [R, h_q] f32``.
    ``config`` overrides :func:`launch_config`'s defaults (tests and benchmarks compare configurations);
    ``split`` as there.
    """
    R, h_q, _ = q.shape
    topk = indices.shape[1]
    dev = q.device
    out = torch.empty(R, h_q, d_v, dtype=q.dtype, device=dev)
    lse = torch.empty(R, h_q, dtype=torch.float32, device=dev)
    if R == 0 or h_q == 0:
        return out, lse
    cfg = launch_config(h_q, fmt, R, topk, dev, config, split)
    args = (q, kv, stride_kv_page, stride_kv_row, n_slots, fmt, indices, sm_scale, d_v, kv_scale, out, lse)
    if config is not None:  # an explicit configuration runs as asked (the benchmark reports what fails)
        why = miscompiled(cfg, dev)
        if why is not None:
            raise ValueError(f"config: expected a configuration Triton compiles correctly: {why}")
        _launch(cfg, *args)
        return out, lse
    # The default configurations sit close to the 227 KB shared-memory limit (fp8 h_q > 16: 226 KB,
    # bf16 h_q > 32: 216 KB with Triton 3.6); should another Triton version need more, step down once
    # (fewer stages, then 32 tokens per step) and remember it.
    key = (fmt, d_v, cfg)
    cfg = _STEP_DOWN.get(key, cfg)
    try:
        _launch(cfg, *args)
    except OutOfResources as e:
        fewer = [replace(cfg, num_stages=st) for st in range(cfg.num_stages - 1, 0, -1)]
        for smaller in [c for c in fewer + [replace(cfg, num_stages=1, block_n=32)] if miscompiled(c, dev) is None]:
            try:
                _launch(smaller, *args)
            except OutOfResources:
                continue
            warnings.warn(f"sparse_mla: {cfg} is out of resources on this GPU ({e}); using {smaller}")
            _STEP_DOWN[key] = smaller
            return out, lse
        raise
    return out, lse


_STEP_DOWN: dict = {}


def miscompiled(cfg: SparseMLAConfig, device: torch.device) -> str | None:
    """Why ``cfg`` must not be launched on ``device``, or None. The heads-on-N kernel at one stage with 64-token
    steps computes garbage (bf16 rows) or reads out of bounds (fp8 rows) when compiled by Triton 3.6 for sm_90
    (H100, benchmarks/sparse_mla_config_check.py, 2026-12-08; 32-token steps and 2-3 stages are right): it is
    refused on CUDA, and the out-of-shared-memory step-down skips it. The interpreter runs it correctly."""
    if (torch.device(device).type == "cuda" and cfg.kernel == "small_h" and cfg.num_stages == 1
            and cfg.block_n >= 64):
        return "kernel 'small_h' with num_stages 1 and block_n >= 64 (miscompiled on sm_90: wrong results)"
    return None


class _Tiles(NamedTuple):
    BDV: int
    n_hb: int
    dv_parts: int
    splits: int
    per_split: int


_TILES: dict = {}
_KERNELS = {"small_h": sparse_mla_fwd_small_h_kernel, "wide": sparse_mla_fwd_wide_kernel,
            "heads_m": sparse_mla_fwd_kernel}
_MAIN = {name: KernelLauncher(k, ("q", "kv", "idx", "out", "lse")) for name, k in _KERNELS.items()}
_COMBINE = KernelLauncher(sparse_mla_combine_kernel, ("part_out", "part_lse", "out", "lse"))


def _tiles(cfg: SparseMLAConfig, h_q: int, topk: int, d_v: int) -> _Tiles:
    key = (cfg, h_q, topk, d_v)
    t = _TILES.get(key)
    if t is None:
        BH, BN = cfg.block_h, cfg.block_n
        BDV = 512 if cfg.kernel in ("small_h", "wide") else cfg.block_dv
        # every split but the last gets a whole number of BLOCK_N steps
        splits = max(1, min(cfg.num_splits, cdiv(topk, BN)))
        per_split = max(BN, cdiv(cdiv(topk, splits), BN) * BN)
        t = _TILES[key] = _Tiles(BDV, cdiv(h_q, BH), cdiv(d_v, BDV), max(1, cdiv(topk, per_split)), per_split)
    return t


def _launch(cfg: SparseMLAConfig, q, kv, stride_kv_page, stride_kv_row, n_slots, fmt, indices, sm_scale, d_v,
            kv_scale, out, lse):
    """Launch the kernel of ``cfg`` (complete: :func:`launch_config`'s) and the combine kernel when the top-k
    list is split, into out / lse; returns the compiled main kernel (the benchmark reports its registers,
    spills and shared memory). Both launch from plans (``ops/_launch.py``) after the first call of a shape."""
    R, h_q, _ = q.shape
    topk = indices.shape[1]
    dev = q.device
    BDV, n_hb, dv_parts, splits, per_split = _tiles(cfg, h_q, topk, d_v)
    os_, ls_ = out.stride(), lse.stride()
    if splits == 1:
        part = None
        o_ptr, l_ptr = out.data_ptr(), lse.data_ptr()
        so_row, so_split, so_h = os_[0], 0, os_[1]
        sl_row, sl_split = ls_[0], 0
    else:
        # fp32 partials [R, splits, h_q, d_v] and their lse [R, splits, h_q], one allocation
        n_o = cdiv(R * splits * h_q * d_v, 4) * 4  # the lse part 16-byte aligned, as its own tensor would be
        part = torch.empty(n_o + R * splits * h_q, dtype=torch.float32, device=dev)
        o_ptr, l_ptr = part.data_ptr(), part.data_ptr() + 4 * n_o
        so_row, so_split, so_h = splits * h_q * d_v, h_q * d_v, d_v
        sl_row, sl_split = splits * h_q, h_q
    ptrs = (q.data_ptr(), kv.data_ptr(), indices.data_ptr(), o_ptr, l_ptr)
    qs = q.stride()
    key = (cfg, dev, R, h_q, topk, q.shape[-1], qs, stride_kv_page, stride_kv_row, indices.stride()[0], os_, ls_[0],
           n_slots, fmt, sm_scale, d_v, kv_scale) if aligned(*ptrs) else None

    def build():
        if part is None:
            o, l = out, lse
        else:
            o = part[:R * splits * h_q * d_v].view(R, splits, h_q, d_v)
            l = part[n_o:].view(R, splits, h_q)
        args = dict(
            q=q, kv=kv, idx=indices, out=o, lse=l,
            stride_q_row=q.stride(0), stride_q_h=q.stride(1),
            stride_kv_page=stride_kv_page, stride_kv_row=stride_kv_row,
            stride_i_row=indices.stride(0),
            stride_o_row=so_row, stride_o_split=so_split, stride_o_h=so_h,
            stride_l_row=sl_row, stride_l_split=sl_split,
            n_slots=n_slots, h_q=h_q, topk=topk, tokens_per_split=per_split, num_splits=splits,
            num_head_blocks=n_hb, qk_scale=sm_scale * LOG2E, kv_scale=1.0 if kv_scale is None else float(kv_scale),
            D_V=d_v, FMT=CACHE_FORMATS[fmt], BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, SLOTS_AHEAD=cfg.slots_ahead,
            UPCAST=upcast_bf16(), ROPE=q.shape[-1] - MLA_LATENT, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if cfg.kernel not in ("small_h", "wide"):
            return (R * splits * dv_parts * n_hb,), dict(args, BLOCK_DV=BDV)
        return (R * splits * n_hb,), args

    compiled = _MAIN[cfg.kernel](key, ptrs, build)
    if splits > 1:
        combine_splits(part[:R * splits * h_q * d_v].view(R, splits, h_q, d_v), part[n_o:].view(R, splits, h_q),
                       out, lse, key)
    return compiled


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   key=None) -> None:
    """Merge top-k splits (flash-decoding) into ``out [R, h_q, d_v]`` / ``lse [R, h_q]``: ``part_out [R, S, h_q,
    d_v]`` fp32 or bf16 normalised partials with unit-stride rows, ``part_lse [R, S, h_q]`` fp32 (natural log).
    ``key``: the caller's plan key (None: no plan), so the launch is planned after the first call of a shape."""
    R, splits, h_q, d_v = part_out.shape
    CH = 16  # small head blocks and 128-column parts: enough programs at batch 1 (kernels.py)
    n_chb = cdiv(h_q, CH)
    cptrs = (part_out.data_ptr(), part_lse.data_ptr(), out.data_ptr(), lse.data_ptr())
    ckey = key and (key, "combine", part_out.dtype)

    def build_combine():
        return (R * n_chb * cdiv(d_v, 128),), dict(
            part_out=part_out, part_lse=part_lse, out=out, lse=lse,
            stride_po_row=part_out.stride(0), stride_po_split=part_out.stride(1), stride_po_h=part_out.stride(2),
            stride_pl_row=part_lse.stride(0), stride_pl_split=part_lse.stride(1),
            stride_o_row=out.stride(0), stride_o_h=out.stride(1), stride_l_row=lse.stride(0),
            h_q=h_q, num_splits=splits, num_head_blocks=n_chb,
            D_V=d_v, BLOCK_H=CH, BLOCK_S=next_pow2(splits), BLOCK_D=128, UPCAST=upcast_bf16(),
            num_warps=4,
        )

    _COMBINE(ckey if aligned(*cptrs) else None, cptrs, build_combine)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def sparse_mla_decode(q, kv_cache, indices, sm_scale, d_v, kv_scale, config: SparseMLAConfig | None = None):
    """Triton backend of :func:`flashdsa.ops.sparse_mla_decode` (inputs already validated); ``config`` as in
    :func:`sparse_mla_fwd`."""
    B, s_q, h_q, d = q.shape
    fmt = mla_cache_format(kv_cache)
    ks = kv_cache.stride()
    if ks[-1] != 1:
        kv_cache = kv_cache.contiguous()
        ks = kv_cache.stride()
    if fmt == "fp8" and (kv_cache.data_ptr() % 4 or ks[0] % 4 or ks[1] % 4):
        # the kernel reads each row's fp32 scales and bf16 rope in place
        raise ValueError(f"kv_cache: expected 4-byte aligned rows for the fp8 layout, got data_ptr % 4 = "
                         f"{kv_cache.data_ptr() % 4}, strides {ks}")
    out, lse = sparse_mla_fwd(
        _unit_last(q.reshape(B * s_q, h_q, d)), kv_cache, ks[0], ks[1], kv_cache.shape[0] * PAGE_SIZE, fmt,
        _unit_last(indices.reshape(B * s_q, indices.shape[-1])), sm_scale, d_v, kv_scale, config)
    return out.view(B, s_q, h_q, d_v), lse.view(B, s_q, h_q)


def sparse_mla_prefill(q, kv, indices, sm_scale, d_v, config: SparseMLAConfig | None = None):
    """Triton backend of :func:`flashdsa.ops.sparse_mla_prefill` (inputs already validated); ``config`` as in
    :func:`sparse_mla_fwd`."""
    assert kv.shape[1] == q.shape[-1]
    kv = _unit_last(kv)
    # No split-K in prefill by default: a row's bits must not depend on how many rows share the call, so
    # chunked prefill equals one-shot prefill exactly (split-K's merge order would differ for small chunks).
    # A flat [N, D] buffer is a paged one whose pages are 64 consecutive rows.
    fmt = "fp32" if kv.dtype == torch.float32 else "bf16"
    return sparse_mla_fwd(_unit_last(q), kv, PAGE_SIZE * kv.stride(0), kv.stride(0), kv.shape[0], fmt,
                          _unit_last(indices), sm_scale, d_v, None, config, split=False)
