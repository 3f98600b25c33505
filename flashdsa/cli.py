"""Command line: ``flashdsa demo`` (the main job), ``flashdsa plan`` (the DSA cost model), ``flashdsa bench``
(our ops vs the peers on the GPU) and ``flashdsa report`` (top-k coverage on a checkpoint's layers).

A user error (a bad flag or value, a preset that does not fit) is one line on stderr and exit code 2,
never a traceback: argparse's errors and the ValueErrors the commands raise are both caught in
:func:`main`, and a ValueError that names an argument (``"layers: ..."``) is shown with its flag
(``"--layers: ..."``).

``--json`` means one thing in every command: alone, the command's JSON object on stdout instead of its text;
``--json PATH``, written to PATH beside the text. ``python -m flashdsa`` runs :func:`main` too (``torchrun ...
-m flashdsa demo --cp P``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys


class UsageError(Exception):
    """A bad command line, reported by :func:`main` as one line."""


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    # "(default: None)" / "(default: False)" would say nothing: those flags' help says what leaving them out does
    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, formatter_class=_Help, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    # argparse prints the whole usage block before its one-line error and exits; keep just the line.
    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _add_json(parser: argparse.ArgumentParser, what: str, text: str) -> None:
    """``--json`` means one thing in every command: alone, ``what`` as one JSON object on stdout instead of the
    ``text``; ``--json PATH``: written to PATH, the text printed as usual."""
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help=f"print {what} as one JSON object to stdout instead of the {text} (--json PATH: write "
                             f"it to PATH and print the {text} as usual)")


def _check_out(flag: str, path: str | None) -> None:
    """An output file's folder must exist before any work starts (``-``: stdout)."""
    folder = os.path.dirname(os.path.abspath(path)) if path and path != "-" else None
    if folder and not os.path.isdir(folder):
        raise ValueError(f"{flag}: the folder of {path} does not exist")


def _emit_json(obj, dest: str, indent: int | None = None) -> None:
    """``--json``: ``-`` (the flag alone) prints ``obj`` to stdout, a path gets it written there."""
    text = json.dumps(obj, indent=indent)
    if dest == "-":
        print(text)
        return
    with open(dest, "w") as f:
        f.write(text + "\n")
    print(f"wrote {dest}", file=sys.stderr)


def _demo(args: argparse.Namespace) -> int:
    from flashdsa.demo import run_demo
    from flashdsa.demo.v4 import V4_PRESETS

    _check_out("json", args.json)
    if args.preset in V4_PRESETS:
        return _v4_demo(args)
    if args.cp is not None or args.dcp is not None:
        return _parallel_demo(args)
    if args.cp_split is not None:
        raise ValueError("cp_split: expected only with --cp (it splits the prompt over the --cp ranks)")
    report = run_demo(preset=args.preset, device=args.device, next_n=args.next_n, seed=args.seed,
                      backend=args.backend, layers=args.layers, kv_format=args.kv_format,
                      log=None if args.json == "-" else print, force=args.force, offload=args.offload,
                      device_buffer=args.device_buffer, kpool=args.kpool)
    if args.json:
        _emit_json(report, args.json)
    return 0 if report["ok"] else 1


def _v4_demo(args: argparse.Namespace) -> int:
    """``demo --preset v4-flash | v4-tiny``: DeepSeek-V4's layer types against transformers' (flashdsa/demo/v4.py)."""
    from flashdsa.demo.v4 import run_v4_demo

    # the DSA scenario's flags mean nothing here: refused, never dropped
    dsa_only = {"next_n": args.next_n != 2, "kv_format": args.kv_format != "fp8", "layers": args.layers is not None,
                "kpool": args.kpool is not None, "force": args.force, "offload": args.offload,
                "device_buffer": args.device_buffer is not None, "cp": args.cp is not None,
                "dcp": args.dcp is not None, "cp_split": args.cp_split is not None}
    for flag, given in dsa_only.items():
        if given:
            raise ValueError(f"{flag}: a flag of the DSA demo; --preset {args.preset} serves DeepSeek-V4's layers in "
                             f"both precisions (exact, fp8) on its own scenario")
    report = run_v4_demo(preset=args.preset, device=args.device, seed=args.seed, backend=args.backend,
                         log=None if args.json == "-" else print)
    if args.json:
        _emit_json(report, args.json)
    return 0 if report["ok"] else 1


