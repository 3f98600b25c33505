"""Host offload through the engine (issue 22): a Runner whose MLA cache lives on the host gives bitwise the
logits and selections of the all-on-device Runner over chunked prefill, many decode steps (with selections
that change a lot), MTP verify, truncate, free and page reuse; the dense fallback and CUDA graphs are
off; failed calls leave it consistent; the demo reports it.

The on-device reference runs with dense_threshold=0: offload turns the dense fallback off, and the dense
path is the same math but not the same bits.
"""

from __future__ import annotations

import pytest
import torch

from flashdsa import DSAConfig, ops
from flashdsa.cache.offload import OffloadConfig, OffloadKVPool
from flashdsa.engine import DecodeGraph, DSAModel, Runner
from flashdsa.testing.inputs import token_ids

# The tiny preset cut to 3 layers: topk 64, layer 2 skips top-k (reuses layer 1's selection). Every MLA
# format is compared byte for byte at the pool level (tests/cache/test_offload.py); here the fp8 cache.
CFG = DSAConfig.preset("tiny").replace(num_hidden_layers=3)
TOPK = CFG.index_topk


@pytest.fixture(scope="module")
def model():
    return DSAModel.random(CFG, seed=0)


def prompt(n, seed=0):
    return token_ids(n, CFG.vocab_size, seed)


def pair(model, fmt="fp8", rows=2 * TOPK, max_requests=4, pages=48, device="cpu"):
    kw = dict(kv_scale=0.02 if fmt == "fp8_raw" else None, record=True)
    if device != "cpu":
        model = model.to(device)
    on = Runner(model, pages, fmt, dense_threshold=0, **kw)
    off = Runner(model, pages, fmt, offload=OffloadConfig(device_buffer=rows, max_requests=max_requests), **kw)
    return on, off


def same(on, off, call, *args, **kw):
    """Run ``call`` on both runners; the logits and every layer's selection must be bitwise equal."""
    a, b = getattr(on, call)(*args, **kw), getattr(off, call)(*args, **kw)
    assert torch.equal(a, b), f"{call}: max |diff| {(a - b).abs().max().item()}"
    assert on.selections.keys() == off.selections.keys()
    for layer in on.selections:
        assert torch.equal(on.selections[layer], off.selections[layer]), f"{call}: layer {layer} selected differently"
    return a


def churn(prev: dict, cur: dict) -> float:
    """The largest share of a decode row's selection that the previous step did not select (any layer)."""
    worst = 0.0
    for layer, sel in cur.items():
        for row_prev, row in zip(prev[layer], sel):
            now = set(row[row >= 0].tolist())
            worst = max(worst, len(now - set(row_prev[row_prev >= 0].tolist())) / max(len(now), 1))
    return worst


