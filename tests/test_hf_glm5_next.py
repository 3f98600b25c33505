"""flashdsa.hf on GLM-5.3-Flash (transformers' ``glm5_next``): HF's model patched in place, against itself
unpatched.

The model is tiny and random, initialised as transformers initialises it (nothing re-scaled), with
everything the real one has: a hybrid stack (a KDA linear-attention layer, which stays HF's, then three DSA
layers, the middle one reusing the previous layer's top-k), hyper-connections, MoE, NoPE MLA over a 512-dim
latent (``qk_rope_head_dim`` 0), and kpool with c = 16 (``index_topk`` 64: 4 groups + the tail, up to 79
tokens a row). Prompts of 113-203 real tokens (left-padded batch of 3), so every row selects. Torch backends
on CPU.

* fp32, ``indexer="exact"``: HF's logits to fp32 rounding (the bound is test_hf's FP32_TOL, measured
  ~8e-7), the same greedy tokens, and every DSA layer's kpool selection equal to HF's
  ``Glm5NextTextIndexer``'s token for token, prefill and decode.
* bf16: the first DSA layer (whose inputs are HF's bits) selects HF's tokens; the logits are as far from
  HF's fp32 answer as HF's own bf16 run is.
* ``indexer="fp8"``: argmax agreement with HF's fp32 model >= 90 % (measured 94 %).
"""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23")
glm5_next = pytest.importorskip("transformers.models.glm5_next")

from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration  # noqa: E402

import flashdsa.hf as fh  # noqa: E402
from flashdsa.cache.pool import KVPool  # noqa: E402
from flashdsa.config import DSAConfig, is_dsa  # noqa: E402

FP32_TOL = 1e-4  # as test_hf: fp32 rounding of the same math in another order measures ~1e-6
TOPK, C, NEW = 64, 16, 6
TEXT = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=96,
            kv_lora_rank=512, qk_nope_head_dim=32, v_head_dim=32, index_topk=TOPK, index_n_heads=4,
            index_head_dim=128, index_kpool=C,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "indexed_attention"],
            index_topk_pattern="FFSF", linear_head_dim=32, linear_num_heads=4, pad_token_id=0,
            mlp_layer_types=["dense", "sparse", "sparse", "dense"])
DSA_LAYERS = [1, 2, 3]  # HF's ids; flashdsa's DSA stack numbers them 0, 1, 2 (1 reuses 0's top-k)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    return Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=dict(TEXT))).eval().to(dtype)


