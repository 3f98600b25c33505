"""Device code every step of both top-k kernels uses (design: README.md).

- The score order as int32 keys: :func:`order_key` / :func:`bits_key` map a float32 (its bits) to an int32
  whose signed order is the op's order (NaN = -inf, -0.0 = +0.0), and :func:`bits_bounds` turns a key
  threshold into three compares on raw bits, so the streaming pass never builds a key.
- Scattered predicated stores (:func:`store`, :func:`store2`: one PTX store, no layout conversion).
- Padding of U / W to a multiple of 4 (:func:`round4`, :func:`pad4`: every load of them is 128-bit), the
  exclusive sum over a program's warps (:func:`excl_sum`), the position -> slot translation
  (:func:`translate`), a row's pointers (:func:`row_setup`), the value checks of a row's metadata
  (:func:`row_check`) and the copy of a row with at most k keys (:func:`copy_short`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdsa.ops._device_checks import check_pages, flag_word

# Keys are int32 whose signed order is the score order: key(-inf) == key(NaN) is the smallest.
INT_MIN = tl.constexpr(-2147483648)
INT_MAX = tl.constexpr(2147483647)
KEY_MIN = tl.constexpr(-2139095041)       # key of -inf (0xFF800000) and of every NaN
KEY_MAX = tl.constexpr(2139095040)        # key of +inf (0x7F800000)
_POS_INF_BITS = tl.constexpr(2139095040)  # 0x7F800000
_NEG_INF_BITS = tl.constexpr(-8388608)    # 0xFF800000 as int32
MAX_LEVELS = tl.constexpr(40)             # > 32 bits / 1 bit per level: a hang guard, never reached


@triton.jit
def order_key(x):
    """``float32 -> int32`` with the same order (NaN -> -inf, -0.0 -> +0.0)."""
    return bits_key(x.to(tl.int32, bitcast=True))


@triton.jit
def bits_key(b):
    """The key of the float32 whose bits are ``b`` (int32)."""
    b = tl.where(b == INT_MIN, 0, b)
    b = tl.where((b & 0x7FFFFFFF) > _POS_INF_BITS, _NEG_INF_BITS, b)
    # Negative floats order backwards as integers: flip their magnitude bits.
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def bits_bounds(t):
    """``(t_a, t_p, t_b)`` with ``key(b) >= t  <=>  (t_a <= b <= t_p) | (b < t_b)`` for float bits ``b``.

    Non-negative floats (b >= 0) pass when ``max(t, 0) <= b <= bits(+inf)`` (positive NaNs fail);
    negative floats order backwards, and -0.0 (b = INT_MIN, key 0) is first: they pass when
    ``b < INT_MIN - min(t, -1)`` (none when t > 0). ``t <= key(-inf)``: everything passes, NaNs too."""
    every = t <= KEY_MIN
    t_a = tl.where(every, INT_MIN, tl.maximum(t, 0))
    t_p = tl.where(every, INT_MAX, _POS_INF_BITS)
    t_b = tl.where(t > 0, INT_MIN, INT_MIN - tl.minimum(t, -1))
    return t_a, t_p, t_b



@triton.jit
def store(ptr, val, pred, ASM: tl.constexpr):
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
def store2(ptr, lo, hi, pred, ASM: tl.constexpr):
    """``ptr[i] = hi << 32 | lo`` (int64 pointer, int32 halves) where ``pred``: one 8-byte store, no 64-bit
    value built."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $4, 0; @p st.global.v2.b32 [$1], {$2, $3}; mov.b32 $0, 0; }",
            "=r,l,r,r,r", [ptr, lo, hi, pred.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF), mask=pred)


