"""Sparse MLA decode over the fp8 656-B paged cache as a warp-specialised Gluon kernel for Hopper (sm_90),
after FlashMLA's sm90 sparse fp8 decode schedule (issue #16). ``flashdsa.ops.sparse_mla_decode`` runs it by
default where it applies (:func:`unsupported` says where not: then the Triton kernels run; ``backend=``
forces either). The interpreter cannot run Gluon, so CI covers the Triton path and ``-m gpu`` tests this
one. ``benchmarks/gluon_sparse_mla_probe.py`` checks every variant against ``reference.py`` and times it
next to FlashMLA and our Triton default; ``--compile-only`` compiles it for sm_90 without a GPU.

Math: ``reference.py`` (s = sm_scale q.k over 576 dims, softmax over the valid selected tokens, out =
P V over the first 512 dims, lse natural log; index -1 / negative / >= N skipped; a row with no valid
index gives out 0 and lse -inf). P is rounded to bf16 for the P V product. The latent is dequantised with
the reference's arithmetic (e4m3 -> fp32, times the fp32 scale, rounded once to bf16; DEQ 0) for any
scale. The default (``ws-pipe-pf2-os-ql-pr-sv-ks-pa6-qs-hp``) is faster than the earlier ``-dq4``, which used FlashMLA's
cheaper arithmetic (e4m3 -> bf16 times the scale rounded to bf16, DEQ 4: bit-identical for the power-of-two
scales flashdsa's cache writers and FlashMLA's quantiser write, the reference on a cache with every scale
rounded to bf16 otherwise; :func:`_dequant`).

One CTA owns one query row (b, s_q) and 64 heads (h_q 128: two CTAs per row, next to each other in the
grid so the second one's gathers hit L2) and walks the top-k list in steps of 64 tokens with three
warpgroups (``gl.warp_specialize``, 12 warps at ``maxnreg`` 168, registers moved by setmaxnreg):

* **producer** (worker, 4 warps, 152 registers): gathers the step's 64 rows of 656 B with 16-B global
  loads, all issued before it waits for a free buffer (mbarrier ``k_free``), dequantises the latent and
  writes the step's tile — 4 x [64, 128] latent + [64, 64] rope, bf16, NVMMA-swizzled — and a [64]
  additive mask (0 / -inf) into one of two shared buffers, then ``fence_async_shared`` + ``k_ready``.
  The default (``PIPE``, :func:`_producer_pipe`) takes the row pointers of step i + 1 from slots loaded
  during step i, and with ``PREFETCH`` asks L2 for the rows of step i + PREFETCH at the end of step i
  (``prefetch.global.L2`` per 128-B line).
* **consumer 0** (default partition, 4 warps, 192 registers): S = Q K^T [64 heads, 64 tokens] over 576
  dims (36 async m64n64k16 wgmma, Q and K from shared memory, one wait), the online softmax in the exp2
  domain, P (bf16) and the rescale factor alpha to shared memory for consumer 1 (``p_ready`` / ``p_free``),
  then O[:, :256] += P V (P from registers, 8 m64n128k16); the default (``HPL``) hands P over after
  issuing its own P V, so the P stores run under it. ``OVERLAP`` (216 registers): step i + 1's S is
  issued before step i's P V and only S is waited for (``warpgroup_mma_wait(2)``), so P V runs under the
  softmax (FA3's intra-warpgroup pipelining).
* **consumer 1** (worker, 4 warps, 160 registers): O[:, 256:] += P V with P and V from shared memory.

A buffer is free again (``k_free``) when both consumers' P V on it completed; in the default every
consumer thread arrives by itself (count 256, ``flashdsa.ops._gluon_sync.release``), not one thread after
a barrier among the warpgroup's warps (-4 % at s_q 1 and 2). Triton 3.6's shared-memory hazard analysis puts a barrier among
a warpgroup's warps after each one-thread ``mbarrier.arrive`` in front of the next shared-memory access,
and one in front of the first S wgmma inside the loop for Q's stores before it: the default takes the
latter once before the loop (``QSYNC``) and moves the former behind the P V wait (``HPL``), where the warps
are in step anyway (-2 %; consumer 0's loop meets 2 barriers a step, consumer 1's 1). Consumer 1 never
computes S (the Triton kernels compute it twice). Shared memory 230,720 B: Q 72 KB + 2 x 72.5 KB of K/V +
8 KB of P (+ masks, alpha, 1/l, barriers); a third buffer does not fit in 227 KB. SASS (sm_90, Triton 3.6):
the HGMMAs are back to back with one ``WARPGROUP.DEPBAR`` per group (none after each instruction), spills
stores 8-104 B (ptxas -v; scalars of the producer / consumer 0 loops), no ptxas serialisation note.

Measured on the H200 (Triton 3.6, CUDA-graph replay, 4 runs of the probe; B64 s_q1 h128 top-2048):

* Correct: every variant matches the Triton kernel's errors case by case (the same max |err| on all 10
  probe cases: ragged / mixed -1, -7, >= N / all-empty rows / NaN bytes in skipped slot 0 / topk 100 ... 2048
  / h 16, 64, 128, NaN-poisoned outputs); both pass 9 of 10 under the Triton tests' tolerance and fail the
  same one (B2 s_q2 h128 topk192: |err| 1.5e-3 on a 0.022 element, bf16 P on a short list).
* Time (2026-12-02, two probe runs in opposite orders): default ``ws-pipe-pf2-os-ql-pr-sv-ks-pa6-qs-hp``
  102.2 / 102.3 us vs FlashMLA 94.6 / 94.7 (1.08x); B64 s_q2 196.2 / 196.0 vs 179.3 / 179.6 (1.09x); h64
  (B128 s_q2) 213.3 / 213.1 vs 234.0 / 234.7 (0.91x). Before it ``-pa6`` 104.6 / 104.3 us vs FlashMLA 94.8
  / 95.3 (1.103 / 1.094x); B64 s_q2 199.5 / 200.0 vs 179.1 / 179.5 (1.114x); h64 (B128 s_q2) 219.0 / 219.2
  vs 235.6 / 235.2 (0.93x). P handed over through named barriers (``-nr`` / ``-nb``, FlashMLA's way;
  sparse_mla/README.md): 102.7 / 109.3 against 102.2, removed. Before that, ``ws-pipe-pf2-os-ql-pr-sv`` 108.8 / 108.2 us
  vs FlashMLA 94.7 / 94.7 (1.149 / 1.143x) and our Triton default 178.5 (0.61x); B64 s_q2 206.1 / 207.4 vs
  179.9 / 179.6 (1.146 / 1.155x); h64 (B128 s_q2) 220.0 / 219.6 vs 235.2 / 235.7 (0.94 / 0.93x). Without
  the 16-B scale loads (``-pr``) 109.1-109.9 / 209.3-209.7 / 221.5-223.1 in these and two earlier runs;
  there the previous default (``-dq4``, row-major gathers) 109.7-110.2 / 210.4-210.8 / 223.7-224.1 and the
  exact arithmetic with row-major gathers (``ws-pipe-pf2-os-ql``) 111.5-111.6 / 215.6-215.8 / 235.8-235.9.
  Earlier: the default before the fixed-cost fixes (``ws-pipe-pf2``) 116.6 against their 111.9.
* What bounds it: the consumers alone (``diag-nodeq``: no gathers, no dequantisation) already take 104 us
  (92 us with ``OVERLAP``; 101.7 with the fixed-cost fixes, 1.07x FlashMLA's whole kernel), i.e. ~3.2 us
  per 64-token step against 2,176 tensor cycles (~1.2 us): QK as m64n64k16 with both operands in shared memory needs 128 B/clk of shared-memory bandwidth, all of it, and
  the softmax sits between QK and P V. FlashMLA's kernel has the same QK shape and runs 2.95 us per step.
  The producer adds 12 us on top (``hot64``, every step on the same 64 rows: 108 us, so ~8 us is DRAM
  latency the 2-buffer pipeline cannot hide).
* Won: slots one step ahead (135.6 -> 129.6 us), per-line L2 prefetch 2 steps ahead (-> 116.3; 3 ahead
  118.0, and h64 worse), Q's loads all issued before its stores and O leaving through the Q tiles as 16-B
  stores (``OSTAGE`` / ``QL``, gluon_bf16.py's fixed-cost fixes: -> 111.9), FlashMLA's bf16 scale multiply
  (DEQ 4, -1 / -4 %), then the ``PAIRED_ROWS`` gather layout (:func:`gather_layout`: row-major's loads,
  conflict-free stores), which gave the exact arithmetic DEQ 4's speed or better (-1.5 / -3 / -6 % against
  the exact arithmetic with row-major gathers), and a row's four scales as one 16-B load (``-sv``: -0.3 to
  -1.7 %, hot64 -5 us). With DEQ 4 the paired-rows layout was 3 % slower (113.8-114.0 /
  214.5-215.1 / 227.7-227.9 against 110.2-110.5 / 210.1-212.1 / 224.2-224.3, two runs), though 1-2 us
  faster with every step on the same 64 rows (hot64): not understood; the SASS of the two differs only in
  the producer's order of stores.
* Lost: ``OVERLAP`` with the real producer (124-148 us: the consumer gets faster alone, 104 -> 92, but
  the 216 registers it needs leave the producer 128 and the dequantisation then competes with the softmax:
  ``diag-ovl-raw`` without the arithmetic 110.6); the integer-pipe dequantisation (DEQ 1: +10 % without
  the prefetch, +2 % with it at h128, -3 % at h64); ``cp.async.bulk.prefetch.L2`` per row (+17 us, +22 us
  even with every row in L2: the bulk ops themselves are slow); carrying the gathered
  bytes across iterations (a u8 tensor in a loop costs a 32-bit register per byte: 4.6 KB of spills);
  P loaded into consumer 1's registers (serialises every wgmma at 160 registers).

SASS figures in this docstring up to 2026-12-02 (eighth session) came from a compile that gave every integer
argument the divisibility-16 hint, the kernel's ``do_not_specialize`` ones too; since the ninth session
``compile_sm90`` (``flashdsa/ops/_gluon.py``) specialises as Triton's launcher does, and the default compiles
(Triton 3.6) to 92 / 88 B of spills (was quoted 80 / 72 B), the same 11 / 11 / 3 / 2 named barriers.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from flashdsa.cache.layouts import MLA_FP8_BYTES
from flashdsa.ops._gluon import compile_sm90 as compile_sm90_kernel
from flashdsa.ops._gluon_sync import release as _release, warps_barrier as _warps_barrier
from flashdsa.ops._launch import KernelLauncher, aligned, capability
from flashdsa.ops._triton_utils import cdiv

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)
BLOCK_H = gl.constexpr(64)   # heads per CTA: the wgmma M side of one warpgroup
BLOCK_N = gl.constexpr(64)   # selected tokens per step
MAXNREG = 168  # 12 warps x 32 threads x 168 registers = 64,512 <= 65,536: one CTA per SM


# ---- layouts ------------------------------------------------------------------------------------------

@gluon.constexpr_function
def mma_layout(n):
    # wgmma accumulator of one warpgroup (4 warps along M = 64 rows), instruction m64 n k16
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


# the producer's gather layouts (GATHER): 0 row-major (8 threads a row, 4 rows a warp), 1 rows-first, 2 paired
# rows (row-major's loads, conflict-free stores)
ROW_MAJOR, ROWS_FIRST, PAIRED_ROWS = 0, 1, 2


@gluon.constexpr_function
def gather_layout(mode):
    """[64 rows, 128 bytes] of one latent group, 16 B a thread (one 16-B global load), stored dequantised (16
    bf16 a thread as two 16-B stores) into the 128-B-swizzled [64, 128] bf16 tile, whose two 64-column
    halves lie 8 KB apart on the same banks. Shared memory serves a 16-B store in phases of 8 lanes.

    * ``ROW_MAJOR`` (the first version): 8 threads a row, 4 rows a warp. The 8 lanes of a phase are one
      row's and write the same 4 bank groups in both halves: 2 wavefronts a phase (ncu on the H200: 8
      wavefronts per store against an ideal 4).
    * ``ROWS_FIRST``: 8 rows a warp in lane order, 4 threads a row, each holding two 16-B pieces 64 bytes
      apart. Eight rows in a phase land on 8 different bank groups (the swizzle XORs the 16-B chunk with
      the row), one wavefront a phase; measured slower all the same (VARIANTS' ``-r8``): a warp's 16-B
      loads then touch twice as many rows' lines.
    * ``PAIRED_ROWS``: a warp's load covers row-major's 4 rows x 128 bytes, with the lanes reordered (a
      linear layout): lanes 0-3 hold columns 0-63 of row 0, lanes 4-7 the same columns of row 1, lanes 8-15
      columns 64-127 of both. A phase's two rows differ in the swizzle's low bit, so its 8 lanes hit 8
      bank groups: row-major's global loads with conflict-free stores.

    tests/ops/test_sparse_mla_gluon.py derives each layout's conflicts from Triton's linear layouts."""
    if mode == ROWS_FIRST:
        return gl.BlockedLayout([1, 16], [8, 4], [4, 1], [0, 1])
    if mode == PAIRED_ROWS:
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [16, 0], [32, 0]],
            lane_bases=[[0, 16], [0, 32], [1, 0], [0, 64], [2, 0]],
            warp_bases=[[4, 0], [8, 0]], block_bases=[], shape=[64, 128])
    return gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])


@gluon.constexpr_function
def rope_layout(mode):
    """[64 rows, 64 bf16] of rope, 16 B a thread, with the rows of :func:`gather_layout` (so the row
    pointers pass between the two without a shuffle through shared memory); PAIRED_ROWS: columns 0-63 of a
    row over lanes 0-3 and 8-11, so a phase's two rows again hit 8 bank groups."""
    if mode == ROWS_FIRST:
        return gl.BlockedLayout([1, 8], [8, 4], [4, 1], [0, 1])
    if mode == PAIRED_ROWS:
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [16, 0], [32, 0]],
            lane_bases=[[0, 16], [0, 32], [1, 0], [0, 8], [2, 0]],
            warp_bases=[[4, 0], [8, 0]], block_bases=[], shape=[64, 64])
    return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.constexpr_function
