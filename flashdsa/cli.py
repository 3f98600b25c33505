"""Command line: ``flashdsa demo`` (the main job) and ``flashdsa plan`` (the DSA cost model)."""

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

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"flashdsa {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
