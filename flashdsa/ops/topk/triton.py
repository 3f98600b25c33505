"""Exact top-k with fused slot translation: the Triton kernels (design notes in README.md).

Each row is worked on as order-preserving int32 keys:

1. sample:   ``S`` keys of the row (runs of 8 at evenly spaced positions), radix-selected -> a low
             threshold ``t_lo`` that ~1.4 k keys reach (a guess: speed only);
2. compact:  one streaming pass keeps every score whose key is ``>= t_lo`` (three integer compares on
             the raw bits, no key computed) with its position. Each warp owns a contiguous segment of
             the row and appends to its own list with warp-local prefix sums: no barrier in the pass;
3. move:     the warp lists are concatenated in position order into ``U`` (scores -> keys on the way);
4. select:   radix levels on ``U`` (32 linear buckets a level) until the bucket of the k-th key holds at
             most WCAP keys, copied to ``W``; levels on ``W`` find the k-th key ``T`` and ``need``, how many
             keys equal to ``T`` are taken (first positions);
5. emit:     every key of ``U`` ``> T`` and the first ``need`` keys ``== T``, in position order,
             translated (page table / offset / plain) in the same store.

The levels hold their keys in registers (8-warp programs), or stream them from memory a tile at a
time (``STREAM``: few-warp programs, registers independent of the candidate count).

Many rows: ``topk_transform_kernel`` does all five, a persistent grid walking the rows. Few long rows:
``topk_split_kernel`` spreads steps 1-3 of a row over several programs; the last of them to finish
(a per-row arrival counter) does 4-5 for the row, in the same launch. If the guess fails (fewer than k
keys reach ``t_lo``, or more than ``U`` holds) the levels run on the row itself until the bucket fits
``U``: slower, same answer. Rows with ``length <= k`` are copied. Scratch
is sized from shapes only, nothing is synchronised with the host, every count is a reduction or a
prefix sum in position order, so the output is the same bits on every run.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashdsa.ops._triton_utils import cdiv, interpreting, next_pow2, num_sms, prev_pow2

# Keys are int32 whose signed order is the score order: key(-inf) == key(NaN) is the smallest.
_INT_MIN = tl.constexpr(-2147483648)
_INT_MAX = tl.constexpr(2147483647)
_KEY_MIN = tl.constexpr(-2139095041)      # key of -inf (0xFF800000) and of every NaN
_KEY_MAX = tl.constexpr(2139095040)       # key of +inf (0x7F800000)
_POS_INF_BITS = tl.constexpr(2139095040)  # 0x7F800000
_NEG_INF_BITS = tl.constexpr(-8388608)    # 0xFF800000 as int32
_MAX_LEVELS = tl.constexpr(40)            # > 32 bits / 1 bit per level: a hang guard, never reached

DEFAULT_BITS = 5          # digit bits of a level on U (32 bins: the cheapest per resolved bit in triton 3.6)
DEFAULT_BITS_W = 5        # digit bits on W
DEFAULT_BITS_S = 5        # digit bits on the sample
WCAP = 512                # W: the bucket small enough to leave U's registers for
LG_SAMPLE_MIN, LG_SAMPLE_MAX = 9, 12
SCRATCH_BUDGET = 1 << 30     # bytes of scratch; fewer programs when k is huge


@triton.jit
def _order_key(x):
    """``float32 -> int32`` with the same order (NaN -> -inf, -0.0 -> +0.0)."""
    return _bits_key(x.to(tl.int32, bitcast=True))


@triton.jit
def _bits_key(b):
    """The key of the float32 whose bits are ``b`` (int32)."""
    b = tl.where(b == _INT_MIN, 0, b)
    b = tl.where((b & 0x7FFFFFFF) > _POS_INF_BITS, _NEG_INF_BITS, b)
    # Negative floats order backwards as integers: flip their magnitude bits.
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _bits_bounds(t):
    """``(t_a, t_p, t_b)`` with ``key(b) >= t  <=>  (t_a <= b <= t_p) | (b < t_b)`` for float bits ``b``.

    Non-negative floats (b >= 0) pass when ``max(t, 0) <= b <= bits(+inf)`` (positive NaNs fail);
    negative floats order backwards, and -0.0 (b = INT_MIN, key 0) is first: they pass when
    ``b < INT_MIN - min(t, -1)`` (none when t > 0). ``t <= key(-inf)``: everything passes, NaNs too."""
    every = t <= _KEY_MIN
    t_a = tl.where(every, _INT_MIN, tl.maximum(t, 0))
    t_p = tl.where(every, _INT_MAX, _POS_INF_BITS)
    t_b = tl.where(t > 0, _INT_MIN, _INT_MIN - tl.minimum(t, -1))
    return t_a, t_p, t_b


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
def _store2(ptr, lo, hi, pred, ASM: tl.constexpr):
    """``ptr[i] = hi << 32 | lo`` (int64 pointer, int32 halves) where ``pred``: one 8-byte store, no 64-bit
    value built."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $4, 0; @p st.global.v2.b32 [$1], {$2, $3}; mov.b32 $0, 0; }",
            "=r,l,r,r,r", [ptr, lo, hi, pred.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF), mask=pred)


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


# ---- warp lists: tiles [NW, 128], warp w owns row w (4 scores a lane: 128-bit loads) ------------------

@triton.jit
def _excl_sum(v, NW: tl.constexpr):
    """Exclusive prefix sums of the NW per-warp values ``v [NW]``, without a scan over a tiny tensor."""
    iw = tl.arange(0, NW)
    return tl.sum(tl.where(iw[None, :] < iw[:, None], v[None, :], 0), axis=1)


@triton.jit
def _load_tile(row, p, s1, VEC: tl.constexpr):
    """``[NW, 128]`` raw score bits at positions ``p < s1`` (0 elsewhere). VEC: the row's 16-byte chunks are
    whole (launcher: aligned rows, length a multiple of 4), so the mask runs to s1 rounded up to 4 and is
    the same for a lane's 4 scores: one 128-bit load a lane instead of four 32-bit ones. The scores past
    s1 that this reads are masked by :func:`_pass_tile`."""
    if VEC:
        m = p < (s1 + 3) // 4 * 4
    else:
        m = p < s1
    # read once: evict-first keeps in L2 the scratch that the later steps read back
    return tl.load(row + p, mask=m, other=0.0, eviction_policy="evict_first").to(tl.int32, bitcast=True)


