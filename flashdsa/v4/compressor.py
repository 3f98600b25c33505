"""DeepSeek-V4's token compressor over a batch of equal-length requests, as HF's
``DeepseekV4{CSA,HCA}Compressor`` and ``DeepseekV4Indexer`` compute it (plain PyTorch in the model's op order and
layout; the fused kernel is a later step of #43).

A compressed layer turns every ``rate`` tokens into one entry: ``entry = sum_j softmax_j(Z_j + B_j) * C_j``
over the window's tokens, per channel, where ``C = H W_kv`` and ``Z = H W_gate`` are projections of the
hidden states and ``B`` a learned ``[rate, width]`` position bias; the layer then RMS-normalises the entry
and rotates its trailing RoPE slice at the position ``n * rate`` (entry n). HCA (rate 128) pools disjoint
windows. CSA (rate 4) and its indexer **overlap** windows: the projections are ``2 D`` wide, a token's first
D channels (``Ca``) feed the *next* window's entry and its last D (``Cb``) its own, so entry n pools
``2 rate`` slots: window n - 1's Ca and window n's Cb (entry 0's Ca half is empty: weight 0).

What requests carry between calls (:class:`CompressState`; the layer step keeps it as a ring of projected tokens
and rebuilds it a call): the tokens of the window not yet closed
(fewer than ``rate``), and for overlapping layers the last closed window's Ca half (kv and gate, bias
included) — all-or-nothing: :func:`compress` returns a new state and leaves the old one as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CompressState:
    """B requests' compressor state for one series: ``pending_kv / pending_gate [B, p, W]`` (p < rate tokens of
    the open window, as projected), ``overlap_kv / overlap_gate [B, rate, W / 2]`` (overlapping layers: the last
    closed window's Ca half, its gate with the position bias added; None before the first window closes),
    ``entries`` (entries emitted so far: the next entry's index)."""
    pending_kv: torch.Tensor
    pending_gate: torch.Tensor
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None
    entries: int = 0

    @classmethod
    def empty(cls, batch: int, width: int, dtype: torch.dtype, device=None) -> "CompressState":
        z = torch.zeros(batch, 0, width, dtype=dtype, device=device)
        return cls(z, z.clone())


def compress(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, rate: int, overlap: bool,
             state: CompressState | None = None) -> tuple[torch.Tensor, CompressState]:
    """Pool B requests' new tokens (the same number each) into the entries whose windows they close.

    Args:
        kv, gate:      ``[B, t, W]`` this call's tokens projected (``W = 2 D`` overlapping, else ``D``), model
                       dtype.
        position_bias: ``[rate, W] float32``.
        rate:          tokens an entry stands for.
        overlap:       CSA / its indexer (True) or HCA (False).
        state:         what earlier calls left (None: new requests).

    Returns ``(entries [B, e, D], state)``: the entries closed by this call, before RMSNorm and RoPE (entry i
    of them is entry ``state.entries + i`` of each request, at position ``(state.entries + i) * rate``), and
    the requests' new state (``state`` itself is left as it was).
    """
    if kv.dim() != 3:
        raise ValueError(f"kv: expected [B, t, W], got {tuple(kv.shape)}")
    B, t, W = kv.shape
    if gate.shape != (B, t, W):
        raise ValueError(f"gate: expected shape {(B, t, W)} (kv's), got {tuple(gate.shape)}")
    if position_bias.shape != (rate, W):
        raise ValueError(f"position_bias: expected shape {(rate, W)}, got {tuple(position_bias.shape)}")
    if overlap and W % 2:
        raise ValueError(f"kv: an overlapping compressor's width is 2 x head_dim, got {W}")
    state = state or CompressState.empty(B, W, kv.dtype, kv.device)
    if state.pending_kv.shape[0] != B:
        raise ValueError(f"state: holds {state.pending_kv.shape[0]} requests, kv {B}")
    kv = torch.cat([state.pending_kv, kv], dim=1)
    gate = torch.cat([state.pending_gate, gate], dim=1)
    n = kv.shape[1] // rate
    usable = n * rate
    pending_kv, pending_gate = kv[:, usable:], gate[:, usable:]
    D = W // 2 if overlap else W
    if n == 0:
        return kv.new_zeros(B, 0, D), CompressState(pending_kv, pending_gate, state.overlap_kv, state.overlap_gate,
                                                    state.entries)
    # HF's layout: [B, n, 2 rate, D] slots (overlapping) or [B, n, rate, D]
    chunk_kv = kv[:, :usable].view(B, n, rate, W)
    chunk_gate = gate[:, :usable].view(B, n, rate, W) + position_bias
    if overlap:
        slots_kv = chunk_kv.new_zeros(B, n, 2 * rate, D)
        slots_gate = chunk_gate.new_full((B, n, 2 * rate, D), float("-inf"))
        slots_kv[:, :, rate:] = chunk_kv[..., D:]
        slots_gate[:, :, rate:] = chunk_gate[..., D:]
        slots_kv[:, 1:, :rate] = chunk_kv[:, :-1, :, :D]
        slots_gate[:, 1:, :rate] = chunk_gate[:, :-1, :, :D]
        if state.overlap_kv is not None:
            slots_kv[:, 0, :rate] = state.overlap_kv.to(slots_kv.dtype)
            slots_gate[:, 0, :rate] = state.overlap_gate.to(slots_gate.dtype)
        new_overlap = (chunk_kv[:, -1, :, :D].clone(), chunk_gate[:, -1, :, :D].clone())
    else:
        slots_kv, slots_gate = chunk_kv, chunk_gate
        new_overlap = (None, None)
    # HF's op order: softmax in fp32, cast to the tokens' dtype, product and sum there
    entries = (slots_kv * slots_gate.softmax(dim=2, dtype=torch.float32).to(slots_kv.dtype)).sum(dim=2)
    return entries, CompressState(pending_kv, pending_gate, *new_overlap, state.entries + n)
