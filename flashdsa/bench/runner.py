"""Running ``flashdsa bench``: each case checked, then timed with its peers against the card's measured
ceilings; the command's driver (:func:`run_bench`).

Times: median µs of ``triton.testing.do_bench`` over a CUDA-graph replay of one call (``--no-graph``: the
plain call), value checks off (the production decode setting). ``roof_us`` = max(bytes / copy bandwidth,
FLOPs / matmul rate) with both ceilings measured on the card in the same run; bytes and FLOPs count valid
work only.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Any

import torch

from flashdsa.bench.checks import Bench
from flashdsa.bench.report import _ceilings_text, format_table, plot, replay, write_json
from flashdsa.bench.setups import SETUPS
from flashdsa.bench.suite import DEFAULT_OPS, Case, _ctx_name, _host_ctx, cases, parse_grid, parse_ops, peers_of
from flashdsa.testing.peers import peer_status
from flashdsa.testing.timing import do_bench_us, time_us


# ---- ceilings and the roofline -----------------------------------------------------------------------

def measure_ceilings(dev) -> dict:
    """The card's copy bandwidth (1 GiB device-to-device, bytes read + written) and bf16 / fp8 matmul
    rates (8192³) in this run: the roofline's ceilings."""
    from flashdsa.quant import FP8
    out: dict[str, Any] = {}
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    out["copy_GBps"] = 2 * src.numel() / do_bench_us(lambda: dst.copy_(src)) / 1e3
    src = dst = None  # free the 2 GiB now (the lambda above is done with them)
    m = 8192
    a, b = torch.randn(m, m, device=dev, dtype=torch.bfloat16), torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    out["bf16_TFLOPs"] = 2 * m ** 3 / do_bench_us(lambda: a @ b) / 1e6
    try:
        a8, b8, one = a.to(FP8), b.to(FP8).t(), torch.ones((), device=dev)  # mat2 column-major, as _scaled_mm wants
        out["fp8_TFLOPs"] = 2 * m ** 3 / do_bench_us(
            lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) / 1e6
    except Exception as e:  # noqa: BLE001
        out["fp8_TFLOPs"], out["fp8_note"] = None, f"torch._scaled_mm failed: {e!r}"[:160]
    return out


def roof_us(b: Bench, ceilings: dict) -> float | None:
    """max(bytes / copy bandwidth, FLOPs / the matmul rate of b.dtype), in µs (a composite: the sum of its parts')."""
    if not ceilings.get("copy_GBps"):
        return None
    if b.parts:
        return sum(roof_us(p, ceilings) for p in b.parts)
    t = b.bytes / ceilings["copy_GBps"] / 1e3
    rate = ceilings.get(f"{b.dtype}_TFLOPs") if b.dtype else None
    return max(t, b.flops / rate / 1e6) if rate and b.flops else t


# ---- one case ----------------------------------------------------------------------------------------

class _Progress:
    """A progress bar on stderr (tqdm if it imports, else a ``[i/n] case`` line) with notes printed above it."""

    def __init__(self, n: int):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=n, file=sys.stderr, unit="case", leave=False, mininterval=0.5)
        except ImportError:
            self.bar = None
        self.i, self.n = 0, n

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(label)
        else:
            print(f"\r[{self.i + 1}/{self.n}] {label}\033[K", end="", file=sys.stderr, flush=True)

    def done(self, notes: list[str]) -> None:
        self.i += 1
        for line in notes:
            if self.bar is not None:
                self.bar.write(line, file=sys.stderr)
            else:
                print(f"\r\033[K{line}", file=sys.stderr, flush=True)
        if self.bar is not None:
            self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def _note(row: dict) -> str:
    """One line per finished row, so a run cut short still shows what it measured."""
    parts = [f"{row['case']}: ours {row['ours_us']:.1f} us" if row.get("ours_us") else row["case"] + ":"]
    parts += [f"{p['name']} {p['us']:.1f} us" for p in row.get("peers", []) if p.get("us")]
    return ", ".join(parts) + f" | {'ok' if row['check'].get('ok') else 'FAIL'} ({row['check'].get('summary', '')})"


