"""flashdsa.hf: HF's own DeepSeek-V3.2 / GLM-5 models, patched in place, against themselves unpatched.

HF's forward is an independent reference written outside this project: with ``indexer="exact"`` the
patched model must select exactly HF's tokens, agree on logits and generate the same greedy tokens;
with ``indexer="fp8"`` it must stay close but not equal. Tiny random models (3 layers, the real 576-dim
MLA cache rows and 128-dim indexer keys, ``index_topk`` 16 < prompt 40), torch backends on CPU.

Also the exact precision of the indexer outside HF (``flashdsa.layers.indexer``) and in the Runner.
"""

from __future__ import annotations

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (DeepseekV32Config, DeepseekV32ForCausalLM, DynamicCache,  # noqa: E402
                          GlmMoeDsaConfig, GlmMoeDsaForCausalLM, LlamaConfig, LlamaForCausalLM)

import flashdsa.hf as fh  # noqa: E402
from flashdsa import ops  # noqa: E402
from flashdsa.config import DSAConfig, is_dsa  # noqa: E402
from flashdsa.engine import DSAModel, Runner  # noqa: E402
from flashdsa.layers.indexer import Indexer, exact_logits_paged, exact_logits_ragged  # noqa: E402
from flashdsa.quant import rope_cos_sin  # noqa: E402
from flashdsa.testing.compare import assert_close, cos_diff  # noqa: E402

TOPK, T, NEW, VOCAB = 16, 40, 5, 256
ARCHS = ("v32", "glm")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference over the finite entries (the -inf ones must coincide)."""
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)), "the non-finite entries differ"
    a, b = a[fin].double(), b[fin].double()
    return float((a - b).norm() / b.norm())


def _tiny(arch: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
              v_head_dim=32, index_n_heads=8, index_head_dim=128, index_topk=TOPK, first_k_dense_replace=3,
              max_position_embeddings=1024, pad_token_id=0)
    kw.update(over)
    if arch == "v32":
        model = DeepseekV32ForCausalLM(DeepseekV32Config(**kw))
    else:  # layer 1 reuses layer 0's top-k
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**kw, indexer_types=["full", "shared", "full"]))
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        # HF initialises every weight with std 0.02, which makes one layer's attention output ~5x the
        # residual stream; real checkpoints carry a residual much larger than any one layer's output.
        # Embeddings of std 1 restore that, so the logits see the attention's bf16 rounding (flashdsa's
        # MLA is bf16; checked per layer below) in proportion.
        model.model.embed_tokens.weight.normal_(0, 1.0)
    return model.eval()


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, **kw)


class _Count:
    """Forward calls of HF's own attention internals (kv_b_proj, the indexer module): flashdsa's path
    reads kv_b_proj's weight and calls the indexer's projections, never these modules themselves."""

    def __init__(self, model):
        self.n = 0
        self.handles = []
        for layer in model.model.layers:
            for mod in (layer.self_attn.kv_b_proj, layer.self_attn.indexer):
                if mod is not None:
                    self.handles.append(mod.register_forward_hook(self._hit))

    def _hit(self, *args):
        self.n += 1

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module", params=ARCHS)
def ref(request):
    """An unpatched tiny model and HF's answers: logits, per-layer attention outputs, top-k, generate()."""
    arch = request.param
    model = _tiny(arch)
    ids = torch.randint(1, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    sel, attn_out = {}, {}
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, a, out, i=i: sel.__setitem__(i, out[0]))
             for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None]
    hooks += [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: attn_out.__setitem__(i, out[0]))
              for i, layer in enumerate(model.model.layers)]
    count = _Count(model)
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    calls_hf = count.n
    count.remove()
    gen = _generate(model, ids)
    return dict(arch=arch, model=model, ids=ids, logits=logits, sel=sel, attn_out=attn_out, gen=gen,
                calls_hf=calls_hf)


@pytest.fixture
def patched(ref):
    """Yields a function that patches ref's model; unpatched again after the test."""
    model = ref["model"]
    yield lambda **kw: fh.apply(model, **{"max_tokens": 2048, **kw})
    if fh.get_patch(model) is not None:
        fh.unapply(model)
    gc.collect()


# ---- config ---------------------------------------------------------------------------------------

def test_config_from_hf_dicts(ref):
    d = ref["model"].config.to_dict()
    assert d.get("architectures") is None and is_dsa(d)  # built in code: model_type names the architecture
    cfg = DSAConfig.from_hf(d)
    if ref["arch"] == "v32":
        assert cfg.architectures == ("DeepseekV32ForCausalLM",) and cfg.indexer_rope_interleave is False
        assert cfg.topk_layers == [0, 1, 2]
    else:
        assert cfg.architectures == ("GlmMoeDsaForCausalLM",) and cfg.indexer_rope_interleave is True
        assert cfg.topk_layers == [0, 2] and cfg.skip_topk_layers == [1]
    assert (cfg.kv_cache_dim, cfg.index_head_dim, cfg.index_topk) == (576, 128, TOPK)


