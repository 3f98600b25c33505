"""The value checks of the default mode, on the device (``flashdsa._checks`` describes the modes).

They check the metadata (lengths, ranges, page ids: what could make an op's kernel read out of bounds)
and scan the float inputs for NaN / inf (what would make the backends disagree), keep a bad value from
being read through (a row with any bad value gets length 0) and store the first error they find into
the host-mapped error word (``_checks.error_flag``), which the next flashdsa call, or
``flashdsa.ops.check_errors()``, raises as the host check's ValueError. No host sync, no device-side
assert (which would poison the CUDA context), CUDA-graph safe. Two forms:

* folded into the op's own kernel (``topk_transform``, ``indexer_logits_paged``, ``indexer_quant``: their
  decode-path calls cost no extra launch): the device functions here (:func:`flag_word`,
  :func:`flag_range`, :func:`check_pages`) and each op's error list (codes consecutive from its
  ``*_CODE0``, :func:`first_code`) are used by the op's kernel under its ``CHECK`` constexpr;
* one small check kernel launched before the op's own on the same stream (``indexer_logits_ragged``, a
  prefill op whose NaN scan covers the whole key tensor; ``indexer_logits_paged`` before its Gluon kernel,
  which has no in-kernel checks), which hands the op sanitised copies of the metadata.

Each error is one int64 store ``word | (value & 0xFFFFFFFF)`` (``word`` = ``error_word(code)``); the
codes name the argument as the host checks do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa._checks import E4M3_NAN, error_code, error_flag, error_word
from flashdsa.cache.layouts import PAGE_SIZE
from flashdsa.ops._shared import INT32_MAX
from flashdsa.ops._launch import KernelLauncher, aligned
from flashdsa.ops._triton_utils import cdiv

SCAN_BLOCK = 2048     # elements a scan program reads
ROWS = 128            # metadata rows a program checks (ragged)
_I32_MAX = tl.constexpr(INT32_MAX)  # kernels may read only constexpr globals (the interpreter does not enforce it)


# ---- kernels --------------------------------------------------------------------------------------------

@triton.jit
def _flag(flag, bad, value, word):
    """Store ``word | value`` (clamped to int32, its low 32 bits) into the error word where ``bad`` (a
    scalar)."""
    v = tl.minimum(tl.maximum(value + tl.zeros([], tl.int64), -2147483648), 2147483647)  # value: also a plain int
    tl.store(flag, word | (v & 0xFFFFFFFF), mask=bad)


@triton.jit
def flag_lo_hi(flag, v, m, lo, hi, word_lo, word_hi):
    """Flag the smallest value of ``v [N]`` below ``lo`` / the largest above ``hi`` (masked by ``m``; a
    value too small wins, as the host check tests ``min`` first); returns the per-element bad mask."""
    bad_lo = m & (v < lo)
    bad_hi = m & (v > hi)
    _flag(flag, tl.max(bad_hi.to(tl.int32), axis=0) > 0, tl.max(tl.where(bad_hi, v, lo), axis=0), word_hi)
    _flag(flag, tl.max(bad_lo.to(tl.int32), axis=0) > 0, tl.min(tl.where(bad_lo, v, hi), axis=0), word_lo)
    return bad_lo | bad_hi


@triton.jit
def flag_word(flag, bad, value, code):
    """``_flag`` with the error word of ``code`` (an int argument, or a sum of one and a constant)."""
    _flag(flag, bad, value, (tl.zeros([], tl.int64) + code) << 32)


@triton.jit
def flag_range(flag, v, m, lo, hi, code):
    """:func:`flag_lo_hi` with the error words of ``code`` (below ``lo``) and ``code + 1`` (above ``hi``): a
    check's two errors registered next to each other (:func:`first_code`)."""
    w_lo = (tl.zeros([], tl.int64) + code) << 32
    return flag_lo_hi(flag, v, m, lo, hi, w_lo, w_lo + (1 << 32))


