"""Host cost of plain (eager) calls of flashdsa's ops and of the peers at DeepSeek-V3.2's decode shapes, and
the plain-call decode step against its CUDA-graph replay (issue #18): the measurement behind
``flashdsa bench --ops host`` and ``benchmarks/bench_host.py`` (whose docstring says how it is timed).

:func:`measure` returns the rows and the PASS / FAIL verdicts against the targets (``TARGET_US``; each op
<= 2x its peer's host cost; the plain step <= 1.2x its replay). Peers must be loaded first
(``flashdsa.testing.peers``); absent ones are left out.
"""

from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl

from flashdsa import ops
from flashdsa._checks import value_check_setting
from flashdsa.ops.topk import launch as topk_launch
from flashdsa.quant import FP8
from flashdsa.testing import peers
from flashdsa.testing.inputs import decode_slots, index_cache, mla_cache, paged_batch, randn

SM_SCALE = 576 ** -0.5
TARGET_US = {"indexer_logits_paged": 45.0, "topk_transform": 20.0}  # issue #18, the H200 host


# ---- timing --------------------------------------------------------------------------------------------

class HostTimer:
    """Host µs per call: the best of ``reps`` batches of ``calls`` calls, each batch queued behind a GPU spin."""

    def __init__(self, dev: str, calls: int, reps: int = 9):
        self.dev, self.calls, self.reps = dev, calls, reps
        self.cycles_per_us = self._calibrate() if dev == "cuda" else 0.0

    @staticmethod
    def _calibrate() -> float:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 20_000_000
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()
        return n / (a.elapsed_time(b) * 1e3)

    def __call__(self, fn, budget_us: float = 400.0) -> tuple[float, bool]:
        """``(µs per call, gpu_busy)``; ``budget_us``: the most one call may take (sizes the spin)."""
        return self.interleaved({0: fn}, budget_us=budget_us)[0]

    def interleaved(self, fns: dict, before=None, budget_us: float = 400.0) -> dict:
        """``{key: (µs per call, gpu_busy)}`` of every call in ``fns``, timed in rounds: each round times
        one batch of each call in turn, and a call's time is its best round. A load change on the shared
        host then hits every call alike, so the ratios of one run compare. ``before(key)``: called before
        each batch of ``key``, outside the timing (e.g. to switch the value checks)."""
        for key, fn in fns.items():
            if before is not None:
                before(key)
            fn()
            fn()  # compile, plans, lazy imports: outside the timing
        if self.dev == "cuda":
            torch.cuda.synchronize()
        best = {key: float("inf") for key in fns}
        busy = {key: True for key in fns}
        # every batch's µs per call, for the spread (``batches``): the best is the path's own cost, a spread
        # that moves the median far from it says something besides the host's load was timed
        self.batches = {key: [] for key in fns}
        for _ in range(self.reps if self.dev == "cuda" else 1):
            for key, fn in fns.items():
                if before is not None:
                    before(key)
                if self.dev == "cuda":
                    torch.cuda._sleep(int(self.cycles_per_us * (budget_us * self.calls + 5000)))
                t = time.perf_counter()
                for _ in range(self.calls):
                    fn()
                dt = time.perf_counter() - t
                if self.dev == "cuda":
                    done = torch.cuda.Event()
                    done.record()
                    busy[key] = busy[key] and not done.query()  # the spin still running: host time only
                    torch.cuda.synchronize()
                best[key] = min(best[key], dt / self.calls * 1e6)
                self.batches[key].append(dt / self.calls * 1e6)
        return {key: (best[key], busy[key]) for key in fns}


