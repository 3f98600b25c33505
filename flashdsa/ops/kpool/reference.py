"""kpool (SPEC §7) in plain PyTorch: pooling c tokens' index keys into one, and expanding selected groups
back to token positions. Written to be read; the Triton kernels beside it compute the same.

Pooling, per group of c tokens and per dim d (fp32)::

    s_i = gate_i[d] + ape[i, d]                       i = 0 .. c-1 (the token's place in its group)
    pooled[d] = sum_i exp(s_i - max_j s_j) k_i[d] / sum_i exp(s_i - max_j s_j)

over the group's tokens written so far (a group still filling pools what it has), rounded to the model
dtype; the op then rotates and quantises it as every index key is (``indexer_quant``).

Expansion, per query row with ``L`` visible tokens, ``n = L // c`` complete groups, ``v = min(G, n)``::

    columns j c .. j c + c - 1 (j < v)   tokens groups[j] c .. groups[j] c + c - 1
    columns v c .. v c + L - n c - 1     the unfinished tail n c .. L - 1 (always selected)
    the rest                             -1
"""

from __future__ import annotations

import torch


def member_sources(k: torch.Tensor, gate: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor,
                   rows: torch.Tensor, first: torch.Tensor, anchors: torch.Tensor, c: int):
    """The c members of each anchor's group: ``keys, gates [G, c, D]`` in the model dtype and ``valid [G, c]``
    (member position <= the anchor's). A member at or after the request's first new position is a new
    token of this batch, an earlier one is read from the request's ring row."""
    S = ring.shape[1]
    t = anchors.long()
    p = positions[t].long()
    f = first[t].long()
    p0 = positions[f].long()                                        # the request's first new position
    member = (p // c * c)[:, None] + torch.arange(c, device=p.device)  # [G, c] positions
    valid = member <= p[:, None]
    new = member >= p0[:, None]
    src_new = (f[:, None] + member - p0[:, None]).clamp(0, max(k.shape[0] - 1, 0))
    row = rows[t].long()[:, None].expand(-1, c)
    slot = member % S
    keys = torch.where(new[..., None], k[src_new], ring[row, slot, 0])
    gates = torch.where(new[..., None], gate[src_new], ring[row, slot, 1])
    return keys, gates, valid


def pool_keys(k: torch.Tensor, gate: torch.Tensor, ring: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
              rows: torch.Tensor, first: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The pooled (not yet rotated) key of each anchor's group: ``[G, D]`` in ``k.dtype`` (module docstring)."""
    c = ape.shape[0]
    if anchors.numel() == 0:
        return k.new_empty(0, k.shape[1])
    keys, gates, valid = member_sources(k, gate, ring, positions, rows, first, anchors, c)
    s = gates.float() + ape[None]
    s = torch.where(valid[..., None], s, float("-inf"))
    e = torch.exp(s - s.amax(dim=1, keepdim=True))                  # member 0 is always valid: finite max
    num = (e * keys.float()).sum(dim=1)
    return (num / e.sum(dim=1)).to(k.dtype)


def expand(groups: torch.Tensor, lengths: torch.Tensor, c: int, page_table: torch.Tensor | None,
           out_offsets: torch.Tensor | None, page_size: int) -> torch.Tensor:
    """``groups [R, G] int32``, ``lengths [R] int32`` -> ``[R, G c + c - 1] int32`` (module docstring),
    translated through ``page_table`` (row r reads row ``r // (R / rows)``) or by ``out_offsets``."""
    R, G = groups.shape
    W = G * c + c - 1
    col = torch.arange(W, device=groups.device)
    L = lengths.long()[:, None]
    n = L // c
    v = n.clamp(max=G)
    j = (col // c).clamp(max=max(G - 1, 0))[None, :].expand(R, -1)
    in_groups = col[None, :] < v * c
    g = torch.gather(groups.long(), 1, j) if G else torch.zeros(R, W, dtype=torch.long, device=groups.device)
    u = col[None, :] - v * c
    in_tail = (u >= 0) & (u < L - n * c)
    p = torch.where(in_groups, g * c + col[None, :] % c, n * c + u)
    valid = in_groups | in_tail
    p = torch.where(valid, p, 0)
    if page_table is not None:
        per = R // page_table.shape[0] if page_table.shape[0] else 1
        table = page_table.long()[torch.arange(R, device=groups.device) // per]
        out = torch.gather(table, 1, p // page_size) * page_size + p % page_size
    elif out_offsets is not None:
        out = p + out_offsets.long()[:, None]
    else:
        out = p
    return torch.where(valid, out, -1).to(torch.int32)