@triton.jit
def check_pages(flag, p_row, n_pages, last_page, code, BLOCK_P: tl.constexpr):
    """Flag a page id outside [0, last_page] among the first ``n_pages`` of the table row ``p_row`` (error
    codes ``code`` / ``code + 1``); returns 1 if there was one, else 0 (int32 scalar)."""
    bad = tl.zeros([], tl.int32)
    for p0 in range(0, n_pages, BLOCK_P):
        o_p = p0 + tl.arange(0, BLOCK_P)
        m_p = o_p < n_pages
        ids = tl.load(p_row + o_p, mask=m_p, other=0)
        bad_p = flag_range(flag, ids, m_p, 0, last_page, code)
        bad = tl.maximum(bad, tl.max(bad_p.to(tl.int32), axis=0))
    return bad


@triton.jit
def _scan(x, flag, word, i_blk, n, s1, s2, s3, t0, t1, t2, t3, BLOCK: tl.constexpr):
    """Block ``i_blk`` of a <= 4-D e4m3 tensor read as bytes (sizes [*, s1, s2, s3], element strides t0..t3)
    in row-major order: flag a NaN code."""
    o = i_blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    i3 = o % s3
    r = o // s3
    i2 = r % s2
    r = r // s2
    i1 = r % s1
    i0 = r // s1
    p = x + i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3
    b = tl.load(p, mask=m, other=0).to(tl.int32)
    bad = m & ((b & 0x7F) == 0x7F)
    tl.store(flag, word, mask=tl.max(bad.to(tl.int32), axis=0) > 0)


