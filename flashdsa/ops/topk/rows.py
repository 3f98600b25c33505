"""The row-in-registers top-k kernel (``TopkConfig(kind="rows")``): one program a row of at most 16K scores,
the whole row held as keys in registers, radix levels of 2^BITS buckets (2048 by default) counted with
shared-memory atomics (design: README.md "Rows in registers").

Why: at the decode shapes (64 rows of 8K-16K) the sample -> compaction -> move -> select chain of the other
two kernels pays a dozen block-wide barriers and global round trips a row; with the row in registers there is
no candidate list at all, and with 2048-bucket levels a row of random scores is resolved in two levels (the
first narrows the range to one bucket's min / max, the second to one key). ``tl.histogram`` lowers to
ballots, one a digit bit and then a pass per bucket, so wide digits are dear there; a shared-memory atomic
costs one instruction a key whatever the width. Triton has no shared-memory atomics and does not hand out
shared addresses, so the two histogram buffers are declared and used in inline PTX (``shared_hist.py``); the
levels are ``radix.select_levels`` with its SHARED switch. In the interpreter (no inline PTX) the same digits
are counted by ``tl.histogram``: the same counts, so the same answer.

Exact and deterministic as the other kernels: counts are sums (their order does not matter), the answer is
``T`` (the k-th largest key) and ``need`` (how many keys equal to T, first positions first), and the emit
ranks the selected keys by one scan in position order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdsa.ops.topk import shared_hist
from flashdsa.ops.topk.common import INT_MAX, INT_MIN, KEY_MAX, KEY_MIN, bits_key, copy_short, row_setup, store, translate
from flashdsa.ops.topk.radix import min_max, min_max2, select_levels


@triton.jit
def topk_rows_kernel(
    logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table, out, R, K, flag, L, maxp,
    last_page, code0,
    CHECK: tl.constexpr, HAS_STARTS: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr, VEC: tl.constexpr, ASM: tl.constexpr,
    NARROW: tl.constexpr, BLOCK2: tl.constexpr = 0,
):
    """Top-K of row ``program_id(0)``, translated; arguments as :func:`~flashdsa.ops.topk.fused.topk_fused_kernel` (no
    scratch). ``BLOCK``: a power of 2 >= every row's length, or with ``BLOCK2`` > 0 the row as two tiles, positions
    ``[0, BLOCK)`` and ``[BLOCK, BLOCK + BLOCK2)`` (both powers of 2, BLOCK + BLOCK2 >= every row's length: a row of
    8256 scores holds 10 240 key slots instead of 16 384); the row at most 16384 (the emit packs two counts of at
    most 16384 in an int32); ``BITS``: digit bits of a level (<= 11). VEC: 128-bit row loads, reading to the length
    rounded up to 4 (rows of whole 16-byte chunks). NARROW (``TopkConfig.narrow``): 2 the levels start from the
    row's min / max and shrink to the min / max key of each level's bucket; 1 the same for a bucket of more than
    1/32 of the row (likely ties), to its edges otherwise; 0 the whole key range, then the edges (no min / max pass
    at all)."""
    if ASM:
        shared_hist.declare()
    r = tl.program_id(0)
    n, row, out_row, table_row, off_r = row_setup(r, logits, stride_l, lengths, row_starts, out_offsets, table,
                                                  stride_t, rows_per_table, out, K, L, maxp, last_page, flag,
                                                  code0, CHECK, HAS_STARTS, MODE, PAGE_SIZE, 128 * NW)
    if n <= K:
        copy_short(out_row, n, K, table_row, off_r, MODE, PAGE_SIZE, 128 * NW)
    else:
        TWO: tl.constexpr = BLOCK2 > 0
        p = tl.arange(0, BLOCK)
        x = _keys(row, p, n, VEC)  # [BLOCK] keys; past the row INT_MIN, below every key
        p2 = BLOCK + tl.arange(0, BLOCK2 if TWO else 1)
        y = x
        if TWO:
            y = _keys(row, p2, n, VEC)
        if NARROW > 0:
            if TWO:
                lo, hi = min_max2(x, y, INT_MIN + 1, INT_MAX, TWO)
            else:
                lo, hi = min_max(x, x > INT_MIN)
            few = n // 32
        else:
            # every key of the row (NaN is -inf's key); the padding INT_MIN lies below
            lo = n * 0 + KEY_MIN
            hi = n * 0 + KEY_MAX
            few = n * 0 + INT_MAX
        # levels of 2^BITS buckets from [lo, hi] down to the k-th key (stop 0: never copied out to a smaller set);
        # NARROW < 2: a bucket's min / max only for buckets of more than `few` keys
        _, T, need, _, _, _, _ = select_levels(x, 0, lo, hi, K, 0, 0, BITS, 128 * NW, False, ASM, NARROW < 2, few,
                                               y, TWO)
        # ---- emit: selected = key > T, or key == T with fewer than need equal keys before it; one scan in
        # position order counts both (at most 2^14 each: two 16-bit halves), the second tile after the first
        counts = _emit(x, p, 0, T, need, out_row, table_row, off_r, MODE, PAGE_SIZE, ASM)
        if TWO:
            _emit(y, p2, counts, T, need, out_row, table_row, off_r, MODE, PAGE_SIZE, ASM)


@triton.jit
def _keys(row, p, n, VEC: tl.constexpr):
    """The row's scores at positions ``p`` as order-preserving keys; INT_MIN past the row (below every key)."""
    if VEC:
        b = tl.load(row + p, mask=p < (n + 3) // 4 * 4, other=0.0, eviction_policy="evict_first")
    else:
        b = tl.load(row + p, mask=p < n, other=0.0, eviction_policy="evict_first")
    return tl.where(p < n, bits_key(b.to(tl.int32, bitcast=True)), INT_MIN)


@triton.jit
def _emit(x, p, before0, T, need, out_row, table_row, off_r, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
          ASM: tl.constexpr):
    """Write the selected keys of ``x`` (positions ``p``) to their slots; ``before0``: the packed (greater,
    equal) counts of the positions before ``p[0]``. Returns those counts after this tile."""
    gt = (x > T).to(tl.int32)
    eq = (x == T).to(tl.int32)
    both = gt + (eq << 16)
    before = tl.cumsum(both, axis=0) - both + before0
    gt_before = before & 0xFFFF
    eq_before = before >> 16
    sel = (gt != 0) | ((eq != 0) & (eq_before < need))
    slot = gt_before + tl.minimum(eq_before, need)
    val = translate(p, sel, table_row, off_r, MODE, PAGE_SIZE)
    store(out_row + slot, val, sel, ASM)
    return before0 + tl.sum(both, axis=0)
