"""Paged indexer logits (decode, MTP verify) as a warp-specialised Gluon kernel for Hopper (sm_90), after
DeepGEMM's sm90 paged MQA-logits schedule: one TMA warp feeding math warpgroups that each own a page
(issue #17). ``flashdsa.ops.indexer_logits_paged`` runs it by default where it applies (:func:`unsupported`
says where not: then the Triton kernels of ``paged.py`` run; ``backend=`` forces either). The interpreter
cannot run Gluon, so CI covers the Triton path and ``-m gpu`` tests this one;
``benchmarks/gluon_indexer_probe.py`` checks it against the reference and times it next to DeepGEMM and our
Triton kernel (``--compile-only``: compiles it for sm_90 without a GPU).

Math: ``reference.py``: ``logit[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])``, -inf at and past
each row's length. The dot of a page is ``S = K [64 keys, 128] . Q_j^T [128, 64 heads]`` (fp8 wgmma, fp32
accumulator), keys on M as in ``paged.py`` (README.md: the head sum then stays inside a thread and its quad).

One CTA owns request b and the output columns [c * CHUNK, (c + 1) * CHUNK), for all n draft rows, with three
partitions (``gl.warp_specialize``):

* **producer** (worker, 1 warp): the page ids four pages ahead (scalar loads in flight while it waits), then
  per page one TMA copy of its [64, 128] e4m3 keys (rows 66 p .. 66 p + 63 of the cache viewed as
  [66 P, 128]) and one of its 64 fp32 scales (row pair 66 p + 64 of the cache viewed as [66 P, 32] fp32)
  into one of ``NBUF`` buffers (mbarriers ``ready`` / ``free``); after its last page it fills the columns
  past the rows' reach with -inf.
* **consumers 0 and 1** (the default partition and a worker, 4 warps each): consumer c takes pages c, c + 2,
  ...: it issues one async m64n64k32 wgmma chain per draft row, then finishes the rows one by one as their
  chains complete (``warpgroup_mma_wait(n - 1 - j)``): relu, times the row's head gates, sum over the 64
  heads, times the key scales, -inf at and past the row's length, stored straight from the accumulator's
  layout. While one consumer runs this epilogue the other's wgmma runs: the overlap Triton cannot schedule
  (it waits for each dot before its epilogue).

Q (n x [64, 128] e4m3) is loaded by consumer 0 into shared memory once per CTA (``q_bar``). The default
mode's device value checks (lengths in [0, hi], the chunk's page ids in [0, P - 1], NaN codes in q, the same
error words as ``paged.py``) run before the partitions fork; a CTA with a bad value reads no key and writes
-inf. No atomics, a fixed reduction order: the same input gives the same bits.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashdsa.cache.layouts import INDEX_KEY_BYTES, INDEX_PAGE_BYTES, PAGE_SIZE
from flashdsa.ops._launch import KernelLauncher, aligned, capability
from flashdsa.ops._triton_utils import cdiv, num_sms, prev_pow2

PAGE_ROWS = INDEX_PAGE_BYTES // (INDEX_KEY_BYTES // PAGE_SIZE)  # 66 rows of 128 B a page: 64 keys, 2 of scales
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
def scale_layout():
    # a page's 64 scales as TMA writes them: [2, 32] fp32, unswizzled, i.e. 64 words in order
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@gluon.jit
def _scales(buf, layout: gl.constexpr, NEW: gl.constexpr):
    """A page's [2, 32] fp32 scale tile read as its 64 scales in ``layout``."""
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if NEW:
        v = buf.reinterpret(gl.float32, [64], flat)
    else:
        v = buf._reinterpret(gl.float32, [64], flat)
    return v.load(layout)


# ---- value checks (default mode) ---------------------------------------------------------------------------

@gluon.jit
def _flag(flag, bad, value, code):
    """Store the error word of ``code`` with ``value``'s low 32 bits into ``flag`` where ``bad`` (scalars)."""
    v = gl.minimum(gl.maximum(value.to(gl.int64), -2147483648), 2147483647)
    gl.store(flag, (code.to(gl.int64) << 32) | (v & 0xFFFFFFFF), mask=bad)


