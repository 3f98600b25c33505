"""The engine's promises (issue 6): sparse == dense where every context fits in top-k; chunked prefill
== one-shot prefill; MTP verify with n drafts == n sequential decodes; skip-top-k layers reuse the
previous layer's selection bit for bit; CUDA-graph replay == eager (GPU only)."""

import pytest
import torch

from flashdsa import DSAConfig
from flashdsa.cache.allocator import OutOfPagesError
from flashdsa.engine import DecodeGraph, DSAModel, Runner
from flashdsa.testing.compare import assert_close_to_scale
from flashdsa.testing.inputs import token_ids

CFG = DSAConfig.preset("tiny")  # topk 64, layer 2 skips top-k
TOPK = CFG.index_topk


@pytest.fixture(scope="module")
def model():
    return DSAModel.random(CFG, seed=0)


def prompt(n, seed=0):
    return token_ids(n, CFG.vocab_size, seed)


def close(a, b, tol=3e-2):
    return assert_close_to_scale(a, b, tol)


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_sparse_equals_dense_when_context_fits(model, fmt):
    lens = {"a": TOPK, "b": 17, "c": 1}
    chunks = {r: prompt(n, i) for i, (r, n) in enumerate(lens.items())}
    dense = Runner(model, 16, fmt)
    sparse = Runner(model, 16, fmt, record=True)
    ld = dense.extend(chunks)
    ls = sparse.extend(chunks, force_sparse=True)
    close(ls, ld)
    # every row selected exactly what it may see
    sel = sparse.selections[0]
    visible = (sel >= 0).sum(1)
    expect = torch.cat([torch.arange(1, n + 1) for n in lens.values()])
    assert torch.equal(visible, expect)
    # and the decode step (always sparse) agrees with a dense re-run of the whole sequence
    step = {"a": 3, "b": 4, "c": 5}
    dec = sparse.decode(step)
    full = Runner(model, 16, fmt).extend({r: torch.cat([chunks[r], torch.tensor([t])]) for r, t in step.items()})
    ends = torch.tensor([n for n in lens.values()]).cumsum(0) + torch.arange(1, 4) - 1
    close(dec, full[ends])


def test_chunked_prefill_equals_one_shot(model):
    # Both on the sparse path: a row's math does not depend on the chunk it is in, so the logits are
    # bit-identical. (With the dense fallback on the first chunk they differ by rounding, which can
    # flip a later layer's top-k boundary: the fallback is exact math, not exact bits.)
    p = prompt(3 * TOPK + 5, seed=3)
    one = Runner(model, 16, "fp8").extend({"a": p}, force_sparse=True)
    r = Runner(model, 16, "fp8")
    outs = [r.extend({"a": c}, force_sparse=True) for c in (p[:50], p[50:130], p[130:])]
    assert torch.equal(torch.cat(outs), one)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_verify_equals_sequential_decodes(model, n):
    p = {"a": prompt(2 * TOPK + 9, 1), "b": prompt(TOPK - 3, 2)}
    drafts = {"a": [11, 12, 13, 14][:n], "b": [21, 22, 23, 24][:n]}
    ver = Runner(model, 16, "fp8", record=True)
    ver.extend(p, force_sparse=True)
    lv = ver.verify(drafts)
    sel_v = {k: v.view(2, n, -1) for k, v in ver.selections.items()}
    dec = Runner(model, 16, "fp8", record=True)
    dec.extend(p, force_sparse=True)
    for j in range(n):
        ld = dec.decode({r: d[j] for r, d in drafts.items()})
        close(lv[:, j], ld)
        for layer, s in dec.selections.items():
            # same pages in both runners, so the same physical slots; compare as sets per row
            a = torch.sort(sel_v[layer][:, j], dim=1).values
            b = torch.sort(s, dim=1).values
            assert torch.equal(a, b), f"layer {layer} draft {j}: selections differ"


def test_verify_rows_do_not_see_later_drafts(model):
    r = Runner(model, 16, "fp8", record=True)
    r.extend({"a": prompt(TOPK + 30, 5)}, force_sparse=True)
    seq0 = r.alloc.seq_len("a")
    r.verify({"a": [1, 2, 3]})
    slots = r.alloc.slots("a")
    for layer, sel in r.selections.items():
        for j in range(3):
            visible = set(slots[: seq0 + j + 1].tolist())
            chosen = set(sel[j][sel[j] >= 0].tolist())
            assert chosen <= visible, f"layer {layer}: draft {j} selected a later draft"


def test_skip_layers_reuse_previous_selection(model):
    assert CFG.skip_topk_layers == [2]
    r = Runner(model, 16, "fp8", record=True)
    r.extend({"a": prompt(2 * TOPK, 7)}, force_sparse=True)
    assert r.selections[2] is r.selections[1]
    r.decode({"a": 1})
    assert r.selections[2] is r.selections[1]
    assert model.layers[2].self_attn.indexer is None and not r.pool.has_index_cache(2)