def test_offload_is_bitwise_the_on_device_runner(model):
    on, off = pair(model)
    p = {"a": prompt(4 * TOPK + 3, 1), "b": prompt(TOPK // 2, 2), "c": prompt(2 * TOPK + 5, 3)}
    same(on, off, "extend", {"a": p["a"][:100], "b": p["b"], "c": p["c"]})  # every context sparse, a chunked
    same(on, off, "extend", {"a": p["a"][100:]})
    g = torch.Generator().manual_seed(11)
    worst, prev = 0.0, None
    for step in range(9):
        tokens = {r: int(torch.randint(0, CFG.vocab_size, (1,), generator=g)) for r in p}
        same(on, off, "decode", tokens)
        if prev is not None:
            worst = max(worst, churn(prev, off.selections))
        prev = dict(off.selections)
        if step == 4:  # a long chunk on top of "c" mid-decode: its new keys pull the selection away
            same(on, off, "extend", {"c": prompt(3 * TOPK, 4)})
            prev = None
        if step == 6:  # MTP verify of 2 drafts, keep one
            same(on, off, "verify", {r: [5, 6] for r in p})
            for r in p:
                on.truncate(r, on.alloc.seq_len(r) - 1)
                off.truncate(r, off.alloc.seq_len(r) - 1)
            prev = None
    assert worst >= 0.5, f"no step changed its selection much (largest new share {worst:.2f})"
    pool = off.pool
    assert isinstance(pool, OffloadKVPool) and pool.stats["decode"]["steps"] == 9
    # more rows copied than the buffers hold: rows were evicted and swapped in again
    assert pool.stats["decode"]["rows"] > pool.max_requests * pool.buffer_rows * CFG.num_hidden_layers
    pool.resident.check()


def test_free_and_truncate_release_rows_and_reused_pages_stay_exact(model):
    on, off = pair(model, max_requests=2, pages=8)
    same(on, off, "extend", {"a": prompt(3 * TOPK, 5), "b": prompt(2 * TOPK, 6)})
    same(on, off, "decode", {"a": 1, "b": 2})
    pool = off.pool
    buf_a = pool.resident.buffer("a")
    assert buf_a is not None and pool.resident.resident_rows() > 0
    dropped = pool.allocator.slots("a", 2 * TOPK)  # the tokens truncate drops (some share a kept page)
    assert all((pool.resident.translate(layer, dropped) >= 0).any() for layer in range(CFG.num_hidden_layers))
    for r in (on, off):
        r.truncate("a", 2 * TOPK)
    assert all((pool.resident.translate(layer, dropped) == -1).all() for layer in range(CFG.num_hidden_layers))
    pages_a = set(off.alloc.pages("a")) | set(dropped.div(CFG.page_size, rounding_mode="floor").tolist())
    for r in (on, off):
        r.free("a")
    assert pool.resident.buffer("a") is None and pool.resident.num_free_buffers == 1
    rows = slice(buf_a * pool.buffer_rows, (buf_a + 1) * pool.buffer_rows)
    assert (pool.resident.slot_of_row[:, rows] == -1).all()
    pool.resident.check()
    # "c" takes a's pages and buffer: every row it reads must hold its own tokens
    same(on, off, "extend", {"c": prompt(3 * TOPK + 9, 7)})
    assert pages_a & set(off.alloc.pages("c")), "the test meant c to reuse a's pages"
    for t in range(3):
        same(on, off, "decode", {"b": t, "c": t + 1})
    for r in (on, off):
        r.free("b")
        r.free("c")
    assert pool.resident.resident_rows() == 0 and pool.resident.num_free_buffers == 2
    with pytest.raises(ValueError, match="req_id"):
        off.free("c")


def test_failed_calls_leave_offload_consistent(model, monkeypatch):
    on, off = pair(model, rows=TOPK)
    p = {"a": prompt(3 * TOPK, 8), "b": prompt(TOPK + 7, 9)}
    same(on, off, "extend", p)
    same(on, off, "decode", {"a": 3, "b": 4})
    # a verify step whose selection might not fit a buffer of exactly top-k rows: refused, nothing reserved
    lens = {r: off.alloc.seq_len(r) for r in p}
    with pytest.raises(ValueError, match="device_buffer"):
        off.verify({r: [1, 2] for r in p})
    assert {r: off.alloc.seq_len(r) for r in p} == lens
    # a forward that fails after some layers swapped rows in: the reservation is given back, and the
    # retry (which rewrites the same slots) reads the new bytes, never the failed step's copies
    real, calls = ops.sparse_mla_decode, []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(*args, **kw)

    monkeypatch.setattr(ops, "sparse_mla_decode", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        off.decode({"a": 7, "b": 8})
    monkeypatch.setattr(ops, "sparse_mla_decode", real)
    assert {r: off.alloc.seq_len(r) for r in p} == lens
    off.pool.resident.check()
    for t in range(2):
        same(on, off, "decode", {"a": 9 + t, "b": 10 + t})


def test_offload_turns_the_dense_fallback_off(model):
    r = Runner(model, 16, "fp8", record=True, offload=OffloadConfig())
    r.extend({"a": prompt(TOPK // 2, 1), "b": prompt(TOPK, 2)})  # every context fits top-k
    assert all(s is not None for s in r.selections.values()), "the dense fallback ran with offload"
    assert r.dense_threshold == 0
    with pytest.raises(ValueError, match="dense_threshold"):
        Runner(model, 16, "fp8", dense_threshold=TOPK, offload=OffloadConfig())
    with pytest.raises(ValueError, match="offload"):
        Runner(model, 16, "fp8", offload=128)


def test_runner_for_layers_takes_offload(model):
    r = Runner.for_layers(CFG, "cpu", 8, offload=OffloadConfig(max_requests=1))
    assert isinstance(r.pool, OffloadKVPool) and r.pool.max_requests == 1


def test_demo_reports_offload(capsys):
    import json

    from flashdsa.cli import main

    rc = main(["demo", "--json", "--layers", "1", "--offload", "--device-buffer", "128"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"] is True and report["offload"] is True and report["device_buffer"] == 128
    assert report["max_abs_vs_on_device"] == 0.0
    assert 0 < report["device_kv_bytes"] and 0 < report["host_kv_bytes"] < report["on_device_kv_bytes"]
    assert report["swap_in_tokens_per_step"] > 0
    assert report["dense_fallback_ran"] is True  # the dense check runs without offload


@pytest.mark.parametrize("argv, flag", [(["--device-buffer", "64"], "--device-buffer"),
                                        (["--offload", "--device-buffer", "100"], "--device-buffer"),
                                        (["--offload", "--device-buffer", "64"], "--device-buffer"),
                                        # more rows than the pool's tokens: refused before anything is allocated
                                        (["--offload", "--device-buffer", str(2 ** 40)], "--device-buffer")])
def test_demo_refuses_bad_offload_flags(capsys, argv, flag):
    from flashdsa.cli import main

    assert main(["demo", "--layers", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flashdsa demo: {flag}: ") and "\n" not in err, err


@pytest.mark.parametrize("next_n", [1, 2, 8, 100])
def test_demo_default_device_buffer_is_one_the_pool_takes(next_n):
    """The default (max(2, next_n) x the tokens a row selects) is cut to the pool's tokens: never a refusal of a
    --device-buffer the user did not pass, and the pool accepts it."""
    from flashdsa.demo.scenario import _offload_config, _scenario, demo_config

    for cfg in (demo_config("tiny", 1), demo_config("tiny", 1, kpool=4)):
        pages = _scenario(cfg, next_n)[2]
        off = _offload_config(cfg, True, None, next_n)
        assert off.device_buffer <= pages * cfg.page_size
        assert off.rows(cfg.index_topk, cfg.index_kpool, pages * cfg.page_size) == off.device_buffer


def test_demo_without_offload_says_so():
    from flashdsa.demo.run import _offload_report

    mem = {"mla": 10, "index": 3, "exact_index": 0, "total": 13}
    rep = _offload_report(None, mem, None, None, 4, 3)
    assert rep == {"offload": False, "device_buffer": None, "device_kv_bytes": 13, "host_kv_bytes": 0,
                   "on_device_kv_bytes": 13, "swap_in_tokens_per_step": None,
                   "swap_in_tokens_per_layer_request": None, "max_abs_vs_on_device": None}


@pytest.mark.gpu
def test_cuda_offload_is_bitwise_the_on_device_runner():
    gpu_model = DSAModel.random(CFG, seed=0, device="cuda")
    on, off = pair(gpu_model, rows=TOPK, device="cuda")
    assert all(t.is_pinned() for t in off.pool.mla_caches)
    p = {"a": prompt(6 * TOPK + 1, 1), "b": prompt(3 * TOPK, 2)}
    same(on, off, "extend", p)
    g = torch.Generator().manual_seed(3)
    for _ in range(16):
        same(on, off, "decode", {r: int(torch.randint(0, CFG.vocab_size, (1,), generator=g)) for r in p})
    assert off.pool.stats["decode"]["rows"] > 0
    off.pool.resident.check()


@pytest.mark.gpu
def test_cuda_graph_refuses_offload():
    gpu_model = DSAModel.random(CFG, seed=0, device="cuda")
    _, off = pair(gpu_model, device="cuda")
    off.extend({"a": prompt(2 * TOPK, 1)})
    with pytest.raises(ValueError, match="offload"):
        DecodeGraph(off, ["a"], max_pages=8)
    assert off.alloc.seq_len("a") == 2 * TOPK