def extra_peak_mb(fn) -> float:
    """MB of device memory one call of ``fn`` allocates at its peak beyond what was allocated before it
    (temporaries and outputs; the caching allocator's reserve not counted)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def run_case(case: Case, dev, status: dict, ceilings: dict | None, graph: bool = True) -> list[dict]:
    """Rows of one case: checked against the reference, then (``ceilings`` given: on CUDA) timed with its peers."""
    from flashdsa import ops
    from flashdsa._checks import value_checks_enabled
    base = {"op": case.op, "kind": case.kind, "params": dict(case.params)}
    if case.sweep:
        base.update(sweep=case.sweep, context=case.params["ctx"])
    try:
        benches = SETUPS[case.kind](case.params, dev, status)
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
        return [{**base, "case": case.name, "error": f"setup: {e!r}"[:300],
                 "check": {"ok": False, "summary": f"setup failed: {type(e).__name__}"}}]
    rows = []
    for suffix, b in benches:
        row = {**base, "case": case.name + suffix, "peers": []}
        try:
            row["check"] = b.check()
        except Exception as e:  # noqa: BLE001
            row["check"] = {"ok": False, "summary": f"error: {type(e).__name__}", "error": repr(e)[:300]}
        if ceilings is not None:
            checks_were_on = value_checks_enabled()
            ops.set_value_checks(False)  # the production decode setting: no host reads in the timed calls
            try:
                us = time_us(b.ours, graph and b.graph)
                row.update(ours_us=us, GBps=b.bytes / us / 1e3, TFLOPs=b.flops / us / 1e6 if b.flops else None,
                           roof_us=roof_us(b, ceilings))
                if b.memory and torch.device(dev).type == "cuda":
                    row["ours_MB"] = extra_peak_mb(b.ours)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"timing ours: {e!r}"[:300]
            for name, make in b.peers.items():
                try:
                    fn, info = make()
                    p_us = time_us(fn, graph and b.graph)
                    row["peers"].append({"name": name, "us": p_us, "check": info,
                                         "ratio": row["ours_us"] / p_us if "ours_us" in row else None})
                    if b.memory and torch.device(dev).type == "cuda":
                        row["peers"][-1]["MB"] = extra_peak_mb(fn)
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    row["peers"].append({"name": name, "error": f"{type(e).__name__}: {e}"[:200]})
            ops.set_value_checks(checks_were_on)
        rows.append(row)
    return rows


# ---- the command -------------------------------------------------------------------------------------

def device_info(dev) -> dict:
    info = {"device": str(dev), "torch": torch.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=p.name, capability=f"sm_{p.major}{p.minor}", sms=p.multi_processor_count,
                    memory_GiB=round(p.total_memory / 2 ** 30, 1), cuda=torch.version.cuda)
    else:
        info["name"] = "cpu"
    return info


def _check_out_path(name: str, path: str | None) -> None:
    if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"{name}: the folder of {path!r} does not exist")


def _use_interpreter() -> None:
    """Triton's interpreter for CPU tensors; it must be on before our kernels are defined (first import)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    # a kernel module imported without the interpreter holds JITFunctions (interpreted ones are another class)
    jit = sys.modules.get("triton.runtime.jit")
    kernel_modules = [mod for name, mod in list(sys.modules.items()) if name.startswith("flashdsa.ops.")]
    if jit and any(isinstance(v, jit.JITFunction) for mod in kernel_modules for v in vars(mod).values()):
        raise ValueError("cpu-check: Triton kernels were already compiled for the GPU in this process; "
                         "run it in a fresh one (or set TRITON_INTERPRET=1)")
    os.environ["TRITON_INTERPRET"] = "1"


