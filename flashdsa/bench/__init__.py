"""``flashdsa bench``: our ops timed next to the peers that import, at docs/DSA.md §9's shapes, checked first.

Peers load when they import: ``deep_gemm``; sgl-kernel's ops (FlashMLA sparse decode / prefill,
fast_topk) from ``import sgl_kernel`` or from the ``*.so`` files of ``--peer-libs DIR`` /
``$FLASHDSA_SGL_KERNEL_LIBS``. Without CUDA the command says what it would measure and exits 0;
``--cpu-check`` instead runs every kind of case at tiny sizes on the CPU, Triton interpreter vs the torch
reference, correctness only (for CI). ``--from-json REPORT --plot OUT.png`` redraws the table and the plot
of a saved report (a GPU box without matplotlib: plot on another machine).

The parts: :mod:`~flashdsa.bench.suite` (the cases of each op), :mod:`~flashdsa.bench.setups` (what a case
measures: inputs, our call, peers, work), :mod:`~flashdsa.bench.checks` (ours vs the torch reference, peers
vs ours), :mod:`~flashdsa.bench.runner` (checking and timing, the command), :mod:`~flashdsa.bench.report`
(table, JSON, plot).
"""

from flashdsa.bench.checks import Bench
from flashdsa.bench.report import format_table, grid_ratios, plot, replay, write_json
from flashdsa.bench.runner import device_info, measure_ceilings, roof_us, run_bench, run_case
from flashdsa.bench.setups import SETUPS, selection_inputs
from flashdsa.bench.suite import DEFAULT_OPS, GRID, OPS, PLOT_SWEEPS, Case, cases, parse_grid, parse_ops, peers_of

__all__ = ["run_bench", "run_case", "replay", "OPS", "DEFAULT_OPS", "GRID", "parse_grid", "PLOT_SWEEPS", "Case",
           "cases", "parse_ops", "peers_of", "SETUPS", "selection_inputs", "Bench", "measure_ceilings", "roof_us",
           "device_info", "format_table", "grid_ratios",
           "write_json", "plot"]
