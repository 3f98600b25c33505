"""DeepSeek-V4's attention core through flashdsa's sparse MLA ops against transformers' ``deepseek_v4`` itself.

A default-initialised tiny ``DeepseekV4ForCausalLM`` (one layer of each type) runs HF's eager forward; each
attention layer's inputs and output are captured. Ours recomputes the layer from the same inputs with HF's
projections, HF's compressor entries and HF's indexer picks (their kernels are a later step of #43), and
flashdsa's attention core: the window and entry rows laid out in one buffer, index lists built by
``flashdsa.v4``, ``sparse_mla_prefill`` + the sinks as a merge, the output's RoPE undone, HF's output
projection. fp32 model: both sides compute the same sums in another order, so the bound is fp32 rounding
through a few ops (a few ulp of the outputs' scale), not a fitted number.
"""

from __future__ import annotations

import pytest
import torch

from flashdsa import v4
from flashdsa.v4.compressor import CompressState, compress
from flashdsa.v4.indexer import scores_exact, select_exact, select_fp8, visible_entries

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("transformers without deepseek_v4", allow_module_level=True)
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

TYPES = [v4.SLIDING, v4.CSA, v4.HCA]


def tiny_model(seed: int = 0, index_head_dim: int = 16, index_n_heads: int = 2) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                           num_attention_heads=4, head_dim=64, q_lora_rank=32, n_routed_experts=4,
                           num_experts_per_tok=2, o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=index_n_heads,
                           index_head_dim=index_head_dim, index_topk=4, layer_types=TYPES, hc_mult=2,
                           qk_rope_head_dim=16,
                           compress_rates={v4.CSA: 4, v4.HCA: 8}, mlp_layer_types=["moe"] * 3,
                           max_position_embeddings=4096)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(cfg).eval()


def capture(model, ids):
    """Each attention layer's (module, inputs, HF output) of one eager forward without a cache."""
    seen = []

    def hook(module, args, kwargs, output):
        seen.append((module, dict(kwargs, hidden_states=args[0] if args else kwargs["hidden_states"]), output[0]))
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def calls_with_cache(model, chunks):
    """HF's eager forward over ``chunks`` in turn with its cache: for each chunk, each attention layer's (inputs,
    HF output)."""
    out, cache = [], None
    for chunk in chunks:
        seen = []

        def hook(module, args, kwargs, output):
            seen.append((dict(kwargs, hidden_states=args[0] if args else kwargs["hidden_states"]), output[0]))
        handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
        try:
            with torch.no_grad():
                cache = model(chunk, past_key_values=cache, use_cache=True).past_key_values
        finally:
            for h in handles:
                h.remove()
        out.append(seen)
    return out


