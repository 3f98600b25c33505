"""The demo on P ranks (``flashdsa demo --cp P`` / ``--dcp P`` under torchrun): the scenario served with prefill
context parallelism or decode context parallelism, checked layer by layer against one process.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Callable

import torch

from flashdsa.demo.scenario import DECODE_STEPS, RAW_KV_SCALE, _check_args, _scenario, demo_config, parse_device
from flashdsa.engine import DSAModel, Runner

PARALLEL_MODES = ("cp", "dcp")


def _drive(run: Runner, steps: list[tuple[str, dict]]) -> tuple[list[torch.Tensor], list[dict | None]]:
    """Run ``steps`` (mode, {request: token ids}) through ``run``: each step's logits and the bytes the rank
    received in it (the batch plan's ``traffic``; None without one)."""
    logits, traffic = [], []
    with torch.no_grad():
        for mode, chunks in steps:
            meta, reservation = run.prepare({r: len(t) for r, t in chunks.items()}, mode, force_sparse=True)
            try:
                logits.append(run.forward(torch.cat(list(chunks.values())).to(run.pool.device), meta))
            except BaseException:
                run.undo(reservation)
                raise
            traffic.append(None if meta.parallel is None else meta.parallel.traffic)
    return logits, traffic


def run_parallel_demo(mode: str, world: int, split: str = "zigzag", preset: str = "tiny", device: str = "cpu",
                      next_n: int = 2, seed: int = 0, backend: str | None = None, layers: int | None = None,
                      kv_format: str = "fp8", log: Callable[[str], None] | None = print,
                      kpool: int | None = None) -> dict:
    """The demo's scenario on ``world`` ranks (one process each, under torchrun), checked against one process.

    ``mode`` "cp" (prefill CP, ``split`` "interleave" | "zigzag") or "dcp" (decode CP: the KV sharded). Every
    rank also runs the scenario as one process, recording each layer's input, selection and output; the
    parallel run then gets each layer's recorded input and must select bitwise the same tokens and stay
    within the bound of :mod:`flashdsa.parallel.check` (CP: equal) — layer by layer, on equal inputs. A free
    run gives the logits' distance to one process (DCP's bf16 partials can flip a later layer's near tie,
    so that number is reported, not judged), the bytes each rank all-gathered per layer (to agree with
    ``flashdsa plan``) and that every rank ended with the same logits. Only rank 0 logs; every rank returns
    the same report. ``kpool`` as in :func:`run_demo` (prefill CP only: it gathers the keys before pooling).
    """
    from flashdsa import plan as cost
    from flashdsa.parallel import ContextParallel, DecodeContextParallel, SPLITS, check, init

    if mode not in PARALLEL_MODES:
        raise ValueError(f"mode: expected one of {PARALLEL_MODES}, got {mode!r}")
    # 1 is meaningful: one rank runs the parallel code path (its overhead, BENCHMARKS.md)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"{mode}: expected an integer >= 1 (ranks, one process each under torchrun), got {world!r}")
    if mode == "cp" and split not in SPLITS:
        raise ValueError(f"cp_split: expected one of {SPLITS}, got {split!r}")
    dev = parse_device(device)
    cfg = demo_config(preset, layers, kpool)
    if mode == "dcp" and cfg.index_kpool > 1:
        raise ValueError(f"kpool: decode context parallelism (--dcp) with kpool is not built (a pooled group's "
                         f"tokens would sit on several ranks); --cp supports it, got kpool {cfg.index_kpool}")
    _check_args(cfg, dev, next_n, seed, backend, kv_format)
    if "WORLD_SIZE" not in os.environ:
        raise ValueError(f"{mode}: expected one process per rank: torchrun --nproc-per-node {world} -m flashdsa "
                         f"demo --{mode} {world} ... (no torchrun environment here)")
    if world != int(os.environ["WORLD_SIZE"]):
        raise ValueError(f"{mode}: expected the number of processes torchrun started ({os.environ['WORLD_SIZE']}), "
                         f"got {world}")
    comm = init(dev)
    dev = comm.device
    rank0 = comm.rank == 0
    log = (log or (lambda *_: None)) if rank0 else (lambda *_: None)
    lens, cuts, pages = _scenario(cfg, next_n)
    gen = torch.Generator().manual_seed(seed)
    prompts = {r: torch.randint(0, cfg.vocab_size, (n,), generator=gen) for r, n in lens.items()}
    what = f"prefill CP, split {split}" if mode == "cp" else "DCP, KV sharded by position"
    log(f"[demo] {preset}: {cfg.num_hidden_layers} layers on {world} rank{'s' if world > 1 else ''} ({what}), "
        f"{dev}, KV {kv_format}, prompts {list(lens.values())}"
        + (f", kpool {cfg.index_kpool}" if cfg.index_kpool > 1 else ""))
    model = DSAModel.random(cfg, seed=seed, device=dev)

    def runner(parallel=None) -> Runner:
        return Runner(model, pages, kv_format, backend=backend, parallel=parallel,
                      kv_scale=RAW_KV_SCALE if kv_format == "fp8_raw" else None, record=True)

    # One process first, greedily, which fixes every step's tokens for the parallel runs.
    long = prompts["long"]
    steps = [("extend", {"short": prompts["short"], "at_topk": prompts["at_topk"], "long": long[cuts[0]:cuts[1]]})]
    steps += [("extend", {"long": long[cuts[i]:cuts[i + 1]]}) for i in (1, 2)]
    one = runner()
    with check.trace(model) as one_trace:
        one_logits, _ = _drive(one, steps)
        nxt = {r: 0 for r in lens} | {"long": int(one_logits[-1][-1].argmax())}
        for _ in range(DECODE_STEPS):
            step = ("decode", {r: torch.tensor([t]) for r, t in nxt.items()})
            steps.append(step)
            (logits,), _ = _drive(one, [step])
            one_logits.append(logits)
            nxt = {r: int(row.argmax()) for r, row in zip(lens, logits)}
        steps.append(("target_verify", {r: torch.tensor([(t + j) % cfg.vocab_size for j in range(next_n)])
                                        for r, t in nxt.items()}))
        one_logits += _drive(one, steps[-1:])[0]
    max_v = check.max_values(one.pool, list(lens))
    log(f"[demo] one process: {len(steps)} steps ({len(steps) - DECODE_STEPS - 1} prefill chunks, {DECODE_STEPS} "
        f"decodes, a verify of {next_n}); now on {world} ranks, every layer fed one process's input ...")

    par = ContextParallel(comm, split) if mode == "cp" else DecodeContextParallel(comm)
    with check.trace(model, check.inputs_only(one_trace)) as par_trace:
        _drive(runner(par), steps)
    layerwise = check.compare(one_trace, par_trace, max_v, cfg.index_topk)
    log("[demo] ... and free-running")
    free = runner(par)
    t0 = time.perf_counter()
    par_logits, traffic = _drive(free, steps)
    elapsed = time.perf_counter() - t0
    logits_max_abs = max(float((a - b).abs().max()) for a, b in zip(par_logits, one_logits))
    digest = hashlib.sha256(torch.cat([t.flatten() for t in par_logits]).cpu().numpy().tobytes()).hexdigest()
    ranks_agree = len(set(comm.all_gather_object(digest, "the logits' digests"))) == 1
    skip_ok = all(free.selections[layer] is free.selections[layer - 1] for layer in cfg.skip_topk_layers) \
        if cfg.skip_topk_layers else None

    # Bytes per rank per layer: CP in the first prefill batch, DCP in the first decode step, both in layer 0
    # (a layer with an indexer), against the cost model's figures for the same tokens and ranks.
    if mode == "cp":
        t = sum(len(c) for c in steps[0][1].values())
        measured = {k: traffic[0][k][0] for k in ("mla", "indexer")}
        planned = cost.cp_gather_bytes_per_rank_per_layer(cfg, t, world)
        at = f"prefill of {t} tokens"
    else:
        first = next(i for i, (m, _) in enumerate(steps) if m == "decode")
        measured = {k: traffic[first][k][0] for k in ("topk_candidates", "partial_attention")}
        planned = cost.dcp_bytes_per_rank_per_layer(cfg, len(lens), world)
        at = f"decode step of {len(lens)} rows"
    measured["total"] = sum(measured.values())
    bytes_agree = measured == planned
    ok = (layerwise["selections_equal"] and layerwise["worst_over_tolerance"] <= 1.0 and ranks_agree and bytes_agree
          and skip_ok is not False)
    report = {
        "ok": ok, "mode": mode, "world_size": world, "split": split if mode == "cp" else "kv-by-position",
        "device": str(dev), "preset": preset, "layers": cfg.num_hidden_layers, "kv_format": kv_format,
        "next_n": next_n, "backend": backend or ("triton" if dev.type == "cuda" else "torch"),
        "kpool": cfg.index_kpool, "prompt_lens": list(lens.values()), "steps": len(steps),
        "selections_bitwise_equal": layerwise["selections_equal"], "layers_compared": layerwise["layers"],
        "selection_mismatches": layerwise["mismatches"],
        "max_abs_vs_single_process": layerwise["max_abs"],
        "max_abs_over_tolerance": layerwise["worst_over_tolerance"],
        "logits_max_abs_vs_single_process_free_running": logits_max_abs, "ranks_agree": ranks_agree,
        "skip_layers_reuse_exact": skip_ok,
        "bytes_all_gathered_per_rank_per_layer": measured, "plan_bytes_per_rank_per_layer": planned,
        "bytes_measured_at": at, "bytes_agree_with_plan": bytes_agree,
        "hidden_bytes_gathered_per_prefill": traffic[0].get("hidden", [0])[0] if mode == "cp" else 0,
        "seconds_free_run": round(elapsed, 4),
    }
    log(f"[demo] layer by layer on one process's inputs ({layerwise['layers']} layer-steps): selections "
        f"{'bitwise equal' if layerwise['selections_equal'] else 'DIFFERENT'}, max |out - one process| "
        f"{layerwise['max_abs']:.3g} = {layerwise['worst_over_tolerance']:.2f} x the bound")
    log(f"[demo] free-running logits: max |diff| {logits_max_abs:.3g} vs one process; ranks agree: {ranks_agree}")
    log(f"[demo] bytes per rank per layer ({at}): {measured} | plan {planned}: "
        f"{'agree' if bytes_agree else 'DISAGREE'}")
    log(f"[demo] {'ok' if ok else 'FAILED'}")
    return report
