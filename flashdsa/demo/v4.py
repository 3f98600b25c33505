"""``flashdsa demo --preset v4-flash`` (or ``v4-tiny``): DeepSeek-V4's three attention layer types served by
flashdsa's V4 step and checked against transformers' own layers (issue #43).

Why through transformers: flashdsa's V4 step (:class:`~flashdsa.v4.layer.V4LayerStep`) adopts an HF
``DeepseekV4Attention`` — its weights, norms and rotary tables stay HF's — so the demo builds a default-initialised
``DeepseekV4ForCausalLM`` with one sliding, one CSA and one HCA layer at the preset's attention shapes (its
vocabulary and MoE shrunk: they are not what is served here) and needs transformers >= 5.23.

The scenario: ``batch`` requests of a ``prompt``-token prompt, prefilled in chunks of ``chunk`` tokens, then
``decode_steps`` decode tokens. HF's model runs it with its own cache; every attention layer's inputs are kept,
and flashdsa's step replays each layer on exactly those inputs, its state carried between calls:

* ``exact`` (the fp32 model): HF's selection and rows, flashdsa's attention — each output within 1e-5 of HF's
  maximum (fp32 rounding of sums of a few hundred terms a few ops deep is ~1e-6; a pick other than HF's moves
  a row by about one key's softmax weight, ~1 / (window + topk) ~ 1e-3: the bound separates the two).
* ``fp8`` (a bf16 copy): fp8 MLA rows and the e4m3 indexer — against HF's bf16 layer, printed as cosine
  distance and relative error, checked only to be finite: e4m3 rows alone put the window-only and HCA layers
  ~4-5 % from HF's (3 mantissa bits), and the CSA layer's picks differ from HF's near the top-k boundary, which
  on v4-tiny's top-4 of ~17 entries moves a row by a quarter of its weight (~30 %). The fp8 ops' own bounds are
  tested against references on the dequantised inputs (tests/ops, tests/v4).

Times (the device synchronised around each call; both sides run the scenario twice and the second run is
timed and checked, so no kernel compiles in it): HF's attention module and flashdsa's step, the prefill's chunks
summed and the decode steps' median, and on CUDA one decode step replayed from a CUDA graph
(``decode(capturable=True)``). The state's buffers are reported beside :meth:`V4Config.cache_bytes_per_token`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from typing import Callable

import torch

from flashdsa.cache.layouts import INDEX_DIM
from flashdsa.demo.scenario import parse_device
from flashdsa.testing.compare import cos_diff
from flashdsa.v4.config import CSA, HCA, LAYER_TYPES, V4Config

V4_PRESETS = ("v4-flash", "v4-tiny")
EXACT_TOL = 1e-5   # max |ours - HF| / max |HF| of a layer's output, exact mode (module docstring)
# (prompt, chunk, decode steps) by preset: v4-flash's prompt puts 1024 entries before the CSA layer's top-512
_SCENARIO = {"v4-flash": (4096, 1024, 8), "v4-tiny": (70, 32, 8)}


def _hf_model(cfg: V4Config, seed: int, device: torch.device):
    """A default-initialised fp32 ``DeepseekV4ForCausalLM``: one layer of each type at ``cfg``'s attention
    shapes, a small vocabulary and MoE."""
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is None or not hasattr(transformers, "DeepseekV4Config"):
        have = getattr(transformers, "__version__", "not installed")
        raise ValueError(f"preset: the V4 demo builds transformers' deepseek_v4 layers and needs transformers "
                         f">= 5.23 (installed: {have})")
    hf_cfg = transformers.DeepseekV4Config(
        vocab_size=256, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim, qk_rope_head_dim=cfg.rope_head_dim, q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.sliding_window,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        compress_rates={CSA: cfg.csa_rate, HCA: cfg.hca_rate}, num_hidden_layers=3,
        layer_types=list(LAYER_TYPES), mlp_layer_types=["moe"] * 3, n_routed_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=64, hc_mult=2, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, pad_token_id=0, eos_token_id=None)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.DeepseekV4ForCausalLM(hf_cfg).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_run(model, chunks: list[torch.Tensor], device: torch.device) -> list[list[tuple[dict, torch.Tensor, float]]]:
    """HF's model over ``chunks`` with its cache: for each chunk, each attention layer's (inputs, output,
    seconds of the attention module)."""
    calls: list[list] = []
    started: dict[int, float] = {}

    def pre(module, args, kwargs):
        _sync(device)
        started[id(module)] = time.perf_counter()

    def post(module, args, kwargs, out):
        _sync(device)
        took = time.perf_counter() - started.pop(id(module))
        calls[-1].append((dict(kwargs, hidden_states=args[0] if args else kwargs["hidden_states"]), out[0], took))
    attns = [layer.self_attn for layer in model.model.layers]
    handles = [a.register_forward_pre_hook(pre, with_kwargs=True) for a in attns]
    handles += [a.register_forward_hook(post, with_kwargs=True) for a in attns]
    cache = None
    try:
        with torch.no_grad():
            for ids in chunks:
                calls.append([])
                cache = model(ids, past_key_values=cache, use_cache=True).past_key_values
    finally:
        for h in handles:
            h.remove()
    return calls


def _state_bytes(state) -> int:
    parts = [state.rows, state.index_keys, *(state.comp or ()), *(state.index_comp or ())]
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _replay_us(step, state, inputs: dict, device: torch.device) -> float | None:
    """One decode step of ``step`` at the state's position replayed from a CUDA graph, median µs (None off
    CUDA). The capturable step rewrites the same slots at the same position, so repeats leave the state as the
    first call does."""
    if device.type != "cuda":
        return None
    from flashdsa.testing.timing import time_us
    cos, sin = (t[0] for t in inputs["position_embeddings"][step.attn.rope_layer_type])
    state = step.reserve(copy.deepcopy(state), state.length + 1)
    h, pos = inputs["hidden_states"], inputs["position_ids"][0]
    return time_us(lambda: step.decode(h, pos, cos, sin, state, capturable=True))


def _replay(step, state, hf_calls, i: int, device) -> tuple:
    """Layer ``i``'s HF calls through ``step`` from ``state``: the final state and, per call, the errors against
    HF's output (max, relative norm, cosine distance) and the seconds of ours and HF's by phase."""
    errs, rels, coss = [], [], []
    ours_s, hf_s = {"prefill": [], "decode": []}, {"prefill": [], "decode": []}
    for calls in hf_calls:
        inputs, want, took = calls[i]
        cos, sin = (t[0] for t in inputs["position_embeddings"][step.attn.rope_layer_type])
        phase = "decode" if want.shape[1] == 1 else "prefill"
        _sync(device)
        t = time.perf_counter()
        got, state = step(inputs["hidden_states"], inputs["position_ids"][0], cos, sin, state)
        _sync(device)
        ours_s[phase].append(time.perf_counter() - t)
        hf_s[phase].append(took)
        errs.append(float((got.double() - want.double()).abs().max() / want.double().abs().max()))
        rels.append(float((got.double() - want.double()).norm() / want.double().norm()))
        coss.append(cos_diff(got, want))
    return state, errs, rels, coss, ours_s, hf_s


def _serve(model, precision: str, chunks, backend: str | None, device: torch.device, log) -> dict[str, dict]:
    """flashdsa's step on every layer's HF inputs over the chunks: errors and times per layer type."""
    from flashdsa.v4.layer import V4LayerStep
    _hf_run(model, chunks, device)  # warm-up: HF's timed run is its second too
    hf_calls = _hf_run(model, chunks, device)
    dtype = next(model.parameters()).dtype
    out = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        step = V4LayerStep(attn, backend, precision)
        for _ in range(2):  # the first pass compiles the kernels: the second is timed and checked
            state, errs, rels, coss, ours_s, hf_s = _replay(step, step.empty_state(chunks[0].shape[0], dtype, device),
                                                            hf_calls, i, device)
        last_decode = hf_calls[-1][i][0]
        row = {"layer": attn.layer_type, "precision": precision, "max_err": max(errs), "max_rel": max(rels),
               "max_cos_diff": max(coss),
               "hf_prefill_ms": 1e3 * sum(hf_s["prefill"]), "ours_prefill_ms": 1e3 * sum(ours_s["prefill"]),
               "hf_decode_us": 1e6 * statistics.median(hf_s["decode"]),
               "ours_decode_us": 1e6 * statistics.median(ours_s["decode"]),
               "ours_graph_decode_us": _replay_us(step, state, last_decode, device),
               "state_bytes_per_request": _state_bytes(state) // state.batch, "tokens": state.length}
        row["ok"] = row["max_err"] <= EXACT_TOL if precision == "exact" else all(map(math.isfinite, errs))
        log(f"[demo] {precision:5s} {attn.layer_type:28s} max_err {row['max_err']:.2e} rel {row['max_rel']:.2e} "
            f"cos_diff {row['max_cos_diff']:.1e}  prefill: HF {row['hf_prefill_ms']:.1f} ms, flashdsa "
            f"{row['ours_prefill_ms']:.1f} ms; decode: HF {row['hf_decode_us']:.0f} us, flashdsa "
            f"{row['ours_decode_us']:.0f} us" + (f" (graph {row['ours_graph_decode_us']:.0f} us)"
                                                if row["ours_graph_decode_us"] is not None else "")
            + ("" if row["ok"] else "  FAILED"))
        out[attn.layer_type] = row
    return out


def run_v4_demo(preset: str = "v4-tiny", device: str = "cpu", seed: int = 0, backend: str | None = None,
                batch: int = 2, prompt: int | None = None, log: Callable[[str], None] | None = print) -> dict:
    """Serve the scenario (module docstring) on ``preset``'s attention shapes and check it; returns the report.

    ``prompt``: tokens a request's prompt (None: the preset's, 4096 for v4-flash, 70 for v4-tiny).
    ValueError naming the argument for a bad one, and for a missing transformers."""
    log = log or (lambda *_: None)
    if preset not in V4_PRESETS:
        raise ValueError(f"preset: expected one of {list(V4_PRESETS)}, got {preset!r}")
    dev = parse_device(device)
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"backend: expected None, 'torch' or 'triton', got {backend!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: expected a positive integer, got {batch!r}")
    cfg = V4Config.preset(preset)
    if cfg.index_head_dim != INDEX_DIM:  # fp8 mode keeps indexer keys on flashdsa's 128-dim pages (the releases')
        cfg = dataclasses.replace(cfg, index_head_dim=INDEX_DIM)
    length, chunk, steps = _SCENARIO[preset]
    if prompt is not None:
        if isinstance(prompt, bool) or not isinstance(prompt, int) or not 2 <= prompt:
            raise ValueError(f"prompt: expected an integer >= 2 (a prefill then decode), got {prompt!r}")
        length = prompt
    if length + steps > cfg.max_position_embeddings:
        raise ValueError(f"prompt: {length} tokens and {steps} decode steps exceed the preset's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    model = _hf_model(cfg, seed, dev)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (batch, length + steps), generator=g).to(dev)
    cuts = list(range(0, length, chunk)) + list(range(length, length + steps))
    chunks = [ids[:, a:b] for a, b in zip(cuts, cuts[1:] + [length + steps])]
    log(f"[demo] {preset}: sliding / CSA / HCA layers ({cfg.num_attention_heads} heads, head_dim {cfg.head_dim}, "
        f"window {cfg.sliding_window}, CSA rate {cfg.csa_rate} top-{cfg.index_topk}, HCA rate {cfg.hca_rate}) on "
        f"{dev}; {batch} requests x {length} prompt tokens in chunks of {chunk}, {steps} decode steps")
    t0 = time.perf_counter()
    rows = list(_serve(model, "exact", chunks, backend, dev, log).values())
    rows += list(_serve(model.to(torch.bfloat16), "fp8", chunks, backend, dev, log).values())
    report = {"preset": preset, "device": str(dev), "backend": backend or ("triton" if dev.type == "cuda" else "torch"),
              "batch": batch, "prompt": length, "chunk": chunk, "decode_steps": steps, "layers": rows,
              "plan_cache_bytes_per_token_bf16": cfg.cache_bytes_per_token(),
              "seconds": time.perf_counter() - t0, "ok": all(r["ok"] for r in rows)}
    log(f"[demo] {'ok' if report['ok'] else 'FAILED'}: exact within {EXACT_TOL:g} of HF's layers, fp8 finite "
        f"({report['seconds']:.1f} s)")
    return report
