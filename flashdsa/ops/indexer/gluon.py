"""Paged indexer logits (decode, MTP verify) as a warp-specialised Gluon kernel for Hopper (sm_90), after
DeepGEMM's sm90 paged MQA-logits schedule: a TMA warp feeding math warpgroups that each own a page (issue
#17, item 1): faster than ``paged.py``'s Triton TMA kernel at next_n 4 (0.89-0.90x), on par at 2 and 3,
0.93-1.03x at 1 (measured below). ``flashdsa.ops.indexer_logits_paged`` runs it from next_n 4 on (its rule,
and the check kernel its default mode launches first: that op's docstring and README.md), through
:func:`indexer_logits_paged_planned` (a launch plan, TMA descriptors cached per address: 31.4 us of host time
a plain call at next_n 4 in a diagnostic run, against the 126-144 us of a JIT launch with new descriptors);
:func:`indexer_logits_paged_gluon`
takes every launch knob. The interpreter cannot run Gluon: ``-m gpu`` tests it
(tests/ops/test_indexer_gluon.py), CI compiles it for sm_90; ``benchmarks/gluon_indexer_probe.py`` checks it
against the reference and times it next to DeepGEMM and the Triton kernel (``--compile-only``: no GPU).

Math: ``reference.py``: ``logit[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])``, -inf at and past
each row's length. A page's dot per draft row is ``S = K [64 keys, 128] . Q_j^T [128, 64 heads]`` (fp8 wgmma
m64n64k32, fp32 accumulator; Hopper's fp8 accumulation keeps less than fp32: ~2e-4 of the largest logit, as
for the Triton kernel), keys on M as in ``paged.py`` (README.md: the head sum stays inside a thread and its
quad). No atomics, a fixed reduction order: the same input and launch give the same bits.

A persistent CTA walks items (request b, chunk of ``CHUNK_PAGES`` pages; every request's first chunk first)
with warp-specialised partitions (``gl.warp_specialize``; the defaults per next_n in :func:`launch_config`):

* **producer** (worker, 1 warp, 40 registers): per item, the request's n query tiles by TMA into one of two
  Q buffers (``q_ready`` / ``q_free``, skipped for items with nothing to score); then per page the page id
  (scalar loads four pages ahead), one TMA copy of its [64, 128] e4m3 keys (rows 66 p .. 66 p + 63 of the
  cache viewed as [66 P, 128]) and one of its 64 fp32 scales (rows 66 p + 64, 65 of the cache viewed as
  [66 P, 32] fp32) into one of ``NBUF`` buffers (``ready`` / ``free``); pages padding the item to whole
  rounds read page 0 and are never stored; finally -inf at the item's columns past the rows' reach.
* **consumers 0 and 1** (the default partition and a worker, 4 warps each): consumer c takes the item's
  pages c, c + 2, ... in rounds of ``DP`` pages: the round's DP x n chains are issued together, then each
  row is finished as its chain completes (``warpgroup_mma_wait(S - 1 - u)``): relu, times the row's gates,
  sum over the 64 heads, times the key scales, -inf at and past the row's length, stored straight from
  the accumulator's layout. Every chain completes within its round: a chain left in flight across the
  loop's back edge (a rolling pipeline) makes ptxas serialise every wgmma (C7514), whatever the waits.
* **paired chains** (``WIDE``, the default at next_n >= 2): a consumer takes one page at a time and issues
  the draft rows in pairs, ``S = K . [Q_0; Q_1]^T`` as one m64n128k32 chain as DeepGEMM does (the keys read
  from shared memory once for two rows; rows 2 / 3 a second chain), then splits the pair's [64, 128]
  accumulator into the rows' [64, 64] ones (a relabelling of registers, checked trivial at compile time).
* **four consumers** (``consumers=4``, the default at next_n 2): DeepGEMM's four math warpgroups at 112
  registers (20 warps at 96 fill the register file), one page in flight each, and a producer warp per
  consumer filling its own ring of NBUF / 4 buffers (``SPLIT``).

Measured on the H200 (2026-12-02, Triton 3.6, CUDA-graph replay, B 64, ctx ~U(0.7, 1.3) x 32K, same runs as
the Triton kernel and DeepGEMM; ``benchmarks/gluon_indexer_probe.py``):

| next_n | this kernel, chunks of 32 / 16 / 8 pages (2-3 runs) | first version (a CTA per item, chunks 32 / 16 / 64) | Triton TMA kernel | DeepGEMM |
|---|---|---|---|---|
| 1 | 79.2-80.5 / 76.9-83.2 / 77.4 | 76.1 / 75.8 / 78.1 | 79.4-80.6 | 73.1-74.1 |
| 2 | 107.1-109.0 / 99.9-103.3 / 103.7 | 101.8 / 119.9 / 95.7 | 93.6-97.8 | 77.5-77.8 |
| 3 | 146.6-151.2 / 137.8-142.5 / 134.7 | 130.4 / 150.8 / 124.0 | 128.8-132.5 | - |
| 4 | 207.0-211.9 / 195.0-196.9 / 195.4 | 199.8 / 222.7 / 193.4 | 179.6-180.6 | - |

What bounds it: the CUDA-core epilogue, not the tensor cores and not memory. With the epilogue left out
(``diag=1``: wgmma chains only) every next_n runs in 72-78 us, and with the wgmma left out too (``diag=2``:
the producer's stream alone) 69-77 us: the memory stream is at DeepGEMM's speed and all four rows' fp8
dots fit under it. Each draft row's epilogue adds ~31 us at this shape (n 2: +30, n 4: +125), about 4x its
issue-bound minimum (32 FMNMX + 30 FFMA a thread per row and page, already contracted). Nsight Compute
(n 2): issue slots 36 %, tensor pipe 35 %, DRAM 45 %, 0.71 eligible warps a scheduler; the top stall is
``barrier`` (the partition-wide ``bar.sync`` Triton places before each mbarrier wait / arrive, 3 a page),
then long scoreboard and ``wait``. Tried and not better: a persistent grid (the first version launched a
CTA per item: n 1 76, n 2 96-102), 12 / 16 buffers, chunks of 8 / 16 / 32 / 64 pages, one page in flight
a consumer instead of two, all a round's rows finished together (``joint``: n 1 79.2 vs 80.1). A third
consumer warpgroup (n <= 2) hung at B 64 and was removed. Prepared, compiled, not yet run: ``scales_gmem``
(each page's scales loaded by the consumers from global memory a round ahead: no scale TMA, no shared
read and the partition barrier Triton puts before it, one of ~5 a round at n 2).

Measured on 2026-12-02 (fourth session, same probe, two runs; Triton kernel 76.7-80.1 / 95.3-96.2 / 131.4-132.4
/ 179.9-180.6 us, DeepGEMM 73.2-74.2 / 78.0-78.4 at n 1 / 2 / 3 / 4):

* ``scales_gmem``: slower (n 1 79.8, n 2 112.2, n 3 153.3, n 4 216.0 against the default's 79.2 / 108.5 /
  151.0 / 207.3). ``joint`` at n 2-4: 108.5 / 154.7 / 210.6 (no gain).
* ``consumers=4`` (n <= 2), DeepGEMM's shape: four consumer warpgroups at 112 registers (20 warps at 96
  fill the register file), one page in flight each, and a producer warp per consumer, each filling its
  consumer's own ring of NBUF / 4 buffers (``SPLIT``: no consumer waits behind another's page). n 2: 104.2 /
  103.2 us (8 / 16 buffers) against the default's 108.3, still 1.08x the Triton kernel and 1.32x DeepGEMM;
  n 1: 81.0 / 82.3 against 78.7. With one producer warp for all four: 109.5-111.8 at n 2; one producer warp
  a consumer with two consumers: no gain at any n. Nsight Compute (n 2, SourceCounters): the ~24 % of stall
  samples at ``NOP`` after a ``BAR.SYNC`` are idle warps at the partitions' exit (the producer group's
  padding), not a cost; with one producer for four consumers the consumers' waits for a page were 20 % of
  the samples and the producer's loop (~60 instructions a page, sharing its scheduler with four consumer
  warps) the reason; in the epilogue, FMNMX / FFMA / SHFL / FADD carry ``dispatch`` and ``selected`` stalls
  (issue-bound), and the QGMMA issue ``mio`` stalls.

* Paired chains (``wide``), same day, two runs (16 buffers; chunks of 32 / 16 pages): n 2 with four
  consumers 97.0 (8 buffers) / 94.1 / 93.2 and 99.6 / 95.2 against the Triton kernel's 93.7 / 96.0; n 3 with
  two consumers 141.5-143.3 / 133.5 against 132.0-132.4; n 4 171.4-173.5 / 161.4 against 180.6-182.0
  (0.89x). Two consumers at n 2: 104.3-111.4 (no gain there).
* The defaults then (third run, ``--cases full``, B 64 ctx ~32K unless said; Triton kernel / DeepGEMM in
  the same run): n 1 chunks of 8 pages 75.2 us (32: 77.0) vs 74.9 / 72.3; 8K 23.1 vs 24.9 / 21.1; B 128
  147.3 (64: 155.9) vs 153.2 / 140.7. n 2 96.5 vs 93.4 / 78.3 (1.23x DeepGEMM; 8K 30.1 vs 29.6 / 23.9).
  n 3 130.8 vs 130.2 (1.36x our n 2). n 4 161.9 vs 180.6 (0.90x). The bars of #17 (n 1 <= 1.0x DeepGEMM,
  n 2 <= 1.05x, n 3 <= 1.2x our n 2, n 4 <= 130 us) are not met.

* The head sum on the tensor cores (``tc_sum``, commit fbec43c, removed after): each pair's relu(S) [64 keys,
  128] as the register A operand of tf32 m64n8k8 wgmma against per-pair gate tiles (columns permuted so the
  accumulator's registers are the A fragment: no data moved, checked at compile time), chained into one
  [64 keys, 8] accumulator whose column j is row j's sum. No FFMA or shuffle left in the epilogue, only the
  relu; error within 18-21 % of its derived bound (tf32: 1.5 * 2^-10 * k_scale * sum_h |w_h| relu(s_h)).
  Slower: n 2 101.3 us against the paired default's 95.5, n 4 179.2 against 161.1 (one run; the 64 serial
  HGMMA.64x8x8 a page cost more than the FFMAs they replace).

Next: the epilogue is what is left between this kernel and DeepGEMM (78.6 us at n 2); its instructions are
already few, so the schedule around them (fewer partition barriers, Triton 3.9's 20 against 3.6's 37
``BAR.SYNC``). In-kernel value checks would save the default mode's check-kernel launch.

``per_thread_release`` (2026-12-02), the default at next_n 2. The sparse-MLA decode kernel gained 4 % from the
same change, then 2 % more from moving the barrier Triton puts after an ``mbarrier.arrive``
(``flashdsa/ops/_gluon_sync.py`` says what its hazard analysis does). Here each consumer thread frees its page
with its own arrive once it has used the page's scales (a scale load must not be in flight when the
producer's next copy lands; the per-thread arrive orders nothing before it), and the item's Q buffer the same
way. A consumer's named barriers a page in the sm_90 SASS (Triton 3.6, from the LLVM IR's debug locations):
2 -> 1 (left: the one before each ``ready`` wait, two waits on one ring's allocation); whole-kernel counts n 1
15 / 15 / 7 -> 11 / 15 / 3, n 2 (four consumers) 20 / 21 / 4 x 3 -> 18 / 21 / 2 x 3, spills 8 -> 0 B, n 4
20 / 15 / 4 -> 18 / 15 / 2. Measured on the H200 (``gluon_indexer_probe.py``, two runs, B 64 ctx ~32K, µs,
without -> with): n 1 76.1 -> 76.9, 77.3 -> 77.0; **n 2 95.6 -> 92.4, 95.6 -> 93.5** (Triton kernel 94.9 /
95.1, DeepGEMM 78.2 / 79.3); n 3 131.7 -> 131.6, 133.1 -> 132.6; n 4 161.9 -> 159.6, 162.0 -> 162.6. So on at
next_n 2 only, where it won both times; elsewhere a knob. (The public op still runs the Triton kernel at
next_n 2: 1-2 % slower than this one's raw kernel, but the Gluon path's default (device) checks cost a check
kernel's launch more, which a 2-µs gain does not pay for.)

SASS figures in this docstring up to 2026-12-02 (eighth session) came from a compile that compiled the batch size
``B`` as a constant (4) and gave no integer the divisibility-16 hint; since the ninth session ``compile_sm90``
(``flashdsa/ops/_gluon.py``) specialises as Triton's launcher does, and the defaults compile (Triton 3.6) without
spills, ``BAR.SYNC`` n 1 37 (29 with ``per_thread_release``), n 2 45 (53 and 8 / 16 B of spills without it), n 3 / n
4 39 (35 with it).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashdsa.cache.layouts import INDEX_KEY_BYTES, INDEX_PAGE_BYTES, PAGE_SIZE
from flashdsa.ops._common import remember
from flashdsa.ops._gluon import compile_sm90 as compile_sm90_kernel
from flashdsa.ops._gluon_sync import release
from flashdsa.ops._launch import Address, KernelLauncher, aligned, capability
from flashdsa.ops._triton_utils import cdiv, num_sms, prev_pow2
from flashdsa.ops.indexer.paged import PAGE_ROWS

ROWS = gl.constexpr(PAGE_ROWS)   # 66 rows of 128 B a page (the TMA kernel's cache view): 64 keys, 2 of scales
INDEX_PAGE_WORDS = gl.constexpr(INDEX_PAGE_BYTES // 4)   # a page in fp32 words, its scales from word 2048
INDEX_KEY_WORDS = gl.constexpr(INDEX_KEY_BYTES // 4)
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
def wide_layout():
    # next_n 2's two query tiles read as one [128, 128] B operand (WIDE): the same 128-B swizzle, whose pattern
    # repeats every 8 rows, so two consecutive [64, 128] tiles are one [128, 128] tile
    return gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)


@gluon.constexpr_function
def wide_acc_layout():
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
    rounds of both consumers). Chunk-major order: every request's first chunk (never empty) comes first."""
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
              SG: gl.constexpr, NC: gl.constexpr, SPLIT: gl.constexpr, PR: gl.constexpr):
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
            mbarrier.expect(bar, 64 * D + 64 * 4 * (1 - SG))   # SG: the consumers load the scales themselves
            _tma_copy(key_desc, [r, 0], bar, k_smem.index(s))
            if not SG:
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
def _issue(g0, i, g: gl.constexpr, q_smem, q0, k_smem, ready, zero, NBUF: gl.constexpr, DIAG: gl.constexpr,
           NC: gl.constexpr, SPLIT: gl.constexpr):
    """Draft row g's chain on the item's page i (the CTA's page g0 + i; row 0 first waits for the page)."""
    s, ph = _slot(g0 + i, NBUF, NC, SPLIT)
    if g == 0:
        mbarrier.wait(ready.index(s), ph)
    if DIAG == 2:
        acc = zero
    else:
        acc = warpgroup_mma(k_smem.index(s), q_smem.index(q0 + g).permute((1, 0)), zero, use_acc=False, is_async=True)
    return acc


