"""Paged indexer logits (decode, MTP verify) as a warp-specialised Gluon kernel for Hopper (sm_90), after
DeepGEMM's sm90 paged MQA-logits schedule. ``flashdsa.ops.indexer_logits_paged`` runs it on sm_90 from next_n
4 on (``backend="gluon"``: next_n 1-4) through :func:`indexer_logits_paged_planned` (a launch plan, the TMA
descriptors cached per address); :func:`indexer_logits_paged_gluon` is a checked JIT launch. The interpreter
cannot run Gluon: ``-m gpu`` tests run it, the CPU tests compile it for sm_90 (:func:`compile_sm90`).

Math: ``reference.py``'s ``logit[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])``, -inf at and past
each row's length. A page's dot per draft row is ``S = K [64 keys, 128] . Q_j^T [128, 64 heads]`` (fp8 wgmma,
fp32 accumulator), keys on M as in ``paged.py``: the head sum stays inside a thread and its quad. No atomics,
a fixed reduction order: the same input gives the same bits.

A persistent CTA walks items (request b, chunk of CHUNK_PAGES pages; every request's first chunk first) with
``gl.warp_specialize`` partitions (the configuration per next_n: :func:`launch_config`):

* **producer** (1 warp): per item the request's n query tiles by TMA into one of two Q buffers (``q_ready`` /
  ``q_free``); per page its id (scalar loads four pages ahead), one TMA copy of its [64, 128] e4m3 keys and one
  of its 64 fp32 scales (the cache viewed as [66 P, 128] e4m3 / [66 P, 32] fp32: page p is rows 66 p .. 66 p
  + 65) into a ring of NBUF buffers (``ready`` / ``free``), pages padding an item to whole rounds reading page
  0 (never stored); then -inf at the item's columns past its rows' reach.
* **consumers** (4 warps each; consumer c takes the item's pages c, c + NC, ...): relu, times the row's gates,
  sum over the 64 heads, times the key scales, -inf past the row's length, stored straight from the
  accumulator's layout. next_n 1: two consumers with two pages in flight each (both chains issued, each row
  finished as its chain completes), two CTAs an SM. next_n >= 2: the rows in pairs, ``K . [Q_0; Q_1]^T`` as one
  m64n128k32 chain as DeepGEMM issues it (the keys read from shared memory once for two rows; rows 2 / 3 a
  second chain), split into the rows' accumulators by a relabelling of registers. next_n 2: four consumers
  (DeepGEMM's four math warpgroups), each fed by its own producer warp and ring of NBUF / 4 buffers, so none
  waits behind another's page; next_n 3 / 4: two consumers and one producer.
* **barriers**: every chain completes within its round or page, since a chain in flight across the loop's back
  edge makes ptxas serialise every wgmma (C7514; the CPU compile test checks). At next_n 2 every consumer
  thread frees a page (and the Q buffer) with its own arrive once it has read the scales (``_gluon_sync``'s
  ``release``) instead of one thread's arrive and the warpgroup barriers Triton puts around it (2-3 % there).

What bounds it: the CUDA-core epilogue, issue-bound. A wgmma-only probe (no epilogue) ran every next_n in 72-78
us and the copy stream alone in 69-77 us, DeepGEMM's speed; each draft row's epilogue adds ~31 us. Last
measured (H200, B 64, ctx ~U(0.7, 1.3) x 32K, CUDA-graph replay, ``benchmarks/gluon_indexer_probe.py``): next_n
1 / 2 / 3 / 4 76.9 / 92.8 / 131.1 / 159.9 us, the Triton kernel 74.8 / 92.9 / 130.1 / 180.0, DeepGEMM 72.6 /
78.4 (n 1 / 2). What was tried and lost: README.md.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashdsa.cache.layouts import INDEX_PAGE_BYTES, PAGE_SIZE
from flashdsa.ops._common import remember
from flashdsa.ops._gluon import compile_sm90 as compile_sm90_kernel
from flashdsa.ops._gluon_sync import release
from flashdsa.ops._launch import Address, KernelLauncher, aligned, capability
from flashdsa.ops._triton_utils import cdiv, num_sms, prev_pow2
from flashdsa.ops.indexer.paged import PAGE_ROWS

ROWS = gl.constexpr(PAGE_ROWS)   # 66 rows of 128 B a page (the TMA kernel's cache view): 64 keys, 2 of scales
D = gl.constexpr(128)
HEADS = gl.constexpr(64)   # the N side of one row's wgmma: the Gluon path takes H == 64 (DeepSeek-V3.2's indexer)
# Triton 3.7 renamed TMA's copy (async_copy_global_to_shared -> async_load) and memdesc._reinterpret; the
# copy is picked here because Triton resolves every global attribute a kernel names when it hashes the kernel
NEW_API = gl.constexpr(hasattr(tma, "async_load"))
_tma_copy = tma.async_load if NEW_API.value else tma.async_copy_global_to_shared


# ---- layouts and version shims ---------------------------------------------------------------------------

@gluon.constexpr_function
def acc_layout():
    # the fp8 wgmma accumulator of one warpgroup: 4 warps along M = 64 keys, instruction m64 n64 k32
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])


@gluon.constexpr_function
def tile_layout():
    # [64, 128] e4m3 tiles (keys, one draft row's queries) as wgmma reads them: 128-B swizzle
    return gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)


@gluon.constexpr_function
def pair_layout():
    # two draft rows' query tiles read as one [128, 128] B operand: the same 128-B swizzle, whose pattern
    # repeats every 8 rows, so two consecutive [64, 128] tiles are one [128, 128] tile
    return gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)


@gluon.constexpr_function
def pair_acc_layout():
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])


@gluon.jit
def _reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr, NEW: gl.constexpr):
    if NEW:
        return buf.reinterpret(dtype, shape, layout)
    else:
        return buf._reinterpret(dtype, shape, layout)


@gluon.constexpr_function
def scale_layout():
    # a page's 64 scales as TMA writes them: [2, 32] fp32, unswizzled, i.e. 64 words in order
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@gluon.jit
def _scales(buf, NEW: gl.constexpr):
    """A page's [2, 32] fp32 scale tile read as its 64 scales, one a key row of the accumulator."""
    layout: gl.constexpr = gl.SliceLayout(1, acc_layout())
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    return _reinterpret(buf, gl.float32, [64], flat, NEW).load(layout)