# ---- exact: HF's numbers ----------------------------------------------------------------------------

def test_exact_matches_hf(ref, patched):
    model, ids = ref["model"], ref["ids"]
    assert ref["calls_hf"] > 0
    patch = patched(indexer="exact", record=True)
    count = _Count(model)
    attn_out = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: attn_out.__setitem__(i, out[0]))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    # every attention layer ran through flashdsa, none of HF's attention internals did
    assert patch.calls == [1, 1, 1] and count.n == 0
    assert patch.runner.pool.exact_index_caches and all(not c.any() for c in patch.runner.pool.index_caches.values())
    # the same tokens as HF's indexer, row by row (HF pads short rows with masked keys: drop those)
    for lid, hf_sel in ref["sel"].items():
        ours = patch.runner.selections[lid]
        for t in range(T):
            want = set(hf_sel[t].tolist()) & set(range(t + 1))
            got = set(p for p in ours[t].tolist() if p >= 0)
            assert got == want, f"layer {lid} row {t}: flashdsa {sorted(got)} != HF {sorted(want)}"
    if ref["arch"] == "glm":
        assert patch.runner.selections[1] is patch.runner.selections[0]  # shared layer: layer 0's selection
    # attention outputs agree to bf16 rounding (flashdsa's MLA runs in bf16, HF's here in fp32)
    for lid, want in ref["attn_out"].items():
        assert _rel(attn_out[lid], want) < 1e-2, f"layer {lid}"
    assert _rel(logits, ref["logits"]) < 1e-3
    assert_close(logits, ref["logits"], atol=1e-3 * float(ref["logits"].abs().max()))
    # greedy generate(): identical tokens, close scores; every step through flashdsa
    gen = _generate(model, ids)
    assert torch.equal(gen.sequences, ref["gen"].sequences)
    assert _rel(torch.stack(gen.scores), torch.stack(ref["gen"].scores)) < 1e-3
    assert patch.calls == [1 + NEW] * 3 and count.n == 0
    count.remove()


def test_fp8_close_but_not_exact(ref, patched):
    model, ids = ref["model"], ref["ids"]
    patch = patched(indexer="exact")
    with torch.no_grad():
        exact = model(ids).logits
    patch = patched(indexer="fp8", record=True)
    with torch.no_grad():
        fp8 = model(ids).logits
    assert patch.calls == [1, 1, 1]
    # the fp8 path really ran: its pages hold keys, no exact key store was made, selections moved a bit
    assert not patch.runner.pool.exact_index_caches
    assert all(c.any() for c in patch.runner.pool.index_caches.values())
    same = total = 0
    for lid, hf_sel in ref["sel"].items():
        for t in range(TOPK, T):  # rows with more candidates than top-k
            want = set(hf_sel[t].tolist())
            got = set(patch.runner.selections[lid][t].tolist())
            same, total = same + len(got & want), total + TOPK
    assert 0.8 < same / total < 1.0
    rel = _rel(fp8, exact)
    assert 0 < rel < 5e-2 and not torch.equal(fp8, exact)
    assert float((fp8.argmax(-1) == exact.argmax(-1)).float().mean()) > 0.9
    _generate(model, ids)
    assert patch.calls == [1 + NEW] * 3


# ---- batches, caches, the patch itself ------------------------------------------------------------------

def test_left_padded_batch(ref, patched):
    model = ref["model"]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (3, 36), generator=g)
    mask = torch.ones_like(ids)
    for b, pad in ((1, 11), (2, 3)):
        ids[b, :pad], mask[b, :pad] = 0, 0
    want = _generate(model, ids, attention_mask=mask)
    patch = patched(indexer="exact")
    got = _generate(model, ids, attention_mask=mask)
    assert torch.equal(got.sequences, want.sequences)
    assert _rel(torch.stack(got.scores), torch.stack(want.scores)) < 1e-3
    # each row holds only its real tokens: prompt minus padding, plus NEW - 1 fed back
    assert got.cache.seq_lens() == [36 + NEW - 1 - p for p in (0, 11, 3)]
    assert got.cache.get_seq_length() == 36 + NEW - 1
    del got
    gc.collect()
    assert patch.runner.alloc.req_ids == []  # pages return when the cache goes


