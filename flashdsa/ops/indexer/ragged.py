"""Ragged indexer logits (prefill / extend): T query rows against N concatenated keys, row i scoring keys in
``[ks[i], ke[i])``.

One program keeps the transposed queries of G rows x HP heads resident and streams key blocks past them
(``common.gated_relu_sum``, one dot a step); it writes every output element (logits inside each row's
range, -inf elsewhere), uses no atomics and a fixed reduction order: the same input and launch shape give
the same bits. Design and measurements: README.md next to this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashdsa.ops._launch import KernelLauncher, aligned
from flashdsa.ops._triton_utils import cdiv, next_pow2, num_sms
from flashdsa.ops.indexer.common import (MAX_DOT_N, e4m3_bits_to_f16, fill_neg_inf, fp8_dot_supported, gated_relu_sum,
                                         logits_buffer)


@triton.jit
def indexer_logits_ragged_kernel(
    q,        # [T, H, D] e4m3 (uint8 bits when not FP8_DOT)
    k,        # [N, D] e4m3 (uint8 bits when not FP8_DOT)
    k_scale,  # [N] f32
    w,        # [T, H] f32
    ks, ke,   # [T] i32
    out,      # [T, N] f32
    T, N,
    stride_qt, stride_qh, stride_k, stride_w, stride_o,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    G: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, FP8_DOT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program (m, c): query rows m * G .. m * G + G - 1, key columns [c * CHUNK, (c + 1) * CHUNK).

    Keys are scored only between the block's smallest ks and largest ke (of its non-empty rows); the
    rest of the chunk is filled with -inf. Programs run heaviest-first (causal rows grow with m).
    """
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_c = tl.program_id(1)

    # [G] rows of this block and their key ranges
    o_i = i_m * G + tl.arange(0, G)
    m_i = o_i < T
    b_ks = tl.load(ks + o_i, mask=m_i, other=0)
    b_ke = tl.load(ke + o_i, mask=m_i, other=0)
    nonempty = b_ke > b_ks
    lo = tl.min(tl.where(nonempty, b_ks, N), axis=0)
    hi = tl.max(tl.where(nonempty, b_ke, 0), axis=0)
    p_rows = out + o_i.to(tl.int64) * stride_o

    # [G * HP] (row, head) pairs on the dot's N side; padded rows / heads get q = w = 0
    o_r = tl.arange(0, G * HP)
    r_i = (i_m * G + o_r // HP).to(tl.int64)
    r_h = o_r % HP
    m_r = (r_i < T) & (r_h < H)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    # [DP, G * HP] stays resident while the keys stream past (loaded transposed, as in the paged kernel)
    b_qt = tl.load(q + r_i[None, :] * stride_qt + r_h[None, :] * stride_qh + o_d[:, None],
                   mask=m_r[None, :] & m_d[:, None], other=0.0)
    if not FP8_DOT:
        b_qt = e4m3_bits_to_f16(b_qt)
    # [G * HP]
    b_w = tl.load(w + r_i * stride_w + r_h, mask=m_r, other=0.0)

    c0 = i_c * CHUNK
    c1 = tl.minimum(c0 + CHUNK, N)
    start = tl.minimum(tl.maximum(c0, lo // BLOCK_N * BLOCK_N), c1)
    end = start + tl.cdiv(tl.maximum(tl.minimum(c1, hi) - start, 0), BLOCK_N) * BLOCK_N
    fill_neg_inf(p_rows, m_i, c0, start, BLOCK_N, G)
    o_n = tl.arange(0, BLOCK_N)
    for t0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        o_t = tl.multiple_of(t0, BLOCK_N) + o_n
        # clamp instead of masking: the last block's extra rows re-read key N - 1 and are never stored
        o_tk = tl.minimum(o_t, N - 1).to(tl.int64)
        # [BLOCK_N, DP]
        b_k = tl.load(k + o_tk[:, None] * stride_k + o_d[None, :], mask=m_d[None, :], other=0.0)
        # [BLOCK_N]
        b_sc = tl.load(k_scale + o_tk)
        if not FP8_DOT:
            b_k = e4m3_bits_to_f16(b_k)
        # [BLOCK_N, G]
        b_l = gated_relu_sum(b_k, b_qt, b_w, G, HP) * b_sc[:, None]
        vis = (o_t[:, None] >= b_ks[None, :]) & (o_t[:, None] < b_ke[None, :])
        b_l = tl.where(vis, b_l, float("-inf"))
        tl.store(p_rows[None, :] + o_t[:, None], b_l, mask=m_i[None, :] & (o_t[:, None] < c1))
    fill_neg_inf(p_rows, m_i, end, c1, BLOCK_N, G)


@dataclass(frozen=True)
class RaggedConfig:
    """Launch configuration of the ragged kernel, what tests and benchmarks pass; ``None`` fields are chosen by
    :func:`ragged_config`.

    64 keys x 256 (row, head) columns a step in one warpgroup: 230 registers a thread, two programs an
    SM (their dots and CUDA-core epilogues overlap); 4 stages keep three key blocks in flight. Tuning
    knobs: every field but ``fp8_dot``, a test hook (False runs the fp16-upcast path of GPUs before sm_89
    on any device).
    """
    block_n: int = 64         # keys per loop step (the dot's M)
    rows: int | None = None   # query rows per program (G); G * HP is the dot's N
    chunk: int | None = None  # key columns per program
    num_warps: int = 4
    num_stages: int = 4
    fp8_dot: bool | None = None  # e4m3 tensor-core dots; None: where the GPU has them (sm_89+), False: fp16


def ragged_config(T: int, N: int, H: int, D: int, device: torch.device,
                  cfg: RaggedConfig | None = None) -> tuple[int, int, int, int, int]:
    """``(G, HP, DP, block_n, chunk)``: G rows x HP heads per dot; key columns split only when the row
    blocks alone give fewer than 4 programs per SM."""
    cfg = cfg or RaggedConfig()
    HP = max(16, next_pow2(H))
    DP = max(32, next_pow2(D))
    G = cfg.rows or max(1, MAX_DOT_N // HP)
    bn = cfg.block_n
    if cfg.chunk is not None:
        chunk = cfg.chunk
    else:
        m_blocks = cdiv(T, G)
        n_blocks = cdiv(max(N, 1), bn)
        splits = min(n_blocks, max(1, cdiv(4 * num_sms(device), max(m_blocks, 1))))
        chunk = cdiv(n_blocks, splits) * bn
    if bn < 16 or bn & (bn - 1) or chunk % bn:
        raise ValueError(f"config: block_n must be a power of two >= 16 dividing chunk, got {bn}, {chunk}")
    return G, HP, DP, bn, chunk


def indexer_logits_ragged(q_fp8: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                          ks: torch.Tensor, ke: torch.Tensor, config: RaggedConfig | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Ragged indexer logits; arguments as :func:`flashdsa.ops.indexer_logits_ragged` (validated there).

    ``q_fp8 [T, H, D] e4m3``, ``k_fp8 [N, D] e4m3``, ``k_scale [N] f32``, ``weights [T, H] f32``,
    ``ks, ke [T] i32`` -> ``[T, N] f32``. ``config`` overrides the launch (tests, benchmarks); ``out`` is an
    optional preallocated ``[T, N] f32`` buffer (every element is written).
    """
    T, H, D = q_fp8.shape
    N = k_fp8.shape[0]
    dev = q_fp8.device
    out = logits_buffer(out, (T, N), dev)
    if out.numel() == 0:
        return out
    cfg = config or _DEFAULT
    if q_fp8.stride(-1) != 1:
        q_fp8 = q_fp8.contiguous()
    if k_fp8.stride(-1) != 1:
        k_fp8 = k_fp8.contiguous()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    k_scale, ks, ke = (t if t.is_contiguous() else t.contiguous() for t in (k_scale, ks, ke))
    ptrs = (q_fp8.data_ptr(), k_fp8.data_ptr(), k_scale.data_ptr(), weights.data_ptr(), ks.data_ptr(), ke.data_ptr(),
            out.data_ptr())
    key = (dev, T, N, H, D, q_fp8.stride(0), q_fp8.stride(1), k_fp8.stride(0), weights.stride(0), out.stride(0),
           config) if aligned(*ptrs) else None

    def build():
        G, HP, DP, bn, chunk = ragged_config(T, N, H, D, dev, cfg)
        fp8_dot = fp8_dot_supported(dev) if cfg.fp8_dot is None else cfg.fp8_dot
        q_in = q_fp8 if fp8_dot else q_fp8.view(torch.uint8)
        k_in = k_fp8 if fp8_dot else k_fp8.view(torch.uint8)
        return (cdiv(T, G), cdiv(N, chunk)), dict(
            q=q_in, k=k_in, k_scale=k_scale, w=weights, ks=ks, ke=ke,
            out=out, T=T, N=N,
            stride_qt=q_in.stride(0), stride_qh=q_in.stride(1), stride_k=k_in.stride(0),
            stride_w=weights.stride(0), stride_o=out.stride(0),
            H=H, HP=HP, D=D, DP=DP, G=G, BLOCK_N=bn, CHUNK=chunk, FP8_DOT=fp8_dot,
            NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _LAUNCH(key, ptrs, build)
    return out


_DEFAULT = RaggedConfig()
_LAUNCH = KernelLauncher(indexer_logits_ragged_kernel, ("q", "k", "k_scale", "w", "ks", "ke", "out"))
