"""One DeepSeek-V4 CSA layer's decode step on flashdsa's ops (issue #43), beside the peers' stages and the floor.

    PYTHONPATH=. python benchmarks/bench_v4_decode.py [--batches 1,64] [--ctx 32768,131072]
    PYTHONPATH=. python benchmarks/bench_v4_decode.py --smoke      # the script on the CPU (torch backends)

V4-Flash's CSA layer at ``ctx`` tokens a request: ``ctx / 4`` compressed entries, their 128-dim indexer keys in
flashdsa's indexer pages (64 entries a page) and their K = V rows in 656-B MLA pages at the same page ids, the
window's 128 raw rows in two more pages a request. The step: paged indexer logits over the visible entries (64
heads) -> exact top-512 translated to the entries' slots -> sparse MLA decode (64 heads, q's rope part 0) over
the 128 window slots and the 512 selected -> V4's sinks (``ops.attention_sinks``). Each stage checked
first against the torch reference (``flashdsa bench``'s bounds: logits cos <= 1e-6, the top-k's bits, attention
cos <= 1e-5).

Peers per stage, where they run on the H200's torch 2.11: DeepGEMM's paged logits (the same pages) and
FlashMLA's sparse decode over the same 640 slots (without the sinks: the pinned build has none). No
V4-specific peer runs there (FlashMLA's and DeepGEMM's V4 kernels need newer builds; anchors README); the
floor is the step's bytes (indexer pages, the 640 rows, the logits written and read) at the measured copy
speed. Times: median CUDA-graph replay, µs; rows to $OUT/bench_v4_decode.json.
"""

from __future__ import annotations

import argparse

import torch

from _common import print_table, write_json

from flashdsa import ops
from flashdsa.bench.checks import ATTN_COS, LOGITS_COS
from flashdsa.testing import peers
from flashdsa.testing.compare import cos_diff
from flashdsa.testing.inputs import index_cache, mla_cache, randn
from flashdsa.testing.timing import time_us

HEADS, IDX_HEADS, TOPK, WINDOW, RATE = 64, 64, 512, 128, 4
SCALE = 512 ** -0.5


def case(B: int, ctx: int, dev, status: dict, smoke: bool, copy_gbps: float | None) -> dict:
    E = ctx // RATE
    per = -(-E // 64)
    g = torch.Generator(device=dev).manual_seed(ctx + B)
    icache = index_cache(B * per, g, dev)
    bt = torch.randperm(B * per, generator=g, device=dev).view(B, per).to(torch.int32)
    mla = mla_cache(B * per + 2 * B, g, dev)  # entries' rows at their index pages' ids, then the windows' pages
    win = (B * per + torch.arange(2 * B, device=dev).view(B, 2))[:, :, None] * 64 + torch.arange(64, device=dev)
    win = win.view(B, WINDOW).to(torch.int32)
    lens = torch.full((B, 1), E, dtype=torch.int32, device=dev)
    max_len = per * 64
    q_idx = randn((B, 1, IDX_HEADS, 128), g, dev, torch.float8_e4m3fn)
    w = randn((B, IDX_HEADS), g, dev) * (IDX_HEADS * 128) ** -0.5
    q = randn((B, 1, HEADS, 576), g, dev, torch.bfloat16)
    q[..., 512:] = 0  # K = V in the latent part: the rope part adds nothing
    sinks = randn((HEADS,), g, dev)
    be = "torch" if smoke else None

    def logits():
        return ops.indexer_logits_paged(q_idx, icache, w, lens, bt, max_len, backend=be)

    def select(x):
        return ops.topk_transform(x, lens.view(-1), TOPK, page_table=bt, backend=be)

    def attend(sel):
        idx = torch.cat((win, sel), dim=1).view(B, 1, WINDOW + TOPK)
        out, lse = ops.sparse_mla_decode(q, mla, idx, SCALE, backend=be)
        return ops.attention_sinks(out, lse, sinks, backend=be)

    x = logits()
    sel = select(x)
    # checks against the torch reference (the CPU smoke run compares the reference with itself: the script only)
    ref_x = ops.indexer_logits_paged(q_idx, icache, w, lens, bt, max_len, backend="torch")
    valid = torch.arange(max_len, device=dev)[None, :] < E
    row = {"B": B, "ctx": ctx, "entries": E,
           "logits_cos": cos_diff(x[valid.expand_as(x)], ref_x[valid.expand_as(ref_x)]),
           "topk_same": bool(torch.equal(sel, ops.topk_transform(x, lens.view(-1), TOPK, page_table=bt,
                                                                  backend="torch")))}
    out = attend(sel)
    idx = torch.cat((win, sel), dim=1).view(B, 1, WINDOW + TOPK)
    r_out, r_lse = ops.sparse_mla_decode(q, mla, idx, SCALE, backend="torch")
    row["attn_cos"] = cos_diff(out, ops.attention_sinks(r_out, r_lse, sinks, backend="torch"))
    if row["logits_cos"] > LOGITS_COS or not row["topk_same"] or row["attn_cos"] > ATTN_COS:
        raise AssertionError(f"B {B} ctx {ctx}: check failed {row}")
    t = (lambda fn: float("nan")) if smoke else time_us
    row["logits"] = t(logits)
    row["topk"] = t(lambda: select(x))
    row["attn"] = t(lambda: attend(sel))
    row["step"] = t(lambda: attend(select(logits())))
    if status.get("DeepGEMM", {}).get("ok"):
        row["dg_logits"] = time_us(peers.deepgemm_paged(q_idx, icache, w, lens, bt, max_len))
    if status.get("FlashMLA", {}).get("ok"):
        row["flashmla_attn"] = time_us(peers.flashmla_decode(q, mla.view(-1, 64, 656), idx, SCALE, lens.view(-1)))
    bytes_ = B * (E * 132 + (WINDOW + TOPK) * 656 + 2 * 4 * max_len + HEADS * 576 * 2 + HEADS * 512 * 2)
    row["floor"] = bytes_ / (copy_gbps * 1e3) if copy_gbps else None
    row["step_x_floor"] = row["step"] / row["floor"] if row["floor"] else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ctx", default="32768,131072")
    ap.add_argument("--peer-libs", default="")
    ap.add_argument("--smoke", action="store_true", help="small shapes on the CPU, torch backends: the script only")
    a = ap.parse_args()
    if a.smoke:
        dev, batches, ctxs, status, copy = torch.device("cpu"), [1, 2], [4096], {}, None
    else:
        from flashdsa.bench import measure_ceilings
        dev = torch.device("cuda")
        batches, ctxs = [int(v) for v in a.batches.split(",")], [int(v) for v in a.ctx.split(",")]
        status = peers.peer_status(a.peer_libs or None)
        copy = measure_ceilings(dev)["copy_GBps"]
        ops.set_value_checks(False)
    rows = []
    for ctx in ctxs:
        for B in batches:
            rows.append(case(B, ctx, dev, status, a.smoke, copy))
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    write_json(rows, "bench_v4_decode")
    keys = ["B", "ctx", "entries", "logits", "dg_logits", "topk", "attn", "flashmla_attn", "step", "floor",
            "step_x_floor"]
    print_table([{k: r.get(k, "") for k in keys} for r in rows],
                "DeepSeek-V4 CSA layer decode (64 heads, top-512 + 128 window, sinks), µs (graph replay)")


if __name__ == "__main__":
    main()