def run_bench(ops: str | tuple[str, ...] = DEFAULT_OPS, quick: bool = False, json_path: str | None = None,
              plot_path: str | None = None, peer_libs: str | None = None, cpu_check: bool = False,
              graph: bool = True, from_json: str | None = None, out=None, grid: str | None = None) -> int:
    """``flashdsa bench``. Returns the exit code: 0, or 1 if a check failed. ValueError for bad arguments.
    ``json_path`` "-": the JSON report to stdout (the text goes to ``out``). ``grid``: the decode-grid's cells
    (:func:`~flashdsa.bench.suite.parse_grid`)."""
    out = out or sys.stdout
    ops = parse_ops(ops) if isinstance(ops, str) else parse_ops(",".join(ops))
    cells = parse_grid(grid) if grid is not None else None
    if cells is not None and "decode-grid" not in ops:
        raise ValueError("grid: only the decode-grid op takes it (add --ops decode-grid)")
    _check_out_path("json", json_path)
    _check_out_path("plot", plot_path)
    if peer_libs is not None and not os.path.isdir(peer_libs):
        raise ValueError(f"peer-libs: no such folder: {peer_libs!r}")
    if from_json is not None:
        return replay(from_json, plot_path, out)
    say = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    report: dict[str, Any] = {"flashdsa": _version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                              "args": {"ops": list(ops), "quick": quick, "cpu_check": cpu_check, "graph": graph,
                                       "peer_libs": peer_libs, "grid": grid}}
    status = peer_status(peer_libs)
    report["peers"] = status
    peers_line = " | ".join(f"{n} {'yes' if s['ok'] else 'no'}" for n, s in status.items())
    timed = torch.cuda.is_available() and not cpu_check

    if not timed and not cpu_check:  # CPU: say what we would measure and why we cannot
        todo = cases(ops, quick, grid=cells)
        dev = device_info(torch.device("cpu"))
        report.update(device=dev, measured=False, rows=[], ok=True,
                      reason="no CUDA device: Triton kernels and the peers need a GPU",
                      cases=[{"op": c.op, "case": c.name, "peers": peers_of(c)} for c in todo])
        say("flashdsa bench: no CUDA device here, so nothing can be timed.")
        say(f"  would time {len(todo)} case(s) of {', '.join(ops)}{' (--quick)' if quick else ''}:")
        width = max(len(c.name) for c in todo) if todo else 0
        for c in todo:
            say(f"    {c.op:<11}{c.name:<{width}}  vs {peers_of(c)}")
        if "host" in ops:
            say(f"    {'host':<11}host us per plain call of each op, contexts "
                f"{', '.join(_ctx_name(c) for c in _host_ctx(quick))}  vs DeepGEMM, fast_topk_v2, FlashMLA")
        say("  cannot measure on CPU: kernel times, the card's copy bandwidth and matmul rates (the roofline),")
        say("  the peers' times (DeepGEMM, FlashMLA and fast_topk are CUDA kernels).")
        say("  peers importable here: " + "; ".join(f"{n}: {'yes' if s['ok'] else 'no (' + s['why'] + ')'}"
                                                    for n, s in status.items()))
        say("  correctness on CPU: flashdsa bench --cpu-check [--quick] (tiny shapes, Triton interpreter vs torch)")
        if json_path:
            write_json(report, json_path)
            say(f"  wrote {json_path}")
        if plot_path:
            say("  no plot: nothing was timed")
        return 0

    if cpu_check:
        _use_interpreter()
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
    todo = cases(ops, quick, tiny=cpu_check, grid=cells)
    info = device_info(dev)
    report["device"] = info
    t0 = time.time()
    ceilings = measure_ceilings(dev) if timed else None
    report["ceilings"] = ceilings
    if timed:
        say(f"flashdsa bench: {info['name']} ({info['capability']}, {info['sms']} SMs) | torch {info['torch']} | "
            f"triton {info['triton']} | {report['date']}")
        say(f"ceilings: {_ceilings_text(ceilings)}")
        say(f"peers: {peers_line}")
    rows: list[dict] = []
    progress = _Progress(len(todo))
    for c in todo:
        progress.start(f"{c.op}: {c.name}")
        new = run_case(c, dev, status, ceilings, graph)
        progress.done([_note(r) for r in new] if timed else [])
        rows += new
        if timed:
            torch.cuda.empty_cache()
    progress.close()
    if "host" in ops:
        report["host"] = _host(dev, timed, quick, status, say)
    ok = all(r["check"].get("ok") for r in rows)
    report.update(measured=timed, rows=rows, ok=ok, seconds=round(time.time() - t0, 1))

    if timed:
        if rows:
            say(format_table(rows))
            say("ours/peer < 1: ours faster. GB/s, TFLOP/s: ours, valid work only. roof_us: max(bytes / copy, "
                "FLOPs / matmul rate) at the measured ceilings. Times: median of do_bench" +
                (" over a CUDA-graph replay." if graph else ", plain calls."))
        if "host" in ops:
            say("host cost of plain calls (us of host time a call, best of 9 batches, GPU kept busy; ours with the "
                "default value checks):")
            say(report["host"]["table"])
            for v in report["host"]["verdicts"]:
                say(f"{'PASS' if v['ok'] else 'FAIL'}  {v['text']}")
    else:
        say(format_table(rows, timed=False))
        n_ok = sum(bool(r["check"].get("ok")) for r in rows)
        say(f"cpu-check: {n_ok}/{len(rows)} ok (tiny shapes, Triton interpreter vs torch reference; nothing timed)"
            f" in {report['seconds']} s")
    if json_path:
        write_json(report, json_path)
        say(f"wrote {json_path}")
    if plot_path:
        if not timed:
            say("no plot: nothing was timed")
        elif written := plot(rows, ceilings, plot_path,
                             title=f"flashdsa bench on {info['name']}, {report['date'][:10]}"):
            say(f"wrote {', '.join(written)}")
        else:
            say("no plot: matplotlib does not import (pip install matplotlib)")
    return 0 if ok else 1


def _host(dev: torch.device, timed: bool, quick: bool, status: dict, say) -> dict:
    """The ``host`` op: flashdsa.testing.host_cost on the GPU; nothing under --cpu-check (host times of the
    interpreter mean nothing, and every op's correctness is the other cases' business)."""
    if not timed:
        say("host: nothing to check on the CPU (host times only; benchmarks/bench_host.py --smoke runs the path)")
        return {"measured": False}
    from flashdsa.testing import host_cost
    say(f"host: timing plain calls at contexts {', '.join(_ctx_name(c) for c in _host_ctx(quick))} ...")
    rows, verdicts = host_cost.measure("cuda", _host_ctx(quick), dg=status["DeepGEMM"]["ok"],
                                       sgl=status["fast_topk"]["ok"] and status["FlashMLA"]["ok"])
    return {"measured": True, "rows": rows, "table": host_cost.table(rows),
            "verdicts": [{"text": t, "ok": ok} for t, ok in verdicts]}


def _version() -> str:
    from flashdsa import __version__
    return __version__