def scales_layout(mode):
    """[64 rows, 4] fp32: a row's four scales (bytes 512-527, 16-B aligned) in one thread as one 16-B load,
    rows in the threads of :func:`gather_layout` (replicated over its column lanes), so each [64] column
    split off it is already in the gather layout's row slice. Rows-first gets the row-major one: still
    right (the split columns are converted), but not free."""
    z = [0, 0]
    if mode == PAIRED_ROWS:
        lanes = [z, z, [1, 0], z, [2, 0]]
    else:
        lanes = [z, z, z, [1, 0], [2, 0]]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [16, 0], [32, 0]], lane_bases=lanes,
                                      warp_bases=[[4, 0], [8, 0]], block_bases=[], shape=[64, 4])


@gluon.constexpr_function
def tile_smem(rows, cols):
    # bf16 tile read by wgmma (128-B swizzle)
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


@gluon.jit
def _klat(k_lat, b, g: gl.constexpr, KSPLIT: gl.constexpr):
    """The [64, 128] bf16 latent tile of group g in K/V buffer b. KSPLIT: k_lat is a tuple of four
    allocations, one per group ([NBUF, 64, 128] each); else one [NBUF * 4, 64, 128] allocation. Triton's
    shared-memory hazard analysis works per allocation: stores to one allocation by different threads are
    fenced from each other by a barrier among the writing warps (one between each two latent groups of a
    step in the single allocation), stores to different allocations are not."""
    if KSPLIT:
        return k_lat[g].index(b)
    else:
        return k_lat.index(b * 4 + g)


# ---- producer -----------------------------------------------------------------------------------------