@triton.jit
def ragged_check_kernel(ks, ke, ks_out, ke_out, flag, T, N, R_BLOCKS, Q_BLOCKS,
                        w_ks_lo, w_ks_hi, w_ke_lo, w_ke_hi, w_order,
                        q, nq, q1, q2, q3, qt0, qt1, qt2, qt3, w_q,
                        k, nk, k1, k2, k3, kt0, kt1, kt2, kt3, w_k,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Programs [0, R_BLOCKS): rows' ks, ke in [0, N] and ke >= ks, sanitised to (0, 0) on error; the next
    Q_BLOCKS scan q_fp8, the rest k_fp8 (e4m3 NaN codes)."""
    pid = tl.program_id(0)
    if pid < R_BLOCKS:
        o = pid * ROWS + tl.arange(0, ROWS)
        m = o < T
        b_ks = tl.load(ks + o, mask=m, other=0)
        b_ke = tl.load(ke + o, mask=m, other=0)
        bad = flag_lo_hi(flag, b_ks, m, 0, N, w_ks_lo, w_ks_hi)
        bad |= flag_lo_hi(flag, b_ke, m & (bad == 0), 0, N, w_ke_lo, w_ke_hi)
        bad |= flag_lo_hi(flag, b_ke - b_ks, m & (bad == 0), 0, _I32_MAX, w_order, w_order)
        tl.store(ks_out + o, tl.where(bad, 0, b_ks), mask=m)
        tl.store(ke_out + o, tl.where(bad, 0, b_ke), mask=m)
    elif pid < R_BLOCKS + Q_BLOCKS:
        _scan(q, flag, w_q, pid - R_BLOCKS, nq, q1, q2, q3, qt0, qt1, qt2, qt3, BLOCK)
    else:
        _scan(k, flag, w_k, pid - R_BLOCKS - Q_BLOCKS, nk, k1, k2, k3, kt0, kt1, kt2, kt3, BLOCK)


@triton.jit
def paged_check_kernel(q, context_lens, block_table, ctx_out, flag, hi, last_page, stride_bt, code0,
                       NEXT_N: tl.constexpr, NP: tl.constexpr, QBYTES: tl.constexpr, BLOCK: tl.constexpr,
                       BLOCK_P: tl.constexpr, PAGE: tl.constexpr):
    """Program b: request b's lengths in [0, hi] and the page ids its longest row reaches in [0, last_page]
    (a bad one flagged, the request's lengths then 0 in ``ctx_out``: nothing is read for it), and its
    queries (``QBYTES`` contiguous e4m3 bytes) free of NaN codes (flagged only: the kernel's output is
    invalid then, not out of bounds). Error words ``code0 + i`` in the order of ``PAGED_CHECKS``, the
    checks of ``indexer/paged.py``'s kernels."""
    b = tl.program_id(0).to(tl.int64)
    o_j = tl.arange(0, NP)
    m_j = o_j < NEXT_N
    lens = tl.load(context_lens + b * NEXT_N + o_j, mask=m_j, other=0)
    bad = tl.max(flag_range(flag, lens, m_j, 0, hi, code0).to(tl.int32), axis=0)
    reach = tl.where(bad == 0, tl.max(tl.where(m_j, lens, 0), axis=0), 0)
    bad = tl.maximum(bad, check_pages(flag, block_table + b * stride_bt, tl.cdiv(reach, PAGE), last_page, code0 + 2,
                                      BLOCK_P))
    tl.store(ctx_out + b * NEXT_N + o_j, tl.where(bad == 0, lens, 0), mask=m_j)
    nan = tl.zeros([BLOCK], tl.int1)
    for r in range(0, QBYTES, BLOCK):
        o = r + tl.arange(0, BLOCK)
        x = tl.load(q + b * QBYTES + o, mask=o < QBYTES, other=0)
        nan = nan | ((x & 0x7F) == 0x7F)
    flag_word(flag, tl.max(nan.to(tl.int32), axis=0) > 0, 0, code0 + 4)


# ---- host side ------------------------------------------------------------------------------------------

def _dims4(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``t`` as (a tensor of <= 4 dims with the same elements, sizes 1..3, strides 0..3)."""
    if t.dim() > 4:
        t = t.reshape(-1, *t.shape[-3:])  # a view when the leading dims merge, else a copy
    shape = (1,) * (4 - t.dim()) + tuple(t.shape)
    stride = (0,) * (4 - t.dim()) + tuple(t.stride())
    return t, shape[1:], stride


class _Scan:
    """One e4m3 tensor's part of a NaN-code scan: its argument list (the tensor as bytes, numel, sizes,
    strides), key and block count."""
    __slots__ = ("t", "n", "sizes", "strides", "blocks")

    def __init__(self, t: torch.Tensor):
        t, sizes, strides = _dims4(t)
        self.t, self.n, self.sizes, self.strides = t, t.numel(), sizes, strides
        self.blocks = cdiv(self.n, SCAN_BLOCK)

    def key(self):
        return (self.n, self.sizes, self.strides)

    def args(self) -> list:
        return [self.t.view(torch.uint8), self.n, *self.sizes, *self.strides]


_RAGGED = _PAGED = None


def _launchers():
    global _RAGGED, _PAGED
    _RAGGED = KernelLauncher(ragged_check_kernel, ("ks", "ke", "ks_out", "ke_out", "flag", "q", "k"))
    _PAGED = KernelLauncher(paged_check_kernel, ("q", "context_lens", "block_table", "ctx_out", "flag"))


_launchers()


def _words(op: str, *specs: tuple) -> tuple[int, ...]:
    return tuple(error_word(error_code(op, *s)) for s in specs)


def first_code(op: str, *specs: tuple) -> int:
    """Register the errors ``specs`` (``(name, expected[, got])``) of a check folded into ``op``'s own kernel
    under consecutive codes; returns the first (the kernel adds ``i`` for ``specs[i]``)."""
    codes = [error_code(op, *s) for s in specs]
    if codes != list(range(codes[0], codes[0] + len(codes))):
        raise RuntimeError(f"{op}: its error codes were registered out of order: {codes}")
    return codes[0]


# topk_transform's checks, in its kernels (topk/common.py ``row_check``), in the host check's order
TOPK_CHECKS = (
    ("lengths", "values >= 0"), ("lengths", "values <= logits.shape[1]"),
    ("row_starts", "values >= 0"), ("row_starts", "values <= logits.shape[1]"),
    ("row_starts + lengths", "values <= logits.shape[1]"),
    ("out_offsets", "values >= 0"), ("out_offsets", "out_offsets + lengths - 1 <= 2^31 - 1 (int32 outputs)"),
    ("page_table", "pages needed by lengths <= page_table.shape[1]"),
    ("page_table", "page ids >= 0"), ("page_table", "page ids < 2^31 / page_size (int32 slots)"))
TOPK_CODE0 = first_code("topk_transform", *TOPK_CHECKS)
# indexer_logits_paged's, in its kernels (indexer/paged.py ``_program_ok``, ``_chunk_pages_ok``)
PAGED_CHECKS = (
    ("context_lens", "values >= 0"), ("context_lens", "values <= min(max_context_len, 64 * block_table.shape[1])"),
    ("block_table", "page ids >= 0"), ("block_table", "page ids < index_cache.shape[0]"),
    ("q_fp8", "finite values", E4M3_NAN))
PAGED_CODE0 = first_code("indexer_logits_paged", *PAGED_CHECKS)


def check_ragged(q_fp8: torch.Tensor, k_fp8: torch.Tensor, ks: torch.Tensor,
                 ke: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Device checks of ``indexer_logits_ragged`` (ks, ke contiguous): sanitised ``(ks, ke) [T] int32``."""
    T, N = ks.shape[0], k_fp8.shape[0]
    Tp = cdiv(T, 4) * 4  # ke's copy 16-byte aligned, as a tensor of its own would be
    buf = torch.empty(2, Tp, dtype=torch.int32, device=ks.device)
    ks_out, ke_out = buf[0, :T], buf[1, :T]
    flag = error_flag(ks.device)
    w = _RAGGED_WORDS
    q, k = _Scan(q_fp8), _Scan(k_fp8)
    r_blocks = cdiv(T, ROWS)
    base = buf.data_ptr()
    ptrs = (ks.data_ptr(), ke.data_ptr(), base, base + 4 * Tp, flag.data_ptr(), q.t.data_ptr(), k.t.data_ptr())
    key = (T, N, q.key(), k.key()) if aligned(*ptrs) else None

    def build():
        return (r_blocks + q.blocks + k.blocks,), dict(
            ks=ks, ke=ke, ks_out=ks_out, ke_out=ke_out, flag=flag, T=T, N=N, R_BLOCKS=r_blocks, Q_BLOCKS=q.blocks,
            w_ks_lo=w[0], w_ks_hi=w[1], w_ke_lo=w[2], w_ke_hi=w[3], w_order=w[4],
            **dict(zip(("q", "nq", "q1", "q2", "q3", "qt0", "qt1", "qt2", "qt3"), q.args())), w_q=w[5],
            **dict(zip(("k", "nk", "k1", "k2", "k3", "kt0", "kt1", "kt2", "kt3"), k.args())), w_k=w[6],
            ROWS=ROWS, BLOCK=SCAN_BLOCK)

    if T or q.n or k.n:
        _RAGGED(key, ptrs, build)
    return ks_out, ke_out


def check_paged(q_fp8: torch.Tensor, context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                n_pages: int) -> torch.Tensor:
    """Device checks of ``indexer_logits_paged`` for a kernel without in-kernel ones (its Gluon kernel): ``q_fp8
    [B, n, H, 128]`` contiguous, ``context_lens [B, n]`` and ``block_table [B, maxp]`` int32 contiguous, the
    cache of ``n_pages`` pages. Returns the lengths sanitised (``[B, n] int32``: a request with a bad length
    or a bad reachable page id gets 0 throughout, so the kernel reads nothing for it and its rows score
    -inf); the first error goes to the error word, as the Triton kernel's own checks do."""
    B, n = context_lens.shape
    out = torch.empty(B, n, dtype=torch.int32, device=context_lens.device)
    if B == 0:
        return out
    flag = error_flag(context_lens.device)
    maxp = block_table.shape[1]
    hi = min(max_context_len, maxp * PAGE_SIZE)
    qbytes = q_fp8[0].numel()
    ptrs = (q_fp8.data_ptr(), context_lens.data_ptr(), block_table.data_ptr(), out.data_ptr(), flag.data_ptr())
    key = (B, n, qbytes, maxp, block_table.stride(0), hi, n_pages) if aligned(*ptrs) else None

    def build():
        return (B,), dict(q=q_fp8.view(torch.uint8), context_lens=context_lens, block_table=block_table, ctx_out=out,
                          flag=flag, hi=hi, last_page=n_pages - 1, stride_bt=block_table.stride(0), code0=PAGED_CODE0,
                          NEXT_N=n, NP=triton.next_power_of_2(n), QBYTES=qbytes, BLOCK=SCAN_BLOCK, BLOCK_P=256,
                          PAGE=PAGE_SIZE)

    _PAGED(key, ptrs, build)
    return out


_RAGGED_WORDS = _words(
    "indexer_logits_ragged",
    ("ks", "values >= 0"), ("ks", "values <= k_fp8.shape[0]"), ("ke", "values >= 0"),
    ("ke", "values <= k_fp8.shape[0]"), ("ke - ks", "ke >= ks, i.e. values >= 0"),
    ("q_fp8", "finite values", E4M3_NAN), ("k_fp8", "finite values", E4M3_NAN))
