"""Launch configuration of the paged indexer kernels (``paged.py``): :class:`PagedConfig`, what tests and
benchmarks pass, and :func:`paged_config`, the launch shape it resolves to, with the defaults measured on an
H200 (B 64, H 64, ctx ~32K: README.md next to this file, "Measured").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from flashdsa.cache.layouts import PAGE_SIZE
from flashdsa.ops._triton_utils import cdiv, next_pow2, num_sms, prev_pow2
from flashdsa.ops.indexer.common import MAX_DOT_N


@dataclass(frozen=True)
class PagedConfig:
    """Launch configuration of the paged kernels; ``None`` fields are chosen by :func:`paged_config`.

    TMA kernel (the default on sm_90): one page a step, a 64-column dot per draft row (n = 4: one
    256-column dot over 8 warps), 6 stages, logits stored from registers, chunks for ~16 programs a SM
    (~8 at 8 warps), at least 8 pages; where the columns are too few for that (small batches), ~4 programs
    an SM of 2 to 16 pages. Pointer kernel (other GPUs, and the interpreter unless ``tma=True``):
    n = 1: one 64-column dot, two pages a step; n = 2: two 64-column dots sharing two pages a step; n = 3:
    three 64-column dots with the fma-chain head sum; n = 4: one 256-column dot, one page a step; 4 warps,
    6 stages, ~8 programs a SM.

    Tuning knobs (benchmark sweeps): every field but the test hooks. Test hooks, off the default path: ``tma``
    (True runs the TMA kernel in the interpreter), ``fp8_dot`` (False runs the fp16-upcast path of GPUs
    before sm_89 on any device). ``chain`` and ``asm_store`` are compile-time switches; their defaults
    compile the measured kernels.
    """
    block_n: int | None = None   # key positions per loop step (64 = one page); None: see above
    chunk: int | None = None     # output columns per program (a multiple of block_n)
    rows: int | None = None      # draft rows per program (G); n > rows re-reads the pages once per group
    sub_rows: int | None = None  # draft rows per dot (GS); G / GS in {1, 2, 4} dots a step share the keys
    chain: bool | None = None    # head sum as an explicit fma chain (64-head groups only), else tl.sum
    num_warps: int | None = None  # None: 8 for a 256-column dot on the TMA path, else 4
    num_stages: int = 6
    programs_per_sm: int | None = None  # the default chunk gives about this many programs a SM; None: above
    max_regs: int | None = None  # ptxas register cap (maxnreg)
    tma: bool | None = None      # keys by TMA copies (whole-page steps); None: on sm_90 CUDA devices
    asm_store: bool = True       # TMA path: store the logits from registers by inline PTX (not interpreted)
    fp8_dot: bool | None = None  # e4m3 tensor-core dots; None: where the GPU has them (sm_89+), False: fp16


class PagedShape(NamedTuple):
    G: int          # draft rows per program
    GS: int         # draft rows per dot
    HP: int         # heads padded to a power of two >= 16
    block_n: int    # key positions per loop step
    chunk: int      # output columns per program
    chain: bool     # fma-chain head sum
    num_warps: int


def paged_config(B: int, n: int, H: int, max_len: int, device: torch.device, cfg: PagedConfig | None = None,
                 tma: bool = False) -> PagedShape:
    """Launch shape: G draft rows x HP heads per program, scored as G / GS dots of GS rows a step; columns
    split into chunks so that about ``programs_per_sm`` programs per SM exist, chunks of 2 .. 64 steps
    (TMA path: at least 8 pages)."""
    cfg = cfg or PagedConfig()
    HP = max(16, next_pow2(H))
    G = cfg.rows or min(next_pow2(n), max(1, MAX_DOT_N // HP))
    width = G * HP
    padded = width == MAX_DOT_N and n < G  # e.g. n = 3 at H 64: one of the group's 4 rows is padding
    if tma:
        # measured (H 64): a dot per draft row, except a full 256-column group: one dot over two warpgroups
        GS = cfg.sub_rows or (G if width == MAX_DOT_N and not padded else max(1, min(G, 64 // HP)))
        bn = cfg.block_n or PAGE_SIZE
        chain = bool(cfg.chain) and HP == 64  # tl.sum lowers to an fma chain on triton 3.6 already
        warps = cfg.num_warps or (8 if GS * HP == MAX_DOT_N else 4)
        # ~16 programs a SM, ~8 for the 8-warp dot (both measured against the other count)
        per_sm, min_chunk = cfg.programs_per_sm or (8 if warps == 8 else 16), 8 * PAGE_SIZE
    else:
        if cfg.sub_rows is not None:
            GS = cfg.sub_rows
        elif padded:
            GS = max(1, G // 4)  # 64-column dots (at H 64): the padded row's dot is compiled out
        elif width == MAX_DOT_N // 2:
            GS = max(1, G // 2)  # n = 2 at H 64: two 64-column dots a step
        else:
            GS = G
        bn = cfg.block_n or (128 if width <= 128 or padded else 64)
        chain = (padded if cfg.chain is None else cfg.chain) and HP == 64
        warps = cfg.num_warps or 4
        per_sm, min_chunk = cfg.programs_per_sm or 8, 0
    if cfg.chunk is not None:
        chunk = cfg.chunk
    else:
        groups = cdiv(n, G)
        work = B * groups * max(max_len, 1)
        per_prog = work // (per_sm * num_sms(device))
        # ~4 programs an SM (the power of two nearest)
        few = prev_pow2(work * 1414 // (1000 * 4 * num_sms(device)))
        if per_prog < min_chunk and few <= 2 * min_chunk:
            # too few columns for per_sm programs of >= min_chunk an SM (latency batches): ~4 an SM, of >= 2
            # steps (H200, B 1 / 4 / 16 / 64 at 8K: chunks 128 / 128 / 256 / 1024 took 7.2 / 9.2 / 13.2 /
            # 30.2 us against 8 pages' 9.5 / 10.7 / 13.6 / 32.5; DeepGEMM 7.4 / 9.0 / 13.8 / 30.1). Where
            # that would take chunks over 2 min_chunk (B 32 at 32K, B 128 at 8K), 16 pages were slower than
            # 8 (54.7 against DeepGEMM's 47.4 at B 32; B 128 ~8K 54.8 against 50.7): the rule below
            chunk = max(few, 2 * bn)
        else:
            chunk = min(max(prev_pow2(per_prog), 2 * bn, min_chunk), 64 * bn)
    if bn < 16 or bn & (bn - 1) or chunk % bn:
        raise ValueError(f"config: block_n must be a power of two >= 16 dividing chunk, got {bn}, {chunk}")
    if tma and bn not in (PAGE_SIZE, 2 * PAGE_SIZE):
        raise ValueError(f"config: the TMA kernel steps whole pages, block_n 64 or 128, got {bn}")
    if GS < 1 or G % GS or G // GS not in (1, 2, 4):
        raise ValueError(f"config: sub_rows must divide rows into 1, 2 or 4 dots, got {GS} of {G}")
    return PagedShape(G, GS, HP, bn, chunk, chain, warps)