@gluon.jit
def _gscales(scales, p_bt, i, n_pages, o_n):
    """The 64 scales of the item's page i from global memory (``scales``: the cache as fp32 words; a page past
    ``n_pages`` reads page 0's, never stored), in the accumulator's key-row layout of ``o_n``."""
    pid = gl.load(p_bt + i, mask=i < n_pages, other=0)
    return gl.load(scales + pid.to(gl.int64) * INDEX_PAGE_WORDS + INDEX_KEY_WORDS + o_n)


@gluon.jit
def _round_scales(scales, p_bt, i0, n_pages, o_n, dummy, DP: gl.constexpr, NC: gl.constexpr):
    """:func:`_gscales` of a consumer's DP pages i0, i0 + NC, ... of one round (``dummy`` for the rest)."""
    s0 = _gscales(scales, p_bt, i0, n_pages, o_n)
    s1 = dummy
    s2 = dummy
    s3 = dummy
    if DP > 1:
        s1 = _gscales(scales, p_bt, i0 + NC, n_pages, o_n)
    if DP > 2:
        s2 = _gscales(scales, p_bt, i0 + 2 * NC, n_pages, o_n)
    if DP > 3:
        s3 = _gscales(scales, p_bt, i0 + 3 * NC, n_pages, o_n)
    return s0, s1, s2, s3