# ---- partitions ----------------------------------------------------------------------------------------------

@gluon.jit
def _item(t, B, context_lens, max_len, NEXT_N: gl.constexpr, CHUNK_PAGES: gl.constexpr, DP: gl.constexpr,
          NC: gl.constexpr):
    """Work item t -> (request b, its first column c0, the chunk end c1, pages to score, pages padded to whole
    rounds of all consumers). Chunk-major order: every request's first chunk (never empty) comes first."""
    b = t % B
    c0 = (t // B) * (CHUNK_PAGES * 64)
    c1 = gl.minimum(c0 + CHUNK_PAGES * 64, max_len)
    p_len = context_lens + b.to(gl.int64) * NEXT_N
    reach = gl.load(p_len)
    for j in gl.static_range(1, NEXT_N):
        reach = gl.maximum(reach, gl.load(p_len + j))
    n_pages = gl.cdiv(gl.maximum(gl.minimum(c1, reach) - c0, 0), 64)
    n_pad = gl.cdiv(n_pages, NC * DP) * (NC * DP)
    return b, c0, c1, n_pages, n_pad


@gluon.jit
def _slot(gi, NBUF: gl.constexpr, NC: gl.constexpr, SPLIT: gl.constexpr):
    """(buffer, phase) of the CTA's page number ``gi`` (pages of earlier items + the page's index in its item).
    One ring of NBUF buffers in page order, or (``SPLIT``) a ring of NBUF / NC a consumer: consumer c takes
    the pages c, c + NC, ... (every item's page count is padded to a multiple of NC, so gi % NC == c)."""
    if SPLIT:
        NBP: gl.constexpr = NBUF // NC
        k = gi // NC
        return (gi % NC) * NBP + k % NBP, (k // NBP) & 1
    else:
        return gi % NBUF, (gi // NBUF) & 1


@gluon.jit
def _producer(rp, NBUF: gl.constexpr, NEXT_N: gl.constexpr, CHUNK_PAGES: gl.constexpr, DP: gl.constexpr,
              NC: gl.constexpr, SPLIT: gl.constexpr, PR: gl.constexpr):
    """For each of the CTA's items: the request's queries (n TMA copies into the item's Q buffer), then its
    pages (page ids four ahead, one TMA copy of the keys and one of the scales per page, padding pages read
    page 0), then -inf at the columns past the rows' reach. ``SPLIT``: one producer warp a consumer (this one
    feeds consumer ``PR``: its pages only, into its ring); producer 0 also loads Q and writes the -inf."""
    (q_desc, key_desc, sc_desc, context_lens, block_table, stride_bt, out, stride_o, max_len, B, n_items, q_smem,
     k_smem, s_smem, ready, free, q_ready, q_free) = rp   # the kernel's shared arguments
    LF: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
    QS: gl.constexpr = NEXT_N + NEXT_N % 2   # Q tiles a buffer (the kernel's q_smem)
    ST: gl.constexpr = NC if SPLIT else 1       # this producer's pages: PR, PR + ST, ...
    o_f = gl.arange(0, 128, layout=LF)
    ninf = gl.full([128], float("-inf"), gl.float32, LF)
    g0 = 0   # pages of earlier items
    it = 0   # non-empty items so far (Q buffer it % 2)
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, c0, c1, n_pages, n_pad = _item(t, B, context_lens, max_len, NEXT_N, CHUNK_PAGES, DP, NC)
        if PR == 0 and n_pages > 0:
            qb = it % 2
            mbarrier.wait(q_free.index(qb), ((it // 2) & 1) ^ 1)   # a fresh barrier's previous phase is done
            mbarrier.expect(q_ready.index(qb), NEXT_N * 64 * D)
            for j in gl.static_range(NEXT_N):
                _tma_copy(q_desc, [(b * NEXT_N + j) * 64, 0], q_ready.index(qb), q_smem.index(qb * QS + j))
            it += 1
        p_bt = block_table + b.to(gl.int64) * stride_bt + c0 // 64
        pa = gl.load(p_bt + PR, mask=PR < n_pages, other=0)
        pb = gl.load(p_bt + PR + ST, mask=PR + ST < n_pages, other=0)
        pc = gl.load(p_bt + PR + 2 * ST, mask=PR + 2 * ST < n_pages, other=0)
        pd = gl.load(p_bt + PR + 3 * ST, mask=PR + 3 * ST < n_pages, other=0)
        for i in range(PR, n_pad, ST):
            pn = gl.load(p_bt + i + 4 * ST, mask=i + 4 * ST < n_pages, other=0)
            s, ph = _slot(g0 + i, NBUF, NC, SPLIT)
            mbarrier.wait(free.index(s), ph ^ 1)
            bar = ready.index(s)
            r = pa * ROWS
            mbarrier.expect(bar, 64 * D + 64 * 4)   # the keys and the scales
            _tma_copy(key_desc, [r, 0], bar, k_smem.index(s))
            _tma_copy(sc_desc, [r + 64, 0], bar, s_smem.index(s))
            pa = pb
            pb = pc
            pc = pd
            pd = pn
        g0 += n_pad
        if PR == 0:
            out_b = out + b.to(gl.int64) * NEXT_N * stride_o
            for j in gl.static_range(NEXT_N):
                for f in range(c0 + n_pages * 64, c1, 128):
                    gl.store(out_b + j * stride_o + f + o_f, ninf, mask=f + o_f < c1)


@gluon.jit
def _row_out(acc, w, sc, len_rel, p_out, lim, o_n):
    """One draft row's logits of a page from its accumulator ``acc [64 keys, 64 heads]``: gates ``w [64]``,
    scales ``sc [64]``, -inf at key offsets >= ``len_rel``, stored at ``p_out + o_n`` below ``lim``."""
    x = gl.maximum(acc, 0.0) * gl.expand_dims(w, 0)
    s = gl.sum(x, axis=1) * sc   # k_scale > 0 leaves the relu and the head sum: one multiply per key
    s = gl.where(o_n < len_rel, s, float("-inf"))
    gl.store(p_out + o_n, s, mask=o_n < lim)


@gluon.jit
def _issue(g0, i, q_smem, q0, k_smem, ready, zero, NBUF: gl.constexpr, NC: gl.constexpr, SPLIT: gl.constexpr):
    """next_n 1: the chain of the item's page i (the CTA's page g0 + i), once the page has landed."""
    s, ph = _slot(g0 + i, NBUF, NC, SPLIT)
    mbarrier.wait(ready.index(s), ph)
    return warpgroup_mma(k_smem.index(s), q_smem.index(q0).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _finish(acc, PENDING: gl.constexpr, g0, i, c0, lim_end, s_smem, free, o_n, w0, l0, out_b, NBUF: gl.constexpr,
            NEW: gl.constexpr, NC: gl.constexpr, SPLIT: gl.constexpr):
    """next_n 1: the item's page i once its chain completes (``PENDING`` chains issued after it may still
    run): free the page, store the row's logits."""
    s, _ = _slot(g0 + i, NBUF, NC, SPLIT)
    sc = _scales(s_smem.index(s), NEW)
    acc = warpgroup_mma_wait(PENDING, deps=(acc,))
    mbarrier.arrive(free.index(s), count=1)
    t0 = c0 + i * 64
    _row_out(acc, w0, sc, l0 - t0, out_b + t0, lim_end - t0, o_n)


@gluon.jit
def _pair_rows(acc):
    """A pair of rows' [64 keys, 128] accumulator split into each row's [64 keys, 64 heads] one: a relabelling
    of registers (``assert_trivial`` fails the compile if it ever were not)."""
    L: gl.constexpr = acc_layout()
    a0, a1 = gl.split(gl.permute(gl.reshape(acc, [64, 2, 64]), (0, 2, 1)))
    return gl.convert_layout(a0, L, assert_trivial=True), gl.convert_layout(a1, L, assert_trivial=True)


@gluon.jit
def _paired_page(g0, i, q_smem, qb, k_smem, s_smem, ready, free, zero, zero_w, c0, lim_end, o_n, w0, w1, w2, w3,
                 l0, l1, l2, l3, out_b, stride_o, NBUF: gl.constexpr, NC: gl.constexpr, SPLIT: gl.constexpr,
                 NEW: gl.constexpr, NEXT_N: gl.constexpr, PTA: gl.constexpr):
    """next_n >= 2: the item's page i with the draft rows in pairs, S [64 keys, 128] = K . [Q_0; Q_1]^T as one
    m64n128k32 chain, rows 2 and 3 as a second chain (row 2 alone at next_n 3); the pair's accumulator is then
    split into the rows' own. Rows 0 and 1 are finished while the second chain runs."""
    s, ph = _slot(g0 + i, NBUF, NC, SPLIT)
    # the Q buffers as one [2 n 64, 128] tile: two consecutive [64, 128] tiles are one [128, 128] tile
    # (a Q buffer holds QS = next_n rounded up to even tiles, so every pair starts a [128, 128] tile)
    QS: gl.constexpr = NEXT_N + NEXT_N % 2
    q_pairs = _reinterpret(q_smem, gl.float8e4nv, [QS, 128, D], pair_layout(), NEW)
    mbarrier.wait(ready.index(s), ph)
    acc = warpgroup_mma(k_smem.index(s), q_pairs.index(qb * (QS // 2)).permute((1, 0)), zero_w, use_acc=False,
                        is_async=True)
    if NEXT_N == 3:
        acc2 = warpgroup_mma(k_smem.index(s), q_smem.index(qb * QS + 2).permute((1, 0)), zero, use_acc=False,
                             is_async=True)
    if NEXT_N == 4:
        acc2 = warpgroup_mma(k_smem.index(s), q_pairs.index(qb * 2 + 1).permute((1, 0)), zero_w, use_acc=False,
                             is_async=True)
    sc = _scales(s_smem.index(s), NEW)
    t0 = c0 + i * 64
    p_out = out_b + t0
    lim = lim_end - t0
    if NEXT_N == 2:
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if not PTA:
            mbarrier.arrive(free.index(s), count=1)
        a0, a1 = _pair_rows(acc)
        _row_out(a0, w0, sc, l0 - t0, p_out, lim, o_n)
        _row_out(a1, w1, sc, l1 - t0, p_out + stride_o, lim, o_n)
    else:
        acc = warpgroup_mma_wait(1, deps=(acc,))
        a0, a1 = _pair_rows(acc)
        _row_out(a0, w0, sc, l0 - t0, p_out, lim, o_n)
        _row_out(a1, w1, sc, l1 - t0, p_out + stride_o, lim, o_n)
        acc2 = warpgroup_mma_wait(0, deps=(acc2,))
        if not PTA:
            mbarrier.arrive(free.index(s), count=1)
        if NEXT_N == 3:
            _row_out(acc2, w2, sc, l2 - t0, p_out + 2 * stride_o, lim, o_n)
        else:
            a2, a3 = _pair_rows(acc2)
            _row_out(a2, w2, sc, l2 - t0, p_out + 2 * stride_o, lim, o_n)
            _row_out(a3, w3, sc, l3 - t0, p_out + 3 * stride_o, lim, o_n)
    if PTA:
        # each thread once the page's scales are used (release() orders nothing before it: a scale load could
        # otherwise still be in flight when the producer's next copy lands)
        release(free.index(s), True)


@gluon.jit
def _consumer(WG: gl.constexpr, rc, NBUF: gl.constexpr, NEXT_N: gl.constexpr, CHUNK_PAGES: gl.constexpr,
              DP: gl.constexpr, NEW: gl.constexpr, NC: gl.constexpr, SPLIT: gl.constexpr, PTA: gl.constexpr):
    """Consumer WG on each of the CTA's items: its pages WG, WG + NC, ... (next_n 1: in rounds of DP = 2, both
    chains issued before the first is waited for, so the tensor cores run the second, and the other
    consumer's, during the first one's epilogue; else :func:`_paired_page` a page)."""
    (w, context_lens, out, stride_w, stride_o, max_len, B, n_items, q_smem, k_smem, s_smem, ready, free, q_ready,
     q_free) = rc   # the kernel's shared arguments
    L: gl.constexpr = acc_layout()
    LN: gl.constexpr = gl.SliceLayout(1, L)
    LH: gl.constexpr = gl.SliceLayout(0, L)
    QS: gl.constexpr = NEXT_N + NEXT_N % 2   # Q tiles a buffer (the kernel's q_smem)
    o_n = gl.arange(0, 64, layout=LN)
    o_h = gl.arange(0, HEADS, layout=LH)
    zero = gl.zeros([64, HEADS], gl.float32, L)
    zero_w = gl.zeros([64, 128], gl.float32, pair_acc_layout())
    g0 = 0   # pages of earlier items (the producer's global page count at this item's start)
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, c0, c1, n_pages, n_pad = _item(t, B, context_lens, max_len, NEXT_N, CHUNK_PAGES, DP, NC)
        if n_pages > 0:
            row0 = b.to(gl.int64) * NEXT_N
            w_b = w + row0 * stride_w
            lens_b = context_lens + row0
            w0 = gl.load(w_b + o_h)
            l0 = gl.load(lens_b)
            w1, w2, w3, l1, l2, l3 = w0, w0, w0, l0, l0, l0
            if NEXT_N > 1:
                w1 = gl.load(w_b + stride_w + o_h)
                l1 = gl.load(lens_b + 1)
            if NEXT_N > 2:
                w2 = gl.load(w_b + 2 * stride_w + o_h)
                l2 = gl.load(lens_b + 2)
            if NEXT_N > 3:
                w3 = gl.load(w_b + 3 * stride_w + o_h)
                l3 = gl.load(lens_b + 3)
            out_b = out + row0 * stride_o
            lim_end = gl.minimum(c1, c0 + n_pages * 64)   # below it the consumers store, from it the producer
            qb = it % 2
            mbarrier.wait(q_ready.index(qb), (it // 2) & 1)
            q0 = qb * QS
            if NEXT_N == 1:
                for r in range(n_pad // (NC * DP)):
                    i0 = WG + NC * DP * r
                    a0 = _issue(g0, i0, q_smem, q0, k_smem, ready, zero, NBUF, NC, SPLIT)
                    a1 = _issue(g0, i0 + NC, q_smem, q0, k_smem, ready, zero, NBUF, NC, SPLIT)
                    _finish(a0, 1, g0, i0, c0, lim_end, s_smem, free, o_n, w0, l0, out_b, NBUF, NEW, NC, SPLIT)
                    _finish(a1, 0, g0, i0 + NC, c0, lim_end, s_smem, free, o_n, w0, l0, out_b, NBUF, NEW, NC, SPLIT)
            else:
                for r in range(n_pad // NC):
                    _paired_page(g0, WG + NC * r, q_smem, qb, k_smem, s_smem, ready, free, zero, zero_w, c0,
                                 lim_end, o_n, w0, w1, w2, w3, l0, l1, l2, l3, out_b, stride_o, NBUF, NC, SPLIT, NEW,
                                 NEXT_N, PTA)
            release(q_free.index(qb), PTA)   # every chain reading this Q buffer was waited for
            it += 1
        g0 += n_pad


# ---- kernel ----------------------------------------------------------------------------------------------------

@gluon.jit
def indexer_paged_ws_kernel(
    q_desc,        # TMA descriptor: q as [B * NEXT_N * 64, 128] e4m3, block [64, 128] (tile_layout)
    key_desc,      # TMA descriptor: the cache as [P * 66, 128] e4m3, block [64, 128] (tile_layout)
    sc_desc,       # TMA descriptor: the cache as [P * 66, 32] fp32, block [2, 32] (scale_layout)
    w,             # [B * NEXT_N, 64] f32, unit stride last
    context_lens,  # [B, NEXT_N] i32, contiguous
    block_table,   # [B, maxp] i32, unit stride last
    out,           # [B * NEXT_N, max_len] f32, unit stride last
    scales,        # the cache as fp32 words, unread: dropping it would shift the later arguments (a new SASS)
    max_len, B, n_chunks, stride_w, stride_bt, stride_o,
    NEXT_N: gl.constexpr, CHUNK_PAGES: gl.constexpr, NBUF: gl.constexpr, DP: gl.constexpr, REGS_C: gl.constexpr,
    REGS_P: gl.constexpr, NEW: gl.constexpr, NC: gl.constexpr, PTA: gl.constexpr,
):
    """A persistent CTA: items t = program_id, program_id + grid, ... of the B * n_chunks (request, chunk of
    CHUNK_PAGES pages) items, so the producer streams the next item's pages while the consumers finish
    this one's (one CTA's start-up per SM, not per item)."""
    n_items = B * n_chunks
    SPLIT: gl.constexpr = NC == 4   # four consumers: a producer warp and a ring of NBUF / 4 buffers each
    QS: gl.constexpr = NEXT_N + NEXT_N % 2   # Q tiles a buffer, even: the paired chains read two as one
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * QS, 64, D], tile_layout())
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [NBUF, 64, D], tile_layout())
    s_smem = gl.allocate_shared_memory(gl.float32, [NBUF, 2, 32], scale_layout())
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=128 if PTA else 1)   # PTA: each thread of the page's consumer
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_free.index(i), count=NC * 128 if PTA else NC)   # every consumer (PTA: every thread)
    fence_async_shared()
    # The partitions' runtime arguments travel as two tuples; the constexprs one by one (a tuple held in a
    # variable loses its constexprs).
    rc = (w, context_lens, out, stride_w, stride_o, max_len, B, n_items, q_smem, k_smem, s_smem, ready, free,
          q_ready, q_free)
    rp = (q_desc, key_desc, sc_desc, context_lens, block_table, stride_bt, out, stride_o, max_len, B, n_items,
          q_smem, k_smem, s_smem, ready, free, q_ready, q_free)
    if NC == 2:
        gl.warp_specialize([
            (_consumer, (0, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, NC, SPLIT, PTA)),
            (_consumer, (1, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, NC, SPLIT, PTA)),
            (_producer, (rp, NBUF, NEXT_N, CHUNK_PAGES, DP, NC, SPLIT, 0))],
            [4, 1], [REGS_C, REGS_P])
    else:
        gl.warp_specialize([
            (_consumer, (0, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, NC, SPLIT, PTA)),
            (_consumer, (1, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, NC, SPLIT, PTA)),
            (_consumer, (2, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, NC, SPLIT, PTA)),
            (_consumer, (3, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, NC, SPLIT, PTA)),
            (_producer, (rp, NBUF, NEXT_N, CHUNK_PAGES, DP, NC, SPLIT, 0)),
            (_producer, (rp, NBUF, NEXT_N, CHUNK_PAGES, DP, NC, SPLIT, 1)),
            (_producer, (rp, NBUF, NEXT_N, CHUNK_PAGES, DP, NC, SPLIT, 2)),
            (_producer, (rp, NBUF, NEXT_N, CHUNK_PAGES, DP, NC, SPLIT, 3))],
            [4, 4, 4, 1, 1, 1, 1], [REGS_C, REGS_C, REGS_C, REGS_P, REGS_P, REGS_P, REGS_P])


# ---- launcher ----------------------------------------------------------------------------------------------

def launch_config(B: int, n: int, max_len: int, device: torch.device, chunk_pages: int | None = None) -> dict:
    """The launch of next_n ``n`` (1-4; measured on the H200, README.md): NC consumers with DP pages in flight
    each, NBUF page buffers, PTA (the per-thread page release), CTAs an SM and the setmaxnreg budgets, and
    the chunk: 8 pages at next_n 1, else about 16 items an SM, 8 .. 64 pages (``chunk_pages`` overrides it:
    the tests' small chunks give several items a CTA).

    Two consumers make a CTA of 12 warps (the producer's warp padded to a warpgroup, which setmaxnreg works
    in): 168 registers at launch give one CTA an SM, redistributed as 232 a consumer and 40 for the
    producer; 80 give two CTAs an SM at next_n 1 (96 a consumer), so one CTA's start-up overlaps the other's
    stream. Four consumers and their producer warps are 20 warps: 96 registers at launch fill the register
    file, redistributed as 112 a consumer (room for one pair's accumulator) and 32 a producer."""
    if n == 1:   # rounds of two pages a consumer; 8 buffers (~66 KB of keys) cover the DRAM latency
        cfg = dict(NC=2, DP=2, PTA=0, NBUF=8, ctas=2, REGS_C=96, REGS_P=40, maxnreg=80)
    elif n == 2:   # paired chains, four consumers with a producer warp and a ring of 4 buffers each
        cfg = dict(NC=4, DP=1, PTA=1, NBUF=16, ctas=1, REGS_C=112, REGS_P=32, maxnreg=96)
    elif n in (3, 4):   # paired chains, two consumers
        cfg = dict(NC=2, DP=1, PTA=0, NBUF=16, ctas=1, REGS_C=232, REGS_P=40, maxnreg=168)
    else:
        raise ValueError(f"next_n: 1 .. 4 (got {n})")
    if chunk_pages is None and n == 1:
        chunk_pages = 8   # measured best at B 64 8K / 32K and B 128 32K (75.2 vs 77.0 us with 32 at B 64 32K)
    elif chunk_pages is None:
        cols = B * max(max_len, 1) // (16 * num_sms(device))
        chunk_pages = min(max(prev_pow2(max(cols // PAGE_SIZE, 1)), 8), 64)
    if chunk_pages < 1:
        raise ValueError(f"chunk_pages: >= 1 (got {chunk_pages})")
    return dict(CHUNK_PAGES=chunk_pages, num_warps=4, **cfg)


def _descs(q_fp8: torch.Tensor, cache_u8: torch.Tensor):
    """The three TMA descriptors of a call (see the kernel's arguments): q must be contiguous."""
    P = cache_u8.shape[0]
    qs = q_fp8.view(-1, D.value)
    keys = cache_u8.view(torch.float8_e4m3fn).view(P * PAGE_ROWS, D.value)
    scales = cache_u8.view(torch.float32).view(P * PAGE_ROWS, 32)
    return (TensorDescriptor.from_tensor(qs, [64, D.value], tile_layout()),
            TensorDescriptor.from_tensor(keys, [64, D.value], tile_layout()),
            TensorDescriptor.from_tensor(scales, [2, 32], scale_layout()))


def kernel_args(q_fp8, cache_u8, weights, context_lens, block_table, max_len, out, chunk_pages: int | None = None,
                max_ctas: int | None = None) -> tuple[tuple, dict]:
    """(grid, kwargs) of one launch of :func:`indexer_paged_ws_kernel` (also :func:`compile_sm90`'s);
    ``chunk_pages`` as :func:`launch_config`, ``max_ctas`` caps the persistent grid (tests: several items a
    CTA)."""
    B, n = q_fp8.shape[:2]
    cfg = launch_config(B, n, max_len, q_fp8.device, chunk_pages)
    ctas = cfg.pop("ctas")
    q_desc, key_desc, sc_desc = _descs(q_fp8, cache_u8)
    n_chunks = cdiv(max_len, 64 * cfg["CHUNK_PAGES"])
    grid = (max(1, min(B * n_chunks, ctas * num_sms(q_fp8.device), max_ctas or B * n_chunks)),)
    return grid, dict(
        q_desc=q_desc, key_desc=key_desc, sc_desc=sc_desc, w=weights, context_lens=context_lens,
        block_table=block_table, out=out, scales=cache_u8.view(torch.float32), max_len=max_len, B=B,
        n_chunks=n_chunks, stride_w=weights.stride(0),
        stride_bt=block_table.stride(0), stride_o=out.stride(0), NEXT_N=n, NEW=NEW_API, **cfg)


def unsupported(q_fp8: torch.Tensor, index_cache: torch.Tensor) -> str | None:
    """Why this kernel cannot run an ``indexer_logits_paged`` call, or None when it can: an sm_90 GPU, 64 heads
    (DeepSeek-V3.2's indexer), 1 <= next_n <= 4 (one m64n64 accumulator per draft row, at most 4 in flight),
    a contiguous 16-byte aligned q (read by TMA) and cache of fewer than 2^31 / 66 pages (TMA's int32 row
    coordinates). ``flashdsa.ops.indexer_logits_paged`` and :func:`indexer_logits_paged_gluon` ask this first."""
    B, n, H, _ = q_fp8.shape
    if H != HEADS.value:
        return f"{HEADS.value} heads (got {H})"
    if not 1 <= n <= 4:
        return f"1 <= next_n <= 4 (got {n})"
    if q_fp8.device.type != "cuda" or capability(q_fp8.device) != (9, 0):
        return f"an sm_90 GPU (got {q_fp8.device})"
    if q_fp8.data_ptr() % 16 or not q_fp8.is_contiguous():
        return "a contiguous 16-byte aligned q_fp8"
    P = index_cache.shape[0]
    if index_cache.data_ptr() % 16 or not index_cache.is_contiguous() or not 0 < P * PAGE_ROWS < 2 ** 31:
        return "a contiguous 16-byte aligned cache of 1 .. 2^31 / 66 pages"
    return None


_DESCS: dict = {}


def _cached_desc(ptr: int, dtype: torch.dtype, rows: int, cols: int, block: tuple, layout) -> TensorDescriptor:
    """The TMA descriptor of ``[rows, cols]`` ``dtype`` at ``ptr``, one object per (address, dtype, shape,
    block): a planned launch encodes each object once (``_launch._encoded``). A decode loop's q tensors come
    back at a handful of addresses from the caching allocator, the cache at one. ``layout``: the function
    making its shared layout, called only for a new descriptor (building a Gluon layout object on the host
    cost ~10 us a call on the H200's host: three of them were half of a planned call)."""
    key = (ptr, dtype, rows, cols, block)
    desc = _DESCS.get(key)
    if desc is None:
        desc = remember(_DESCS, key, TensorDescriptor(Address(ptr, dtype), [rows, cols], [cols, 1], list(block),
                                                      layout()), 256)
    return desc


_PLANNED = KernelLauncher(indexer_paged_ws_kernel, ("q_desc", "key_desc", "sc_desc", "w", "context_lens",
                                                    "block_table", "out", "scales"))


def indexer_logits_paged_planned(q_fp8: torch.Tensor, index_cache: torch.Tensor, weights: torch.Tensor,
                                 context_lens: torch.Tensor, block_table: torch.Tensor,
                                 max_context_len: int) -> torch.Tensor:
    """The public op's path into this kernel (``flashdsa.ops.indexer_logits_paged``: shapes, dtypes and, per
    its value-check mode, values already checked or sanitised; :func:`unsupported` None; ``weights`` / ``context_lens`` /
    ``block_table`` contiguous), with the default launch. Launched from a plan (``ops/_launch.py``) with the
    TMA descriptors cached per address: a plain call's host cost is the Triton kernel's, not the 126-144 us of
    :func:`indexer_logits_paged_gluon`'s JIT launch with three new descriptors."""
    B, n = q_fp8.shape[:2]
    out = torch.empty(B * n, max_context_len, dtype=torch.float32, device=q_fp8.device)
    if out.numel() == 0:
        return out
    P = index_cache.shape[0]
    q_ptr, cache_ptr = q_fp8.data_ptr(), index_cache.data_ptr()
    ptrs = (weights.data_ptr(), context_lens.data_ptr(), block_table.data_ptr(), out.data_ptr())
    key = None
    if aligned(*ptrs):   # Triton specialises on the pointers' 16-byte alignment (q and the cache: checked)
        key = (q_fp8.device, B, n, max_context_len, P, weights.stride(0), *block_table.shape, block_table.stride(0))
    f8 = torch.float8_e4m3fn
    descs = (_cached_desc(q_ptr, f8, B * n * HEADS.value, D.value, (64, D.value), tile_layout),
             _cached_desc(cache_ptr, f8, P * PAGE_ROWS, D.value, (64, D.value), tile_layout),
             _cached_desc(cache_ptr, torch.float32, P * PAGE_ROWS, 32, (2, 32), scale_layout))

    def build():
        return kernel_args(q_fp8, index_cache, weights, context_lens, block_table, max_context_len, out)

    _PLANNED(key, (*descs, *ptrs, cache_ptr), build)
    return out


def indexer_logits_paged_gluon(q_fp8: torch.Tensor, index_cache: torch.Tensor, weights: torch.Tensor,
                               context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                               out: torch.Tensor | None = None, chunk_pages: int | None = None,
                               max_ctas: int | None = None) -> torch.Tensor:
    """Paged indexer logits by this kernel, a JIT launch with its arguments checked (the public op's path is
    :func:`indexer_logits_paged_planned`). No value checks: the caller's lengths must lie in
    [0, min(max_context_len, 64 * maxp)] and the reachable page ids in [0, P).

    Args:
        q_fp8:        ``[B, n, 64, 128] float8_e4m3fn``, contiguous, 1 <= n <= 4.
        index_cache:  ``[P, 8448] uint8`` pages (64 x 128 e4m3 keys, then 64 fp32 scales), contiguous.
        weights:      ``[B * n, 64] float32``, unit stride last.
        context_lens: ``[B, n] int32``, contiguous.
        block_table:  ``[B, maxp] int32``, unit stride last.
        max_context_len: output width.
        out:          optional ``[B * n, max_context_len] float32`` destination, unit stride last.
        chunk_pages, max_ctas: as :func:`kernel_args` (tests: small items, several a CTA).

    Returns:
        ``[B * n, max_context_len] float32``: logits below each row's length, -inf from it on.
    """
    B, n = q_fp8.shape[:2]
    why = unsupported(q_fp8, index_cache)
    if why:
        raise ValueError(f"q_fp8 / index_cache: this kernel needs {why}")
    if q_fp8.dtype != torch.float8_e4m3fn or not q_fp8.is_contiguous() or q_fp8.shape[-1] != D.value:
        raise ValueError(f"q_fp8: expected a contiguous [B, n, 64, 128] float8_e4m3fn tensor, got {q_fp8.dtype} "
                         f"{tuple(q_fp8.shape)} with strides {q_fp8.stride()}")
    if weights.shape != (B * n, HEADS.value) or weights.dtype != torch.float32 or weights.stride(-1) != 1:
        raise ValueError(f"weights: expected [{B * n}, 64] float32 with unit stride last, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if context_lens.shape != (B, n) or context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        raise ValueError(f"context_lens: expected a contiguous [{B}, {n}] int32 tensor, got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32 \
            or block_table.stride(-1) != 1:
        raise ValueError(f"block_table: expected [{B}, maxp] int32 with unit stride last, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if out is None:
        out = torch.empty(B * n, max_context_len, dtype=torch.float32, device=q_fp8.device)
    elif out.shape != (B * n, max_context_len) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out: expected [{B * n}, {max_context_len}] float32 with unit stride last, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if out.numel() == 0:
        return out
    grid, kw = kernel_args(q_fp8, index_cache, weights, context_lens, block_table, max_context_len, out, chunk_pages,
                           max_ctas)
    indexer_paged_ws_kernel[grid](**kw)
    return out


def compile_sm90(n: int, chunk_pages: int = 16):
    """Compile the kernel for sm_90 for next_n ``n`` (any host: no GPU needed) and return Triton's compiled
    kernel (``asm["ptx"]``, ``asm["cubin"]``, ``metadata.shared``): the CI check and the probe's
    ``--compile-only``. ``chunk_pages``: the H200's default at B 64 ctx 32K (a CPU has no SM count to ask)."""
    B, P, max_len = 4, 64, 4096
    q = torch.empty(B, n, HEADS.value, D.value, dtype=torch.float8_e4m3fn)
    cache = torch.empty(P, INDEX_PAGE_BYTES, dtype=torch.uint8)
    args = (torch.empty(B * n, HEADS.value), torch.empty(B, n, dtype=torch.int32),
            torch.empty(B, max_len // 64, dtype=torch.int32), max_len, torch.empty(B * n, max_len))
    _, kw = kernel_args(q, cache, *args, chunk_pages)
    return compile_sm90_kernel(indexer_paged_ws_kernel, kw)