def loop_us(fn, n: int = 50) -> float:
    """µs per call of ``n`` back-to-back calls, CUDA events around the loop (host and GPU both count)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / n)
    return best


def graph_of(fn):
    from flashdsa.testing.timing import capture_graph
    return capture_graph(fn).replay


# ---- inputs at the decode shapes ------------------------------------------------------------------------

def decode_inputs(dev: str, B: int, ctx: int, H: int, h_q: int, topk: int, backend: str | None = None) -> dict:
    """One layer's decode step at context ~ctx: indexer q / gates, the paged caches, the metadata, the
    logits and selection the later stages read, and the MLA query."""
    g = torch.Generator(device=dev).manual_seed(ctx)
    seq, bt, P = paged_batch(B, ctx, 1, g, dev)
    d = dict(B=B, H=H, h_q=h_q, topk=topk, backend=backend, block_table=bt, context_lens=seq.to(torch.int32).view(B, 1),
             max_len=bt.shape[1] * 64, index_cache=index_cache(P, g, dev), mla_cache=mla_cache(P, g, dev))
    d["q_fp8"] = randn((B, 1, H, 128), g, dev, FP8)
    d["weights"] = randn((B, H), g, dev) * H ** -0.5
    d["q"] = randn((B, 1, h_q, 576), g, dev, torch.bfloat16)
    d["x"] = randn((B, H, 128), g, dev, torch.bfloat16)
    d["cos"], d["sin"] = torch.rand(B, 32, generator=g, device=dev), torch.rand(B, 32, generator=g, device=dev)
    d["logits"] = ops.indexer_logits_paged(d["q_fp8"], d["index_cache"], d["weights"], d["context_lens"], bt,
                                           d["max_len"], backend=backend)
    d["lengths"] = d["context_lens"].view(-1)
    d["indices"] = decode_slots(bt, int(seq.min()), 1, topk, g)
    return d


def our_calls(d: dict) -> dict:
    """name -> (plain call, peer name or None)."""
    be = d["backend"]

    def paged():
        return ops.indexer_logits_paged(d["q_fp8"], d["index_cache"], d["weights"], d["context_lens"],
                                        d["block_table"], d["max_len"], backend=be)

    def topk():
        return ops.topk_transform(d["logits"], d["lengths"], d["topk"], backend=be)

    out = torch.empty(d["B"], d["topk"], dtype=torch.int32, device=d["lengths"].device)

    def topk_out():   # into a buffer made once: the raw fast_topk op's terms
        return ops.topk_transform(d["logits"], d["lengths"], d["topk"], backend=be, out=out)

    def topk_pages():
        return ops.topk_transform(d["logits"], d["lengths"], d["topk"], page_table=d["block_table"], backend=be)

    def decode():
        return ops.sparse_mla_decode(d["q"], d["mla_cache"], d["indices"], SM_SCALE, backend=be)

    def quant():
        return ops.indexer_quant(d["x"], d["cos"], d["sin"], False, backend=be)

    def step():
        logits = paged()
        sel = ops.topk_transform(logits, d["lengths"], d["topk"], page_table=d["block_table"], backend=be)
        return ops.sparse_mla_decode(d["q"], d["mla_cache"], sel.view(d["B"], 1, -1), SM_SCALE, backend=be)

    # top-k's peers: sgl-kernel's Python entry, which allocates its output per call as ours does, and its raw op
    # writing into a buffer made once, as ours does with out=
    return {"indexer_logits_paged": (paged, "DeepGEMM paged"), "topk_transform": (topk, "fast_topk_v2"),
            "topk_transform (out=)": (topk_out, "fast_topk"), "topk_transform (page table)": (topk_pages, None),
            "sparse_mla_decode": (decode, "FlashMLA decode"), "indexer_quant (q)": (quant, None), "step": (step, None)}


def check_cost_calls(d: dict) -> dict:
    """name -> (launch with the folded value checks compiled in, the same launch without): the device cost of
    checking inside the op's kernel, timed by graph replay (capture itself skips the public op's checks, so
    the launchers are called directly)."""
    from flashdsa.ops.indexer import paged
    from flashdsa.ops.topk import launch
    args = (d["q_fp8"], d["index_cache"], d["weights"], d["context_lens"], d["block_table"], d["max_len"])
    B = d["B"]
    # MTP verify (next_n 2): the two draft rows of each request see lengths - 1 and lengths
    args2 = (d["q_fp8"].expand(B, 2, *d["q_fp8"].shape[2:]).contiguous(), d["index_cache"],
             d["weights"].repeat_interleave(2, 0), torch.cat([d["context_lens"] - 1, d["context_lens"]], 1),
             d["block_table"], d["max_len"])
    targs = (d["logits"], d["lengths"], d["topk"], d["block_table"], None, None, 64)
    return {"indexer_logits_paged": (lambda: paged.indexer_logits_paged(*args, check=True),
                                     lambda: paged.indexer_logits_paged(*args)),
            "indexer_logits_paged next_n 2": (lambda: paged.indexer_logits_paged(*args2, check=True),
                                              lambda: paged.indexer_logits_paged(*args2)),
            "topk_transform (page table)": (lambda: launch.topk_transform(*targs, check=True),
                                            lambda: launch.topk_transform(*targs))}


def peer_calls(d: dict, dg: bool, sgl: bool) -> dict:
    out = {}
    if dg:
        out["DeepGEMM paged"] = peers.deepgemm_paged(d["q_fp8"], d["index_cache"], d["weights"], d["context_lens"],
                                                     d["block_table"], d["max_len"])
    if sgl and hasattr(torch.ops.sgl_kernel, "fast_topk") and d["topk"] == 2048:
        out["fast_topk"] = peers.fast_topk(d["logits"], d["lengths"], d["topk"])[0]
        out["fast_topk_v2"] = peers.fast_topk_v2(d["logits"], d["lengths"], d["topk"])
    if sgl and hasattr(torch.ops.sgl_kernel, "sparse_decode_fwd"):
        out["FlashMLA decode"] = peers.flashmla_decode(d["q"], d["mla_cache"], d["indices"], SM_SCALE, d["lengths"])
    if len(out) == 4:
        fns = [out[n] for n in ("DeepGEMM paged", "fast_topk", "FlashMLA decode")]
        out["peers' step"] = lambda: [f() for f in fns]
    return out


# module level: Triton resolves a kernel's names (tl) in its module's globals, not in a closure
@triton.jit
def k2(x, n):
    pass


@triton.jit
def k12(a, b, c, d, e, f, n1, n2, n3, n4, B: tl.constexpr, C: tl.constexpr):
    pass


def calibration_calls(dev: str) -> dict:
    """torch.add and an empty Triton kernel with 2 / 12 arguments (examples/launch_overhead.py)."""
    x = torch.empty(1024, device=dev)
    ts = [torch.empty(1024, device=dev) for _ in range(6)]
    return {"torch.add": lambda: torch.add(x, 1), "triton empty kernel, 2 args": lambda: k2[(1,)](x, 1024),
            "triton empty kernel, 12 args": lambda: k12[(1,)](*ts, 1, 2, 3, 4, B=64, C=128)}


# ---- the run ------------------------------------------------------------------------------------------

def run_ctx(d: dict, ctx: int, dev: str, timer: HostTimer, dg: bool, sgl: bool, rows: list, verdicts: list) -> None:
    """Every call at context ``ctx`` on ``d`` (:func:`decode_inputs`), its rows and verdicts appended."""
    ours, theirs = our_calls(d), peer_calls(d, dg, sgl)
    calls = {("peer", name): fn for name, fn in theirs.items()}
    for checks in ("on", "off"):
        calls.update({(checks, name): fn for name, (fn, _) in ours.items()})
    # A/B in the same rounds: top-k allocating its scratch every call instead of the per-stream cached one
    calls[("fresh-scratch", "topk_transform (page table)")] = ours["topk_transform (page table)"][0]

    def before(key):
        ops.set_value_checks(key[0] != "off")
        topk_launch.CACHED_SCRATCH = key[0] != "fresh-scratch"

    setting = value_check_setting()
    try:
        timed = timer.interleaved(calls, before=before)
    finally:
        ops.set_value_checks(setting)
        topk_launch.CACHED_SCRATCH = True
    ops.check_errors()
    peer_us = {}
    for name in theirs:
        peer_us[name], busy = timed[("peer", name)]
        rows.append(dict(ctx=ctx, call=name, side="peer", host_us=peer_us[name], gpu_busy=busy))
    for name, (fn, peer) in ours.items():
        row = dict(ctx=ctx, call=name, side="ours")
        row["host_us"], row["gpu_busy"] = timed[("on", name)]
        row["host_us_median"] = statistics.median(timer.batches[("on", name)])
        row["host_us_checks_off"] = timed[("off", name)][0]
        if ("fresh-scratch", name) in timed:
            row["host_us_fresh_scratch"] = timed[("fresh-scratch", name)][0]
        if peer in peer_us:
            row["peer"], row["peer_host_us"] = peer, peer_us[peer]
            row["ours/peer"] = row["host_us"] / peer_us[peer]
        if peer == "fast_topk_v2" and "fast_topk" in peer_us:
            row["ours/raw fast_topk"] = row["host_us"] / peer_us["fast_topk"]
        rows.append(row)
        if dev != "cuda":
            continue
        if name in TARGET_US:
            verdicts.append((f"{name} ctx {ctx}: host {row['host_us']:.1f} us <= {TARGET_US[name]:.0f} us",
                             row["host_us"] <= TARGET_US[name]))
        if peer in peer_us:
            verdicts.append((f"{name} ctx {ctx}: {row['ours/peer']:.2f}x {peer}'s host cost <= 2x",
                             row["ours/peer"] <= 2.0))
    if dev == "cuda":
        from flashdsa.testing.timing import time_us
        for name, (on, off) in check_cost_calls(d).items():
            t_on, t_off = time_us(on), time_us(off)
            rows.append(dict(ctx=ctx, call=f"{name}: GPU us, checks in the kernel / none", side="ours",
                             gpu_us_checks=t_on, gpu_us_no_checks=t_off, **{"checks/none": t_on / t_off}))
        step = ours["step"][0]
        plain, replay = loop_us(step), loop_us(graph_of(step))
        rows.append(dict(ctx=ctx, call="step: plain calls vs graph replay", side="ours", step_plain_us=plain,
                         step_graph_us=replay, **{"plain/graph": plain / replay}))
        verdicts.append((f"decode step ctx {ctx}: plain {plain:.1f} us = {plain / replay:.2f}x the graph replay "
                         f"({replay:.1f} us) <= 1.2x", plain / replay <= 1.2))
        if "peers' step" in theirs:
            p_plain, p_replay = loop_us(theirs["peers' step"]), loop_us(graph_of(theirs["peers' step"]))
            rows.append(dict(ctx=ctx, call="peers' step: plain vs graph", side="peer", step_plain_us=p_plain,
                             step_graph_us=p_replay, **{"plain/graph": p_plain / p_replay}))
    ops.check_errors()


def measure(dev: str, ctxs=(8192, 32768), calls: int = 100, B: int = 64, H: int = 64, h_q: int = 128,
            topk: int = 2048, backend: str | None = None, dg: bool = False, sgl: bool = False,
            timer: HostTimer | None = None) -> tuple[list[dict], list[tuple[str, bool]]]:
    """``(rows, verdicts)``: the calibration calls, then per context every call of ours (default checks and
    checks off) and of the peers (``dg``: DeepGEMM loaded, ``sgl``: sgl-kernel's ops loaded), the device cost
    of the folded checks and the plain step vs its replay. ``dev`` "cpu": the interpreter, times meaningless."""
    timer = timer or HostTimer(dev, calls)
    rows: list[dict] = []
    verdicts: list[tuple[str, bool]] = []
    if dev == "cuda":
        for cname, (us, busy) in timer.interleaved(calibration_calls(dev)).items():
            rows.append(dict(ctx="-", call=cname, side="calibration", host_us=us, gpu_busy=busy))
    for ctx in ctxs:
        run_ctx(decode_inputs(dev, B, ctx, H, h_q, topk, backend), ctx, dev, timer, dg, sgl, rows, verdicts)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows, verdicts


COLUMNS = ("ctx", "call", "side", "host_us", "host_us_median", "host_us_checks_off", "host_us_fresh_scratch", "peer",
           "peer_host_us", "ours/peer", "ours/raw fast_topk", "gpu_busy", "step_plain_us", "step_graph_us", "plain/graph",
           "gpu_us_checks", "gpu_us_no_checks", "checks/none")


def table(rows: list[dict]) -> str:
    """The host rows as a Markdown table: ctx | call | side | ours µs (default checks) | checks off | peer |
    peer µs | ours/peer | the step's plain / replay µs and ratio."""
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)

    cols = ["ctx", "call", "side", "host_us", "checks_off_us", "peer", "peer_us", "ours/peer", "step plain / replay us",
            "plain/replay"]
    lines = []
    for r in rows:
        if "gpu_us_checks" in r:
            continue  # the folded checks' device cost: in the JSON
        step = f"{r['step_plain_us']:.1f} / {r['step_graph_us']:.1f}" if "step_plain_us" in r else "-"
        lines.append([str(r["ctx"]), r["call"], r["side"], f(r.get("host_us")), f(r.get("host_us_checks_off")),
                      r.get("peer", "-"), f(r.get("peer_host_us")), f(r.get("ours/peer"), ".2f"), step,
                      f(r.get("plain/graph"), ".2f")])
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]
    out = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip(), " | ".join("-" * w for w in widths)]
    out += [" | ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)