@gluon.jit
def _prefetch_rows(p_row, valid, o_l):
    """Ask L2 for the 6 128-B lines of each valid 656-B row (``prefetch.global.L2``: an LSU op, no register
    result, nothing to wait for). p_row / valid [64] in SliceLayout(1, L), o_l = 128 * arange(8) in
    SliceLayout(0, L); a row starts 16-B aligned, so its bytes lie in the lines of offsets 0..640."""
    m = valid[:, None] & (o_l[None, :] < 656)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [p_row[:, None] + o_l[None, :], m.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gather(p_row, valid, o_c, o_r, SR: gl.constexpr, SCV: gl.constexpr = False, GATHER: gl.constexpr = 0):
    """One step's loads of the rows at ``p_row`` (``valid`` masks; [64] in the latent layout): [64, 128] u8 x 4
    latent groups, [64] f32 x 4 scales (byte 512 + 4 g; SCV: one 16-B load a row, :func:`scales_layout`),
    [64, 64] bf16 rope (byte 528, rows in layout SR)."""
    p_lat = p_row[:, None] + o_c[None, :]
    m_lat = valid[:, None]
    b_u0 = gl.load(p_lat, mask=m_lat, other=0)
    b_u1 = gl.load(p_lat + 128, mask=m_lat, other=0)
    b_u2 = gl.load(p_lat + 256, mask=m_lat, other=0)
    b_u3 = gl.load(p_lat + 384, mask=m_lat, other=0)
    if SCV:
        LS: gl.constexpr = scales_layout(GATHER)
        SS: gl.constexpr = gl.SliceLayout(1, LS)
        p_sc = (gl.convert_layout(p_row, SS) + 512).to(gl.pointer_type(gl.float32))
        o_s = gl.arange(0, 4, gl.SliceLayout(0, LS))
        b_sc = gl.load(p_sc[:, None] + o_s[None, :], mask=gl.convert_layout(valid, SS)[:, None], other=0.0)
        # [64, 4] -> (scale 0 and 2, scale 1 and 3) -> the four columns
        s02, s13 = gl.split(b_sc.reshape([64, 2, 2]))
        b_s0, b_s2 = gl.split(s02)
        b_s1, b_s3 = gl.split(s13)
        SG: gl.constexpr = p_row.type.layout
        b_s0 = gl.convert_layout(b_s0, SG)
        b_s1 = gl.convert_layout(b_s1, SG)
        b_s2 = gl.convert_layout(b_s2, SG)
        b_s3 = gl.convert_layout(b_s3, SG)
    else:
        p_sc = (p_row + 512).to(gl.pointer_type(gl.float32))
        b_s0 = gl.load(p_sc, mask=valid, other=0.0)
        b_s1 = gl.load(p_sc + 1, mask=valid, other=0.0)
        b_s2 = gl.load(p_sc + 2, mask=valid, other=0.0)
        b_s3 = gl.load(p_sc + 3, mask=valid, other=0.0)
    p_rope = (gl.convert_layout(p_row, SR) + 528).to(gl.pointer_type(gl.bfloat16))
    b_rope = gl.load(p_rope[:, None] + o_r[None, :], mask=gl.convert_layout(valid, SR)[:, None], other=0.0)
    return b_u0, b_u1, b_u2, b_u3, b_s0, b_s1, b_s2, b_s3, b_rope


@gluon.jit
def _stage(tiles, valid, k_lat, k_rope, k_bias, k_ready, b, DEQ: gl.constexpr, KSPLIT: gl.constexpr = False):
    """Dequantise a step's :func:`_gather` tiles (e4m3 -> fp32, times the group's scale, rounded once to bf16
    as reference.py; DEQ: :func:`_dequant`) into buffer ``b`` with the [64] additive score mask (0 valid,
    -inf skipped), then publish it to the consumers."""
    b_u0, b_u1, b_u2, b_u3, b_s0, b_s1, b_s2, b_s3, b_rope = tiles
    _klat(k_lat, b, 0, KSPLIT).store(_dequant(b_u0, b_s0, DEQ))
    _klat(k_lat, b, 1, KSPLIT).store(_dequant(b_u1, b_s1, DEQ))
    _klat(k_lat, b, 2, KSPLIT).store(_dequant(b_u2, b_s2, DEQ))
    _klat(k_lat, b, 3, KSPLIT).store(_dequant(b_u3, b_s3, DEQ))
    k_rope.index(b).store(b_rope)
    k_bias.index(b).store(gl.where(valid, 0.0, float("-inf")))
    # generic-proxy stores -> async-proxy (wgmma) reads
    fence_async_shared()
    mbarrier.arrive(k_ready.index(b), count=1)


@gluon.jit
def _producer(kv, idx, stride_kv_page, stride_kv_row, stride_i_row, n_slots, topk, n_steps, n_hb,
              k_lat, k_rope, k_bias, k_ready, k_free, NBUF: gl.constexpr, PREFETCH: gl.constexpr, DEQ: gl.constexpr,
              GATHER: gl.constexpr, SCV: gl.constexpr = False,
              KSPLIT: gl.constexpr = False):
    """Gather, dequantise and stage the K/V tile of every step, slots loaded in-step (variant "ws", the
    first version; :func:`_producer_pipe` replaces it). PREFETCH, DEQ, GATHER, SCV and KSPLIT are ignored (exact
    dequantisation, row-major gathers)."""
    LG: gl.constexpr = gather_layout(0)   # [64 rows, 128 bytes], row-major
    LR: gl.constexpr = rope_layout(0)     # [64 rows, 64 bf16], LG's rows
    i_row = (gl.program_id(0) // n_hb).to(gl.int64)
    p_idx = idx + i_row * stride_i_row
    o_n = gl.arange(0, BLOCK_N, gl.SliceLayout(1, LG))
    o_c = gl.arange(0, 128, gl.SliceLayout(0, LG))
    o_r = gl.arange(0, 64, gl.SliceLayout(0, LR))

    for i in range(n_steps):
        b = i % NBUF
        k0 = i * BLOCK_N
        # [64] slots of this step; -1 past the list. Invalid slots read nothing (masked, zeros), so a NaN
        # in slot 0 of the cache cannot reach P V through 0 * NaN.
        b_slot = gl.load(p_idx + k0 + o_n, mask=k0 + o_n < topk, other=-1)
        valid = (b_slot >= 0) & (b_slot < n_slots)
        b_slot = gl.where(valid, b_slot, 0)
        p_row = kv + (b_slot // 64).to(gl.int64) * stride_kv_page + (b_slot % 64).to(gl.int64) * stride_kv_row
        # every load of the step is issued before the wait for a free buffer: the gather latency overlaps
        # the consumers' work on the previous steps
        tiles = _gather(p_row, valid, o_c, o_r, gl.SliceLayout(1, LR))
        mbarrier.wait(k_free.index(b), ((i // NBUF) & 1) ^ 1)
        _stage(tiles, valid, k_lat, k_rope, k_bias, k_ready, b, 0, KSPLIT)


@gluon.jit
def _slots(p_idx, k0, topk, n_slots, kv, stride_kv_page, stride_kv_row, L: gl.constexpr):
    """[64] slots of the step at k0 in layout L -> (row pointers, valid). -1 past the list; skipped slots
    point at slot 0 and every load of them is masked (zeros), so a NaN there cannot reach P V via 0 * NaN."""
    o_n = k0 + gl.arange(0, BLOCK_N, L)
    b_slot = gl.load(p_idx + o_n, mask=o_n < topk, other=-1)
    valid = (b_slot >= 0) & (b_slot < n_slots)
    b_slot = gl.where(valid, b_slot, 0)
    return kv + (b_slot // 64).to(gl.int64) * stride_kv_page + (b_slot % 64).to(gl.int64) * stride_kv_row, valid


@gluon.jit
def _dequant(b_u, b_sc, DEQ: gl.constexpr):
    """[64, 128] e4m3 bytes times their row's fp32 scale [64] -> [64, 128] bf16.

    DEQ 0 (exact, reference.py's rounding): e4m3 -> fp32, times the scale, rounded once to bf16 — per
    two elements one e4m3x2 -> f16x2 unpack, two f16 -> f32, two FMUL and one f32x2 -> bf16x2 pack, the
    unpack and pack on the conversion pipe.
    DEQ 1 (integer pipe + one bf16x2 multiply): e4m3 bits moved into bf16 bits (prmt / shr / and / or:
    the value times 2^-120, subnormals included) times bf16(scale * 2^120). Bit-identical to DEQ 0 when
    the scale is a power of two (the ue8m0 scales FlashMLA's quantiser and ours write) below 2^8; a
    non-power-of-two scale is rounded to bf16 first (<= 1 bf16 ulp off), and e4m3 NaN bytes come out finite.
    """
    if DEQ == 0:
        return (b_u.to(gl.float8e4nv, bitcast=True).to(gl.float32) * b_sc[:, None]).to(gl.bfloat16)
    elif DEQ == 4:
        # FlashMLA's arithmetic: e4m3 -> bf16 (exact), times bf16(scale) in bf16 (one HMUL2 per two
        # elements instead of two FMUL); bit-identical to DEQ 0 for power-of-two scales
        return b_u.to(gl.float8e4nv, bitcast=True).to(gl.float32).to(gl.bfloat16) * b_sc.to(gl.bfloat16)[:, None]
    elif DEQ == 2:
        # diagnostic (wrong results): no dequantisation and, the bytes now unused, no gathers either —
        # what the consumers alone cost
        return gl.zeros_like(b_u, dtype=gl.bfloat16)
    elif DEQ == 3:
        # diagnostic (wrong results): the bytes spread into bf16 lanes by two prmt, no arithmetic — what
        # the gathers and stores cost without the dequantisation's arithmetic
        return gl.inline_asm_elementwise("prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424;", "=r,=r,r",
                                         [b_u], dtype=gl.bfloat16, is_pure=True, pack=4)
    else:
        sc = gl.broadcast((b_sc * 1.329227995784916e36).to(gl.bfloat16)[:, None], b_u)[0]   # * 2^120
        # per 4 bytes b0..b3 ($2): lo = bf16x2(b0, b1), hi = bf16x2(b2, b3), each times the scale pair $3
        return gl.inline_asm_elementwise(
            "{ .reg .b32 x, y, t;\n"
            "prmt.b32 x, $2, 0, 0x1404; shr.b32 y, x, 4; and.b32 t, x, 0x80008000;\n"
            "and.b32 y, y, 0x07F007F0; or.b32 y, y, t; mul.rn.bf16x2 $0, y, $3;\n"
            "prmt.b32 x, $2, 0, 0x3424; shr.b32 y, x, 4; and.b32 t, x, 0x80008000;\n"
            "and.b32 y, y, 0x07F007F0; or.b32 y, y, t; mul.rn.bf16x2 $1, y, $3; }",
            "=r,=r,r,r,r", [b_u, sc], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def _producer_pipe(kv, idx, stride_kv_page, stride_kv_row, stride_i_row, n_slots, topk, n_steps, n_hb,
                   k_lat, k_rope, k_bias, k_ready, k_free, NBUF: gl.constexpr, PREFETCH: gl.constexpr,
                   DEQ: gl.constexpr, GATHER: gl.constexpr, SCV: gl.constexpr = False,
                   KSPLIT: gl.constexpr = False):
    """:func:`_producer` with the slot loads out of the gathers' critical path: the row pointers of step
    i + 1 come from slots loaded during step i, and with ``PREFETCH`` the rows of step i + PREFETCH are
    asked into L2 at the end of step i (their slots loaded at its top, so that load's latency hides under
    the dequantisation). The gathered bytes themselves are not carried across iterations: a u8 tensor
    carried by the loop costs a 32-bit register per byte (ptxas spilled 4.6 KB when it was tried)."""
    LG: gl.constexpr = gather_layout(GATHER)   # [64 rows, 128 bytes]
    LR: gl.constexpr = rope_layout(GATHER)     # [64 rows, 64 bf16]
    LP: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])   # [64 rows, 8 lines] L2 prefetches
    SG: gl.constexpr = gl.SliceLayout(1, LG)
    SR: gl.constexpr = gl.SliceLayout(1, LR)
    i_row = (gl.program_id(0) // n_hb).to(gl.int64)
    p_idx = idx + i_row * stride_i_row
    o_c = gl.arange(0, 128, gl.SliceLayout(0, LG))
    o_r = gl.arange(0, 64, gl.SliceLayout(0, LR))

    o_l = gl.arange(0, 8, gl.SliceLayout(0, LP)) * 128
    if PREFETCH > 0:
        for j in range(1, PREFETCH):
            p_pf, v_pf = _slots(p_idx, j * BLOCK_N, topk, n_slots, kv, stride_kv_page, stride_kv_row,
                                gl.SliceLayout(1, LP))
            _prefetch_rows(p_pf, v_pf, o_l)
    p_row, valid = _slots(p_idx, 0, topk, n_slots, kv, stride_kv_page, stride_kv_row, SG)
    for i in range(n_steps):
        b = i % NBUF
        # next step's row pointers (carried), this iteration's L2 prefetch slots
        p_row_n, valid_n = _slots(p_idx, (i + 1) * BLOCK_N, topk, n_slots, kv, stride_kv_page, stride_kv_row, SG)
        if PREFETCH > 0:
            p_pf, v_pf = _slots(p_idx, (i + PREFETCH) * BLOCK_N, topk, n_slots, kv, stride_kv_page, stride_kv_row,
                                gl.SliceLayout(1, LP))
        tiles = _gather(p_row, valid, o_c, o_r, SR, SCV, GATHER)
        mbarrier.wait(k_free.index(b), ((i // NBUF) & 1) ^ 1)
        _stage(tiles, valid, k_lat, k_rope, k_bias, k_ready, b, DEQ, KSPLIT)
        if PREFETCH > 0:
            _prefetch_rows(p_pf, v_pf, o_l)
        p_row = p_row_n
        valid = valid_n


# ---- consumer 0: S, softmax, O[:, :256] ---------------------------------------------------------------

@gluon.jit
def _scores(q_lat, q_rope, k_lat, k_rope, b, zero_s, KSPLIT: gl.constexpr = False):
    # [64 heads, 64 tokens] = Q_rope K_rope^T + sum_g Q_g K_g^T, five async wgmma groups, none waited here
    s = warpgroup_mma(q_rope, k_rope.index(b).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    for g in gl.static_range(4):
        s = warpgroup_mma(q_lat.index(g), _klat(k_lat, b, g, KSPLIT).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax(s, bias, qk_scale, m_i, l_i):
    """One online-softmax step in the exp2 domain on S [64, 64] (fp32, -inf masked by ``bias``).

    Returns (p bf16, alpha, m, l). A head that has seen only skipped tokens keeps m = -inf; exp2 is then
    taken against 0, so -inf - -inf never makes a NaN and its p, alpha and l stay 0."""
    s = s * qk_scale + bias[None, :]
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p.to(gl.bfloat16), alpha, m_new, l_i


@gluon.jit
def _hand_p(p16, alpha, i, p_s, alpha_s, p_ready, p_free):
    # consumer 1's P V on the previous P has completed (p_free) -> overwrite P and alpha, signal p_ready
    mbarrier.wait(p_free, (i & 1) ^ 1)
    p_s.store(p16)
    alpha_s.store(alpha)
    # consumer 1 reads P with wgmma (async proxy): order these generic stores before it
    fence_async_shared()
    mbarrier.arrive(p_ready, count=1)


@gluon.jit
def _rescale(o0, o1, alpha, p16, M128: gl.constexpr, PA: gl.constexpr):
    # O *= alpha (before the P V wgmma is issued: nothing touches an accumulator in flight), P as the
    # register A operand of the P V wgmma
    a_o = gl.convert_layout(alpha, gl.SliceLayout(1, M128))
    return o0 * a_o[:, None], o1 * a_o[:, None], gl.convert_layout(p16, PA)


@gluon.jit
def load_q(q, stride_q_row, stride_q_h, h_q, i_row, i_hb, q_lat, q_rope, QL: gl.constexpr, PART: gl.constexpr = 0):
    """Q of this row and head block into shared memory, once: ``q_lat`` [4, 64, 128] bf16 (latent), ``q_rope``
    [64, 64] bf16 (a tile), then ``fence_async_shared`` for the wgmma reads. QL 0: one group after the other;
    QL 1: every load issued before the first store (one DRAM latency instead of five; part of -180 us of
    fixed cost over 8192 CTAs in gluon_bf16.py); QL 2: PART 1 latent groups 0, 1, PART 2 groups 2, 3 and the
    rope, loads before stores (gluon_bf16.py: each consumer loads half). Heads >= h_q read as 0."""
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])   # [64, 128] bf16
    LQR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])   # [64, 64] bf16
    o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LQ))
    o_c = gl.arange(0, 128, gl.SliceLayout(0, LQ))
    p_q = q + i_row * stride_q_row + o_h.to(gl.int64)[:, None] * stride_q_h + o_c[None, :]
    m_q = (o_h < h_q)[:, None]
    o_hr = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LQR))
    o_r = gl.arange(0, 64, gl.SliceLayout(0, LQR))
    p_r = q + i_row * stride_q_row + o_hr.to(gl.int64)[:, None] * stride_q_h + 512 + o_r[None, :]
    m_r = (o_hr < h_q)[:, None]
    if QL == 0:
        for g in gl.static_range(4):
            q_lat.index(g).store(gl.load(p_q + g * 128, mask=m_q, other=0.0))
        q_rope.store(gl.load(p_r, mask=m_r, other=0.0))
    else:
        if PART != 2:
            b_q0 = gl.load(p_q, mask=m_q, other=0.0)
            b_q1 = gl.load(p_q + 128, mask=m_q, other=0.0)
        if PART != 1:
            b_q2 = gl.load(p_q + 256, mask=m_q, other=0.0)
            b_q3 = gl.load(p_q + 384, mask=m_q, other=0.0)
            b_qr = gl.load(p_r, mask=m_r, other=0.0)
        if PART != 2:
            q_lat.index(0).store(b_q0)
            q_lat.index(1).store(b_q1)
        if PART != 1:
            q_lat.index(2).store(b_q2)
            q_lat.index(3).store(b_q3)
            q_rope.store(b_qr)
    fence_async_shared()


@gluon.jit
def _consumer0(q, out, lse, stride_q_row, stride_q_h, stride_o_row, stride_o_h, stride_l_row, h_q, n_hb, n_steps,
               qk_scale, q_lat, q_rope, k_lat, k_rope, k_bias, p_s, alpha_s, fin_s, k_ready, k_free, p_ready,
               p_free, fin, NBUF: gl.constexpr, OVERLAP: gl.constexpr, OSTAGE: gl.constexpr, QL: gl.constexpr,
               KSPLIT: gl.constexpr = False, PTA: gl.constexpr = 0, QSYNC: gl.constexpr = False,
               HPL: gl.constexpr = False):
    M64: gl.constexpr = mma_layout(64)
    M128: gl.constexpr = mma_layout(128)
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M128, k_width=2)
    i_hb = gl.program_id(0) % n_hb
    i_row = (gl.program_id(0) // n_hb).to(gl.int64)
    load_q(q, stride_q_row, stride_q_h, h_q, i_row, i_hb, q_lat, q_rope, QL)
    if QSYNC:
        # Q's stores must reach every warp's first S wgmma. Left to Triton's shared-memory hazard analysis,
        # that barrier lands in front of the S wgmma inside the loop (it cannot tell iteration 0 apart) and
        # runs every step; here it runs once.
        _warps_barrier()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, M64))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, M64))
    o0 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    o1 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    zero_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, M64)

    if OVERLAP:
        # prologue: S and P of step 0
        mbarrier.wait(k_ready.index(0), 0)
        s = _scores(q_lat, q_rope, k_lat, k_rope, 0, zero_s, KSPLIT)
        s = warpgroup_mma_wait(0, deps=(s,))
        p16, alpha, m_i, l_i = _softmax(s, k_bias.index(0).load(gl.SliceLayout(0, M64)), qk_scale, m_i, l_i)
        _hand_p(p16, alpha, 0, p_s, alpha_s, p_ready, p_free)
        for i in range(n_steps - 1):
            b = i % NBUF
            bn = (i + 1) % NBUF
            # S of step i + 1 first, then P V of step i: wgmma groups retire in order, so waiting with two
            # groups outstanding leaves exactly the two P V groups running under the softmax
            mbarrier.wait(k_ready.index(bn), ((i + 1) // NBUF) & 1)
            s = _scores(q_lat, q_rope, k_lat, k_rope, bn, zero_s, KSPLIT)
            o0, o1, pa = _rescale(o0, o1, alpha, p16, M128, PA)
            o0 = warpgroup_mma(pa, _klat(k_lat, b, 0, KSPLIT), o0, is_async=True)
            o1 = warpgroup_mma(pa, _klat(k_lat, b, 1, KSPLIT), o1, is_async=True)
            s = warpgroup_mma_wait(2, deps=(s,))
            # the mask is read after the wait: its 16 registers per thread are not live under the wgmma
            p16, alpha, m_i, l_i = _softmax(s, k_bias.index(bn).load(gl.SliceLayout(0, M64)), qk_scale, m_i, l_i)
            _hand_p(p16, alpha, i + 1, p_s, alpha_s, p_ready, p_free)
            o0, o1, pa = warpgroup_mma_wait(0, deps=(o0, o1, pa))
            _release(k_free.index(b), PTA & 4)
        # epilogue: P V of the last step
        b = (n_steps - 1) % NBUF
        o0, o1, pa = _rescale(o0, o1, alpha, p16, M128, PA)
        o0 = warpgroup_mma(pa, _klat(k_lat, b, 0, KSPLIT), o0, is_async=True)
        o1 = warpgroup_mma(pa, _klat(k_lat, b, 1, KSPLIT), o1, is_async=True)
        o0, o1, pa = warpgroup_mma_wait(0, deps=(o0, o1, pa))
        _release(k_free.index(b), PTA & 4)
    else:
        for i in range(n_steps):
            b = i % NBUF
            mbarrier.wait(k_ready.index(b), (i // NBUF) & 1)
            s = _scores(q_lat, q_rope, k_lat, k_rope, b, zero_s, KSPLIT)
            s = warpgroup_mma_wait(0, deps=(s,))
            p16, alpha, m_i, l_i = _softmax(s, k_bias.index(b).load(gl.SliceLayout(0, M64)), qk_scale, m_i, l_i)
            if not HPL:
                _hand_p(p16, alpha, i, p_s, alpha_s, p_ready, p_free)
            o0, o1, pa = _rescale(o0, o1, alpha, p16, M128, PA)
            o0 = warpgroup_mma(pa, _klat(k_lat, b, 0, KSPLIT), o0, is_async=True)
            o1 = warpgroup_mma(pa, _klat(k_lat, b, 1, KSPLIT), o1, is_async=True)
            if HPL:
                # P handed to consumer 1 while this P V runs: the barrier Triton puts after the p_ready
                # arrive then falls after the wgmma wait (warps in step) instead of in front of its issue
                _hand_p(p16, alpha, i, p_s, alpha_s, p_ready, p_free)
            o0, o1, pa = warpgroup_mma_wait(0, deps=(o0, o1, pa))
            _release(k_free.index(b), PTA & 4)

    # empty rows (no valid index): l = 0 -> out 0 (O is 0), lse -inf
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    inv = 1.0 / l_safe
    fin_s.store(inv)
    mbarrier.arrive(fin, count=1)
    o_hl = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, M64))
    gl.store(lse + i_row * stride_l_row + o_hl, gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2),
             mask=o_hl < h_q)
    store_o(out, i_row, i_hb, stride_o_row, stride_o_h, h_q, o0, o1, gl.convert_layout(inv, gl.SliceLayout(1, M128)),
             0, M128, q_lat, OSTAGE)


@gluon.jit
def store_o(out, i_row, i_hb, stride_o_row, stride_o_h, h_q, o_a, o_b, inv, d0: gl.constexpr, M128: gl.constexpr,
             q_lat, OSTAGE: gl.constexpr):
    """out[row, heads, d0 : d0 + 256] = (O / l) in bf16: straight from the accumulator layout (4-B pieces), or
    with OSTAGE through the Q tiles d0 / 128, d0 / 128 + 1 (the caller knows every QK reading them is done:
    here ``fin``, in gluon_bf16.py the sum exchange) into whole 16-B pieces of 256-B rows."""
    if OSTAGE:
        LO: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])   # [64, 128] bf16
        q_lat.index(d0 // 128).store((o_a * inv[:, None]).to(gl.bfloat16))
        q_lat.index(d0 // 128 + 1).store((o_b * inv[:, None]).to(gl.bfloat16))
        o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LO))
        o_d = gl.arange(0, 128, gl.SliceLayout(0, LO))
        p_o = out + i_row * stride_o_row + o_h.to(gl.int64)[:, None] * stride_o_h + d0 + o_d[None, :]
        m_o = (o_h < h_q)[:, None]
        gl.store(p_o, q_lat.index(d0 // 128).load(LO), mask=m_o)
        gl.store(p_o + 128, q_lat.index(d0 // 128 + 1).load(LO), mask=m_o)
    else:
        o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, M128))
        o_d = gl.arange(0, 128, gl.SliceLayout(0, M128))
        p_o = out + i_row * stride_o_row + o_h.to(gl.int64)[:, None] * stride_o_h + d0 + o_d[None, :]
        m_o = (o_h < h_q)[:, None]
        gl.store(p_o, (o_a * inv[:, None]).to(gl.bfloat16), mask=m_o)
        gl.store(p_o + 128, (o_b * inv[:, None]).to(gl.bfloat16), mask=m_o)


# ---- consumer 1: O[:, 256:] ---------------------------------------------------------------------------

@gluon.jit
def _consumer1(out, stride_o_row, stride_o_h, h_q, n_hb, n_steps, k_lat, p_s, alpha_s, fin_s, k_free, p_ready,
               p_free, fin, q_lat, NBUF: gl.constexpr, OSTAGE: gl.constexpr, KSPLIT: gl.constexpr = False,
               PTA: gl.constexpr = 0):
    M128: gl.constexpr = mma_layout(128)
    i_hb = gl.program_id(0) % n_hb
    i_row = (gl.program_id(0) // n_hb).to(gl.int64)
    o2 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    o3 = gl.zeros([BLOCK_H, 128], gl.float32, M128)
    for i in range(n_steps):
        b = i % NBUF
        mbarrier.wait(p_ready, i & 1)
        a_o = alpha_s.load(gl.SliceLayout(1, M128))
        o2 = o2 * a_o[:, None]
        o3 = o3 * a_o[:, None]
        # P straight from shared memory, freed once this P V completed. (P loaded into registers first, to
        # free it earlier, needs 16 more registers: at 160 ptxas then serialises every wgmma.)
        o2 = warpgroup_mma(p_s, _klat(k_lat, b, 2, KSPLIT), o2, is_async=True)
        o3 = warpgroup_mma(p_s, _klat(k_lat, b, 3, KSPLIT), o3, is_async=True)
        o2, o3 = warpgroup_mma_wait(0, deps=(o2, o3))
        _release(p_free, PTA & 2)
        _release(k_free.index(b), PTA & 2)
    mbarrier.wait(fin, 0)
    store_o(out, i_row, i_hb, stride_o_row, stride_o_h, h_q, o2, o3, fin_s.load(gl.SliceLayout(1, M128)), 256, M128,
             q_lat, OSTAGE)


# ---- the kernel ---------------------------------------------------------------------------------------

# sizes that vary per call are not specialised (one compile serves every batch and top-k); the address
# strides stay specialised, so 16-byte alignment is known and the gathers are 16-byte loads
@gluon.jit(do_not_specialize=["stride_i_row", "stride_l_row", "n_slots", "h_q", "topk", "n_steps", "n_hb"])
def sparse_mla_decode_ws_kernel(
    q, kv, idx, out, lse,
    stride_q_row, stride_q_h, stride_kv_page, stride_kv_row, stride_i_row, stride_o_row, stride_o_h, stride_l_row,
    n_slots, h_q, topk, n_steps, n_hb, qk_scale,
    NBUF: gl.constexpr, PREFETCH: gl.constexpr, OVERLAP: gl.constexpr, PIPE: gl.constexpr,
    DEQ: gl.constexpr, REGS_C1: gl.constexpr, REGS_PROD: gl.constexpr, OSTAGE: gl.constexpr = False,
    QL: gl.constexpr = 0, GATHER: gl.constexpr = 0, SCV: gl.constexpr = False,
    KSPLIT: gl.constexpr = False, PTA: gl.constexpr = 0, QSYNC: gl.constexpr = False, HPL: gl.constexpr = False,
):
    """Warp-specialised sparse MLA decode, one (query row, 64 heads) per CTA (module docstring).

    q    [R, h_q, 576] bf16 (unit stride last)           idx [R, topk] int32 slots (unit stride last)
    kv   [P, 64, 656] uint8 cache: slot -> kv + (slot // 64) * stride_kv_page + (slot % 64) * stride_kv_row;
         row = 512 e4m3 | 4 fp32 scales (one per 128 dims) | 64 bf16 rope; strides multiples of 16
    out  [R, h_q, 512] bf16 (unit stride last)           lse [R, h_q] fp32, natural log
    n_steps = max(1, cdiv(topk, 64)); n_hb = cdiv(h_q, 64); qk_scale = sm_scale * log2(e).
    """
    T: gl.constexpr = tile_smem(BLOCK_N, 128)
    TR: gl.constexpr = tile_smem(BLOCK_N, 64)
    V1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], T)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], TR)
    if KSPLIT:
        k_lat = (gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, 128], T),
                 gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, 128], T),
                 gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, 128], T),
                 gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, 128], T))
    else:
        k_lat = gl.allocate_shared_memory(gl.bfloat16, [NBUF * 4, BLOCK_N, 128], T)
    k_rope = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, 64], TR)
    k_bias = gl.allocate_shared_memory(gl.float32, [NBUF, BLOCK_N], V1)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], TR)
    alpha_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], V1)
    fin_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], V1)
    k_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # a warpgroup's releases (see _release): PTA bit 2 consumer 1's, bit 4 consumer 0's one by one
    A_C1: gl.constexpr = 128 if PTA & 2 else 1
    A_C0: gl.constexpr = 128 if PTA & 4 else 1
    for j in gl.static_range(NBUF):
        mbarrier.init(k_ready.index(j), count=1)             # the producer
        mbarrier.init(k_free.index(j), count=A_C0 + A_C1)    # both consumers
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=A_C1)
    mbarrier.init(fin, count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer0, (q, out, lse, stride_q_row, stride_q_h, stride_o_row, stride_o_h, stride_l_row, h_q, n_hb, n_steps,
                      qk_scale, q_lat, q_rope, k_lat, k_rope, k_bias, p_s, alpha_s, fin_s, k_ready, k_free, p_ready,
                      p_free, fin, NBUF, OVERLAP, OSTAGE, QL, KSPLIT, PTA, QSYNC, HPL)),
        (_consumer1, (out, stride_o_row, stride_o_h, h_q, n_hb, n_steps, k_lat, p_s, alpha_s, fin_s, k_free, p_ready,
                      p_free, fin, q_lat, NBUF, OSTAGE, KSPLIT, PTA)),
        (_producer_pipe if PIPE else _producer,
         (kv, idx, stride_kv_page, stride_kv_row, stride_i_row, n_slots, topk, n_steps, n_hb, k_lat, k_rope, k_bias,
          k_ready, k_free, NBUF, PREFETCH, DEQ, GATHER, SCV, KSPLIT)),
    ], [4, 4], [REGS_C1, REGS_PROD])


