"""Command line: ``flashdsa demo`` (the main job), ``flashdsa plan`` (the DSA cost model) and ``flashdsa bench``
(our ops vs the peers on the GPU)."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    from flashdsa.demo import run_demo

    report = run_demo(preset=args.preset, device=args.device, next_n=args.next_n, seed=args.seed,
                      backend=args.backend, layers=args.layers, kv_format=args.kv_format,
                      log=None if args.json else print)
    if args.json:
        print(json.dumps(report))
    return 0 if report["ok"] else 1


def _plan(args: argparse.Namespace) -> int:
    from flashdsa.plan import format_plan, load_config, plan

    cfg, source = load_config(preset=args.preset, config=args.config)
    report = plan(cfg, context=args.context, batch=args.batch, gpus=args.gpus, kv_format=args.kv_format,
                  parallel=args.parallel, source=source)
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    return 0


def _add_plan(sub) -> None:
    from flashdsa.config import PRESETS
    from flashdsa.plan import DEFAULT_CONTEXT, DEFAULT_GPUS, PARALLEL_MODES

    plan = sub.add_parser("plan", help="the DSA cost model: KV bytes, FLOPs, crossover, TP vs CP traffic, memory")
    src = plan.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, choices=sorted(PRESETS), help="a built-in model (default: v32)")
    src.add_argument("--config", default=None, help="an HF config.json, or a folder holding one")
    plan.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens per request (S)")
    plan.add_argument("--batch", type=int, default=1, help="requests (B), for the memory figure")
    plan.add_argument("--gpus", type=int, default=DEFAULT_GPUS, help="ranks (P), for traffic and memory")
    plan.add_argument("--kv-format", default="fp8", choices=["bf16", "fp8", "fp8_raw"],
                      help="MLA cache format for the indexer share and the memory figure")
    plan.add_argument("--parallel", default="tp", choices=list(PARALLEL_MODES),
                      help="memory: tp = whole KV on every GPU, cp = KV sharded over the GPUs (DCP)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.set_defaults(func=_plan)


def _bench(args: argparse.Namespace) -> int:
    from flashdsa.bench import run_bench

    return run_bench(ops=args.ops, quick=args.quick, json_path=args.json, plot_path=args.plot,
                     peer_libs=args.peer_libs, cpu_check=args.cpu_check, graph=not args.no_graph,
                     from_json=args.from_json)


def _add_bench(sub) -> None:
    from flashdsa.bench import OPS

    bench = sub.add_parser("bench", help="time our ops against the peers that import (DeepGEMM, FlashMLA, "
                                         "sgl-kernel fast_topk, torch) at SPEC section 9's shapes, checked first")
    bench.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)} (default: all)")
    bench.add_argument("--quick", action="store_true", help="the smallest useful subset (under a minute on an H200)")
    bench.add_argument("--json", default=None, metavar="OUT.json", help="write every row, the device and the ceilings")
    bench.add_argument("--plot", default=None, metavar="OUT.png",
                       help="time vs context, ours vs peers vs the roofline (needs matplotlib: flashdsa[bench])")
    bench.add_argument("--peer-libs", default=None, metavar="DIR",
                       help="load sgl-kernel's *.so from DIR (default: $FLASHDSA_SGL_KERNEL_LIBS, "
                            "else import sgl_kernel)")
    bench.add_argument("--cpu-check", action="store_true",
                       help="no timing: every kind of case at tiny sizes on CPU, Triton interpreter vs torch reference")
    bench.add_argument("--no-graph", action="store_true", help="time plain calls instead of CUDA-graph replays")
    bench.add_argument("--from-json", default=None, metavar="REPORT.json",
                       help="measure nothing: print the table (and --plot) of a saved --json report")
    bench.set_defaults(func=_bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashdsa", description="DeepSeek Sparse Attention, end to end.")
    sub = parser.add_subparsers(dest="cmd", required=True)

    demo = sub.add_parser("demo", help="run the DSA pipeline on a preset and check it")
    demo.add_argument("--preset", default="tiny", choices=["tiny", "v32", "glm5"])
    demo.add_argument("--device", default="cpu", help="cpu or cuda")
    demo.add_argument("--next-n", type=int, default=2, help="draft tokens per request in the MTP verify step")
    demo.add_argument("--backend", default=None, choices=["torch", "triton"],
                      help="force an op backend (default: triton on CUDA, torch on CPU)")
    demo.add_argument("--layers", type=int, default=None, help="keep only the first N layers of the preset")
    demo.add_argument("--kv-format", default="fp8", choices=["fp8", "bf16", "fp8_raw"],
                      help="MLA cache format (fp8 = FlashMLA's 656-B layout)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    demo.set_defaults(func=_demo)

    # One _add_<cmd>(sub) per further subcommand, each wiring its own handler.
    _add_plan(sub)
    _add_bench(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"flashdsa {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
