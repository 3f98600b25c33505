"""Proof that a parallel run is one process's: layer by layer, on the same inputs.

Free-running, a parallel run and one process drift apart wherever their rounding differs (DCP merges
bf16 partial outputs), and a later layer's top-k can then flip at a near tie, which moves that row's
output by O(1) — a comparison of final logits cannot tell that from a bug. So the check runs the
single process first and records, for every forward and every DSA layer, its input ``x``, its selection
(as positions) and its latent attention output (what ``finish`` gets); then the parallel run gets each
layer's recorded input (:func:`trace` with ``force``), and every layer is compared on equal inputs:

    selection   bitwise: the same positions for every query row (docs/DSA.md §8: ranks select one process's tokens)
    output      |out_par - out_one| <= (3 * 2^-8 + 2 k 2^-24) * max |V|

The bound: one process rounds its output ``o`` to bf16 once (error <= u |o|, u = 2^-8); DCP rounds each
rank's partial ``o_r`` (<= u |o_r|), merges them with weights that sum to 1 (<= u max |o_r|) and rounds
the result (<= u |o|); every |o| is a convex combination of value rows, so <= max |V|: 3 u max |V|. Both
sides sum up to k = topk softmax terms in fp32 in different orders: 2 k 2^-24 max |V| more. Prefill CP
changes no arithmetic of any row (only which process does it), so there the outputs are equal.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from flashdsa.cache.metadata import EXTEND, BatchMetadata

BF16_U = 2.0 ** -8
FP32_U = 2.0 ** -24


def output_tolerance(max_v: float, topk: int) -> float:
    """The bound of the module docstring for values of magnitude <= ``max_v`` and ``topk`` selected keys."""
    return (3 * BF16_U + 2 * topk * FP32_U) * max_v


def selection_positions(sel: torch.Tensor, batch: BatchMetadata, page_size: int) -> torch.Tensor:
    """A layer's selection as positions in each row's request: ``[R, k] int64``, -1 kept.

    One process / prefill CP: extend selections are rows of the gathered KV (position = row - ks), decode
    selections physical slots (inverted through the block table). DCP's plan keeps the positions it merged.
    """
    sel = sel.long()
    if batch.mode == EXTEND:
        return torch.where(sel >= 0, sel - batch.ks.long()[:, None], -1)
    n = batch.context_lens.shape[1]
    table = batch.block_table.long().cpu()
    out = torch.full(sel.shape, -1, dtype=torch.int64)
    s = sel.cpu()
    pages_used = (batch.context_lens.cpu().amax(1) + page_size - 1) // page_size  # the rest of a row is padding
    for row in range(s.shape[0]):
        index_of_page = {int(p): j for j, p in enumerate(table[row // n, : pages_used[row // n]])}
        valid = s[row] >= 0
        pages = [index_of_page[int(p)] for p in (s[row][valid] // page_size)]
        out[row, valid] = torch.tensor(pages, dtype=torch.int64) * page_size + s[row][valid] % page_size
    return out.to(sel.device)


@contextlib.contextmanager
def trace(model, force: list[dict] | None = None) -> Iterator[list[dict]]:
    """Record every DSA layer of ``model`` (a ``DSAModel``) per forward; optionally feed recorded inputs.

    Yields a list that gets one dict per forward: ``{layer_id: {"x", "out", "positions", "rows"}}`` —
    ``x`` the layer's input rows ``[t, hidden]``, ``out`` its latent output ``[t, h, 512]``, ``positions``
    its selection as positions (``[t, k]``, None after the dense fallback) and ``rows`` the batch rows
    this process ran (``[t] int64``; None: all of them). With ``force`` (a list recorded by one process
    over the same calls), forward i's layer l gets ``force[i][l]["x"]`` (its own rows of it) as input.
    """
    records: list[dict] = []
    current: dict = {}
    handles = []
    attns = [layer.self_attn for layer in model.layers]

    def pre(module, args):
        x, cos, sin, batch, pool, prev = args
        if module.layer_id == attns[0].layer_id:
            current.clear()
            records.append({})
        rows = getattr(batch.parallel, "rows", None)
        if hasattr(batch.parallel, "keep_positions"):
            batch.parallel.keep_positions = True  # DCP: keep the merged positions for the comparison
        if force is not None:
            full = force[len(records) - 1][module.layer_id]["x"]
            x = full if rows is None else full.index_select(0, rows.to(full.device))
        current[module.layer_id] = {"x": x, "rows": rows, "batch": batch, "pool": pool}
        return (x, cos, sin, batch, pool, prev)

    def post(module, args, output):
        _, sel = output
        rec = current[module.layer_id]
        batch, pool = rec.pop("batch"), rec.pop("pool")
        plan_positions = getattr(batch.parallel, "positions", None)
        if sel is None:
            rec["positions"] = None
        elif plan_positions is not None:  # DCP: the merged positions (a skip layer reuses the last ones)
            rec["positions"] = plan_positions[max(k for k in plan_positions if k <= module.layer_id)]
        else:
            rec["positions"] = selection_positions(sel, batch, pool.page_size)
        records[-1][module.layer_id] = rec

    def finish(module):
        inner = module.finish

        def recording(out_latent):
            current[module.layer_id]["out"] = out_latent
            return inner(out_latent)
        return recording

    try:
        for attn in attns:
            handles.append(attn.register_forward_pre_hook(pre))
            handles.append(attn.register_forward_hook(post))
            attn.finish = finish(attn)
        yield records
    finally:
        for h in handles:
            h.remove()
        for attn in attns:
            del attn.finish  # the class's method again


def compare(one: list[dict], par: list[dict], max_v: dict[int, float], topk: int) -> dict:
    """Layer-by-layer comparison of a forced parallel trace with one process's (module docstring).

    ``max_v[layer]``: max |V| of the layer's values (one process's cache). Returns ``selections_equal``
    (bool), ``mismatches`` (the first few ``(forward, layer, rows)`` that differ), ``max_abs`` (the largest
    |out_par - out_one|), ``worst_over_tolerance`` (the largest
    |out_par - out_one| / tolerance of its layer; <= 1 passes) and ``layers`` compared.
    """
    mismatches, max_abs, worst, n = [], 0.0, 0.0, 0
    for step, (a, b) in enumerate(zip(one, par, strict=True)):
        for layer, rec in b.items():
            ref = a[layer]
            rows = rec["rows"]
            pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows.to(t.device)))
            if (rec["positions"] is None) != (ref["positions"] is None):
                mismatches.append((step, layer, "dense vs sparse"))
            elif rec["positions"] is not None:
                got, want = rec["positions"].sort(1).values.cpu(), pick(ref["positions"]).sort(1).values.cpu()
                if got.shape != want.shape or not torch.equal(got, want):
                    rows_off = (got != want).any(1).nonzero().squeeze(1).tolist() if got.shape == want.shape else "all"
                    mismatches.append((step, layer, rows_off))
            d = float((rec["out"].float() - pick(ref["out"]).float().to(rec["out"].device)).abs().max()) \
                if rec["out"].numel() else 0.0
            max_abs = max(max_abs, d)
            worst = max(worst, d / output_tolerance(max_v[layer], topk))
            n += 1
    return {"selections_equal": not mismatches, "mismatches": mismatches[:8], "max_abs": max_abs,
            "worst_over_tolerance": worst, "layers": n}


def max_values(pool, req_ids) -> dict[int, float]:
    """max |V| (the 512 latent dims) of every layer's cache over the live requests ``req_ids``."""
    slots = torch.cat([pool.slots(r) for r in req_ids])
    return {layer: float(pool.read(layer, slots)[:, :512].abs().max()) for layer in range(pool.num_layers)}


def inputs_only(records: list[dict]) -> list[dict]:
    """What ``trace(force=...)`` needs of a recording: each layer's input."""
    return [{layer: {"x": rec["x"]} for layer, rec in step.items()} for step in records]
