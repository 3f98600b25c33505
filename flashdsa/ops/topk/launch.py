"""Top-k launch: the frozen config of one launch, the default config for a shape, and the launcher.

The launcher runs one of two kernels, ``fused.py`` (many rows) or ``split.py`` (few long rows), with
scratch sized from shapes only (no host sync: CUDA-graph capturable). :func:`default_config` is the launch
measured best on the H200; tests and benchmarks pass variants of it::

    cfg = dataclasses.replace(default_config(R, L, k, num_sms(dev)), chunks=4)
    launch.topk_transform(logits, lengths, k, None, None, None, 64, config=cfg)

What each default was measured against is in README.md ("Measured").
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from flashdsa._checks import error_flag, is_cuda
from flashdsa._library import in_registered_op
from flashdsa.ops._common import INT32_MAX, remember
from flashdsa.ops._device_checks import TOPK_CODE0
from flashdsa.ops._launch import KernelLauncher
from flashdsa.ops._triton_utils import cdiv, interpreting, next_pow2, num_sms, prev_pow2
from flashdsa.ops.topk.fused import topk_fused_kernel
from flashdsa.ops.topk.rows import topk_rows_kernel
from flashdsa.ops.topk.split import arrive_counters, stream_key, topk_split_kernel

ROWS_MAX_L = 16384            # the rows kernel's emit packs two counts of at most its block in an int32
WCAP = 512                    # W: the bucket small enough to leave U's registers for
LG_SAMPLE_MIN, LG_SAMPLE_MAX = 9, 11
SCRATCH_BUDGET = 1 << 30      # bytes of scratch; fewer programs when k is huge

# Test hooks, by name in the config and by number in the kernels (0: off, compiled out).
FORCE = {"": 0, "sample_max": 1, "no_guess": 2, "sample_min": 3}
STOP_AFTER = {"": 0, "sample": 1, "compaction": 2, "move": 3, "select": 4}


@dataclasses.dataclass(frozen=True)
class TopkConfig:
    """One launch of the top-k kernels, apart from the inputs; :func:`default_config` gives the measured
    one for a shape. U holds ``cand`` candidates a row, W ``wcap`` keys, the sample ``2^lg_sample`` keys:
    small ones make every path reachable on rows of a few thousand.

    Test hooks, off ("") in every default config and then compiled out of the kernels (README.md):
    ``force`` replaces the threshold guess by "sample_max", the largest sampled key (fewer than k
    candidates), "no_guess" (every key a candidate: more than U holds) or "sample_min", the smallest
    sampled key (more than U holds, some below it): the fallback paths on any row. ``stop_after`` ends
    each row after "sample" (t_lo to its first output slot), "compaction" (the count), "move" (the
    largest key) or "select" (T + need), the rest of the row unwritten; split mode writes chunk j's value
    to slot j and, but for "select", skips the finisher. For ``bench_topk.py --stages`` and tests.
    """

    kind: str                  # "fused" (fused.py: many rows), "split" (split.py: few long rows) or "rows"
                               # (rows.py: a program a row held in registers, rows of at most 16384 scores;
                               # uses num_warps, maxnreg, bits, vec and narrow only)
    cand: int                  # U's slots a row: a power of 2 <= 16384 (emit packs two counts in an int32)
    lg_sample: int             # log2 of the sample size, >= 3 (runs of 8 keys)
    wcap: int                  # W's slots: a multiple of 4 (read 4 keys a thread)
    num_warps: int             # warps a program, NW: the compaction keeps NW warp lists
    maxnreg: int               # register cap, 0: none (not applied in the interpreter)
    unroll: int                # [NW, 128] tiles a warp loads at once in the compaction: 1, 2 or 4
    move_step: int             # warp-list entries a warp moves to U a step
    stream: bool               # the levels on U / W (split: the finisher's) stream from memory, 128 NW keys
                               # a step, instead of being held in registers (registers independent of cand)
    sample_stream: bool        # the same for the sample's levels
    block: int                 # scores a step of the row fallback's passes: a power of 2 <= 16384
    grid: int = 0              # fused: programs of the persistent grid (lowered to fit SCRATCH_BUDGET)
    chunks: int = 1            # split: programs a row
    cached_counters: bool = True  # split: arrival counters kept per (device, stream) and left at zero by
                                  # the kernel; False: fresh zeros each call (a memset)
    bits: int = 5              # digit bits of a level on U (32 buckets: the cheapest per resolved bit)
    bits_w: int = 5            # ... on W
    bits_s: int = 5            # ... on the sample
    stages: int = 1            # software-pipeline depth of the row fallback's loops
    vec: bool = True           # 128-bit row loads, reading to the length rounded up to 4, where every row
                               # is whole 16-byte chunks (the launcher checks: :func:`_whole_chunks`)
    narrow: int = 2            # rows: the levels' ranges, 2 the row's min / max, then each bucket's min / max
                               # (a pass over the row a level); 1 the same where a bucket holds more than 1/32
                               # of the row (ties likely), else its edges; 0 the whole key range, then the edges
    tiles: int = 1             # rows: the row held as one power-of-two tile (1), or as two (2: a power of two
                               # and a smaller one) where that holds fewer key slots (8256 scores: 10 240 of
                               # 16 384; the default past 4K, see default_config)
    ties: bool = True          # rows whose sample says a warp's segment holds more than k keys equal to the
                               # guess keep only a warp's first k of them in the compaction (compact.py,
                               # ``compact_seg_ties``); False: every key reaching the guess is listed
    # ---- test hooks (above)
    force: str = ""            # "", "sample_max", "no_guess" or "sample_min"
    stop_after: str = ""       # "", "sample", "compaction", "move" or "select"

    def __post_init__(self):
        def bad(field, expected):
            raise ValueError(f"TopkConfig.{field}: expected {expected}, got {getattr(self, field)!r}")
        if self.kind not in ("fused", "split", "rows"):
            bad("kind", '"fused", "split" or "rows"')
        if self.kind == "rows" and not 1 <= self.bits <= 11:
            bad("bits", "1 to 11 (rows: 2^bits buckets of shared memory)")
        for field in ("cand", "block"):
            v = getattr(self, field)
            if v < 1 or v > 16384 or v & (v - 1):
                bad(field, "a power of 2 <= 16384")
        if self.lg_sample < 3:
            bad("lg_sample", ">= 3")
        if self.wcap < 4 or self.wcap % 4:
            bad("wcap", "a positive multiple of 4")
        if self.unroll not in (1, 2, 4):
            bad("unroll", "1, 2 or 4")
        if self.kind == "fused" and self.grid < 1:
            bad("grid", ">= 1 (fused)")
        if self.kind == "split" and self.chunks < 1:
            bad("chunks", ">= 1 (split)")
        if self.narrow not in (0, 1, 2):
            bad("narrow", "0, 1 or 2")
        if self.tiles not in (1, 2):
            bad("tiles", "1 or 2")
        if self.force not in FORCE:
            bad("force", " / ".join(map(repr, FORCE)))
        if self.stop_after not in STOP_AFTER:
            bad("stop_after", " / ".join(map(repr, STOP_AFTER)))


def _sizes(K: int, L: int) -> tuple[int, int]:
    """(cand, lg_sample): U's capacity and log2 of the sample size for top-K over rows of up to L keys.

    S ~ 128 L / K puts mu = S K / L ~ 128 samples in a full row's top K. The threshold is about the
    m-th largest sample, m = mu + 4 sqrt(mu) + 1 (+ m / 16 of early-stop slack), reached by about
    ``c = m L / S`` keys with a relative spread of 1 / sqrt(m): fewer than K is a 4-sigma event, and U
    holds c plus 5 sigma (a miss either way costs speed, never the answer).
    """
    lg_sample = min(max((128 * max(L, 1) // K - 1).bit_length(), LG_SAMPLE_MIN), LG_SAMPLE_MAX)
    S = 1 << lg_sample
    mu = S * K / max(L, 1)
    m = min(mu + 4 * math.sqrt(mu) + 1, S)
    c = m * (1 + 1 / 16) * L / S
    return max(next_pow2(int(c + 5 * c / math.sqrt(m)) + 1), 256), lg_sample


def default_config(R: int, L: int, K: int, sms: int, kind: str | None = None) -> TopkConfig:
    """The default launch of top-K over R rows of up to L scores on a GPU of ``sms`` SMs, as measured on
    the H200 (triton 3.6; README.md "Measured"). ``kind`` picks the kernel instead of the rule below.

    Few rows (R <= sms) of 2K < L <= 16K (and L > K): the rows kernel (rows.py), a program a row held in
    registers, levels of 2048 buckets (64 x 8K 17.9 us against split's 23.9, 64 x 16K 24.8 against 26.0, decode
    selection's 64 x ~8K of width 10 624 23.6 against 27.1 with 16 warps; since 2026-12-04 8 warps, 3-8 % faster,
    and past 4K the row as two tiles, ``tiles``, 20-25 % faster again: 64 x 8256 16.7 against 22.4); rows of
    2K-4K since 2026-12-04: 1 / 16 / 64 / 132 x 4096 9.2 / 11.3 / 11.4 / 12.2 us against split's 18.8 / 19.5 / 20.3
    / 28.4, x 2560 11.6 / 11.8 / 12.1 / 13.8 against the fused kernel's 17.8 / 22.2 / 22.9 / 23.3; fast_topk
    7.6-12.3). Its loads are 128-bit only where rows are whole 16-byte chunks, and without them it was slower than
    split (64 x ~8K of width 10 649: 30.6-33.5 against 24.1), so the launcher takes split there
    (:func:`_launch_shape`, which sees the logits).
    Many rows of 2K < L <= 4K (and L > K): the rows kernel too (since 2026-12-04: 4096 x 4096 127.5 us against the
    fused kernel's 304.9, causal prefill rows 85.6 against 139.7, 4096 x 2560 144.4 against 215.6, 512 x 4096 24.3
    against 68.8; fast_topk 0.77-0.95 of ours; at 8K the fused kernel stays, 1.16x faster).
    Few rows (R <= sms, L >= 4K), otherwise: split mode, ``chunks`` 8-warp programs a row, one per 32K of row and at
    least 2 (more chunks, or more programs of fewer warps, were slower at 64 rows), and where the rows are so few
    that this leaves SMs idle, one per 4K of row within one wave of programs (H200, rows of ~32K: 1 row 8 chunks
    26.1 us against 2 chunks' 31.1, 4 rows 16 chunks 26.0 against 30.6, 16 rows 8 chunks 28.4 against 32.4), 4 tiles
    a warp compacted at once, 128 list entries a warp moved a step; the finisher's levels in registers up to cand
    4096, streamed above (the register form needs 127 registers at cand 8192: two programs an SM, and the chunk
    programs ran in two waves).
    Many rows: the fused kernel on a persistent grid of what fits at once, capped at 64 registers (the
    grid assumes every program resident). Rows up to 16K: 4-warp programs, 8 an SM, levels on U / W
    streamed and on the sample (<= 2048 keys) in registers, 2 tiles a warp at once, 128 entries a step.
    Longer rows: 8-warp programs, 4 an SM, levels in registers, 4 tiles a warp at once, 64 entries a
    step (streamed with 1 / 2 / 4 warps was slower).
    ``ties`` (the tie-capped compaction) everywhere but the 4-warp fused kernel (see there).
    """
    cand, lg_sample = _sizes(K, L)
    sizes = dict(cand=cand, lg_sample=lg_sample, wcap=min(WCAP, cand))
    if kind is None:
        # measured from 2K on (below: not measured, fused); many rows only up to 4K (4096 causal prefill rows of
        # <= 4096 keys: 89.6 us against the fused kernel's 140.6, fast_topk 78.1; of 8K 279 against 241)
        if max(K, 2048) < L <= ROWS_MAX_L and (R <= sms or L <= 4096):
            kind = "rows"
        else:
            kind = "split" if R <= sms and L >= 4096 else "fused"
    if kind == "rows":
        # 8 warps (1 / 64 / 132 x 4096 9.3 / 11.3 / 12.3 us against 16 warps' 9.8 / 12.0 / 12.9), and past 4K the
        # row as two tiles (1 / 16 / 64 / 132 x 8256 14.7 / 16.3 / 16.7 / 17.7 against one 16-warp tile's 18.8 /
        # 21.6 / 22.4 / 22.9; 64 x 12288 19.1 against 22.2; at 2560 one tile was 0.1-0.8 faster)
        nw, tiles = 8, 2 if L > 4096 else 1
        return TopkConfig(kind="rows", num_warps=nw, maxnreg=0, unroll=1, move_step=128, stream=False,
                          sample_stream=False, block=128 * nw, bits=11, narrow=1, tiles=tiles, **sizes)
    if kind == "split":
        # many rows: a chunk per 32K of row (more chunks were slower at 64 rows); rows that leave SMs idle
        # even so: a chunk per 4K of row while the (row, chunk) grid stays within one wave
        chunks = max(2, min(16, L // 32768, prev_pow2(4 * sms // max(R, 1))),
                     min(16, L // 4096, prev_pow2(sms // max(R, 1))))
        return TopkConfig(kind="split", num_warps=8, maxnreg=0, unroll=4, move_step=128, stream=cand > 4096,
                          sample_stream=False, block=128 * 8, chunks=chunks, **sizes)
    if L <= 16384:
        nw, per_sm, unroll, stream, move_step = 4, 8, 2, True, 128
    else:
        nw, per_sm, unroll, stream, move_step = 8, 4, 4, False, 64
    # Whole SMs' worth of programs from R = sms up: the grid the defaults were measured with (for R
    # between sms and per_sm * sms, min(R, per_sm * sms) may be faster: not measured).
    grid = max(R, 1) if R < sms else min(R // sms, per_sm) * sms
    # the tie-capped compaction's code costs the 4-warp kernel registers it has not got at 64 (more spills:
    # 4096 x 8K random rows 215.7 -> 229.2 us), so it is off there; the 8-warp kernel keeps its speed with it
    return TopkConfig(kind="fused", num_warps=nw, maxnreg=64, unroll=unroll, move_step=move_step, stream=stream,
                      sample_stream=False, block=128 * nw, grid=grid, ties=nw == 8, **sizes)


def rows_tiles(L: int, nw: int, tiles: int) -> tuple[int, int]:
    """The rows kernel's key tiles for rows of up to ``L`` scores: ``(BLOCK, BLOCK2)``, powers of two of at least 4
    keys a thread (128 NW), BLOCK2 = 0 for one tile. ``tiles`` (``TopkConfig.tiles``) 2: half the power of two and a
    tile for the rest where that is smaller than the other half (8256: 8192 + 2048 at 16 warps, not 16384)."""
    block = max(next_pow2(L), 128 * nw)
    if tiles == 2 and block > 128 * nw:
        rest = max(next_pow2(L - block // 2), 128 * nw)
        if rest < block // 2:
            return block // 2, rest
    return block, 0


def _whole_chunks(logits: torch.Tensor, row_starts) -> bool:
    """Whether every row is made of whole 16-byte chunks (aligned start, length a multiple of 4), so the
    compaction may read a row to its length rounded up to 4 with 128-bit loads (the kernels' VEC)."""
    return (row_starts is None and logits.shape[1] % 4 == 0 and logits.stride(0) % 4 == 0
            and logits.stride(1) == 1 and logits.data_ptr() % 16 == 0)


def _seg_cap(cand: int, nw: int, un: int, length: int) -> int:
    """Entries a warp list may need: its segment of a ``length``-key span, at most cand (more: fallback)."""
    tile = un * 128
    return min(cand, cdiv(cdiv(length, nw), tile) * tile)


class _Launch(NamedTuple):
    """One shape's launch (see :func:`_launch_shape`): the kernel's constexprs and ints, the grid, and the
    scratch as byte ranges of one buffer ``(offset, bytes, dtype)`` in the kernel's argument order."""
    cfg: TopkConfig
    grid: tuple
    consts: dict
    scratch: tuple
    nbytes: int


_SHAPES: dict = {}
_FUSED = KernelLauncher(topk_fused_kernel, ("logits", "lengths", "row_starts", "out_offsets", "table", "out", "scr",
                                            "sscr", "wscr", "flag"))
_SPLIT = KernelLauncher(topk_split_kernel, ("logits", "lengths", "row_starts", "out_offsets", "table", "out", "scr",
                                            "sscr", "counts", "arrive", "uscr", "wscr", "sampscr", "flag"))
_ROWS = KernelLauncher(topk_rows_kernel, ("logits", "lengths", "row_starts", "out_offsets", "table", "out", "flag"))
_ALIGN = 256  # scratch pieces start at multiples of this (16 would do: Triton's pointer specialisation)
CACHED_SCRATCH = True  # bench hook: False allocates the scratch on every call (bench_host.py's A/B row)
SCRATCH_CACHE_MAX = 64 << 20  # bytes: decode shapes need 3-9 MiB; a larger scratch is allocated per call

# Scratch kept per (device, stream) for eager calls, grown to the largest shape seen: an allocation a call
# costs 2-6 us of host time on the H200's host. Safe for the same reasons as split mode's arrival counters
# (split.py, ``_ARRIVE``): calls on one stream run one after another, two streams get two buffers. Never
# used by a call that is being captured into a CUDA graph (the graph would keep the address, and a later
# larger call replaces the buffer) nor by the registered op (torch.compile's CUDA-graph trees check that
# no buffer of their warm-up outlives it): those allocate per call, as before.
_SCRATCH: dict = {}


def scratch_buffer(dev: torch.device, nbytes: int, capturing: bool | None = None) -> torch.Tensor:
    """``[>= nbytes] uint8`` scratch for one launch on ``dev``'s current stream (see ``_SCRATCH``).
    ``capturing``: whether that stream is being captured into a CUDA graph (None: asked here)."""
    if capturing is None:
        capturing = is_cuda(dev) and torch.cuda.is_current_stream_capturing()
    if not CACHED_SCRATCH or nbytes > SCRATCH_CACHE_MAX or capturing or in_registered_op():
        return torch.empty(nbytes, dtype=torch.uint8, device=dev)
    key = stream_key(dev)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < nbytes:
        buf = _SCRATCH[key] = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return buf


def _launch_shape(key, logits, K, page_table, row_starts, out_offsets, page_size, config, check) -> _Launch:
    """Config, constexprs, grid and scratch layout of a launch: functions of the shapes, the config, the
    device and the logits' alignment only, so they are worked out once per ``key`` (the caller looks
    ``_SHAPES`` up first)."""
    R, L = logits.shape
    dev = logits.device
    cfg = default_config(R, L, K, num_sms(dev)) if config is None else config
    if config is None and cfg.kind == "rows" and not _whole_chunks(logits, row_starts):
        cfg = default_config(R, L, K, num_sms(dev), kind="split" if R <= num_sms(dev) and L >= 4096 else "fused")
    nw, cand = cfg.num_warps, cfg.cand
    interp = interpreting()
    # what every kernel takes: the row layout, the translation, the device checks
    consts = dict(HAS_STARTS=row_starts is not None, MODE=2 if page_table is not None else 1 if out_offsets is not None
                  else 0, PAGE_SIZE=page_size, NW=nw, ASM=not interp, VEC=cfg.vec and _whole_chunks(logits, row_starts),
                  stride_l=logits.stride(0), stride_t=page_table.stride(0) if page_table is not None else 0,
                  rows_per_table=R // page_table.shape[0] if page_table is not None else 1, R=R, K=K, num_warps=nw,
                  CHECK=check, L=L, maxp=page_table.shape[1] if page_table is not None else 0,
                  last_page=(INT32_MAX + 1) // page_size - 1, code0=TOPK_CODE0)
    if cfg.maxnreg and not interp:
        consts["maxnreg"] = cfg.maxnreg
    if cfg.kind == "rows":
        if L > ROWS_MAX_L:
            raise ValueError(f"config: kind 'rows' takes rows of at most {ROWS_MAX_L} scores, got logits of width {L}")
        # a program a row, no scratch; at least 4 keys a thread, so no key is held (and counted) by two threads
        block, block2 = rows_tiles(L, nw, cfg.tiles)
        consts.update(BLOCK=block, BLOCK2=block2, BITS=cfg.bits, NARROW=cfg.narrow)
        return remember(_SHAPES, key, _Launch(cfg, (R,), consts, (), 0), 1024)
    consts.update(CAND=cand, UN=cfg.unroll, UB=128 * nw, LG_S=cfg.lg_sample, BITS=cfg.bits, BITS_W=cfg.bits_w,
                  BITS_S=cfg.bits_s, STREAM=cfg.stream, SAMPLE_STREAM=cfg.sample_stream, MJ=cfg.move_step,
                  BLOCK=cfg.block, STAGES=cfg.stages, FORCE=FORCE[cfg.force], STOP=STOP_AFTER[cfg.stop_after])
    # the tie-capped compaction, compiled in only where a warp's segment can hold more than K keys (elsewhere
    # its test never passes: no code for it, e.g. at the 8K / 32K decode shapes)
    span = cdiv(L, cfg.chunks) if cfg.kind == "split" else L
    consts["TIES"] = cfg.ties and cdiv(span, nw) > K
    if cfg.kind == "split":
        # scratch per row, not per program
        chunks = cfg.chunks
        cap = _seg_cap(cand, nw, cfg.unroll, cdiv(L, chunks) + nw * cfg.unroll * 128)
        consts.update(CAP=cap, WCAP=cfg.wcap, CHUNKS=chunks, RESET=cfg.cached_counters)
        pieces = [("scr", R * chunks * 2 * cand, torch.int32), ("sscr", R * chunks * nw * cap, torch.int64),
                  ("counts", R * 2 * chunks, torch.int32), ("uscr", R * 2 * cand, torch.int32),
                  ("wscr", R * cfg.wcap, torch.int32)]
        if cfg.sample_stream:
            pieces.append(("sampscr", R * chunks << cfg.lg_sample, torch.int32))
        grid = (R, chunks)
    else:
        cap = _seg_cap(cand, nw, cfg.unroll, L)
        # W doubles as the sample's buffer when the sample streams; it keeps that size whenever levels stream
        # (the WCAP the streamed defaults were measured with)
        wlen = max(cfg.wcap, 1 << cfg.lg_sample) if cfg.stream or cfg.sample_stream else cfg.wcap
        g = min(cfg.grid, max(1, SCRATCH_BUDGET // (8 * cand + 8 * nw * cap + 4 * wlen)))
        consts.update(CAP=cap, WCAP=wlen)
        pieces = [("scr", g * 2 * cand, torch.int32), ("sscr", g * nw * cap, torch.int64),
                  ("wscr", g * wlen, torch.int32)]
        grid = (g,)
    scratch, off = [], 0
    for name, numel, dtype in pieces:
        nbytes = numel * dtype.itemsize
        scratch.append((name, off, nbytes, dtype))
        off += cdiv(max(nbytes, 1), _ALIGN) * _ALIGN
    return remember(_SHAPES, key, _Launch(cfg, grid, consts, tuple(scratch), off), 1024)


def launch_key(logits, K, page_table, row_starts, out_offsets, page_size, config, check) -> tuple:
    """The key of a launch's shape (``_SHAPES``) and plan: every value the kernel specialises on but the
    pointers, and the logits' 16-byte alignment (the other pointers are checked per call)."""
    return (logits.device, *logits.shape, logits.stride()[0], K, config, page_size, row_starts is not None,
            out_offsets is not None, None if page_table is None else (*page_table.shape, page_table.stride()[0]),
            not logits.data_ptr() & 15, check)


class Entry(NamedTuple):
    """What :func:`run` needs for a call of given shapes (:func:`launch_entry`), unpacked once."""
    key: tuple                 # the launch key (``_SHAPES``, the plans)
    launch: _Launch
    dev: torch.device
    rows: int                  # R
    k: int                     # K
    split: bool
    offsets: tuple             # the scratch pieces' byte offsets, in the kernel's argument order
    flag: torch.Tensor | None  # the error word of the device checks (None: no checks)


def launch_entry(logits, K, page_table, row_starts, out_offsets, page_size, config=None, check=False) -> Entry:
    """What :func:`run` needs for a call of these shapes, worked out once per key. The public op keeps it
    per call signature (its fast path), so a repeated eager call skips both the argument checks and this
    lookup."""
    key = launch_key(logits, K, page_table, row_starts, out_offsets, page_size, config, check)
    hit = _SHAPES.get(key)
    if hit is None:
        hit = _launch_shape(key, logits, K, page_table, row_starts, out_offsets, page_size, config, check)
    return Entry(key, hit, logits.device, logits.shape[0], K, hit.cfg.kind == "split",
                 tuple(off for _, off, _, _ in hit.scratch), error_flag(logits.device) if check else None)


def topk_transform(logits, lengths, topk, page_table, row_starts, out_offsets, page_size, *,
                   out: torch.Tensor | None = None, config: TopkConfig | None = None, check: bool = False) -> torch.Tensor:
    """Launcher; arguments as in :func:`flashdsa.ops.topk.topk_transform` (shapes validated).

    ``out``: ``[R, topk] int32`` to write into (tests poison it); ``config``: the launch (None:
    :func:`default_config` for this shape and device); ``check``: the kernel checks every row's metadata
    values first (the default mode's device checks: a bad row selects nothing and the error goes to the
    error word, ``flashdsa._checks``).

    Host path: a shape's launch is worked out once (:func:`_launch_shape`), the scratch is one
    buffer kept per stream for eager calls (:func:`scratch_buffer`), and the kernel is launched from a plan
    (``ops/_launch.py``) when the pointers are aligned.
    """
    if logits.shape[0] == 0:
        return torch.empty(0, int(topk), dtype=torch.int32, device=logits.device) if out is None else out
    entry = launch_entry(logits, int(topk), page_table, row_starts, out_offsets, page_size, config, check)
    return run(entry, logits, lengths, page_table, row_starts, out_offsets, out)


def run(entry: Entry, logits, lengths, page_table, row_starts, out_offsets, out=None,
        capturing: bool | None = None) -> torch.Tensor:
    """Launch ``entry`` (:func:`launch_entry` of these arguments' shapes, R >= 1) and return ``out`` (a new
    ``[R, K] int32`` when None). ``capturing``: whether the current stream is being captured, when the
    caller already asked (None: ask here)."""
    key, hit, dev, R, K, split, offs, flag = entry
    if out is None:
        out = torch.empty(R, K, dtype=torch.int32, device=dev)  # sizes as arguments, not a tuple: 0.5 us less
    len_ptr = lengths.data_ptr()
    table = page_table if page_table is not None else lengths
    offsets = out_offsets if out_offsets is not None else lengths
    starts = row_starts if row_starts is not None else lengths
    if flag is None:
        flag = lengths  # unused (compiled out) without checks: any pointer
    # the pointers in the kernel's order (scratch pieces: offsets into the scratch buffer)
    user = (lp := logits.data_ptr(), len_ptr, sp := starts.data_ptr(), op := offsets.data_ptr(),
            tp := table.data_ptr(), outp := out.data_ptr())
    if (lp | len_ptr | sp | op | tp | outp) & 15:  # ops/_launch.aligned, inline
        key = None  # no plan: Triton's launch (our own buffers are allocator-aligned, pieces 256-B apart)
    if hit.cfg.kind == "rows":  # no scratch, a program a row
        _ROWS(key, (*user, flag.data_ptr()), lambda: (hit.grid, dict(
            hit.consts, logits=logits, lengths=lengths, row_starts=starts, out_offsets=offsets, table=table, out=out,
            flag=flag)))
        return out
    buf = scratch_buffer(dev, hit.nbytes, capturing)
    base = buf.data_ptr()
    if split:
        cfg = hit.cfg
        arrive = arrive_counters(dev, R, cfg.cached_counters)
        scr, sscr, counts, *rest = [base + o for o in offs]
        # uscr, wscr, then sampscr: a piece when the sample streams, else unused (any int32 pointer)
        ptrs = (*user, scr, sscr, counts, arrive.data_ptr(), *rest, *(() if cfg.sample_stream else (len_ptr,)),
                flag.data_ptr())
        launcher = _SPLIT
    else:
        arrive = None
        ptrs = (*user, *[base + o for o in offs], flag.data_ptr())
        launcher = _FUSED

    def build():
        kw = dict(hit.consts, logits=logits, lengths=lengths, row_starts=starts, out_offsets=offsets, table=table,
                  out=out, flag=flag)
        for name, off, n, dtype in hit.scratch:
            kw[name] = buf[off:off + n].view(dtype)
        if split:
            kw["arrive"] = arrive
            kw.setdefault("sampscr", lengths)
        return hit.grid, kw

    launcher(key, ptrs, build)
    return out
