"""Radix select: steps 1 and 4 of the top-k kernels (design: README.md "Five steps").

:func:`select_levels` runs radix levels over keys held in registers or streamed from memory a tile at a time:
each level histograms a 2^BITS-bucket digit of ``key - lo`` and keeps the bucket of the kk-th largest
key. On it:

- :func:`sample_threshold` (step 1): the guess ``t_lo``, about the m-th largest of S sampled keys;
- :func:`finish` (step 4): ``(T, need)`` for the k-th largest key of U, levels on U until the bucket fits
  W, then on W;
- :func:`select_emit`: steps 4 and 5 on a full U (the shared tail of both kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdsa.ops.topk import shared_hist
from flashdsa.ops.topk.common import INT_MAX, INT_MIN, KEY_MIN, MAX_LEVELS, order_key, pad4, round4, store
from flashdsa.ops.topk.compact import copy_range, emit_u


@triton.jit
def bit_width(x):
    """Number of bits of ``x`` (an int64 scalar in [0, 2^32)); 0 for 0."""
    w = x * 0
    for i in tl.static_range(5):
        step = 16 >> i
        w = tl.where((x >> (w + step)) != 0, w + step, w)
    return w + (x != 0).to(tl.int64)


@triton.jit
def _min_max_combine(a_min, a_max, b_min, b_max):
    return tl.minimum(a_min, b_min), tl.maximum(a_max, b_max)


@triton.jit
def min_max(x, m):
    """(min, max) of the keys ``x`` where ``m``, in one reduction."""
    return tl.reduce((tl.where(m, x, INT_MAX), tl.where(m, x, INT_MIN)), 0, _min_max_combine)


@triton.jit
def min_max2(x, y, lo, hi, TWO: tl.constexpr):
    """(min, max) of the keys in ``[lo, hi]`` of ``x`` and, TWO, of ``y`` too."""
    a, b = min_max(x, (x >= lo) & (x <= hi))
    if TWO:
        a2, b2 = min_max(y, (y >= lo) & (y <= hi))
        a = tl.minimum(a, a2)
        b = tl.maximum(b, b2)
    return a, b


@triton.jit
def _pick_combine(a_n, a_above, a_ge, b_n, b_above, b_ge):
    return a_n + b_n, tl.maximum(a_above, b_above), tl.minimum(a_ge, b_ge)


@triton.jit
def pick_bucket(hist, kk):
    """From a histogram over buckets: the bucket holding the kk-th largest, the keys above it, its size."""
    # ge[b] = keys in buckets >= b (non-increasing in b): the k-th key's bucket is the last b with ge >= kk.
    ge = tl.cumsum(hist, axis=0, reverse=True)
    n_ge, above, ge_sel = tl.reduce(((ge >= kk).to(tl.int32), tl.where(ge < kk, ge, 0),
                                     tl.where(ge >= kk, ge, INT_MAX)), 0, _pick_combine)
    return n_ge - 1, above, ge_sel - above


@triton.jit
def _stream_hist(src, c, lo, hi, shift, BITS: tl.constexpr, UB: tl.constexpr):
    """Histogram of the digit ``((x - lo) >> shift) & (2^BITS - 1)`` over the keys x of ``src[:c]`` (padded with
    INT_MIN to a multiple of 4) in ``[lo, hi]``, UB at a time, the next block loaded a step ahead."""
    ar = tl.arange(0, UB)
    c4 = round4(c)
    hist = tl.zeros([1 << BITS], dtype=tl.int32)
    # [UB] keys (empty slots: INT_MIN, below every key)
    x = tl.load(src + ar, mask=ar < c4, other=INT_MIN)
    for start in tl.range(0, c, UB, num_stages=1):
        nxt = start + UB + ar
        xn = tl.load(src + nxt, mask=nxt < c4, other=INT_MIN)
        d = tl.where((x >= lo) & (x <= hi), ((x - lo) >> shift) & ((1 << BITS) - 1), -1)
        hist += tl.histogram(d, 1 << BITS, mask=d >= 0)
        x = xn
    return hist


@triton.jit
def _stream_min_max(src, c, lo, hi, UB: tl.constexpr):
    """(min, max) of the keys of ``src[:c]`` (padded to a multiple of 4) in ``[lo, hi]``, UB at a time."""
    ar = tl.arange(0, UB)
    c4 = round4(c)
    vmin = tl.full([UB], INT_MAX, tl.int32)
    vmax = tl.full([UB], INT_MIN, tl.int32)
    x = tl.load(src + ar, mask=ar < c4, other=INT_MIN)
    for start in tl.range(0, c, UB, num_stages=1):
        nxt = start + UB + ar
        xn = tl.load(src + nxt, mask=nxt < c4, other=INT_MIN)
        inb = (x >= lo) & (x <= hi)
        vmin = tl.minimum(vmin, tl.where(inb, x, INT_MAX))
        vmax = tl.maximum(vmax, tl.where(inb, x, INT_MIN))
        x = xn
    return tl.min(vmin, axis=0), tl.max(vmax, axis=0)


@triton.jit
def select_levels(x, c, lo, hi, kk, tol, stop, BITS: tl.constexpr, UB: tl.constexpr, STREAM: tl.constexpr,
                  SHARED: tl.constexpr = False, EDGES: tl.constexpr = False, few=0, y=None,
                  TWO: tl.constexpr = False):
    """Radix levels on the keys ``x`` (a 1-D register tensor; empty slots hold INT_MIN, below every key), or,
    STREAM, on the ``c`` keys that the pointer ``x`` points to (padded with INT_MIN to a multiple of 4),
    read from memory UB at a time at each level (registers independent of c: the form for few-warp
    programs). SHARED (registers only, compiled kernels that called ``shared_hist.declare()``): the
    histogram is counted with shared-memory atomics (``shared_hist.py``: one instruction a key whatever BITS,
    where ``tl.histogram`` pays a ballot a digit bit and a pass a bucket); the rows kernel's 11-bit levels. Only keys in ``[lo, hi]`` (lo >= key(-inf)) count; the levels go towards the kk-th
    largest of them.

    Precondition: at least kk keys lie in ``[lo, hi]`` and every key above ``hi`` is taken. A level
    histograms the digit ``((x - lo) >> shift) & (2^BITS - 1)``: 2^BITS equal buckets laid from lo up
    (``shift = bitwidth(hi - lo) - BITS``; ``x - lo`` wraps in int32 but its low ``shift + BITS <= 32``
    bits are right) and keeps the bucket where the count from the top reaches kk. It stops when
    - one key value is left: ``T = lo``, ``need = kk`` (kk copies of T taken, first positions first);
    - the bucket is taken whole (at most ``kk + tol`` keys; ``tol > 0`` only for the sample's
      threshold, where more than kk may be "taken"): ``T`` = the bucket's lower edge - 1, ``need = 0``;
    - the bucket holds at most ``stop`` keys (``done = 0``): ``[lo, hi]`` = the bucket's edges, and the
      caller continues on a smaller copy.
    Otherwise ``[lo, hi]`` shrinks to the min / max key in the bucket (narrow data collapses at once) and
    the next level runs. EDGES (registers only) does that only for a bucket of more than ``few`` keys (ties
    are likely there: a run of equal keys ends the levels at once) and takes the bucket's edges otherwise, a
    pass over the keys fewer (``few`` = INT_MAX: always the edges, each level then resolving BITS more bits, at
    most ceil(32 / BITS) levels). TWO (registers only): the keys are ``x`` and a second register tensor ``y``
    (the rows kernel's row as two tiles, fewer slots than one power of two).
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
    in_bin = zero + INT_MAX
    if SHARED:
        # both buffers clear (the first level's barrier orders this before its atomics)
        shared_hist.clear(0, 1 << BITS)
        shared_hist.clear(1, 1 << BITS)
    while (done == 0) & (in_bin > stop) & (it < MAX_LEVELS):
        it += 1
        width = bit_width(hi.to(tl.int64) - lo.to(tl.int64))
        if width == 0:
            T = lo
            need = kk
            done = zero + 1
        else:
            shift = tl.maximum(width - BITS, 0).to(tl.int32)
            if STREAM:
                hist = _stream_hist(x, c, lo, hi, shift, BITS, UB)
            else:
                # the digit, -1 outside the range
                d = tl.where((x >= lo) & (x <= hi), ((x - lo) >> shift) & ((1 << BITS) - 1), -1)
                d2 = d
                if TWO:
                    d2 = tl.where((y >= lo) & (y <= hi), ((y - lo) >> shift) & ((1 << BITS) - 1), -1)
                if SHARED:
                    hist = shared_hist.histogram(d, it % 2, 1 << BITS, d2, TWO)
                else:
                    hist = tl.histogram(d, 1 << BITS, mask=d >= 0)
                    if TWO:
                        hist += tl.histogram(d2, 1 << BITS, mask=d2 >= 0)
            dsel, above, in_bin = pick_bucket(hist, kk)
            kk = kk - above
            b_lo = lo.to(tl.int64) + (dsel.to(tl.int64) << shift)
            b_hi = tl.minimum(b_lo + (1 << shift.to(tl.int64)) - 1, hi.to(tl.int64)).to(tl.int32)
            if in_bin <= kk + tol:
                # The whole bucket is taken: T sits just below it (b_lo >= lo >= key(-inf): no overflow).
                T = b_lo.to(tl.int32) - 1
                need = zero
                done = zero + 1
            elif in_bin <= stop:
                lo = b_lo.to(tl.int32)
                hi = b_hi
            elif EDGES:
                if in_bin > few:
                    lo, hi = min_max2(x, y, b_lo.to(tl.int32), b_hi, TWO)
                else:
                    lo = b_lo.to(tl.int32)
                    hi = b_hi
            elif STREAM:
                # one more pass: the bucket's min / max (narrow data collapses at once)
                lo, hi = _stream_min_max(x, c, b_lo.to(tl.int32), b_hi, UB)
            else:
                lo, hi = min_max2(x, y, b_lo.to(tl.int32), b_hi, TWO)
    return done, T, need, lo, hi, kk, in_bin


@triton.jit
def finish(uk, c, lo, hi, kk, w, CAND: tl.constexpr, WCAP: tl.constexpr, UB: tl.constexpr, BITS: tl.constexpr,
           BITS_W: tl.constexpr, STREAM: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr):
    """``(T, need)`` for the kk-th largest of the keys ``uk[:c]`` in ``[lo, hi]``: levels on U (in registers,
    or streamed when STREAM) until the bucket holds at most WCAP keys, then those keys are copied to ``w``
    and the levels go on there."""
    if STREAM:
        done, T, need, lo, hi, kk, in_bin = select_levels(uk, c, lo, hi, kk, 0, WCAP, BITS, UB, True)
    else:
        iu = tl.arange(0, CAND)
        # [CAND] keys of U (empty slots: INT_MIN, below every key)
        x = tl.load(uk + iu, mask=iu < round4(c), other=INT_MIN)
        done, T, need, lo, hi, kk, in_bin = select_levels(x, c, lo, hi, kk, 0, WCAP, BITS, UB, False)
    if done == 0:
        # the bucket -> w (U reloaded: fewer live registers than keeping x)
        copy_range(uk, c, lo, hi, w, NW, ASM)
        pad4(w, in_bin, WCAP)
        # Other threads read what this one wrote.
        tl.debug_barrier()
        if STREAM:
            done, T, need, lo, hi, kk, in_bin = select_levels(w, in_bin, lo, hi, kk, 0, 0, BITS_W, UB, True)
        else:
            iw = tl.arange(0, WCAP)
            # [WCAP] the bucket's keys
            xw = tl.load(w + iw, mask=iw < round4(in_bin), other=INT_MIN)
            done, T, need, lo, hi, kk, in_bin = select_levels(xw, in_bin, lo, hi, kk, 0, 0, BITS_W, UB, False)
        # The next row's copy into w waits for these reads.
        tl.debug_barrier()
    return T, need


@triton.jit
def select_emit(uk, c, t_lo, umax, K, w, out_row, table_row, off_r, CAND: tl.constexpr, WCAP: tl.constexpr,
                UB: tl.constexpr, BITS: tl.constexpr, BITS_W: tl.constexpr, STREAM: tl.constexpr, NW: tl.constexpr,
                MODE: tl.constexpr, PAGE_SIZE: tl.constexpr, ASM: tl.constexpr, STOP: tl.constexpr):
    """Steps 4-5 on a full U (``c`` keys in ``[t_lo, umax]``, K <= c <= CAND): select, then emit (STOP 4:
    stop before the emit with ``T + need`` in the row's first slot)."""
    T, need = finish(uk, c, t_lo, umax, K, w, CAND, WCAP, UB, BITS, BITS_W, STREAM, NW, ASM)
    if STOP == 4:
        tl.store(out_row, T + need)
    else:
        emit_u(uk, c, T, need, out_row, table_row, off_r, CAND, NW, MODE, PAGE_SIZE, ASM)


@triton.jit
def sample_threshold(row, n, K, sbuf, CAND: tl.constexpr, LG_S: tl.constexpr, BITS_S: tl.constexpr,
                     FORCE: tl.constexpr, STREAM: tl.constexpr, UB: tl.constexpr, ASM: tl.constexpr):
    """Threshold guess ``t_lo`` for a row with ``n > K`` keys: about the m-th largest of S sampled keys, m
    chosen so that P(fewer than K row keys reach it) is ~4 sigma small (expected count K + 4 sqrt(K n / S)).
    The radix levels stop early once the bucket's lower edge is reached by at most ``m + tol`` samples,
    tol = m / 16. The samples come in runs of 8 adjacent keys (one 32-byte sector each) at evenly spaced
    positions; they are selected in registers, or (STREAM) copied to ``sbuf [S]`` and streamed from there.
    Rows that fit U (n <= CAND) need no guess: every key is a candidate (``KEY_MIN``).
    Returns ``(t_lo, s_eq)``: s_eq is the number of samples equal to t_lo when the levels ended on one
    value (ties at the guess: ``s_eq / S`` estimates the share of the row equal to it), else 0."""
    S: tl.constexpr = 1 << LG_S
    t_lo = n * 0 + KEY_MIN
    s_eq = n * 0
    if ((n > CAND) & (FORCE != 2)) | (FORCE == 1) | (FORCE == 3):
        mu = S * (K + 0.0) / n.to(tl.float32)
        m_s = (mu + 4.0 * tl.sqrt(mu)).to(tl.int32) + 1
        if STREAM:
            vmin = tl.full([UB], INT_MAX, tl.int32)
            vmax = tl.full([UB], INT_MIN, tl.int32)
            for start in tl.range(0, S, UB, num_stages=1):
                i = start + tl.arange(0, UB)
                p = (((i // 8).to(tl.int64) * n) >> (LG_S - 3)).to(tl.int32)
                p = tl.minimum((p & -8) + i % 8, n - 1)
                # [UB] sampled keys
                xs = order_key(tl.load(row + p, mask=i < S, other=float("-inf")))
                vmin = tl.minimum(vmin, tl.where(i < S, xs, INT_MAX))
                vmax = tl.maximum(vmax, tl.where(i < S, xs, INT_MIN))
                store(sbuf + i, xs, i < S, ASM)
            smin = tl.min(vmin, axis=0)
            smax = tl.max(vmax, axis=0)
            # Other threads read what this one wrote.
            tl.debug_barrier()
        else:
            i = tl.arange(0, S)
            p = (((i // 8).to(tl.int64) * n) >> (LG_S - 3)).to(tl.int32)
            p = tl.minimum((p & -8) + i % 8, n - 1)
            # [S] sampled keys
            xs = order_key(tl.load(row + p))
            smin, smax = min_max(xs, i < S)
        if FORCE == 1:
            t_lo = smax
        elif FORCE == 3:
            t_lo = smin
        elif m_s < S:
            if STREAM:
                done, T, need, lo, hi, kk, in_bin = select_levels(sbuf, S, smin, smax, m_s, m_s // 16, 0, BITS_S, UB,
                                                            True)
            else:
                done, T, need, lo, hi, kk, in_bin = select_levels(xs, S, smin, smax, m_s, m_s // 16, 0, BITS_S, UB, False)
            t_lo = tl.where(need > 0, T, T + 1)
            # need > 0: the levels ended on one value, the bucket's in_bin samples (INT_MAX when every
            # sample was equal from the start)
            s_eq = tl.where(need > 0, tl.minimum(in_bin, S), 0)
    return t_lo, s_eq


