"""The main job: a DSA model served the way an engine serves it, on paged caches, with its checks.

Builds a model with seeded random weights (a preset's real layer shapes, optionally fewer layers) and
a KV pool, prefills a batch whose prompts straddle the dense/sparse threshold (the longest in chunks),
decodes a few steps, runs one MTP verify step, and checks the promises of the engine:

    dense_equivalence_max_abs   sparse path vs dense fallback where every context <= index_topk
    chunked_vs_oneshot_max_abs  the long prompt in chunks vs in one extend (both sparse)
    verify_vs_decode_max_abs    next_n drafts verified at once vs n sequential decodes
    skip_layers_reuse_exact     skip-top-k layers use the previous layer's selection as is
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from flashdsa.cache import layouts
from flashdsa.config import DSAConfig
from flashdsa.engine import DSAModel, Runner

# The checks compare logits of two runs that differ only in how the work was batched. Both sides
# round in bf16, and on a GPU cuBLAS picks other GEMM algorithms for other row counts, so the bits
# differ; random weights then amplify rounding through the layers (and can flip a top-k boundary).
# A real bug (a chunk not seeing its prefix, a draft seeing its future) moves the logits by O(1), so
# ok is judged on the relative RMS error, with the max abs error (relative to the logits' scale)
# reported beside it. The rounding noise grows about linearly with depth (v32 shapes on an H200:
# 0.26-0.40 % RMS after 1 layer, 0.8 % after 2, 1.5-2.0 % after 4), hence a budget per layer.
TOL_RMS_PER_LAYER = 6e-3


def _rel_max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).float().norm() / b.float().norm().clamp_min(1e-30))


def run_demo(preset: str = "tiny", device: str = "cpu", next_n: int = 2, seed: int = 0, backend: str | None = None,
             layers: int | None = None, kv_format: str = "fp8", log: Callable[[str], None] | None = print) -> dict:
    log = log or (lambda *_: None)
    cfg = DSAConfig.preset(preset)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers: expected >= 1, got {layers}")
        keep = dict(num_hidden_layers=layers)
        if cfg.indexer_types is not None:
            keep["indexer_types"] = cfg.indexer_types[:layers]
        if cfg.index_topk_pattern is not None:
            keep["index_topk_pattern"] = cfg.index_topk_pattern[:layers]
        cfg = cfg.replace(**keep)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch sees no CUDA device")
    if next_n < 1:
        raise ValueError(f"next_n: expected >= 1, got {next_n}")
    dev = torch.device(device)
    k = cfg.index_topk
    lens = {"short": k // 2, "at_topk": k, "long": 3 * k + 7}  # straddle the dense/sparse threshold
    prompts = {r: torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed + i))
               for i, (r, n) in enumerate(lens.items())}
    pages = 2 * sum(-(-(n + 8 + next_n) // cfg.page_size) for n in lens.values()) + 8
    stages: dict[str, float] = {}

    def timed(name: str, fn):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        stages[name] = stages.get(name, 0.0) + time.perf_counter() - t0
        return out

    log(f"[demo] {preset}: {cfg.num_hidden_layers} layers ({len(cfg.topk_layers)} with an indexer, skip-top-k "
        f"{cfg.skip_topk_layers}), {cfg.num_attention_heads} heads, topk {k}, on {device}, KV {kv_format}")
    log("[demo] building the model (seeded random weights) ...")
    model = timed("build", lambda: DSAModel.random(cfg, seed=seed, device=dev))
    kv_scale = 1 / 32 if kv_format == "fp8_raw" else None  # the latent stays within ±14 after its RMSNorm

    def runner(**kw) -> Runner:
        return Runner(model, pages, kv_format, backend=backend, kv_scale=kv_scale, **kw)

    long = prompts["long"]
    cuts = [0, k // 2, 2 * k, len(long)]
    steps = 4

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
        for _ in range(steps):
            logits = timed("decode", lambda: run.decode(nxt))
            nxt = {r: int(row.argmax()) for r, row in zip(lens, logits)}
            tokens += len(lens)
        log(f"[demo] decoded {steps} steps x {len(lens)} requests")
        drafts = {r: [(t + j) % cfg.vocab_size for j in range(next_n)] for r, t in nxt.items()}
        timed("verify", lambda: run.verify(drafts))
        log(f"[demo] verified {next_n} drafts x {len(lens)} requests")
        return drafts, tokens + next_n * len(lens)

    if dev.type == "cuda":
        # Triton compiles each kernel on its first call (seconds per kernel on a cold cache): run the
        # scenario once untimed so the stages below measure serving, not compilation.
        log("[demo] warm-up (Triton compiles the kernels) ...")
        timed("warmup", lambda: serve(runner(), lambda _name, fn: fn(), lambda *_: None))
    run = runner(record=True)
    drafts, tokens = serve(run, timed, log)
    skip_ok = all(run.selections[layer] is run.selections[layer - 1] and not run.pool.has_index_cache(layer)
                  for layer in cfg.skip_topk_layers)

    # ---- checks ---------------------------------------------------------------------------------
    log("[demo] checking: verify vs sequential decodes ...")
    ref = runner()
    ref.extend(dict(prompts), force_sparse=True)
    verify_ref = runner()
    verify_ref.extend(dict(prompts), force_sparse=True)
    v = verify_ref.verify(drafts)
    d = torch.stack([ref.decode({r: drafts[r][j] for r in lens}) for j in range(next_n)], dim=1)
    verify_err, verify_rms = _rel_max_abs(v, d), _rel_rms(v, d)

    log("[demo] checking: chunked vs one-shot prefill, sparse vs dense ...")
    one = runner().extend({"long": long}, force_sparse=True)
    chunked = runner()
    parts = [chunked.extend({"long": long[cuts[i]:cuts[i + 1]]}, force_sparse=True) for i in range(3)]
    chunk_err, chunk_rms = _rel_max_abs(torch.cat(parts), one), _rel_rms(torch.cat(parts), one)
    fit = {r: prompts[r] for r in ("short", "at_topk")}
    dense = runner().extend(fit)
    sparse = runner().extend(fit, force_sparse=True)
    dense_err, dense_rms = _rel_max_abs(sparse, dense), _rel_rms(sparse, dense)

    total_s = sum(t for name, t in stages.items() if name not in ("build", "warmup"))
    n_index = len(cfg.topk_layers)
    L = cfg.num_hidden_layers
    kv_bytes = {"bf16": layouts.MLA_BF16_BYTES * L, "fp8": layouts.MLA_FP8_BYTES * L,
                "fp8_raw": layouts.MLA_FP8_RAW_BYTES * L, "index": layouts.INDEX_BYTES_PER_TOKEN * n_index,
                "total": run.pool.bytes_per_token()}
    tol = TOL_RMS_PER_LAYER * cfg.num_hidden_layers
    ok = max(dense_rms, chunk_rms, verify_rms) < tol and skip_ok
    report = {
        "ok": ok, "device": device, "preset": preset, "layers": L, "kv_format": kv_format, "next_n": next_n,
        "backend": backend or ("triton" if dev.type == "cuda" else "torch"), "prompt_lens": list(lens.values()),
        "stages_s": {n: round(t, 4) for n, t in stages.items()}, "tokens_per_s": tokens / total_s,
        "kv_bytes_per_token": kv_bytes, "dense_equivalence_max_abs": dense_err,
        "chunked_vs_oneshot_max_abs": chunk_err, "verify_vs_decode_max_abs": verify_err,
        "dense_equivalence_rel_rms": dense_rms, "chunked_vs_oneshot_rel_rms": chunk_rms,
        "verify_vs_decode_rel_rms": verify_rms,
        "skip_layers": cfg.skip_topk_layers, "skip_layers_reuse_exact": skip_ok,
        "tolerance_rel_rms": tol,
    }
    for name, t in stages.items():
        log(f"[demo] {name:<8} {t * 1e3:10.1f} ms")
    log(f"[demo] {tokens} tokens in {total_s:.3f} s: {report['tokens_per_s']:.1f} tokens/s")
    log(f"[demo] KV bytes/token (all layers): MLA fp8 {kv_bytes['fp8']} | bf16 {kv_bytes['bf16']} | raw "
        f"{kv_bytes['fp8_raw']} | indexer {kv_bytes['index']} | this pool {kv_bytes['total']:.0f}")
    log(f"[demo] checks, relative RMS (tolerance {tol:.3g}) | max |diff| / scale: dense equivalence "
        f"{dense_rms:.2e} | {dense_err:.2e}, chunked vs one-shot {chunk_rms:.2e} | {chunk_err:.2e}, "
        f"verify vs decode {verify_rms:.2e} | {verify_err:.2e}, skip layers reuse "
        f"{'exact' if skip_ok else 'BROKEN'} (layers {cfg.skip_topk_layers})")
    log(f"[demo] {'ok' if ok else 'FAILED'}")
    return report
