"""Sparse MLA decode over the grid users run (issue #41): batch x heads, our kernels and their top-k splits
against FlashMLA in the same run.

    PYTHONPATH=. python benchmarks/sparse_decode_grid.py [--batches 1,4,16,64] [--heads 16,32,64,128] [--s-q 1,2]
        [--default-only] [--nope]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/sparse_decode_grid.py --smoke   # the script on the CPU

One layer's attention of a decode step: q [B, 1, h, 576] bf16 over the fp8 656-B cache, top-2048 slots of
~32K-token requests. Per (B, h): FlashMLA (q padded to 64 heads below 64, as engines pad it), our dispatch's
default, the Gluon kernel (h a multiple of 64; no split) and the Triton kernels at every top-k split count
(flash-decoding: each program a slice of the list, merged by the combine kernel). Each output is checked
against our default's first (cosine diff), the default against the fp32 reference on a few rows. Times:
median CUDA-graph replay, µs. The table comes last (best: the fastest of ours); rows go to
$OUT/sparse_decode_grid.json.

``--nope`` (GLM-5.3-Flash, issue #42): q [B, 1, h, 512] over the 528-B NoPE rows, beside the same latents in
656-B rows with a zero rope part (what NoPE models were stored as before) through our default ("rows656")
and FlashMLA, which has no NoPE layout: the NoPE decode reads 528 / 656 of the bytes and does 1024 / 1088 of
the FLOPs.
"""

from __future__ import annotations

import argparse

import torch

from _common import load_sgl_ops, print_table, timed, write_json

from flashdsa import ops
from flashdsa.ops.sparse_mla import reference
from flashdsa.ops.sparse_mla import triton as tri
from flashdsa.testing.compare import cos_diff
from flashdsa.testing.inputs import decode_slots, mla_cache, paged_batch
from flashdsa.testing.peers import flashmla_decode

SM_SCALE = 576 ** -0.5
SPLITS = (1, 2, 4, 8, 16, 32)
GLUON_SPLITS = (1, 2, 4, 8, 16)


def gluon_split(q: torch.Tensor, cache: torch.Tensor, idx: torch.Tensor, splits: int):
    """The Gluon decode kernel with each query's top-k list in ``splits`` slices (one CTA each, bf16 partials
    merged by the combine kernel; heads padded to a multiple of 64 as the kernel pads them)."""
    from flashdsa.ops.sparse_mla import gluon
    return gluon.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, splits)