def _prompts(seed: int):
    """Left-padded batch of 3: 203, 166 and 113 real tokens."""
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(1, TEXT["vocab_size"], (3, 203), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    mask[2, :90] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


def _rel_max(got, want, mask) -> float:
    real = mask.bool()
    return float((got - want)[real].abs().max() / want[real].abs().max())


def _hf_selections(model, ids, mask, steps: int = 1):
    """HF's indexer outputs of every full DSA layer: per forward (prefill, then ``steps - 1`` greedy decode
    steps), ``{hf layer: [B, S, topk + c - 1]}`` column indices (padding columns counted), -1 padded."""
    text = model.model.language_model
    got, hooks = [], []
    for i in DSA_LAYERS:
        ind = text.layers[i].self_attn.indexer
        if ind is not None:
            hooks.append(ind.register_forward_hook(lambda m, a, out, i=i: got[-1].__setitem__(i, out)))
    try:
        cache, cur, m = None, ids, mask
        with torch.no_grad():
            for _ in range(steps):
                got.append({})
                out = model(input_ids=cur, attention_mask=m, cache=cache, use_cache=True)
                cache, cur = out.cache, out.logits[:, -1:].argmax(-1)
                m = torch.cat((m, torch.ones_like(cur)), dim=1)
    finally:
        for h in hooks:
            h.remove()
    return got


def _our_selections(model, ids, mask, steps: int = 1):
    """flashdsa's selections of every DSA layer, per forward, as ``{flashdsa layer: [T, topk + c - 1]}``
    positions (-1 padded), with the rows' request and the request's pad count."""
    patch = fh.apply(model, indexer="exact", backend="torch", record=True, max_tokens=4096)
    got = []
    try:
        cache, cur, m = None, ids, mask
        with torch.no_grad():
            for _ in range(steps):
                out = model(input_ids=cur, attention_mask=m, cache=cache, use_cache=True)
                cache = out.cache
                runner = patch.runner
                # slot -> position, every row's request
                pos_of = {}
                for r in cache.rows:
                    for p, s in enumerate(runner.pool.slots(r).tolist()):
                        pos_of[s] = p
                step = {}
                for lid, sel in runner.selections.items():
                    if cur.shape[1] > 1:   # prefill: rows of the gathered KV, request b's from sum(lens[:b])
                        lens = m.sum(1).tolist()
                        ks = torch.cat([torch.full((n,), sum(lens[:b])) for b, n in enumerate(lens)])
                        step[lid] = torch.where(sel >= 0, sel - ks[:, None], -1)
                    else:
                        step[lid] = sel.clone().apply_(lambda s: pos_of.get(s, -1) if s >= 0 else -1)
                got.append(step)
                cur = out.logits[:, -1:].argmax(-1)
                m = torch.cat((m, torch.ones_like(cur)), dim=1)
    finally:
        fh.unapply(model)
    return got


def _same_selection(hf: dict, ours: dict, mask: torch.Tensor, layers_hf, what: str) -> None:
    """``mask``: the prompt's (its pad counts shift HF's columns to positions)."""
    pads = (mask == 0).sum(1).tolist()
    B, S = mask.shape[0], hf[layers_hf[0]].shape[1]
    for lid, h in enumerate(DSA_LAYERS):
        if h not in layers_hf:
            continue
        t = 0
        for b in range(B):
            for s in range(S):
                if S > 1 and s < pads[b]:
                    continue  # a padding column: HF's row is all -1, flashdsa has no row
                want = {c - pads[b] for c in hf[h][b, s].tolist() if c >= 0}
                got = {p for p in ours[lid][t].tolist() if p >= 0}
                assert got == want, f"{what}: layer {h}, row {b}, column {s}: {sorted(got ^ want)[:8]} differ"
                t += 1


# ---- config ---------------------------------------------------------------------------------------------

def test_config_reads_glm5_next():
    """The released model's shapes (transformers' defaults), nested under text_config or flat."""
    hf = Glm5NextConfig().to_dict()
    assert is_dsa(hf)
    cfg = DSAConfig.from_hf(hf)
    assert cfg.dsa_layers == list(range(3, 45, 4)) and cfg.topk_layers == cfg.dsa_layers
    assert (cfg.index_kpool, cfg.qk_rope_head_dim, cfg.kv_cache_dim, cfg.page_size) == (16, 0, 512, 1024)
    assert (cfg.index_n_heads, cfg.index_topk, cfg.selected_tokens) == (32, 2048, 2063)
    assert cfg.softmax_scale == 256 ** -0.5
    stack = cfg.dsa_stack()
    assert stack.num_hidden_layers == 11 and stack.layer_types is None and stack.topk_layers == list(range(11))
    flat = dict(hf["text_config"], model_type="glm5_next", architectures=["Glm5NextForConditionalGeneration"])
    assert DSAConfig.from_hf(flat) == cfg
    tiny = DSAConfig.from_hf(_model().config.to_dict())
    assert tiny.dsa_layers == DSA_LAYERS and tiny.skip_topk_layers == [2]
    assert tiny.dsa_stack().skip_topk_layers == [1]
    KVPool(tiny.dsa_stack(), 4)  # the caches take the stack
    with pytest.raises(ValueError, match="dsa_stack"):
        KVPool(tiny, 4)


@pytest.mark.parametrize("change, field", [
    (dict(index_kpool=24), "index_kpool"),                                   # 64 % 24: does not divide the topk
    (dict(layer_types=["linear_attention", "mamba", "indexed_attention", "indexed_attention"]), "layer_types"),
    (dict(index_topk_pattern="FSFF"), "indexer_types"),                      # shared after a linear layer
    (dict(qk_rope_head_dim=-2), "qk_rope_head_dim"),
])
def test_config_refusals(change, field):
    d = Glm5NextConfig(text_config=dict(TEXT)).to_dict()
    d["text_config"].update(change)
    if "index_topk_pattern" in change:
        d["text_config"]["indexer_types"] = None
    with pytest.raises(ValueError, match=field):
        DSAConfig.from_hf(d)


def test_rope_dims_the_cache_cannot_hold():
    """A RoPE width other than 0 (NoPE) or 64 has no cache rows: refused by name before anything is patched."""
    model = _model()
    model.config.text_config.qk_rope_head_dim = 32   # HF itself refuses rope > 0 for this model; the dict path
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        fh.apply(model)
    assert fh.get_patch(model) is None


# ---- exact mode ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_is_hf_in_fp32(seed):
    model = _model(seed)
    ids, mask = _prompts(seed)
    want = _logits(model, ids, mask)
    with torch.no_grad():
        want_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    patch = fh.apply(model, indexer="exact", backend="torch", max_tokens=4096)
    got = _logits(model, ids, mask)
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert patch.calls[0] > 0 and len(patch.calls) == 3   # the three DSA layers ran through flashdsa
    assert _rel_max(got, want, mask) < FP32_TOL
    assert torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("seed", [0, 3])
def test_kpool_selection_is_hf(seed):
    """Every DSA layer's selection (the full ones' and the shared one's), on the prompt and 2 decode steps,
    equals HF's Glm5NextTextIndexer output token for token (ties included) in fp32."""
    model = _model(seed)
    ids, mask = _prompts(seed)
    hf = _hf_selections(model, ids, mask, steps=3)
    ours = _our_selections(model, ids, mask, steps=3)
    for step, (h, o) in enumerate(zip(hf, ours)):
        h = {**h, 2: h[1]}  # the shared layer attends layer 1's selection
        _same_selection(h, o, mask, DSA_LAYERS, f"step {step}")


def test_bf16_first_layer_selects_hf_tokens_and_logits_within_hf_spread():
    model = _model(0)
    ids, mask = _prompts(0)
    want32 = _logits(model, ids, mask)
    model = model.to(torch.bfloat16)
    hf16 = _logits(model, ids, mask)
    hf = _hf_selections(model, ids, mask)
    ours = _our_selections(model, ids, mask)
    _same_selection(hf[0], ours[0], mask, [1], "bf16 prefill")
    fh.apply(model, indexer="exact", backend="torch", max_tokens=4096)
    got = _logits(model, ids, mask)
    # HF's bf16 run is 0.38 of the logits' maximum from its fp32 run on this model (hyper-connections and
    # Sinkhorn routing amplify bf16 rounding); ours lands at the same distance (0.38), its argmax agreeing
    # with HF's bf16 run on 99 % of the rows
    spread = _rel_max(hf16, want32, mask)
    assert _rel_max(got, want32, mask) < 1.5 * spread
    real = mask.bool()
    assert float((got.argmax(-1) == hf16.argmax(-1))[real].float().mean()) >= 0.95


def test_fp8_argmax_agrees():
    model = _model(0)
    ids, mask = _prompts(0)
    want = _logits(model, ids, mask)
    fh.apply(model, indexer="fp8", backend="torch", max_tokens=4096)
    got = _logits(model, ids, mask)
    real = mask.bool()
    assert float((got.argmax(-1) == want.argmax(-1))[real].float().mean()) >= 0.9
    assert _rel_max(got, want, mask) > 10 * FP32_TOL  # not the exact path by accident


def test_hybrid_cache():
    """The linear-attention layers keep their state in HF's own cache layers inside flashdsa's cache; a
    second generate() starts fresh; crop (which a recurrent state cannot undo) is refused by name."""
    model = _model(0)
    ids, mask = _prompts(0)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    patch = fh.apply(model, indexer="exact", backend="torch", max_tokens=4096)
    assert patch.hybrid and patch.hf_layers == DSA_LAYERS
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False), want)
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache = out.cache
    assert isinstance(cache, fh.FlashDSACache)
    assert type(cache.layers[0]).__name__ == "LinearAttentionLayer"
    assert cache.layers[0].has_previous_state[0]
    with pytest.raises(NotImplementedError, match="hybrid"):
        cache.crop(-1)
    cache.reset()
    assert not cache.layers[0].has_previous_state[0] and cache.seen == 0


