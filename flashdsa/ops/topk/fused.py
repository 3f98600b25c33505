"""The many-rows top-k kernel (R > #SMs, or rows shorter than 4K): a persistent grid of programs, each
taking one row at a time through all five steps (design: README.md "Two layouts of the work").

Launched by :mod:`flashdsa.ops.topk.launch` with a :class:`~flashdsa.ops.topk.launch.TopkConfig`; the
steps are in ``radix.py`` (1, 4), ``compact.py`` (2, 3, 5) and ``fallback.py`` (the guess missed).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdsa.ops.topk.common import INT_MIN, copy_short, row_setup
from flashdsa.ops.topk.compact import compact_guess, move, move_capped
from flashdsa.ops.topk.fallback import row_fallback
from flashdsa.ops.topk.radix import sample_threshold, select_emit


@triton.jit
def topk_fused_kernel(
    logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table,
    out, scr, sscr, wscr, R, K, flag, L, maxp, last_page, code0,
    CHECK: tl.constexpr, HAS_STARTS: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAND: tl.constexpr, NW: tl.constexpr, CAP: tl.constexpr,
    UN: tl.constexpr, WCAP: tl.constexpr, UB: tl.constexpr, LG_S: tl.constexpr, BITS: tl.constexpr,
    BITS_W: tl.constexpr, BITS_S: tl.constexpr, STREAM: tl.constexpr, MJ: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr, ASM: tl.constexpr, FORCE: tl.constexpr, STOP: tl.constexpr,
    SAMPLE_STREAM: tl.constexpr, VEC: tl.constexpr, TIES: tl.constexpr,
):
    """Top-K of each row, translated. A persistent program walks rows pid, pid + G, ...

    logits [R, *] f32 (row stride ``stride_l``), lengths [R] i32, row_starts [R] i32 (HAS_STARTS),
    out_offsets [R] i32 (MODE 1), table [R / rows_per_table, *] i32 (MODE 2, row stride stride_t),
    out [R, K] i32, scratch per program: scr [G, 2, CAND] i32 the candidates U (keys, then positions),
    sscr [G, NW, CAP] i64 the warp lists of the compaction (score bits << 32 | position), wscr [G, WCAP]
    i32 the keys of a small bucket W (and, SAMPLE_STREAM, first the sample: WCAP >= S). NW = num_warps
    warp lists; UN tiles a warp loads at once; MJ list entries a warp moves a step. STREAM: the radix
    levels read U / W from memory, UB at a time, instead of holding them in registers (few-warp
    programs); SAMPLE_STREAM: the same for the sample's levels. TIES: rows whose sample says most keys
    equal the guess are compacted keeping a warp's first K equal ones (``compact_seg_ties``).
    CHECK (the default mode's device value checks): each row's metadata is checked first by
    :func:`~flashdsa.ops.topk.common.row_check` (L the logits' width, maxp the page table's width, last_page
    the largest page id whose slots fit int32, errors into ``flag`` from code ``code0``); a bad row selects
    nothing. Off, those arguments are unused and the check compiles to nothing.
    Test hooks, 0 in every default launch (where they compile to nothing): FORCE replaces the threshold
    guess by 1 the largest sampled key (too high: fewer than K candidates), 2 none (every key a
    candidate), 3 the smallest sampled key (too low); STOP ends a row early, after 1 the sample (t_lo in
    the row's first slot), 2 the compaction (c), 3 the move (umax) or 4 the select (T + need).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    uk = scr + pid.to(tl.int64) * (2 * CAND)
    useg = sscr + pid.to(tl.int64) * (NW * CAP)
    w = wscr + pid.to(tl.int64) * WCAP
    for r in range(pid, R, G):
        r = r + tl.full([], 0, tl.int32)   # a tensor also in the interpreter, which loops on ints
        # The previous row's readers of U are done before this row writes it.
        tl.debug_barrier()
        n, row, out_row, table_row, off_r = row_setup(r, logits, stride_l, lengths, row_starts, out_offsets, table,
                                                      stride_t, rows_per_table, out, K, L, maxp, last_page, flag,
                                                      code0, CHECK, HAS_STARTS, MODE, PAGE_SIZE, 128 * NW)
        if n <= K:
            copy_short(out_row, n, K, table_row, off_r, MODE, PAGE_SIZE, BLOCK)
        else:
            # ---- 1. threshold guess from a sample
            t_lo, s_eq = sample_threshold(row, n, K, w, CAND, LG_S, BITS_S, FORCE, SAMPLE_STREAM, UB, ASM)
            if STOP == 1:
                tl.store(out_row, t_lo)
            else:
                # ---- 2. one pass over the row: scores with key >= t_lo -> the warps' lists
                cw = compact_guess(row, 0, n, t_lo, s_eq, n, K, useg, 0, CAP, NW, UN, VEC, ASM, LG_S, TIES)
                c = tl.sum(cw, axis=0)
                # The lists are read by other threads below.
                tl.debug_barrier()
                if STOP == 2:
                    tl.store(out_row, c)
                else:
                    c_sel = c
                    umax = tl.full([], INT_MIN, tl.int32)
                    if (c >= K) & (c <= CAND):
                        # ---- 3. the lists -> U, in position order, as keys
                        umax = move(useg, cw, c, uk, CAP, CAND, NW, MJ, ASM)
                    elif (c > CAND) & (tl.max(cw, axis=0) <= CAP):
                        # more than U holds, no list overflowed: many keys tie with t_lo, keep the first needed
                        c_sel, umax = move_capped(useg, cw, c, t_lo, K, uk, CAP, CAND, NW, MJ, ASM)
                    if (c_sel >= K) & (c_sel <= CAND):
                        tl.debug_barrier()
                        if STOP == 3:
                            tl.store(out_row, umax)
                        else:
                            # ---- 4./5. select, emit from U
                            select_emit(uk, c_sel, t_lo, umax, K, w, out_row, table_row, off_r, CAND, WCAP, UB, BITS,
                                        BITS_W, STREAM, NW, MODE, PAGE_SIZE, ASM, STOP)
                    else:
                        row_fallback(row, n, K, c, t_lo, uk, w, out_row, table_row, off_r, CAND, WCAP, UB, BITS,
                                     BITS_W, STREAM, BLOCK, STAGES, MODE, PAGE_SIZE, NW, ASM, STOP == 0)