# ---- launcher -----------------------------------------------------------------------------------------

def _variant(pipe: bool, deq: int, prefetch: int, overlap: bool, ostage: bool = False, ql: bool = False,
             gather: int = ROW_MAJOR, scv: bool = False, ksplit: bool = False,
             pta: int = 0, qsync: bool = False, hpl: bool = False) -> dict:
    # two K/V buffers (a third does not fit); consumer 1 needs 160 registers (152 spill), consumer 0 192
    # (216 with OVERLAP: at 200 ptxas serialises its wgmma), the producer gets the rest of 3 x 168
    return dict(NBUF=2, PIPE=pipe, DEQ=deq, PREFETCH=prefetch, OVERLAP=overlap, REGS_C1=160,
                REGS_PROD=128 if overlap else 152, OSTAGE=ostage, QL=int(ql), GATHER=gather,
                SCV=scv, KSPLIT=ksplit, PTA=pta, QSYNC=qsync, HPL=hpl)


# variant name -> constexprs. Measured on the H200 with Triton 3.6
# (CUDA-graph replay median, us, for B64 s_q1 h128 / B64 s_q2 h128 / B128 s_q2 h64, top-2048; in the same
# runs FlashMLA 94.4-95.8 / 178.4-181.6 / 234.6-237.7 and our Triton default 177.4-179.3 / 344.4-348.7 /
# 361.2-364.9). What each one showed: the module docstring.
VARIANTS = {
    # the previous default: carried slots + per-line L2 prefetch 2 steps ahead, FlashMLA's bf16 scale
    # multiply, and gluon_bf16.py's fixed-cost fixes (Q's loads before its stores, O through the Q tiles into
    # 16-B stores); in one run 109.9 / 211.2 / 224.6 against the exact dequantisation's 111.1 / 215.5 /
    # 236.2 (FlashMLA 94.8 / 179.9 / 236.3)
    "ws-pipe-pf2-os-ql-dq4": _variant(pipe=True, deq=4, prefetch=2, overlap=False, ostage=True, ql=True),
    # the default and its exact twin with the conflict-free gather layout (:func:`gather_layout`; the same 56
    # LDG.128 / 72 STS.128). ncu: no excess shared wavefronts (the default's 2-way conflict is gone), yet
    # slower: 2026-12-02, one run, 133.6 / 254.5 / 256.0 and 120.4 / 228.7 / 236.4 against 109.4 / 210.7 /
    # 224.7 and 111.3 / 215.9 / 236.2 (FlashMLA 94.7 / 179.8 / 235.3); with every step on the same 64 rows
    # (hot64, no DRAM) 111.6 / 111.4 against 108.9 / 102.3. Each load instruction of a warp now touches 8
    # rows' lines instead of 4, and the gathers, not the stores' conflicts, set the pace.
    # the exact dequantisation (any scale) with PAIRED_ROWS gathers (row-major's loads, conflict-free
    # stores); two runs 109.9 / 209.5 / 222.0 and 109.4 / 209.6 / 221.5 against the -dq4 default's 109.7 /
    # 210.8 / 223.7 and 110.2 / 210.4 / 224.1 (FlashMLA 95.7 / 180.2 / 236.5, 95.0 / 180.7 / 236.2)
    "ws-pipe-pf2-os-ql-pr": _variant(pipe=True, deq=0, prefetch=2, overlap=False, ostage=True, ql=True,
                                     gather=PAIRED_ROWS),
    # the default until -pa6: -pr with each row's four scales as one 16-B load (scales_layout) instead of four 4-B loads
    # (70 LDG a thread's code against 82); two runs in opposite orders 108.8 / 206.1 / 220.0 and 108.2 /
    # 207.4 / 219.6 against -pr's 109.1 / 209.7 / 222.9 and 108.8 / 209.3 / 223.1, hot64 105.7-105.8 against
    # 110.6-110.8 (FlashMLA 94.7 / 179.9 / 235.2 and 94.7 / 179.6 / 235.7)
    "ws-pipe-pf2-os-ql-pr-sv": _variant(pipe=True, deq=0, prefetch=2, overlap=False, ostage=True, ql=True,
                                        gather=PAIRED_ROWS, scv=True),
    # the default with one shared allocation per latent group (_klat): the producer's warps then meet at 2
    # named barriers a step instead of 5 (sm_90 SASS, Triton 3.6: the three between the latent groups' stores
    # are gone; unrolling the loop by two with constant buffer indices removed none). Alone no faster (below)
    "ws-pipe-pf2-os-ql-pr-sv-ks": _variant(pipe=True, deq=0, prefetch=2, overlap=False, ostage=True, ql=True,
                                           gather=PAIRED_ROWS, scv=True, ksplit=True),
    # -ks with the consumers' threads releasing buffers one by one (_release; PTA bit 2 consumer 1, bit 4
    # consumer 0), so no barrier among their warps before a release. 2026-12-02, two probe runs in opposite
    # orders (FlashMLA 94.8 / 179.1 / 235.6 and 95.3 / 179.5 / 235.2): pa2 106.3 / 201.4 / 218.6 and 106.5 /
    # 201.0 / 219.1; pa6 (the default since) 104.6 / 199.5 / 219.0 and 104.3 / 200.0 / 219.2; -ks 108.4 /
    # 207.0 / 222.3 and 108.7 / 208.6 / 223.3; -sv 108.9 / 206.0 / 219.4 and 108.7 / 207.1 / 218.9
    "ws-pipe-pf2-os-ql-pr-sv-ks-pa2": _variant(pipe=True, deq=0, prefetch=2, overlap=False, ostage=True, ql=True,
                                               gather=PAIRED_ROWS, scv=True, ksplit=True, pta=2),
    "ws-pipe-pf2-os-ql-pr-sv-ks-pa6": _variant(pipe=True, deq=0, prefetch=2, overlap=False, ostage=True, ql=True,
                                               gather=PAIRED_ROWS, scv=True, ksplit=True, pta=6),
    # -pa6 with one barrier after Q's stores before the loop, so none in front of each step's S (QSYNC);
    # 2026-12-02, two probe runs in opposite orders: 104.1 / 199.6 / 219.3 and 104.2 / 199.9 / 219.7 against
    # -pa6's 104.7 / 199.5 / 220.1 and 104.3 / 199.5 / 219.3 (no change alone)
    "ws-pipe-pf2-os-ql-pr-sv-ks-pa6-qs": _variant(pipe=True, deq=0, prefetch=2, overlap=False, ostage=True, ql=True,
                                                  gather=PAIRED_ROWS, scv=True, ksplit=True, pta=6, qsync=True),
    # and P handed to consumer 1 after this step's P V is issued (HPL): the default since. Same runs: 102.2 /
    # 196.2 / 213.3 and 102.3 / 196.0 / 213.1 (FlashMLA 94.6 / 179.3 / 234.0 and 94.7 / 179.6 / 234.7: 1.08 /
    # 1.09 / 0.91x), hot64 100.6 / 100.0 against 101.2
    "ws-pipe-pf2-os-ql-pr-sv-ks-pa6-qs-hp": _variant(pipe=True, deq=0, prefetch=2, overlap=False, ostage=True,
                                                     ql=True, gather=PAIRED_ROWS, scv=True, ksplit=True, pta=6,
                                                     qsync=True, hpl=True),
    "ws-pipe-pf2-os-ql-dq4-sv": _variant(pipe=True, deq=4, prefetch=2, overlap=False, ostage=True, ql=True, scv=True),
    # the same layout with DEQ 4: 113.8 / 214.5 / 227.9 and 114.0 / 215.1 / 227.7 against -dq4's 110.2 / 210.1
    # / 224.2 and 110.5 / 212.1 / 224.3 (hot64 107.9 / 107.2 against 109.1 / 109.2); OVERLAP with it 124.7 /
    # 239.0 / 250.4
    "ws-pipe-pf2-os-ql-dq4-pr": _variant(pipe=True, deq=4, prefetch=2, overlap=False, ostage=True, ql=True,
                                         gather=PAIRED_ROWS),
    "ws-ovl-pipe-pf2-dq4-pr": _variant(pipe=True, deq=4, prefetch=2, overlap=True, gather=PAIRED_ROWS),
    "ws-pipe-pf2-os-ql-dq4-r8": _variant(pipe=True, deq=4, prefetch=2, overlap=False, ostage=True, ql=True,
                                         gather=ROWS_FIRST),
    "ws-pipe-pf2-os-ql-r8": _variant(pipe=True, deq=0, prefetch=2, overlap=False, ostage=True, ql=True,
                                     gather=ROWS_FIRST),
    # the same with the reference's dequantisation for any scale; 2026-12-02, another run: 111.9 / 216.2 /
    # 238.0 against ws-pipe-pf2's 116.6 / 223.8 / 241.9 (FlashMLA 94.4 / 179.4 / 234.1)
    "ws-pipe-pf2-os-ql": _variant(pipe=True, deq=0, prefetch=2, overlap=False, ostage=True, ql=True),
    # prefetch 3 ahead: 112.1 / 217.7 / 253.9
    "ws-pipe-pf3-os-ql": _variant(pipe=True, deq=0, prefetch=3, overlap=False, ostage=True, ql=True),
    # diagnostic: the consumers alone with the fixed-cost fixes: 101.7 / 193.6 / 191.2 (hot64: 99.5)
    "diag-nodeq-os-ql": _variant(pipe=True, deq=2, prefetch=0, overlap=False, ostage=True, ql=True),
    # diagnostic: the default's gathers and stores without the dequantisation's arithmetic (bytes spread into
    # bf16 lanes by two prmt): what the arithmetic costs, i.e. what splitting it over two CTAs could save.
    # 2026-12-02, one run: 112.3 / 214.2 / 221.1 (hot64 104.5) against the default's 109.2 / 209.8 / 222.1
    # (hot64 110.3) and the consumers alone (diag-nodeq-os-ql) 99.6 / 190.3 / 190.2 (hot64 98.1): with the
    # real gathers the arithmetic costs nothing; the gathers and stores are the producer's ~10 us
    "diag-raw-os-ql-pr": _variant(pipe=True, deq=3, prefetch=2, overlap=False, ostage=True, ql=True,
                                  gather=PAIRED_ROWS),
    # the default until 2026-12-02 (without the fixed-cost fixes)
    "ws-pipe-pf2": _variant(pipe=True, deq=0, prefetch=2, overlap=False),  # 116.3 / 224.3 / 241.7
    # the same with FlashMLA's bf16 scale multiply (exact for power-of-two scales only)
    "ws-pipe-pf2-dq4": _variant(pipe=True, deq=4, prefetch=2, overlap=False),  # 115.5 / 221.1 / 232.9
    "ws-pipe-pf2-dq1": _variant(pipe=True, deq=1, prefetch=2, overlap=False),  # 118.5 / 226.7 / 234.5
    "ws-pipe-pf3": _variant(pipe=True, deq=0, prefetch=3, overlap=False),  # 118.0 / 228.3 / 258.8
    "ws-pipe": _variant(pipe=True, deq=0, prefetch=0, overlap=False),  # 129.6 / 245.2 / 255.9
    "ws-pipe-dq1": _variant(pipe=True, deq=1, prefetch=0, overlap=False),  # 142.8 / 267.6 / 282.7
    "ws": _variant(pipe=False, deq=0, prefetch=0, overlap=False),  # 135.6 / 257.7 / 269.8
    # FA3-style consumer 0 (216 registers, so the producer gets 128)
    "ws-ovl-pipe-pf2-dq4": _variant(pipe=True, deq=4, prefetch=2, overlap=True),  # 124.2 / 238.7 / 248.1
    "ws-ovl-pipe-pf2-dq1": _variant(pipe=True, deq=1, prefetch=2, overlap=True),  # 140.0 / 270.5 / 281.6
    "ws-ovl-pipe-pf2": _variant(pipe=True, deq=0, prefetch=2, overlap=True),  # 130.6 / 252.2 / 262.8
    "ws-ovl-pipe-pf3": _variant(pipe=True, deq=0, prefetch=3, overlap=True),  # 132.1 / 255.4 / 281.5
    "ws-ovl-pipe": _variant(pipe=True, deq=0, prefetch=0, overlap=True),  # 143.5 / 275.5 / 293.8
    "ws-ovl": _variant(pipe=False, deq=0, prefetch=0, overlap=True),  # 148.5 / 284.8 / 298.4
    # diagnostics (wrong results, timed only): the consumers alone (no gathers, no dequantisation); the gathers
    # and stores without the dequantisation's arithmetic
    "diag-nodeq": _variant(pipe=True, deq=2, prefetch=0, overlap=False),  # 104.0 / 198.8 / 199.3
    "diag-ovl-nodeq": _variant(pipe=True, deq=2, prefetch=0, overlap=True),  # 92.1 / 177.8 / 178.3
    "diag-ovl-raw": _variant(pipe=True, deq=3, prefetch=0, overlap=True),  # 110.6 / 210.2 / 219.8
}
DEFAULT_VARIANT = "ws-pipe-pf2-os-ql-pr-sv-ks-pa6-qs-hp"


