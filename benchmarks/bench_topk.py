"""Top-2048 with slot translation: ours (Triton) vs sgl-kernel fast_topk vs torch.topk, exactness checked.

    PYTHONPATH=. python benchmarks/bench_topk.py [--quick [--full-adv]] [--sweep] [--stages] [--ab F=V] [--smoke]

Shapes (rows x length, every row full, k = 2048): 64 x 32K, 64 x 128K, 4096 x 8K, 4096 x 32K on
random N(0, 1) fp32 scores; plus 64 x 8K and 64 x 32K with a compact page table (the decode call:
translation fused; fast_topk is timed on the same scores without translation). Adversarial rows,
64 x 32K and 64 x 128K: scores quantised to 256 and to 16 distinct levels, all equal, and the narrow
range 1000 + U(0, 1e-3) (16 distinct fp32 values).

Checks per case, before timing:
- ours == a GPU torch oracle of the same order (int64 key = order-preserving score bits << 32 |
  ~position, torch.topk on it, positions sorted): bitwise, every row;
- tie-safe exactness of ours and of the peer: each row returns min(k, length) distinct in-range
  positions and every selected score >= the row's k-th largest score (NaN = -inf). This is the test
  the peer fails on rows with many equal scores;
- ours repeats bit for bit.
Timings: median of triton.testing.do_bench (L2 flushed each rep) of a CUDA-graph replay of one call,
for all three (GPU time without Python / launch overhead, as decode runs it); "ours_eager_us" is our
plain call, overhead included. Value checks are off (the production decode setting: no host sync).
torch.topk returns (values, indices) in value order, untranslated.
``--sweep`` times other launch configs of ours per random shape (split chunks, warps a program and
programs per SM, streamed vs in-register radix levels, register cap, unroll, digit bits): changes to
default_config() in flashdsa/ops/topk/launch.py. ``--stages`` times the default config stopped after
each stage (sample, compaction, move, select; cumulative), on the random and page-table shapes.
``--ab ties=False`` also times every case with those config fields changed (checked to give the same bits).
``--smoke`` runs tiny shapes (CPU through the interpreter when there is no GPU) to check the script
itself; its times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from _common import load_sgl_ops, print_table, timed, write_json

from flashdsa import ops
from flashdsa.ops._triton_utils import num_sms
from flashdsa.ops.topk import launch
from flashdsa.testing.compare import topk_order_keys, topk_tie_safe
from flashdsa.testing.peers import fast_topk
from flashdsa.testing.timing import capture_graph, do_bench_us

K = 2048
SHAPES = [(64, 32768), (64, 131072), (4096, 8192), (4096, 32768)]
SHAPES_QUICK = SHAPES
PAGES = [(64, 8192), (64, 32768)]
RAGGED_PAGES = [(64, 10649), (64, 42598)]   # decode's rows: ~U(0.7, 1.3) x 8K / 32K, page table (flashdsa bench's)
ADV = [(64, 32768), (64, 131072)]
ADV_QUICK = [(64, 32768)]
KINDS = ("levels256", "levels16", "equal", "narrow")
SGL_PUBLISHED = {(64, 32768): 24, (64, 131072): 78, (4096, 8192): 181, (4096, 32768): 469}   # µs, the issue's
DEV = "cuda"


def _time_graph(fn) -> float:
    """GPU time of fn replayed from a CUDA graph (no Python / launch overhead: how decode runs it); a call
    that cannot be captured fails the run."""
    if DEV != "cuda":
        return timed(fn, DEV)
    return do_bench_us(capture_graph(fn).replay)


def make_scores(kind: str, R: int, L: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    if kind == "randn":
        return torch.randn(R, L, generator=g, device=DEV)
    u = torch.rand(R, L, generator=g, device=DEV)
    if kind == "levels256":
        return (u * 256).floor() / 256 - 0.5
    if kind == "levels16":
        return (u * 16).floor() / 16
    if kind == "equal":
        return torch.full((R, L), 0.25, device=DEV)
    if kind == "narrow":
        return 1000 + u * 1e-3
    raise ValueError(kind)


def oracle(x: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Positions [R, k] int32 in the documented order, -1 padded: torch on one int64 key per score."""
    R, L = x.shape
    pos = torch.arange(L, device=x.device)
    key = (topk_order_keys(x).long() << 32) | (0xFFFFFFFF - pos)          # score desc, then position asc
    valid = pos[None, :] < lengths[:, None].long()
    key = torch.where(valid, key, torch.iinfo(torch.int64).min)
    top = torch.topk(key, min(k, L), dim=1).indices
    top = torch.where(torch.gather(valid, 1, top), top, L)           # not a candidate: sorts last
    top = torch.sort(top, dim=1).values
    out = torch.full((R, k), -1, dtype=torch.int32, device=x.device)
    out[:, :top.shape[1]] = torch.where(top < L, top, -1).to(torch.int32)
    return out