def test_graph_decode_plumbing_with_linear_layers(monkeypatch):
    """Decode steps from (stand-in, CPU) CUDA graphs in the hybrid stack give the eager tokens: the capture's
    warm-up runs step the linear-attention layers' state, which must be put back before the replay makes the
    step (the stand-in's capture runs the forward once, as a warm-up does); one graph per cache object."""
    import flashdsa.hf.graphs as fh_graphs

    model = _model(0)
    ids, mask = _prompts(0)
    # fp8: exact kpool (host-side lengths) decodes eagerly, graphs or not
    patch = fh.apply(model, indexer="fp8", max_tokens=16384, cuda_graphs=False)
    with torch.no_grad():
        eager = model.generate(ids, max_new_tokens=NEW, do_sample=False)

    class StandIn:
        def __init__(self, run):
            self.run, self.out = run, run()

        def replay(self):
            saved = patch._fwd, list(patch.calls)  # a real replay runs no Python: no forward of ours counted
            out = self.run()
            patch._fwd, patch.calls[:] = saved
            self.out["last_hidden_state"].copy_(out["last_hidden_state"])

    captures = []
    monkeypatch.setattr(fh_graphs, "_graphs_possible", lambda device: True)
    monkeypatch.setattr(fh_graphs, "_capture", lambda run, device: (captures.append(StandIn(run)) or captures[-1],
                                                                    captures[-1].out))
    patch.cuda_graphs = True
    with torch.no_grad():
        for n in (1, 2):
            got = model.generate(ids, max_new_tokens=NEW, do_sample=False)
            assert torch.equal(got, eager)
            assert len(captures) == n and len(patch.graphs) == 1  # a new cache, a new graph; the old one dropped
    assert patch.graph_replays == 2 * (NEW - 1)