def kernel_args(q, cache_u8, indices, sm_scale, out, lse, variant: str = DEFAULT_VARIANT):
    """(grid, kwargs) of one launch of :func:`sparse_mla_decode_ws_kernel` over R = B * s_q rows (also used by
    the probe's sm_90 compile check)."""
    B, s_q, h_q, _ = q.shape
    R, topk = B * s_q, indices.shape[-1]
    n_hb = cdiv(h_q, 64)
    q3 = q.reshape(R, h_q, q.shape[-1])
    i2 = indices.reshape(R, topk)
    o3 = out.view(R, h_q, out.shape[-1])
    l2 = lse.view(R, h_q)
    return (R * n_hb,), dict(
        q=q3, kv=cache_u8, idx=i2, out=o3, lse=l2,
        stride_q_row=q3.stride(0), stride_q_h=q3.stride(1),
        stride_kv_page=cache_u8.stride(0), stride_kv_row=cache_u8.stride(1), stride_i_row=i2.stride(0),
        stride_o_row=o3.stride(0), stride_o_h=o3.stride(1), stride_l_row=l2.stride(0),
        n_slots=cache_u8.shape[0] * cache_u8.shape[1], h_q=h_q, topk=topk, n_steps=max(1, cdiv(topk, 64)),
        n_hb=n_hb, qk_scale=sm_scale * LOG2E, **VARIANTS[variant], num_warps=4, maxnreg=MAXNREG)


