"""The demo's run (:func:`run_demo`): build a model with seeded random weights and serve the scenario on
paged caches — prefill (the long prompt in chunks), a few greedy decode steps, one MTP verify step — once
untimed, once timed; run the checks (:mod:`flashdsa.demo.checks`); present the result (``[demo]`` log
lines, the JSON report).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from flashdsa.cache import layouts
from flashdsa.cache.offload import OffloadConfig
from flashdsa.demo.checks import (TOL_RMS_PER_LAYER, _Diff, _fmt_check, chunked_vs_oneshot, dense_equivalence,
                                  offload_vs_on_device, skip_layers_reuse, verify_vs_decode)
from flashdsa.demo.memory import (GB, _cpu_matmul_rate, _estimate, _fit_message, _fits, _gb, _weights,
                                  available_memory)
from flashdsa.demo.scenario import (DECODE_STEPS, RAW_KV_SCALE, _check_args, _offload_config, _scenario,
                                    _tokens_processed, demo_config, parse_device)
from flashdsa.engine import DSAModel, Runner


def _decode_kernel(torch_ops: bool) -> str:
    """The sparse-MLA decode kernel behind the figures: "gluon" where the default dispatch ran the Gluon
    kernel (sm_90), else the backend's."""
    from flashdsa.ops.sparse_mla import gluon_decode_ran
    return "torch" if torch_ops else "gluon" if gluon_decode_ran() else "triton"


def _offload_report(off_cfg: OffloadConfig | None, kv_mem: dict, swap: dict | None, diff: _Diff | None,
                    layers: int, requests: int) -> dict:
    """The report's offload keys; without offload the device holds everything and the rest is None."""
    on_device = kv_mem["mla"] + kv_mem["index"] + kv_mem["exact_index"]
    per_step = swap["rows"] / swap["steps"] if swap and swap["steps"] else None
    return {
        "offload": off_cfg is not None, "device_buffer": off_cfg.device_buffer if off_cfg else None,
        "device_kv_bytes": kv_mem["device"] if off_cfg else on_device,
        "host_kv_bytes": kv_mem["host"] if off_cfg else 0, "on_device_kv_bytes": on_device,
        "swap_in_tokens_per_step": per_step,
        "swap_in_tokens_per_layer_request": None if per_step is None else per_step / (layers * requests),
        "max_abs_vs_on_device": None if diff is None else diff.err_max,
    }