def _parallel_demo(args: argparse.Namespace) -> int:
    """``demo --cp P`` / ``--dcp P``: one process per rank under torchrun; rank 0 prints the report."""
    import torch.distributed as dist

    from flashdsa.demo import run_parallel_demo

    # run_parallel_demo takes every other flag of demo; these it has no use for, so refuse them, never drop them
    if args.cp is not None and args.dcp is not None:
        raise ValueError("dcp: expected --cp or --dcp, not both (prefill CP writes the whole KV on every rank)")
    if args.force:
        raise ValueError("force: the parallel demo makes no memory estimate to force past")
    if args.offload or args.device_buffer is not None:
        flag = "offload" if args.offload else "device_buffer"
        raise ValueError(f"{flag}: host offload (--offload, --device-buffer) with context parallelism (--cp / --dcp) "
                         f"is not built; run one of them")
    if args.dcp is not None and args.cp_split is not None:
        raise ValueError("cp_split: expected only with --cp (--dcp shards the KV by position, it splits no prompt)")
    mode, world = ("cp", args.cp) if args.cp is not None else ("dcp", args.dcp)
    try:
        report = run_parallel_demo(mode, world, split=args.cp_split or "zigzag", preset=args.preset,
                                   device=args.device, next_n=args.next_n, seed=args.seed, backend=args.backend,
                                   layers=args.layers, kv_format=args.kv_format,
                                   log=None if args.json == "-" else print, kpool=args.kpool)
        if args.json and dist.get_rank() == 0:
            _emit_json(report, args.json)
        # every rank past its last collective before any rank tears its connections down: a rank that
        # closes early can abort a peer still finishing (seen once in CI: gloo, 3 ranks, SIGABRT at exit)
        dist.barrier()
    finally:
        # also after an error: a gloo group left to interpreter shutdown can abort the process
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if report["ok"] else 1


def _plan(args: argparse.Namespace) -> int:
    from flashdsa.plan import format_plan, load_config, plan, with_kpool
    from flashdsa.v4.plan import format_plan_v4, load_v4, plan_v4

    v4 = load_v4(args.preset, args.config)  # (--preset and --config are exclusive: argparse refuses both)
    if v4 is not None:  # DeepSeek-V4: its own cost model
        if args.kpool is not None:
            raise ValueError("kpool: DeepSeek-V4 compresses its keys itself (no kpool)")
        _check_out("json", args.json)
        report = plan_v4(v4[0], context=args.context, batch=args.batch, kv_format=args.kv_format, source=v4[1])
        text = format_plan_v4
    else:
        cfg, source = load_config(preset=args.preset, config=args.config)
        if args.kpool is not None:
            cfg = with_kpool(cfg, args.kpool)
        _check_out("json", args.json)
        report = plan(cfg, context=args.context, batch=args.batch, gpus=args.gpus, kv_format=args.kv_format,
                      parallel=args.parallel, source=source)
        text = format_plan
    if args.json != "-":
        print(text(report))
    if args.json:
        _emit_json(report, args.json, indent=2)
    return 0