@triton.jit
def _pass_tile(b, p, s1, t_a, t_p, t_b, dst, cw, CAP: tl.constexpr, ASM: tl.constexpr):
    """One tile of score bits ``b`` at positions ``p [NW, 128]``: warp w appends the passing scores
    (bits << 32 | position) to its list ``dst[w]`` after its ``cw[w]`` entries (stores stop at CAP).
    Returns the new counts."""
    f = (p < s1) & (((b >= t_a) & (b <= t_p)) | (b < t_b))
    fi = f.to(tl.int32)
    slot = cw[:, None] + tl.cumsum(fi, axis=1) - 1
    _store2(dst + slot, p, b, f & (slot < CAP), ASM)
    return cw + tl.sum(fi, axis=1)


@triton.jit
def _compact_seg(row, s0, s1, t_a, t_p, t_b, useg, CAP: tl.constexpr, NW: tl.constexpr, UN: tl.constexpr,
                 VEC: tl.constexpr, ASM: tl.constexpr):
    """Positions ``[s0, s1)`` of the row split into NW contiguous segments, one a warp: warp w appends
    ``bits << 32 | position`` of every score passing ``(t_a <= b <= t_p) | (b < t_b)`` to its own list
    ``useg[w * CAP:]`` (at most CAP stored), in position order, with warp-local prefix sums (no
    barrier). A warp issues the loads of UN tiles of 128 scores before it works on the first of them
    (the list stores are inline asm with side effects: loads after them in program order wait for
    them). Returns the uncapped counts ``[NW]``. s0 is a multiple of 4 (128-bit loads)."""
    w = tl.arange(0, NW)
    j = tl.arange(0, 128)
    seg = tl.cdiv(tl.cdiv(s1 - s0, NW), UN * 128) * (UN * 128)
    start = (s0 + w * seg)[:, None] + j[None, :]
    dst = useg + (w.to(tl.int64) * CAP)[:, None]
    cw = tl.zeros([NW], dtype=tl.int32)
    for it in tl.range(0, seg, UN * 128, num_stages=1):
        p = start + it
        if UN == 1:
            cw = _pass_tile(_load_tile(row, p, s1, VEC), p, s1, t_a, t_p, t_b, dst, cw, CAP, ASM)
        elif UN == 2:
            b0 = _load_tile(row, p, s1, VEC)
            b1 = _load_tile(row, p + 128, s1, VEC)
            cw = _pass_tile(b0, p, s1, t_a, t_p, t_b, dst, cw, CAP, ASM)
            cw = _pass_tile(b1, p + 128, s1, t_a, t_p, t_b, dst, cw, CAP, ASM)
        else:
            tl.static_assert(UN == 4)
            b0 = _load_tile(row, p, s1, VEC)
            b1 = _load_tile(row, p + 128, s1, VEC)
            b2 = _load_tile(row, p + 256, s1, VEC)
            b3 = _load_tile(row, p + 384, s1, VEC)
            cw = _pass_tile(b0, p, s1, t_a, t_p, t_b, dst, cw, CAP, ASM)
            cw = _pass_tile(b1, p + 128, s1, t_a, t_p, t_b, dst, cw, CAP, ASM)
            cw = _pass_tile(b2, p + 256, s1, t_a, t_p, t_b, dst, cw, CAP, ASM)
            cw = _pass_tile(b3, p + 384, s1, t_a, t_p, t_b, dst, cw, CAP, ASM)
    return cw


@triton.jit
def _round4(c):
    """c rounded up to a multiple of 4: a bound the compiler knows to be one, so masked loads of 4 adjacent
    int32 a thread stay 128-bit loads (U / W are padded up to it with INT_MIN: :func:`_pad4`)."""
    return (c + 3) // 4 * 4


@triton.jit
def _pad4(keys, c, CAP: tl.constexpr):
    """``keys[c : round4(c)] = INT_MIN`` (below every key; CAP a multiple of 4), so loads of U / W may run to
    the rounded count."""
    i = c + tl.arange(0, 4)
    tl.store(keys + i, tl.full([4], _INT_MIN, tl.int32), mask=(i < _round4(c)) & (i < CAP))


@triton.jit
def _move(useg, cw, c, uk, CAP: tl.constexpr, CAND: tl.constexpr, NW: tl.constexpr, MJ: tl.constexpr,
          ASM: tl.constexpr):
    """The warp lists (``cw [NW]`` entries each, ``c`` in all) -> U in position order, MJ entries of each a
    step: keys to ``uk[:CAND]``, positions to ``uk[CAND:2 CAND]`` (at most CAND), then U padded to a
    multiple of 4.
    The next step's entries are loaded before this step's stores (which the loads would otherwise wait
    for), two a 128-bit load (the mask runs to the count rounded up to 2: entries inside the list).
    Returns the largest key moved."""
    w = tl.arange(0, NW)
    j = tl.arange(0, MJ)[None, :]
    base = _excl_sum(cw, NW)[:, None]
    top = tl.max(tl.minimum(cw, CAP), axis=0)
    cnt = tl.minimum(cw, CAP)[:, None]
    cnt2 = (cnt + 1) // 2 * 2
    src = useg + (w.to(tl.int64) * CAP)[:, None]
    vmax = tl.full([NW, MJ], _INT_MIN, tl.int32)
    # [NW, MJ] bits << 32 | position
    v = tl.load(src + j, mask=j < cnt2, other=0)
    for it in tl.range(0, top, MJ, num_stages=1):
        jj = it + j
        vn = tl.load(src + jj + MJ, mask=jj + MJ < cnt2, other=0)
        m = (jj < cnt) & (base + jj < CAND)
        key = _bits_key((v >> 32).to(tl.int32))
        vmax = tl.maximum(vmax, tl.where(m, key, _INT_MIN))
        _store(uk + base + jj, key, m, ASM)
        _store(uk + CAND + base + jj, (v & 0xFFFFFFFF).to(tl.int32), m, ASM)
        v = vn
    _pad4(uk, tl.minimum(c, CAND), CAND)
    return tl.max(tl.max(vmax, axis=1), axis=0)


