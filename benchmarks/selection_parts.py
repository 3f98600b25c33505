"""Where decode selection's time goes: the paged logits alone, top-k alone on them, and the chain, as
``flashdsa bench --ops selection`` builds them (B 64, next_n 1, contexts ~U(0.7, 1.3) x ctx, value checks
off), each a CUDA-graph replay; and the peer's chain and its parts when DeepGEMM / sgl-kernel load.

    PYTHONPATH=. python benchmarks/selection_parts.py [--peer-libs DIR] [--ctx 8192,32768]

The sum of the parts against the chain shows what the hand-over between the two kernels costs. The rows also
go to ``$OUT/selection_parts.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from flashdsa import ops
from flashdsa.bench import selection_inputs
from flashdsa.testing import peers
from flashdsa.testing.timing import time_us

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import peer_selection_us, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", default="8192,32768")
    ap.add_argument("--peer-libs", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    status = peers.peer_status(a.peer_libs or None)
    ops.set_value_checks(False)
    B, H, k = 64, 64, 2048
    rows = []
    for ctx in map(int, a.ctx.split(",")):
        q, cache, w, lens, bt, max_len, _ = selection_inputs(B, ctx, H, dev)
        rows_len = lens.view(-1).contiguous()
        x = ops.indexer_logits_paged(q, cache, w, lens, bt, max_len)
        r = {"ctx": ctx, "L": max_len,
             "logits": time_us(lambda: ops.indexer_logits_paged(q, cache, w, lens, bt, max_len)),
             "topk": time_us(lambda: ops.topk_transform(x, rows_len, k, page_table=bt)),
             "chain": time_us(lambda: ops.topk_transform(ops.indexer_logits_paged(q, cache, w, lens, bt, max_len),
                                                         rows_len, k, page_table=bt))}
        r.update(peer_selection_us(q, cache, w, lens, bt, max_len, x, k, status))
        r["chain - parts"] = r["chain"] - r["logits"] - r["topk"]
        rows.append(r)
        print({kk: round(v, 1) if isinstance(v, float) else v for kk, v in r.items()}, flush=True)
    write_json(rows, "selection_parts")   # $OUT/selection_parts.json when OUT is set


if __name__ == "__main__":
    main()