def sparse_mla_decode_gluon(q: torch.Tensor, cache_u8: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                            d_v: int = 512, variant: str = DEFAULT_VARIANT, out: torch.Tensor | None = None,
                            lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode over the fp8 656-B paged cache on Hopper (sm_90), Gluon.

    Args:
        q:        ``[B, s_q, h_q, 576] bfloat16`` absorbed queries (512 latent + 64 rope), unit stride last.
        cache_u8: ``[P, 64, 656] uint8`` FlashMLA's fp8 layout (512 e4m3 | 4 fp32 scales | 64 bf16 rope),
                  unit stride within a row, page / row strides multiples of 16 bytes.
        indices:  ``[B, s_q, topk] int32`` physical slots ``page * 64 + row``; -1, negative or >= 64 P = skip.
        sm_scale: softmax scale.
        d_v:      512 only (the whole latent is the value).
        variant:  a key of :data:`VARIANTS`.
        out, lse: optional destinations (contiguous, the shapes below), e.g. NaN-poisoned by a test.

    Returns:
        ``out [B, s_q, h_q, 512] bfloat16`` and ``lse [B, s_q, h_q] float32`` (natural log). A row with no
        valid index gives out 0 and lse -inf.
    """
    B, s_q, h_q, d = q.shape
    assert d == 576 and d_v == 512 and q.dtype == torch.bfloat16 and q.stride(-1) == 1
    assert cache_u8.dtype == torch.uint8 and cache_u8.dim() == 3 and cache_u8.shape[1:] == (64, 656)
    assert cache_u8.stride(2) == 1 and cache_u8.stride(0) % 16 == 0 and cache_u8.stride(1) % 16 == 0
    assert indices.dtype == torch.int32 and indices.shape[:2] == (B, s_q) and indices.stride(-1) == 1
    if out is None:
        out = torch.empty(B, s_q, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(B, s_q, h_q, dtype=torch.float32, device=q.device)
    assert out.shape == (B, s_q, h_q, d_v) and out.is_contiguous()
    assert lse.shape == (B, s_q, h_q) and lse.is_contiguous()
    if B * s_q == 0 or h_q == 0:
        return out, lse
    grid, kw = kernel_args(q, cache_u8, indices, sm_scale, out, lse, variant)
    sparse_mla_decode_ws_kernel[grid](**kw)
    return out, lse


def compiled_kernel(q, cache_u8, indices, sm_scale, variant: str = DEFAULT_VARIANT):
    """Launch once and return the compiled kernel (``n_regs``, ``n_spills``, ``metadata.shared``)."""
    B, s_q, h_q, _ = q.shape
    out = torch.empty(B, s_q, h_q, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, s_q, h_q, dtype=torch.float32, device=q.device)
    grid, kw = kernel_args(q, cache_u8, indices, sm_scale, out, lse, variant)
    return sparse_mla_decode_ws_kernel[grid](**kw)


def compile_sm90(variant: str = DEFAULT_VARIANT):
    """The decode kernel of ``variant`` compiled for sm_90 without a GPU (B 2, h_q 128, top-2048): the CPU
    test's check and the probe's ``--compile-only``."""
    q = torch.empty(2, 1, 128, 576, dtype=torch.bfloat16)
    cache = torch.empty(64, 64, 656, dtype=torch.uint8)
    idx = torch.empty(2, 1, 2048, dtype=torch.int32)
    out, lse = torch.empty(2, 1, 128, 512, dtype=torch.bfloat16), torch.empty(2, 1, 128)
    _, kw = kernel_args(q, cache, idx, 576 ** -0.5, out, lse, variant)
    return compile_sm90_kernel(sparse_mla_decode_ws_kernel, kw)


# ---- the dispatch's entry ------------------------------------------------------------------------------

_LAUNCHER = KernelLauncher(sparse_mla_decode_ws_kernel, ("q", "kv", "idx", "out", "lse"))


def unsupported(q: torch.Tensor, kv_cache: torch.Tensor, fmt: str, d_v: int) -> str | None:
    """Why this kernel cannot run a (validated) ``sparse_mla_decode`` call, or None when it can: an sm_90 GPU,
    the fp8 656-B cache with 16-byte aligned rows, a bf16 query with h_q a multiple of 64 (whole 64-head
    CTAs: at h_q <= 32 the Triton kernels' 16-head tiles do less wasted MMA work), d_v 512. Measured faster
    than the Triton kernels at h_q 64 and 128 (README.md)."""
    if fmt != "fp8":
        return f"the fp8 {MLA_FP8_BYTES}-B cache (got {fmt!r})"
    if d_v != 512:
        return f"d_v 512 (got {d_v})"
    if q.dtype != torch.bfloat16 or q.shape[2] % 64:
        return f"a bfloat16 q with h_q a multiple of 64 (got {q.dtype}, h_q {q.shape[2]})"
    if q.device.type != "cuda" or capability(q.device) != (9, 0):
        return f"an sm_90 GPU (got {q.device})"
    if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16:
        return "16-byte aligned cache rows (data_ptr and page / row strides multiples of 16)"
    return None


def sparse_mla_decode(q, kv_cache, indices, sm_scale, d_v, kv_scale):
    """The Gluon backend of :func:`flashdsa.ops.sparse_mla_decode` (inputs validated there, and
    :func:`unsupported` None): the default variant, launched from a plan (``ops/_launch.py``) after the
    first call of a shape."""
    B, s_q, h_q, d = q.shape
    R, topk = B * s_q, indices.shape[-1]
    out = torch.empty(B, s_q, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, s_q, h_q, dtype=torch.float32, device=q.device)
    if R == 0 or h_q == 0:  # no program to launch (a grid of 0 is a launch error)
        return out, lse
    q3 = q.reshape(R, h_q, d) if q.stride(-1) == 1 else q.reshape(R, h_q, d).contiguous()
    i2 = indices.reshape(R, topk)
    if i2.stride(-1) != 1:
        i2 = i2.contiguous()
    ks = kv_cache.stride()
    ptrs = (q3.data_ptr(), kv_cache.data_ptr(), i2.data_ptr(), out.data_ptr(), lse.data_ptr())
    key = (q.device, R, h_q, topk, q3.stride(), ks, i2.stride()[0], kv_cache.shape[0], sm_scale) \
        if aligned(*ptrs) else None

    def build():
        return kernel_args(q3.view(R, 1, h_q, d), kv_cache, i2.view(R, 1, topk), sm_scale, out.view(R, 1, h_q, d_v),
                           lse.view(R, 1, h_q))

    _LAUNCHER(key, ptrs, build)
    return out, lse