def ours(attn, inputs, backend):
    """The layer's output from HF's projections / compressor / indexer and flashdsa's attention core."""
    h = inputs["hidden_states"]
    B, S, _ = h.shape
    pos = inputs["position_ids"].expand(B, -1)  # HF passes one row for the batch
    cos, sin = (t.expand(B, -1, -1) for t in inputs["position_embeddings"][attn.rope_layer_type])
    D = attn.head_dim
    q_res = attn.q_a_norm(attn.q_a_proj(h))
    q = attn.q_b_norm(attn.q_b_proj(q_res).view(B, S, -1, D).transpose(1, 2))
    q = hf_v4.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)  # [B, S, H, D]
    kv = attn.kv_norm(attn.kv_proj(h)).view(B, S, 1, D).transpose(1, 2)
    kv = hf_v4.apply_rotary_pos_emb(kv, cos, sin)[:, 0]  # [B, S, D]
    outs = []
    for b in range(B):
        p = pos[b]
        rows, idx = [kv[b]], [v4.window_indices(p, attn.sliding_window)]
        if attn.compressor is not None:
            entries, _ = attn.compressor(h[b:b + 1], q_res[b:b + 1], pos[b:b + 1], None, attn.layer_idx)
            entries = entries[0, 0]  # [E, D]
            rows.append(entries)
            if attn.layer_type == v4.CSA:
                picks = attn.compressor.indexer(h[b:b + 1], q_res[b:b + 1], pos[b:b + 1], None, attn.layer_idx)[0]
                idx.append(torch.where(picks >= 0, picks + S, -1).to(torch.int32))
            else:
                idx.append(v4.causal_entry_indices(p, attn.compressor.compress_rate, entries.shape[0], S))
        out = v4.attend(q[b], torch.cat(rows), torch.cat(idx, dim=1), attn.sinks, attn.scaling,
                        cos[b].float(), sin[b].float(), backend=backend)
        outs.append(out)
    out = torch.stack(outs)  # [B, S, H, D]
    grouped = attn.o_a_proj(out.reshape(B, S, attn.config.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("sinks", ["default", "random"])
def test_attention_core_equals_hf(backend, sinks):
    """Every layer type, prompts of 37 tokens (several windows, entries of both rates, more CSA entries than
    index_topk so the indexer selects), default initialisation; sinks as initialised (0) and random."""
    model = tiny_model()
    if sinks == "random":
        g = torch.Generator().manual_seed(1)
        for layer in model.model.layers:
            layer.self_attn.sinks.data = torch.randn(4, generator=g) * 2
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(2))
    seen = capture(model, ids)
    assert [m.layer_type for m, _, _ in seen] == TYPES
    for attn, inputs, want in seen:
        with torch.no_grad():
            got = ours(attn, inputs, backend)
        scale = want.abs().max()
        assert torch.isfinite(got).all()
        # fp32 throughout: sums in another order, then HF's output projection (~200 terms): a few ulp x size
        assert (got - want).abs().max() <= 64 * torch.finfo(torch.float32).eps * scale, attn.layer_type


def test_index_builders():
    p = torch.tensor([0, 3, 9])
    assert v4.window_indices(p, 4, first_row=10).tolist() == [[-1, -1, -1, 10], [10, 11, 12, 13], [16, 17, 18, 19]]
    # entry w is visible once token (w + 1) * rate - 1 is: rate 4, tokens 3 / 7 close entries 0 / 1
    assert v4.causal_entry_indices(torch.tensor([2, 3, 7, 8]), 4, 3, 100).tolist() == [
        [-1, -1, -1], [100, -1, -1], [100, 101, -1], [100, 101, -1]]


def test_attend_refuses_bad_shapes():
    q = torch.randn(3, 4, 64)
    with pytest.raises(ValueError, match="^kv:"):
        v4.attend(q, torch.randn(5, 32), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(4), 0.1)
    with pytest.raises(ValueError, match="^sinks:"):
        v4.attend(q, torch.randn(5, 64), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3), 0.1)
    with pytest.raises(ValueError, match="^x:"):
        v4.mla_rows(torch.randn(2, 600))




def rope_entries(module, entries, first, dtype):
    """HF's RMSNorm and RoPE of pooled entries ``[B, e, D]``, entry ``first ..`` (what the layer does after
    pooling)."""
    rate = module.compress_rate
    normed = module.kv_norm(entries)
    pos = ((torch.arange(entries.shape[1]) + first) * rate)[None]
    cos, sin = module.rotary_emb(normed, position_ids=pos, layer_type=module.rope_layer_type)
    return hf_v4.apply_rotary_pos_emb(normed.unsqueeze(1), cos, sin).squeeze(1).to(dtype)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressor_state_across_calls_equals_hf(dtype):
    """A prompt, then single-token decode steps, then a 6-token extend, through HF's model with its cache; at
    every call our compressor (the batch's rows in one call, its state carried between calls) gives the entries HF's
    cache holds — CSA's attention and indexer series (overlapping windows) and HCA's — bit for bit: the same
    ops in the same order."""
    model = tiny_model().to(dtype)
    B = 2
    ids = torch.randint(0, 128, (B, 11), generator=torch.Generator().manual_seed(3))
    series = {}  # (layer, name) -> (module, overlap)
    for i, layer in enumerate(model.model.layers):
        comp = layer.self_attn.compressor
        if comp is not None:
            series[(i, "compressor")] = (comp, layer.self_attn.layer_type == v4.CSA)
            if layer.self_attn.layer_type == v4.CSA:
                series[(i, "indexer")] = (comp.indexer, True)
    inputs = {}

    def hook(module, args, kwargs):
        inputs[id(module)] = args[0] if args else kwargs["hidden_states"]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m, _ in series.values()]
    states = {key: None for key in series}
    ours = {key: [] for key in series}
    cache = None
    chunks = [ids] + [torch.randint(0, 128, (B, 1), generator=torch.Generator().manual_seed(10 + s)) for s in range(9)]
    chunks.append(torch.randint(0, 128, (B, 6), generator=torch.Generator().manual_seed(30)))
    try:
        with torch.no_grad():
            for step, chunk in enumerate(chunks):
                out = model(chunk, past_key_values=cache, use_cache=True)  # `cache` from 5.25 on
                cache = out.past_key_values
                for key, (module, overlap) in series.items():
                    i, name = key
                    h = inputs[id(module)]
                    kv, gate = module.kv_proj(h), module.gate_proj(h)
                    want = cache.layers[i].compressed_kv[name]
                    first = states[key].entries if states[key] is not None else 0
                    entries, states[key] = compress(kv, gate, module.position_bias, module.compress_rate, overlap,
                                                    states[key])
                    if entries.shape[1]:
                        ours[key].append(rope_entries(module, entries, first, dtype))
                    got = torch.cat(ours[key], dim=1) if ours[key] else None
                    if want is None or want.shape[1] == 0:
                        assert got is None, (step, i, name)
                    else:
                        assert got is not None and torch.equal(got, want), (step, i, name)
    finally:
        for h in handles:
            h.remove()
    total = 11 + 9 + 6
    assert states[(1, "compressor")].entries == total // 4 and states[(2, "compressor")].entries == total // 8