@triton.jit
def translate(p, m, table_row, off_r, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Row-relative position -> what the attention reads (MODE 0 plain, 1 offset, 2 page table)."""
    if MODE == 2:
        page = tl.load(table_row + p // PAGE_SIZE, mask=m, other=0)
        return page * PAGE_SIZE + p % PAGE_SIZE
    elif MODE == 1:
        return p + off_r
    else:
        return p


@triton.jit
def excl_sum(v, NW: tl.constexpr):
    """Exclusive prefix sums of the NW per-warp values ``v [NW]``, without a scan over a tiny tensor."""
    iw = tl.arange(0, NW)
    return tl.sum(tl.where(iw[None, :] < iw[:, None], v[None, :], 0), axis=1)


@triton.jit
def round4(c):
    """c rounded up to a multiple of 4: a bound the compiler knows to be one, so masked loads of 4 adjacent
    int32 a thread stay 128-bit loads (U / W are padded up to it with INT_MIN: :func:`pad4`)."""
    return (c + 3) // 4 * 4


@triton.jit
def pad4(keys, c, CAP: tl.constexpr):
    """``keys[c : round4(c)] = INT_MIN`` (below every key; CAP a multiple of 4), so loads of U / W may run to
    the rounded count."""
    i = c + tl.arange(0, 4)
    tl.store(keys + i, tl.full([4], INT_MIN, tl.int32), mask=(i < round4(c)) & (i < CAP))


@triton.jit
def copy_short(out_row, n, K, table_row, off_r, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
               BLOCK: tl.constexpr):
    """A row with ``n <= K`` keys: every position is selected, then -1 padding."""
    for start in range(0, K, BLOCK):
        p = start + tl.arange(0, BLOCK)
        v = p < n
        val = translate(p, v, table_row, off_r, MODE, PAGE_SIZE)
        tl.store(out_row + p, tl.where(v, val, -1), mask=p < K)


@triton.jit
def row_setup(r, logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table, out, K, L, maxp,
              last_page, flag, code0, CHECK: tl.constexpr, HAS_STARTS: tl.constexpr, MODE: tl.constexpr,
              PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr):
    """Row r's length, its first score, its output row, its page-table row and its output offset; CHECK (the
    default mode's device value checks): the length is 0 when the row's metadata is bad (:func:`row_check`)."""
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
    if CHECK:
        n = row_check(n, r, row_starts, out_offsets, table_row, L, maxp, last_page, flag, code0, HAS_STARTS, MODE,
                      PAGE_SIZE, BLOCK_P)
    return n, row, out_row, table_row, off_r


@triton.jit
def _first_bad(flag, bad, cond, value, code):
    """``bad | cond``; where the row had no bad value yet, ``cond`` stores its error (``value``, word of
    ``code``): the host check reports a row's first bad value."""
    b = cond & (bad == 0)
    flag_word(flag, b, value, code)
    return bad | b


@triton.jit
def row_check(n, r, row_starts, out_offsets, table_row, L, maxp, last_page, flag, code0,
              HAS_STARTS: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr):
    """The device value checks of row r (default mode, ``CHECK``): ``n`` if its metadata is good, else 0
    (the row then reads no score and selects nothing) with the error stored in ``flag``.

    Checked as the host does, in its order (the first bad value of a row is the one reported): lengths in
    [0, L]; row_starts in [0, L] and row_starts + lengths <= L; out_offsets >= 0 and
    out_offsets + lengths - 1 <= 2^31 - 1; the pages the row needs <= maxp, their ids in [0, last_page].
    Error words: ``code0 + i`` in the order of ``_device_checks.TOPK_CHECKS``. Every program of a row
    (split mode: each chunk) makes the same decision, from the same values."""
    bad = n < 0
    flag_word(flag, bad, n, code0)
    bad = _first_bad(flag, bad, n > L, n, code0 + 1)
    if HAS_STARTS:
        st = tl.load(row_starts + r)
        bad = _first_bad(flag, bad, st < 0, st, code0 + 2)
        bad = _first_bad(flag, bad, st > L, st, code0 + 3)
        end = st.to(tl.int64) + n
        bad = _first_bad(flag, bad, end > L, end, code0 + 4)
    if MODE == 1:
        off = tl.load(out_offsets + r)
        bad = _first_bad(flag, bad, off < 0, off, code0 + 5)
        last = off.to(tl.int64) + n - 1
        bad = _first_bad(flag, bad, last > 2147483647, last, code0 + 6)
    if MODE == 2:
        need = tl.where(bad, 0, tl.cdiv(n, PAGE_SIZE))
        bad = _first_bad(flag, bad, need > maxp, need, code0 + 7)
        need = tl.where(bad, 0, need)
        bad = bad | (check_pages(flag, table_row, need, last_page, code0 + 8, BLOCK_P) > 0)
    return tl.where(bad, 0, n)