@triton.jit
def _warp_spans(c, NW: tl.constexpr):
    """Warp w's span of ``[0, c)`` (c padded to c4, a multiple of 4): ``start [NW, 128]``, the positions of its
    first tile, and ``span``, a multiple of 128, the same for every warp."""
    c4 = _round4(c)
    span = tl.cdiv(tl.cdiv(c4, NW), 128) * 128
    start = (tl.arange(0, NW) * span)[:, None] + tl.arange(0, 128)[None, :]
    return start, span, c4


@triton.jit
def _span_counts(src, start, span, c4, a1, b1, a2, b2, NW: tl.constexpr):
    """Per warp ``[NW]``: how many keys of its span (``src``, INT_MIN past c4) lie in ``[a1, b1]``, plus how many
    lie in ``[a2, b2]`` shifted left by 16 (each below 2^15). The next tile is loaded a step ahead."""
    acc = tl.zeros([NW, 128], dtype=tl.int32)
    # [NW, 128] keys
    x = tl.load(src + start, mask=start < c4, other=_INT_MIN)
    for it in tl.range(0, span, 128, num_stages=1):
        nxt = start + it + 128
        xn = tl.load(src + nxt, mask=nxt < c4, other=_INT_MIN)
        acc += ((x >= a1) & (x <= b1)).to(tl.int32) + (((x >= a2) & (x <= b2)).to(tl.int32) << 16)
        x = xn
    return tl.sum(acc, axis=1)


@triton.jit
def _emit_u(uk, c, T, need, out_row, table_row, off_r, CAND: tl.constexpr, NW: tl.constexpr, MODE: tl.constexpr,
            PAGE_SIZE: tl.constexpr, ASM: tl.constexpr):
    """Write, in U order, the positions (``uk[CAND:]``) of every key (``uk[:c]``, padded to a multiple of 4)
    ``> T`` and of the first ``need`` keys ``== T``, translated.

    Warp w owns a contiguous span of U and walks it in ``[NW, 128]`` tiles, so every scan and sum stays
    inside a warp (a block-wide scan costs two barriers a block): a first pass counts each warp's keys
    ``> T`` and ``== T``, one exclusive sum over the NW totals gives each warp its output offsets, a
    second pass scans and stores. Each pass loads the next tile before working on this one."""
    start, span, c4 = _warp_spans(c, NW)
    # ---- pass 1: per-warp counts, > T in the low 16 bits, == T in the high (CAND < 2^15)
    tot = _span_counts(uk, start, span, c4, T + 1, _INT_MAX, T, T, NW)
    gt_base = _excl_sum(tot & 0xFFFF, NW)
    eq_base = _excl_sum(tot >> 16, NW)
    # ---- pass 2: warp-local scans, translated stores
    x = tl.load(uk + start, mask=start < c4, other=_INT_MIN)
    pos = tl.load(uk + CAND + start, mask=start < c4, other=0)
    for it in tl.range(0, span, 128, num_stages=1):
        nxt = start + it + 128
        xn = tl.load(uk + nxt, mask=nxt < c4, other=_INT_MIN)
        pn = tl.load(uk + CAND + nxt, mask=nxt < c4, other=0)
        gt = (x > T).to(tl.int32)
        eq = (x == T).to(tl.int32)
        v = gt + (eq << 16)
        ex = tl.cumsum(v, axis=1) - v
        gt_ex = gt_base[:, None] + (ex & 0xFFFF)
        eq_ex = eq_base[:, None] + (ex >> 16)
        sel = (gt != 0) | ((eq != 0) & (eq_ex < need))
        slot = gt_ex + tl.minimum(eq_ex, need)
        _store(out_row + slot, _translate(pos, sel, table_row, off_r, MODE, PAGE_SIZE), sel, ASM)
        t = tl.sum(v, axis=1)
        gt_base += t & 0xFFFF
        eq_base += t >> 16
        x = xn
        pos = pn


# ---- the 1-D streaming helpers of the row fallback ------------------------------------------------------

@triton.jit
def _compact_block(row, offs, m, lo, hi, dst, c, CAND: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr):
    """Append the keys of one block that lie in ``[lo, hi]`` to ``dst`` (int32) after the ``c`` already
    there, in position order; stores stop at CAND. Returns the new count."""
    if MASKED:
        # [BLOCK] scores of the row
        s = _order_key(tl.load(row + offs, mask=m, other=float("-inf")))
        f = m & (s >= lo) & (s <= hi)
    else:
        s = _order_key(tl.load(row + offs))
        f = (s >= lo) & (s <= hi)
    fi = f.to(tl.int32)
    slot = c + tl.cumsum(fi, axis=0) - 1
    _store(dst + slot, s, f & (slot < CAND), ASM)
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


# ---- radix select in registers --------------------------------------------------------------------------

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
def _stream_hist(src, c, lo, hi, shift, BITS: tl.constexpr, UB: tl.constexpr):
    """Histogram of the digit ``((x - lo) >> shift) & (2^BITS - 1)`` over the keys x of ``src[:c]`` (padded with
    INT_MIN to a multiple of 4) in ``[lo, hi]``, UB at a time, the next block loaded a step ahead."""
    ar = tl.arange(0, UB)
    c4 = _round4(c)
    hist = tl.zeros([1 << BITS], dtype=tl.int32)
    # [UB] keys (empty slots: INT_MIN, below every key)
    x = tl.load(src + ar, mask=ar < c4, other=_INT_MIN)
    for start in tl.range(0, c, UB, num_stages=1):
        nxt = start + UB + ar
        xn = tl.load(src + nxt, mask=nxt < c4, other=_INT_MIN)
        d = tl.where((x >= lo) & (x <= hi), ((x - lo) >> shift) & ((1 << BITS) - 1), -1)
        hist += tl.histogram(d, 1 << BITS, mask=d >= 0)
        x = xn
    return hist


@triton.jit
def _stream_min_max(src, c, lo, hi, UB: tl.constexpr):
    """(min, max) of the keys of ``src[:c]`` (padded to a multiple of 4) in ``[lo, hi]``, UB at a time."""
    ar = tl.arange(0, UB)
    c4 = _round4(c)
    vmin = tl.full([UB], _INT_MAX, tl.int32)
    vmax = tl.full([UB], _INT_MIN, tl.int32)
    x = tl.load(src + ar, mask=ar < c4, other=_INT_MIN)
    for start in tl.range(0, c, UB, num_stages=1):
        nxt = start + UB + ar
        xn = tl.load(src + nxt, mask=nxt < c4, other=_INT_MIN)
        inb = (x >= lo) & (x <= hi)
        vmin = tl.minimum(vmin, tl.where(inb, x, _INT_MAX))
        vmax = tl.maximum(vmax, tl.where(inb, x, _INT_MIN))
        x = xn
    return tl.min(vmin, axis=0), tl.max(vmax, axis=0)