@gluon.jit
def _pick(d: gl.constexpr, s0, s1, s2, s3):
    """s_d (a static pick: per-row and per-page values live in separate registers)."""
    if d == 0:
        return s0
    elif d == 1:
        return s1
    elif d == 2:
        return s2
    else:
        return s3


@gluon.jit
def _finish(U: gl.constexpr, acc, g0, i0, G: gl.constexpr, S: gl.constexpr, c0, lim_end, s_smem, free, o_n,
            w0, w1, w2, w3, l0, l1, l2, l3, out_b, stride_o, NBUF: gl.constexpr, NEW: gl.constexpr,
            DIAG: gl.constexpr, WAIT: gl.constexpr, SG: gl.constexpr, s0, s1, s2, s3, NC: gl.constexpr,
            SPLIT: gl.constexpr, PTA: gl.constexpr = False):
    """Accumulator U = d * G + g of a round whose first page is i0: wait for its chain (the oldest of the
    S - U still in flight), free the page after its last row, store the row's logits. Scales: from the
    page's shared buffer, or (``SG``) ``s_d``, loaded from global memory a round earlier."""
    d: gl.constexpr = U // G
    g: gl.constexpr = U % G
    i = i0 + NC * d
    s, _ = _slot(g0 + i, NBUF, NC, SPLIT)
    if SG:
        sc = _pick(d, s0, s1, s2, s3)
    else:
        sc = _scales(s_smem.index(s), NEW)
    if DIAG < 2 and WAIT:
        acc = warpgroup_mma_wait(S - 1 - U, deps=(acc,))
    if g == G - 1 and not PTA:
        mbarrier.arrive(free.index(s), count=1)
    if DIAG == 0:
        t0 = c0 + i * 64
        w = _pick(g, w0, w1, w2, w3)
        ln = _pick(g, l0, l1, l2, l3)
        _row_out(acc, w, sc, ln - t0, out_b + g * stride_o + t0, lim_end - t0, o_n)
    if g == G - 1 and PTA:
        # each thread once its scales are used (release() orders nothing before it: a scale load could
        # otherwise still be in flight when the producer's next copy lands)
        release(free.index(s), True)


