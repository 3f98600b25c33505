"""What ``flashdsa bench`` shows and keeps: the table, the JSON report, the plot, and ``--from-json``
(the table and the plot of a saved report, measuring nothing).
"""

from __future__ import annotations

import json
import sys

from flashdsa.bench.suite import PLOT_SWEEPS, _ctx_name

def format_table(rows: list[dict], timed: bool = True) -> str:
    """One line per (case, peer): op | case | ours_us | peer | peer_us | ours/peer | GB/s | TFLOP/s | roof_us |
    check (``timed=False``: op | case | check), as a Markdown table."""
    def f(v, spec=".4g"):
        return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)

    def chk(c):
        return ("ok" if c.get("ok") else "FAIL") + (f" ({c['summary']})" if c.get("summary") else "")

    lines = []
    for r in rows:
        head = [r["op"], r["case"]]
        check = chk(r["check"]) + (f" [{r['error'][:60]}]" if r.get("error") else "")
        if not timed:
            lines.append(head + [check])
            continue
        ours = [f(r.get("ours_us"), ".1f")]
        if r.get("ours_MB") is not None:  # a case that measured memory: the extra peak MB of one call
            check += f"; +{r['ours_MB']:.0f} MB a call"
        tail = [f(r.get("GBps"), ".0f"), f(r.get("TFLOPs"), ".1f"), f(r.get("roof_us"), ".1f"), check]
        peers = r.get("peers") or [{}]
        for p in peers:
            pc = p.get("check", {}).get("summary", "") if "error" not in p else p["error"][:40]
            if p.get("MB") is not None:
                pc = (pc + "; " if pc else "") + f"+{p['MB']:.0f} MB a call"
            name = (p.get("name", "-") + (f" ({pc})" if pc else "")) if p else "-"
            lines.append(head + ours + [name, f(p.get("us"), ".1f"), f(p.get("ratio"), ".2f")] + tail)
    cols = ["op", "case", "check"] if not timed else \
        ["op", "case", "ours_us", "peer", "peer_us", "ours/peer", "GB/s", "TFLOP/s", "roof_us", "check"]
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]
    # a header rule makes the table a Markdown table as printed (for BENCHMARKS.md)
    out = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip(), " | ".join("-" * w for w in widths)]
    out += [" | ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def write_json(report: dict, path: str) -> None:
    """The report to ``path``; ``"-"`` (``--json`` alone) prints it to stdout."""
    if path == "-":
        print(json.dumps(report, indent=1, default=str), flush=True)
        return
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1, default=str)


def grid_ratios(rows: list[dict]) -> dict:
    """The decode-grid's step rows as ``{(ctx, n): {(B, h): ours / the peers' chain}}`` (None where the chain
    did not run)."""
    out: dict = {}
    for r in rows:
        if r.get("op") != "decode-grid" or not r["case"].endswith(": step"):
            continue
        p = r["params"]
        ratio = next((q["ratio"] for q in r.get("peers", []) if q.get("ratio")), None)
        out.setdefault((p["ctx"], p.get("n", 1)), {})[(p["B"], p["h"])] = ratio
    return out


def grid_plot_path(path: str) -> str:
    """Where the heat map goes when the sweeps' plot takes ``path``: ``bench.png`` -> ``bench_grid.png``."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem}_grid.{ext}" if dot and "/" not in ext else path + "_grid"


def plot(rows: list[dict], ceilings: dict, path: str, title: str = "") -> list[str] | bool:
    """Time vs context for the two sweeps (ours, each peer, the roofline) to ``path``, and where decode-grid rows
    are present the heat map of the step's ratio to the peers' chain (to ``path`` if nothing else was
    measured, else to :func:`grid_plot_path`). The paths written; False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    grid = grid_ratios(rows)
    other = any(r.get("op") != "decode-grid" for r in rows)
    written = []
    if other or not grid:
        _plot_sweeps(plt, rows, ceilings, path, title)
        written.append(path)
    if grid:
        written.append(grid_plot_path(path) if other else path)
        _plot_grid(plt, grid, written[-1], title)
    return written