def _add_plan(sub) -> None:
    from flashdsa.config import PRESETS
    from flashdsa.plan import DEFAULT_CONTEXT, DEFAULT_GPUS, PARALLEL_MODES

    about = "the DSA cost model: KV bytes, FLOPs, crossover, TP vs CP traffic, memory"
    plan = sub.add_parser("plan", help=about, description=about)
    src = plan.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, choices=sorted(PRESETS) + ["v4-flash"],
                     help="a built-in model (without --config: v32; v4-flash: DeepSeek-V4-Flash)")
    src.add_argument("--config", default=None, help="an HF config.json (DSA or DeepSeek-V4), or a folder holding one")
    plan.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens per request (S)")
    plan.add_argument("--batch", type=int, default=1, help="requests (B), for the memory figure")
    plan.add_argument("--gpus", type=int, default=DEFAULT_GPUS, help="ranks (P), for traffic and memory")
    plan.add_argument("--kv-format", default="fp8", choices=["bf16", "fp8", "fp8_raw"],
                      help="MLA cache format for the indexer share and the memory figure")
    plan.add_argument("--parallel", default="tp", choices=list(PARALLEL_MODES),
                      help="memory: tp = whole KV on every GPU, cp = KV sharded over the GPUs (DCP)")
    plan.add_argument("--kpool", type=int, default=None, metavar="C",
                      help="index_kpool: one pooled index key per C tokens (default: the model's)")
    _add_json(plan, "the plan", "table")
    plan.set_defaults(func=_plan)


def _bench(args: argparse.Namespace) -> int:
    from flashdsa.bench import run_bench

    if args.json and args.from_json:
        raise ValueError("json: --from-json measures nothing, so there is no new report to write")
    # --json alone: stdout holds the JSON object only (the progress line stays on stderr)
    with open(os.devnull, "w") if args.json == "-" else contextlib.nullcontext(sys.stdout) as out:
        return run_bench(ops=args.ops, quick=args.quick, json_path=args.json, plot_path=args.plot,
                         peer_libs=args.peer_libs, cpu_check=args.cpu_check, graph=not args.no_graph,
                         from_json=args.from_json, out=out, grid=args.grid)


def _add_bench(sub) -> None:
    from flashdsa.bench import OPS
    from flashdsa.bench.suite import DEFAULT_OPS

    about = ("time our ops against the peers that import (DeepGEMM, FlashMLA, sgl-kernel fast_topk, torch) "
             "at the shapes of docs/DSA.md §9, checked first")
    bench = sub.add_parser("bench", help=about, description=about)
    bench.add_argument("--ops", default=",".join(DEFAULT_OPS),
                       help=f"a comma-separated subset of {','.join(OPS)} (decode-grid runs only when named)")
    bench.add_argument("--grid", default=None, metavar="'B=1,4;h=16,128;ctx=32K;n=1'",
                       help="the decode-grid's cells, a key left out taking every value (default: B 1-128 x h 16-128 "
                            "x ctx 8K, 32K, 128K x n 1, 2; --quick: B 1, 4, 16, 64 x h 16, 128 x ctx 32K x n 1)")
    bench.add_argument("--quick", action="store_true", help="the smallest useful subset (under a minute on an H200)")
    _add_json(bench, "every row, the device and the ceilings", "table")
    bench.add_argument("--plot", default=None, metavar="OUT.png",
                       help="time vs context, ours vs peers vs the roofline, and the decode-grid's heat map (needs "
                            "matplotlib: pip install matplotlib)")
    bench.add_argument("--peer-libs", default=None, metavar="DIR",
                       help="load sgl-kernel's *.so from DIR (default: $FLASHDSA_SGL_KERNEL_LIBS, "
                            "else import sgl_kernel)")
    bench.add_argument("--cpu-check", action="store_true",
                       help="no timing: every kind of case at tiny sizes on CPU, Triton interpreter vs torch reference")
    bench.add_argument("--no-graph", action="store_true", help="time plain calls instead of CUDA-graph replays")
    bench.add_argument("--from-json", default=None, metavar="REPORT.json",
                       help="measure nothing: print the table (and --plot) of a saved --json report")
    bench.set_defaults(func=_bench)


