"""kpool (docs/DSA.md §7) vs plain DSA: indexer cache bytes per token and the indexer + top-k time of one
decode step of one V3.2-shaped layer, c = 4 against c = 1, at 32K and 128K context.

    PYTHONPATH=. python benchmarks/bench_kpool.py [--quick] [--no-graph] [--ctx 32768,131072] [--kpool 4]
    PYTHONPATH=. python benchmarks/bench_kpool.py --smoke    # script check on tiny shapes (CPU: interpreter)

One layer (V3.2: H_I 64, D 128, top-2048), B = 64 requests of ``ctx - b % 7`` tokens (every phase of a
group), pages interleaved over the pool, random index keys everywhere, through the layer's own step as
``DSAAttention.forward`` runs it at decode:

    indexer   Indexer.forward: q / weights (and with kpool the key before rotation and its gate)
    store     DSAAttention.store: the MLA row and the index key (kpool: the pooled key of the token's
              group, written every step, and the ring)
    select    DSAAttention.select: paged logits over S (kpool: S / c pooled keys) -> exact top-k (kpool:
              top-k / c groups, expanded with the tail)
    step      the three in a row

``index B/token`` is the pool's indexer cache per token of capacity (132 / c). Times: median of do_bench
over a CUDA-graph replay of one call (``--no-graph``: the plain call). ``vs c=1`` divides by the c = 1
row of the same context. Before timing, on 4 requests: the logits against the torch reference (cosine
diff), the group top-k and the expansion bit for bit against the torch backend on the same logits.
Rows go to $OUT/bench_kpool.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from _common import print_table, timed, write_json  # noqa: E402

from flashdsa import ops  # noqa: E402
from flashdsa._checks import trusted_inputs  # noqa: E402
from flashdsa.config import DSAConfig  # noqa: E402
from flashdsa.engine import Runner  # noqa: E402
from flashdsa.layers.attention import DSAAttention  # noqa: E402
from flashdsa.layers.indexer import IndexerOutput  # noqa: E402
from flashdsa.quant import rope_cos_sin  # noqa: E402
from flashdsa.testing.compare import cos_diff  # noqa: E402
from flashdsa.testing.inputs import randn, rows_subset  # noqa: E402

CTXS = (32768, 131072)
B = 64


def setup(preset: str, ctx: int, c: int, batch: int, dev: str, backend: str) -> dict:
    """A one-layer model-less runner whose B requests hold ``ctx - b % 7`` random tokens, the layer, its
    decode metadata and inputs."""
    cfg = DSAConfig.preset(preset).replace(num_hidden_layers=1, index_kpool=c)
    g = torch.Generator(device=dev).manual_seed(ctx + c)
    page = cfg.page_size
    run = Runner.for_layers(cfg, dev, batch * (-(-(ctx + 1) // page)) + 1, "fp8", backend=backend,
                            kpool_max_requests=batch)
    pool = run.pool
    attn = DSAAttention(cfg, 0).to(dev)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(randn(p.shape, g, dev, p.dtype) * p.shape[-1] ** -0.5)
    lens = [ctx - b % 7 for b in range(batch)]
    step = 16 * page
    for start in range(0, ctx, step):  # requests grow in turns, so their pages interleave
        pool.reserve({b: min(step, n - start) for b, n in enumerate(lens) if n > start})
    # random keys in every slot: the scan does not depend on which were written by pooling
    cache = pool.index_cache(0)
    keys = cache[:, :8192]
    for p0 in range(0, cache.shape[0], 4096):
        keys[p0:p0 + 4096] = randn(keys[p0:p0 + 4096].shape, g, dev).to(torch.float8_e4m3fn).view(torch.uint8)
    cache[:, 8192:].view(torch.float32).copy_(torch.rand(cache.shape[0], 64, generator=g, device=dev) + 0.5)
    if c > 1:
        ring = pool.tail_ring(0, torch.bfloat16)
        ring.copy_(randn(ring.shape, g, dev, torch.bfloat16))
    meta, _ = run.prepare({b: 1 for b in range(batch)}, "decode")
    x = randn((batch, cfg.hidden_size), g, dev, torch.bfloat16)
    qr = randn((batch, cfg.q_lora_rank), g, dev, torch.bfloat16)
    cos, sin = rope_cos_sin(meta.positions, cfg.qk_rope_head_dim)
    kv_rows = randn((batch, 576), g, dev, torch.bfloat16)
    return dict(cfg=cfg, run=run, pool=pool, attn=attn, meta=meta, x=x, qr=qr, cos=cos, sin=sin, kv=kv_rows)


def check(s: dict) -> dict:
    """On 4 requests: logits vs the torch reference; group top-k and expansion vs the torch backend."""
    attn, meta, pool, c = s["attn"], s["meta"], s["pool"], s["cfg"].index_kpool
    with torch.no_grad():
        idx = attn.indexer(s["x"], s["qr"], s["cos"], s["sin"])
    sub = rows_subset(meta.context_lens.shape[0], 4, s["x"].device)
    lens = meta.context_lens[sub] // c
    q = idx.q[sub].unsqueeze(1)
    args = (q, pool.index_cache(0), idx.weights[sub], lens, meta.block_table[sub], meta.max_context_len // c)
    ours = ops.indexer_logits_paged(*args, backend=meta.backend)
    ref = ops.indexer_logits_paged(*args, backend="torch")
    valid = torch.isfinite(ref)
    cd = cos_diff(torch.where(valid, ours, 0), torch.where(valid, ref, 0))
    k = s["cfg"].index_topk // c
    top = ops.topk_transform(ours, lens.view(-1), k, backend=meta.backend)
    parts = {"logits_cos_diff": cd,
             "same_topk": torch.equal(top, ops.topk_transform(ours, lens.view(-1), k, backend="torch")),
             "same_inf": torch.equal(torch.isinf(ours), torch.isinf(ref))}
    ok = cd < 1e-5 and parts["same_topk"] and parts["same_inf"]
    if c > 1:
        exp = [ops.kpool_expand(top, meta.context_lens[sub].view(-1), c, page_table=meta.block_table[sub],
                                page_size=pool.page_size, backend=be) for be in (meta.backend, "torch")]
        parts["same_expand"] = torch.equal(*exp)
        # and the layer's own select on those rows agrees with its torch backend
        sub_meta = dataclasses.replace(meta, context_lens=meta.context_lens[sub], block_table=meta.block_table[sub])
        sub_idx = IndexerOutput(idx.q[sub], idx.weights[sub], idx.k[sub], None, idx.gate[sub])
        got = attn.select(sub_idx, sub_meta, pool)
        want = attn.select(sub_idx, dataclasses.replace(sub_meta, backend="torch"), pool)
        # set overlap per row (not the sorted rows compared position by position: one flipped group shifts
        # every later position)
        hits = sum(int(torch.isin(g[g >= 0], w[w >= 0]).sum()) for g, w in zip(got, want))
        parts["select_overlap"] = hits / max(int((want >= 0).sum()), 1)
        # the logits differ in their last bits: a near-tie may flip one group
        ok = ok and parts["same_expand"] and parts["select_overlap"] > 0.99
    if not ok:
        print(f"kpool check failed (c = {c}): {parts}", file=sys.stderr)
    return {"ok": bool(ok), **parts}


def bench(s: dict, graph: bool, dev: str) -> dict:
    attn, meta, pool = s["attn"], s["meta"], s["pool"]
    # as DSAAttention.forward runs them: the ops' value checks off (each is a host sync)
    with torch.no_grad(), trusted_inputs():
        idx = attn.indexer(s["x"], s["qr"], s["cos"], s["sin"])

        def indexer():
            return attn.indexer(s["x"], s["qr"], s["cos"], s["sin"])

        def store():
            attn.store(s["kv"], idx, meta, pool)

        def select():
            return attn.select(idx, meta, pool)

        def step():
            i = attn.indexer(s["x"], s["qr"], s["cos"], s["sin"])
            attn.store(s["kv"], i, meta, pool)
            return attn.select(i, meta, pool)

        return {name + "_us": timed(fn, dev, graph=graph) for name, fn in
                (("indexer", indexer), ("store", store), ("select", select), ("step", step))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="32K only")
    ap.add_argument("--ctx", default=None, help="comma-separated contexts (default 32768,131072)")
    ap.add_argument("--kpool", type=int, default=4, help="c to compare with c = 1 (default 4)")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device: checks the script")
    args = ap.parse_args()
    rows = run(quick=args.quick, ctx=args.ctx, kpool=args.kpool, graph=not args.no_graph, smoke=args.smoke)
    print_table(rows, "kpool: indexer cache and decode indexer + top-k, one layer")
    write_json(rows, "bench_kpool")
    if not all(r["ok"] for r in rows):
        sys.exit(1)


def run(quick: bool = False, ctx: str | None = None, kpool: int = 4, graph: bool = True,
        smoke: bool = False) -> list[dict]:
    """The table's rows: one per (context, c), c = 1 first."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    preset, batch = ("tiny", 2) if smoke else ("v32", B)
    ctxs = [300] if smoke else [int(x) for x in ctx.split(",")] if ctx else list(CTXS[:1] if quick else CTXS)
    backend = "triton" if dev == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    rows = []
    for n in ctxs:
        base = None
        for c in (1, kpool):
            s = setup(preset, n, c, batch, dev, backend)
            row = {"ctx": n, "c": c, "B": batch, "index B/token": s["pool"].memory_bytes()["index_per_token"]}
            row.update(check(s))
            row.update(bench(s, graph and dev == "cuda", dev))
            if base is None:
                base = row
            for k in ("select_us", "step_us"):
                row[f"{k[:-3]} vs c=1"] = row[k] / base[k]
            rows.append(row)
            del s
            if dev == "cuda":
                torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