def test_compress_refuses_bad_shapes_and_keeps_state():
    s0 = CompressState.empty(2, 8, torch.float32)
    kv = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="^kv:"):
        compress(kv[0], kv[0], torch.zeros(4, 8), 4, True)
    with pytest.raises(ValueError, match="^gate:"):
        compress(kv, torch.randn(2, 2, 8), torch.zeros(4, 8), 4, True)
    with pytest.raises(ValueError, match="^position_bias:"):
        compress(kv, kv, torch.zeros(2, 8), 4, True)
    with pytest.raises(ValueError, match="^state:"):
        compress(kv[:1], kv[:1], torch.zeros(4, 8), 4, True, s0)
    e, s1 = compress(kv, kv, torch.zeros(4, 8), 4, True, s0)
    assert e.shape == (2, 0, 4) and s1.pending_kv.shape == (2, 3, 8) and s0.pending_kv.shape == (2, 0, 8)  # s0 kept
    e, s2 = compress(kv, kv, torch.zeros(4, 8), 4, True, s1)
    assert e.shape == (2, 1, 4) and s2.entries == 1 and s2.pending_kv.shape == (2, 2, 8) and s1.entries == 0


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_exact_selection_equals_hf_indexer():
    """select_exact on HF's queries, weights and cached indexer keys picks what HF's DeepseekV4Indexer picks,
    in its order, -1 included: a prompt of 37 tokens (9 entries, top-4), then 6 decode steps."""
    model = tiny_model()
    idx_mod = model.model.layers[1].self_attn.compressor.indexer
    got = []

    def hook(module, args, kwargs, output):
        got.append((args, kwargs, output))
    handle = idx_mod.register_forward_hook(hook, with_kwargs=True)
    cache, B = None, 2
    chunks = [torch.randint(0, 128, (B, 37), generator=torch.Generator().manual_seed(4))]
    chunks += [torch.randint(0, 128, (B, 1), generator=torch.Generator().manual_seed(40 + s)) for s in range(6)]
    try:
        with torch.no_grad():
            for chunk in chunks:
                cache = model(chunk, past_key_values=cache, use_cache=True).past_key_values
                (h, q_res, pos, *_), _, want = got[-1]
                keys = cache.layers[1].compressed_kv["indexer"]  # [B, E, d] after this call
                S = h.shape[1]
                cos, sin = idx_mod.rotary_emb(h, position_ids=pos, layer_type=idx_mod.rope_layer_type)
                q = idx_mod.q_b_proj(q_res).view(B, S, -1, idx_mod.head_dim).transpose(1, 2)
                q = hf_v4.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)
                w = idx_mod.scorer.weights_proj(h).float() * idx_mod.scorer.weights_scaling
                ours = select_exact(q, keys, w, pos[0], idx_mod.compress_rate, idx_mod.index_topk)
                k = want.shape[-1]
                assert torch.equal(ours[..., :k], want.to(torch.int32)) and (ours[..., k:] == -1).all()
    finally:
        handle.remove()
    assert any((o >= 0).sum(-1).max() == 4 for _, _, o in got)  # selection happened: 9 entries, top-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_selection_against_dequantised_reference(backend):
    """select_fp8 (flashdsa's ragged logits + exact top-k) on fp8 queries and keys: its picks are an exact top-k
    of the reference scores of the dequantised inputs whatever the tie rule (tie-safe), and both backends give
    the same bits. Two requests (each over its own keys, in one launch), keys of random scale, ties at ReLU's
    zeros, rows seeing 0 .. 40 entries, topk 16."""
    from flashdsa.quant import act_quant
    from flashdsa.testing.compare import topk_tie_safe
    g = torch.Generator().manual_seed(5)
    B, T, H, d, E, rate, topk = 2, 24, 4, 128, 40, 4, 16
    positions = torch.sort(torch.randint(0, E * rate, (T,), generator=g)).values
    positions[0] = 2  # sees no entry yet
    q_fp8, q_scale = act_quant(torch.randn(B, T, H, d, generator=g))
    k_fp8, k_scale = act_quant(torch.randn(B, E, d, generator=g) * torch.rand(B, E, 1, generator=g) * 3)
    k_scale = k_scale[..., 0]
    weights = torch.randn(B, T, H, generator=g) * H ** -0.5 * d ** -0.5 * q_scale[..., 0]
    picks = select_fp8(q_fp8, k_fp8, k_scale, weights, positions, rate, topk, backend=backend)
    ref = scores_exact(q_fp8.float(), k_fp8.float() * k_scale[..., None], weights * d ** 0.5, positions, rate)
    visible = visible_entries(positions, rate)
    for b in range(B):
        ok, recall = topk_tie_safe(ref[b], visible, picks[b], topk, ascending=True)
        assert ok, (b, recall)
    assert (picks[:, 0] == -1).all() and picks.shape == (B, T, topk)
    assert torch.equal(picks, select_fp8(q_fp8, k_fp8, k_scale, weights, positions, rate, topk, backend="torch"))
    alone = select_fp8(q_fp8[1:], k_fp8[1:], k_scale[1:], weights[1:], positions, rate, topk, backend=backend)
    assert torch.equal(alone, picks[1:])  # a request's picks do not depend on the others in the launch


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("backend,capturable", [("torch", False), ("triton", False), ("torch", True)])
def test_layer_step_equals_hf_over_prompt_decode_and_extend(backend, capturable):
    """V4LayerStep, the batch's rows in one call with their state carried between calls, against every attention
    layer of HF's model run with its cache: a 37-token prompt, 7 decode steps, a 5-token extend, then 20 decode
    steps (the entry buffers grow); fp32, default initialisation, random sinks too (HF initialises them to 0).
    ``capturable``: the decode steps through ``decode(capturable=True)`` (the position on the device only, every
    entry of the reserved buffers scored or masked). The bound: fp32 rounding (see the first test).

    Why 8 indexer heads when capturable: the capturable step's top-k runs over the reserved row (-inf past the
    visible entries), and CPU ``torch.topk`` breaks exact ties by its partial sort over the whole row, so with
    2 heads (a score is exactly 0 whenever both ReLUs are: a quarter of the entries) a tie at the boundary can
    pick another 0-score entry than HF's shorter row does (#40). That path is for CUDA graphs, where topk keeps
    the first of equal scores whatever the row's length; with 8 heads an exact 0 is rare and the test checks
    the ring, entry and mask bookkeeping it is for."""
    model = tiny_model(index_n_heads=8 if capturable else 2)
    g = torch.Generator().manual_seed(6)
    for layer in model.model.layers:
        layer.self_attn.sinks.data = torch.randn(4, generator=g)
    from flashdsa.v4.layer import V4LayerStep
    B = 2
    chunks = [torch.randint(0, 128, (B, 37), generator=g)]
    chunks += [torch.randint(0, 128, (B, 1), generator=g) for _ in range(7)]
    chunks.append(torch.randint(0, 128, (B, 5), generator=g))
    chunks += [torch.randint(0, 128, (B, 1), generator=g) for _ in range(20)]
    steps = [V4LayerStep(layer.self_attn, backend) for layer in model.model.layers]
    states = [s.empty_state(B, torch.float32) for s in steps]
    for seen in calls_with_cache(model, chunks):
        for i, (inputs, want) in enumerate(seen):
            step = steps[i]
            S = want.shape[1]
            cos, sin = (t[0] for t in inputs["position_embeddings"][step.attn.rope_layer_type])
            if capturable and S == 1:
                states[i] = step.reserve(states[i], 37 + 7 + 5 + 20)
                got, states[i] = step.decode(inputs["hidden_states"], inputs["position_ids"][0], cos, sin, states[i],
                                             capturable=True)
            else:
                got, states[i] = step(inputs["hidden_states"], inputs["position_ids"][0], cos, sin, states[i])
            err = (got - want).abs().max()
            assert err <= 64 * torch.finfo(torch.float32).eps * want.abs().max(), (i, S, float(err))
    n = 37 + 7 + 5 + 20
    st = states[1]
    assert st.length == n and st.entries(steps[1].window) >= n // 4 and st.index_keys.shape[1] >= n // 4
    assert st.rows.shape[1] % 64 == 0 and states[2].entries(steps[2].window) >= n // 8