@pytest.mark.gpu
def test_graph_decode_gpu_hybrid():
    """On the GPU (Triton kernels): fp32, exact — HF's greedy tokens, eagerly (exact kpool decodes without
    graphs); bf16, fp8 — the decode steps replayed from CUDA graphs, the linear-attention layers' state
    stepped by the replay only, give the eager decode's tokens and logits (the same kernels on the same
    values; bound: one bf16 ulp of the largest logit), twice (a new cache: a new graph)."""
    model = _model(0).cuda()
    ids, mask = (t.cuda() for t in _prompts(0))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        patch = fh.apply(model, indexer="exact", max_tokens=16384)
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False), want)
        assert not patch.graphs and patch.graph_failure is None
        model = model.to(torch.bfloat16)

        def steps(graphs: bool):
            fh.apply(model, indexer="fp8", max_tokens=16384, cuda_graphs=graphs)
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            # the GPU box's transformers (5.23) names the cache past_key_values, in and out; 5.25 `cache`
            name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            rows, cache, m = [out.logits[:, -1].float()], getattr(out, name), mask
            for j in range(NEW):
                tok = ids[:, -1 - j:ids.shape[1] - j]   # teacher-forced: the same tokens both ways
                m = torch.cat((m, torch.ones_like(tok)), dim=1)
                out = model(input_ids=tok, attention_mask=m, use_cache=True, **{name: cache})
                rows.append(out.logits[:, -1].float())
            return torch.stack(rows)

        eager = steps(False)
        if tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 25):
            # (the GPU box has 5.23): its linear-attention cache layers cannot be captured; eager decode, warned
            with pytest.warns(RuntimeWarning, match="decoding eagerly"):
                got = steps(True)
            assert "transformers >= 5.25" in fh.get_patch(model).graph_failure and torch.equal(got, eager)
            return
        for n in (1, 2):
            got = steps(True)
            patch = fh.get_patch(model)
            assert patch.graph_failure is None and patch.graph_replays == NEW and len(patch.graphs) == 1
            ulp = float(eager.abs().max()) * 2 ** -8
            assert float((got - eager).abs().max()) <= ulp, f"run {n}"
