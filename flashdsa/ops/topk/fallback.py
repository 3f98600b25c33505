"""The row fallback of the top-k kernels: when the threshold guess missed (fewer than k keys reached it,
or more than U holds), radix levels run on the row itself, one pass each, until the bucket of the k-th
key fits U; :func:`~flashdsa.ops.topk.radix.finish` ends there and the emit walks the row (design:
README.md "The guess missed"). Slower than the sampled path, same answer: no candidate is ever dropped.

The passes here are 1-D, ``BLOCK`` scores a step with block-wide prefix sums (the default step, 128 NW,
is 4 scores a thread, so they never dominate the register count).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdsa.ops.topk.common import INT_MAX, INT_MIN, KEY_MAX, KEY_MIN, MAX_LEVELS, order_key, pad4, store, translate
from flashdsa.ops.topk.radix import bit_width, finish, pick_bucket


@triton.jit
def _compact_block(row, offs, m, lo, hi, dst, c, CAND: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr):
    """Append the keys of one block that lie in ``[lo, hi]`` to ``dst`` (int32) after the ``c`` already
    there, in position order; stores stop at CAND. Returns the new count."""
    if MASKED:
        # [BLOCK] scores of the row
        s = order_key(tl.load(row + offs, mask=m, other=float("-inf")))
        f = m & (s >= lo) & (s <= hi)
    else:
        s = order_key(tl.load(row + offs))
        f = (s >= lo) & (s <= hi)
    fi = f.to(tl.int32)
    slot = c + tl.cumsum(fi, axis=0) - 1
    store(dst + slot, s, f & (slot < CAND), ASM)
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
    vmin = tl.full([BLOCK], INT_MAX, tl.int32)
    vmax = tl.full([BLOCK], INT_MIN, tl.int32)
    for start in tl.range(0, n, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        # [BLOCK] scores of the row
        s = order_key(tl.load(row + offs, mask=m, other=0.0))
        m = m & (s >= lo) & (s <= hi)
        hist += tl.histogram(((s - lo) >> shift) & ((1 << BITS) - 1), 1 << BITS, mask=m)
        vmin = tl.minimum(vmin, tl.where(m, s, INT_MAX))
        vmax = tl.maximum(vmax, tl.where(m, s, INT_MIN))
    return hist, tl.min(vmin, axis=0), tl.max(vmax, axis=0)


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
        s = order_key(tl.load(row + offs, mask=m, other=0.0))
        gt = (m & (s > T)).to(tl.int32)
        eq = (m & (s == T)).to(tl.int32)
        incl = tl.cumsum(gt + (eq << 16), axis=0)
        gt_ex = gt_base + (incl & 0xFFFF) - gt
        eq_ex = eq_base + (incl >> 16) - eq
        sel = (gt != 0) | ((eq != 0) & (eq_ex < need))
        slot = gt_ex + tl.minimum(eq_ex, need)
        store(out_row + slot, translate(offs, sel, table_row, off_r, MODE, PAGE_SIZE), sel, ASM)
        tot = tl.sum(gt + (eq << 16), axis=0)
        gt_base += tot & 0xFFFF
        eq_base += tot >> 16
        taken = gt_base + tl.minimum(eq_base, need)
        start += BLOCK


@triton.jit
def row_fallback(row, n, K, c, t_lo, uk, w, out_row, table_row, off_r, CAND: tl.constexpr, WCAP: tl.constexpr,
                 UB: tl.constexpr, BITS: tl.constexpr, BITS_W: tl.constexpr, STREAM: tl.constexpr,
                 BLOCK: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 NW: tl.constexpr, ASM: tl.constexpr, EMIT: tl.constexpr):
    """The guess missed (``c`` keys reached ``t_lo``: fewer than K, or more than U holds). Levels on the
    row itself until the bucket fits U (its keys copied to ``uk``), then in registers; emit from the row."""
    if c > CAND:
        lo = t_lo
        hi = n * 0 + KEY_MAX
        kk = K + n * 0
    else:
        # the c keys >= t_lo are above the range and all taken
        lo = n * 0 + KEY_MIN
        hi = t_lo - 1
        kk = K - c
    T = n * 0
    need = n * 0
    done = n * 0
    it = n * 0
    while (done == 0) & (it < MAX_LEVELS):
        it += 1
        width = bit_width(hi.to(tl.int64) - lo.to(tl.int64))
        if width == 0:
            T = lo
            need = kk
            done = n * 0 + 1
        else:
            shift = tl.maximum(width - BITS, 0)
            hist, smin, smax = _row_hist(row, n, lo, hi, shift.to(tl.int32), BITS, BLOCK, STAGES)
            dsel, above, in_bin = pick_bucket(hist, kk)
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
                pad4(uk, in_bin, CAND)
                _compact_row(row, 0, n, lo, hi, uk, CAND, BLOCK, STAGES, ASM)
                tl.debug_barrier()
                # the bucket's keys in U (emit reads the row: positions are not needed)
                T, need = finish(uk, in_bin, lo, hi, kk, w, CAND, WCAP, UB, BITS, BITS_W, STREAM, NW, ASM)
                done = n * 0 + 1
    if EMIT:
        _emit_row(row, n, T, need, K, out_row, table_row, off_r, MODE, PAGE_SIZE, BLOCK, ASM)