def _report(args: argparse.Namespace) -> int:
    from flashdsa.report import format_report, plot_report, run_report

    _check_out("json", args.json)
    _check_out("plot", args.plot)
    try:
        report = run_report(args.checkpoint, args.layers, contexts=args.context, device=args.device, hidden=args.hidden,
                            queries=args.queries, seed=args.seed, backend=args.backend,
                            log=lambda line: print(line, file=sys.stderr))
    except FileNotFoundError as e:  # a missing checkpoint file or --hidden: one line, like any bad argument
        raise ValueError(str(e)) from None
    if args.json != "-":
        print(format_report(report))
    if args.json:
        _emit_json(report, args.json, indent=1)
    if args.plot:
        if plot_report(report, args.plot):
            print(f"wrote {args.plot}", file=sys.stderr)
        else:
            print("no plot: matplotlib does not import (pip install matplotlib)", file=sys.stderr)
    return 0


def _add_report(sub) -> None:
    from flashdsa.report import DEFAULT_QUERIES

    about = "how much of dense attention DSA's top-k keeps, layer by layer, on a Hugging Face checkpoint's weights"
    rep = sub.add_parser("report", help=about, description=about + (
        ": captured attention mass (exact and fp8 indexer), sparse-vs-dense output difference, overlap with the "
        "previous layer's selection, at a few context lengths"))
    rep.add_argument("--checkpoint", required=True, metavar="DIR",
                     help="a DeepSeek-V3.2 / GLM-5 / GLM-5.3-Flash model folder (config.json, "
                          "model.safetensors.index.json, shards; a hybrid stack: its DSA layers)")
    rep.add_argument("--layers", required=True, metavar="A-B",
                     help="the layers to load and run (inclusive; the first must compute its own top-k)")
    rep.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    rep.add_argument("--context", type=int, nargs="+", default=None, metavar="N",
                     help="context lengths, each > index_topk (without it: 2, 4 and 8 x index_topk, those "
                          "--hidden holds)")
    rep.add_argument("--hidden", default=None, metavar="FILE",
                     help="saved hidden states (.pt / .safetensors): [T, hidden] entering the first layer, or "
                          "[layers(+1), T, hidden] as HF's output_hidden_states (default: synthetic)")
    rep.add_argument("--queries", type=int, default=DEFAULT_QUERIES,
                     help="query rows measured per context, the last ones (at most context - index_topk)")
    rep.add_argument("--seed", type=int, default=0, help="seed of the synthetic hidden states")
    rep.add_argument("--backend", default=None, choices=["torch", "triton"],
                     help="force an op backend (default: triton on CUDA, torch on CPU)")
    _add_json(rep, "the report", "table")
    rep.add_argument("--plot", default=None, metavar="OUT.png", help="also plot it (needs matplotlib: pip install "
                                                                     "matplotlib)")
    rep.set_defaults(func=_report)


