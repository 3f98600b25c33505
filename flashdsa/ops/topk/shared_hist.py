"""Histograms in shared memory through inline PTX, for the rows kernel's radix levels (README.md "Rows in
registers").

Triton has no shared-memory atomics and hands out no shared addresses, so the buffers are declared in PTX
(:func:`declare`: a ``.shared`` array at the kernel's function scope, which ptxas accepts and allocates as
static shared memory apart from Triton's dynamic buffer: no Triton value can alias it) and are read, cleared
and counted only here. Two buffers of NB_MAX buckets alternate between levels (:func:`histogram`). Compiled
kernels only: the interpreter runs no inline PTX (its callers count with ``tl.histogram`` there).
"""

from __future__ import annotations

import triton
import triton.language as tl

NB_MAX = tl.constexpr(2048)  # buckets of the widest level (11-bit digits): two buffers of 8 KiB
SINK = tl.constexpr(4096)    # one word after them that the keys outside a level's range count into (never read)


@triton.jit
def declare():
    """Declares ``flashdsa_topk_hist``, ``[2, NB_MAX] u32`` of shared memory, at the kernel's function scope
    (called once, first thing in the kernel: PTX wants a name declared before its uses)."""
    tl.inline_asm_elementwise(".shared .align 16 .b32 flashdsa_topk_hist[4100];\n\tmov.b32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def clear(buf, NB: tl.constexpr):
    """``hist[buf, :NB] = 0`` (threads holding the same bucket store the same 0)."""
    i = tl.arange(0, NB) + buf * NB_MAX
    tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, flashdsa_topk_hist; mad.lo.u32 a, $1, 4, a; st.shared.u32 [a], 0; "
        "mov.b32 $0, 0; }", "=r,r", [i], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _count(d, buf):
    """``hist[buf, d] += 1`` for every digit ``d >= 0`` (fire-and-forget shared atomics). The others count
    into the SINK word: an unpredicated atomic, which ptxas emits without the branch around it that a
    predicated one costs (3 of ~12 instructions a key and level, sm_90)."""
    i = tl.where(d >= 0, d + buf * NB_MAX, SINK)
    tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, flashdsa_topk_hist; mad.lo.u32 a, $1, 4, a; red.shared.add.u32 [a], 1; "
        "mov.b32 $0, 0; }",
        "=r,r", [i], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _read(buf, NB: tl.constexpr):
    """``hist[buf, :NB]`` as an ``[NB] int32`` tensor."""
    i = tl.arange(0, NB) + buf * NB_MAX
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, flashdsa_topk_hist; mad.lo.u32 a, $1, 4, a; ld.shared.u32 $0, [a]; }",
        "=r,r", [i], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def histogram(d, buf, NB: tl.constexpr, d2=None, TWO: tl.constexpr = False):
    """``tl.histogram(d, NB, mask=d >= 0)`` of the digits ``d`` (every element held by one thread only) in
    buffer ``buf`` (0 / 1), which must be clear (``radix.select_levels`` clears both before its first level);
    clears the other buffer for the next level. TWO: the digits ``d2`` of a second tile count too.

    The barrier first orders the previous level's reads of this buffer and its clear (both before this
    call's atomics); the second makes every thread's atomics visible before the reads. The other buffer
    was last read before the first barrier, so clearing it after the reads races with nothing."""
    tl.debug_barrier()
    _count(d, buf)
    if TWO:
        _count(d2, buf)
    tl.debug_barrier()
    hist = _read(buf, NB)
    clear(1 - buf, NB)
    return hist
