"""Exact top-k with fused slot translation: the Triton kernel (design notes in README.md).

One program owns a row at a time (a persistent grid walks the rows) and works on the row's
order-preserving int32 keys:

1. sample:   ``S`` evenly spaced keys of the row -> a low threshold ``t_lo`` that about ``1.7 k`` keys
             reach (a guess: it only decides speed, never the answer);
2. compact:  one pass over the row keeps every key ``>= t_lo`` with its position, in position order,
             in a per-program scratch buffer ``U`` (exclusive prefix sum, no atomics);
3. select:   radix levels (histogram of the next digit -> the bucket holding the k-th key -> shrink
             the key range, compacting the bucket when it is small) find the k-th key ``T`` exactly
             and ``need``, how many keys equal to ``T`` are taken (smallest positions first);
4. emit:     one pass over ``U`` writes every key ``> T`` and the first ``need`` keys ``== T``, in
             position order, translated (page table / offset / plain) in the same store.

If the guess fails (fewer than k keys reach ``t_lo``, or more than ``U`` holds) steps 3-4 run on the
row itself: slower, same answer. Rows with ``length <= k`` are copied. Scratch is sized from shapes
only, nothing is synchronised with the host, and every count is a reduction, so the output is the
same bits on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.ops._triton_utils import interpreting, num_sms

# Keys are int32 whose signed order is the score order: key(-inf) == key(NaN) is the smallest.
_INT_MIN = tl.constexpr(-2147483648)
_KEY_MIN = tl.constexpr(-2139095041)      # key of -inf (0xFF800000) and of every NaN
_KEY_POS_INF = tl.constexpr(2139095040)   # key of +inf (0x7F800000)
_NEG_INF_BITS = tl.constexpr(-8388608)    # 0xFF800000 as int32
_MAX_LEVELS = tl.constexpr(40)            # > 32 bits / 1 bit per level: a hang guard, never reached


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


# Triton >= 3.7 lowers tl.histogram to one shared-memory atomic per element (cost independent of the
# bin count): 8-bit digits. Triton 3.6 builds it from warp ballots, whose cost grows with the bins:
# 5-bit digits (32 bins, the cheapest per resolved bit there).
DEFAULT_BITS = 8 if _triton_version() >= (3, 7) else 5
LG_SAMPLE_MIN, LG_SAMPLE_MAX = 8, 12   # sample 256 .. 4096 keys
SCRATCH_BUDGET = 256 << 20             # bytes of scratch; fewer programs when k is huge


def launch_config(R: int, sms: int) -> dict:
    """Warps, streaming block, pipeline depth, register cap and program count.

    Few rows (R <= SMs): one 16-warp program per row, for memory parallelism within the row. Many
    rows: two 8-warp programs per SM, so one program's barrier-bound select overlaps the other's
    streaming; left alone ptxas gives this build ~230 registers (one program per SM), capped at 128
    it spills 12 bytes (triton 3.6). Either way a thread streams 8 keys per step and the row loops
    keep ``stages - 1`` blocks in flight (cp.async into shared memory: 16 / 32 KB per program).
    """
    if R <= sms:
        return dict(num_warps=16, block=4096, stages=3, grid=R, maxnreg=128)
    return dict(num_warps=8, block=2048, stages=3, grid=min(R, 2 * sms), maxnreg=128)


@triton.jit
def _order_key(x):
    """``float32 -> int32`` with the same order (NaN -> -inf, -0.0 -> +0.0)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(b == _INT_MIN, 0, b)
    b = tl.where((b & 0x7FFFFFFF) > 0x7F800000, _NEG_INF_BITS, b)
    # Negative floats order backwards as integers: flip their magnitude bits.
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _bit_width(x):
    """Number of bits of ``x`` (an int64 scalar in [0, 2^32)); 0 for 0."""
    w = x * 0
    for i in tl.static_range(5):
        step = 16 >> i
        w = tl.where((x >> (w + step)) != 0, w + step, w)
    return w + (x != 0).to(tl.int64)


@triton.jit
def _load_keys(src, offs, m, IS_ROW: tl.constexpr):
    if IS_ROW:
        # [BLOCK] float32 scores -> keys
        return _order_key(tl.load(src + offs, mask=m, other=0.0))
    else:
        # [BLOCK] int32 keys already in scratch
        return tl.load(src + offs, mask=m, other=0)


