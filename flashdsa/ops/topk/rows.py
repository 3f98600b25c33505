"""The row-in-registers top-k kernel (``TopkConfig(kind="rows")``): one program a row of at most 16K scores,
the whole row held as keys in registers, radix levels of 2^BITS buckets (2048 by default) counted with
shared-memory atomics (design: README.md "Rows in registers").

Why: at the decode shapes (64 rows of 8K-16K) the sample -> compaction -> move -> select chain of the other
two kernels pays a dozen block-wide barriers and global round trips a row; with the row in registers there is
no candidate list at all, and with 2048-bucket levels a row of random scores is resolved in two levels (the
first narrows the range to one bucket's min / max, the second to one key). ``tl.histogram`` lowers to
ballots, one a digit bit and then a pass per bucket, so wide digits are dear there; a shared-memory atomic
costs one instruction a key whatever the width. Triton has no shared-memory atomics and does not hand out
shared addresses, so the two histogram buffers are declared in PTX (:func:`_declare`: a ``.shared`` array at
function scope, which ptxas accepts and allocates as static shared memory next to Triton's own dynamic
buffer, so nothing Triton does can alias it) and used through inline PTX only. In the interpreter (no
inline PTX) the same digits are counted by ``tl.histogram``: the same counts, so the same answer.

Exact and deterministic as the other kernels: counts are sums (their order does not matter), the answer is
``T`` (the k-th largest key) and ``need`` (how many keys equal to T, first positions first), and the emit
ranks the selected keys by one scan in position order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdsa.ops.topk.common import INT_MIN, MAX_LEVELS, bits_key, copy_short, row_check, row_setup, store, translate
from flashdsa.ops.topk.radix import bit_width, min_max, pick_bucket

NB_MAX = tl.constexpr(2048)  # buckets of the widest level (BITS 11): two buffers of 8 KiB of static shared memory


@triton.jit
def _declare():
    """Declares ``flashdsa_topk_hist``, ``[2, 2048] u32`` of shared memory, at the kernel's function scope
    (called once, first thing: PTX wants a name declared before its uses)."""
    tl.inline_asm_elementwise(".shared .align 16 .b32 flashdsa_topk_hist[4096];\n\tmov.b32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _zero(buf, NB: tl.constexpr):
    """``hist[buf, :NB] = 0`` (every thread a share; threads holding the same bucket store the same 0)."""
    i = tl.arange(0, NB) + buf * NB_MAX
    tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, flashdsa_topk_hist; mad.lo.u32 a, $1, 4, a; st.shared.u32 [a], 0; "
        "mov.b32 $0, 0; }", "=r,r", [i], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _count(d, buf):
    """``hist[buf, d] += 1`` for every digit ``d >= 0`` (fire-and-forget shared atomics)."""
    i = tl.where(d >= 0, d + buf * NB_MAX, -1)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a; setp.ge.s32 p, $1, 0; mov.u32 a, flashdsa_topk_hist; "
        "mad.lo.u32 a, $1, 4, a; @p red.shared.add.u32 [a], 1; mov.b32 $0, 0; }",
        "=r,r", [i], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _read(buf, NB: tl.constexpr):
    """``hist[buf, :NB]`` as an ``[NB] int32`` tensor."""
    i = tl.arange(0, NB) + buf * NB_MAX
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, flashdsa_topk_hist; mad.lo.u32 a, $1, 4, a; ld.shared.u32 $0, [a]; }",
        "=r,r", [i], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _levels(x, kk, NB: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """``(T, need)`` for the kk-th largest of the keys ``x [BLOCK]`` (empty slots INT_MIN, below every key):
    radix levels of NB = 2^BITS buckets laid from the range's lowest key up, each keeping the bucket where
    the count from the top reaches kk and then narrowing the range to that bucket's min / max key.

    Compiled (ASM), the two shared buffers alternate: a level counts into one and, once every thread has
    read it, clears the other for the next level; the barrier at the top of each level orders that clear
    (and the previous level's reads) before the next level's atomics."""
    lo, hi = min_max(x, x > INT_MIN)
    zero = tl.full([], 0, tl.int32)
    kk = kk + zero
    T = zero
    need = zero
    done = zero
    it = zero
    if ASM:
        _zero(0, NB)
        _zero(1, NB)
    while (done == 0) & (it < MAX_LEVELS):
        width = bit_width(hi.to(tl.int64) - lo.to(tl.int64))
        if width == 0:
            T = lo
            need = kk
            done = zero + 1
        else:
            shift = tl.maximum(width - BITS, 0).to(tl.int32)
            # the digit, -1 outside the range (x - lo wraps in int32; its low shift + BITS <= 32 bits are right)
            d = tl.where((x >= lo) & (x <= hi), ((x - lo) >> shift) & (NB - 1), -1)
            if ASM:
                buf = it % 2
                tl.debug_barrier()
                _count(d, buf)
                tl.debug_barrier()
                hist = _read(buf, NB)
                _zero(1 - buf, NB)
            else:
                hist = tl.histogram(d, NB, mask=d >= 0)
            dsel, above, in_bin = pick_bucket(hist, kk)
            kk = kk - above
            b_lo = lo.to(tl.int64) + (dsel.to(tl.int64) << shift)
            b_hi = tl.minimum(b_lo + (1 << shift.to(tl.int64)) - 1, hi.to(tl.int64)).to(tl.int32)
            if in_bin <= kk:
                # the whole bucket is taken: T sits just below it (b_lo >= lo >= key(-inf): no overflow)
                T = b_lo.to(tl.int32) - 1
                need = zero
                done = zero + 1
            else:
                lo, hi = min_max(x, (x >= b_lo.to(tl.int32)) & (x <= b_hi))
        it += 1
    return T, need


@triton.jit
def topk_rows_kernel(
    logits, stride_l, lengths, row_starts, out_offsets, table, stride_t, rows_per_table, out, R, K, flag, L, maxp,
    last_page, code0,
    CHECK: tl.constexpr, HAS_STARTS: tl.constexpr, MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr, VEC: tl.constexpr, ASM: tl.constexpr,
):
    """Top-K of row ``program_id(0)``, translated; arguments as :func:`~flashdsa.ops.topk.fused.topk_fused_kernel`
    (no scratch). ``BLOCK``: a power of 2 >= every row's length (at most 16384: the emit packs two counts of at
    most BLOCK in an int32); ``BITS``: digit bits of a level (<= 11). VEC: 128-bit row loads, reading to the
    length rounded up to 4 (rows of whole 16-byte chunks)."""
    if ASM:
        _declare()
    r = tl.program_id(0)
    n, row, out_row, table_row, off_r = row_setup(r, logits, stride_l, lengths, row_starts, out_offsets, table,
                                                  stride_t, rows_per_table, out, K, HAS_STARTS, MODE)
    if CHECK:
        n = row_check(n, r, row_starts, out_offsets, table_row, L, maxp, last_page, flag, code0, HAS_STARTS, MODE,
                      PAGE_SIZE, 128 * NW)
    if n <= K:
        copy_short(out_row, n, K, table_row, off_r, MODE, PAGE_SIZE, 128 * NW)
    else:
        p = tl.arange(0, BLOCK)
        if VEC:
            b = tl.load(row + p, mask=p < (n + 3) // 4 * 4, other=0.0, eviction_policy="evict_first")
        else:
            b = tl.load(row + p, mask=p < n, other=0.0, eviction_policy="evict_first")
        # [BLOCK] keys; past the row INT_MIN, below every key
        x = tl.where(p < n, bits_key(b.to(tl.int32, bitcast=True)), INT_MIN)
        T, need = _levels(x, K, 1 << BITS, BITS, ASM)
        # ---- emit: selected = key > T, or key == T with fewer than need equal keys before it; one scan in
        # position order counts both (at most BLOCK <= 2^14 each: two 16-bit halves)
        gt = (x > T).to(tl.int32)
        eq = (x == T).to(tl.int32)
        both = gt + (eq << 16)
        before = tl.cumsum(both, axis=0) - both
        gt_before = before & 0xFFFF
        eq_before = before >> 16
        sel = (gt != 0) | ((eq != 0) & (eq_before < need))
        slot = gt_before + tl.minimum(eq_before, need)
        val = translate(p, sel, table_row, off_r, MODE, PAGE_SIZE)
        store(out_row + slot, val, sel, ASM)

