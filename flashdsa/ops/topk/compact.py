"""Position-ordered compaction with warp-local prefix sums: steps 2, 3 and 5 of the top-k kernels, and the
copy of a small bucket to W (design: README.md "Five steps").

Every pass splits its range into NW contiguous spans, one a warp, and walks them in ``[NW, 128]`` tiles
(4 scores a lane: 128-bit loads): a warp's prefix sums and counts never leave the warp, and the order
across warps comes from one exclusive sum over the NW warp totals, so no pass has a block-wide scan.
Loads of the next tile are issued before this tile's stores (the asm stores have side effects: a load
after them waits for them).

- :func:`compact_seg` (step 2): scores whose key reaches the threshold -> each warp's own list;
  :func:`compact_seg_ties`, the same for rows of mostly one value, keeping a warp's first k equal ones;
- :func:`move` (step 3): the warp lists -> U in position order, scores -> keys on the way;
  :func:`move_capped`, the same for lists holding more than U when most of them tie with the threshold
  (only the first equal ones can be selected);
- :func:`copy_range`: the keys of U in a bucket -> W;
- :func:`emit_u` (step 5): the selected keys' positions, translated, -> the output row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdsa.ops.topk.common import (INT_MAX, INT_MIN, bits_bounds, bits_key, excl_sum, pad4, round4, store, store2,
                                      translate)


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
    store2(dst + slot, p, b, f & (slot < CAP), ASM)
    return cw + tl.sum(fi, axis=1)


@triton.jit
def _segments(s0, s1, useg, CAP: tl.constexpr, NW: tl.constexpr, UN: tl.constexpr):
    """The compaction's split of ``[s0, s1)``: ``seg`` (a multiple of UN tiles of 128) positions a warp, the
    positions of each warp's first tile ``start [NW, 128]`` and its list ``dst`` (``useg[w * CAP:]``)."""
    w = tl.arange(0, NW)
    seg = tl.cdiv(tl.cdiv(s1 - s0, NW), UN * 128) * (UN * 128)
    start = (s0 + w * seg)[:, None] + tl.arange(0, 128)[None, :]
    return seg, start, useg + (w.to(tl.int64) * CAP)[:, None]


@triton.jit
def compact_seg(row, s0, s1, t_a, t_p, t_b, useg, CAP: tl.constexpr, NW: tl.constexpr, UN: tl.constexpr,
                VEC: tl.constexpr, ASM: tl.constexpr):
    """Positions ``[s0, s1)`` of the row split into NW contiguous segments, one a warp: warp w appends
    ``bits << 32 | position`` of every score passing ``(t_a <= b <= t_p) | (b < t_b)`` to its own list
    ``useg[w * CAP:]`` (at most CAP stored), in position order, with warp-local prefix sums (no
    barrier). A warp issues the loads of UN tiles of 128 scores before it works on the first of them
    (the list stores are inline asm with side effects: loads after them in program order wait for
    them). Returns the uncapped counts ``[NW]``. s0 is a multiple of 4 (128-bit loads)."""
    seg, start, dst = _segments(s0, s1, useg, CAP, NW, UN)
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
def _pass_tile_ties(b, p, s1, t_lo, K, dst, cw, ew, CAP: tl.constexpr, ASM: tl.constexpr):
    """:func:`_pass_tile` keeping at most K keys equal to ``t_lo`` a warp: warp w appends the scores with key
    ``> t_lo``, and those ``== t_lo`` while fewer than K of them came before in its segment (``ew[w]``
    so far). Returns the new counts of stored and of equal keys."""
    key = bits_key(b)
    f = (p < s1) & (key >= t_lo)
    eq = (f & (key == t_lo)).to(tl.int32)
    keep = f & ((eq == 0) | (ew[:, None] + tl.cumsum(eq, axis=1) <= K))
    ki = keep.to(tl.int32)
    slot = cw[:, None] + tl.cumsum(ki, axis=1) - 1
    store2(dst + slot, p, b, keep & (slot < CAP), ASM)
    return cw + tl.sum(ki, axis=1), ew + tl.sum(eq, axis=1)


@triton.jit
def ties_fill_warps(s_eq, span, K, NW: tl.constexpr, LG_S: tl.constexpr):
    """Whether the sample (``s_eq`` of its ``2^LG_S`` keys equal to the guess) predicts more than K keys equal
    to the guess in a warp's segment of a ``span``-key range: then :func:`compact_seg_ties` stores fewer."""
    s = s_eq.to(tl.int64)
    return s * tl.cdiv(span, NW) > (s * 0 + K) * (1 << LG_S)


