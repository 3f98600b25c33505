"""generate() tokens/s of a small random HF DeepSeek-V3.2 (or GLM-5.3-Flash) model: HF eager vs patched by
flashdsa.hf, same run.

    PYTHONPATH=. python benchmarks/bench_hf.py [--quick] [--lens 4096,16384] [--batches 1,8] [--new 32] [--smoke]
    PYTHONPATH=. python benchmarks/bench_hf.py --arch glm5-next ...
    PYTHONPATH=. python benchmarks/bench_hf.py --arch v4 ...

``--arch v4``: ``DeepseekV4ForCausalLM``, bf16, 4 layers (sliding, CSA, HCA, CSA), hidden 1024, 16 heads, the
released attention dims (one K = V head of 512 with 64 RoPE dims, window 128, CSA rate 4 with 16 indexer heads of
128 and top-512, HCA rate 128, sinks), small MoE MLPs (transformers' default experts implementation), hyper-
connections as the model has them. Rows ``hf-eager``, ``fd-exact``, ``fd-fp8`` (decode from CUDA graphs, the
whole decoder's step: flashdsa/hf/v4.py), ``fd-fp8-eager``. Its check: the fp32 copy's
prompt logits, exact mode vs HF (a prompt of ``--check-len`` tokens: selection happens past 2K), and the same
greedy tokens.

``--arch glm5-next``: ``Glm5NextForConditionalGeneration``, bf16, 4 layers (KDA linear attention, DSA, KDA,
DSA: the released model's pattern is 3 KDA to 1 DSA), hidden 1024, 16 heads, the released DSA layer's dims
(NoPE: kv_lora 512, nope 256, v 256; 32 indexer heads of 128, index_topk 2048, kpool 16), dense MLPs,
hyper-connections as the model has them. Its KDA layers are HF's in every row (transformers' torch fallback
where flash-linear-attention is not installed), so the ratio is of the whole model.

The model: ``DeepseekV32ForCausalLM`` from transformers with its default initialisation (nothing re-scaled),
bf16, 4 layers, hidden 1024, 16 heads, the real MLA / indexer dims (kv_lora 512, rope 64, nope 128, v 128,
index head dim 128, index_topk 2048), 16 indexer heads (HF's eager indexer materialises [B, S, heads, T]
fp32 scores: 64 heads at 16K would need 64 GiB), dense MLPs. Greedy, ``--new`` new tokens.

Cases (default, ~4 minutes on an H200): batch 1 at 4K and 16K prompts, batch 8 at 4K (at 16K HF eager's
indexer scores alone would take 128 GiB: flashdsa rows only, with ``--batches 1,8 --lens 16384``).
Rows: ``hf-eager`` (the unpatched model, ``attn_implementation="eager"``, its DynamicCache),
``fd-fp8`` (``flashdsa.hf.apply(model, indexer="fp8")``: bf16 MLA cache, decode from CUDA graphs),
``fd-fp8-eager`` (the same, ``cuda_graphs=False``: what the graphs buy), ``fd-exact`` (``indexer="exact"``,
graphs). Per row: prefill = time of ``generate(max_new_tokens=1)``; decode tokens/s = ``B (new - 1) /
(t(new) - t(1))`` (every row's tokens); gen tokens/s = ``B new / t(new)`` (prefill included, what a user
sees); peak GiB = ``torch.cuda.max_memory_allocated`` over the row's runs (graph pools included). Best of
3 after a warm-up at the same shapes (Triton compiles, graphs are captured); value checks of the ops are
off while timing (production setting). A short table comes last: decode_x = decode tokens/s / HF eager's.

Checked first, against HF's own answers:
* fp32 copy of the model, ``indexer="exact"`` (kv_format auto -> the fp32 cache, fp32 kernels), on a prompt
  of ``index_topk - 8`` tokens (every row selects all its tokens, prompt and 8 greedy ones): logits within
  1e-4 of their maximum and the same 8 greedy tokens as HF fp32 — the exact path is exact. Then on a 3K
  prompt (sparse: > index_topk), printed, not bounded: the indexer scores agree with HF's to fp32 rounding
  (another summation order), so a near-tie at the top-k boundary may pick the other token; each such flip
  moves its row by about one token's attention weight (~1/2048), so ~1e-3 there is expected, not a bug;
* the bf16 model: how far flashdsa exact is from HF's fp32 logits, in units of HF's own bf16 run's distance
  (printed; tests/test_hf.py bounds it by 1.5x on its models); fp8 close to exact, not equal.
``--smoke`` runs the whole script on a tiny model on CPU to check the script itself; its times mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time

import torch

from _common import print_table, write_json

import flashdsa.hf as fh
from flashdsa import ops
from flashdsa.v4.layer import V4LayerStep
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=16, index_head_dim=128,
             index_topk=2048, first_k_dense_replace=4, max_position_embeddings=32768)
SMOKE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
             v_head_dim=32, index_n_heads=8, index_head_dim=128, index_topk=16, first_k_dense_replace=3,
             max_position_embeddings=1024)
GLM5_NEXT = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                 num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=8,
                 num_experts_per_tok=2, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256,
                 index_n_heads=32, index_head_dim=128, index_topk=2048, index_kpool=16,
                 layer_types=["linear_attention", "indexed_attention"] * 2, mlp_layer_types=["dense"] * 4,
                 linear_head_dim=128, linear_num_heads=8, max_position_embeddings=65536)
GLM5_NEXT_SMOKE = dict(GLM5_NEXT, vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=4, q_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32, index_n_heads=4,
                       index_topk=16, index_kpool=4, linear_head_dim=32, linear_num_heads=2,
                       max_position_embeddings=1024)
V4 = dict(vocab_size=32000, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=16,
          head_dim=512, qk_rope_head_dim=64, q_lora_rank=384, o_groups=4, o_lora_rank=256, sliding_window=128,
          index_n_heads=16, index_head_dim=128, index_topk=512, n_routed_experts=8, num_experts_per_tok=2,
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "compressed_sparse_attention"], mlp_layer_types=["moe"] * 4, max_position_embeddings=65536)
V4_SMOKE = dict(V4, vocab_size=256, hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
                q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=8, index_n_heads=4, index_topk=4,
                moe_intermediate_size=64, compress_rates={"compressed_sparse_attention": 4,
                                                          "heavily_compressed_attention": 8},
                max_position_embeddings=1024)
V4_IMPLS = ("hf-eager", "fd-exact", "fd-fp8", "fd-fp8-eager")
IMPLS = {  # name -> flashdsa.hf.apply keywords (None: HF eager, unpatched)
    "hf-eager": None,
    "fd-fp8": dict(indexer="fp8"),
    "fd-fp8-eager": dict(indexer="fp8", cuda_graphs=False),
    "fd-exact": dict(indexer="exact"),
}
HF_EAGER_MAX_SCORES = 64 << 30  # skip HF eager where its [B, S, heads, T] fp32 indexer scores exceed this


def build(cfg: dict, device: str, dtype: torch.dtype, arch: str = "v32"):
    torch.manual_seed(0)
    with torch.device(device):
        if arch == "glm5-next":
            from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
            config = Glm5NextConfig(text_config=dict(cfg, pad_token_id=0, eos_token_id=None))
            config.text_config._attn_implementation = "eager"
            model = Glm5NextForConditionalGeneration(config)
        elif arch == "v4":
            from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
            model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg, pad_token_id=0, eos_token_id=None))
        else:
            model = DeepseekV32ForCausalLM(DeepseekV32Config(**cfg, pad_token_id=0, eos_token_id=None))
    model.config._attn_implementation = "eager"
    return model.to(dtype).eval()


def text_config(model):
    return getattr(model.config, "text_config", model.config)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def generate(model, ids, new: int, **kw):
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)


def timed(model, ids, new: int, device: str) -> float:
    sync(device)
    t = time.perf_counter()
    generate(model, ids, new)
    sync(device)
    return time.perf_counter() - t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def fp32_vs_hf(model, ids, new: int, max_tokens: int) -> tuple[float, int, str, torch.Tensor]:
    """fp32 copy of ``model``: (max|flashdsa exact - HF| / max|HF| of the prompt's logits, greedy tokens equal
    of ``new``, the patched cache's kv_format, HF fp32's logits)."""
    with torch.no_grad():
        m32 = copy.deepcopy(model).float()
        ref = m32(ids).logits.float()
        tokens = generate(m32, ids, new)
        fh.apply(m32, indexer="exact", max_tokens=max_tokens)
        ours = m32(ids).logits.float()
        our_tokens = generate(m32, ids, new)
        fmt = fh.get_patch(m32).runner.pool.kv_format
    del m32
    gc.collect()
    p = ids.shape[1]
    err = float((ours - ref).abs().max() / ref.abs().max())
    return err, int((our_tokens[0, p:] == tokens[0, p:]).sum()), fmt, ref


def check(model, vocab: int, prompt: int, device: str, max_tokens: int, new: int = 8) -> None:
    """The numerics against HF before any timing (module docstring); raises if they are off."""
    ids = torch.randint(1, vocab, (1, prompt), device=device, generator=torch.Generator(device).manual_seed(1))
    dense = text_config(model).index_topk - new
    err32, same32, fmt32, _ = fp32_vs_hf(model, ids[:, :dense], new, max_tokens)
    print(f"[check] prompt {dense} (<= index_topk: nothing to select), fp32 model ({fmt32} cache): exact vs HF "
          f"max|diff| / max|HF| {err32:.2e} (bound 1e-4), greedy tokens equal {same32}/{new}")
    # what holds by construction is asserted; the rest are statistics (asserted on the tests' models)
    assert fmt32 == "fp32" and err32 < 1e-4 and same32 == new, "the fp32 exact path is not HF's fp32"
    err32s, same32s, _, ref32 = fp32_vs_hf(model, ids, new, max_tokens)
    print(f"[check] prompt {prompt} (sparse), fp32 model: exact vs HF max|diff| / max|HF| {err32s:.2e} (near-ties "
          f"at the top-k boundary may flip: not bounded), greedy tokens equal {same32s}/{new}")
    with torch.no_grad():
        ref16 = model(ids).logits.float()
        fh.apply(model, indexer="exact", max_tokens=max_tokens)
        exact16 = model(ids).logits.float()
        fh.apply(model, indexer="fp8", max_tokens=max_tokens)
        fp8 = model(ids).logits.float()
        fh.unapply(model)
    ratio = rel(exact16, ref32) / rel(ref16, ref32)
    print(f"[check] bf16 model vs HF fp32: flashdsa exact rel {rel(exact16, ref32):.2e}, HF bf16 rel "
          f"{rel(ref16, ref32):.2e}: {ratio:.2f}x HF's own bf16 spread ({'within' if ratio <= 1.5 else 'OUTSIDE'} "
          f"the tests' 1.5x); exact vs HF bf16 rel {rel(exact16, ref16):.2e}; fp8 vs exact rel "
          f"{rel(fp8, exact16):.2e}")
    assert not torch.equal(fp8, exact16), "fp8 mode should differ from exact"


def v4_layer_errors(model, ids) -> list[dict]:
    """Every attention layer of the fp32 V4 ``model`` on prompt ``ids [1, P]``: HF's output against
    ``V4LayerStep``'s on the very inputs HF's layer got (teacher-forced), with the default backend and with
    ``backend="torch"``; max |diff| / max |HF| over the prompt and the position where it peaks. Here the
    selection sees HF's own inputs, so exact mode picks HF's entries and the rest differs in summation order
    only: ~1e-6 (fp32 rounding of sums of a few hundred terms, a few ops deep); a pick that differs from HF's
    moves a row by about one key's softmax weight (~1 / (window + topk), ~1e-3)."""
    seen = []

    def hook(module, args, kwargs, out):
        seen.append((module, dict(kwargs, hidden_states=args[0] if args else kwargs["hidden_states"]), out[0]))
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in handles:
        h.remove()
    rows = []
    for i, (attn, inputs, want) in enumerate(seen):
        cos, sin = (t[0] for t in inputs["position_embeddings"][attn.rope_layer_type])
        for backend in (None, "torch"):
            step = V4LayerStep(attn, backend)
            got, _ = step(inputs["hidden_states"], inputs["position_ids"][0], cos, sin,
                          step.empty_state(1, torch.float32, ids.device))
            err = (got - want).abs().amax(-1)[0] / want.abs().max()
            rows.append({"layer": i, "type": attn.layer_type, "backend": backend or "default",
                         "max_err": float(err.max()), "at": int(err.argmax()), "mean_err": float(err.mean())})
    return rows


