"""Exact top-k with fused slot translation: the Triton kernels (design notes in README.md).

Each row is worked on as order-preserving int32 keys:

1. sample:   ``S`` keys of the row (runs of 8 at evenly spaced positions), radix-selected in
             registers -> a low threshold ``t_lo`` that ~1.5 k keys reach (a guess: speed only);
2. compact:  one streaming pass keeps every key ``>= t_lo`` with its position, in position order,
             in a scratch buffer ``U`` (prefix sums, no atomics);
3. select:   ``U`` in registers; one radix level (32 linear buckets, shrunk to the chosen bucket's
             min / max) usually leaves a bucket of a few hundred keys, copied to ``W``; levels on ``W``
             find the k-th key ``T`` and ``need``, how many keys equal to ``T`` are taken (first positions);
4. emit:     every key of ``U`` ``> T`` and the first ``need`` keys ``== T``, in position order,
             translated (page table / offset / plain) in the same store.

Many rows: ``topk_transform_kernel`` does all four, a persistent grid walking the rows. Few long rows:
``topk_chunk_kernel`` spreads steps 1-2 of a row over several programs, ``topk_finish_kernel`` does 3-4.
If the guess fails (fewer than k keys reach ``t_lo``, or more than ``U`` holds) the levels run on the row
itself until the bucket fits ``U``: slower, same answer. Rows with ``length <= k`` are copied. Scratch
is sized from shapes only, nothing is synchronised with the host, every count is a reduction, so the
output is the same bits on every run.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashdsa.ops._triton_utils import interpreting, num_sms

# Keys are int32 whose signed order is the score order: key(-inf) == key(NaN) is the smallest.
_INT_MIN = tl.constexpr(-2147483648)
_INT_MAX = tl.constexpr(2147483647)
_KEY_MIN = tl.constexpr(-2139095041)      # key of -inf (0xFF800000) and of every NaN
_KEY_MAX = tl.constexpr(2139095040)       # key of +inf (0x7F800000)
_NEG_INF_BITS = tl.constexpr(-8388608)    # 0xFF800000 as int32
_MAX_LEVELS = tl.constexpr(40)            # > 32 bits / 1 bit per level: a hang guard, never reached

DEFAULT_BITS = 5          # digit bits of a level on U (32 bins: the cheapest per resolved bit in triton 3.6)
DEFAULT_BITS_W = 8        # digit bits on the small tensors (sample, W): fewer levels, each one cheap
WCAP = 1024               # W: the bucket small enough to leave U's registers for
LG_SAMPLE_MIN, LG_SAMPLE_MAX = 10, 12
SCRATCH_BUDGET = 256 << 20   # bytes of scratch; fewer programs when k is huge


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
def _store(ptr, val, pred, ASM: tl.constexpr):
    """Scattered predicated store. Compiled, it is one PTX store: ``tl.store`` would pin the operands to
    a one-element-per-thread layout and convert the whole block through shared memory first."""
    if ASM:
        if val.dtype == tl.int64:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b64 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,l,r", [ptr, val, pred.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,r,r", [ptr, val, pred.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val, mask=pred)


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
def _compact_block(row, offs, m, lo, hi, dst, c, CAND: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr):
    """Append the keys of one block that lie in ``[lo, hi]`` (key << 32 | position, int64) to ``dst``
    after the ``c`` already there, in position order; stores stop at CAND. Returns the new count."""
    if MASKED:
        # [BLOCK] scores of the row
        s = _order_key(tl.load(row + offs, mask=m, other=float("-inf")))
        f = m & (s >= lo) & (s <= hi)
    else:
        s = _order_key(tl.load(row + offs))
        f = (s >= lo) & (s <= hi)
    fi = f.to(tl.int32)
    slot = c + tl.cumsum(fi, axis=0) - 1
    _store(dst + slot, (s.to(tl.int64) << 32) | offs.to(tl.int64), f & (slot < CAND), ASM)
    return c + tl.sum(fi, axis=0)


@triton.jit
def _compact_row(row, s0, s1, lo, hi, dst, CAND: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                 ASM: tl.constexpr):
    """One pass over positions ``[s0, s1)`` of the row (s0 a multiple of BLOCK): keys in ``[lo, hi]`` ->
    ``dst`` (at most CAND stored). Returns their number. Full blocks load without a mask (128-bit loads
    when the row is aligned), then one masked tail."""
    c = tl.full([], 0, tl.int32)
    s_full = s1 - (s1 - s0) % BLOCK
    for start in tl.range(s0, s_full, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        c = _compact_block(row, offs, offs < s1, lo, hi, dst, c, CAND, False, ASM)
    if s_full < s1:
        offs = s_full + tl.arange(0, BLOCK)
        c = _compact_block(row, offs, offs < s1, lo, hi, dst, c, CAND, True, ASM)
    return c


@triton.jit
def _row_hist(row, n, lo, hi, shift, BITS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Histogram of the digit ``((s - lo) >> shift) & (2^BITS - 1)`` over the row keys s in ``[lo, hi]``,
    plus their min and max."""
    hist = tl.zeros([1 << BITS], dtype=tl.int32)
    vmin = tl.full([BLOCK], _INT_MAX, tl.int32)
    vmax = tl.full([BLOCK], _INT_MIN, tl.int32)
    for start in tl.range(0, n, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        # [BLOCK] scores of the row
        s = _order_key(tl.load(row + offs, mask=m, other=0.0))
        m = m & (s >= lo) & (s <= hi)
        hist += tl.histogram(((s - lo) >> shift) & ((1 << BITS) - 1), 1 << BITS, mask=m)
        vmin = tl.minimum(vmin, tl.where(m, s, _INT_MAX))
        vmax = tl.maximum(vmax, tl.where(m, s, _INT_MIN))
    return hist, tl.min(vmin, axis=0), tl.max(vmax, axis=0)


@triton.jit
def _emit_regs(x, pos, m, T, need, out_row, table_row, off_r, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
               ASM: tl.constexpr):
    """Write, in the (position) order of ``x``, every key ``> T`` and the first ``need`` keys ``== T``."""
    gt = (m & (x > T)).to(tl.int32)
    eq = (m & (x == T)).to(tl.int32)
    # One scan counts both: greater-than in the low 16 bits, equal in the high (CAND < 2^15).
    incl = tl.cumsum(gt + (eq << 16), axis=0)
    gt_ex = (incl & 0xFFFF) - gt
    eq_ex = (incl >> 16) - eq
    sel = (gt != 0) | ((eq != 0) & (eq_ex < need))
    slot = gt_ex + tl.minimum(eq_ex, need)
    _store(out_row + slot, _translate(pos, sel, table_row, off_r, MODE, PAGE_SIZE), sel, ASM)


@triton.jit
def _emit_row(row, n, T, need, K, out_row, table_row, off_r, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
              BLOCK: tl.constexpr, ASM: tl.constexpr):
    """The same from the row itself (the fallback), block by block; stops once K are out."""
    zero = tl.full([], 0, tl.int32)
    gt_base = zero
    eq_base = zero
    taken = zero
    start = zero
    while (start < n) & (taken < K):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        # [BLOCK] scores of the row
        s = _order_key(tl.load(row + offs, mask=m, other=0.0))
        gt = (m & (s > T)).to(tl.int32)
        eq = (m & (s == T)).to(tl.int32)
        incl = tl.cumsum(gt + (eq << 16), axis=0)
        gt_ex = gt_base + (incl & 0xFFFF) - gt
        eq_ex = eq_base + (incl >> 16) - eq
        sel = (gt != 0) | ((eq != 0) & (eq_ex < need))
        slot = gt_ex + tl.minimum(eq_ex, need)
        _store(out_row + slot, _translate(offs, sel, table_row, off_r, MODE, PAGE_SIZE), sel, ASM)
        tot = tl.sum(gt + (eq << 16), axis=0)
        gt_base += tot & 0xFFFF
        eq_base += tot >> 16
        taken = gt_base + tl.minimum(eq_base, need)
        start += BLOCK


@triton.jit
def _min_max_combine(a_min, a_max, b_min, b_max):
    return tl.minimum(a_min, b_min), tl.maximum(a_max, b_max)


@triton.jit
def _min_max(x, m):
    """(min, max) of the keys ``x`` where ``m``, in one reduction."""
    return tl.reduce((tl.where(m, x, _INT_MAX), tl.where(m, x, _INT_MIN)), 0, _min_max_combine)


@triton.jit
def _pick_combine(a_n, a_above, a_ge, b_n, b_above, b_ge):
    return a_n + b_n, tl.maximum(a_above, b_above), tl.minimum(a_ge, b_ge)


@triton.jit
def _pick_bucket(hist, kk):
    """From a histogram over buckets: the bucket holding the kk-th largest, the keys above it, its size."""
    # ge[b] = keys in buckets >= b (non-increasing in b): the k-th key's bucket is the last b with ge >= kk.
    ge = tl.cumsum(hist, axis=0, reverse=True)
    n_ge, above, ge_sel = tl.reduce(((ge >= kk).to(tl.int32), tl.where(ge < kk, ge, 0),
                                     tl.where(ge >= kk, ge, _INT_MAX)), 0, _pick_combine)
    return n_ge - 1, above, ge_sel - above


@triton.jit
def _select_regs(x, m, lo, hi, kk, tol, stop, BITS: tl.constexpr):
    """Radix levels on the keys ``x`` (a register tensor; ``m`` marks the set) that lie in ``[lo, hi]``,
    towards the kk-th largest of them.

    Precondition: at least kk keys of the set lie in ``[lo, hi]`` and every key of the set above ``hi``
    is taken. A level histograms the digit ``((x - lo) >> shift) & (2^BITS - 1)``: 2^BITS equal buckets
    laid from lo up (``shift = bitwidth(hi - lo) - BITS``; ``x - lo`` wraps in int32 but its low
    ``shift + BITS <= 32`` bits are right), keeps the bucket where the count from the top reaches kk
    and shrinks ``[lo, hi]`` to the min / max key in that bucket. It stops when
    - one key value is left: ``T = lo``, ``need = kk`` (kk copies of T taken, first positions first);
    - the bucket is taken whole (at most ``kk + tol`` keys; ``tol > 0`` only for the sample's
      threshold, where more than kk may be "taken"): ``T = lo - 1``, ``need = 0``;
    - the bucket holds at most ``stop`` keys (``done = 0``): the caller continues on a smaller copy.
    Returns ``(done, T, need, lo, hi, kk, in_bin)``; with done the answer is every key of the range
    ``> T`` plus the first ``need`` keys ``== T``.
    """
    zero = tl.full([], 0, tl.int32)
    done = zero
    T = zero
    need = zero
    it = zero
    lo = lo + zero
    hi = hi + zero
    kk = kk + zero
    in_bin = zero + _INT_MAX
    while (done == 0) & (in_bin > stop) & (it < _MAX_LEVELS):
        it += 1
        width = _bit_width(hi.to(tl.int64) - lo.to(tl.int64))
        if width == 0:
            T = lo
            need = kk
            done = zero + 1
        else:
            shift = tl.maximum(width - BITS, 0).to(tl.int32)
            inr = m & (x >= lo) & (x <= hi)
            d = ((x - lo) >> shift) & ((1 << BITS) - 1)
            dsel, above, in_bin = _pick_bucket(tl.histogram(d, 1 << BITS, mask=inr), kk)
            kk = kk - above
            lo, hi = _min_max(x, inr & (d == dsel))
            if in_bin <= kk + tol:
                # The whole bucket is taken: T sits just below it (lo >= _KEY_MIN: no overflow).
                T = lo - 1
                need = zero
                done = zero + 1
    return done, T, need, lo, hi, kk, in_bin


@triton.jit
def _finish(x, m, lo, hi, kk, w, WCAP: tl.constexpr, BITS: tl.constexpr, BITS_W: tl.constexpr, ASM: tl.constexpr):
    """``(T, need)`` for the kk-th largest of the keys ``x[m]`` in ``[lo, hi]``: levels on ``x`` until the
    bucket holds at most WCAP keys, then those keys are copied to ``w`` and the levels go on there."""
    done, T, need, lo, hi, kk, in_bin = _select_regs(x, m, lo, hi, kk, 0, WCAP, BITS)
    if done == 0:
        f = m & (x >= lo) & (x <= hi)
        _store(w + tl.cumsum(f.to(tl.int32), axis=0) - 1, x, f, ASM)
        # Other threads read what this one wrote.
        tl.debug_barrier()
        iw = tl.arange(0, WCAP)
        mw = iw < in_bin
        # [WCAP] the bucket's keys
        xw = tl.load(w + iw, mask=mw, other=0)
        done, T, need, lo, hi, kk, in_bin = _select_regs(xw, mw, lo, hi, kk, 0, 0, BITS_W)
        # The next row's copy into w waits for these reads.
        tl.debug_barrier()
    return T, need


@triton.jit
def _sample_threshold(row, n, K, CAND: tl.constexpr, LG_S: tl.constexpr, BITS_W: tl.constexpr,
                      FORCE: tl.constexpr):
    """Threshold guess ``t_lo`` for a row with ``n > K`` keys: the m-th largest of S sampled keys, m chosen
    so that P(fewer than K row keys reach it) is ~4 sigma small (expected count K + 4 sqrt(K n / S)).
    The samples come in runs of 8 adjacent keys (one 32-byte sector each) at evenly spaced positions.
    Rows that fit U (n <= CAND) need no guess: every key is a candidate (``_KEY_MIN``)."""
    S: tl.constexpr = 1 << LG_S
    t_lo = n * 0 + _KEY_MIN
    if ((n > CAND) & (FORCE != 2)) | (FORCE == 1) | (FORCE == 3):
        i = tl.arange(0, S)
        p = (((i // 8).to(tl.int64) * n) >> (LG_S - 3)).to(tl.int32)
        p = tl.minimum((p & -8) + i % 8, n - 1)
        # [S] sampled keys
        xs = _order_key(tl.load(row + p))
        mu = S * (K + 0.0) / n.to(tl.float32)
        m_s = (mu + 4.0 * tl.sqrt(mu)).to(tl.int32) + 1
        smin, smax = _min_max(xs, i < S)
        if FORCE == 1:
            t_lo = smax
        elif FORCE == 3:
            t_lo = smin
        elif m_s < S:
            done, T, need, lo, hi, kk, in_bin = _select_regs(xs, i < S, smin, smax, m_s, m_s // 16, 0, BITS_W)
            t_lo = tl.where(need > 0, T, T + 1)
    return t_lo


@triton.jit
def _fallback(row, n, K, c, t_lo, u, w, out_row, table_row, off_r, CAND: tl.constexpr, WCAP: tl.constexpr,
              BITS: tl.constexpr, BITS_W: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
              MODE: tl.constexpr, PAGE_SIZE: tl.constexpr, ASM: tl.constexpr, EMIT: tl.constexpr):
    """The guess missed (``c`` keys reached ``t_lo``: fewer than K, or more than U holds). Levels on the
    row itself until the bucket fits U, then in registers; emit from the row."""
    if c > CAND:
        lo = t_lo
        hi = n * 0 + _KEY_MAX
        kk = K + n * 0
    else:
        # the c keys >= t_lo are above the range and all taken
        lo = n * 0 + _KEY_MIN
        hi = t_lo - 1
        kk = K - c
    T = n * 0
    need = n * 0
    done = n * 0
    it = n * 0
    while (done == 0) & (it < _MAX_LEVELS):
        it += 1
        width = _bit_width(hi.to(tl.int64) - lo.to(tl.int64))
        if width == 0:
            T = lo
            need = kk
            done = n * 0 + 1
        else:
            shift = tl.maximum(width - BITS, 0)
            hist, smin, smax = _row_hist(row, n, lo, hi, shift.to(tl.int32), BITS, BLOCK, STAGES)
            dsel, above, in_bin = _pick_bucket(hist, kk)
            kk = kk - above
            # The bucket's key range, clipped to the keys seen in range (smin >= lo and smax <= hi: the
            # top bucket may reach past hi, where keys outside the range live).
            b_lo = lo.to(tl.int64) + (dsel.to(tl.int64) << shift)
            b_hi = b_lo + ((shift * 0 + 1) << shift) - 1
            lo = tl.maximum(b_lo, smin.to(tl.int64)).to(tl.int32)
            hi = tl.minimum(b_hi, smax.to(tl.int64)).to(tl.int32)
            if in_bin <= kk:
                T = lo - 1
                need = n * 0
                done = n * 0 + 1
            elif in_bin <= CAND:
                # Small enough: copy the bucket's keys into U and finish in registers.
                tl.debug_barrier()
                _compact_row(row, 0, n, lo, hi, u, CAND, BLOCK, STAGES, ASM)
                tl.debug_barrier()
                iu = tl.arange(0, CAND)
                mu = iu < in_bin
                # [CAND] the bucket's keys (emit reads the row: positions are not needed)
                x = (tl.load(u + iu, mask=mu, other=0) >> 32).to(tl.int32)
                T, need = _finish(x, mu, lo, hi, kk, w, WCAP, BITS, BITS_W, ASM)
                done = n * 0 + 1
    if EMIT:
        _emit_row(row, n, T, need, K, out_row, table_row, off_r, MODE, PAGE_SIZE, BLOCK, ASM)


@triton.jit
def _copy_short(out_row, n, K, table_row, off_r, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                BLOCK: tl.constexpr):
    """A row with ``n <= K`` keys: every position is selected, then -1 padding."""
    for start in range(0, K, BLOCK):
        p = start + tl.arange(0, BLOCK)
        v = p < n
        val = _translate(p, v, table_row, off_r, MODE, PAGE_SIZE)
        tl.store(out_row + p, tl.where(v, val, -1), mask=p < K)


@triton.jit
def topk_transform_kernel(
    logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table,
    out, scr, wscr, R, K,
    HAS_STARTS: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAND: tl.constexpr, WCAP: tl.constexpr, LG_S: tl.constexpr, BITS: tl.constexpr, BITS_W: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, FORCE: tl.constexpr, PROFILE: tl.constexpr,
):
    """Top-K of each row, translated. A persistent program walks rows pid, pid + G, ...

    logits [R, *] f32 (row stride ``stride_l``), lengths [R] i32, row_starts [R] i32 (HAS_STARTS),
    out_offsets [R] i32 (MODE 1), table [R / rows_per_table, *] i32 (MODE 2, row stride stride_t),
    out [R, K] i32, scratch per program: scr [G, CAND] i64 the candidates U (key << 32 | position),
    wscr [G, WCAP] i32 the keys of a small bucket W.
    FORCE (tests only) replaces the threshold guess: 1 = the largest sampled key (too high: fewer
    than K candidates), 2 = none (every key a candidate), 3 = the smallest sampled key (too low).
    PROFILE (benchmarks only) stops early: 1 after the sample, 2 after the compaction, 3 before emit.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    u = scr + pid.to(tl.int64) * CAND
    w = wscr + pid.to(tl.int64) * WCAP
    for r in range(pid, R, G):
        r = r + tl.full([], 0, tl.int32)   # a tensor also in the interpreter, which loops on ints
        # The previous row's readers of U are done before this row writes it.
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
            _copy_short(out_row, n, K, table_row, off_r, MODE, PAGE_SIZE, BLOCK)
        else:
            # ---- 1. threshold guess from a sample
            t_lo = _sample_threshold(row, n, K, CAND, LG_S, BITS_W, FORCE)
            if PROFILE == 1:
                tl.store(out_row, t_lo)
            else:
                # ---- 2. one pass over the row: keys >= t_lo (and positions) -> U in position order.
                c = _compact_row(row, 0, n, t_lo, _INT_MAX, u, CAND, BLOCK, STAGES, ASM)
                if PROFILE == 2:
                    tl.store(out_row, c)
                elif (c >= K) & (c <= CAND):
                    # ---- 3./4. the fast path: select and emit from U in registers.
                    tl.debug_barrier()
                    iu = tl.arange(0, CAND)
                    mu = iu < c
                    # [CAND] candidate keys (U holds key << 32 | position)
                    x = (tl.load(u + iu, mask=mu, other=0) >> 32).to(tl.int32)
                    lo, hi = _min_max(x, mu)
                    T, need = _finish(x, mu, lo, hi, K, w, WCAP, BITS, BITS_W, ASM)
                    if PROFILE == 3:
                        tl.store(out_row, T + need)
                    else:
                        # loaded again rather than kept: fewer live registers, more programs per SM
                        cand = tl.load(u + iu, mask=mu, other=0)
                        _emit_regs((cand >> 32).to(tl.int32), (cand & 0xFFFFFFFF).to(tl.int32), mu, T, need,
                                   out_row, table_row, off_r, MODE, PAGE_SIZE, ASM)
                else:
                    _fallback(row, n, K, c, t_lo, u, w, out_row, table_row, off_r, CAND, WCAP, BITS, BITS_W,
                              BLOCK, STAGES, MODE, PAGE_SIZE, ASM, PROFILE == 0)


@triton.jit
def topk_chunk_kernel(
    logits, stride_l, lengths, row_starts, scr, counts, R, K,
    HAS_STARTS: tl.constexpr, CAND: tl.constexpr, LG_S: tl.constexpr, BITS_W: tl.constexpr, CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, FORCE: tl.constexpr,
):
    """Split mode, step 1 of 2 (few long rows): program (r, j) compacts chunk j of row r.

    Every program of a row draws the same sample, so they agree on ``t_lo``. Chunk j is
    ``[j * CH, (j + 1) * CH)`` with ``CH = BLOCK * ceil(n / (CHUNKS * BLOCK))``; its keys ``>= t_lo`` go to
    scr[r, j] (``[R, CHUNKS, CAND] i64``, key << 32 | position, at most CAND stored) and their number
    (uncapped) to counts[r, j] (``[R, CHUNKS + 1] i32``; counts[r, CHUNKS] = t_lo).
    """
    r = tl.program_id(0)
    j = tl.program_id(1)
    n = tl.load(lengths + r)
    if HAS_STARTS:
        row = logits + r.to(tl.int64) * stride_l + tl.load(row_starts + r)
    else:
        row = logits + r.to(tl.int64) * stride_l
    if n > K:
        t_lo = _sample_threshold(row, n, K, CAND, LG_S, BITS_W, FORCE)
        ch = tl.cdiv(tl.cdiv(n, CHUNKS), BLOCK) * BLOCK
        s0 = tl.minimum(j * ch, n)
        c = _compact_row(row, s0, tl.minimum(s0 + ch, n), t_lo, _INT_MAX,
                         scr + (r * CHUNKS + j).to(tl.int64) * CAND, CAND, BLOCK, STAGES, ASM)
        tl.store(counts + r * (CHUNKS + 1) + j, c)
        if j == 0:
            tl.store(counts + r * (CHUNKS + 1) + CHUNKS, t_lo)


@triton.jit
def _gather_chunks(scr_r, counts_r, iu, CAND: tl.constexpr, CHUNKS: tl.constexpr):
    """U of a split row as one register tensor: slot i of the concatenated chunks (position order),
    key << 32 | position. Returns (U, c = total count, uncapped)."""
    base = tl.full([], 0, tl.int32)
    off = iu.to(tl.int64) * 0
    for jj in tl.static_range(CHUNKS):
        cnt = tl.load(counts_r + jj)
        in_j = (iu >= base) & (iu < base + cnt)
        off = tl.where(in_j, jj * CAND + (iu - base).to(tl.int64), off)
        base += cnt
    # [CAND] candidates (cache-global: another SM wrote them)
    cand = tl.load(scr_r + off, mask=iu < base, other=0, cache_modifier=".cg")
    return cand, base


@triton.jit
def topk_finish_kernel(
    logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table,
    out, scr, counts, wscr, R, K,
    HAS_STARTS: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAND: tl.constexpr, WCAP: tl.constexpr, BITS: tl.constexpr, BITS_W: tl.constexpr, CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, PROFILE: tl.constexpr,
):
    """Split mode, step 2 of 2: select and emit each row from its chunks' candidates (one program a row,
    persistent). scr / counts as written by ``topk_chunk_kernel``; wscr [G, WCAP] i32; the rest as in
    ``topk_transform_kernel``. The fallback re-uses chunk 0's buffer as U."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    w = wscr + pid.to(tl.int64) * WCAP
    for r in range(pid, R, G):
        r = r + tl.full([], 0, tl.int32)
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
        scr_r = scr + r.to(tl.int64) * (CHUNKS * CAND)
        counts_r = counts + r * (CHUNKS + 1)
        if n <= K:
            _copy_short(out_row, n, K, table_row, off_r, MODE, PAGE_SIZE, BLOCK)
        else:
            iu = tl.arange(0, CAND)
            cand, c = _gather_chunks(scr_r, counts_r, iu, CAND, CHUNKS)
            t_lo = tl.load(counts_r + CHUNKS)
            if (c >= K) & (c <= CAND):
                mu = iu < c
                x = (cand >> 32).to(tl.int32)
                lo, hi = _min_max(x, mu)
                T, need = _finish(x, mu, lo, hi, K, w, WCAP, BITS, BITS_W, ASM)
                if PROFILE == 3:
                    tl.store(out_row, T + need)
                else:
                    cand, c = _gather_chunks(scr_r, counts_r, iu, CAND, CHUNKS)
                    _emit_regs((cand >> 32).to(tl.int32), (cand & 0xFFFFFFFF).to(tl.int32), mu, T, need,
                               out_row, table_row, off_r, MODE, PAGE_SIZE, ASM)
            else:
                _fallback(row, n, K, c, t_lo, scr_r, w, out_row, table_row, off_r, CAND, WCAP, BITS, BITS_W,
                          BLOCK, STAGES, MODE, PAGE_SIZE, ASM, PROFILE == 0)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def sizes(K: int, L: int, cand: int | None = None, lg_sample: int | None = None,
          max_lg_sample: int = LG_SAMPLE_MAX) -> tuple[int, int]:
    """(CAND, LG_S): U's capacity and log2 of the sample size for top-K over rows of up to L keys.

    S ~ 64 L / K puts mu = S K / L ~ 64 samples in a full row's top K; the guess then leaves
    ``K + 4 sqrt(K L / S) + L / S`` candidates on average, and U holds that plus 4 sigma more.
    """
    if lg_sample is None:
        lg_sample = min(max((64 * max(L, 1) // K - 1).bit_length(), LG_SAMPLE_MIN), max_lg_sample)
    if cand is None:
        S = 1 << lg_sample
        c_hi = K + 4 * math.sqrt(K * L / S) + L / S + 1
        cand = max(_next_pow2(int(c_hi + 4 * math.sqrt(c_hi)) + 1), 256)
    return cand, lg_sample


def launch_config(R: int, L: int, sms: int) -> dict:
    """Launch shapes, chosen on the H200 (triton 3.6; README "Tuning").

    Few long rows (R <= SMs): split mode. A row's sample + compaction is spread over ``chunks``
    programs of 8 warps (64 x 32K: 4 chunks, 64 x 128K: 8; more was slower), then one 16-warp program
    a row selects and emits. Many rows: the fused kernel, 8 warps capped at 64 registers so 4 programs
    share an SM (one's reductions overlap the others' streaming; 2 or 3 a SM were slower), and a
    persistent grid of exactly what fits at once.
    """
    if R <= sms and L >= 16384:
        chunks = max(2, min(16, L // 8192, _prev_pow2(4 * sms // R)))
        return dict(chunks=chunks, num_warps=8, block=2048, stages=2, maxnreg=0, grid=R,
                    finish_warps=16, max_lg_sample=10)
    return dict(chunks=1, num_warps=8, block=2048, stages=2, maxnreg=64, grid=min(R, 4 * sms),
                finish_warps=8, max_lg_sample=LG_SAMPLE_MAX)


def _prev_pow2(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def topk_transform(logits, lengths, topk, page_table, row_starts, out_offsets, page_size, *,
                   out=None, cand=None, wcap=None, lg_sample=None, bits=None, bits_w=None, block=None, grid=None,
                   num_warps=None, stages=None, maxnreg=None, chunks=None, finish_warps=None, force=0, profile=0):
    """Launcher; arguments as in :func:`flashdsa.ops.topk.topk_transform` (already validated).

    Keyword knobs are for tests and tuning (small buffers reach every path on small rows):
    ``out`` [R, topk] int32 to write into, ``cand`` U capacity, ``wcap`` W capacity, ``lg_sample``
    log2 sample size, ``bits`` / ``bits_w`` digit widths on U / on W and the sample, ``block``
    streaming step, ``grid`` programs, ``num_warps``, ``stages`` (software-pipeline depth of the
    streaming loops), ``maxnreg`` (register cap, 0 = none), ``chunks`` (> 1: split mode, programs per
    row in its first kernel), ``finish_warps`` (split mode's second kernel), ``force`` (threshold guess
    replaced by 1: the largest sampled key, 2: none, 3: the smallest sampled key), ``profile``
    (benchmarks: stop after stage 1 / 2 / 3, output garbage).
    """
    R, L = logits.shape
    dev = logits.device
    K = int(topk)
    if out is None:
        out = torch.empty((R, K), dtype=torch.int32, device=dev)
    if R == 0:
        return out
    cfg = launch_config(R, L, num_sms(dev))
    pick = lambda v, key: cfg[key] if v is None else v  # noqa: E731
    block, num_warps, stages = pick(block, "block"), pick(num_warps, "num_warps"), pick(stages, "stages")
    maxnreg, chunks, finish_warps = pick(maxnreg, "maxnreg"), pick(chunks, "chunks"), pick(finish_warps, "finish_warps")
    assert block <= 16384 and block & (block - 1) == 0, "emit packs two block counts in one int32"
    bits = DEFAULT_BITS if bits is None else bits
    bits_w = DEFAULT_BITS_W if bits_w is None else bits_w
    cand, lg_s = sizes(K, L, cand, lg_sample, cfg["max_lg_sample"] if chunks > 1 else LG_SAMPLE_MAX)
    assert lg_s >= 3, "the sample comes in runs of 8"
    assert cand <= 16384 and cand & (cand - 1) == 0, "emit packs two candidate counts in one int32"
    wcap = min(WCAP, cand) if wcap is None else wcap
    mode = 2 if page_table is not None else 1 if out_offsets is not None else 0
    table = page_table if page_table is not None else lengths
    rows_per_table = R // page_table.shape[0] if page_table is not None else 1
    starts = row_starts if row_starts is not None else lengths
    interp = interpreting()
    regs = {"maxnreg": maxnreg} if maxnreg and not interp else {}
    common = dict(HAS_STARTS=row_starts is not None, CAND=cand, BLOCK=block, STAGES=stages, ASM=not interp)
    translate = (out_offsets if out_offsets is not None else lengths, table,
                 table.stride(0) if page_table is not None else 0, rows_per_table)
    if chunks > 1:
        # split mode: scratch per row, not per program
        scr = torch.empty(R * chunks * cand, dtype=torch.int64, device=dev)
        counts = torch.empty(R * (chunks + 1), dtype=torch.int32, device=dev)
        topk_chunk_kernel[(R, chunks)](
            logits, logits.stride(0), lengths, starts, scr, counts, R, K,
            LG_S=lg_s, BITS_W=bits_w, CHUNKS=chunks, FORCE=force, **common, num_warps=num_warps, **regs)
        if profile in (1, 2):
            return out
        grid = min(R, 4 * num_sms(dev)) if grid is None else grid
        wscr = torch.empty(grid * wcap, dtype=torch.int32, device=dev)
        topk_finish_kernel[(grid,)](
            logits, logits.stride(0), lengths, starts, *translate, out, scr, counts, wscr, R, K,
            MODE=mode, PAGE_SIZE=page_size, WCAP=wcap, BITS=bits, BITS_W=bits_w, CHUNKS=chunks, PROFILE=profile,
            **common, num_warps=finish_warps)
        return out
    if grid is None:
        grid = min(cfg["grid"], max(1, SCRATCH_BUDGET // (8 * cand + 4 * wcap)))
    scr = torch.empty(grid * cand, dtype=torch.int64, device=dev)
    wscr = torch.empty(grid * wcap, dtype=torch.int32, device=dev)
    topk_transform_kernel[(grid,)](
        logits, logits.stride(0), lengths, starts, *translate, out, scr, wscr, R, K,
        MODE=mode, PAGE_SIZE=page_size, WCAP=wcap, LG_S=lg_s, BITS=bits, BITS_W=bits_w, FORCE=force,
        PROFILE=profile, **common, num_warps=num_warps, **regs)
    return out