@triton.jit
def compact_guess(row, s0, s1, t_lo, s_eq, span, K, useg, prog, CAP: tl.constexpr, NW: tl.constexpr,
                  UN: tl.constexpr, VEC: tl.constexpr, ASM: tl.constexpr, LG_S: tl.constexpr, TIES: tl.constexpr):
    """Step 2 on keys ``[s0, s1)`` of a row, each warp's keys ``>= t_lo`` to its list: :func:`compact_seg_ties`
    where the sample predicts more than K keys equal to the guess in a warp's segment of the ``span``-key
    range (TIES compiles that test in), else :func:`compact_seg`. The lists: program ``prog``'s ``[NW, CAP]`` of
    ``useg`` (its address worked out in each branch, as the kernels had it inline: the same sm_90 code).
    Returns ``[NW]`` the lists' lengths."""
    ties = False
    if TIES:
        ties = ties_fill_warps(s_eq, span, K, NW, LG_S)
    if ties:
        # mostly one value: a warp keeps its first K keys equal to t_lo
        cw = compact_seg_ties(row, s0, s1, t_lo, K, useg + prog * (NW * CAP), CAP, NW, UN, VEC, ASM)
    else:
        t_a, t_p, t_b = bits_bounds(t_lo)
        cw = compact_seg(row, s0, s1, t_a, t_p, t_b, useg + prog * (NW * CAP), CAP, NW, UN, VEC, ASM)
    return cw


@triton.jit
def compact_seg_ties(row, s0, s1, t_lo, K, useg, CAP: tl.constexpr, NW: tl.constexpr, UN: tl.constexpr,
                     VEC: tl.constexpr, ASM: tl.constexpr):
    """:func:`compact_seg` (the same segments) for rows where most keys equal the guess ``t_lo``: a warp
    stores every key ``> t_lo`` but only the first K keys ``== t_lo`` of its segment. Exact: the selection
    takes every key above the k-th largest T and the first ``K - #(key > T)`` keys equal to T in position
    order, so when T == t_lo a selected equal key has fewer than K equal keys before it in the row, the
    more so in its warp's segment (and when T > t_lo no equal key is selected). The lists stay in
    position order and hold at least K keys whenever the row has K keys ``>= t_lo``, so every later step
    runs on them as on :func:`compact_seg`'s. One tile a step, the next one loaded ahead of the stores.
    Returns the counts stored (uncapped by CAP) ``[NW]``."""
    seg, start, dst = _segments(s0, s1, useg, CAP, NW, UN)
    cw = tl.zeros([NW], dtype=tl.int32)
    ew = tl.zeros([NW], dtype=tl.int32)
    b = _load_tile(row, start, s1, VEC)
    for it in tl.range(0, seg, 128, num_stages=1):
        p = start + it
        # the next tile of this warp's segment (none past it: that is the next warp's)
        b_next = _load_tile(row, p + 128, tl.where(it + 128 < seg, s1, 0), VEC)
        cw, ew = _pass_tile_ties(b, p, s1, t_lo, K, dst, cw, ew, CAP, ASM)
        b = b_next
    return cw


@triton.jit
def move(useg, cw, c, uk, CAP: tl.constexpr, CAND: tl.constexpr, NW: tl.constexpr, MJ: tl.constexpr,
         ASM: tl.constexpr):
    """The warp lists (``cw [NW]`` entries each, ``c`` in all) -> U in position order, MJ entries of each a
    step: keys to ``uk[:CAND]``, positions to ``uk[CAND:2 CAND]`` (at most CAND), then U padded to a
    multiple of 4.
    The next step's entries are loaded before this step's stores (which the loads would otherwise wait
    for), two a 128-bit load (the mask runs to the count rounded up to 2: entries inside the list).
    Returns the largest key moved."""
    w = tl.arange(0, NW)
    j = tl.arange(0, MJ)[None, :]
    base = excl_sum(cw, NW)[:, None]
    top = tl.max(tl.minimum(cw, CAP), axis=0)
    cnt = tl.minimum(cw, CAP)[:, None]
    cnt2 = (cnt + 1) // 2 * 2
    src = useg + (w.to(tl.int64) * CAP)[:, None]
    vmax = tl.full([NW, MJ], INT_MIN, tl.int32)
    # [NW, MJ] bits << 32 | position
    v = tl.load(src + j, mask=j < cnt2, other=0)
    for it in tl.range(0, top, MJ, num_stages=1):
        jj = it + j
        vn = tl.load(src + jj + MJ, mask=jj + MJ < cnt2, other=0)
        m = (jj < cnt) & (base + jj < CAND)
        key = bits_key((v >> 32).to(tl.int32))
        vmax = tl.maximum(vmax, tl.where(m, key, INT_MIN))
        store(uk + base + jj, key, m, ASM)
        store(uk + CAND + base + jj, (v & 0xFFFFFFFF).to(tl.int32), m, ASM)
        v = vn
    pad4(uk, tl.minimum(c, CAND), CAND)
    return tl.max(tl.max(vmax, axis=1), axis=0)