def page_table(R: int, L: int) -> torch.Tensor:
    """A shuffled compact page table ``[R, ceil(L / 64)] int32``, as decode hands it."""
    maxp = (L + 63) // 64
    return torch.randperm(R * maxp, device=DEV).view(R, maxp).to(torch.int32)


def decode_lengths(R: int, L: int, ragged: bool) -> torch.Tensor:
    """``[R] int32`` row lengths: L each, or (``ragged``) ~U(0.7, 1.3) x L / 1.3 as at decode (the longest
    about L), the same draw for the same R."""
    if not ragged:
        return torch.full((R,), L, dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(R)
    return (L / 1.3 * (0.7 + 0.6 * torch.rand(R, generator=g, device=DEV))).clamp(max=L).to(torch.int32)


def run_case(name: str, kind: str, R: int, L: int, sgl: bool, rows: list, pages: bool = False,
             ragged: bool = False) -> None:
    """One case; ``ragged``: row lengths ~U(0.7, 1.3) x L / 1.3 as at decode (the longest about L)."""
    if ONLY and not any(o in f"{name} {kind}" for o in ONLY):
        return
    x = make_scores(kind, R, L, seed=R + L)
    lengths = decode_lengths(R, L, ragged)
    kw = {"backend": "triton"}
    if pages:
        kw["page_table"] = page_table(R, L)
    ours = ops.topk_transform(x, lengths, K, **kw)
    again = ops.topk_transform(x, lengths, K, **kw)
    pos = oracle(x, lengths, K)
    if pages:
        page = torch.gather(kw["page_table"], 1, (pos // 64).clamp(min=0).long())
        want = torch.where(pos >= 0, page * 64 + pos % 64, -1)
        pos_ours = None
    else:
        want, pos_ours = pos, ours
    row = {"case": name, "kind": kind, "R": R, "L": L,
           "ours==oracle": bool(torch.equal(ours, want)), "repeat": bool(torch.equal(ours, again))}
    if pos_ours is not None:
        row["ours_exact"], row["ours_recall"] = topk_tie_safe(x, lengths, pos_ours, K)
    row["ours_us"] = _time_graph(lambda: ops.topk_transform(x, lengths, K, **kw))
    row["ours_eager_us"] = timed(lambda: ops.topk_transform(x, lengths, K, **kw), DEV)
    if AB:
        # the same call with the default config changed: an A / B of a knob measured in one run
        cfg = dataclasses.replace(launch.default_config(R, L, K, num_sms(x.device)), **AB)
        table = kw.get("page_table")
        row["ab==ours"] = bool(torch.equal(_ours(x, lengths, cfg, table), ours))
        # A B B A: ours was timed first, so each side is timed once more in the other order and averaged (one
        # pass in a row showed up to 3 % between the two sides on the same kernel: an order bias)
        ab = _time_graph(lambda: _ours(x, lengths, cfg, table))
        ab = (ab + _time_graph(lambda: _ours(x, lengths, cfg, table))) / 2
        row["ours_us"] = (row["ours_us"] + _time_graph(lambda: ops.topk_transform(x, lengths, K, **kw))) / 2
        row["ab_us"] = ab
        row["ours/ab"] = row["ours_us"] / row["ab_us"]
    if sgl:
        sgl_call, out = fast_topk(x, lengths, K)
        sgl_call()
        row["sgl_exact"], row["sgl_recall"] = topk_tie_safe(x, lengths, out, K)
        row["sgl_us"] = _time_graph(sgl_call)
        row["ours/sgl"] = row["ours_us"] / row["sgl_us"]
    row["torch_us"] = _time_graph(lambda: torch.topk(x, K, dim=1))
    row["ours/torch"] = row["ours_us"] / row["torch_us"]
    if (R, L) in SGL_PUBLISHED and kind == "randn" and not pages:
        row["sgl_issue_us"] = SGL_PUBLISHED[(R, L)]
    rows.append(row)
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


# --sweep: changes to the default config per regime (default_config() in flashdsa/ops/topk/launch.py);
# per_sm sets the fused grid to min(R, per_sm * SMs), and the row fallback's step follows num_warps (128 NW)
SWEEP_FEW = [dict(chunks=2), dict(chunks=8), dict(chunks=16), dict(num_warps=4, sample_stream=True, chunks=8),
             dict(stream=True), dict(unroll=4), dict(cached_counters=False)]
SWEEP_MANY = [dict(num_warps=1, stream=True, sample_stream=True, maxnreg=64, per_sm=32),
              dict(num_warps=2, stream=True, sample_stream=True, maxnreg=64, per_sm=16),
              dict(num_warps=4, stream=True, maxnreg=64, per_sm=8),
              dict(num_warps=4, stream=True, maxnreg=0, per_sm=8),
              dict(num_warps=8, stream=False, maxnreg=64, per_sm=4),
              dict(num_warps=8, stream=False, maxnreg=80, per_sm=3), dict(unroll=4), dict(move_step=128),
              dict(bits_w=8)]
AB: dict = {}   # --ab: config fields changed for the A / B column
ONLY: list = []  # --only: substrings of the case names (and kinds) to run
STAGES = ("sample", "compaction", "move", "select", "")   # stop_after of each timed stage; "": the whole op


def _ours(x, lengths, cfg, table=None):
    return launch.topk_transform(x, lengths, K, table, None, None, 64, config=cfg)


def run_sweep(shapes, rows: list) -> None:
    sms = num_sms(torch.device(DEV))
    for R, L in shapes:
        x = make_scores("randn", R, L, seed=R + L)
        lengths = torch.full((R,), L, dtype=torch.int32, device=DEV)
        default = launch.default_config(R, L, K, sms)
        want = _ours(x, lengths, default)
        base = _time_graph(lambda: _ours(x, lengths, default))
        for knobs in SWEEP_FEW if R <= sms and L >= 16384 else SWEEP_MANY:
            kw = dict(knobs)
            if "per_sm" in kw:
                kw["grid"] = min(R, kw.pop("per_sm") * sms)
            if "num_warps" in kw:
                kw["block"] = 128 * kw["num_warps"]
            cfg = dataclasses.replace(default, **kw)
            got = _ours(x, lengths, cfg)
            t = _time_graph(lambda: _ours(x, lengths, cfg))
            rows.append({"case": f"sweep {R}x{L}", "knobs": str(knobs), "us": t, "vs_default": t / base,
                         "same": bool(torch.equal(got, want))})


def run_stages(shapes, pages, rows: list) -> None:
    """Cumulative time of the default config stopped after each stage (its output is not the answer)."""
    sms = num_sms(torch.device(DEV))
    for (R, L), table in [(s, False) for s in shapes] + [(s, True) for s in pages]:
        x = make_scores("randn", R, L, seed=R + L)
        lengths = torch.full((R,), L, dtype=torch.int32, device=DEV)
        pt = page_table(R, L) if table else None
        default = launch.default_config(R, L, K, sms)
        row = {"case": f"stages {R}x{L}" + (" pages" if table else "")}
        for stop in STAGES:
            cfg = dataclasses.replace(default, stop_after=stop)
            row[stop or "all"] = _time_graph(lambda: _ours(x, lengths, cfg, pt))
        rows.append(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a one-minute subset")
    ap.add_argument("--sweep", action="store_true", help="also time a few launch shapes of ours")
    ap.add_argument("--stages", action="store_true", help="also time ours stopped after each stage")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (CPU ok)")
    ap.add_argument("--full-adv", action="store_true", help="with --quick: the adversarial rows at 128K too")
    ap.add_argument("--only", default="", help="comma-separated substrings of the case names to run (e.g. pages)")
    ap.add_argument("--ab", default="", metavar="FIELD=VALUE[,...]",
                    help="also time ours with these TopkConfig fields changed (ints / True / False), "
                         "e.g. ties=False: an A / B in one run")
    a = ap.parse_args()
    global DEV, K, SHAPES, ADV, PAGES, RAGGED_PAGES
    ONLY.extend(filter(None, a.only.split(",")))
    for item in filter(None, a.ab.split(",")):
        field, value = item.split("=")
        AB[field] = {"True": True, "False": False}.get(value, value if not value.lstrip("-").isdigit() else int(value))
    if not torch.cuda.is_available():
        if not a.smoke:
            raise SystemExit("needs a CUDA GPU (or --smoke)")
        DEV = "cpu"
    if a.smoke:
        K, SHAPES, ADV, PAGES = 64, [(3, 700), (5, 300)], [(3, 700)], [(3, 700)]
        RAGGED_PAGES[:] = [(4, 900)]
    elif a.quick:
        SHAPES, ADV = SHAPES_QUICK, ADV if a.full_adv else ADV_QUICK
    import triton
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    print(f"{name} | torch {torch.__version__} | triton {triton.__version__}")
    sgl = DEV == "cuda" and load_sgl_ops() and hasattr(torch.ops.sgl_kernel, "fast_topk")
    if not sgl:
        print("[peer] sgl-kernel fast_topk absent: ours vs torch.topk only")
    ops.set_value_checks(False)  # the production decode setting: no host sync in the timed calls
    rows: list[dict] = []
    for R, L in SHAPES:
        run_case(f"{R}x{L}", "randn", R, L, sgl, rows)
    for R, L in PAGES:
        run_case(f"{R}x{L} pages", "randn", R, L, sgl, rows, pages=True)
    for R, L in RAGGED_PAGES:
        run_case(f"{R}x~{L * 10 // 13 // 1024}K decode pages", "randn", R, L, sgl, rows, pages=True, ragged=True)
    for R, L in ADV:
        for kind in KINDS:
            run_case(f"{R}x{L}", kind, R, L, sgl, rows)
    sweep_rows: list[dict] = []
    if a.sweep:
        run_sweep(SHAPES, sweep_rows)
    stage_rows: list[dict] = []
    if a.stages:
        run_stages(SHAPES, PAGES, stage_rows)
    write_json(rows + sweep_rows + stage_rows, "bench_topk")
    if sweep_rows:
        print_table(sweep_rows, "launch-shape sweep (ours, random scores)")
    if stage_rows:
        print_table(stage_rows, "ours stopped after each stage, cumulative us (default config, random scores)")
    cols = ("case", "kind", "ours_us", "sgl_us", "torch_us", "ours/sgl", "ours/torch", "ours_eager_us", "sgl_issue_us",
            "ab_us", "ours/ab", "ab==ours", "ours==oracle", "ours_exact", "sgl_exact", "sgl_recall", "repeat")
    print_table([{c: r[c] for c in cols if c in r} for r in rows],
                f"top-{K}: ours (Triton, exact) vs sgl-kernel fast_topk vs torch.topk (ours/x < 1: ours faster)")


if __name__ == "__main__":
    main()
