"""Command line: ``flashdsa demo`` (the main job) and ``flashdsa plan`` (the DSA cost model)."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    from flashdsa.demo import run_demo

    report = run_demo(preset=args.preset, device=args.device, next_n=args.next_n, seed=args.seed,
                      backend=args.backend, log=None if args.json else print)
    if args.json:
        print(json.dumps(report))
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashdsa", description="DeepSeek Sparse Attention, end to end.")
    sub = parser.add_subparsers(dest="cmd", required=True)

    demo = sub.add_parser("demo", help="run the DSA pipeline on a preset and check it")
    demo.add_argument("--preset", default="tiny", choices=["tiny", "v32", "glm5"])
    demo.add_argument("--device", default="cpu", help="cpu or cuda")
    demo.add_argument("--next-n", type=int, default=2, help="draft tokens per request in the MTP verify step")
    demo.add_argument("--backend", default=None, choices=["torch", "triton"],
                      help="force an op backend (default: triton on CUDA, torch on CPU)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    demo.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"flashdsa {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