@triton.jit
def tie_cap(gt, eq, cap, n_parts: tl.constexpr):
    """Per part (warp list or chunk, in position order) with ``gt [n_parts]`` keys above the threshold and
    ``eq`` equal to it, when only the first ``cap`` equal keys of all parts (position order) are wanted:
    ``(eq_base, base, kept)``, the equal keys before each part, the kept keys before each part, and the
    kept keys in all."""
    eq_base = excl_sum(eq, n_parts)
    keep = gt + tl.minimum(tl.maximum(cap - eq_base, 0), eq)
    return eq_base, excl_sum(keep, n_parts), tl.sum(keep, axis=0)


@triton.jit
def scan_keep(key, valid, t, cap, eq_before):
    """One tile ``[P, J]`` of keys >= t (``valid``), each row a part in position order, ``eq_before [P, 1]``
    equal keys before the tile in position order: which keys are kept (above t, or among the first ``cap``
    equal to t), the exclusive count of kept keys before each in its row, and the row totals of kept and
    equal keys (two scans along the rows: the kept depend on the equal ones' ranks)."""
    eq = valid & (key == t)
    ex_eq = tl.cumsum(eq.to(tl.int32), axis=1) - eq.to(tl.int32)
    keep = valid & ((key != t) | (eq_before + ex_eq < cap))
    ki = keep.to(tl.int32)
    return keep, tl.cumsum(ki, axis=1) - ki, tl.sum(ki, axis=1), tl.sum(eq.to(tl.int32), axis=1)


@triton.jit
def move_capped(useg, cw, c, t_lo, K, uk, CAP: tl.constexpr, CAND: tl.constexpr, NW: tl.constexpr,
                MJ: tl.constexpr, ASM: tl.constexpr):
    """:func:`move` for lists holding more than U does (``c > CAND``; none overflowed: every ``cw <= CAP``)
    because many keys equal ``t_lo``: only the first ``K - #(key > t_lo)`` of those in position order can
    be selected (every key above t_lo is, and the k-th largest is t_lo or above), so U gets every key
    ``> t_lo`` and those first equal ones, in position order. A first pass counts each list's equal keys;
    the second moves, a scan along each list ranking the equal keys.
    Returns ``(kept, umax)``: the keys kept (U holds them when ``kept <= CAND``; above that nothing past
    CAND is stored and the caller falls back) and the largest key kept."""
    w = tl.arange(0, NW)
    j = tl.arange(0, MJ)[None, :]
    cnt = cw[:, None]
    src = useg + (w.to(tl.int64) * CAP)[:, None]
    top = tl.max(cw, axis=0)
    # ---- pass 1: equal keys per list
    acc = tl.zeros([NW, MJ], dtype=tl.int32)
    for it in tl.range(0, top, MJ, num_stages=1):
        jj = it + j
        v = tl.load(src + jj, mask=jj < cnt, other=0)
        acc += ((jj < cnt) & (bits_key((v >> 32).to(tl.int32)) == t_lo)).to(tl.int32)
    eq = tl.sum(acc, axis=1)
    cap = tl.maximum(K - (c - tl.sum(eq, axis=0)), 0)
    eq_base, base, kept = tie_cap(cw - eq, eq, cap, NW)
    # ---- pass 2: move what is kept
    eq_before = eq_base[:, None]
    at = base[:, None]
    vmax = tl.full([NW, MJ], INT_MIN, tl.int32)
    for it in tl.range(0, top, MJ, num_stages=1):
        jj = it + j
        v = tl.load(src + jj, mask=jj < cnt, other=0)
        key = bits_key((v >> 32).to(tl.int32))
        keep, ex, n_keep, n_eq = scan_keep(key, jj < cnt, t_lo, cap, eq_before)
        slot = at + ex
        m = keep & (slot < CAND)
        vmax = tl.maximum(vmax, tl.where(keep, key, INT_MIN))
        store(uk + slot, key, m, ASM)
        store(uk + CAND + slot, (v & 0xFFFFFFFF).to(tl.int32), m, ASM)
        at += n_keep[:, None]
        eq_before += n_eq[:, None]
    pad4(uk, tl.minimum(kept, CAND), CAND)
    return kept, tl.max(tl.max(vmax, axis=1), axis=0)


@triton.jit
def _warp_spans(c, NW: tl.constexpr):
    """Warp w's span of ``[0, c)`` (c padded to c4, a multiple of 4): ``start [NW, 128]``, the positions of its
    first tile, and ``span``, a multiple of 128, the same for every warp."""
    c4 = round4(c)
    span = tl.cdiv(tl.cdiv(c4, NW), 128) * 128
    start = (tl.arange(0, NW) * span)[:, None] + tl.arange(0, 128)[None, :]
    return start, span, c4


