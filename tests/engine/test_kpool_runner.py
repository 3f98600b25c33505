"""kpool through the runner (issue 19): chunked prefill == one-shot for chunks that split groups; decode
across several group boundaries == a prefill of the same tokens; MTP verify with drafts crossing a group
boundary == sequential decodes; truncation and failed forwards leave the tail rings right; the config keys
and the model's parameters; CUDA-graph decode (GPU only)."""

from __future__ import annotations

import pytest
import torch

from flashdsa import DSAConfig
from flashdsa.config import PRESETS
from flashdsa.engine import DecodeGraph, DSAModel, Runner
from flashdsa.testing.compare import assert_close_to_scale
from flashdsa.testing.inputs import token_ids

C = 4
CFG = DSAConfig.preset("tiny").replace(index_kpool=C)  # top-64 = 16 groups of 4, pages of 256, layer 2 skips
TOPK = CFG.index_topk
WIDTH = TOPK + C - 1


@pytest.fixture(scope="module")
def model():
    return DSAModel.random(CFG, seed=0)


def prompt(n, seed=0):
    return token_ids(n, CFG.vocab_size, seed)


def close(a, b, tol=3e-2):
    return assert_close_to_scale(a, b, tol)


def state(run: Runner) -> dict:
    """Everything a call may change that a later call can see: each request's length and pages, the MLA rows
    of its tokens and the pooled keys of its complete groups in every layer, its ring row and the ring
    positions the pool counts as kept (the last tail_len written, up to its length), the free lists.
    (A failed call's writes past a request's length stay, unreachable, as without kpool.)"""
    pool, out = run.pool, {}
    for r in run.alloc.req_ids:
        n = run.alloc.seq_len(r)
        out[r] = (n, run.alloc.pages(r), pool._tails[r][0] if r in pool._tails else None)
        for layer in range(CFG.num_hidden_layers):
            out[r, "mla", layer] = pool.mla_cache(layer).view(-1, pool.mla_cache(layer).shape[-1])[pool.slots(r)].clone()
        for layer in CFG.topk_layers:
            k, scale = pool.read_index(layer, pool.index_slots(r, 0, n // C))
            out[r, "index", layer] = torch.cat([k.view(torch.uint8), scale.view(torch.uint8).view(-1, 4)], 1)
        if r in pool._tails:
            row, hi = pool._tails[r]
            out[r, "kept"] = lo = max(hi - pool.tail_len, 0)
            assert lo <= n // C * C  # the unfinished group is always kept
            for layer, ring in pool.tail_rings.items():
                out[r, "ring", layer] = {p: ring[row, p % pool.tail_len].clone() for p in range(lo, n)}
    out["free"] = (run.alloc.free_page_ids, list(pool._free_rows))
    return out


def same_state(a: dict, b: dict) -> None:
    """``a`` (after) as ``b`` (before); the ring kept from ``a``'s oldest kept position on (a failed forward
    may count older ones as lost, never the unfinished group's)."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(k, tuple) and k[1] == "kept":
            assert a[k] >= b[k]
        elif isinstance(k, tuple) and k[1] == "ring":
            assert all(torch.equal(v, b[k][p]) for p, v in a[k].items()), k
        else:
            assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


def test_model_and_config_carry_kpool(model):
    hf = dict(PRESETS["tiny"], architectures=["GlmMoeDsaForCausalLM"], index_kpool=4, index_kpool_compress=True,
              index_kpool_always_select_tail=True)
    cfg = DSAConfig.from_hf(hf)
    assert (cfg.index_kpool, cfg.index_kpool_compress, cfg.index_kpool_always_select_tail) == (4, True, True)
    assert cfg.page_size == 256
    # the two switches default to the only variant built
    bare = DSAConfig.from_hf(dict(PRESETS["tiny"], index_kpool=4))
    assert bare.index_kpool_compress and bare.index_kpool_always_select_tail
    with pytest.raises(ValueError, match="^index_kpool_compress:"):
        DSAConfig.from_hf(dict(hf, index_kpool_compress=False))
    names = {n: p for n, p in model.named_parameters() if "kpool" in n}
    assert sorted(names) == sorted(f"layers.{i}.self_attn.indexer.index_kpool_compress_{w}"
                                   for i in CFG.topk_layers for w in ("gate", "ape"))
    gate, ape = names["layers.0.self_attn.indexer.index_kpool_compress_gate"], names[
        "layers.0.self_attn.indexer.index_kpool_compress_ape"]
    assert gate.shape == (128, CFG.hidden_size) and gate.dtype == torch.bfloat16
    assert ape.shape == (C, 128) and ape.dtype == torch.float32
    with torch.no_grad():
        assert 0.3 < float(ape.std()) < 0.7 and 0.5 < float((gate.float() @ torch.randn(CFG.hidden_size)).std()) < 2


@pytest.mark.parametrize("change, key", [
    (dict(index_kpool_compress=False), "index_kpool_compress"),
    (dict(index_kpool_always_select_tail=False), "index_kpool_always_select_tail"),
    (dict(index_kpool_compress="yes"), "index_kpool_compress"),
    (dict(index_kpool_always_select_tail=1), "index_kpool_always_select_tail"),
    (dict(index_kpool=3), "index_kpool"),           # 64 % 3
    (dict(index_kpool=128), "index_kpool"),         # top-64 % 128
])
def test_config_errors_name_the_key(change, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        CFG.replace(**change)
    # without kpool the two switches do not matter, but must still be booleans
    CFG.replace(index_kpool=1, index_kpool_compress=False, index_kpool_always_select_tail=False)


def test_chunked_prefill_equals_one_shot(model):
    p = prompt(3 * TOPK + 5, seed=3)
    one = Runner(model, 8, "fp8").extend({"a": p}, force_sparse=True)
    r = Runner(model, 8, "fp8", record=True)
    outs = [r.extend({"a": ch}, force_sparse=True) for ch in (p[:50], p[50:130], p[130:])]  # 50, 130: 2 mod 4
    assert torch.equal(torch.cat(outs), one)
    assert r.selections[0].shape == (len(p) - 130, WIDTH)


def test_decode_across_group_boundaries_equals_prefill(model):
    n0, steps = TOPK + 6, 2 * C + 3  # 70 = 2 mod 4: the second decode completes a group the prefill began
    p = prompt(n0 + steps, seed=4)
    full = Runner(model, 8, "fp8").extend({"a": p}, force_sparse=True)
    r = Runner(model, 8, "fp8")
    r.extend({"a": p[:n0]}, force_sparse=True)
    for i in range(steps):
        close(r.decode({"a": int(p[n0 + i])})[0], full[n0 + i])


@pytest.mark.parametrize("precision", ["fp8", "exact"])
def test_nope_kpool_16_decode_equals_prefill(precision):
    """GLM-5.3-Flash's shape of the step: NoPE (no RoPE in MLA or the indexer; rows without a rope part) and
    c = 16, in both indexer precisions: decode across group boundaries equals a prefill of the same tokens,
    over the 512-dim NoPE rows."""
    cfg = DSAConfig.preset("tiny").replace(qk_rope_head_dim=0, index_kpool=16)
    m = DSAModel.random(cfg, seed=1)
    for layer in m.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.precision = precision
    n0, steps = cfg.index_topk + 20, 18  # 84 = 4 mod 16: the 12th decode completes a group
    p = token_ids(n0 + steps, cfg.vocab_size, 5)
    full = Runner(m, 4, "bf16").extend({"a": p}, force_sparse=True)
    r = Runner(m, 4, "bf16")
    r.extend({"a": p[:n0]}, force_sparse=True)
    for i in range(steps):
        close(r.decode({"a": int(p[n0 + i])})[0], full[n0 + i])
    rows = r.pool.read(0, r.pool.slots("a"))
    assert rows.shape[1] == 512 and r.pool.mla_cache(0).shape[-1] == 512  # bf16 NoPE rows


@pytest.mark.parametrize("n", [1, 3, 5])
def test_verify_equals_sequential_decodes(model, n):
    # a: 137 = 1 mod 4 (drafts 137.. cross the boundary at 140); b: 61, shorter than top-k
    p = {"a": prompt(2 * TOPK + 9, 1), "b": prompt(TOPK - 3, 2)}
    drafts = {"a": [11, 12, 13, 14, 15][:n], "b": [21, 22, 23, 24, 25][:n]}
    ver = Runner(model, 8, "fp8", record=True)
    ver.extend(p, force_sparse=True)
    lv = ver.verify(drafts)
    sel_v = {k: v.view(2, n, -1) for k, v in ver.selections.items()}
    dec = Runner(model, 8, "fp8", record=True)
    dec.extend(p, force_sparse=True)
    for j in range(n):
        ld = dec.decode({r: d[j] for r, d in drafts.items()})
        close(lv[:, j], ld)
        for layer, s in dec.selections.items():
            assert s.shape == (2, WIDTH)
            a, b = torch.sort(sel_v[layer][:, j], dim=1).values, torch.sort(s, dim=1).values
            assert torch.equal(a, b), f"layer {layer} draft {j}: selections differ"


def test_skip_layers_reuse_and_dense_fallback(model):
    r = Runner(model, 8, "fp8", record=True)
    short = {"a": prompt(TOPK - 5, 7), "b": prompt(3, 8)}
    dense = r.extend(short)  # every context <= top-k: the dense fallback, pooled keys still written
    assert all(s is None for s in r.selections.values())
    sparse = Runner(model, 8, "fp8").extend(short, force_sparse=True)
    close(dense, sparse)
    r.decode({"a": 1, "b": 2})
    assert r.selections[2] is r.selections[1] and r.selections[1].shape == (2, WIDTH)
    ref = Runner(model, 8, "fp8")  # the same tokens on the sparse path throughout
    ref.extend(short, force_sparse=True)
    ref.decode({"a": 1, "b": 2})
    close(r.decode({"a": 3, "b": 4}), ref.decode({"a": 3, "b": 4}))


def test_truncate_after_verify_then_decode_matches_fresh_run(model):
    p = prompt(TOPK + 6, 9)  # 70: drafts 70, 71, 72 complete group 17 (68..71)
    r = Runner(model, 8, "fp8")
    r.extend({"a": p}, force_sparse=True)
    r.verify({"a": [1, 2, 3]})
    r.truncate("a", len(p) + 1)  # keep the first draft only: group 17 unfinished again
    after = r.decode({"a": 4})
    fresh = Runner(model, 8, "fp8")
    fresh.extend({"a": p}, force_sparse=True)
    fresh.decode({"a": 1})
    assert torch.equal(after, fresh.decode({"a": 4}))


def test_truncate_refused_when_the_ring_no_longer_holds_the_tail(model):
    r = Runner(model, 8, "fp8", kpool_max_next_n=1)  # the ring keeps the last c = 4 positions
    assert r.pool.tail_len == C
    p = prompt(TOPK + 6, 10)
    r.extend({"a": p}, force_sparse=True)
    r.verify({"a": [1, 2, 3]})  # writes 70, 71, 72: 68, 69 are gone from the ring
    before = state(r)
    with pytest.raises(ValueError, match="n_tokens"):
        r.truncate("a", 71)  # would need 68..70
    same_state(state(r), before)
    r.truncate("a", 72)  # a multiple of c: nothing unfinished
    assert r.alloc.seq_len("a") == 72
    ok = Runner(model, 8, "fp8")  # the default ring (c + 7) keeps them
    ok.extend({"a": p}, force_sparse=True)
    ok.verify({"a": [1, 2, 3]})
    ok.truncate("a", 71)


def _fail_after_layer_1(monkeypatch, model):
    """Make the next forward fail in layer 3, after layers 0 and 1 wrote their caches and rings."""
    def boom(*args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(model.layers[3].mlp, "forward", boom)


@pytest.mark.parametrize("call", ["extend", "decode", "verify"])
def test_failed_forward_leaves_everything_as_before(model, monkeypatch, call):
    p = prompt(TOPK + 6, 11)  # 70: an unfinished group of 2 tokens whose raw keys only the ring holds
    chunk = prompt(2 * TOPK + 3, 12)  # long enough to wrap the ring over the unfinished group
    args = {"extend": ({"a": chunk, "b": prompt(5, 13)},), "decode": ({"a": 5},), "verify": ({"a": [5, 6, 7]},)}[call]
    r, ref = Runner(model, 8, "fp8"), Runner(model, 8, "fp8")
    for run in (r, ref):
        run.extend({"a": p}, force_sparse=True)
    before = state(r)
    with monkeypatch.context() as m:
        _fail_after_layer_1(m, model)
        with pytest.raises(RuntimeError, match="injected"):
            getattr(r, call)(*args)
    same_state(state(r), before)
    kw = {"force_sparse": True} if call == "extend" else {}
    assert torch.equal(getattr(r, call)(*args, **kw), getattr(ref, call)(*args, **kw))
    assert torch.equal(r.decode({"a": 9, **({"b": 9} if call == "extend" else {})}),
                       ref.decode({"a": 9, **({"b": 9} if call == "extend" else {})}))


def test_tail_rows_run_out_and_come_back(model):
    r = Runner(model, 8, "fp8", kpool_max_requests=2)
    r.extend({"a": prompt(9, 1), "b": prompt(6, 2)})
    before = state(r)
    with pytest.raises(ValueError, match="new_tokens.*max_requests"):
        r.extend({"c": prompt(5, 3)})
    same_state(state(r), before)
    r.free("a")
    r.extend({"c": prompt(5, 3)})  # a's row again
    assert r.pool.tail_rows(["c"]) == [0]
    r.alloc.free("b")  # freed behind the pool's back: its row is reclaimed at the next reservation
    r.extend({"d": prompt(7, 4)})
    assert sorted(r.pool.tail_rows(["c", "d"])) == [0, 1]


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    model = DSAModel.random(CFG, seed=0, device="cuda")
    p = {"a": prompt(3 * TOPK + 1), "b": prompt(TOPK // 2 + 1, 1)}
    eager, graphed = Runner(model, 8, "fp8"), Runner(model, 8, "fp8")
    eager.extend(p)
    graphed.extend(p)
    g = DecodeGraph(graphed, ["a", "b"], max_pages=4)
    for step in range(2 * C + 1):  # across group boundaries: the pooled writes and the ring inside the graph
        toks = [10 + step, 20 + step]
        le = eager.decode(dict(zip(["a", "b"], toks)))
        lg = g.replay(toks)
        close(lg.clone(), le, tol=1e-2)


def test_decode_kpool_metadata_stays_the_same_from_step_to_step(model):
    """What a CUDA graph captures once: decode's kpool fields depend on the batch, not on the positions."""
    r = Runner(model, 8, "fp8")
    r.extend({"a": prompt(TOPK + 6, 14), "b": prompt(9, 15)})
    metas = []
    for step in range(C + 1):
        meta, reservation = r.prepare({"a": 1, "b": 1}, "decode")
        metas.append(meta)
        r.forward(torch.tensor([step, step]), meta)
    for m in metas[1:]:
        for name in ("kpool_rows", "kpool_first", "kpool_anchors", "kpool_tail_tokens"):
            assert torch.equal(getattr(m, name), getattr(metas[0], name)), name
    assert metas[0].kpool_anchors.tolist() == [0, 1] and metas[0].kpool == C and metas[0].kpool_every_token


@pytest.mark.gpu
def test_bench_kpool_on_the_gpu(monkeypatch):
    """The H200 numbers for BENCHMARKS.md: ``PYTHONPATH=. python benchmarks/bench_kpool.py`` (32K and 128K).
    Here 32K only: the checks pass, the cache shrinks by 4 and the scan + top-k gets cheaper."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_kpool

    rows = bench_kpool.run(quick=True)
    print(rows)
    one, four = rows
    assert one["ok"] and four["ok"]
    assert four["index B/token"] * 4 == one["index B/token"] == 132
    assert four["select vs c=1"] < 0.75, four


def test_kpool_with_host_offload_is_bitwise_the_on_device_run(model):
    """kpool and host offload together: the offloading pool keeps the tail rings too (its free / truncate go
    through KVPool's), and a row's selection of topk + c - 1 tokens fits its device buffer."""
    from flashdsa.cache.offload import OffloadConfig

    p = {"a": prompt(2 * TOPK + 9, 16), "b": prompt(TOPK + 2, 17)}
    dev, off = Runner(model, 8, "fp8", dense_threshold=0), Runner(model, 8, "fp8", offload=OffloadConfig(max_requests=2))
    assert off.pool.buffer_rows >= 2 * WIDTH
    for run in (dev, off):
        run.extend(p)
    for step in range(C + 1):
        assert torch.equal(off.decode({"a": step, "b": step + 1}), dev.decode({"a": step, "b": step + 1}))
    assert torch.equal(off.verify({"a": [1, 2, 3], "b": [4, 5, 6]}), dev.verify({"a": [1, 2, 3], "b": [4, 5, 6]}))
    for run in (dev, off):
        run.truncate("a", run.alloc.seq_len("a") - 2)
        run.free("b")
    assert "b" not in off.pool._tails and off.pool._free_rows == dev.pool._free_rows
    assert torch.equal(off.decode({"a": 9}), dev.decode({"a": 9}))


def test_kpool_with_decode_context_parallelism_is_refused(model):
    """DCP would put a pooled group's tokens on several ranks; prefill CP runs kpool (tests/parallel)."""
    from flashdsa.parallel import Parallel

    class Sharded(Parallel):
        shards_kv = True

    with pytest.raises(ValueError, match=r"^parallel: decode context parallelism \(DCP\) with index_kpool = 4 is "
                                         "not built"):
        Runner(model, 8, "fp8", parallel=Sharded(None))  # refused before the plan (or the group) is used