def check_v4(model, vocab: int, prompt: int, device: str, new: int = 8) -> None:
    """V4's numerics against HF before any timing, on the fp32 copy in exact mode and the bf16 model.

    Asserted (what holds by construction): a prompt short enough that no CSA layer drops an entry (``rate x
    topk - new`` tokens) gives HF's logits within 1e-4 of their maximum (v32's bound) and its greedy tokens; at
    ``prompt`` tokens, where the indexer selects, every attention layer fed HF's inputs is HF's within 1e-5
    (:func:`v4_layer_errors`: the same picks). Printed, not bounded: the whole model at ``prompt`` tokens. Its
    layers see hidden states that differ from HF's by rounding, so a near-tie at the top-k boundary can pick
    another entry (~1e-3 from there on, 1.7e-3 at 3072 tokens on CPU and 2.2e-3 on an H100, 2026-12-07); HF's
    own fp32 run is printed beside it against an fp64 run. fp8 mode's argmax agreement with exact mode is
    printed beside HF bf16's with HF fp32 (on this model's near-flat random logits both are low)."""
    g = torch.Generator(device).manual_seed(1)
    ids = torch.randint(1, vocab, (1, prompt), device=device, generator=g)
    tc = text_config(model)
    dense = tc.compress_rates["compressed_sparse_attention"] * tc.index_topk - new
    with torch.no_grad():
        m32 = copy.deepcopy(model).float()
        short = ids[:, :dense]
        ref_d, tokens_d = m32(short).logits, generate(m32, short, new)
        ref, tokens = m32(ids).logits, generate(m32, ids, new)
        layers = v4_layer_errors(m32, ids)
        fh.apply(m32, indexer="exact")
        ours_d, our_tokens_d = m32(short).logits, generate(m32, short, new)
        ours, our_tokens = m32(ids).logits, generate(m32, ids, new)
        fh.unapply(m32)
        m32.config._experts_implementation = "eager"  # grouped_mm has no fp64
        ref64 = m32.double()(ids).logits
        del m32
        gc.collect()
        ref16 = model(ids).logits
        fh.apply(model, indexer="exact")
        exact16 = model(ids).logits
        fh.apply(model, indexer="fp8")
        fp8 = model(ids).logits
        fh.unapply(model)

    def err(a, b):
        return float((a.double() - b.double()).abs().max() / b.double().abs().max())

    def agree(a, b):
        return float((a.argmax(-1) == b.argmax(-1)).float().mean())

    def same(a, b, p):
        return int((a[0, p:] == b[0, p:]).sum())
    e_dense, s_dense = err(ours_d, ref_d), same(our_tokens_d, tokens_d, dense)
    worst = max((r for r in layers if r["backend"] == "default"), key=lambda r: r["max_err"])
    print(f"[check] prompt {dense} (no CSA layer drops an entry), fp32 model: exact vs HF max|diff| / max|HF| "
          f"{e_dense:.2e} (bound 1e-4), greedy tokens equal {s_dense}/{new}")
    print(f"[check] prompt {prompt}, each attention layer on HF's inputs: worst {worst['max_err']:.2e} (layer "
          f"{worst['layer']} {worst['type']}, bound 1e-5)")
    print(f"[check] prompt {prompt}, whole fp32 model (near-ties may flip: not bounded): exact vs HF "
          f"{err(ours, ref):.2e}, vs HF fp64 {err(ours, ref64):.2e} (HF fp32 vs HF fp64 {err(ref, ref64):.2e}), "
          f"greedy tokens equal {same(our_tokens, tokens, prompt)}/{new}")
    print(f"[check] bf16 model, prompt {prompt}: fp8 vs exact argmax agreement {agree(fp8, exact16):.3f}; exact vs "
          f"HF bf16 {agree(exact16, ref16):.3f}; HF bf16 vs HF fp32 {agree(ref16, ref):.3f}")
    assert e_dense < 1e-4 and s_dense == new, "the V4 exact path is not HF's where nothing is selected"
    assert worst["max_err"] < 1e-5, "a V4 layer is not HF's on HF's inputs"