def _plot_grid(plt, grid: dict, path: str, title: str) -> None:
    """One heat map per (ctx, n): rows batch, columns heads, colour and label the step's ours / peers ratio."""
    import numpy as np
    keys = sorted(grid)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.2), squeeze=False)
    for ax, (ctx, n) in zip(axes[0], keys):
        cells = grid[(ctx, n)]
        bs, hs = sorted({b for b, _ in cells}), sorted({h for _, h in cells})
        vals = np.array([[cells.get((b, h)) or np.nan for h in hs] for b in bs], dtype=float)
        im = ax.imshow(vals, cmap="RdYlGn_r", vmin=0.5, vmax=1.5, aspect="auto")
        for i in range(len(bs)):
            for j in range(len(hs)):
                ax.text(j, i, "-" if np.isnan(vals[i, j]) else f"{vals[i, j]:.2f}", ha="center", va="center",
                        fontsize=8)
        ax.set_xticks(range(len(hs)), [str(h) for h in hs])
        ax.set_yticks(range(len(bs)), [str(b) for b in bs])
        ax.set_xlabel("attention heads a GPU holds")
        ax.set_ylabel("batch")
        ax.set_title(f"decode step, ours / peers' chain: ctx {_ctx_name(ctx)}, {n} row(s) a request", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="< 1: ours faster")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_sweeps(plt, rows: list[dict], ceilings: dict, path: str, title: str) -> None:
    fig, axes = plt.subplots(1, len(PLOT_SWEEPS), figsize=(6 * len(PLOT_SWEEPS), 4.2))
    for ax, (sweep, label) in zip(axes, PLOT_SWEEPS.items()):
        pts = sorted((r for r in rows if r.get("sweep") == sweep and r.get("ours_us")), key=lambda r: r["context"])
        ax.set_title(label, fontsize=10)
        if not pts:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
            continue
        x = [r["context"] for r in pts]
        ax.plot(x, [r["ours_us"] for r in pts], "o-", color="C0", label="flashdsa (Triton)")
        names = list(dict.fromkeys(p["name"] for r in pts for p in r["peers"] if p.get("us")))
        for i, name in enumerate(names):
            xy = [(r["context"], p["us"]) for r in pts for p in r["peers"] if p["name"] == name and p.get("us")]
            ax.plot(*zip(*xy), "s-", color=f"C{i + 1}", label=name)
        roof = [(r["context"], r["roof_us"]) for r in pts if r.get("roof_us")]
        if roof:
            ax.plot(*zip(*roof), "k--", label=f"roofline ({_ceilings_text(ceilings)})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [_ctx_name(c) for c in x])
        ax.set_xlabel("context (tokens per request)")
        ax.set_ylabel("µs (median)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ceilings_text(c: dict) -> str:
    rate = lambda key: "-" if not c.get(key) else f"{c[key]:.0f}"  # noqa: E731
    return (f"measured copy {c.get('copy_GBps', 0) / 1e3:.2f} TB/s, bf16 mm {rate('bf16_TFLOPs')}, "
            f"fp8 mm {rate('fp8_TFLOPs')} TFLOP/s")


def replay(report_path: str, plot_path: str | None = None, out=None) -> int:
    """The table (and the plot) of a saved ``--json`` report, measuring nothing: plot a GPU run elsewhere."""
    say = lambda s="": print(s, file=out or sys.stdout, flush=True)  # noqa: E731
    try:
        with open(report_path) as fh:
            report = json.load(fh)
        rows, info = report["rows"], report["device"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"from-json: cannot read a flashdsa bench report from {report_path!r} ({e})") from e
    say(f"flashdsa bench (from {report_path}): {info.get('name')} | {report.get('date')}")
    if report.get("ceilings"):
        say(f"ceilings: {_ceilings_text(report['ceilings'])}")
    say(format_table(rows, timed=bool(report.get("measured"))))
    if plot_path:
        if not report.get("measured"):
            say("no plot: nothing was timed")
        elif written := plot(rows, report["ceilings"], plot_path, f"flashdsa bench on {info.get('name')}, "
                                                                  f"{str(report.get('date'))[:10]}"):
            say(f"wrote {', '.join(written)}")
        else:
            say("no plot: matplotlib does not import (pip install matplotlib)")
    return 0 if report.get("ok") else 1