@triton.jit
def _translate(p, m, table_row, off_r, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Row-relative position -> what the attention reads (MODE 0 plain, 1 offset, 2 page table)."""
    if MODE == 2:
        page = tl.load(table_row + p // PAGE_SIZE, mask=m, other=0)
        return page * PAGE_SIZE + p % PAGE_SIZE
    elif MODE == 1:
        return p + off_r
    else:
        return p


@triton.jit
def _level_hist(src, cnt, lo, hi, shift, BITS: tl.constexpr, IS_ROW: tl.constexpr, BLOCK: tl.constexpr,
                STAGES: tl.constexpr):
    """Histogram of the digit ``((s - lo) >> shift) & (2^BITS - 1)`` over the keys s of ``src[:cnt]``
    in ``[lo, hi]``, plus their min and max. (s - lo wraps in int32 but is right as unsigned, and
    ``shift + BITS <= 32`` keeps the sign-extended bits out of the digit.)"""
    hist = tl.zeros([1 << BITS], dtype=tl.int32)
    vmin = tl.full([BLOCK], 2147483647, tl.int32)
    vmax = tl.full([BLOCK], _INT_MIN, tl.int32)
    for start in tl.range(0, cnt, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        m = offs < cnt
        s = _load_keys(src, offs, m, IS_ROW)
        m = m & (s >= lo) & (s <= hi)
        d = ((s - lo) >> shift) & ((1 << BITS) - 1)
        hist += tl.histogram(d, 1 << BITS, mask=m)
        vmin = tl.minimum(vmin, tl.where(m, s, 2147483647))
        vmax = tl.maximum(vmax, tl.where(m, s, _INT_MIN))
    return hist, tl.min(vmin, axis=0), tl.max(vmax, axis=0)


@triton.jit
def _compact_range(src, cnt, lo, hi, dst, IS_ROW: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Copy the keys of ``src[:cnt]`` that lie in ``[lo, hi]`` to ``dst``, in order."""
    base = tl.full([], 0, tl.int32)
    for start in tl.range(0, cnt, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        m = offs < cnt
        s = _load_keys(src, offs, m, IS_ROW)
        f = (m & (s >= lo) & (s <= hi)).to(tl.int32)
        slot = base + tl.cumsum(f, axis=0) - 1
        tl.store(dst + slot, s, mask=f != 0)
        base += tl.sum(f, axis=0)


@triton.jit
def _radix_levels(src, cnt, lo, hi, kk, tol, scr, cur, wa, wb, WCAP: tl.constexpr, BITS: tl.constexpr,
                  IS_ROW: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Find the kk-th largest key among the keys in ``[lo, hi]`` of a source.

    Source: the row (``IS_ROW``: ``src`` = scores, ``cnt`` = length) or scratch keys
    ``scr[cur : cur + cnt]``. Invariant: at least kk source keys lie in ``[lo, hi]``.
    Returns ``(done, T, need, cur, cnt, lo, hi, kk)``: when done, the answer is every key ``> T``
    plus the first ``need`` keys ``== T`` (``need`` may be 0). With ``tol > 0`` a level may stop
    early once the bucket holds at most ``kk + tol`` keys (then more than kk keys are "selected":
    used for the sample's threshold, never for the answer). Row sources stop (done = 0) as soon as
    the surviving keys are compacted into ``scr[wa:]``; buffer sources ping-pong between wa and wb.
    """
    bins = tl.arange(0, 1 << BITS)
    zero = tl.full([], 0, tl.int32)
    cur = cur + zero
    done = zero
    moved = zero
    T = zero
    need = zero
    it = zero
    while (done == 0) & (moved == 0) & (it < _MAX_LEVELS):
        it += 1
        lo64 = lo.to(tl.int64)
        hi64 = hi.to(tl.int64)
        width = _bit_width(hi64 - lo64)
        if width == 0:
            # One key value left: it is T and the kk still needed are taken among its copies.
            T = lo
            need = kk
            done = zero + 1
        else:
            # 2^BITS equal buckets of 2^shift keys from lo up cover [lo, hi].
            shift = tl.maximum(width - BITS, 0)
            if IS_ROW:
                hist, smin, smax = _level_hist(src, cnt, lo, hi, shift.to(tl.int32), BITS, IS_ROW, BLOCK,
                                               STAGES)
            else:
                hist, smin, smax = _level_hist(scr + cur, cnt, lo, hi, shift.to(tl.int32), BITS, IS_ROW,
                                               BLOCK, STAGES)
            # ge[d] = number of keys whose digit is >= d; the k-th key's digit is the last d with ge >= kk.
            ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
            dsel = tl.sum((ge >= kk).to(tl.int32), axis=0) - 1
            above = tl.sum(tl.where(bins > dsel, hist, 0), axis=0)
            in_bin = tl.sum(tl.where(bins == dsel, hist, 0), axis=0)
            kk = kk - above
            # The bucket's key range, clipped to the keys actually seen (smin >= lo, smax <= hi; the
            # top bucket may reach past hi, where keys outside the set live).
            b_lo = lo64 + (dsel.to(tl.int64) << shift)
            b_hi = b_lo + (((lo64 * 0 + 1) << shift) - 1)
            lo = tl.maximum(b_lo, smin.to(tl.int64)).to(tl.int32)
            hi = tl.minimum(b_hi, smax.to(tl.int64)).to(tl.int32)
            if in_bin <= kk + tol:
                # The whole bucket is taken: T sits just below it (clamped above int32's minimum;
                # no key is below _KEY_MIN, so "> _KEY_MIN - 1" still means ">= lo").
                T = tl.maximum(lo, _KEY_MIN) - 1
                need = zero
                done = zero + 1
            else:
                if IS_ROW:
                    do_move = in_bin <= WCAP
                else:
                    do_move = (in_bin <= WCAP) & (in_bin * 4 <= cnt)
                if do_move:
                    # Keep only the bucket's keys: later levels read in_bin keys, not cnt.
                    if IS_ROW:
                        dst = zero + wa
                        _compact_range(src, cnt, lo, hi, scr + dst, IS_ROW, BLOCK, STAGES)
                        moved = zero + 1
                    else:
                        dst = tl.where(cur == wa, wb, wa)
                        _compact_range(scr + cur, cnt, lo, hi, scr + dst, IS_ROW, BLOCK, STAGES)
                    # Other threads read what this one wrote.
                    tl.debug_barrier()
                    cur = dst
                    cnt = in_bin
    return done, T, need, cur, cnt, lo, hi, kk


@triton.jit
def _emit(src, pos, cnt, T, need, K, out_row, table_row, off_r, MODE: tl.constexpr,
          PAGE_SIZE: tl.constexpr, IS_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Write, in position order, every key ``> T`` and the first ``need`` keys ``== T`` of a source
    (the row, or scratch keys ``src`` with positions ``pos``), translated; stops once K are out."""
    zero = tl.full([], 0, tl.int32)
    gt_base = zero
    eq_base = zero
    taken = zero
    start = zero
    while (start < cnt) & (taken < K):
        offs = start + tl.arange(0, BLOCK)
        m = offs < cnt
        s = _load_keys(src, offs, m, IS_ROW)
        if IS_ROW:
            p = offs
        else:
            p = tl.load(pos + offs, mask=m, other=0)
        gt = (m & (s > T)).to(tl.int32)
        eq = (m & (s == T)).to(tl.int32)
        # One scan counts both: greater-than in the low 16 bits, equal in the high (BLOCK < 2^15).
        incl = tl.cumsum(gt + (eq << 16), axis=0)
        gt_ex = gt_base + (incl & 0xFFFF) - gt
        eq_ex = eq_base + (incl >> 16) - eq
        sel = (gt != 0) | ((eq != 0) & (eq_ex < need))
        slot = gt_ex + tl.minimum(eq_ex, need)
        val = _translate(p, sel, table_row, off_r, MODE, PAGE_SIZE)
        tl.store(out_row + slot, val, mask=sel)
        tot = tl.sum(gt + (eq << 16), axis=0)
        gt_base += tot & 0xFFFF
        eq_base += tot >> 16
        taken = gt_base + tl.minimum(eq_base, need)
        start += BLOCK


@triton.jit
def topk_transform_kernel(
    logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table,
    out, scr, R, K,
    HAS_STARTS: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAND: tl.constexpr, WCAP: tl.constexpr, LG_SMIN: tl.constexpr, LG_SMAX: tl.constexpr,
    BITS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr, FORCE: tl.constexpr,
):
    """Top-K of each row, translated. A persistent program walks rows pid, pid + G, ...

    logits [R, *] f32 (row stride ``stride_l``), lengths [R] i32, row_starts [R] i32 (HAS_STARTS),
    out_offsets [R] i32 (MODE 1), table [R / rows_per_table, *] i32 (MODE 2, row stride stride_t),
    out [R, K] i32, scr [G, 2 CAND + 2 WCAP] i32 scratch: U positions | U keys | W_a keys | W_b keys.
    FORCE (tests only) replaces the threshold guess: 1 = the largest sampled key (too high: fewer
    than K candidates), 2 = none (every key a candidate), 3 = the smallest sampled key (too low).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    scr = scr + pid.to(tl.int64) * (2 * CAND + 2 * WCAP)
    u_pos = scr
    u_key = CAND
    wa = 2 * CAND
    wb = 2 * CAND + WCAP
    for r in range(pid, R, G):
        r = r + tl.full([], 0, tl.int32)   # a tensor also in the interpreter, which loops on ints
        # The previous row's readers of the scratch are done before this row writes it.
        tl.debug_barrier()
        n = tl.load(lengths + r)
        if HAS_STARTS:
            row = logits + r.to(tl.int64) * stride_l + tl.load(row_starts + r)
        else:
            row = logits + r.to(tl.int64) * stride_l
        out_row = out + r.to(tl.int64) * K
        table_row = table + (r // rows_per_table).to(tl.int64) * stride_t
        if MODE == 1:
            off_r = tl.load(out_offsets + r)
        else:
            off_r = 0
        if n <= K:
            # Every candidate is selected: copy positions, pad with -1.
            for start in range(0, K, BLOCK):
                p = start + tl.arange(0, BLOCK)
                v = p < n
                val = _translate(p, v, table_row, off_r, MODE, PAGE_SIZE)
                tl.store(out_row + p, tl.where(v, val, -1), mask=p < K)
        else:
            # ---- 1. threshold guess from S evenly spaced keys: the m-th largest, m chosen so that
            # P(fewer than K row keys reach it) is ~5 sigma small (expected count ~ K + 5 sqrt(K n / S)).
            t_lo = n * 0 + _KEY_MIN
            lg_s = _bit_width((n.to(tl.int64) * 64) // K - 1)
            lg_s = tl.minimum(tl.maximum(lg_s, LG_SMIN), LG_SMAX)
            lg_s = tl.minimum(lg_s, _bit_width(n.to(tl.int64)) - 1)
            S = (n * 0 + 1) << lg_s.to(tl.int32)
            mu = (S.to(tl.float32) * K) / n.to(tl.float32)
            m_s = (mu + 5.0 * tl.sqrt(mu)).to(tl.int32) + 2
            if ((n > 2 * K) & (m_s < S) & (FORCE == 0)) | (FORCE == 1) | (FORCE == 3):
                smin = n * 0 + 2147483647
                smax = n * 0 + _INT_MIN
                for start in range(0, S, BLOCK):
                    i = start + tl.arange(0, BLOCK)
                    mi = i < S
                    p = ((i.to(tl.int64) * n) >> lg_s).to(tl.int32)
                    s = _order_key(tl.load(row + p, mask=mi, other=0.0))
                    tl.store(scr + wa + i, s, mask=mi)
                    smin = tl.minimum(smin, tl.min(tl.where(mi, s, 2147483647), axis=0))
                    smax = tl.maximum(smax, tl.max(tl.where(mi, s, _INT_MIN), axis=0))
                tl.debug_barrier()
                if FORCE == 1:
                    t_lo = smax
                elif FORCE == 3:
                    t_lo = smin
                else:
                    done, T, need, cur, cnt, lo, hi, kk = _radix_levels(
                        scr, S, smin, smax, m_s, m_s // 16, scr, wa, wa, wb, WCAP, BITS, False, BLOCK, STAGES)
                    t_lo = tl.where(need > 0, T, T + 1)
            # ---- 2. one pass over the row: keys >= t_lo (and positions) -> U in position order.
            c = n * 0
            vmax = tl.full([BLOCK], _KEY_MIN, tl.int32)
            for start in tl.range(0, n, BLOCK, num_stages=STAGES):
                offs = start + tl.arange(0, BLOCK)
                # [BLOCK] scores of the row (the loop is software-pipelined: STAGES blocks in flight)
                s = _order_key(tl.load(row + offs, mask=offs < n, other=float("-inf")))
                f = ((offs < n) & (s >= t_lo)).to(tl.int32)
                slot = c + tl.cumsum(f, axis=0) - 1
                keep = (f != 0) & (slot < CAND)
                tl.store(u_pos + slot, offs, mask=keep)
                tl.store(scr + u_key + slot, s, mask=keep)
                c += tl.sum(f, axis=0)
                # masked lanes hold key(-inf), harmless for a max
                vmax = tl.maximum(vmax, s)
            rmax = tl.max(vmax, axis=0)
            tl.debug_barrier()
            if (c >= K) & (c <= CAND):
                # ---- 3./4. the fast path: select and emit from U.
                done, T, need, cur, cnt, lo, hi, kk = _radix_levels(
                    row, c, t_lo, rmax, K + n * 0, n * 0, scr, u_key, wa, wb, WCAP, BITS, False, BLOCK, STAGES)
                _emit(scr + u_key, u_pos, c, T, need, K, out_row, table_row, off_r, MODE, PAGE_SIZE,
                      False, BLOCK)
            else:
                # ---- the guess missed: select on the row (compacting once the range is small).
                if c > CAND:
                    lo = t_lo
                    hi = rmax
                    kk = K + n * 0
                else:
                    lo = n * 0 + _KEY_MIN
                    hi = t_lo - 1
                    kk = K - c
                done, T, need, cur, cnt, lo, hi, kk = _radix_levels(
                    row, n, lo, hi, kk, n * 0, scr, wa, wa, wb, WCAP, BITS, True, BLOCK, STAGES)
                if done == 0:
                    done, T, need, cur, cnt, lo, hi, kk = _radix_levels(
                        row, cnt, lo, hi, kk, n * 0, scr, cur, wa, wb, WCAP, BITS, False, BLOCK, STAGES)
                _emit(row, row, n, T, need, K, out_row, table_row, off_r, MODE, PAGE_SIZE, True, BLOCK)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def topk_transform(logits, lengths, topk, page_table, row_starts, out_offsets, page_size, *,
                   out=None, cand=None, wcap=None, lg_sample=None, bits=None, block=None, grid=None,
                   num_warps=None, stages=None, maxnreg=None, force=0):
    """Launcher; arguments as in :func:`flashdsa.ops.topk.topk_transform` (already validated).

    Keyword knobs are for tests and tuning (small buffers reach every path on small rows):
    ``out`` [R, topk] int32 to write into, ``cand`` U capacity, ``wcap`` W capacity, ``lg_sample``
    (min, max) log2 sample sizes, ``bits`` digit width, ``block`` streaming step, ``grid`` programs,
    ``num_warps``, ``stages`` (software-pipeline depth of the streaming loops), ``maxnreg`` (register
    cap, 0 = none), ``force`` (threshold guess replaced by 1: the largest sampled key, 2: none, 3: the
    smallest sampled key).
    """
    R, L = logits.shape
    dev = logits.device
    K = int(topk)
    if out is None:
        out = torch.empty((R, K), dtype=torch.int32, device=dev)
    if R == 0:
        return out
    cfg = launch_config(R, num_sms(dev))
    block = cfg["block"] if block is None else block
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    stages = cfg["stages"] if stages is None else stages
    maxnreg = cfg["maxnreg"] if maxnreg is None else maxnreg
    assert block <= 16384 and block & (block - 1) == 0, "emit packs two block counts in one int32"
    bits = DEFAULT_BITS if bits is None else bits
    lg_smin, lg_smax = (LG_SAMPLE_MIN, LG_SAMPLE_MAX) if lg_sample is None else lg_sample
    # U holds ~1.5 k candidates on a good guess; 4 k leaves a ~5-sigma margin (see README).
    cand = _next_pow2(max(4 * K, 2048)) if cand is None else cand
    wcap = max(cand // 2, 1 << lg_smax) if wcap is None else wcap
    assert wcap >= 1 << lg_smax, "the sample lives in W_a"
    per_program = 2 * cand + 2 * wcap
    if grid is None:
        grid = min(cfg["grid"], max(1, SCRATCH_BUDGET // (4 * per_program)))
    scr = torch.empty(grid * per_program, dtype=torch.int32, device=dev)
    mode = 2 if page_table is not None else 1 if out_offsets is not None else 0
    table = page_table if page_table is not None else lengths
    rows_per_table = R // page_table.shape[0] if page_table is not None else 1
    topk_transform_kernel[(grid,)](
        logits, logits.stride(0), lengths,
        row_starts if row_starts is not None else lengths,
        out_offsets if out_offsets is not None else lengths,
        table, table.stride(0) if page_table is not None else 0, rows_per_table,
        out, scr, R, K,
        HAS_STARTS=row_starts is not None, MODE=mode, PAGE_SIZE=page_size,
        CAND=cand, WCAP=wcap, LG_SMIN=lg_smin, LG_SMAX=lg_smax, BITS=bits, BLOCK=block, STAGES=stages,
        FORCE=force,
        num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg and not interpreting() else {}),
    )
    return out
