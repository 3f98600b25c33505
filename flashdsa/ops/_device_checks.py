"""The value checks of the default mode, on the device (``flashdsa._checks`` describes the modes).

One small kernel per op call, launched before the op's own kernel on the same stream: it checks the
metadata (lengths, ranges, page ids: what could make the op's kernel read out of bounds) and scans the
float inputs for NaN / inf (what would make the backends disagree), writes SANITISED copies of the
metadata for the op's kernel (a row with any bad value gets length 0, so nothing is read through it)
and stores the first error it finds into the host-mapped error word (``_checks.error_flag``), which the
next flashdsa call, or ``flashdsa.ops.check_errors()``, raises as the host check's ValueError. No host
sync, no device-side assert (which would poison the CUDA context), CUDA-graph safe; the op kernels are
untouched.

Each error is one int64 store ``word | (value & 0xFFFFFFFF)`` (``word`` = ``error_word(code)``); the
codes name the argument as the host checks do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa._checks import E4M3_NAN, error_code, error_flag, error_word, finite_text
from flashdsa.ops._common import INT32_MAX
from flashdsa.ops._launch import KernelLauncher, aligned
from flashdsa.ops._triton_utils import cdiv, next_pow2

SCAN_BLOCK = 2048     # elements a scan program reads
ROWS = 128            # metadata rows a program checks (top-k, ragged)
PAGE_BLOCK = 128      # page-table entries a step
_I32_MAX = tl.constexpr(INT32_MAX)  # kernels may read only constexpr globals (the interpreter does not enforce it)
F32_MAX = 3.4028234663852886e38
KIND = {torch.float8_e4m3fn: 0, torch.uint8: 0, torch.float32: 1, torch.bfloat16: 2}  # how _scan reads


# ---- kernels --------------------------------------------------------------------------------------------

@triton.jit
def _flag(flag, bad, value, word):
    """Store ``word | value`` (clamped to int32, its low 32 bits) into the error word where ``bad`` (a
    scalar)."""
    v = tl.minimum(tl.maximum(value.to(tl.int64), -2147483648), 2147483647)
    tl.store(flag, word | (v & 0xFFFFFFFF), mask=bad)


@triton.jit
def _flag_lo_hi(flag, v, m, lo, hi, word_lo, word_hi):
    """Flag the smallest value of ``v [N]`` below ``lo`` / the largest above ``hi`` (masked by ``m``; a
    value too small wins, as the host check tests ``min`` first); returns the per-element bad mask."""
    bad_lo = m & (v < lo)
    bad_hi = m & (v > hi)
    _flag(flag, tl.max(bad_hi.to(tl.int32), axis=0) > 0, tl.max(tl.where(bad_hi, v, lo), axis=0), word_hi)
    _flag(flag, tl.max(bad_lo.to(tl.int32), axis=0) > 0, tl.min(tl.where(bad_lo, v, hi), axis=0), word_lo)
    return bad_lo | bad_hi


@triton.jit
def _check_pages(flag, p_row, n_pages, last_page, w_lo, w_hi, BLOCK_P: tl.constexpr):
    """Flag a page id outside [0, last_page] among the first ``n_pages`` of the table row ``p_row``;
    returns 1 if there was one, else 0 (int32 scalar)."""
    bad = tl.zeros([], tl.int32)
    for p0 in range(0, n_pages, BLOCK_P):
        o_p = p0 + tl.arange(0, BLOCK_P)
        m_p = o_p < n_pages
        ids = tl.load(p_row + o_p, mask=m_p, other=0)
        bad_p = _flag_lo_hi(flag, ids, m_p, 0, last_page, w_lo, w_hi)
        bad = tl.maximum(bad, tl.max(bad_p.to(tl.int32), axis=0))
    return bad


@triton.jit
def _scan(x, flag, word, i_blk, n, s1, s2, s3, t0, t1, t2, t3, bound, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``i_blk`` of a <= 4-D tensor (sizes [*, s1, s2, s3], element strides t0..t3) read in
    row-major order: flag a NaN e4m3 code (KIND 0: bytes), or a NaN / |value| > bound (1: fp32, 2: bf16
    as int16 bits)."""
    o = i_blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    i3 = o % s3
    r = o // s3
    i2 = r % s2
    r = r // s2
    i1 = r % s1
    i0 = r // s1
    p = x + i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3
    if KIND == 0:
        b = tl.load(p, mask=m, other=0).to(tl.int32)
        bad = m & ((b & 0x7F) == 0x7F)
    else:
        if KIND == 2:
            v = (tl.load(p, mask=m, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            v = tl.load(p, mask=m, other=0.0)
        bad = m & ((v != v) | (tl.abs(v) > bound))
    tl.store(flag, word, mask=tl.max(bad.to(tl.int32), axis=0) > 0)


@triton.jit
def scan_kernel(flag,
                x0, n0, a1, a2, a3, a4, a5, a6, a7, bound0, word0, blocks0,
                x1, n1, b1, b2, b3, b4, b5, b6, b7, bound1, word1, blocks1,
                x2, n2, c1, c2, c3, c4, c5, c6, c7, bound2, word2,
                K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, NT: tl.constexpr, BLOCK: tl.constexpr):
    """NaN / inf scans of up to 3 tensors in one launch: programs [0, blocks0) scan x0, the next blocks1
    x1, the rest x2 (each tensor: numel, sizes 1-3, strides 0-3, bound, error word)."""
    pid = tl.program_id(0)
    if pid < blocks0:
        _scan(x0, flag, word0, pid, n0, a1, a2, a3, a4, a5, a6, a7, bound0, K0, BLOCK)
    elif NT > 1 and pid < blocks0 + blocks1:
        _scan(x1, flag, word1, pid - blocks0, n1, b1, b2, b3, b4, b5, b6, b7, bound1, K1, BLOCK)
    elif NT > 2:
        _scan(x2, flag, word2, pid - blocks0 - blocks1, n2, c1, c2, c3, c4, c5, c6, c7, bound2, K2, BLOCK)


@triton.jit
def paged_check_kernel(lens, lens_out, bt, stride_bt, flag, B, hi, last_page,
                       w_len_lo, w_len_hi, w_page_lo, w_page_hi,
                       q, nq, q1, q2, q3, qt0, qt1, qt2, qt3, w_q,
                       NEXT_N: tl.constexpr, NP: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Programs [0, B): request b's lengths ``lens [B, NEXT_N]`` in [0, hi] and the page ids of the pages
    they reach in [0, last_page]; its sanitised lengths (0 for the whole request on any error) go to
    ``lens_out``. The rest scan ``q`` (e4m3 bytes) for NaN codes."""
    pid = tl.program_id(0)
    if pid < B:
        o = tl.arange(0, NP)
        m = o < NEXT_N
        p_len = lens + pid * NEXT_N + o
        b_len = tl.load(p_len, mask=m, other=0)
        bad = tl.max(_flag_lo_hi(flag, b_len, m, 0, hi, w_len_lo, w_len_hi).to(tl.int32), axis=0)
        # pages reached by the request's longest row (none when a length is bad)
        reach = tl.where(bad > 0, 0, tl.max(b_len, axis=0))
        n_pages = tl.cdiv(reach, PAGE)
        bad_p = _check_pages(flag, bt + pid.to(tl.int64) * stride_bt, n_pages, last_page, w_page_lo, w_page_hi,
                             BLOCK_P)
        bad = tl.maximum(bad, bad_p)
        tl.store(lens_out + pid * NEXT_N + o, tl.where(bad > 0, 0, b_len), mask=m)
    else:
        _scan(q, flag, w_q, pid - B, nq, q1, q2, q3, qt0, qt1, qt2, qt3, 0.0, 0, BLOCK)


@triton.jit
def topk_check_kernel(lengths, len_out, starts, offsets, table, stride_t, flag, R, L, maxp, last_page,
                      w_len_lo, w_len_hi, w_st_lo, w_st_hi, w_st_len, w_off_lo, w_off_hi, w_pages, w_page_lo,
                      w_page_hi,
                      G: tl.constexpr, GP: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                      HAS_TABLE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr):
    """Program g: rows g * G .. g * G + G - 1 (with a page table: the rows of table row g). lengths in
    [0, L]; row_starts in [0, L] and row_starts + lengths <= L; out_offsets >= 0 and
    out_offsets + lengths - 1 <= INT32_MAX; the table row's pages needed by its longest row <= maxp, and
    their ids in [0, last_page]. Sanitised lengths (0 for a bad row; for the table row's rows on a table
    error) go to ``len_out``."""
    pid = tl.program_id(0)
    o_g = tl.arange(0, GP)
    o = pid.to(tl.int64) * G + o_g
    m = (o_g < G) & (o < R)
    b_len = tl.load(lengths + o, mask=m, other=0)
    bad = _flag_lo_hi(flag, b_len, m, 0, L, w_len_lo, w_len_hi)
    # each later check looks at the rows the earlier ones passed: one bad value, the host check's error
    if HAS_STARTS:
        b_st = tl.load(starts + o, mask=m, other=0)
        bad |= _flag_lo_hi(flag, b_st, m & (bad == 0), 0, L, w_st_lo, w_st_hi)
        end = b_st.to(tl.int64) + b_len
        bad |= _flag_lo_hi(flag, end, m & (bad == 0), 0, L, w_st_len, w_st_len)
    if HAS_OFFSETS:
        b_off = tl.load(offsets + o, mask=m, other=0)
        bad |= _flag_lo_hi(flag, b_off, m & (bad == 0), 0, _I32_MAX, w_off_lo, w_off_lo)
        last = b_off.to(tl.int64) + b_len - 1
        bad |= _flag_lo_hi(flag, last, m & (bad == 0), -_I32_MAX - 1, _I32_MAX, w_off_hi, w_off_hi)
    if HAS_TABLE:
        need = tl.max(tl.where(bad, 0, b_len), axis=0)
        n_pages = tl.cdiv(need, PAGE_SIZE)
        tbad = n_pages > maxp
        _flag(flag, tbad, n_pages, w_pages)
        n_pages = tl.where(tbad, 0, n_pages)
        bad_p = _check_pages(flag, table + pid.to(tl.int64) * stride_t, n_pages, last_page, w_page_lo, w_page_hi,
                             BLOCK_P)
        bad |= tbad | (bad_p > 0)
    tl.store(len_out + o, tl.where(bad, 0, b_len), mask=m)


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
        bad = _flag_lo_hi(flag, b_ks, m, 0, N, w_ks_lo, w_ks_hi)
        bad |= _flag_lo_hi(flag, b_ke, m & (bad == 0), 0, N, w_ke_lo, w_ke_hi)
        bad |= _flag_lo_hi(flag, b_ke - b_ks, m & (bad == 0), 0, _I32_MAX, w_order, w_order)
        tl.store(ks_out + o, tl.where(bad, 0, b_ks), mask=m)
        tl.store(ke_out + o, tl.where(bad, 0, b_ke), mask=m)
    elif pid < R_BLOCKS + Q_BLOCKS:
        _scan(q, flag, w_q, pid - R_BLOCKS, nq, q1, q2, q3, qt0, qt1, qt2, qt3, 0.0, 0, BLOCK)
    else:
        _scan(k, flag, w_k, pid - R_BLOCKS - Q_BLOCKS, nk, k1, k2, k3, kt0, kt1, kt2, kt3, 0.0, 0, BLOCK)


# ---- host side ------------------------------------------------------------------------------------------

def _dims4(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``t`` as (a tensor of <= 4 dims with the same elements, sizes 1..3, strides 0..3)."""
    if t.dim() > 4:
        t = t.reshape(-1, *t.shape[-3:])  # a view when the leading dims merge, else a copy
    shape = (1,) * (4 - t.dim()) + tuple(t.shape)
    stride = (0,) * (4 - t.dim()) + tuple(t.stride())
    return t, shape[1:], stride


def _scan_view(t: torch.Tensor) -> torch.Tensor:
    """What the scan reads: e4m3 as its bytes, bf16 as int16 bits, fp32 as is."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    return t


class _Scan:
    """One tensor's part of a scan launch: its argument list, key and block count."""
    __slots__ = ("t", "n", "sizes", "strides", "bound", "word", "kind", "blocks")

    def __init__(self, t: torch.Tensor, bound: float | None, word: int):
        t, sizes, strides = _dims4(t)
        self.t, self.n, self.sizes, self.strides = t, t.numel(), sizes, strides
        self.bound = F32_MAX if bound is None else float(bound)
        self.word, self.kind = word, KIND[t.dtype]
        self.blocks = cdiv(self.n, SCAN_BLOCK)

    def key(self):
        return (self.n, self.sizes, self.strides, self.bound, self.word, self.kind)

    def args(self, view: bool) -> list:
        x = _scan_view(self.t) if view else self.t.data_ptr()
        return [x, self.n, *self.sizes, *self.strides, self.bound, self.word]


_SCAN = None
_PAGED = None
_TOPK = None
_RAGGED = None


def _launchers():
    global _SCAN, _PAGED, _TOPK, _RAGGED
    _SCAN = KernelLauncher(scan_kernel, ("flag", "x0", "x1", "x2"))
    _PAGED = KernelLauncher(paged_check_kernel, ("lens", "lens_out", "bt", "flag", "q"))
    _TOPK = KernelLauncher(topk_check_kernel, ("lengths", "len_out", "starts", "offsets", "table", "flag"))
    _RAGGED = KernelLauncher(ragged_check_kernel, ("ks", "ke", "ks_out", "ke_out", "flag", "q", "k"))


_launchers()


def _words(op: str, *specs: tuple) -> tuple[int, ...]:
    return tuple(error_word(error_code(op, *s)) for s in specs)


def scan_finite(op: str, tensors: list[tuple[str, torch.Tensor, float | None]]) -> None:
    """Flag NaN (e4m3: NaN codes; floats: NaN / inf / |x| > bound) in up to 3 ``(name, tensor, bound)``."""
    parts = [_Scan(t, b, error_word(error_code(op, name, finite_text(b), E4M3_NAN if t.dtype in (
        torch.float8_e4m3fn, torch.uint8) else "NaN / inf or a larger value")))
        for name, t, b in tensors if t.numel()]
    if not parts:
        return
    flag = error_flag(parts[0].t.device)
    while len(parts) < 3:
        parts.append(None)
    used = [p for p in parts if p is not None]
    blocks = sum(p.blocks for p in used)
    fptr = flag.data_ptr()
    ptrs = (fptr, *(p.t.data_ptr() if p is not None else fptr for p in parts))
    key = ("scan", tuple(p.key() if p is not None else None for p in parts)) if aligned(*ptrs) else None

    def build():
        kw = dict(flag=flag, K0=0, K1=0, K2=0, NT=len(used), BLOCK=SCAN_BLOCK)
        for i, (p, names) in enumerate(zip(parts, (("x0", "n0", "a"), ("x1", "n1", "b"), ("x2", "n2", "c")))):
            x, n, pre = names
            vals = p.args(True) if p is not None else [flag, 0, 1, 1, 1, 0, 0, 0, 0, 0.0, 0]
            kw[x], kw[n] = vals[0], vals[1]
            for j in range(7):
                kw[f"{pre}{j + 1}"] = vals[2 + j]
            kw[f"bound{i}"], kw[f"word{i}"] = vals[9], vals[10]
            kw[f"K{i}"] = p.kind if p is not None else 1
        kw["blocks0"] = parts[0].blocks
        kw["blocks1"] = parts[1].blocks if parts[1] is not None else 0
        return (blocks,), kw

    _SCAN(key, ptrs, build)


def check_paged(q_fp8: torch.Tensor, index_cache: torch.Tensor, context_lens: torch.Tensor,
                block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """Device checks of ``indexer_logits_paged`` (arguments as there, the small ones contiguous): the
    sanitised ``context_lens [B, n] int32`` for the kernel."""
    B, n = context_lens.shape
    out = torch.empty_like(context_lens)
    if B == 0 or n == 0:
        return out
    flag = error_flag(q_fp8.device)
    P, maxp = index_cache.shape[0], block_table.shape[1]
    hi = min(max_context_len, maxp * 64)
    words = _PAGED_WORDS
    q = _Scan(q_fp8, None, words[4])
    ptrs = (context_lens.data_ptr(), out.data_ptr(), block_table.data_ptr(), flag.data_ptr(), q.t.data_ptr())
    key = (B, n, hi, P, block_table.stride(0), q.key()) if aligned(*ptrs) else None

    def build():
        return (B + q.blocks,), dict(
            lens=context_lens, lens_out=out, bt=block_table, stride_bt=block_table.stride(0), flag=flag, B=B, hi=hi,
            last_page=P - 1, w_len_lo=words[0], w_len_hi=words[1], w_page_lo=words[2], w_page_hi=words[3],
            **dict(zip(("q", "nq", "q1", "q2", "q3", "qt0", "qt1", "qt2", "qt3"), q.args(True)[:9])), w_q=words[4],
            NEXT_N=n, NP=max(2, next_pow2(n)), PAGE=64, BLOCK_P=PAGE_BLOCK, BLOCK=SCAN_BLOCK)

    _PAGED(key, ptrs, build)
    return out


_PAGED_WORDS = _words(
    "indexer_logits_paged",
    ("context_lens", "values >= 0"), ("context_lens", "values <= min(max_context_len, 64 * block_table.shape[1])"),
    ("block_table", "page ids >= 0"), ("block_table", "page ids < index_cache.shape[0]"),
    ("q_fp8", "finite values", E4M3_NAN))


def check_topk(logits: torch.Tensor, lengths: torch.Tensor, page_table, row_starts, out_offsets,
               page_size: int) -> torch.Tensor:
    """Device checks of ``topk_transform`` (arguments as there, contiguous): the sanitised ``lengths [R]``."""
    R, L = logits.shape
    out = torch.empty_like(lengths)
    if R == 0:
        return out
    flag = error_flag(logits.device)
    if page_table is not None:
        G, groups, maxp, stride_t = R // page_table.shape[0], page_table.shape[0], page_table.shape[1], page_table.stride(0)
    else:
        G, groups, maxp, stride_t = ROWS, cdiv(R, ROWS), 0, 0
    last_page = (INT32_MAX + 1) // page_size - 1
    dummy = lengths
    ptrs = (lengths.data_ptr(), out.data_ptr(), (row_starts if row_starts is not None else dummy).data_ptr(),
            (out_offsets if out_offsets is not None else dummy).data_ptr(),
            (page_table if page_table is not None else dummy).data_ptr(), flag.data_ptr())
    key = (R, L, G, maxp, stride_t, page_size, row_starts is not None, out_offsets is not None) \
        if aligned(*ptrs) else None

    def build():
        return (groups,), dict(
            lengths=lengths, len_out=out, starts=row_starts if row_starts is not None else dummy,
            offsets=out_offsets if out_offsets is not None else dummy,
            table=page_table if page_table is not None else dummy, stride_t=stride_t, flag=flag, R=R, L=L, maxp=maxp,
            last_page=last_page, **dict(zip(_TOPK_WORD_NAMES, _TOPK_WORDS)),
            G=G, GP=max(2, next_pow2(G)), HAS_STARTS=row_starts is not None, HAS_OFFSETS=out_offsets is not None,
            HAS_TABLE=page_table is not None, PAGE_SIZE=page_size, BLOCK_P=PAGE_BLOCK)

    _TOPK(key, ptrs, build)
    return out


_TOPK_WORD_NAMES = ("w_len_lo", "w_len_hi", "w_st_lo", "w_st_hi", "w_st_len", "w_off_lo", "w_off_hi", "w_pages",
                    "w_page_lo", "w_page_hi")
_TOPK_WORDS = _words(
    "topk_transform",
    ("lengths", "values >= 0"), ("lengths", "values <= logits.shape[1]"),
    ("row_starts", "values >= 0"), ("row_starts", "values <= logits.shape[1]"),
    ("row_starts + lengths", "values <= logits.shape[1]"),
    ("out_offsets", "values >= 0"), ("out_offsets", "out_offsets + lengths - 1 <= 2^31 - 1 (int32 outputs)"),
    ("page_table", "pages needed by lengths <= page_table.shape[1]"),
    ("page_table", "page ids >= 0"), ("page_table", "page ids < 2^31 / page_size (int32 slots)"))


def check_ragged(q_fp8: torch.Tensor, k_fp8: torch.Tensor, ks: torch.Tensor,
                 ke: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Device checks of ``indexer_logits_ragged`` (ks, ke contiguous): sanitised ``(ks, ke) [T] int32``."""
    T, N = ks.shape[0], k_fp8.shape[0]
    Tp = cdiv(T, 4) * 4  # ke's copy 16-byte aligned, as a tensor of its own would be
    buf = torch.empty(2, Tp, dtype=torch.int32, device=ks.device)
    ks_out, ke_out = buf[0, :T], buf[1, :T]
    flag = error_flag(ks.device)
    w = _RAGGED_WORDS
    q, k = _Scan(q_fp8, None, w[5]), _Scan(k_fp8, None, w[6])
    r_blocks = cdiv(T, ROWS)
    base = buf.data_ptr()
    ptrs = (ks.data_ptr(), ke.data_ptr(), base, base + 4 * Tp, flag.data_ptr(), q.t.data_ptr(), k.t.data_ptr())
    key = (T, N, q.key(), k.key()) if aligned(*ptrs) else None

    def build():
        return (r_blocks + q.blocks + k.blocks,), dict(
            ks=ks, ke=ke, ks_out=ks_out, ke_out=ke_out, flag=flag, T=T, N=N, R_BLOCKS=r_blocks, Q_BLOCKS=q.blocks,
            w_ks_lo=w[0], w_ks_hi=w[1], w_ke_lo=w[2], w_ke_hi=w[3], w_order=w[4],
            **dict(zip(("q", "nq", "q1", "q2", "q3", "qt0", "qt1", "qt2", "qt3"), q.args(True)[:9])), w_q=w[5],
            **dict(zip(("k", "nk", "k1", "k2", "k3", "kt0", "kt1", "kt2", "kt3"), k.args(True)[:9])), w_k=w[6],
            ROWS=ROWS, BLOCK=SCAN_BLOCK)

    if T or q.n or k.n:
        _RAGGED(key, ptrs, build)
    return ks_out, ke_out


_RAGGED_WORDS = _words(
    "indexer_logits_ragged",
    ("ks", "values >= 0"), ("ks", "values <= k_fp8.shape[0]"), ("ke", "values >= 0"),
    ("ke", "values <= k_fp8.shape[0]"), ("ke - ks", "ke >= ks, i.e. values >= 0"),
    ("q_fp8", "finite values", E4M3_NAN), ("k_fp8", "finite values", E4M3_NAN))