def test_cache_objects(ref, patched):
    if ref["arch"] != "v32":
        pytest.skip("cache handling is architecture-independent")
    model, ids = ref["model"], ref["ids"]
    with torch.no_grad():
        full = model(torch.cat((ids, ids[:, :1]), 1)).logits  # HF, one token more
        filled = DynamicCache(config=model.config)
        model(ids[:, :8], cache=filled)
    patch = patched(indexer="exact")
    with torch.no_grad():
        # prefix, then the rest on top of it (extend over a cached prefix), then one decode step
        a = model(ids[:, :29])
        assert isinstance(a.cache, fh.FlashDSACache) and a.cache.get_seq_length() == 29
        b = model(ids[:, 29:], cache=a.cache)
        c = model(ids[:, :1], cache=a.cache)
        assert _rel(torch.cat((a.logits, b.logits, c.logits), 1), full) < 1e-3
        # crop drops the last columns; feeding them again gives the same logits
        a.cache.crop(-4)
        assert a.cache.get_seq_length() == T - 3 and a.cache.seq_lens() == [T - 3]
        again = model(torch.cat((ids[:, T - 3:], ids[:, :1]), 1), cache=a.cache).logits
        assert_close(again, torch.cat((b.logits[:, -3:], c.logits), 1), atol=1e-5)
        # an empty HF cache stands for a new sequence, and the same object continues it
        hf_cache = DynamicCache(config=model.config)
        d = model(ids[:, :29], cache=hf_cache)
        assert isinstance(d.cache, fh.FlashDSACache) and hf_cache.get_seq_length() == 0
        e = model(ids[:, 29:], cache=hf_cache)
        assert torch.equal(e.logits, b.logits)
        # a cache holding HF's own KV cannot be continued
        with pytest.raises(ValueError, match="computed without flashdsa"):
            model(ids[:, 8:9], cache=filled)
        # use_cache=False: the pages are back once the forward returns
        live = len(patch.runner.alloc.req_ids)
        model(ids, use_cache=False)
        assert len(patch.runner.alloc.req_ids) == live
        with pytest.raises(ValueError, match="2-D"):
            model(ids, attention_mask=torch.ones(1, 1, T, T))
        with pytest.raises(NotImplementedError, match="beam search"):
            a.cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(ValueError, match="inference-only"):
        model.train()
        try:
            model(ids)
        finally:
            model.eval()


def test_failed_forward_leaves_the_cache_as_before(ref, patched):
    """A forward that fails part-way (here: an input past the vocabulary, then an MLP that raises after the
    first attention layer wrote its caches) gives its reserved tokens back: the cache is exactly as
    before and the next forward returns the same logits as a cache that never saw the failure."""
    if ref["arch"] != "v32":
        pytest.skip("cache handling is architecture-independent")
    model, ids = ref["model"], ref["ids"]
    patch = patched(indexer="exact")
    mlp = model.model.layers[0].mlp

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    with torch.no_grad():
        good, bad = model(ids[:, :20]).cache, model(ids[:, :20]).cache
        alloc = patch.runner.alloc
        state = (bad.seen, bad.seq_lens(), alloc.free_page_ids)
        with pytest.raises(IndexError):
            model(torch.full((1, 3), VOCAB + 5), cache=bad)  # the embedding fails before any layer
        mlp.forward = boom
        try:
            with pytest.raises(RuntimeError, match="injected"):
                model(ids[:, 20:30], cache=bad)
            with pytest.raises(RuntimeError, match="injected"):
                model(ids[:, :5])  # a new cache whose first forward fails: its rows are gone again
        finally:
            del mlp.forward
        assert (bad.seen, bad.seq_lens(), alloc.free_page_ids) == state
        assert torch.equal(model(ids[:, 20:30], cache=bad).logits, model(ids[:, 20:30], cache=good).logits)
        assert bad.seen == good.seen == 30 and bad.seq_lens() == good.seq_lens() == [30]


def test_apply_twice_and_unapply(ref, patched):
    model, ids = ref["model"], ref["ids"]
    first = patched(indexer="exact")
    with torch.no_grad():
        out1 = model(ids)
    second = patched(indexer="exact")
    assert fh.get_patch(model) is second and first.closed
    with torch.no_grad():
        out2 = model(ids).logits
        assert torch.equal(out2, out1.logits) and second.calls == [1, 1, 1]  # patched once, not twice
        with pytest.raises(ValueError, match="earlier flashdsa.hf.apply"):
            model(ids[:, :1], cache=out1.cache)
    fh.unapply(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref["logits"])  # HF's own forward is back, bit for bit
    with pytest.raises(ValueError, match="not patched"):
        fh.unapply(model)


def test_not_a_dsa_model():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="not a DSA model"):
        fh.apply(llama)
    with pytest.raises(ValueError, match="model_type 'llama'"):
        fh.apply(llama)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        fh.apply(_tiny("v32", kv_lora_rank=256))
    with pytest.raises(ValueError, match="indexer"):
        fh.apply(_tiny("v32"), indexer="bf16")


# ---- the exact precision of the indexer, outside HF -----------------------------------------------------