def profile(model, ids, device: str, max_tokens: int, path: str | None) -> None:
    """Host-side cost of patched decode steps: torch.profiler over generate() of 8 tokens on a short prompt."""
    from torch.profiler import ProfilerActivity, profile as prof
    fh.apply(model, indexer="fp8", max_tokens=max_tokens)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.no_grad():
        generate(model, ids, 8)
        with prof(activities=acts) as p:
            generate(model, ids, 8)
    fh.unapply(model)
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    if path:
        with open(path, "w") as f:
            f.write(table)
    print("\n".join(table.splitlines()[:18]))


def _entry_rate(tc) -> int:
    # V4's indexer scores compressed entries (one per CSA rate tokens), DSA's every token
    return getattr(tc, "compress_rates", {}).get("compressed_sparse_attention", 1)


def run(model, impl: str, ids, new: int, device: str, max_tokens: int) -> dict:
    B, L = ids.shape
    row = {"prompt": L, "batch": B, "impl": impl}
    kw = IMPLS[impl]
    tc = text_config(model)
    scores = B * L * L * tc.index_n_heads * 4 // getattr(tc, "index_kpool", 1) // _entry_rate(tc)
    if kw is None and scores > HF_EAGER_MAX_SCORES and device == "cuda":
        row["prefill_ms"] = "skipped (HF's indexer scores > 64 GiB)"
        return row
    patch = fh.apply(model, max_tokens=max_tokens, **kw) if kw is not None else None
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        with torch.no_grad():
            # warm-up at the timed shapes: Triton compiles the variants they pick, graphs are captured
            generate(model, ids, new)
            t1s = [timed(model, ids, 1, device) for _ in range(3)]
            tns = [timed(model, ids, new, device) for _ in range(3)]
        t1, tn = min(t1s), min(tns)
        row["runs_ms"] = {"1": [round(1e3 * t) for t in t1s], str(new): [round(1e3 * t) for t in tns]}
        # decode rate from the difference of two generate() times; "noise" when timing noise exceeds it
        row.update(prefill_ms=1e3 * t1, decode_tok_s=B * (new - 1) / (tn - t1) if tn > t1 else "noise",
                   gen_tok_s=B * new / tn)
        if device == "cuda":
            row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        if patch is not None:
            failure = getattr(patch, "graph_failure", None)
            row["graphs"] = sorted(patch.graphs) if failure is None else f"failed: {failure}"
    except torch.OutOfMemoryError:
        row["prefill_ms"] = "OOM"
    finally:
        if fh.get_patch(model) is not None:
            fh.unapply(model)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch 1 at 4K only, 16 new tokens")
    ap.add_argument("--lens", default="4096,16384")
    ap.add_argument("--batches", default="1,8", help="batch sizes; batch > 1 runs at the shortest length only "
                    "unless --lens names one length")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--impls", default=None, help=f"of {list(IMPLS)} (default all; --arch v4: {list(V4_IMPLS)})")
    ap.add_argument("--no-check", action="store_true", help="skip the numerics check against HF")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's host-side table of "
                    "patched decode steps")
    ap.add_argument("--arch", default="v32", choices=["v32", "glm5-next", "v4"])
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, times mean nothing")
    args = ap.parse_args()
    impls = args.impls.split(",") if args.impls else list(V4_IMPLS if args.arch == "v4" else IMPLS)
    unknown = set(impls) - set(IMPLS)
    if unknown:
        sys.exit(f"bench_hf: unknown --impls {sorted(unknown)}; choose from {list(IMPLS)}")
    if args.smoke:
        device, dtype, lens, batches, new, check_len = "cpu", torch.bfloat16, [48], [1, 2], 4, 40
        cfg = {"glm5-next": GLM5_NEXT_SMOKE, "v4": V4_SMOKE}.get(args.arch, SMOKE)
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_hf: needs a CUDA device (or --smoke)")
        device, dtype = "cuda", torch.bfloat16
        cfg = {"glm5-next": GLM5_NEXT, "v4": V4}.get(args.arch, MODEL)
        lens = [4096] if args.quick else [int(x) for x in args.lens.split(",")]
        batches = [1] if args.quick else [int(x) for x in args.batches.split(",")]
        new, check_len = (16 if args.quick else args.new), 3072
    cases = [(L, 1) for L in lens if 1 in batches] + [(min(lens), b) for b in batches if b > 1]
    page = 64 * cfg.get("index_kpool", 1)  # every row rounds up to whole pages
    max_tokens = max([b * -(-(L + new + 64) // page) * page for L, b in cases] + [check_len + 64 + 8])
    model = build(cfg, device, dtype, args.arch)
    print(f"model: {type(model).__name__} {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {dtype}, "
          f"{device}, default initialisation; op backends: default (Triton on CUDA where a kernel exists)")
    if not args.no_check and args.arch == "v4":
        check_v4(model, cfg["vocab_size"], check_len, device)
    elif not args.no_check:
        check(model, cfg["vocab_size"], check_len, device, max_tokens)
    ops.set_value_checks(False)
    if args.profile:
        ids = torch.randint(1, cfg["vocab_size"], (1, 512 if device == "cuda" else 40), device=device)
        out = os.environ.get("OUT")
        profile(model, ids, device, max_tokens, os.path.join(out, "hf_profile.txt") if out else None)
    rows = []
    g = torch.Generator(device).manual_seed(2)
    for L, b in cases:
        ids = torch.randint(1, cfg["vocab_size"], (b, L), device=device, generator=g)
        base = None
        for impl in impls:
            t0 = time.perf_counter()
            row = run(model, impl, ids, new, device, max_tokens)
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            if impl == "hf-eager":
                base = row
            elif base is not None and isinstance(row.get("decode_tok_s"), float) and \
                    isinstance(base.get("decode_tok_s"), float):
                row["decode_x"] = row["decode_tok_s"] / base["decode_tok_s"]
                row["gen_x"] = row["gen_tok_s"] / base["gen_tok_s"]
            rows.append(row)
            print(row, flush=True)
    ops.set_value_checks(True)
    write_json(rows, "bench_hf")
    short = [{k: r.get(k, "") for k in ("prompt", "batch", "impl", "prefill_ms", "decode_tok_s", "decode_x",
                                        "gen_tok_s", "gen_x", "peak_GiB")} for r in rows]
    print_table(short, f"generate() of a random bf16 {type(model).__name__}, {new} new tokens, greedy; "
                       "decode_x / gen_x: vs hf-eager at the same prompt and batch")


if __name__ == "__main__":
    main()