@gluon.jit
def _pair_rows(acc):
    """A pair of rows' [64 keys, 128] accumulator split into each row's [64 keys, 64 heads] one: a relabelling
    of registers (``assert_trivial`` fails the compile if it ever were not)."""
    L: gl.constexpr = acc_layout()
    a0, a1 = gl.split(gl.permute(gl.reshape(acc, [64, 2, 64]), (0, 2, 1)))
    return gl.convert_layout(a0, L, assert_trivial=True), gl.convert_layout(a1, L, assert_trivial=True)


@gluon.jit
def _wide_page(g0, i, q_smem, qb, k_smem, s_smem, ready, free, zero, zero_w, c0, lim_end, o_n, w0, w1, w2, w3,
               l0, l1, l2, l3, out_b, stride_o, NBUF: gl.constexpr, NC: gl.constexpr, SPLIT: gl.constexpr,
               NEW: gl.constexpr, SG: gl.constexpr, sg, NEXT_N: gl.constexpr, PTA: gl.constexpr = False):
    """The item's page i with the draft rows in PAIRS, as DeepGEMM issues next_n 2: S [64 keys, 128] =
    K . [Q_0; Q_1]^T as one m64n128k32 chain (the keys read from shared memory once for both rows), rows 2 and
    3 as a second chain (row 2 alone at next_n 3); the pair's accumulator is then split into the rows' own."""
    s, ph = _slot(g0 + i, NBUF, NC, SPLIT)
    # the Q buffers as one [2 n 64, 128] tile: two consecutive [64, 128] tiles are one [128, 128] tile
    # (a Q buffer holds QS = next_n rounded up to even tiles, so every pair starts a [128, 128] tile)
    QS: gl.constexpr = NEXT_N + NEXT_N % 2
    q_pairs = _reinterpret(q_smem, gl.float8e4nv, [QS, 128, D], wide_layout(), NEW)
    mbarrier.wait(ready.index(s), ph)
    acc = warpgroup_mma(k_smem.index(s), q_pairs.index(qb * (QS // 2)).permute((1, 0)), zero_w, use_acc=False,
                        is_async=True)
    if NEXT_N == 3:
        acc2 = warpgroup_mma(k_smem.index(s), q_smem.index(qb * QS + 2).permute((1, 0)), zero, use_acc=False,
                             is_async=True)
    if NEXT_N == 4:
        acc2 = warpgroup_mma(k_smem.index(s), q_pairs.index(qb * 2 + 1).permute((1, 0)), zero_w, use_acc=False,
                             is_async=True)
    if SG:
        sc = sg
    else:
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
        acc = warpgroup_mma_wait(1, deps=(acc,))   # rows 0 and 1 while the second chain runs
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
        # each thread once the page's scales are used (see _finish)
        release(free.index(s), True)


@gluon.jit
def _consumer(WG: gl.constexpr, rc, NBUF: gl.constexpr, NEXT_N: gl.constexpr, CHUNK_PAGES: gl.constexpr,
              DP: gl.constexpr, NEW: gl.constexpr, DIAG: gl.constexpr, JOINT: gl.constexpr, SG: gl.constexpr,
              NC: gl.constexpr, SPLIT: gl.constexpr, WIDE: gl.constexpr, PTA: gl.constexpr = False):
    """Consumer WG on each of the CTA's items: pages WG, WG + 2, ... in rounds of DP pages: the round's
    S = DP * n chains issued together, then finished one by one as they complete (``_finish``), so the
    tensor cores run the rest of the round's chains (and the other consumer's) during each epilogue.
    Every chain completes within its round (ptxas serialises wgmma whose accumulators are read while a
    chain issued in an earlier loop iteration may still run: C7514)."""
    (w, context_lens, out, stride_w, stride_o, max_len, B, n_items, q_smem, k_smem, s_smem, ready, free, q_ready,
     q_free, scales, block_table, stride_bt) = rc   # the kernel's shared arguments
    L: gl.constexpr = acc_layout()
    LN: gl.constexpr = gl.SliceLayout(1, L)
    LH: gl.constexpr = gl.SliceLayout(0, L)
    S: gl.constexpr = DP * NEXT_N
    G: gl.constexpr = NEXT_N
    QS: gl.constexpr = NEXT_N + NEXT_N % 2   # Q tiles a buffer (the kernel's q_smem)
    o_n = gl.arange(0, 64, layout=LN)
    o_h = gl.arange(0, HEADS, layout=LH)
    zero = gl.zeros([64, HEADS], gl.float32, L)
    zero_w = gl.zeros([64, 128], gl.float32, wide_acc_layout())
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
            # SG: the scales of round 0's pages now, then each round those of the next (loads in flight
            # across the loop's back edge, unlike wgmma chains); else unused
            s0 = gl.zeros([64], gl.float32, LN)
            s1 = s0
            s2 = s0
            s3 = s0
            p_bt = block_table + b.to(gl.int64) * stride_bt + c0 // 64
            if SG:
                s0, s1, s2, s3 = _round_scales(scales, p_bt, WG, n_pages, o_n, s0, DP, NC)
            if WIDE:
                for r in range(n_pad // NC):
                    n0 = s0
                    if SG:   # the next page's scales, in flight during this one
                        n0 = _gscales(scales, p_bt, WG + NC * (r + 1), n_pages, o_n)
                    _wide_page(g0, WG + NC * r, q_smem, qb, k_smem, s_smem, ready, free, zero, zero_w, c0, lim_end,
                               o_n, w0, w1, w2, w3, l0, l1, l2, l3, out_b, stride_o, NBUF, NC, SPLIT, NEW, SG, s0,
                               NEXT_N, PTA)
                    s0 = n0
            else:
                for r in range(n_pad // (NC * DP)):
                    i0 = WG + NC * DP * r
                    n0 = s0
                    n1 = s1
                    n2 = s2
                    n3 = s3
                    if SG:   # the next round's, in flight during this one
                        n0, n1, n2, n3 = _round_scales(scales, p_bt, i0 + NC * DP, n_pages, o_n, s0, DP, NC)
                    a0 = _issue(g0, i0, 0, q_smem, q0, k_smem, ready, zero, NBUF, DIAG, NC, SPLIT)
                    a1 = a0
                    a2 = a0
                    a3 = a0
                    if S > 1:
                        a1 = _issue(g0, i0 + NC * (1 // G), 1 % G, q_smem, q0, k_smem, ready, zero, NBUF, DIAG, NC, SPLIT)
                    if S > 2:
                        a2 = _issue(g0, i0 + NC * (2 // G), 2 % G, q_smem, q0, k_smem, ready, zero, NBUF, DIAG, NC, SPLIT)
                    if S > 3:
                        a3 = _issue(g0, i0 + NC * (3 // G), 3 % G, q_smem, q0, k_smem, ready, zero, NBUF, DIAG, NC, SPLIT)
                    if JOINT and DIAG < 2:
                        # every chain of the round first, then the rows' epilogues together (more independent
                        # work for the scheduler than one row at a time)
                        if S == 1:
                            a0 = warpgroup_mma_wait(0, deps=(a0,))
                        elif S == 2:
                            a0, a1 = warpgroup_mma_wait(0, deps=(a0, a1))
                        elif S == 3:
                            a0, a1, a2 = warpgroup_mma_wait(0, deps=(a0, a1, a2))
                        else:
                            a0, a1, a2, a3 = warpgroup_mma_wait(0, deps=(a0, a1, a2, a3))
                    _finish(0, a0, g0, i0, G, S, c0, lim_end, s_smem, free, o_n, w0, w1, w2, w3, l0, l1, l2, l3,
                            out_b, stride_o, NBUF, NEW, DIAG, not JOINT, SG, s0, s1, s2, s3, NC, SPLIT, PTA)
                    if S > 1:
                        _finish(1, a1, g0, i0, G, S, c0, lim_end, s_smem, free, o_n, w0, w1, w2, w3, l0, l1, l2, l3,
                                out_b, stride_o, NBUF, NEW, DIAG, not JOINT, SG, s0, s1, s2, s3, NC, SPLIT, PTA)
                    if S > 2:
                        _finish(2, a2, g0, i0, G, S, c0, lim_end, s_smem, free, o_n, w0, w1, w2, w3, l0, l1, l2, l3,
                                out_b, stride_o, NBUF, NEW, DIAG, not JOINT, SG, s0, s1, s2, s3, NC, SPLIT, PTA)
                    if S > 3:
                        _finish(3, a3, g0, i0, G, S, c0, lim_end, s_smem, free, o_n, w0, w1, w2, w3, l0, l1, l2, l3,
                                out_b, stride_o, NBUF, NEW, DIAG, not JOINT, SG, s0, s1, s2, s3, NC, SPLIT, PTA)
                    s0 = n0
                    s1 = n1
                    s2 = n2
                    s3 = n3
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
    scales,        # the cache as fp32 words (SG: the consumers read the scales from it)
    max_len, B, n_chunks, stride_w, stride_bt, stride_o,
    NEXT_N: gl.constexpr, CHUNK_PAGES: gl.constexpr, NBUF: gl.constexpr, DP: gl.constexpr, REGS_C: gl.constexpr,
    REGS_P: gl.constexpr, NEW: gl.constexpr, JOINT: gl.constexpr = 0,
    SG: gl.constexpr = 0, DIAG: gl.constexpr = 0, NC: gl.constexpr = 2, WIDE: gl.constexpr = 0,
    PTA: gl.constexpr = 0,
):
    """A persistent CTA: items t = program_id, program_id + grid, ... of the B * n_chunks (request, chunk of
    CHUNK_PAGES pages) items, so the producer streams the next item's pages while the consumers finish
    this one's (one CTA's start-up per SM, not per item)."""
    n_items = B * n_chunks
    SPLIT: gl.constexpr = NC == 4   # four consumers: a producer warp and a ring of NBUF / 4 buffers each
    QS: gl.constexpr = NEXT_N + NEXT_N % 2   # Q tiles a buffer, even: the paired chains (WIDE) read two as one
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
    # variable loses its constexprs). Two consumers and one producer warp, or four consumers (DeepGEMM's count
    # of math warpgroups: 16 warps of epilogue hiding each other's latency) and a producer warp each (SPLIT),
    # as DeepGEMM has a TMA warp per math warpgroup.
    rc = (w, context_lens, out, stride_w, stride_o, max_len, B, n_items, q_smem, k_smem, s_smem, ready, free,
          q_ready, q_free, scales, block_table, stride_bt)
    rp = (q_desc, key_desc, sc_desc, context_lens, block_table, stride_bt, out, stride_o, max_len, B, n_items,
          q_smem, k_smem, s_smem, ready, free, q_ready, q_free)
    if NC == 2:
        gl.warp_specialize([
            (_consumer, (0, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, DIAG, JOINT, SG, NC, SPLIT, WIDE, PTA)),
            (_consumer, (1, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, DIAG, JOINT, SG, NC, SPLIT, WIDE, PTA)),
            (_producer, (rp, NBUF, NEXT_N, CHUNK_PAGES, DP, SG, NC, SPLIT, 0))],
            [4, 1], [REGS_C, REGS_P])
    else:
        gl.warp_specialize([
            (_consumer, (0, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, DIAG, JOINT, SG, NC, SPLIT, WIDE, PTA)),
            (_consumer, (1, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, DIAG, JOINT, SG, NC, SPLIT, WIDE, PTA)),
            (_consumer, (2, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, DIAG, JOINT, SG, NC, SPLIT, WIDE, PTA)),
            (_consumer, (3, rc, NBUF, NEXT_N, CHUNK_PAGES, DP, NEW, DIAG, JOINT, SG, NC, SPLIT, WIDE, PTA)),
            (_producer, (rp, NBUF, NEXT_N, CHUNK_PAGES, DP, SG, NC, SPLIT, 0)),
            (_producer, (rp, NBUF, NEXT_N, CHUNK_PAGES, DP, SG, NC, SPLIT, 1)),
            (_producer, (rp, NBUF, NEXT_N, CHUNK_PAGES, DP, SG, NC, SPLIT, 2)),
            (_producer, (rp, NBUF, NEXT_N, CHUNK_PAGES, DP, SG, NC, SPLIT, 3))],
            [4, 4, 4, 1, 1, 1, 1], [REGS_C, REGS_C, REGS_C, REGS_P, REGS_P, REGS_P, REGS_P])


# ---- launcher ----------------------------------------------------------------------------------------------

NBUF_DEFAULT = 8   # pages in flight a CTA: ~66 KB of keys, enough to cover DRAM latency at n = 1


def launch_config(B: int, n: int, max_len: int, device: torch.device, chunk_pages: int | None = None,
                  nbuf: int | None = None, ctas_per_sm: int | None = None, pages_in_flight: int | None = None,
                  joint: bool = False, scales_gmem: bool = False, consumers: int | None = None,
                  wide: bool | None = None, diag: int = 0, per_thread_release: bool | None = None) -> dict:
    """Chunk, pipeline depth and register budget of a launch. Defaults (measured, module docstring): next_n 1
    two consumers, two CTAs an SM, 8 buffers, chunks of 8 pages; next_n 2 four consumers with the paired chain (``wide``), 16
    buffers; next_n 3 / 4 two consumers with the paired chains, 16 buffers. ``joint``, ``pages_in_flight`` > 1
    or ``ctas_per_sm`` 2 select the round-based path (``wide`` False) unless ``wide`` is given.

    A CTA is 12 warps (the producer's warp is padded to a warpgroup, which setmaxnreg works in): 168
    registers at launch give one CTA an SM, redistributed as 232 a consumer and 40 for the producer; 80 give
    two CTAs an SM (96 a consumer: n = 1 only), so one CTA's start-up overlaps the other's stream.
    ``pages_in_flight`` (DP): pages a consumer issues per round, DP * n accumulators of 32 registers (at most
    4). ``joint``: a round's rows finished together after all its chains. ``scales_gmem``: the consumers load
    each page's scales from global memory a round ahead instead of the producer's TMA copy into shared memory
    (slower, measured). ``consumers=4`` (next_n <= 2): four consumer warpgroups, one page in flight each, a
    producer warp and a ring of nbuf / 4 buffers each. ``wide`` (next_n >= 2): the draft rows' chains in
    pairs (m64n128k32), one page in flight a consumer. Chunks (next_n >= 2): about 16 items an SM, 8 .. 64
    pages. ``per_thread_release``: every consumer thread frees a page (and the item's Q buffer) by itself
    once it has used the page's scales, instead of one thread after a barrier among the warpgroup's warps
    right after the chain's wait (Triton also puts a barrier after each such one-thread arrive:
    ``flashdsa/ops/_gluon_sync.py``); None: on at next_n 2 (2-3 % faster there, neutral at 1, 3, 4: module
    docstring)."""
    if wide is None:
        # the round-based path's own knobs (a round's rows finished together, several pages in flight, two
        # CTAs an SM) ask for that path: the paired chains would ignore or refuse them
        wide = n >= 2 and not diag and not joint and (pages_in_flight or 1) == 1 and (ctas_per_sm or 1) == 1
    if consumers is None:
        consumers = 4 if n == 2 and wide else 2
    if per_thread_release is None:
        per_thread_release = n == 2
    if nbuf is None:
        nbuf = 16 if wide else NBUF_DEFAULT
    if consumers not in (2, 4):
        raise ValueError(f"consumers: 2 or 4 (got {consumers})")
    if wide and (n < 2 or diag):
        raise ValueError(f"wide: next_n >= 2, no diag (got n {n}, diag {diag})")
    if consumers == 4 and nbuf % 4:
        raise ValueError(f"nbuf: a multiple of 4 with consumers=4 (a ring a consumer; got {nbuf})")
    if consumers == 4:
        # 20 warps (the producer's padded to a warpgroup) at 96 registers fill the register file; setmaxnreg
        # then gives 112 a consumer and 32 to the producer (an increase the pool cannot cover blocks for ever):
        # room for two accumulators, i.e. one page of n <= 2 in flight a consumer
        ctas, dp = 1, 1
        if (ctas_per_sm or 1) != 1 or (pages_in_flight or 1) != 1 or n > 2:
            raise ValueError(f"consumers=4 takes next_n <= 2, one CTA an SM, one page in flight (got n {n}, "
                             f"ctas_per_sm {ctas_per_sm}, pages_in_flight {pages_in_flight})")
    elif wide:   # the pairs' chains: one page in flight a consumer, 1 CTA an SM (up to 128 accumulator registers)
        ctas, dp = 1, 1
        if (ctas_per_sm or 1) != 1 or (pages_in_flight or 1) != 1:
            raise ValueError(f"wide takes one CTA an SM and one page in flight (got ctas_per_sm {ctas_per_sm}, "
                             f"pages_in_flight {pages_in_flight})")
    else:
        ctas = ctas_per_sm or (2 if n == 1 else 1)
        dp = pages_in_flight or (4 // n if ctas == 1 else 2 // n) or 1   # n = 3: one page
    if ctas not in (1, 2) or dp * n > 4 or dp < 1:
        raise ValueError(f"ctas_per_sm 1 or 2, pages_in_flight * n <= 4 (got {ctas}, {dp} x {n})")
    if chunk_pages is None and n == 1:
        chunk_pages = 8   # measured best at B 64 8K / 32K and B 128 32K (75.2 vs 77.0 us with 32 at B 64 32K)
    elif chunk_pages is None:
        cols = B * max(max_len, 1) // (16 * num_sms(device))
        chunk_pages = min(max(prev_pow2(max(cols // PAGE_SIZE, 1)), 8), 64)
    if chunk_pages < 1:
        raise ValueError(f"chunk_pages: >= 1 (got {chunk_pages})")
    if consumers == 4:
        regs = dict(REGS_C=112, REGS_P=32, maxnreg=96)
    elif ctas == 2:
        regs = dict(REGS_C=96, REGS_P=40, maxnreg=80)
    else:
        regs = dict(REGS_C=232, REGS_P=40, maxnreg=168)
    return dict(CHUNK_PAGES=chunk_pages, NBUF=nbuf, DP=dp, JOINT=int(joint), SG=int(scales_gmem), num_warps=4,
                ctas=ctas, DIAG=diag, NC=consumers, WIDE=int(wide), PTA=int(per_thread_release), **regs)


def _descs(q_fp8: torch.Tensor, cache_u8: torch.Tensor):
    """The three TMA descriptors of a call (see the kernel's arguments): q must be contiguous."""
    P = cache_u8.shape[0]
    qs = q_fp8.view(-1, D.value)
    keys = cache_u8.view(torch.float8_e4m3fn).view(P * PAGE_ROWS, D.value)
    scales = cache_u8.view(torch.float32).view(P * PAGE_ROWS, 32)
    return (TensorDescriptor.from_tensor(qs, [64, D.value], tile_layout()),
            TensorDescriptor.from_tensor(keys, [64, D.value], tile_layout()),
            TensorDescriptor.from_tensor(scales, [2, 32], scale_layout()))


def kernel_args(q_fp8, cache_u8, weights, context_lens, block_table, max_len, out, max_ctas: int | None = None,
                **config) -> tuple[tuple, dict]:
    """(grid, kwargs) of one launch of :func:`indexer_paged_ws_kernel` (also the probe's sm_90 compile check);
    ``max_ctas`` caps the persistent grid (tests: several items a CTA)."""
    B, n = q_fp8.shape[:2]
    cfg = launch_config(B, n, max_len, q_fp8.device, **config)
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
                               out: torch.Tensor | None = None, **config) -> torch.Tensor:
    """Paged indexer logits by this kernel with any launch knob (a JIT launch: the public op's path is
    :func:`indexer_logits_paged_planned`). No value checks: the
    caller's lengths must lie in [0, min(max_context_len, 64 * maxp)] and the reachable page ids in [0, P).

    Args:
        q_fp8:        ``[B, n, 64, 128] float8_e4m3fn``, contiguous, 1 <= n <= 4.
        index_cache:  ``[P, 8448] uint8`` pages (64 x 128 e4m3 keys, then 64 fp32 scales), contiguous.
        weights:      ``[B * n, 64] float32``, unit stride last.
        context_lens: ``[B, n] int32``, contiguous.
        block_table:  ``[B, maxp] int32``, unit stride last.
        max_context_len: output width.
        out:          optional ``[B * n, max_context_len] float32`` destination, unit stride last.
        config:       :func:`launch_config` overrides (and ``max_ctas``).

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
    grid, kw = kernel_args(q_fp8, index_cache, weights, context_lens, block_table, max_context_len, out, **config)
    indexer_paged_ws_kernel[grid](**kw)
    return out


def compile_sm90(n: int, **config):
    """Compile the kernel for sm_90 for next_n ``n`` (any host: no GPU needed) and return Triton's compiled
    kernel (``asm["ptx"]``, ``asm["cubin"]``, ``metadata.shared``): the CI check and the probe's
    ``--compile-only``."""
    B, P, max_len = 4, 64, 4096
    q = torch.empty(B, n, HEADS.value, D.value, dtype=torch.float8_e4m3fn)
    cache = torch.empty(P, INDEX_PAGE_BYTES, dtype=torch.uint8)
    args = (torch.empty(B * n, HEADS.value), torch.empty(B, n, dtype=torch.int32),
            torch.empty(B, max_len // 64, dtype=torch.int32), max_len, torch.empty(B * n, max_len))
    config.setdefault("chunk_pages", 16)   # the H200's default at B 64 ctx 32K (a CPU has no SM count to ask)
    _, kw = kernel_args(q, cache, *args, **config)
    return compile_sm90_kernel(indexer_paged_ws_kernel, kw)