def test_layer_step_refuses_another_batch():
    model = tiny_model()
    from flashdsa.v4.layer import V4LayerStep
    step = V4LayerStep(model.model.layers[1].self_attn)
    state = step.empty_state(2, torch.float32)
    h = torch.randn(3, 4, 64)
    with pytest.raises(ValueError, match="^state:"):
        step(h, torch.arange(4), torch.zeros(4, 8), torch.zeros(4, 8), state)
    assert state.length == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attend_fp8_equals_attend_on_the_dequantised_rows(backend):
    """The fp8 mode's attention (paged decode over fp8 MLA rows) against the exact core in fp32 on those rows
    dequantised: the same values; what separates them is two bf16 roundings of the output (the kernel's, the
    result's: relative <= 2^-9 each, so a cosine diff up to about (2 * 2^-9)^2 / 2 = 7.6e-6) and, on the
    Triton path, P in bf16 (relative 2^-9 a weight, averaging out over 40 keys): bound 1e-5, the one
    ``flashdsa bench`` checks attention with. -1 entries and a row with nothing to see included."""
    from flashdsa.cache.layouts import decode_mla
    from flashdsa.testing.compare import cos_diff
    from flashdsa.v4.attention import attend_fp8, fp8_rows
    g = torch.Generator().manual_seed(9)
    T, h, D, N = 5, 16, 64, 150
    q = torch.randn(T, h, D, generator=g).to(torch.bfloat16)
    rows = fp8_rows(torch.randn(N, D, generator=g))
    idx = torch.randint(-1, N, (T, 40), generator=g).to(torch.int32)
    idx[2] = -1
    sinks, cos = torch.randn(h, generator=g), torch.randn(T, 8, generator=g)
    sin = torch.randn(T, 8, generator=g)
    got = attend_fp8(q, rows, idx, sinks, D ** -0.5, cos, sin, backend=backend)
    want = v4.attend(q.float(), decode_mla(rows)[:, :D].float(), idx, sinks, D ** -0.5, cos, sin, backend="torch")
    assert got.shape == (T, h, D) and (got[2] == 0).all()
    assert cos_diff(got.float(), want) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["exact", "fp8"])