@triton.jit
def _span_counts(src, start, span, c4, a1, b1, a2, b2, NW: tl.constexpr):
    """Per warp ``[NW]``: how many keys of its span (``src``, INT_MIN past c4) lie in ``[a1, b1]``, plus how many
    lie in ``[a2, b2]`` shifted left by 16 (each below 2^15). The next tile is loaded a step ahead."""
    acc = tl.zeros([NW, 128], dtype=tl.int32)
    # [NW, 128] keys
    x = tl.load(src + start, mask=start < c4, other=INT_MIN)
    for it in tl.range(0, span, 128, num_stages=1):
        nxt = start + it + 128
        xn = tl.load(src + nxt, mask=nxt < c4, other=INT_MIN)
        acc += ((x >= a1) & (x <= b1)).to(tl.int32) + (((x >= a2) & (x <= b2)).to(tl.int32) << 16)
        x = xn
    return tl.sum(acc, axis=1)


@triton.jit
def emit_u(uk, c, T, need, out_row, table_row, off_r, CAND: tl.constexpr, NW: tl.constexpr, MODE: tl.constexpr,
           PAGE_SIZE: tl.constexpr, ASM: tl.constexpr):
    """Write, in U order, the positions (``uk[CAND:]``) of every key (``uk[:c]``, padded to a multiple of 4)
    ``> T`` and of the first ``need`` keys ``== T``, translated.

    Warp w owns a contiguous span of U and walks it in ``[NW, 128]`` tiles, so every scan and sum stays
    inside a warp (a block-wide scan costs two barriers a block): a first pass counts each warp's keys
    ``> T`` and ``== T``, one exclusive sum over the NW totals gives each warp its output offsets, a
    second pass scans and stores. Each pass loads the next tile before working on this one."""
    start, span, c4 = _warp_spans(c, NW)
    # ---- pass 1: per-warp counts, > T in the low 16 bits, == T in the high (CAND < 2^15)
    tot = _span_counts(uk, start, span, c4, T + 1, INT_MAX, T, T, NW)
    gt_base = excl_sum(tot & 0xFFFF, NW)
    eq_base = excl_sum(tot >> 16, NW)
    # ---- pass 2: warp-local scans, translated stores
    x = tl.load(uk + start, mask=start < c4, other=INT_MIN)
    pos = tl.load(uk + CAND + start, mask=start < c4, other=0)
    for it in tl.range(0, span, 128, num_stages=1):
        nxt = start + it + 128
        xn = tl.load(uk + nxt, mask=nxt < c4, other=INT_MIN)
        pn = tl.load(uk + CAND + nxt, mask=nxt < c4, other=0)
        gt = (x > T).to(tl.int32)
        eq = (x == T).to(tl.int32)
        v = gt + (eq << 16)
        ex = tl.cumsum(v, axis=1) - v
        gt_ex = gt_base[:, None] + (ex & 0xFFFF)
        eq_ex = eq_base[:, None] + (ex >> 16)
        sel = (gt != 0) | ((eq != 0) & (eq_ex < need))
        slot = gt_ex + tl.minimum(eq_ex, need)
        store(out_row + slot, translate(pos, sel, table_row, off_r, MODE, PAGE_SIZE), sel, ASM)
        t = tl.sum(v, axis=1)
        gt_base += t & 0xFFFF
        eq_base += t >> 16
        x = xn
        pos = pn


@triton.jit
def copy_range(src, c, lo, hi, dst, NW: tl.constexpr, ASM: tl.constexpr):
    """The keys of ``src[:c]`` (padded with INT_MIN to a multiple of 4) that lie in ``[lo, hi]`` -> ``dst``, in
    order. Warp spans and two passes as in :func:`emit_u`: counts, one exclusive sum over the warps,
    then warp-local scans and stores (no block-wide scan)."""
    start, span, c4 = _warp_spans(c, NW)
    # empty slots (INT_MIN) are never in range; the second range is empty
    base = excl_sum(_span_counts(src, start, span, c4, lo, hi, 1, 0, NW), NW)
    x = tl.load(src + start, mask=start < c4, other=INT_MIN)
    for it in tl.range(0, span, 128, num_stages=1):
        nxt = start + it + 128
        xn = tl.load(src + nxt, mask=nxt < c4, other=INT_MIN)
        f = (x >= lo) & (x <= hi)
        fi = f.to(tl.int32)
        store(dst + base[:, None] + tl.cumsum(fi, axis=1) - 1, x, f, ASM)
        base += tl.sum(fi, axis=1)
        x = xn