@triton.jit
def _select(x, c, lo, hi, kk, tol, stop, BITS: tl.constexpr, UB: tl.constexpr, STREAM: tl.constexpr):
    """Radix levels on the keys ``x`` (a 1-D register tensor; empty slots hold INT_MIN, below every key), or,
    STREAM, on the ``c`` keys that the pointer ``x`` points to (padded with INT_MIN to a multiple of 4),
    read from memory UB at a time at each level (registers independent of c: the form for few-warp
    programs). Only keys in ``[lo, hi]`` (lo >= key(-inf)) count; the levels go towards the kk-th
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
    Otherwise ``[lo, hi]`` shrinks to the min / max key in the bucket (narrow data collapses at once)
    and the next level runs.
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
            if STREAM:
                hist = _stream_hist(x, c, lo, hi, shift, BITS, UB)
            else:
                # the digit, -1 outside the range
                d = tl.where((x >= lo) & (x <= hi), ((x - lo) >> shift) & ((1 << BITS) - 1), -1)
                hist = tl.histogram(d, 1 << BITS, mask=d >= 0)
            dsel, above, in_bin = _pick_bucket(hist, kk)
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
            elif STREAM:
                # one more pass: the bucket's min / max (narrow data collapses at once)
                lo, hi = _stream_min_max(x, c, b_lo.to(tl.int32), b_hi, UB)
            else:
                lo, hi = _min_max(x, (x >= b_lo.to(tl.int32)) & (x <= b_hi))
    return done, T, need, lo, hi, kk, in_bin


@triton.jit
def _copy_range(src, c, lo, hi, dst, NW: tl.constexpr, ASM: tl.constexpr):
    """The keys of ``src[:c]`` (padded with INT_MIN to a multiple of 4) that lie in ``[lo, hi]`` -> ``dst``, in
    order. Warp spans and two passes as in :func:`_emit_u`: counts, one exclusive sum over the warps,
    then warp-local scans and stores (no block-wide scan)."""
    start, span, c4 = _warp_spans(c, NW)
    # empty slots (INT_MIN) are never in range; the second range is empty
    base = _excl_sum(_span_counts(src, start, span, c4, lo, hi, 1, 0, NW), NW)
    x = tl.load(src + start, mask=start < c4, other=_INT_MIN)
    for it in tl.range(0, span, 128, num_stages=1):
        nxt = start + it + 128
        xn = tl.load(src + nxt, mask=nxt < c4, other=_INT_MIN)
        f = (x >= lo) & (x <= hi)
        fi = f.to(tl.int32)
        _store(dst + base[:, None] + tl.cumsum(fi, axis=1) - 1, x, f, ASM)
        base += tl.sum(fi, axis=1)
        x = xn


@triton.jit
def _finish(uk, c, lo, hi, kk, w, CAND: tl.constexpr, WCAP: tl.constexpr, UB: tl.constexpr, BITS: tl.constexpr,
            BITS_W: tl.constexpr, STREAM: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr):
    """``(T, need)`` for the kk-th largest of the keys ``uk[:c]`` in ``[lo, hi]``: levels on U (in registers,
    or streamed when STREAM) until the bucket holds at most WCAP keys, then those keys are copied to ``w``
    and the levels go on there."""
    if STREAM:
        done, T, need, lo, hi, kk, in_bin = _select(uk, c, lo, hi, kk, 0, WCAP, BITS, UB, True)
    else:
        iu = tl.arange(0, CAND)
        # [CAND] keys of U (empty slots: INT_MIN, below every key)
        x = tl.load(uk + iu, mask=iu < _round4(c), other=_INT_MIN)
        done, T, need, lo, hi, kk, in_bin = _select(x, c, lo, hi, kk, 0, WCAP, BITS, UB, False)
    if done == 0:
        # the bucket -> w (U reloaded: fewer live registers than keeping x)
        _copy_range(uk, c, lo, hi, w, NW, ASM)
        _pad4(w, in_bin, WCAP)
        # Other threads read what this one wrote.
        tl.debug_barrier()
        if STREAM:
            done, T, need, lo, hi, kk, in_bin = _select(w, in_bin, lo, hi, kk, 0, 0, BITS_W, UB, True)
        else:
            iw = tl.arange(0, WCAP)
            # [WCAP] the bucket's keys
            xw = tl.load(w + iw, mask=iw < _round4(in_bin), other=_INT_MIN)
            done, T, need, lo, hi, kk, in_bin = _select(xw, in_bin, lo, hi, kk, 0, 0, BITS_W, UB, False)
        # The next row's copy into w waits for these reads.
        tl.debug_barrier()
    return T, need


@triton.jit
def _select_emit(uk, c, t_lo, umax, K, w, out_row, table_row, off_r, CAND: tl.constexpr, WCAP: tl.constexpr,
                 UB: tl.constexpr, BITS: tl.constexpr, BITS_W: tl.constexpr, STREAM: tl.constexpr, NW: tl.constexpr,
                 MODE: tl.constexpr, PAGE_SIZE: tl.constexpr, ASM: tl.constexpr, PROFILE: tl.constexpr):
    """Steps 4-5 on a full U (``c`` keys in ``[t_lo, umax]``, K <= c <= CAND): select, then emit (PROFILE 4:
    stop before the emit with ``T + need`` in the row's first slot)."""
    T, need = _finish(uk, c, t_lo, umax, K, w, CAND, WCAP, UB, BITS, BITS_W, STREAM, NW, ASM)
    if PROFILE == 4:
        tl.store(out_row, T + need)
    else:
        _emit_u(uk, c, T, need, out_row, table_row, off_r, CAND, NW, MODE, PAGE_SIZE, ASM)


@triton.jit
def _sample_threshold(row, n, K, sbuf, CAND: tl.constexpr, LG_S: tl.constexpr, BITS_S: tl.constexpr,
                      FORCE: tl.constexpr, STREAM: tl.constexpr, UB: tl.constexpr, ASM: tl.constexpr):
    """Threshold guess ``t_lo`` for a row with ``n > K`` keys: about the m-th largest of S sampled keys, m
    chosen so that P(fewer than K row keys reach it) is ~4 sigma small (expected count K + 4 sqrt(K n / S)).
    The radix levels stop early once the bucket's lower edge is reached by at most ``m + tol`` samples,
    tol = m / 16. The samples come in runs of 8 adjacent keys (one 32-byte sector each) at evenly spaced
    positions; they are selected in registers, or (STREAM) copied to ``sbuf [S]`` and streamed from there.
    Rows that fit U (n <= CAND) need no guess: every key is a candidate (``_KEY_MIN``)."""
    S: tl.constexpr = 1 << LG_S
    t_lo = n * 0 + _KEY_MIN
    if ((n > CAND) & (FORCE != 2)) | (FORCE == 1) | (FORCE == 3):
        mu = S * (K + 0.0) / n.to(tl.float32)
        m_s = (mu + 4.0 * tl.sqrt(mu)).to(tl.int32) + 1
        if STREAM:
            vmin = tl.full([UB], _INT_MAX, tl.int32)
            vmax = tl.full([UB], _INT_MIN, tl.int32)
            for start in tl.range(0, S, UB, num_stages=1):
                i = start + tl.arange(0, UB)
                p = (((i // 8).to(tl.int64) * n) >> (LG_S - 3)).to(tl.int32)
                p = tl.minimum((p & -8) + i % 8, n - 1)
                # [UB] sampled keys
                xs = _order_key(tl.load(row + p, mask=i < S, other=float("-inf")))
                vmin = tl.minimum(vmin, tl.where(i < S, xs, _INT_MAX))
                vmax = tl.maximum(vmax, tl.where(i < S, xs, _INT_MIN))
                _store(sbuf + i, xs, i < S, ASM)
            smin = tl.min(vmin, axis=0)
            smax = tl.max(vmax, axis=0)
            # Other threads read what this one wrote.
            tl.debug_barrier()
        else:
            i = tl.arange(0, S)
            p = (((i // 8).to(tl.int64) * n) >> (LG_S - 3)).to(tl.int32)
            p = tl.minimum((p & -8) + i % 8, n - 1)
            # [S] sampled keys
            xs = _order_key(tl.load(row + p))
            smin, smax = _min_max(xs, i < S)
        if FORCE == 1:
            t_lo = smax
        elif FORCE == 3:
            t_lo = smin
        elif m_s < S:
            if STREAM:
                done, T, need, lo, hi, kk, in_bin = _select(sbuf, S, smin, smax, m_s, m_s // 16, 0, BITS_S, UB,
                                                            True)
            else:
                done, T, need, lo, hi, kk, in_bin = _select(xs, S, smin, smax, m_s, m_s // 16, 0, BITS_S, UB, False)
            t_lo = tl.where(need > 0, T, T + 1)
    return t_lo


@triton.jit
def _fallback(row, n, K, c, t_lo, uk, w, out_row, table_row, off_r, CAND: tl.constexpr, WCAP: tl.constexpr,
              UB: tl.constexpr, BITS: tl.constexpr, BITS_W: tl.constexpr, STREAM: tl.constexpr,
              BLOCK: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
              NW: tl.constexpr, ASM: tl.constexpr, EMIT: tl.constexpr):
    """The guess missed (``c`` keys reached ``t_lo``: fewer than K, or more than U holds). Levels on the
    row itself until the bucket fits U (its keys copied to ``uk``), then in registers; emit from the row."""
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
                _pad4(uk, in_bin, CAND)
                _compact_row(row, 0, n, lo, hi, uk, CAND, BLOCK, STAGES, ASM)
                tl.debug_barrier()
                # the bucket's keys in U (emit reads the row: positions are not needed)
                T, need = _finish(uk, in_bin, lo, hi, kk, w, CAND, WCAP, UB, BITS, BITS_W, STREAM, NW, ASM)
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
def _row_setup(r, logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table, out, K,
               HAS_STARTS: tl.constexpr, MODE: tl.constexpr):
    """Row r's length, its first score, its output row, its page-table row and its output offset."""
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
    return n, row, out_row, table_row, off_r


@triton.jit
def topk_transform_kernel(
    logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table,
    out, scr, sscr, wscr, R, K,
    HAS_STARTS: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAND: tl.constexpr, NW: tl.constexpr, CAP: tl.constexpr,
    UN: tl.constexpr, WCAP: tl.constexpr, UB: tl.constexpr, LG_S: tl.constexpr, BITS: tl.constexpr,
    BITS_W: tl.constexpr, BITS_S: tl.constexpr, STREAM: tl.constexpr, MJ: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr, ASM: tl.constexpr, FORCE: tl.constexpr, PROFILE: tl.constexpr,
    SAMPLE_STREAM: tl.constexpr, VEC: tl.constexpr,
):
    """Top-K of each row, translated. A persistent program walks rows pid, pid + G, ...

    logits [R, *] f32 (row stride ``stride_l``), lengths [R] i32, row_starts [R] i32 (HAS_STARTS),
    out_offsets [R] i32 (MODE 1), table [R / rows_per_table, *] i32 (MODE 2, row stride stride_t),
    out [R, K] i32, scratch per program: scr [G, 2, CAND] i32 the candidates U (keys, then positions),
    sscr [G, NW, CAP] i64 the warp lists of the compaction (score bits << 32 | position), wscr [G, WCAP]
    i32 the keys of a small bucket W (and, STREAM, first the sample: WCAP >= S). The compaction runs NW
    warp lists (NW = num_warps). STREAM: the radix levels read U / W / the sample from memory, UB at a
    time, instead of holding them in registers (for one-warp programs). MJ: list entries a warp moves a step.
    FORCE (tests only) replaces the threshold guess: 1 = the largest sampled key (too high: fewer
    than K candidates), 2 = none (every key a candidate), 3 = the smallest sampled key (too low).
    PROFILE (benchmarks only) stops early: 1 after the sample, 2 after the compaction, 3 after the
    move, 4 before emit.
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
        n, row, out_row, table_row, off_r = _row_setup(r, logits, stride_l, lengths, row_starts, out_offsets, table,
                                                       stride_t, rows_per_table, out, K, HAS_STARTS, MODE)
        if n <= K:
            _copy_short(out_row, n, K, table_row, off_r, MODE, PAGE_SIZE, BLOCK)
        else:
            # ---- 1. threshold guess from a sample
            t_lo = _sample_threshold(row, n, K, w, CAND, LG_S, BITS_S, FORCE, SAMPLE_STREAM, UB, ASM)
            if PROFILE == 1:
                tl.store(out_row, t_lo)
            else:
                # ---- 2. one pass over the row: scores with key >= t_lo -> the warps' lists
                t_a, t_p, t_b = _bits_bounds(t_lo)
                cw = _compact_seg(row, 0, n, t_a, t_p, t_b, useg, CAP, NW, UN, VEC, ASM)
                c = tl.sum(cw, axis=0)
                # The lists are read by other threads below.
                tl.debug_barrier()
                if PROFILE == 2:
                    tl.store(out_row, c)
                elif (c >= K) & (c <= CAND):
                    # ---- 3. the lists -> U, in position order, as keys
                    umax = _move(useg, cw, c, uk, CAP, CAND, NW, MJ, ASM)
                    tl.debug_barrier()
                    if PROFILE == 3:
                        tl.store(out_row, umax)
                    else:
                        # ---- 4./5. select, emit from U
                        _select_emit(uk, c, t_lo, umax, K, w, out_row, table_row, off_r, CAND, WCAP, UB, BITS, BITS_W,
                                     STREAM, NW, MODE, PAGE_SIZE, ASM, PROFILE)
                else:
                    _fallback(row, n, K, c, t_lo, uk, w, out_row, table_row, off_r, CAND, WCAP, UB, BITS,
                              BITS_W, STREAM, BLOCK, STAGES, MODE, PAGE_SIZE, NW, ASM, PROFILE == 0)


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
    cnt4 = _round4(cnt)[:, None]
    dst = uk + _excl_sum(cnt, CP)[:, None]
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
        _store(dst + o, x, m, ASM)
        _store(dst + CAND + o, p, m, ASM)
        x = xn
        p = pn


@triton.jit
def topk_split_kernel(
    logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table,
    out, scr, sscr, counts, arrive, uscr, wscr, sampscr, R, K,
    HAS_STARTS: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAND: tl.constexpr, NW: tl.constexpr, CAP: tl.constexpr, UN: tl.constexpr, WCAP: tl.constexpr,
    UB: tl.constexpr, LG_S: tl.constexpr, BITS: tl.constexpr, BITS_W: tl.constexpr, BITS_S: tl.constexpr,
    CHUNKS: tl.constexpr, STREAM: tl.constexpr, FINISH_STREAM: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr, RESET: tl.constexpr, MJ: tl.constexpr, ASM: tl.constexpr, FORCE: tl.constexpr,
    PROFILE: tl.constexpr, VEC: tl.constexpr,
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
    there (W: wscr ``[R, WCAP] i32``), or runs the row fallback. STREAM: the sample is selected through
    sampscr ``[R * CHUNKS, S] i32``; FINISH_STREAM: the finisher's levels stream U / W from memory.
    PROFILE (benchmarks): 1 / 2 / 3 stop after the sample / compaction / move (no finisher), 4 before emit.
    """
    r = tl.program_id(0)
    j = tl.program_id(1)
    n, row, out_row, table_row, off_r = _row_setup(r, logits, stride_l, lengths, row_starts, out_offsets, table,
                                                   stride_t, rows_per_table, out, K, HAS_STARTS, MODE)
    if n <= K:
        if j == 0:
            _copy_short(out_row, n, K, table_row, off_r, MODE, PAGE_SIZE, BLOCK)
    else:
        prog = (r * CHUNKS + j).to(tl.int64)
        t_lo = _sample_threshold(row, n, K, sampscr + prog * (1 << LG_S), CAND, LG_S, BITS_S, FORCE, STREAM, UB, ASM)
        if PROFILE == 1:
            tl.store(out_row + j, t_lo)
        else:
            t_a, t_p, t_b = _bits_bounds(t_lo)
            ch = tl.cdiv(tl.cdiv(n, CHUNKS), NW * UN * 128) * (NW * UN * 128)
            # s0 stays a multiple of the tile (aligned loads); an empty chunk has s1 == s0
            s0 = j * ch
            cw = _compact_seg(row, s0, tl.maximum(tl.minimum(s0 + ch, n), s0), t_a, t_p, t_b,
                              sscr + prog * (NW * CAP), CAP, NW, UN, VEC, ASM)
            c_j = tl.sum(cw, axis=0)
            tl.debug_barrier()
            if PROFILE == 2:
                tl.store(out_row + j, c_j)
            else:
                umax = _move(sscr + prog * (NW * CAP), cw, c_j, scr + prog * (2 * CAND), CAP, CAND, NW, MJ, ASM)
                counts_r = counts + r * (2 * CHUNKS)
                tl.store(counts_r + j, c_j)
                tl.store(counts_r + CHUNKS + j, umax)
                if PROFILE == 3:
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
                        umax = tl.full([], _INT_MIN, tl.int32)
                        for jj in tl.static_range(CHUNKS):
                            c += tl.load(counts_r + jj, cache_modifier=".cg")
                            umax = tl.maximum(umax, tl.load(counts_r + CHUNKS + jj, cache_modifier=".cg"))
                        if (c >= K) & (c <= CAND):
                            _gather_chunks(scr + r.to(tl.int64) * (CHUNKS * 2 * CAND), counts_r, uk, CAND, CHUNKS,
                                           UB, ASM)
                            _pad4(uk, c, CAND)
                            tl.debug_barrier()
                            _select_emit(uk, c, t_lo, umax, K, w, out_row, table_row, off_r, CAND, WCAP, UB, BITS,
                                         BITS_W, FINISH_STREAM, NW, MODE, PAGE_SIZE, ASM, PROFILE)
                        else:
                            _fallback(row, n, K, c, t_lo, uk, w, out_row, table_row, off_r, CAND, WCAP, UB, BITS,
                                      BITS_W, FINISH_STREAM, BLOCK, STAGES, MODE, PAGE_SIZE, NW, ASM, PROFILE == 0)


def sizes(K: int, L: int, cand: int | None = None, lg_sample: int | None = None,
          max_lg_sample: int = LG_SAMPLE_MAX) -> tuple[int, int]:
    """(CAND, LG_S): U's capacity and log2 of the sample size for top-K over rows of up to L keys.

    S ~ 128 L / K puts mu = S K / L ~ 128 samples in a full row's top K. The threshold is about the
    m-th largest sample, m = mu + 4 sqrt(mu) + 1 (+ m / 16 of early-stop slack), reached by about
    ``c = m L / S`` keys with a relative spread of 1 / sqrt(m): fewer than K is a 4-sigma event, and U
    holds c plus 5 sigma (a miss either way costs speed, never the answer).
    """
    if lg_sample is None:
        lg_sample = min(max((128 * max(L, 1) // K - 1).bit_length(), LG_SAMPLE_MIN), max_lg_sample)
    if cand is None:
        S = 1 << lg_sample
        mu = S * K / max(L, 1)
        m = min(mu + 4 * math.sqrt(mu) + 1, S)
        c = m * (1 + 1 / 16) * L / S
        cand = max(next_pow2(int(c + 5 * c / math.sqrt(m)) + 1), 256)
    return cand, lg_sample


def launch_config(R: int, L: int, sms: int, kind: str | None = None) -> dict:
    """Launch shapes, chosen on the H200 (triton 3.6; README "Measured").

    Few rows (R <= SMs, L >= 4K, ``kind="split"``): :func:`topk_split_kernel`; a row's sample + compaction
    is spread over ``chunks`` programs of 8 warps (one per 32K of row, at least 2: 64 x 32K 2 chunks 26.8
    against 4 chunks 28.5 us, 64 x 128K 4 chunks 42.1 against 8 chunks 48.7, 2026-11-29 13:40 UTC; 2-warp
    programs x 8 / 16 and 1-warp x 32 were slower), each compacting 4 tiles a warp at once, 128 list
    entries a warp moved a step; the last of them selects (levels in registers up to CAND 4096, streamed
    above: the register form needs 127 registers at CAND 8192) and emits.
    Many rows (``"fused"``): :func:`topk_transform_kernel` on a persistent grid of what fits at once.
    Rows up to 16K: 4-warp programs, 8 an SM, capped at 64 registers (the persistent grid assumes all
    of them resident: uncapped, a few registers more left programs waiting for a whole other one), levels
    on U / W streamed from memory but on the sample (<= 2048 keys) in registers (4096 x 16K 319 -> 310 us,
    4096 x 8K 240 -> 238, 2026-11-29 about 12:40 UTC), 2 tiles a warp compacted at once (4: 218.7 against
    215.6 us at 4096 x 8K), 128 list entries a warp moved to U a step (1 / 2 warps, 8 warps in registers
    were slower). Longer rows: 8 warps capped at 64 registers, 4 an SM, levels in registers, 4 tiles a
    warp at once (4096 x 32K 428 against 457 us with 2; streamed with 1 / 2 / 4 warps was slower).
    """
    if kind is None:
        kind = "split" if R <= sms and L >= 4096 else "fused"
    if kind == "split":
        chunks = max(2, min(16, L // 32768, prev_pow2(4 * sms // max(R, 1))))
        return dict(kind=kind, chunks=chunks, num_warps=8, maxnreg=0, unroll=4, stream=False, finish_stream=None,
                    move_step=128, max_lg_sample=11)
    if L <= 16384:
        return dict(kind=kind, num_warps=4, maxnreg=64, grid=min(R, 8 * sms), unroll=2, stream=True, move_step=128,
                    sample_stream=False, max_lg_sample=11)
    return dict(kind=kind, num_warps=8, maxnreg=64, grid=min(R, 4 * sms), unroll=4, stream=False, move_step=64,
                max_lg_sample=11)


def _whole_chunks(logits: torch.Tensor, row_starts) -> bool:
    """Whether every row is made of whole 16-byte chunks (aligned start, length a multiple of 4), so the
    compaction may read a row to its length rounded up to 4 with 128-bit loads (the kernels' VEC)."""
    return (row_starts is None and logits.shape[1] % 4 == 0 and logits.stride(0) % 4 == 0
            and logits.stride(1) == 1 and logits.data_ptr() % 16 == 0)


def _ub(num_warps: int) -> int:
    """Slots a step of the streaming loops over U / W / the sample handles: 4 a thread (128-bit loads)."""
    return 128 * num_warps


def _seg_cap(cand: int, nw: int, un: int, length: int) -> int:
    """Entries a warp list may need: its segment of a ``length``-key span, at most CAND (more: fallback)."""
    tile = un * 128
    return min(cand, cdiv(cdiv(length, nw), tile) * tile)


# Split mode's arrival counters, one buffer per (device, stream). The finisher of each row sets its counter
# back to zero, so every call leaves the buffer all zero and the next call needs no memset (a memset node
# cost ~1.1 us of the 31.6 us of 64 x 32K). Calls on one stream run one after another; calls on two
# streams get two buffers, so concurrent calls never share a counter. (Graph replays reuse the counters
# of their capture stream, like they reuse their scratch: the same rule as a graph memory pool shared by
# several graphs, which must not be replayed concurrently either. A first call on a stream inside a
# capture allocates the buffer there: its zeroing is captured and replayed, correct if slower.)
_ARRIVE: dict = {}


def _arrive_counters(dev: torch.device, R: int, cached: bool) -> torch.Tensor:
    """Split mode's per-row arrival counters ``[>= R] int32``, zero at launch: cached per device and stream
    (``cached``), else fresh zeros."""
    if not cached:
        return torch.zeros(R, dtype=torch.int32, device=dev)
    key = (dev, torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0)
    buf = _ARRIVE.get(key)
    if buf is None or buf.numel() < R:
        buf = _ARRIVE[key] = torch.zeros(max(R, 1024), dtype=torch.int32, device=dev)
    return buf


def topk_transform(logits, lengths, topk, page_table, row_starts, out_offsets, page_size, *,
                   out=None, kind=None, cand=None, wcap=None, lg_sample=None, bits=None, bits_w=None, bits_s=None,
                   block=None, grid=None, num_warps=None, stages=None, maxnreg=None, chunks=None, unroll=None,
                   stream=None, finish_stream=None, move_step=None, cached_counters=True, force=0, profile=0,
                   sample_stream=None, vec=None):
    """Launcher; arguments as in :func:`flashdsa.ops.topk.topk_transform` (already validated).

    Keyword knobs are for tests and tuning (small buffers reach every path on small rows):
    ``out`` [R, topk] int32 to write into, ``kind`` the kernel (``"split"`` or ``"fused"``; ``chunks`` > 1
    implies split, ``chunks=1`` fused), ``cand`` U capacity, ``wcap`` W capacity,
    ``lg_sample`` log2 sample size, ``bits`` / ``bits_w`` / ``bits_s`` digit widths on U / on W / on the
    sample, ``block`` streaming step of the row fallback, ``grid`` programs, ``num_warps``,
    ``stages`` (software-pipeline depth of the fallback's streaming loops), ``maxnreg`` (register cap, 0 =
    none), ``chunks`` (split mode: programs per row), ``unroll`` ([NW, 128] tiles a warp loads at once
    in the compaction), ``stream`` (radix levels read from memory instead of registers) and
    ``finish_stream`` (the same for split mode's select; default: when CAND > 4096), ``sample_stream``
    (many-rows kernel with ``stream``: False selects the sample in registers), ``move_step`` (list
    entries a warp moves to U a step), ``cached_counters`` (split mode: the arrival counters kept per
    device and stream and reset by the kernel; False: zeroed each call), ``force`` (threshold guess
    replaced by 1: the largest sampled key, 2: none, 3: the smallest sampled key), ``profile``
    (benchmarks: stop after stage 1 / 2 / 3 / 4, output garbage), ``vec`` (128-bit row loads reading to
    the length rounded up to 4; default: when every row is whole 16-byte chunks).
    """
    R, L = logits.shape
    dev = logits.device
    K = int(topk)
    if out is None:
        out = torch.empty((R, K), dtype=torch.int32, device=dev)
    if R == 0:
        return out
    sms = num_sms(dev)
    if kind is None and chunks is not None:
        kind = "split" if chunks > 1 else "fused"
    cfg = launch_config(R, L, sms, kind)
    kind = cfg["kind"]
    pick = lambda v, key: cfg.get(key) if v is None else v  # noqa: E731
    num_warps, maxnreg = pick(num_warps, "num_warps"), pick(maxnreg, "maxnreg")
    block = block or 128 * num_warps
    stages = stages or 1
    assert block <= 16384 and block & (block - 1) == 0, "emit packs two block counts in one int32"
    bits = DEFAULT_BITS if bits is None else bits
    bits_w = DEFAULT_BITS_W if bits_w is None else bits_w
    bits_s = DEFAULT_BITS_S if bits_s is None else bits_s
    mode = 2 if page_table is not None else 1 if out_offsets is not None else 0
    table = page_table if page_table is not None else lengths
    rows_per_table = R // page_table.shape[0] if page_table is not None else 1
    starts = row_starts if row_starts is not None else lengths
    interp = interpreting()
    regs = {"maxnreg": maxnreg} if maxnreg and not interp else {}
    translate = (out_offsets if out_offsets is not None else lengths, table,
                 table.stride(0) if page_table is not None else 0, rows_per_table)
    un = pick(unroll, "unroll")
    stream = pick(stream, "stream")
    cand, lg_s = sizes(K, L, cand, lg_sample, cfg["max_lg_sample"])
    assert lg_s >= 3, "the sample comes in runs of 8"
    assert cand <= 16384 and cand & (cand - 1) == 0, "emit packs two candidate counts in one int32"
    wcap = min(WCAP, cand) if wcap is None else wcap
    assert wcap % 4 == 0, "W is read 4 keys a thread, padded to a multiple of 4"
    common = dict(HAS_STARTS=row_starts is not None, MODE=mode, PAGE_SIZE=page_size, CAND=cand, NW=num_warps,
                  UN=un, UB=_ub(num_warps), LG_S=lg_s, BITS=bits, BITS_W=bits_w, BITS_S=bits_s, STREAM=stream,
                  MJ=pick(move_step, "move_step"), BLOCK=block, STAGES=stages, ASM=not interp, FORCE=force,
                  PROFILE=profile, VEC=_whole_chunks(logits, row_starts) if vec is None else vec)
    finish_stream = cand > 4096 if pick(finish_stream, "finish_stream") is None else finish_stream
    if kind == "split":
        # scratch per row, not per program
        chunks = pick(chunks, "chunks")
        span = cdiv(L, chunks)
        cap = _seg_cap(cand, num_warps, un, span + num_warps * un * 128)
        scr = torch.empty(R * chunks * 2 * cand, dtype=torch.int32, device=dev)
        sscr = torch.empty(R * chunks * num_warps * cap, dtype=torch.int64, device=dev)
        counts = torch.empty(R * 2 * chunks, dtype=torch.int32, device=dev)
        arrive = _arrive_counters(dev, R, cached_counters)
        uscr = torch.empty(R * 2 * cand, dtype=torch.int32, device=dev)
        wscr = torch.empty(R * wcap, dtype=torch.int32, device=dev)
        samp = torch.empty(R * chunks << lg_s, dtype=torch.int32, device=dev) if stream else lengths
        topk_split_kernel[(R, chunks)](
            logits, logits.stride(0), lengths, starts, *translate, out, scr, sscr, counts, arrive, uscr, wscr, samp,
            R, K, CAP=cap, WCAP=wcap, CHUNKS=chunks, FINISH_STREAM=finish_stream,
            RESET=cached_counters, **common, num_warps=num_warps, **regs)
        return out
    cap = _seg_cap(cand, num_warps, un, L)
    # W doubles as the sample's buffer when the levels stream
    wlen = max(wcap, 1 << lg_s) if stream else wcap
    if grid is None:
        per_sm = max(1, cfg["grid"] // sms) if num_warps == cfg["num_warps"] else max(1, 32 // num_warps)
        grid = min(R, per_sm * sms)
    grid = min(grid, max(1, SCRATCH_BUDGET // (8 * cand + 8 * num_warps * cap + 4 * wlen)))
    scr = torch.empty(grid * 2 * cand, dtype=torch.int32, device=dev)
    sscr = torch.empty(grid * num_warps * cap, dtype=torch.int64, device=dev)
    wscr = torch.empty(grid * wlen, dtype=torch.int32, device=dev)
    topk_transform_kernel[(grid,)](
        logits, logits.stride(0), lengths, starts, *translate, out, scr, sscr, wscr, R, K,
        CAP=cap, WCAP=wlen, SAMPLE_STREAM=stream and pick(sample_stream, "sample_stream") is not False, **common,
        num_warps=num_warps, **regs)
    return out