def _add_demo(sub) -> None:
    from flashdsa.config import PRESETS
    from flashdsa.demo import KV_FORMATS
    from flashdsa.demo.v4 import V4_PRESETS

    about = "serve a random model of a preset through the DSA pipeline and check it"
    demo = sub.add_parser("demo", help=about, description=about + (
        "; refuses a preset whose memory estimate (weights + KV caches + activations) exceeds the device's "
        "free memory, and says how many layers fit"))
    demo.add_argument("--preset", default="tiny", choices=sorted(PRESETS) + list(V4_PRESETS),
                      help="model shapes: tiny (CPU, seconds), v32 (DeepSeek-V3.2), glm5 (GLM-5) or glm5-flash "
                           "(GLM-5.3-Flash: its 11 DSA layers, NoPE, kpool 16); v4-flash / v4-tiny: DeepSeek-V4's "
                           "sliding, CSA and HCA layers against transformers' own (needs transformers >= 5.23)")
    demo.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    demo.add_argument("--next-n", type=int, default=2,
                      help="draft tokens per request in the MTP verify step (>= 1; the longest request with its "
                           "drafts must fit the preset's max_position_embeddings)")
    demo.add_argument("--backend", default=None, choices=["torch", "triton"],
                      help="force an op backend (default: triton on CUDA, torch on CPU)")
    demo.add_argument("--layers", type=int, default=None, metavar="N",
                      help="keep only the first N layers of the preset (without it: all)")
    demo.add_argument("--kv-format", default="fp8", choices=list(KV_FORMATS),
                      help="MLA cache: fp8 = FlashMLA's 656-B layout, bf16 = 1152 B, fp8_raw = 576 B")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    demo.add_argument("--kpool", type=int, default=None, metavar="C",
                      help="pool every C tokens' index keys into one (GLM-5.3's index_kpool; default: the preset's, 1)")
    demo.add_argument("--force", action="store_true",
                      help="run even when the memory estimate exceeds the device's free memory")
    demo.add_argument("--offload", action="store_true",
                      help="serve with the MLA cache in host memory and small per-request device buffers, and "
                           "check it against the same scenario all on the device (bitwise)")
    demo.add_argument("--device-buffer", type=int, default=None, metavar="N",
                      help="with --offload: device rows per request and layer, a multiple of 64 from next_n x the "
                           "tokens a row selects (or the longest request's tokens if fewer) to the pool's tokens "
                           "(without it: max(2, next_n) x those tokens, rounded up to 64, at most the pool's)")
    demo.add_argument("--cp", type=int, default=None, metavar="P",
                      help="prefill context parallelism on P >= 1 ranks: run under torchrun --nproc-per-node P "
                           "-m flashdsa (gloo on --device cpu, NCCL on cuda); checked against one process")
    demo.add_argument("--cp-split", default=None, choices=["interleave", "zigzag"],
                      help="how --cp splits the prompt tokens (without it: zigzag)")
    demo.add_argument("--dcp", type=int, default=None, metavar="P",
                      help="decode context parallelism on P >= 1 ranks (KV sharded), under torchrun like --cp")
    _add_json(demo, "the report", "log")
    demo.set_defaults(func=_demo)


def _with_flag(message: str, parser: argparse.ArgumentParser) -> str:
    """``"next_n: ..."`` -> ``"--next-n: ..."`` when the command has that flag."""
    m = re.match(r"([\w-]+): ", message)
    flag = m and "--" + m[1].replace("_", "-")
    if flag and flag in parser._option_string_actions:
        return flag + message[len(m[1]):]
    return message


def _subparser(parser: argparse.ArgumentParser, cmd: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[cmd]


def _out_of_memory(e: BaseException) -> bool:
    import torch

    return (isinstance(e, (MemoryError, torch.OutOfMemoryError))
            or isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def _parallel_error(e: BaseException) -> bool:
    from flashdsa.parallel.comm import ParallelError  # torch is loaded by now: a rank ran

    return isinstance(e, ParallelError)


def build_parser() -> argparse.ArgumentParser:
    """The ``flashdsa`` parser; its errors raise :class:`UsageError` instead of exiting."""
    import flashdsa

    parser = _Parser(prog="flashdsa", description="DeepSeek Sparse Attention, end to end.")
    # flashdsa.__version__ is pyproject.toml's version too (setuptools reads it from there)
    parser.add_argument("--version", action="version", version=f"flashdsa {flashdsa.__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    # One _add_<cmd>(sub) per subcommand, each wiring its own handler.
    for add in (_add_demo, _add_plan, _add_bench, _add_report):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ValueError as e:
        print(f"flashdsa {args.cmd}: {_with_flag(str(e), _subparser(parser, args.cmd))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (``flashdsa plan | head``): say nothing more, and keep the interpreter's
        # final flush of stdout from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"flashdsa {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as e:
        if _parallel_error(e):
            # another rank failed (its own error is on its stderr) or the group timed out: one line
            print(f"flashdsa {args.cmd}: {e}", file=sys.stderr)
            return 1
        if not _out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = "; the memory estimate fell short: try fewer --layers or another --device" if args.cmd == "demo" else ""
        print(f"flashdsa {args.cmd}: out of memory ({first}){hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
