"""kpool's two kernels: the pooled key of each touched group (``kpool_pool_fwd_kernel``) and the expansion
of selected groups to token slots (``kpool_expand_fwd_kernel``). One program per group / per row block;
no host reads, so both run inside a CUDA graph.

Pooling follows ``reference.pool_keys`` step for step (max over the members, then the exponentials and
both sums over the members in order 0 .. c-1, one division), so it differs from the reference only by
the last bit of ``exp``; the rotation and fp8 quantisation are ``indexer_quant``'s kernel, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.ops._triton_utils import cdiv, next_pow2

BLOCK_N = 1024  # output columns per expand program


@triton.jit
def kpool_pool_fwd_kernel(
    k, gate, ring, ape, positions, rows, first, anchors, pooled,
    stride_k, stride_gate, stride_ring_r, stride_ring_s, stride_ring_kv, stride_pooled,
    T, S,
    C: tl.constexpr, D: tl.constexpr, OUT_BF16: tl.constexpr,
):
    i_g = tl.program_id(0)
    o_d = tl.arange(0, D)
    t = tl.load(anchors + i_g).to(tl.int64)
    # the scalars as [D] vectors: the interpreter mishandles masks built from scalar comparisons
    z_d = tl.zeros([D], tl.int64)
    p = z_d + tl.load(positions + t).to(tl.int64)
    row = z_d + tl.load(rows + t).to(tl.int64)
    f = z_d + tl.load(first + t).to(tl.int64)
    p0 = z_d + tl.load(positions + tl.load(first + t).to(tl.int64)).to(tl.int64)
    base = p // C * C

    # pass 1: the max score of each dim over the group's members written so far (member 0 always is)
    b_m = tl.full([D], float("-inf"), tl.float32)
    for i in tl.static_range(C):
        q = base + i
        m_q = q <= p
        # a member is a new token of this batch or sits in the request's ring row
        p_s = tl.where(q >= p0, gate + tl.maximum(f + q - p0, 0) * stride_gate + o_d,
                       ring + row * stride_ring_r + (q % S) * stride_ring_s + stride_ring_kv + o_d)
        # [D]
        b_s = tl.load(p_s, mask=m_q, other=0.0).to(tl.float32) + tl.load(ape + i * D + o_d)
        b_m = tl.where(m_q, tl.maximum(b_m, b_s), b_m)

    # pass 2: the softmax weights and both sums, members in order
    b_num = tl.zeros([D], tl.float32)
    b_den = tl.zeros([D], tl.float32)
    for i in tl.static_range(C):
        q = base + i
        m_q = q <= p
        p_s = tl.where(q >= p0, gate + tl.maximum(f + q - p0, 0) * stride_gate + o_d,
                       ring + row * stride_ring_r + (q % S) * stride_ring_s + stride_ring_kv + o_d)
        p_k = tl.where(q >= p0, k + tl.maximum(f + q - p0, 0) * stride_k + o_d,
                       ring + row * stride_ring_r + (q % S) * stride_ring_s + o_d)
        # [D]
        b_s = tl.load(p_s, mask=m_q, other=0.0).to(tl.float32) + tl.load(ape + i * D + o_d)
        b_k = tl.load(p_k, mask=m_q, other=0.0).to(tl.float32)
        b_e = tl.where(m_q, tl.exp(b_s - b_m), 0.0)
        b_num += b_e * b_k
        b_den += b_e
    b_out = b_num / b_den
    if OUT_BF16:
        tl.store(pooled + i_g.to(tl.int64) * stride_pooled + o_d, b_out.to(tl.bfloat16))
    else:
        tl.store(pooled + i_g.to(tl.int64) * stride_pooled + o_d, b_out)


def pool_keys(k: torch.Tensor, gate: torch.Tensor, ring: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
              rows: torch.Tensor, first: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Launcher of :func:`kpool_pool_fwd_kernel`: the same contract as ``reference.pool_keys``."""
    G, D = anchors.shape[0], k.shape[1]
    pooled = torch.empty(G, D, dtype=k.dtype, device=k.device)
    if G == 0:
        return pooled
    # rows of k / gate and of the ring are read with unit stride along D
    k, gate, ape = k.contiguous(), gate.contiguous(), ape.contiguous()
    kpool_pool_fwd_kernel[(G,)](
        k, gate, ring, ape, positions, rows, first, anchors, pooled,
        stride_k=k.stride(0), stride_gate=gate.stride(0), stride_ring_r=ring.stride(0),
        stride_ring_s=ring.stride(1), stride_ring_kv=ring.stride(2), stride_pooled=pooled.stride(0),
        T=k.shape[0], S=ring.shape[1], C=ape.shape[0], D=D, OUT_BF16=k.dtype == torch.bfloat16,
        num_warps=1,
    )
    return pooled


@triton.jit
def kpool_expand_fwd_kernel(
    groups, lengths, page_table, out_offsets, out,
    stride_groups, stride_table, stride_out, G, W, ROWS_PER_TABLE,
    C: tl.constexpr, PAGE_SIZE: tl.constexpr, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # MODE: 0 positions, 1 slots through page_table, 2 positions + out_offsets
    i_r = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < W
    L = tl.load(lengths + i_r)
    n = L // C
    v = tl.minimum(n, G)
    in_groups = o_n < v * C
    # [BLOCK_N] the group of each column (C consecutive columns read the same id)
    b_g = tl.load(groups + i_r * stride_groups + o_n // C, mask=m_n & in_groups, other=0)
    u = o_n - v * C
    in_tail = (u >= 0) & (u < L - n * C)
    b_p = tl.where(in_groups, b_g * C + o_n % C, n * C + u)
    valid = m_n & (in_groups | in_tail)
    b_p = tl.where(valid, b_p, 0)
    if MODE == 1:
        b_page = tl.load(page_table + (i_r // ROWS_PER_TABLE) * stride_table + b_p // PAGE_SIZE, mask=valid, other=0)
        b_o = b_page * PAGE_SIZE + b_p % PAGE_SIZE
    elif MODE == 2:
        b_o = b_p + tl.load(out_offsets + i_r)
    else:
        b_o = b_p
    tl.store(out + i_r * stride_out + o_n, tl.where(valid, b_o, -1).to(tl.int32), mask=m_n)


def expand(groups: torch.Tensor, lengths: torch.Tensor, c: int, page_table: torch.Tensor | None,
           out_offsets: torch.Tensor | None, page_size: int) -> torch.Tensor:
    """Launcher of :func:`kpool_expand_fwd_kernel`: the same contract as ``reference.expand``."""
    R, G = groups.shape
    W = G * c + c - 1
    out = torch.empty(R, W, dtype=torch.int32, device=groups.device)
    if R == 0 or W == 0:
        return out
    mode = 1 if page_table is not None else 2 if out_offsets is not None else 0
    table = page_table if page_table is not None else lengths  # a placeholder pointer when unused
    rows_per_table = R // page_table.shape[0] if page_table is not None else 1
    block = min(BLOCK_N, next_pow2(W))
    kpool_expand_fwd_kernel[(R, cdiv(W, block))](
        groups, lengths, table, out_offsets if out_offsets is not None else lengths, out,
        stride_groups=groups.stride(0), stride_table=table.stride(0) if page_table is not None else 0,
        stride_out=out.stride(0), G=G, W=W, ROWS_PER_TABLE=rows_per_table,
        C=c, PAGE_SIZE=page_size, MODE=mode, BLOCK_N=block,
    )
    return out
