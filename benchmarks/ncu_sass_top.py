"""Summarise Nsight Compute's per-SASS-instruction source counters: which instructions of a kernel cost
the excess shared-memory wavefronts (bank conflicts), the local-memory (spill) traffic and the stall
samples. Input: the CSV that ``ncu --section SourceCounters --page source --print-source sass --csv``
prints for one kernel (``benchmarks/gpu_session.sh ncu`` writes ``$OUT/ncu-sass*.csv``)::

    python benchmarks/ncu_sass_top.py out/ncu-sass.csv [--top 12]

Plain Python (csv only): it runs on any machine, on a CSV fetched from the GPU box.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

STALLS = ("stall_long_sb", "stall_short_sb", "stall_barrier", "stall_wait", "stall_mio", "stall_math",
          "stall_dispatch", "stall_selected", "stall_not_selected", "stall_lg", "stall_no_inst")


def read(path: Path) -> tuple[str, list[dict]]:
    """(kernel name, one dict per SASS instruction) of ncu's CSV; ncu's own log lines before it are skipped."""
    rows = list(csv.reader(path.read_text().splitlines()))
    kernel = next((r[1] for r in rows if len(r) > 1 and r[0] == "Kernel Name"), "?")
    head = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if head is None:
        raise SystemExit(f"{path}: no 'Address' header: not ncu's --page source --csv output")
    names = rows[head]
    return kernel, [dict(zip(names, r)) for r in rows[head + 1:] if len(r) == len(names)]


def num(row: dict, key: str) -> int:
    v = row.get(key, "0").replace(",", "")
    return int(float(v)) if v not in ("", "-") else 0


def summary(path: Path, top: int) -> str:
    kernel, rows = read(path)
    lines = [f"== {kernel} ({len(rows)} SASS instructions)"]
    wf, ideal, excess = (sum(num(r, k) for r in rows) for k in
                         ("L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal", "L1 Wavefronts Shared Excessive"))
    local = sum(num(r, "L2 Theoretical Sectors Local") for r in rows)
    samples = sum(num(r, "Warp Stall Sampling (All Samples)") for r in rows)
    lines.append(f"shared wavefronts {wf:,} (ideal {ideal:,}, excess {excess:,} = {excess / max(wf, 1):.1%}); "
                 f"local-memory sectors {local:,}; stall samples {samples:,}")
    by_reason = {s: sum(num(r, s) for r in rows) for s in STALLS}
    lines.append("stall samples by reason: " + ", ".join(f"{k[6:]} {v:,} ({v / max(samples, 1):.0%})"
                                                          for k, v in sorted(by_reason.items(), key=lambda x: -x[1])
                                                          if v))

    def table(title, key, extra=()):
        picked = sorted((r for r in rows if num(r, key)), key=lambda r: -num(r, key))[:top]
        if not picked:
            return
        lines.append(f"-- top {len(picked)} by {title}")
        for r in picked:
            cols = ", ".join(f"{e} {num(r, e):,}" for e in extra)
            lines.append(f"  {r['Address'][-5:]}  {r['Source'].strip()[:60]:60s} {num(r, key):>10,}  {cols}")

    table("excess shared wavefronts", "L1 Wavefronts Shared Excessive",
          ("Instructions Executed", "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"))
    table("local-memory sectors (spills)", "L2 Theoretical Sectors Local", ("Instructions Executed",))
    table("stall samples", "Warp Stall Sampling (All Samples)", ("stall_long_sb", "stall_wait", "stall_barrier"))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=12, help="instructions listed per table")
    a = ap.parse_args()
    for p in a.csv:
        print(summary(p, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
