"""A V4 compressor's decode step — the new token into its ring, and the entry of the window that ends at it — as
one Triton launch (issue #43).

A decode step of a compressed layer runs each compressor once (CSA: the attention's and the indexer's): the
token's ``kv_proj`` / ``gate_proj`` go into the compressor's ring, and the window ending at the token is pooled
— softmax over the window's slots of gate + position bias, per channel; the gate-weighted sum of the slots' kv;
RMSNorm; RoPE on the trailing channels at the window's first position. In torch (:func:`close_entry_torch`, HF's
ops in HF's layout, so the same bits as HF's compressor) that is ~40 small kernels a compressor, every step
(captured steps compute the entry whether or not the window closes): on an H100 most of a V4-Flash CSA layer's
~900 µs graph replay was such kernels, and HCA's softmax over its 128-slot window (over a non-last dim, as HF
writes it) alone took 71 µs (benchmarks/v4_layer_profile.py, 2026-12-07).

The kernel (:func:`close_entry_triton`; the projections stay cuBLAS GEMMs) does it in one program a request with
the reference's roundings — the gate sum, the softmax weights, each product and the pooled sum rounded to the
model dtype, RMSNorm and RoPE in fp32, cos / sin rounded to the dtype as HF's rotary returns them — in another
order of summation (the softmax's and the pooled sum's over slots, the norm's over channels): the entry differs
from the reference's by rounding, so the fp8 mode uses it and the exact mode (HF's bits, for HF's selection)
keeps the torch ops.

Design: the slots are read from the ring in blocks of SB slots x every channel ([SB, D] tiles: D <= 512 keeps
the pooled row in registers for the norm); the softmax takes three passes over them (max, sum, weighted sum) so
that each weight is final — rounded to the dtype — before it multiplies, as HF's order requires. The window is
read from the ring after the program's own write of the token (a barrier between), so every step — closing or
not — pools what the torch ops pool. RoPE pairs (2i, 2i + 1) are re-read from the output after a barrier (a
pair's two channels sit in different threads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.ops._common import pick_backend

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _slot_rows(j, n, R, rate: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr):
    """Slots ``j [SB]`` of the window ending at entry n: (ring slot, channel offset, position-bias row, valid).
    As the torch ops index the ring (token mod ring, Python's modulo), a window that has not closed (n < 0)
    reads finite stale slots: its entry is never stored, but it passes value checks."""
    if OVERLAP:  # slots 0..rate-1: the previous window, first D channels; then this window, last D
        prev = j < rate
        tok = tl.where(prev, (n - 1) * rate + j, n * rate + j - rate)
        off = tl.where(prev, 0, D)
        brow = tl.where(prev, j, j - rate)
        ok = (j < 2 * rate) & ((tok >= 0) | ~prev)  # the first window has no earlier half: weight 0
    else:
        tok = n * rate + j
        off = j * 0
        brow = j
        ok = j < rate
    return (tok % R + R) % R, off, brow, ok


@triton.jit
def _gate(gate_ring, bias, b, j, n, R, W: tl.constexpr, rate: tl.constexpr, D: tl.constexpr, c, cm,
          OVERLAP: tl.constexpr, GDT: tl.constexpr):
    """[SB, BLOCK_D] fp32: gate + position bias rounded to the sum's dtype; -inf where a slot is not there."""
    ring, off, brow, ok = _slot_rows(j, n, R, rate, D, OVERLAP)
    m = ok[:, None] & cm[None, :]
    g = tl.load(gate_ring + (b * R + ring)[:, None] * W + off[:, None] + c[None, :], mask=m, other=0.0)
    g = g.to(tl.float32) + tl.load(bias + brow[:, None] * W + off[:, None] + c[None, :], mask=m, other=0.0).to(
        tl.float32)
    return tl.where(m, g.to(GDT).to(tl.float32), float("-inf"))


@triton.jit
def _kv(kv_ring, b, j, n, R, W: tl.constexpr, rate: tl.constexpr, D: tl.constexpr, c, cm, OVERLAP: tl.constexpr):
    ring, off, brow, ok = _slot_rows(j, n, R, rate, D, OVERLAP)
    m = ok[:, None] & cm[None, :]
    return tl.load(kv_ring + (b * R + ring)[:, None] * W + off[:, None] + c[None, :], mask=m, other=0.0).to(
        tl.float32)


@triton.jit
def close_entry_kernel(kv_new, gate_new, kv_ring, gate_ring, bias, norm_w, inv_freq, t_ptr, out, scaling, eps,
                       R, W: tl.constexpr, D: tl.constexpr, rate: tl.constexpr, ROPE: tl.constexpr,
                       OVERLAP: tl.constexpr, SB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                       GDT: tl.constexpr):
    """One program a request b: ring write, pooled entry ``out[b, :D]`` (module docstring)."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr).to(tl.int64)
    DT = out.dtype.element_ty
    c = tl.arange(0, BLOCK_D)
    cm = c < D
    slot = t % R
    for w0 in range(0, W, BLOCK_D):  # the token's projections into its ring slot
        cw = w0 + c
        mw = cw < W
        tl.store(kv_ring + (b * R + slot) * W + cw, tl.load(kv_new + b * W + cw, mask=mw), mask=mw)
        tl.store(gate_ring + (b * R + slot) * W + cw, tl.load(gate_new + b * W + cw, mask=mw), mask=mw)
    tl.debug_barrier()  # the window's reads below see the token just written, from other threads
    n = (t + 1) // rate - 1
    NS: tl.constexpr = 2 * rate if OVERLAP else rate
    s = tl.arange(0, SB)
    mx = tl.full([BLOCK_D], float("-inf"), tl.float32)
    for s0 in range(0, NS, SB):
        mx = tl.maximum(mx, tl.max(_gate(gate_ring, bias, b, s0 + s, n, R, W, rate, D, c, cm, OVERLAP, GDT),
                                   axis=0))
    den = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, NS, SB):
        g = _gate(gate_ring, bias, b, s0 + s, n, R, W, rate, D, c, cm, OVERLAP, GDT)
        den += tl.sum(tl.exp(g - mx[None, :]), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, NS, SB):
        g = _gate(gate_ring, bias, b, s0 + s, n, R, W, rate, D, c, cm, OVERLAP, GDT)
        w = (tl.exp(g - mx[None, :]) / den[None, :]).to(DT).to(tl.float32)
        x = _kv(kv_ring, b, s0 + s, n, R, W, rate, D, c, cm, OVERLAP)
        acc += tl.sum((x * w).to(DT).to(tl.float32), axis=0)
    raw = tl.where(cm, acc.to(DT).to(tl.float32), 0.0)
    y = raw * (1.0 / tl.sqrt(tl.sum(raw * raw, axis=0) / D + eps))
    y = (tl.load(norm_w + c, mask=cm, other=0.0).to(tl.float32) * y).to(DT)
    tl.store(out + b * D + c, y, mask=cm)
    tl.debug_barrier()
    i = tl.arange(0, BLOCK_R)
    im = i < ROPE // 2
    pos = (tl.maximum(n, 0) * rate).to(tl.float32)
    f = pos * tl.load(inv_freq + i, mask=im, other=0.0)
    cs = (tl.cos(f) * scaling).to(DT).to(tl.float32)
    sn = (tl.sin(f) * scaling).to(DT).to(tl.float32)
    pa = out + b * D + (D - ROPE) + 2 * i
    a = tl.load(pa, mask=im, other=0.0).to(tl.float32)
    z = tl.load(pa + 1, mask=im, other=0.0).to(tl.float32)
    tl.store(pa, (a * cs - z * sn).to(DT), mask=im)
    tl.store(pa + 1, (z * cs + a * sn).to(DT), mask=im)


def _rope_of(module) -> tuple[torch.Tensor, float]:
    rot = module.rotary_emb
    kind = module.rope_layer_type
    return getattr(rot, f"{kind}_inv_freq"), float(getattr(rot, f"{kind}_attention_scaling"))


def kernel_fits(module, ring: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether :func:`close_entry_triton` serves ``module``: a static RoPE (HF's "dynamic" rope types rescale
    with the sequence length), D <= 512 (the pooled row in registers), a ring of the model dtype."""
    rope_type = module.rotary_emb.rope_type.get(module.rope_layer_type, "default")
    return (rope_type in ("default", "yarn", "linear", "llama3") and module.kv_norm.weight.shape[0] <= 512
            and ring[0].dtype in _TL)


def close_entry_triton(module, h: torch.Tensor, ring: tuple[torch.Tensor, torch.Tensor], p: torch.Tensor,
                       overlap: bool) -> torch.Tensor:
    """:func:`close_entry_torch`'s contract in one launch after the projections: ``h [B, 1, hidden]``, ``ring``
    the compressor's ``(kv, gate) [B, ring, W]`` (written at slot ``p % ring``), ``p [1] int64`` the token's
    index on the device -> ``[B, 1, D]`` the entry of the window ending at ``p`` (meaningful only where
    ``(p + 1) % rate == 0``)."""
    kv_ring, gate_ring = ring
    B, R, W = kv_ring.shape
    D = module.kv_norm.weight.shape[0]
    kv = module.kv_proj(h).to(kv_ring.dtype).reshape(B, W).contiguous()
    gate = module.gate_proj(h).to(gate_ring.dtype).reshape(B, W).contiguous()
    bias = module.position_bias.contiguous()
    gdt = torch.promote_types(gate_ring.dtype, bias.dtype)
    inv_freq, scaling = _rope_of(module)
    rope = 2 * inv_freq.shape[0]
    out = torch.empty(B, D, dtype=kv_ring.dtype, device=h.device)
    slots = 2 * module.compress_rate if overlap else module.compress_rate
    close_entry_kernel[(B,)](kv, gate, kv_ring, gate_ring, bias, module.kv_norm.weight, inv_freq.contiguous(),
                             p.reshape(1), out, scaling, module.kv_norm.variance_epsilon, R, W=W, D=D,
                             rate=module.compress_rate, ROPE=rope, OVERLAP=overlap, SB=min(16, slots),
                             BLOCK_D=triton.next_power_of_2(D), BLOCK_R=triton.next_power_of_2(max(rope // 2, 1)),
                             GDT=_TL[gdt], num_warps=8)
    return out.view(B, 1, D)


def close_entry_torch(module, h: torch.Tensor, ring: tuple[torch.Tensor, torch.Tensor], p: torch.Tensor,
                      overlap: bool) -> torch.Tensor:
    """One decode token through compressor ``module``: its projections written to the ring (slot ``p % ring``),
    and the entry of the window that ends at ``p`` (``[B, 1, D]``, normalised and rotated at its position) —
    meaningful only where ``(p + 1) % rate == 0``. The same ops in the same layout as
    :func:`~flashdsa.v4.compressor.compress` over one closing window (and HF's decode step), so the same bits."""
    from flashdsa.v4.layer import _rope_tail
    kv_ring, gate_ring = ring
    rate, R = module.compress_rate, kv_ring.shape[1]
    slot = p % R
    kv_ring.index_copy_(1, slot, module.kv_proj(h).to(kv_ring.dtype))
    gate_ring.index_copy_(1, slot, module.gate_proj(h).to(gate_ring.dtype))
    n = (p + 1) // rate - 1
    cur = n * rate + torch.arange(rate, device=h.device)
    ckv, cgate = kv_ring[:, cur % R], gate_ring[:, cur % R] + module.position_bias
    if overlap:
        half = kv_ring.shape[-1] // 2
        prev = cur - rate
        seen = (prev >= 0)[None, :, None]  # entry 0 has no earlier window: weight 0
        pkv = torch.where(seen, kv_ring[:, prev % R, :half], 0)
        pgate = torch.where(seen, gate_ring[:, prev % R, :half] + module.position_bias[:, :half], float("-inf"))
        ckv = torch.cat((pkv, ckv[..., half:]), dim=1)
        cgate = torch.cat((pgate, cgate[..., half:]), dim=1)
    # compress()'s layout for one window, [B, 1, slots, D]: softmax in fp32, cast, product and sum in the dtype
    ckv, cgate = ckv[:, None], cgate[:, None]
    raw = (ckv * cgate.softmax(dim=2, dtype=torch.float32).to(ckv.dtype)).sum(dim=2)
    normed = module.kv_norm(raw)
    pos = (n.clamp(min=0) * rate)[None]
    cos, sin = module.rotary_emb(normed, position_ids=pos, layer_type=module.rope_layer_type)
    return _rope_tail(normed, *(t.expand(normed.shape[0], -1, -1) for t in (cos, sin)))


def close_entry(module, h: torch.Tensor, ring: tuple[torch.Tensor, torch.Tensor], p: torch.Tensor, overlap: bool,
                backend: str | None = None) -> torch.Tensor:
    """The decode compressor step: ``backend`` "torch" (HF's bits), "triton" (one launch), None: Triton on CUDA
    where :func:`kernel_fits`, else torch."""
    fits = kernel_fits(module, ring)
    if backend == "triton" and not fits:
        raise ValueError("backend: 'triton' serves compressors of D <= 512 with a static RoPE in bf16 / fp16 / fp32")
    impls = {"torch": close_entry_torch, **({"triton": close_entry_triton} if fits else {})}
    return pick_backend(backend, impls, h.device, "close_entry")(module, h, ring, p, overlap)