def test_truncate_then_decode_matches_fresh_run(model):
    p = prompt(TOPK + 10, 9)
    r = Runner(model, 16, "fp8")
    r.extend({"a": p}, force_sparse=True)
    r.verify({"a": [1, 2, 3]})
    r.truncate("a", len(p) + 1)  # keep the first draft only
    after = r.decode({"a": 4})
    fresh = Runner(model, 16, "fp8")
    fresh.extend({"a": p}, force_sparse=True)
    fresh.decode({"a": 1})
    close(after, fresh.decode({"a": 4}))


def test_out_of_pages_leaves_the_pool_unchanged(model):
    r = Runner(model, 3, "fp8")
    r.extend({"a": prompt(100)})
    free = r.alloc.num_free_pages
    with pytest.raises(OutOfPagesError):
        r.extend({"b": prompt(64), "c": prompt(65)})
    assert r.alloc.num_free_pages == free and "b" not in r.alloc and "c" not in r.alloc


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    model = DSAModel.random(CFG, seed=0, device="cuda")
    p = {"a": prompt(3 * TOPK), "b": prompt(TOPK // 2, 1)}
    eager, graphed = Runner(model, 32, "fp8"), Runner(model, 32, "fp8")
    eager.extend(p)
    graphed.extend(p)
    g = DecodeGraph(graphed, ["a", "b"], max_pages=8)
    for step in range(3):
        toks = [10 + step, 20 + step]
        le = eager.decode(dict(zip(["a", "b"], toks)))
        lg = g.replay(toks)
        close(lg.clone(), le, tol=1e-2)


def test_prefill_logits_budget_does_not_change_results(model):
    # A budget of a few rows forces many chunks of query rows through the indexer -> top-k path.
    p = {"a": prompt(2 * TOPK + 3, 4), "b": prompt(TOPK + 9, 6)}
    free = Runner(model, 16, "fp8", record=True)
    budget = Runner(model, 16, "fp8", record=True, max_logits_bytes=4 * 3 * (2 * TOPK + 3))
    assert torch.equal(budget.extend(p, force_sparse=True), free.extend(p, force_sparse=True))
    for layer in CFG.topk_layers:
        assert torch.equal(budget.selections[layer], free.selections[layer])


def test_runner_for_layers_drives_attention_per_layer(model):
    """A model-less runner (how flashdsa.hf drives HF's models) prepares the batch; the caller calls each
    layer's step itself and gets the same logits as forward()."""
    p = prompt(2 * TOPK + 3, seed=7)
    want = Runner(model, 16, "fp8").extend({"a": p}, force_sparse=True)
    run = Runner.for_layers(CFG, "cpu", 16, "fp8")
    meta, _ = run.prepare({"a": len(p)}, force_sparse=True)
    x = model.embed_tokens(p)
    cos, sin = model.rotary(meta.positions)
    sel = None
    with torch.no_grad():
        for layer in model.layers:
            out, sel = layer.self_attn(layer.input_layernorm(x), cos, sin, meta, run.pool, sel)
            x = x + out
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        got = model.lm_head(model.norm(x)).float()
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="no model"):
        run.forward(p, meta)
    with pytest.raises(ValueError, match="model"):
        Runner(None, 16, "fp8")


def test_layer_ops_skip_value_checks_but_public_calls_keep_them(model, monkeypatch):
    """The runner's per-layer op calls run on host-built metadata: no value check (each is a device read,
    a host sync at decode), while the same op called directly still rejects bad values."""
    from flashdsa import _checks, ops

    seen = []
    real = ops.topk_transform

    def spy(*args, **kwargs):
        seen.append(_checks.value_checks_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "topk_transform", spy)
    run = Runner(model, 16, "fp8")
    run.extend({"a": prompt(TOPK + 40)}, force_sparse=True)
    run.decode({"a": 3})
    assert seen and not any(seen)
    assert _checks.value_checks_enabled()
    with pytest.raises(ValueError, match="lengths"):
        real(torch.randn(2, 8), torch.tensor([3, 9], dtype=torch.int32), 4)


def test_an_empty_request_says_it_has_no_token_ids(model):
    """``torch.as_tensor([])`` is float32: an empty list must be called empty, not "not integer ids"."""
    r = Runner(model, 16, "fp8")
    for chunk in ([], torch.tensor([], dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"^chunks\['e'\]: expected at least one token id, got none$"):
            r.extend({"e": chunk})
    r.extend({"a": prompt(5)})
    with pytest.raises(ValueError, match=r"^drafts\['a'\]: expected at least one token id, got none$"):
        r.verify({"a": []})
    assert "e" not in r.alloc and r.alloc.seq_len("a") == 5


@pytest.mark.parametrize("parallel", ["cp", 2, object()])
def test_parallel_must_be_a_parallel_mode(model, parallel):
    with pytest.raises(ValueError, match=r"^parallel: expected None or a flashdsa\.parallel mode \(ContextParallel"):
        Runner(model, 16, "fp8", parallel=parallel)