def _brute(q, k, w, ks, ke):
    s = torch.einsum("thd,nd->thn", q.double(), k.double()).clamp_min(0)
    out = torch.einsum("thn,th->tn", s, w.double())
    pos = torch.arange(k.shape[0])
    vis = (pos[None] >= ks[:, None]) & (pos[None] < ke[:, None])
    return torch.where(vis, out, float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_exact_logits_ragged_and_paged(dtype):
    g = torch.Generator().manual_seed(3)
    H, D, lens = 4, 128, [63, 1, 65, 130]
    N = sum(lens)
    k = torch.randn(N, D, generator=g).to(dtype)
    ks, ke = [], []
    off = 0
    for L in lens:  # each request queries its last 5 tokens (or all of them)
        for p in range(max(0, L - 5), L):
            ks.append(off)
            ke.append(off + p + 1)
        off += L
    ks, ke = torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)
    q = torch.randn(len(ks), H, D, generator=g).to(dtype)
    w = torch.randn(len(ks), H, generator=g)
    ragged = exact_logits_ragged(q, k, w, ks, ke)
    assert_close(ragged, _brute(q, k, w, ks, ke).float(), atol=1e-4, rtol=1e-5)
    # the same keys in shuffled 64-token pages, scored through block tables: the same numbers
    perm = torch.randperm(16, generator=g)
    store = torch.full((16 * 64, D), float("nan")).to(dtype)
    tables, off, page = [], 0, 0
    for L in lens:
        n_pages = -(-L // 64)
        pages = perm[page:page + n_pages]
        page += n_pages
        slots = (pages[torch.arange(L) // 64] * 64 + torch.arange(L) % 64)
        store[slots] = k[off:off + L]
        tables.append(torch.nn.functional.pad(pages, (0, 3 - n_pages)).to(torch.int32))
        off += L
    last = [i for i in range(len(ks)) if i + 1 == len(ks) or ks[i + 1] != ks[i]]  # each request's last row
    ctx = (ke[last] - ks[last]).view(-1, 1)
    paged = exact_logits_paged(q[last].unsqueeze(1), store, w[last], ctx, torch.stack(tables), 3 * 64)
    for r, i in enumerate(last):
        n = int(ctx[r])
        assert torch.equal(paged[r, :n], ragged[i, int(ks[i]):int(ke[i])])
        assert torch.isneginf(paged[r, n:]).all()


def test_indexer_precisions():
    cfg = DSAConfig.preset("tiny")
    torch.manual_seed(4)
    idx = Indexer(cfg, torch.float32)
    with torch.no_grad():
        for p in idx.parameters():
            p.normal_(0, 0.1 if p.dim() == 2 else 1.0)
    x, qr = torch.randn(70, cfg.hidden_size), torch.randn(70, cfg.q_lora_rank)
    cos, sin = rope_cos_sin(torch.arange(70))
    with torch.no_grad():
        f8 = idx(x, qr, cos, sin)
        idx.precision = "exact"
        ex = idx(x, qr, cos, sin)
    assert not f8.exact and ex.exact and ex.k_scale is None and ex.q.dtype == torch.float32
    ks = torch.zeros(70, dtype=torch.int32)
    ke = torch.arange(1, 71, dtype=torch.int32)
    lf8 = ops.indexer_logits_ragged(f8.q, f8.k, f8.k_scale, f8.weights, ks, ke, backend="torch")
    lex = exact_logits_ragged(ex.q, ex.k, ex.weights, ks, ke)
    # the same quantity (every scale folded the same way), fp8 rounding apart
    assert cos_diff(lf8, lex) < 1e-3 and not torch.equal(lf8, lex)
    with pytest.raises(ValueError, match="precision"):
        idx.precision = "fp16"


def test_runner_exact_decode_matches_extend():
    cfg = DSAConfig.preset("tiny")  # index_topk 64, a skip-top-k layer every other layer
    model = DSAModel.random(cfg, seed=5, dtype=torch.float32)
    for layer in model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.precision = "exact"
    prompt = torch.randint(0, cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(6))
    whole = Runner(model, 4, "bf16", record=True)
    lw = whole.extend({"a": prompt})
    steps = Runner(model, 4, "bf16", record=True)
    steps.extend({"a": prompt[:99]})
    ld = steps.decode({"a": int(prompt[99])})
    assert_close(ld[0], lw[-1], atol=1e-2 * float(lw[-1].abs().max()))
    pages = steps.alloc.pages("a")
    for lid in cfg.topk_layers:
        assert lid in steps.pool.exact_index_caches and not steps.pool.index_caches[lid].any()
        slots = steps.selections[lid][0].tolist()
        got = {pages.index(s // 64) * 64 + s % 64 for s in slots if s >= 0}
        want = {p for p in whole.selections[lid][-1].tolist() if p >= 0}
        assert got == want and len(got) == cfg.index_topk
