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

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("transformers without deepseek_v4", allow_module_level=True)
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

TYPES = [v4.SLIDING, v4.CSA, v4.HCA]


def tiny_model(seed: int = 0) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                           num_attention_heads=4, head_dim=64, q_lora_rank=32, n_routed_experts=4,
                           num_experts_per_tok=2, o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=2,
                           index_head_dim=16, index_topk=4, layer_types=TYPES, hc_mult=2, qk_rope_head_dim=16,
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


def test_hf_apply_says_what_is_missing():
    import flashdsa.hf as fh
    with pytest.raises(NotImplementedError, match="DeepSeek-V4.*#43"):
        fh.apply(tiny_model())