def grid_case(B: int, h: int, ctx: int, topk: int, dev: str, peer: bool, s_q: int = 1,
              all_variants: bool = True, nope: bool = False) -> dict:
    g = torch.Generator(dev).manual_seed(B * 1000 + h)
    seq, bt, P = paged_batch(B, ctx, s_q, g, dev)
    rope = 0 if nope else 64
    cache = mla_cache(P, g, dev, rope=rope)
    idx = decode_slots(bt, min(ctx, int(seq.min())), s_q, topk, g)
    q = torch.randn(B, s_q, h, 512 + rope, generator=g, device=dev).to(torch.bfloat16)
    row = {"B": B, "s_q": s_q, "h": h}
    if nope:  # the same latents in 656-B rows, zero rope part, and q padded with zeros: the same attention
        cache576 = torch.zeros(*cache.shape[:2], 656, dtype=torch.uint8, device=dev)
        cache576[..., :528] = cache
        q576 = torch.cat((q, q.new_zeros(B, s_q, h, 64)), dim=-1)
        row["rows656"] = timed(lambda: ops.sparse_mla_decode(q576, cache576, idx, SM_SCALE), dev, graph=True)
        row["rows656_cos"] = cos_diff(ops.sparse_mla_decode(q576, cache576, idx, SM_SCALE)[0].float(),
                                      ops.sparse_mla_decode(q, cache, idx, SM_SCALE)[0].float())
        if row["rows656_cos"] > 1e-5:
            raise AssertionError(f"B {B} h {h}: NoPE rows vs 656-B rows cos diff {row['rows656_cos']:.2e}")
        q_peer, cache_peer = q576, cache576
    else:
        q_peer, cache_peer = q, cache
    want, _ = ops.sparse_mla_decode(q, cache, idx, SM_SCALE)
    rows = torch.arange(min(B, 2), device=dev)
    ref, _ = reference.sparse_mla_decode(q[rows], cache, idx[rows], SM_SCALE, 512, None)
    row["default_cos_vs_ref"] = cos_diff(want[rows].float(), ref)
    calls = {"default": lambda: ops.sparse_mla_decode(q, cache, idx, SM_SCALE)}
    if dev == "cuda":
        calls["gluon"] = lambda: ops.sparse_mla_decode(q, cache, idx, SM_SCALE, backend="gluon")
    if dev == "cuda" and all_variants and not nope:
        for s in GLUON_SPLITS:
            if B * -(-h // 64) * s <= 4 * 132:
                calls[f"gluon-s{s}"] = lambda s=s: gluon_split(q, cache, idx, s)
    for s in SPLITS if all_variants and not nope else ():
        cfg = tri.SparseMLAConfig(num_splits=s)
        calls[f"triton-s{s}"] = lambda cfg=cfg: tri.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None, cfg)
    for name, fn in calls.items():
        out = fn()[0]
        err = cos_diff(out.float(), want.float())
        row[f"{name}_cos"] = err
        if err > 1e-5:
            raise AssertionError(f"B {B} h {h} {name}: cos diff {err:.2e} against the default")
        row[name] = timed(fn, dev, graph=True)
    if peer:
        qp = q_peer if h >= 64 else torch.cat((q_peer, q_peer.new_zeros(B, s_q, 64 - h, 576)), dim=2)
        row["flashmla"] = timed(flashmla_decode(qp, cache_peer, idx, SM_SCALE, seq.to(torch.int32)), dev, graph=True)
    ours = {k: v for k, v in row.items()
            if (k.startswith("gluon") or k.startswith("triton-") or k == "default") and not k.endswith("_cos")}
    best = min(ours, key=ours.get)
    row["best"], row["best_us"] = best, ours[best]
    if peer:
        row["default_x"] = row["default"] / row["flashmla"]
        row["best_x"] = row["best_us"] / row["flashmla"]
    if nope:
        row["nope_over_rows656"] = row["default"] / row["rows656"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--heads", default="16,32,64,128")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--s-q", default="1", help="comma-separated query rows a request (MTP verify: 2)")
    ap.add_argument("--default-only", action="store_true", help="time the dispatch's default and FlashMLA only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter: the script only")
    ap.add_argument("--nope", action="store_true", help="the 528-B NoPE rows (module docstring)")
    a = ap.parse_args()
    if a.smoke:
        dev, batches, heads, ctx, topk, peer = "cpu", [1], [16], 256, 64, False
    else:
        dev, ctx, topk = "cuda", a.ctx, 2048
        batches, heads = [int(x) for x in a.batches.split(",")], [int(x) for x in a.heads.split(",")]
        peer = load_sgl_ops()
    rows = []
    for s_q in [int(x) for x in a.s_q.split(",")]:
        for B, h in [(B, h) for B in batches for h in heads]:
            row = grid_case(B, h, ctx, topk, dev, peer, s_q, not a.default_only, a.nope)
            rows.append(row)
            print(row, flush=True)
    write_json(rows, "sparse_decode_grid")
    keys = ["B", "s_q", "h", "flashmla", "default", "gluon", "best", "best_us", "default_x", "best_x"]
    keys += ["rows656", "nope_over_rows656"] if a.nope else []
    keys += sorted({k for r in rows for k in r if k.startswith("gluon-s") and not k.endswith("_cos")},
                   key=lambda k: int(k[7:]))
    print_table([{k: r.get(k, "") for k in keys} for r in rows],
                f"sparse MLA decode, fp8 {528 if a.nope else 656}, top-2048, ctx ~{ctx // 1024}K, µs (graph replay); "
                f"x: ours / FlashMLA{' (656-B rows)' if a.nope else ''}")


if __name__ == "__main__":
    main()