def run_demo(preset: str = "tiny", device: str = "cpu", next_n: int = 2, seed: int = 0, backend: str | None = None,
             layers: int | None = None, kv_format: str = "fp8", log: Callable[[str], None] | None = print,
             force: bool = False, offload: bool = False, device_buffer: int | None = None,
             kpool: int | None = None) -> dict:
    """Serve the scenario on a preset model and check it; returns the report (``flashdsa demo --json``).

    ``offload``: serve with the MLA cache in host memory and ``device_buffer`` rows per request and layer
    on the device (:func:`~flashdsa.demo.scenario._offload_config`), and check it against the same scenario
    all on the device.
    ``kpool``: pool every ``kpool`` tokens' index keys into one (docs/DSA.md §7; None: the preset's, 1).

    Raises ValueError naming the argument for a bad one, and for a preset whose
    :func:`~flashdsa.demo.memory.memory_estimate` exceeds the device's free memory (unless ``force``: then it
    only warns).
    """
    log = log or (lambda *_: None)
    dev = parse_device(device)
    cfg = demo_config(preset, layers, kpool)
    _check_args(cfg, dev, next_n, seed, backend, kv_format)
    off_cfg = _offload_config(cfg, offload, device_buffer, next_n)
    torch_ops = (backend or ("triton" if dev.type == "cuda" else "torch")) == "torch"

    fixed, per_layer, matmul_params = _weights(cfg)
    est = _estimate(cfg, kv_format, next_n, torch_ops, fixed + sum(per_layer))
    avail = available_memory(dev)
    fits = None if avail is None else _fits(est, avail)
    if fits is False:
        msg = _fit_message(preset, cfg, dev, est, avail, kv_format, next_n, torch_ops)
        if not force:
            raise ValueError(msg)
        log(f"[demo] warning (--force): {msg}")

    k = cfg.index_topk
    lens, cuts, pages = _scenario(cfg, next_n)
    prompts = {r: torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed + i))
               for i, (r, n) in enumerate(lens.items())}
    stages: dict[str, float] = {}

    def timed(name: str, fn):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        stages[name] = stages.get(name, 0.0) + time.perf_counter() - t0
        return out

    log(f"[demo] {preset}: {cfg.num_hidden_layers} layer{'s' if cfg.num_hidden_layers > 1 else ''} "
        f"({len(cfg.topk_layers)} with an indexer, skip-top-k "
        f"{cfg.skip_topk_layers}), {cfg.num_attention_heads} heads, topk {k}, on {dev}, KV {kv_format}"
        + (f", kpool {cfg.index_kpool} (top-{k // cfg.index_kpool} groups of {cfg.index_kpool} + the tail)"
           if cfg.index_kpool > 1 else ""))
    log(f"[demo] memory estimate {_gb(est['total'])} (weights {_gb(est['weights'])}, KV {_gb(est['kv'])}, "
        f"activations {_gb(est['activations'])}); {'n/a' if avail is None else _gb(avail)} free")
    work = 2 * matmul_params * _tokens_processed(lens, next_n)  # a multiply-add per weight and token
    if dev.type == "cpu" and work > 1e12:
        rate = _cpu_matmul_rate()
        log(f"[demo] about {work / 1e12:.0f} TFLOP of bf16 matmuls: roughly {work / rate / 60:.0f} min at this "
            f"CPU's {rate / 1e9:.1f} GFLOP/s (a GPU takes seconds); Ctrl-C stops it")
    log("[demo] building the model (seeded random weights) ...")
    model = timed("build", lambda: DSAModel.random(cfg, seed=seed, device=dev))

    def runner(offload: OffloadConfig | None = None, **kw) -> Runner:
        # kpool_max_requests: the tail rings of the scenario's requests only (256 by default)
        return Runner(model, pages, kv_format, backend=backend, kpool_max_requests=len(lens),
                      kv_scale=RAW_KV_SCALE if kv_format == "fp8_raw" else None, offload=offload, **kw)

    long = prompts["long"]

    def serve(run: Runner, timed, log) -> tuple[dict, int]:
        """The serving scenario: prefill (short prompts whole, the long one in three chunks), decode a few
        steps greedily, one MTP verify step. Returns the drafts verified and the tokens processed."""
        first = {"short": prompts["short"], "at_topk": prompts["at_topk"], "long": long[cuts[0]:cuts[1]]}
        log(f"[demo] prefill chunk 1/3: {', '.join(f'{r} {len(t)}' for r, t in first.items())} tokens")
        timed("prefill", lambda: run.extend(first))
        for i in (1, 2):
            log(f"[demo] prefill chunk {i + 1}/3: long {cuts[i + 1] - cuts[i]} tokens on top of {cuts[i]}")
            last = timed("prefill", lambda: run.extend({"long": long[cuts[i]:cuts[i + 1]]}))
        tokens = sum(lens.values())
        nxt = {r: int(t) for r, t in zip(lens, [0, 0, int(last[-1].argmax())])}
        for _ in range(DECODE_STEPS):
            logits = timed("decode", lambda: run.decode(nxt))
            nxt = {r: int(row.argmax()) for r, row in zip(lens, logits)}
            tokens += len(lens)
        log(f"[demo] decoded {DECODE_STEPS} steps x {len(lens)} requests")
        drafts = {r: [(t + j) % cfg.vocab_size for j in range(next_n)] for r, t in nxt.items()}
        timed("verify", lambda: run.verify(drafts))
        log(f"[demo] verified {next_n} drafts x {len(lens)} requests")
        return drafts, tokens + next_n * len(lens)

    # The first pass pays one-off costs: Triton compiles each kernel on CUDA (seconds per kernel on a
    # cold cache), and on the CPU torch's first calls pick kernels and grow the allocator. Run the
    # scenario once untimed, on every device, so tokens_per_s measures serving.
    log("[demo] warm-up: the scenario once, untimed (Triton compiles its kernels; first calls) ...")
    timed("warmup", lambda: serve(runner(off_cfg), lambda _name, fn: fn(), lambda *_: None))
    run = runner(off_cfg, record=True)
    drafts, tokens = serve(run, timed, log)
    skip_ok = skip_layers_reuse(run, cfg)
    pool_bytes_per_token = run.pool.bytes_per_token()
    kv_mem = run.pool.memory_bytes()
    swap = run.pool.stats.get("decode") if off_cfg else None
    del run

    offload_diff = None
    if off_cfg:
        log("[demo] checking: offload vs all on the device ...")
        offload_diff = offload_vs_on_device(runner, off_cfg, serve)

    log("[demo] checking: verify vs sequential decodes ...")
    verify = verify_vs_decode(runner, prompts, drafts, next_n)
    log("[demo] checking: chunked vs one-shot prefill ...")
    chunk = chunked_vs_oneshot(runner, long, cuts)
    # The runner never takes the dense path with an fp8_raw cache, so there is nothing to compare.
    dense, dense_ran, dense_na = None, None, "fp8_raw never takes the dense path"
    if kv_format != "fp8_raw":
        log("[demo] checking: sparse vs dense fallback ...")
        dense, dense_ran = dense_equivalence(runner, prompts)

    total_s = sum(t for name, t in stages.items() if name not in ("build", "warmup"))
    n_index = len(cfg.topk_layers)
    L = cfg.num_hidden_layers
    index_bytes = layouts.INDEX_BYTES_PER_TOKEN * n_index / cfg.index_kpool  # one 132-B key per c tokens
    rope = cfg.qk_rope_head_dim  # NoPE rows (0) have no rope part
    kv_bytes = {**{f: layouts.mla_row_bytes(f, rope) * L for f in layouts.MLA_FORMATS}, "index": index_bytes,
                "total": pool_bytes_per_token}
    tol = TOL_RMS_PER_LAYER * L
    rms = [c.rel_rms for c in (dense, chunk, verify) if c is not None]
    ok = (max(rms) < tol and skip_ok is not False and dense_ran is not False
          and (offload_diff is None or offload_diff.err_max == 0.0))
    not_applicable = {}
    if dense is None:
        not_applicable["dense_equivalence"] = dense_na
    if skip_ok is None:
        not_applicable["skip_layers_reuse"] = "no skip-top-k layers in this model"
    report = {
        "ok": ok, "device": str(dev), "preset": preset, "layers": L, "kv_format": kv_format, "next_n": next_n,
        "backend": "torch" if torch_ops else "triton", "decode_attention_kernel": _decode_kernel(torch_ops),
        "prompt_lens": list(lens.values()),
        "stages_s": {n: round(t, 4) for n, t in stages.items()}, "tokens_per_s": tokens / total_s,
        "kv_bytes_per_token": kv_bytes, "kpool": cfg.index_kpool, "indexer_bytes_per_token": index_bytes,
        "memory_estimate_gb": {n: round(b / GB, 3) for n, b in est.items()},
        "memory_available_gb": None if avail is None else round(avail / GB, 3),
        "dense_equivalence_max_abs": None if dense is None else dense.rel_max_abs,
        "chunked_vs_oneshot_max_abs": chunk.rel_max_abs, "verify_vs_decode_max_abs": verify.rel_max_abs,
        "dense_equivalence_rel_rms": None if dense is None else dense.rel_rms,
        "chunked_vs_oneshot_rel_rms": chunk.rel_rms, "verify_vs_decode_rel_rms": verify.rel_rms,
        "dense_fallback_ran": dense_ran,
        "skip_layers": cfg.skip_topk_layers, "skip_layers_reuse_exact": skip_ok,
        "not_applicable": not_applicable, "tolerance_rel_rms": tol,
        **_offload_report(off_cfg, kv_mem, swap, offload_diff, L, len(lens)),
    }
    for name, t in stages.items():
        log(f"[demo] {name:<8} {t * 1e3:10.1f} ms")
    log(f"[demo] {tokens} tokens in {total_s:.3f} s: {report['tokens_per_s']:.1f} tokens/s (after the warm-up)")
    log(f"[demo] KV bytes/token (all layers): MLA fp8 {kv_bytes['fp8']} | bf16 {kv_bytes['bf16']} | raw "
        f"{kv_bytes['fp8_raw']} | indexer {kv_bytes['index']:g} | this pool {kv_bytes['total']:.0f}")
    skip_text = ("n/a (no skip-top-k layers)" if skip_ok is None
                 else f"{'exact' if skip_ok else 'BROKEN'} (layers {cfg.skip_topk_layers})")
    log(f"[demo] checks, relative RMS (tolerance {tol:.3g}) | max |diff| / scale: dense equivalence "
        f"{_fmt_check(dense, dense_na)}, chunked vs one-shot {_fmt_check(chunk)}, verify vs decode "
        f"{_fmt_check(verify)}, skip layers reuse {skip_text}")
    if dense_ran is False:
        log("[demo] the dense fallback did not run where every context fits top-k")
    if off_cfg:
        r = report
        log(f"[demo] offload: device KV {r['device_kv_bytes'] / 2**20:.2f} MiB (indexer caches, "
            f"{off_cfg.max_requests} buffers x {off_cfg.device_buffer} rows per layer, resident map), host KV "
            f"{r['host_kv_bytes'] / 2**20:.2f} MiB; all on the device {r['on_device_kv_bytes'] / 2**20:.2f} MiB")
        same = "bitwise the same" if r["max_abs_vs_on_device"] == 0 else "DIFFERENT"
        log(f"[demo] offload: swap-in {r['swap_in_tokens_per_step']:.1f} tokens per decode step "
            f"({r['swap_in_tokens_per_layer_request']:.1f} per layer and request), max |offload - on device| "
            f"{r['max_abs_vs_on_device']:.3g} ({same})")
    log(f"[demo] {'ok' if ok else 'FAILED'}")
    return report
