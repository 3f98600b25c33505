"""The decode compressor step in one Triton launch (flashdsa/v4/close_entry.py; the interpreter here) against
the torch ops it replaces (HF's ops in HF's layout), on transformers' own compressor modules with random
position biases and norm weights: the CSA compressor (overlapping windows, rate 4), the indexer's (head dim 128)
and an HCA compressor (rate 64: the slot loop runs several blocks), at windows that close first (the earlier
half of an overlapping window not there yet), later, and far out (RoPE at position ~4M).

Bounds from the roundings: fp32 — both sum the same terms in another order, so a few ulp of the entry's scale
(64 eps). bf16 — the pooled sum, the normalised row and the rotated pair are each rounded to bf16 once on either
side, and another summation order can move a rounding by one ulp at each: at most ~5 ulp of bf16 (2^-8
relative) of the largest element a rotated pair mixes, so 5 * 2^-8 of the entry's max. A wrong slot, bias row
or position is off by tens of per cent. The ring write is a copy: bitwise."""

from __future__ import annotations

import pytest
import torch

from flashdsa.testing.inputs import poison_torch_empty
from flashdsa.v4 import CSA, HCA, SLIDING
from flashdsa.v4.close_entry import close_entry, close_entry_torch, kernel_fits

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("transformers without deepseek_v4", allow_module_level=True)
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402


def compressors(dtype):
    cfg = DeepseekV4Config(vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                           num_attention_heads=4, head_dim=64, q_lora_rank=32, n_routed_experts=2,
                           num_experts_per_tok=1, o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=2,
                           index_head_dim=128, index_topk=4, layer_types=[SLIDING, CSA, HCA], hc_mult=2,
                           qk_rope_head_dim=16, compress_rates={CSA: 4, HCA: 64}, mlp_layer_types=["moe"] * 3,
                           max_position_embeddings=1 << 23)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).eval().to(dtype)
    g = torch.Generator().manual_seed(1)
    csa, hca = model.model.layers[1].self_attn.compressor, model.model.layers[2].self_attn.compressor
    mods = {"csa": (csa, True), "indexer": (csa.indexer, True), "hca": (hca, False)}
    for m, _ in mods.values():
        m.position_bias.data = torch.randn(m.position_bias.shape, generator=g).to(m.position_bias.dtype)
        m.kv_norm.weight.data = (1 + torch.randn(m.kv_norm.weight.shape, generator=g) / 4).to(m.kv_norm.weight.dtype)
    return mods


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    poison_torch_empty(monkeypatch)  # an entry element the kernel does not write fails


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["csa", "indexer", "hca"])
def test_kernel_matches_the_torch_ops(dtype, kind):
    check(dtype, kind, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["csa", "indexer", "hca"])
def test_compiled_kernel_matches_the_torch_ops(dtype, kind):
    """The same on the GPU: the compiled kernel (its exp, cos and sin are the GPU's) against cuBLAS and torch."""
    check(dtype, kind, "cuda")


def check(dtype, kind, device):
    module, overlap = compressors(dtype)[kind]
    module.to(device)
    rate, B = module.compress_rate, 3
    W = module.kv_proj.out_features
    R = 2 * rate if overlap else rate
    g = torch.Generator().manual_seed(rate + W)
    assert kernel_fits(module, (torch.empty(1, dtype=dtype),))
    # windows that close (the entry ending at token (n + 1) rate - 1), far out (RoPE at ~1M), and tokens that
    # close none (the first window not full yet; mid-window): the captured step pools them all, stored or not
    ts = [(n + 1) * rate - 1 for n in (0, 1, 5, 1_000_003 // rate)] + [0, rate // 2, 3 * rate + 1]
    for t in ts:
        t = torch.tensor([t], device=device)
        ring = (torch.randn(B, R, W, generator=g).to(device, dtype),
                (2 * torch.randn(B, R, W, generator=g)).to(device, dtype))
        h = torch.randn(B, 1, module.kv_proj.in_features, generator=g).to(device, dtype)
        mine = tuple(x.clone() for x in ring)
        with torch.no_grad():
            want = close_entry_torch(module, h, ring, t, overlap)
            got = close_entry(module, h, mine, t, overlap, backend="triton")
        assert got.shape == want.shape == (B, 1, module.kv_norm.weight.shape[0]) and got.dtype == dtype
        assert torch.equal(mine[0], ring[0]) and torch.equal(mine[1], ring[1]), "the ring write is a copy"
        assert torch.isfinite(got).all()  # value checks downstream see every step's entry
        bound = 64 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 5 * 2 ** -8
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err <= bound, (kind, int(t), float(err))


def test_the_window_without_its_earlier_half_weighs_it_zero():
    """Entry 0 of an overlapping compressor pools its own window only: a ring full of NaN where the earlier
    half would be leaves the entry finite and equal to the torch ops'."""
    module, _ = compressors(torch.float32)["csa"]
    B, W = 2, module.kv_proj.out_features
    g = torch.Generator().manual_seed(3)
    ring = (torch.full((B, 8, W), float("nan")), torch.full((B, 8, W), float("nan")))
    ring[0][:, :4], ring[1][:, :4] = torch.randn(B, 4, W, generator=g), torch.randn(B, 4, W, generator=g)
    h = torch.randn(B, 1, 64, generator=g)
    t = torch.tensor([3])
    with torch.no_grad():
        want = close_entry_torch(module, h, tuple(x.clone() for x in ring), t, True)
        got = close_entry(module, h, ring, t, True, backend="triton")
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 64 * torch.finfo(torch.float32).eps * want.abs().max()


def test_backend_refusals():
    module, overlap = compressors(torch.float32)["hca"]
    ring = (torch.zeros(1, 64, 64), torch.zeros(1, 64, 64))
    with pytest.raises(ValueError, match="^backend:"):
        close_entry(module, torch.zeros(1, 1, 64), ring, torch.tensor([63]), overlap, backend="cuda")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_indexer_quantize_is_dsas_indexer_numerics(backend):
    """flashdsa.v4.indexer.quantize at d = 128 goes through ops.indexer_quant with an identity RoPE: fp32 rows
    give the torch composition's bits (Hadamard in fp32, e4m3 with a UE8M0 scale); bf16 rows round the rotated
    row to bf16 first (DSA's keys do), so each e4m3 value is the composition's or its neighbour (2^-3 relative of
    the element, at most one e4m3 step) and the scales are equal or one power of two apart at a rounding edge."""
    from flashdsa.quant import act_quant, hadamard
    from flashdsa.v4.indexer import quantize
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 7, 128, generator=g) * torch.rand(3, 5, 7, 1, generator=g) * 10
    got, scale = quantize(x, backend=backend)
    want, want_scale = act_quant(hadamard(x), block=128)
    assert got.shape == x.shape and scale.shape == x.shape[:-1]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scale, want_scale[..., 0])
    xb = x.to(torch.bfloat16)
    got, scale = quantize(xb, backend=backend)
    want, want_scale = act_quant(hadamard(xb.float()), block=128)
    a, b = got.float() * scale[..., None], want.float() * want_scale
    assert ((a - b).abs() <= 2 ** -3 * b.abs().clamp_min(2 ** -6 * want_scale)).all()