@gluon.jit
def _flag_range(flag, v, m, hi, code):
    """Flag the largest of ``v`` above ``hi`` (code + 1), then the smallest below 0 (code: it wins, as the host
    check tests the minimum first). Returns 1 if any was bad, else 0 (int32 scalar)."""
    bad_lo = m & (v < 0)
    bad_hi = m & (v > hi)
    any_hi = gl.max(bad_hi.to(gl.int32), axis=0)
    any_lo = gl.max(bad_lo.to(gl.int32), axis=0)
    _flag(flag, any_hi > 0, gl.max(gl.where(bad_hi, v, 0), axis=0), code + 1)
    _flag(flag, any_lo > 0, gl.min(gl.where(bad_lo, v, 0), axis=0), code)
    return gl.maximum(any_hi, any_lo)


@gluon.jit
def _checks(q_b, stride_qn, stride_qh, lens, m_j, p_bt, page0, n_pages, i_c, flag, hi, last_page, code0,
            NEXT_N: gl.constexpr, CP: gl.constexpr):
    """The device checks of CTA (b, c) (error words code0 + i in ``_device_checks.PAGED_CHECKS``' order):
    lengths, the chunk's page ids, and (chunk 0) NaN codes in the request's queries. 1 if all good."""
    bad = _flag_range(flag, lens, m_j, hi, code0)
    LP: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    o_p = gl.arange(0, CP, layout=LP)
    m_p = o_p < n_pages
    ids = gl.load(p_bt + page0 + o_p, mask=m_p, other=0)
    bad = gl.maximum(bad, _flag_range(flag, ids, m_p, last_page, code0 + 2))
    if i_c == 0:
        LQ: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        o_h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, LQ))
        o_d = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
        nan = gl.zeros([HEADS, D], gl.int32, LQ)
        for j in gl.static_range(NEXT_N):
            x = gl.load(q_b + j * stride_qn + gl.expand_dims(o_h, 1) * stride_qh + gl.expand_dims(o_d, 0))
            nan = gl.maximum(nan, ((x.to(gl.uint8, bitcast=True) & 0x7F) == 0x7F).to(gl.int32))
        any_nan = gl.max(gl.max(nan, axis=1), axis=0)
        _flag(flag, any_nan > 0, any_nan * 0, code0 + 4)
    return bad == 0


# ---- partitions ----------------------------------------------------------------------------------------------

