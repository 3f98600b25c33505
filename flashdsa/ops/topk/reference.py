"""Exact top-k with slot translation in plain PyTorch.

The order that defines "top": larger score first; NaN counts as -inf; -0.0 equals +0.0; among equal
scores the smaller position wins. The k best candidates of a row are returned in ascending position
order (good locality for the attention gather), padded with -1.
"""

from __future__ import annotations

import torch


def select_positions(logits: torch.Tensor, lengths: torch.Tensor, topk: int, row_starts: torch.Tensor | None) -> torch.Tensor:
    """``logits [R, L] f32, lengths [R] -> [R, topk] int64`` row-relative positions, ascending, -1 padded."""
    R, L = logits.shape
    out = torch.full((R, topk), -1, dtype=torch.int64, device=logits.device)
    lengths = lengths.cpu()
    starts = torch.zeros(R, dtype=torch.int64) if row_starts is None else row_starts.cpu()
    for r in range(R):
        n = int(lengths[r])
        s0 = int(starts[r])
        if n == 0:
            continue
        row = logits[r, s0:s0 + n].double()
        row = torch.where(torch.isnan(row), float("-inf"), row)
        # A stable sort keeps equal scores in position order, so the smaller position wins a tie.
        order = torch.sort(row, descending=True, stable=True).indices[:topk]
        out[r, : order.numel()] = torch.sort(order).values
    return out


def topk_transform(logits, lengths, topk, page_table, row_starts, out_offsets, page_size):
    return translate(select_positions(logits, lengths, topk, row_starts), page_table, out_offsets, page_size)


def translate(pos: torch.Tensor, page_table: torch.Tensor | None, out_offsets: torch.Tensor | None,
              page_size: int) -> torch.Tensor:
    """``pos [R, k] int64`` row-relative positions (-1: none) -> ``[R, k] int32``: physical slots through
    ``page_table [R / g, maxp]`` (g rows a table row), ``p + out_offsets [R]``, or the positions; -1 stays."""
    valid = pos >= 0
    if page_table is not None:
        rows_per_table = pos.shape[0] // max(1, page_table.shape[0])
        table = page_table.long().repeat_interleave(rows_per_table, dim=0)
        if table.shape[1] == 0:  # valid when no row has a candidate; gather still needs a column to read
            table = table.new_zeros(table.shape[0], 1)
        page = torch.gather(table, 1, torch.where(valid, pos // page_size, 0))
        out = page * page_size + pos % page_size
    elif out_offsets is not None:
        out = pos + out_offsets.long()[:, None]
    else:
        out = pos
    return torch.where(valid, out, -1).to(torch.int32)
