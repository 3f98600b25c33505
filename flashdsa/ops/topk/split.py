"""The few-long-rows top-k kernel (R <= #SMs, L >= 4K), one launch: ``chunks`` programs share each row's
sample, compaction and move; the last of them to arrive (a per-row counter) selects and emits for the
row (design: README.md "Two layouts of the work"). Also the host side of that protocol: the arrival
counters, cached per (device, stream) and left at zero by every call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa._checks import is_cuda
from flashdsa._library import in_registered_op
from flashdsa.ops.topk.common import (INT_MIN, copy_short, excl_sum, pad4, round4, row_setup,
                                      store)
from flashdsa.ops.topk.compact import compact_guess, move, move_capped, scan_keep, tie_cap
from flashdsa.ops.topk.fallback import row_fallback
from flashdsa.ops.topk.radix import sample_threshold, select_emit


@triton.jit
def _gather_chunks(scr_r, counts_r, uk, CAND: tl.constexpr, CHUNKS: tl.constexpr, UB: tl.constexpr, ASM: tl.constexpr):
    """The chunks' candidates of a split row (``scr_r [CHUNKS, 2, CAND]``, counts_r[:CHUNKS] of them, at most
    CAND in all) concatenated, in position order, into ``uk [2, CAND]`` (keys, then positions).
    Cache-global loads: other SMs wrote them. All chunks move at once, ``[CP, UB / CP]`` slots a step,
    the next step loaded ahead (one round trip, not one a chunk)."""
    CP: tl.constexpr = triton.next_power_of_2(CHUNKS)
    BJ: tl.constexpr = UB // CP
    jj = tl.arange(0, CP)
    cnt = tl.load(counts_r + jj, mask=jj < CHUNKS, other=0, cache_modifier=".cg")
    cnt4 = round4(cnt)[:, None]
    dst = uk + excl_sum(cnt, CP)[:, None]
    src = scr_r + (jj * (2 * CAND))[:, None]
    offs = tl.arange(0, BJ)[None, :]
    # [CP, BJ] keys and positions (read to the counts rounded up to 4: 128-bit loads)
    x = tl.load(src + offs, mask=offs < cnt4, other=0, cache_modifier=".cg")
    p = tl.load(src + CAND + offs, mask=offs < cnt4, other=0, cache_modifier=".cg")
    for start in tl.range(0, tl.max(cnt, axis=0), BJ, num_stages=1):
        o = start + offs
        nxt = o + BJ
        xn = tl.load(src + nxt, mask=nxt < cnt4, other=0, cache_modifier=".cg")
        pn = tl.load(src + CAND + nxt, mask=nxt < cnt4, other=0, cache_modifier=".cg")
        m = o < cnt[:, None]
        store(dst + o, x, m, ASM)
        store(dst + CAND + o, p, m, ASM)
        x = xn
        p = pn


@triton.jit
def _gather_capped(scr_r, counts_r, t_lo, K, uk, CAND: tl.constexpr, CHUNKS: tl.constexpr, UB: tl.constexpr,
                   ASM: tl.constexpr):
    """:func:`_gather_chunks` when the chunks hold more than U does in all (each at most CAND) because many
    keys equal ``t_lo``: every key ``> t_lo`` and only the first ``K - #(key > t_lo)`` equal ones in
    position order (:func:`~flashdsa.ops.topk.compact.move_capped`, across chunks). A first pass counts
    each chunk's keys above and equal, the second copies with a scan ranking the equal keys. Returns the
    keys kept (U holds them when at most CAND; above that nothing past CAND is stored)."""
    CP: tl.constexpr = triton.next_power_of_2(CHUNKS)
    BJ: tl.constexpr = UB // CP
    jj = tl.arange(0, CP)
    cnt = tl.load(counts_r + jj, mask=jj < CHUNKS, other=0, cache_modifier=".cg")
    cnt2 = cnt[:, None]
    src = scr_r + (jj * (2 * CAND))[:, None]
    offs = tl.arange(0, BJ)[None, :]
    top = tl.max(cnt, axis=0)
    # ---- pass 1: keys above and equal, per chunk
    gt = tl.zeros([CP, BJ], dtype=tl.int32)
    eq = tl.zeros([CP, BJ], dtype=tl.int32)
    for start in tl.range(0, top, BJ, num_stages=1):
        o = start + offs
        x = tl.load(src + o, mask=o < cnt2, other=INT_MIN, cache_modifier=".cg")
        gt += ((o < cnt2) & (x > t_lo)).to(tl.int32)
        eq += ((o < cnt2) & (x == t_lo)).to(tl.int32)
    n_gt = tl.sum(gt, axis=1)
    n_eq = tl.sum(eq, axis=1)
    cap = tl.maximum(K - tl.sum(n_gt, axis=0), 0)
    eq_base, base, kept = tie_cap(n_gt, n_eq, cap, CP)
    # ---- pass 2: copy what is kept
    eq_before = eq_base[:, None]
    at = base[:, None]
    for start in tl.range(0, top, BJ, num_stages=1):
        o = start + offs
        x = tl.load(src + o, mask=o < cnt2, other=INT_MIN, cache_modifier=".cg")
        p = tl.load(src + CAND + o, mask=o < cnt2, other=0, cache_modifier=".cg")
        keep, ex, k_row, e_row = scan_keep(x, o < cnt2, t_lo, cap, eq_before)
        slot = at + ex
        store(uk + slot, x, keep & (slot < CAND), ASM)
        store(uk + CAND + slot, p, keep & (slot < CAND), ASM)
        at += k_row[:, None]
        eq_before += e_row[:, None]
    return kept


@triton.jit
def topk_split_kernel(
    logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table,
    out, scr, sscr, counts, arrive, uscr, wscr, sampscr, R, K, flag, L, maxp, last_page, code0,
    CHECK: tl.constexpr, HAS_STARTS: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAND: tl.constexpr, NW: tl.constexpr, CAP: tl.constexpr, UN: tl.constexpr, WCAP: tl.constexpr,
    UB: tl.constexpr, LG_S: tl.constexpr, BITS: tl.constexpr, BITS_W: tl.constexpr, BITS_S: tl.constexpr,
    CHUNKS: tl.constexpr, SAMPLE_STREAM: tl.constexpr, STREAM: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr, RESET: tl.constexpr, MJ: tl.constexpr, ASM: tl.constexpr, FORCE: tl.constexpr,
    STOP: tl.constexpr, VEC: tl.constexpr, TIES: tl.constexpr,
):
    """Split mode (few long rows), one launch: program (r, j) does steps 1-3 on chunk j of row r, and the
    last program of row r to finish them does steps 4-5 for the whole row.

    Every program of a row draws the same sample, so they agree on ``t_lo``. Chunk j is
    ``[j * CH, (j + 1) * CH)`` with CH a multiple of ``NW * UN * 128`` near ``n / CHUNKS``; its keys
    ``>= t_lo`` go through the warp lists (sscr ``[R * CHUNKS, NW, CAP] i64``) to scr[r, j]
    (``[R, CHUNKS, 2, CAND] i32``: keys, then positions; at most CAND stored), their number (uncapped) to
    counts[r, j] and their largest key to counts[r, CHUNKS + j] (counts ``[R, 2 CHUNKS] i32``). Then the
    program adds 1 to arrive[r] (``[R] i32``, zero at launch; RESET: set back to zero by the finisher).
    The one that sees CHUNKS - 1 arrived last: it reads chunks 0 .. CHUNKS - 1 in order (whoever it is,
    so the output does not depend on the arrival order) into uscr[r] (``[R, 2, CAND] i32``) and selects
    there (W: wscr ``[R, WCAP] i32``), or runs the row fallback. SAMPLE_STREAM: the sample is selected
    through sampscr ``[R * CHUNKS, S] i32``; STREAM: the finisher's levels stream U / W from memory.
    CHECK as in :func:`~flashdsa.ops.topk.fused.topk_fused_kernel` (every chunk program of a row checks it
    and reaches the same decision). Test hooks (0 in every default launch) as there,
    except that STOP 1 / 2 / 3 write chunk j's value to slot j and skip the finisher.
    """
    r = tl.program_id(0)
    j = tl.program_id(1)
    n, row, out_row, table_row, off_r = row_setup(r, logits, stride_l, lengths, row_starts, out_offsets, table,
                                                  stride_t, rows_per_table, out, K, L, maxp, last_page, flag,
                                                  code0, CHECK, HAS_STARTS, MODE, PAGE_SIZE, 128 * NW)
    if n <= K:
        if j == 0:
            copy_short(out_row, n, K, table_row, off_r, MODE, PAGE_SIZE, BLOCK)
    else:
        prog = (r * CHUNKS + j).to(tl.int64)
        t_lo, s_eq = sample_threshold(row, n, K, sampscr + prog * (1 << LG_S), CAND, LG_S, BITS_S, FORCE,
                                      SAMPLE_STREAM, UB, ASM)
        if STOP == 1:
            tl.store(out_row + j, t_lo)
        else:
            ch = tl.cdiv(tl.cdiv(n, CHUNKS), NW * UN * 128) * (NW * UN * 128)
            # s0 stays a multiple of the tile (aligned loads); an empty chunk has s1 == s0
            s0 = j * ch
            s1 = tl.maximum(tl.minimum(s0 + ch, n), s0)
            # (every chunk makes the same tie choice: the same sample, the same chunk length)
            cw = compact_guess(row, s0, s1, t_lo, s_eq, ch, K, sscr, prog, CAP, NW, UN, VEC, ASM, LG_S, TIES)
            c_j = tl.sum(cw, axis=0)
            tl.debug_barrier()
            if STOP == 2:
                tl.store(out_row + j, c_j)
            else:
                if (c_j > CAND) & (tl.max(cw, axis=0) <= CAP):
                    # more than U holds, no list overflowed: many keys tie with t_lo, keep the first needed
                    c_j, umax = move_capped(sscr + prog * (NW * CAP), cw, c_j, t_lo, K, scr + prog * (2 * CAND), CAP,
                                            CAND, NW, MJ, ASM)
                else:
                    umax = move(sscr + prog * (NW * CAP), cw, c_j, scr + prog * (2 * CAND), CAP, CAND, NW, MJ, ASM)
                counts_r = counts + r * (2 * CHUNKS)
                tl.store(counts_r + j, c_j)
                tl.store(counts_r + CHUNKS + j, umax)
                if STOP == 3:
                    tl.store(out_row + j, umax)
                else:
                    # Every thread's stores of this chunk happen before the arrival, whose release (one
                    # thread, after the barrier) publishes them at gpu scope; its acquire makes the
                    # other chunks' stores visible to the last program (the result is broadcast to
                    # all threads behind a barrier).
                    tl.debug_barrier()
                    arrived = tl.atomic_add(arrive + r, 1, sem="acq_rel", scope="gpu")
                    if arrived == CHUNKS - 1:
                        if RESET:
                            tl.store(arrive + r, 0)
                        uk = uscr + r.to(tl.int64) * (2 * CAND)
                        w = wscr + r.to(tl.int64) * WCAP
                        c = tl.full([], 0, tl.int32)
                        cmax = tl.full([], 0, tl.int32)
                        umax = tl.full([], INT_MIN, tl.int32)
                        for jj in tl.static_range(CHUNKS):
                            c_jj = tl.load(counts_r + jj, cache_modifier=".cg")
                            c += c_jj
                            cmax = tl.maximum(cmax, c_jj)
                            umax = tl.maximum(umax, tl.load(counts_r + CHUNKS + jj, cache_modifier=".cg"))
                        c_sel = c
                        if (c >= K) & (c <= CAND):
                            _gather_chunks(scr + r.to(tl.int64) * (CHUNKS * 2 * CAND), counts_r, uk, CAND, CHUNKS,
                                           UB, ASM)
                        elif (c > CAND) & (cmax <= CAND):
                            # more than U holds in all, no chunk overflowed: many keys tie with t_lo
                            c_sel = _gather_capped(scr + r.to(tl.int64) * (CHUNKS * 2 * CAND), counts_r, t_lo, K, uk,
                                                   CAND, CHUNKS, UB, ASM)
                        if (c_sel >= K) & (c_sel <= CAND):
                            pad4(uk, c_sel, CAND)
                            tl.debug_barrier()
                            select_emit(uk, c_sel, t_lo, umax, K, w, out_row, table_row, off_r, CAND, WCAP, UB, BITS,
                                        BITS_W, STREAM, NW, MODE, PAGE_SIZE, ASM, STOP)
                        else:
                            row_fallback(row, n, K, c, t_lo, uk, w, out_row, table_row, off_r, CAND, WCAP, UB, BITS,
                                         BITS_W, STREAM, BLOCK, STAGES, MODE, PAGE_SIZE, NW, ASM, STOP == 0)


# Split mode's arrival counters, one buffer per (device, stream). The finisher of each row sets its counter
# back to zero, so every call leaves the buffer all zero and the next call needs no memset (a memset node
# cost ~1.1 us of the 31.6 us of 64 x 32K). Calls on one stream run one after another; calls on two
# streams get two buffers, so concurrent calls never share a counter. (Graph replays reuse the counters
# of their capture stream, like they reuse their scratch: the same rule as a graph memory pool shared by
# several graphs, which must not be replayed concurrently either. A first call on a stream inside a
# capture allocates the buffer there: its zeroing is captured and replayed, correct if slower.) Calls made
# as the registered op (compiled graphs) take fresh zeros instead: torch.compile's CUDA-graph trees run
# their warm-up with every allocation routed into their private pool and then check that only their
# outputs stay allocated there, which a buffer cached here would fail. A buffer outgrown by more rows is
# kept alive (``_OUTGROWN``), never freed: a graph captured with it still replays on its address.
_ARRIVE: dict = {}
_OUTGROWN: list = []


try:  # the raw stream handle, as Triton's driver reads it (torch.cuda.current_stream builds a Stream object)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # a CPU-only torch build (then never called)
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def stream_key(dev: torch.device) -> tuple:
    """(device, its current stream's handle): the key of a buffer kept per stream."""
    return dev, _raw_stream(dev.index) if is_cuda(dev) else 0


def arrive_counters(dev: torch.device, R: int, cached: bool) -> torch.Tensor:
    """Split mode's per-row arrival counters ``[>= R] int32``, zero at launch: cached per device and stream
    (``cached``, and not called as the registered op: see ``_ARRIVE``), else fresh zeros."""
    if not cached or in_registered_op():
        return torch.zeros(R, dtype=torch.int32, device=dev)
    key = stream_key(dev)
    buf = _ARRIVE.get(key)
    if buf is None or buf.numel() < R:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _ARRIVE[key] = torch.zeros(max(R, 1024), dtype=torch.int32, device=dev)
    return buf