def test_capturable_decode_replays_from_a_cuda_graph(precision):
    """``decode(capturable=True)`` of every layer type captured once in a CUDA graph and replayed over 10
    positions (windows closing and not, the first HCA entry included) gives the bits of the same step run
    eagerly on a copy of the state: nothing in it reads the host or depends on the position but through the
    device. bf16 model (fp8: the releases' indexer head dim 128)."""
    import copy
    from flashdsa.v4.layer import V4LayerStep
    model = tiny_model(index_head_dim=128 if precision == "fp8" else 16).to("cuda", torch.bfloat16)
    B, prompt, steps = 2, 29, 10
    g = torch.Generator("cuda").manual_seed(11)
    rope = model.model.rotary_emb
    for layer in model.model.layers:
        step = V4LayerStep(layer.self_attn, precision=precision)
        kind = layer.self_attn.rope_layer_type

        def cos_sin(pos):
            cos, sin = rope(torch.zeros(1, device="cuda"), position_ids=pos[None], layer_type=kind)
            return cos[0], sin[0]
        h0 = torch.randn(B, prompt, 64, device="cuda", generator=g).to(torch.bfloat16)
        pos0 = torch.arange(prompt, device="cuda")
        _, state = step(h0, pos0, *cos_sin(pos0), step.empty_state(B, torch.bfloat16, "cuda"))
        state = step.reserve(state, prompt + steps + 1)
        eager = copy.deepcopy(state)
        h_in = torch.zeros(B, 1, 64, device="cuda", dtype=torch.bfloat16)
        p_in = torch.zeros(1, dtype=torch.long, device="cuda")
        cos_in, sin_in = (t.clone() for t in cos_sin(p_in))
        warm = copy.deepcopy(state)  # the warm-up runs (compiles) on a copy: the captured state is not written
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step.decode(h_in, p_in, cos_in, sin_in, warm, capturable=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, _ = step.decode(h_in, p_in, cos_in, sin_in, state, capturable=True)
        for t in range(steps):
            pos = torch.tensor([prompt + t], device="cuda")
            h = torch.randn(B, 1, 64, device="cuda", generator=g).to(torch.bfloat16)
            want, eager = step.decode(h, pos, *cos_sin(pos), eager, capturable=True)
            h_in.copy_(h)
            p_in.copy_(pos)
            c, s = cos_sin(pos)
            cos_in.copy_(c)
            sin_in.copy_(s)
            graph.replay()
            assert torch.equal(out, want), (layer.self_attn.layer_type, t)
        assert torch.equal(state.rows, eager.rows)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_decode_scores_the_paged_keys_as_the_chunk_does(backend):
    """fp8 mode keeps CSA's indexer keys on flashdsa's index pages: a decode step scores them in place
    (``indexer_logits_paged`` + ``topk_transform``) and a chunk gathers them for the ragged op; for the same
    query both are exact top-k's of the same fp8 scores, and with the same tie rule (the smaller position)
    they pick the same entries. Two requests, 37 prompt tokens then decode steps past an entry boundary."""
    from flashdsa.v4.layer import V4LayerStep
    model = tiny_model(index_head_dim=128).to(torch.bfloat16)
    attn = model.model.layers[1].self_attn
    step = V4LayerStep(attn, backend, "fp8")
    g = torch.Generator().manual_seed(12)
    B = 2
    h = torch.randn(B, 37, 64, generator=g).to(torch.bfloat16)
    rope = model.model.rotary_emb

    def cos_sin(pos):
        cos, sin = rope(h, position_ids=pos[None], layer_type=attn.rope_layer_type)
        return cos[0], sin[0]
    pos = torch.arange(37)
    _, state = step(h, pos, *cos_sin(pos), step.empty_state(B, torch.bfloat16))
    picked = []
    orig = step._pick
    step._pick = lambda *args: picked.append(orig(*args)) or picked[-1]
    for t in range(37, 41):
        x = torch.randn(B, 1, 64, generator=g).to(torch.bfloat16)
        p = torch.tensor([t])
        _, state = step.decode(x, p, *cos_sin(p), state)
        count = (t + 1) // 4
        q_res = attn.q_a_norm(attn.q_a_proj(x))
        chunk = V4LayerStep._pick(step, torch.cat((x, x), dim=1), torch.cat((q_res, q_res), dim=1),
                                  torch.tensor([[t, t]]).expand(B, 2), state, count)[:, :1]
        assert torch.equal(picked[-1], chunk), t
        assert (picked[-1] >= 0).sum(-1).min() == min(count, attn.compressor.indexer.index_topk)
    with pytest.raises(ValueError, match="^attn: fp8 mode"):
        V4LayerStep(tiny_model().model.layers[1].self_attn, precision="fp8")


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_layer_step_over_a_chunk_that_closes_no_entry():
    """An extend whose tokens close no entry in either compressed layer (positions 37, 38: CSA rate 4 closes at
    39, HCA rate 8 at 39) still runs and equals HF's layers, and the next token's entries are right (the
    rotary of zero new entries once failed to reshape)."""
    from flashdsa.v4.layer import V4LayerStep
    model = tiny_model()
    g = torch.Generator().manual_seed(9)
    B = 2
    chunks = [torch.randint(0, 128, (B, n), generator=g) for n in (37, 2, 1, 1)]
    steps = [V4LayerStep(layer.self_attn, "torch") for layer in model.model.layers]
    states = [s.empty_state(B, torch.float32) for s in steps]
    for chunk, seen in zip(chunks, calls_with_cache(model, chunks)):
        for i, (inputs, want) in enumerate(seen):
            cos, sin = (t[0] for t in inputs["position_embeddings"][steps[i].attn.rope_layer_type])
            got, states[i] = steps[i](inputs["hidden_states"], inputs["position_ids"][0], cos, sin, states[i])
            assert (got - want).abs().max() <= 64 * torch.finfo(torch.float32).eps * want.abs().max(), (i, chunk.shape)
    assert states[1].length == 41 and states[2].length == 41
