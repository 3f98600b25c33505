"""Decode selection at latency batches (issue #41 item 3): where B 1-16's time goes, and top-k launches that
spread a few long rows over more SMs, against the peers' parts in the same run.

    PYTHONPATH=. python benchmarks/small_batch_selection.py [--batches 1,4,16] [--ctx 8192,32768,131072]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/small_batch_selection.py --smoke   # the script on the CPU

Per (B, ctx): the paged logits alone (ours, DeepGEMM), top-k alone on them (our default launch, the split
kernel at 2 .. 64 chunks a row, the rows kernel where it applies, sgl-kernel's fast_topk_transform_fused),
and the chains. Every top-k variant's slots are checked bit for bit against the default's, the default's
against the torch reference. Times: median CUDA-graph replay, µs; rows to $OUT/small_batch_selection.json.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from _common import peer_selection_us, print_table, write_json

from flashdsa import ops
from flashdsa.bench import selection_inputs
from flashdsa.ops._triton_utils import num_sms
from flashdsa.ops.indexer import paged
from flashdsa.ops.topk import launch
from flashdsa.testing import peers
from flashdsa.testing.timing import time_us

CHUNKS = (2, 4, 8, 16, 32, 64)
LOGIT_CHUNKS = (128, 256, 512, 1024, 2048)  # output columns a program of the paged logits (default: >= 512)


def variants(R: int, L: int, k: int, sms: int) -> dict[str, launch.TopkConfig]:
    split = launch.default_config(R, L, k, sms, kind="split")
    out = {"default": launch.default_config(R, L, k, sms)}
    for c in CHUNKS:
        if c * 512 <= L:
            out[f"split-c{c}"] = dataclasses.replace(split, chunks=c)
    if L <= launch.ROWS_MAX_L:
        out["rows"] = launch.default_config(R, L, k, sms, kind="rows")
    return out


def case(B: int, ctx: int, H: int, k: int, dev, status: dict, smoke: bool, logit_chunks: bool = False,
         logits_only: bool = False) -> dict:
    q, cache, w, lens, bt, max_len, _ = selection_inputs(B, ctx, H, dev)
    rows_len = lens.view(-1).contiguous()
    be = "triton" if smoke else None

    def logits():
        return ops.indexer_logits_paged(q, cache, w, lens, bt, max_len, backend=be)

    x = logits()
    sms = 4 if smoke else num_sms(dev)
    want = ops.topk_transform(x, rows_len, k, page_table=bt, backend="torch")
    row = {"B": B, "ctx": ctx, "L": max_len}
    t = (lambda fn: float("nan")) if smoke else time_us
    row["logits"] = t(logits)
    row["logits_chunk"] = paged.paged_config(B, 1, H, max_len, dev, tma=dev.type == "cuda").chunk  # the default's
    for c in LOGIT_CHUNKS if logit_chunks else ():
        if c >= 2 * 64 and c <= max(max_len, 128):
            cfg = paged.PagedConfig(chunk=c)
            def fn(cfg=cfg):
                return paged.indexer_logits_paged(q, cache, w, lens, bt, max_len, config=cfg)
            if not torch.equal(fn(), x):  # a column's score does not depend on which program computes it
                raise AssertionError(f"B {B} ctx {ctx} logits chunk {c}: differs from the default's")
            row[f"logits:c{c}"] = t(fn)
    if logits_only:
        return {**row, **peer_selection_us(q, cache, w, lens, bt, max_len, x, k, status, topk=False)}
    for name, cfg in variants(B, max_len, k, sms).items():
        def topk(cfg=cfg, x=x):
            return launch.topk_transform(x, rows_len, k, bt, None, None, 64, config=cfg)
        if not torch.equal(topk(), want):
            raise AssertionError(f"B {B} ctx {ctx} {name}: slots differ from the torch reference")
        row[f"topk:{name}"] = t(topk)
    row["chain"] = t(lambda: ops.topk_transform(logits(), rows_len, k, page_table=bt))
    tk = {kk: v for kk, v in row.items() if kk.startswith("topk:")}
    best = min(tk, key=tk.get) if not smoke else "topk:default"
    row["best_topk"] = best[5:]
    row.update(peer_selection_us(q, cache, w, lens, bt, max_len, x, k, status))
    if "peer_chain" in row:
        row["chain_x"] = row["chain"] / row["peer_chain"]
        row["parts_best_x"] = (row["logits"] + row[best]) / row["peer_chain"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ctx", default="8192,32768,131072")
    ap.add_argument("--peer-libs", default="")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter: the script only")
    ap.add_argument("--logit-chunks", action="store_true", help="also time the paged logits at each chunk width")
    ap.add_argument("--logits-only", action="store_true", help="the paged logits only (no top-k)")
    a = ap.parse_args()
    if a.smoke:
        dev, batches, ctxs, H, k, status = torch.device("cpu"), [1, 3], [1200], 8, 64, {}
    else:
        dev, H, k = torch.device("cuda"), 64, 2048
        batches, ctxs = [int(v) for v in a.batches.split(",")], [int(v) for v in a.ctx.split(",")]
        status = peers.peer_status(a.peer_libs or None)
        ops.set_value_checks(False)
    rows = []
    for ctx in ctxs:
        for B in batches:
            rows.append(case(B, ctx, H, k, dev, status, a.smoke, a.logit_chunks, a.logits_only))
            print({kk: round(v, 1) if isinstance(v, float) else v for kk, v in rows[-1].items()}, flush=True)
    write_json(rows, "small_batch_selection")
    keys = ["B", "ctx", "logits", "peer_logits", "topk:default", "best_topk", "peer_topk", "chain", "peer_chain",
            "chain_x", "parts_best_x"]
    print_table([{kk: r.get(kk, "") for kk in keys} for r in rows],
                "decode selection at small batches, µs (graph replay); x: ours / peers' chain")


if __name__ == "__main__":
    main()