@gluon.jit
def _producer(key_desc, sc_desc, p_bt, page0, n_pages, out_b, stride_o, fill0, c1, k_smem, s_smem, ready, free,
              NBUF: gl.constexpr, NEXT_N: gl.constexpr, NEW: gl.constexpr):
    """Pages [page0, page0 + n_pages) of the request's table row ``p_bt``: page ids 4 ahead, one TMA copy of
    the keys and one of the scales per page into buffer i % NBUF; then -inf at columns [fill0, c1) of the
    request's NEXT_N rows (``out_b``)."""
    pa = gl.load(p_bt + page0, mask=n_pages > 0, other=0)
    pb = gl.load(p_bt + page0 + 1, mask=n_pages > 1, other=0)
    pc = gl.load(p_bt + page0 + 2, mask=n_pages > 2, other=0)
    pd = gl.load(p_bt + page0 + 3, mask=n_pages > 3, other=0)
    for i in range(n_pages):
        pn = gl.load(p_bt + page0 + i + 4, mask=i + 4 < n_pages, other=0)
        s = i % NBUF
        mbarrier.wait(free.index(s), ((i // NBUF) & 1) ^ 1)   # a fresh barrier's previous phase counts as done
        bar = ready.index(s)
        mbarrier.expect(bar, 64 * D + 64 * 4)
        r = pa * 66
        _tma_copy(key_desc, [r, 0], bar, k_smem.index(s))
        _tma_copy(sc_desc, [r + 64, 0], bar, s_smem.index(s))
        pa = pb
        pb = pc
        pc = pd
        pd = pn
    LF: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
    o_f = gl.arange(0, 128, layout=LF)
    ninf = gl.full([128], float("-inf"), gl.float32, LF)
    for j in gl.static_range(NEXT_N):
        for t in range(fill0, c1, 128):
            gl.store(out_b + j * stride_o + t + o_f, ninf, mask=t + o_f < c1)


@gluon.jit
def _row_out(acc, w, sc, len_rel, p_out, lim, o_n):
    """One draft row's logits of a page from its accumulator ``acc [64 keys, 64 heads]``: gates ``w [64]``,
    scales ``sc [64]``, -inf at key offsets >= ``len_rel``, stored at ``p_out + o_n`` below ``lim``."""
    x = gl.maximum(acc, 0.0) * gl.expand_dims(w, 0)
    s = gl.sum(x, axis=1) * sc   # k_scale > 0 leaves the relu and the head sum: one multiply per key
    s = gl.where(o_n < len_rel, s, float("-inf"))
    gl.store(p_out + o_n, s, mask=o_n < lim)


@gluon.jit
def _consumer(WG: gl.constexpr, q_b, w_b, lens_b, out_b, stride_qn, stride_qh, stride_w, stride_o, c0, c1, n_pages,
              q_smem, k_smem, s_smem, ready, free, q_bar, NBUF: gl.constexpr, NEXT_N: gl.constexpr,
              NEW: gl.constexpr):
    """Consumer WG: pages WG, WG + 2, ... of the CTA (see the module docstring)."""
    L: gl.constexpr = acc_layout()
    LN: gl.constexpr = gl.SliceLayout(1, L)
    LH: gl.constexpr = gl.SliceLayout(0, L)
    if WG == 0:
        LQ: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        o_h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, LQ))
        o_d = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
        for j in gl.static_range(NEXT_N):
            x = gl.load(q_b + j * stride_qn + gl.expand_dims(o_h, 1) * stride_qh + gl.expand_dims(o_d, 0))
            q_smem.index(j).store(x)
        fence_async_shared()
        mbarrier.arrive(q_bar, count=1)
    o_n = gl.arange(0, 64, layout=LN)
    o_hw = gl.arange(0, HEADS, layout=LH)
    w0 = gl.load(w_b + o_hw)
    l0 = gl.load(lens_b)
    p0 = out_b
    if NEXT_N > 1:
        w1 = gl.load(w_b + stride_w + o_hw)
        l1 = gl.load(lens_b + 1)
        p1 = out_b + stride_o
    if NEXT_N > 2:
        w2 = gl.load(w_b + 2 * stride_w + o_hw)
        l2 = gl.load(lens_b + 2)
        p2 = out_b + 2 * stride_o
    if NEXT_N > 3:
        w3 = gl.load(w_b + 3 * stride_w + o_hw)
        l3 = gl.load(lens_b + 3)
        p3 = out_b + 3 * stride_o
    zero = gl.zeros([64, HEADS], gl.float32, L)
    mbarrier.wait(q_bar, 0)
    for i in range(WG, n_pages, 2):
        s = i % NBUF
        mbarrier.wait(ready.index(s), (i // NBUF) & 1)
        kt = k_smem.index(s)
        a0 = warpgroup_mma(kt, q_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        if NEXT_N > 1:
            a1 = warpgroup_mma(kt, q_smem.index(1).permute((1, 0)), zero, use_acc=False, is_async=True)
        if NEXT_N > 2:
            a2 = warpgroup_mma(kt, q_smem.index(2).permute((1, 0)), zero, use_acc=False, is_async=True)
        if NEXT_N > 3:
            a3 = warpgroup_mma(kt, q_smem.index(3).permute((1, 0)), zero, use_acc=False, is_async=True)
        sc = _scales(s_smem.index(s), LN, NEW)
        t0 = c0 + i * 64
        lim = c1 - t0
        if NEXT_N == 1:
            a0 = warpgroup_mma_wait(0, deps=(a0,))
            mbarrier.arrive(free.index(s), count=1)
            _row_out(a0, w0, sc, l0 - t0, p0 + t0, lim, o_n)
        elif NEXT_N == 2:
            a0 = warpgroup_mma_wait(1, deps=(a0,))
            _row_out(a0, w0, sc, l0 - t0, p0 + t0, lim, o_n)
            a1 = warpgroup_mma_wait(0, deps=(a1,))
            mbarrier.arrive(free.index(s), count=1)
            _row_out(a1, w1, sc, l1 - t0, p1 + t0, lim, o_n)
        elif NEXT_N == 3:
            a0 = warpgroup_mma_wait(2, deps=(a0,))
            _row_out(a0, w0, sc, l0 - t0, p0 + t0, lim, o_n)
            a1 = warpgroup_mma_wait(1, deps=(a1,))
            _row_out(a1, w1, sc, l1 - t0, p1 + t0, lim, o_n)
            a2 = warpgroup_mma_wait(0, deps=(a2,))
            mbarrier.arrive(free.index(s), count=1)
            _row_out(a2, w2, sc, l2 - t0, p2 + t0, lim, o_n)
        else:
            a0 = warpgroup_mma_wait(3, deps=(a0,))
            _row_out(a0, w0, sc, l0 - t0, p0 + t0, lim, o_n)
            a1 = warpgroup_mma_wait(2, deps=(a1,))
            _row_out(a1, w1, sc, l1 - t0, p1 + t0, lim, o_n)
            a2 = warpgroup_mma_wait(1, deps=(a2,))
            _row_out(a2, w2, sc, l2 - t0, p2 + t0, lim, o_n)
            a3 = warpgroup_mma_wait(0, deps=(a3,))
            mbarrier.arrive(free.index(s), count=1)
            _row_out(a3, w3, sc, l3 - t0, p3 + t0, lim, o_n)


# ---- kernel ----------------------------------------------------------------------------------------------------

@gluon.jit
def indexer_paged_ws_kernel(
    q,             # [B, NEXT_N, 64, 128] e4m3, unit stride last
    key_desc,      # TMA descriptor: the cache as [P * 66, 128] e4m3, block [64, 128] (tile_layout)
    sc_desc,       # TMA descriptor: the cache as [P * 66, 32] fp32, block [2, 32] (scale_layout)
    w,             # [B * NEXT_N, 64] f32, unit stride last
    context_lens,  # [B, NEXT_N] i32, contiguous
    block_table,   # [B, maxp] i32, unit stride last
    out,           # [B * NEXT_N, max_len] f32, unit stride last
    max_len, stride_qb, stride_qn, stride_qh, stride_w, stride_bt, stride_o,
    flag, hi, last_page, code0,   # the device value checks (CHECK)
    NEXT_N: gl.constexpr, CHUNK_PAGES: gl.constexpr, NBUF: gl.constexpr, REGS_C: gl.constexpr,
    REGS_P: gl.constexpr, CHECK: gl.constexpr, NEW: gl.constexpr,
):
    """CTA (c, b): request b, output columns [c * CHUNK, (c + 1) * CHUNK) with CHUNK = 64 * CHUNK_PAGES."""
    i_c = gl.program_id(0)
    i_b = gl.program_id(1).to(gl.int64)
    c0 = i_c * (CHUNK_PAGES * 64)
    c1 = gl.minimum(c0 + CHUNK_PAGES * 64, max_len)
    LJ: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    o_j = gl.arange(0, 4, layout=LJ)
    m_j = o_j < NEXT_N
    lens = gl.load(context_lens + i_b * NEXT_N + o_j, mask=m_j, other=0)
    reach = gl.max(lens, axis=0)
    n_pages = gl.cdiv(gl.maximum(gl.minimum(c1, reach) - c0, 0), 64)
    q_b = q + i_b * stride_qb
    p_bt = block_table + i_b * stride_bt
    page0 = i_c * CHUNK_PAGES
    if CHECK:
        ok = _checks(q_b, stride_qn, stride_qh, lens, m_j, p_bt, page0, n_pages, i_c, flag, hi, last_page, code0,
                     NEXT_N, CHUNK_PAGES)
        n_pages = gl.where(ok, n_pages, 0)
    out_b = out + i_b * NEXT_N * stride_o
    fill0 = c0 + n_pages * 64

    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [NEXT_N, 64, D], tile_layout())
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [NBUF, 64, D], tile_layout())
    s_smem = gl.allocate_shared_memory(gl.float32, [NBUF, 2, 32], scale_layout())
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    mbarrier.init(q_bar, count=1)
    fence_async_shared()

    w_b = w + i_b * NEXT_N * stride_w
    lens_b = context_lens + i_b * NEXT_N
    gl.warp_specialize([
        (_consumer, (0, q_b, w_b, lens_b, out_b, stride_qn, stride_qh, stride_w, stride_o, c0, c1, n_pages,
                     q_smem, k_smem, s_smem, ready, free, q_bar, NBUF, NEXT_N, NEW)),
        (_consumer, (1, q_b, w_b, lens_b, out_b, stride_qn, stride_qh, stride_w, stride_o, c0, c1, n_pages,
                     q_smem, k_smem, s_smem, ready, free, q_bar, NBUF, NEXT_N, NEW)),
        (_producer, (key_desc, sc_desc, p_bt, page0, n_pages, out_b, stride_o, fill0, c1, k_smem, s_smem, ready,
                     free, NBUF, NEXT_N, NEW)),
    ], [4, 1], [REGS_C, REGS_P])


# ---- launcher ----------------------------------------------------------------------------------------------

NBUF_DEFAULT = 8   # pages in flight a CTA: ~66 KB of keys, enough to cover DRAM latency at n = 1


def launch_config(B: int, n: int, max_len: int, device: torch.device, chunk_pages: int | None = None,
                  nbuf: int = NBUF_DEFAULT) -> dict:
    """Chunk and register budget of a launch. n <= 2: two CTAs an SM (maxnreg 112: 9 warps x 2 x 112 x 32
    <= 64 K registers), so one CTA's start-up (lengths, Q, first pages) overlaps the other's stream; n 3-4: one
    CTA an SM (each row's accumulator is 32 registers a thread). Chunks: about 8 (n <= 2) or 4 CTAs an SM,
    8 .. 64 pages."""
    two = n <= 2
    if chunk_pages is None:
        per_sm = 8 if two else 4
        cols = B * max(max_len, 1) // (per_sm * num_sms(device))
        chunk_pages = min(max(prev_pow2(max(cols // PAGE_SIZE, 1)), 8), 64)
    if chunk_pages < 1 or chunk_pages & (chunk_pages - 1):
        raise ValueError(f"chunk_pages: a power of two >= 1 (got {chunk_pages})")
    return dict(CHUNK_PAGES=chunk_pages, NBUF=nbuf, REGS_C=120 if two else 240, REGS_P=40,
                maxnreg=112 if two else 224, num_warps=4)


def _descs(cache_u8: torch.Tensor):
    """The two TMA descriptors of an indexer cache ``[P, 8448] uint8`` (see the kernel's arguments)."""
    P = cache_u8.shape[0]
    keys = cache_u8.view(torch.float8_e4m3fn).view(P * PAGE_ROWS, D.value)
    scales = cache_u8.view(torch.float32).view(P * PAGE_ROWS, 32)
    return (TensorDescriptor.from_tensor(keys, [64, D.value], tile_layout()),
            TensorDescriptor.from_tensor(scales, [2, 32], scale_layout()))


def kernel_args(q_fp8, cache_u8, weights, context_lens, block_table, max_len, out, flag=None, hi=0, code0=0,
                check=False, **config) -> tuple[tuple, dict]:
    """(grid, kwargs) of one launch of :func:`indexer_paged_ws_kernel` (also the probe's sm_90 compile check)."""
    B, n = q_fp8.shape[:2]
    cfg = launch_config(B, n, max_len, q_fp8.device, **config)
    key_desc, sc_desc = _descs(cache_u8)
    grid = (cdiv(max_len, 64 * cfg["CHUNK_PAGES"]), B)
    return grid, dict(
        q=q_fp8, key_desc=key_desc, sc_desc=sc_desc, w=weights, context_lens=context_lens, block_table=block_table,
        out=out, max_len=max_len, stride_qb=q_fp8.stride(0), stride_qn=q_fp8.stride(1), stride_qh=q_fp8.stride(2),
        stride_w=weights.stride(0), stride_bt=block_table.stride(0), stride_o=out.stride(0),
        flag=context_lens if flag is None else flag, hi=hi, last_page=cache_u8.shape[0] - 1, code0=code0,
        NEXT_N=n, CHECK=check, NEW=NEW_API, **cfg)


def unsupported(q_fp8: torch.Tensor, index_cache: torch.Tensor) -> str | None:
    """Why this kernel cannot run a (validated) ``indexer_logits_paged`` call, or None when it can: an sm_90
    GPU, 64 heads (DeepSeek-V3.2's indexer; other head counts run the Triton kernels), 1 <= next_n <= 4 (one
    m64n64 accumulator per draft row; MTP verify with more drafts runs the Triton kernels), a 16-byte aligned
    contiguous cache of fewer than 2^31 / 66 pages (TMA's int32 row coordinates)."""
    B, n, H, _ = q_fp8.shape
    if H != HEADS.value:
        return f"{HEADS.value} heads (got {H})"
    if not 1 <= n <= 4:
        return f"1 <= next_n <= 4 (got {n})"
    if q_fp8.device.type != "cuda" or capability(q_fp8.device) != (9, 0):
        return f"an sm_90 GPU (got {q_fp8.device})"
    P = index_cache.shape[0]
    if index_cache.data_ptr() % 16 or not index_cache.is_contiguous() or not 0 < P * PAGE_ROWS < 2 ** 31:
        return "a contiguous 16-byte aligned cache of 1 .. 2^31 / 66 pages"
    return None
