"""A Runner call is all or nothing (issue 15): bad input is rejected before anything is reserved, and a
forward that fails gives its reservation back, so the requests are exactly as before — same lengths, same
pages, same free list — and the next valid call returns the same logits, bit for bit, as if the failed
call had never been made."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashdsa import DSAConfig
from flashdsa.cache.allocator import PageAllocator
from flashdsa.engine import DSAModel, Runner

CFG = DSAConfig.preset("tiny").replace(num_hidden_layers=2)
VOCAB = CFG.vocab_size


@pytest.fixture(scope="module")
def model():
    return DSAModel.random(CFG, seed=1)


def state(run: Runner):
    a = run.alloc
    return a.free_page_ids, {r: (a.seq_len(r), a.pages(r)) for r in a.req_ids}


def toks(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


BAD_CALLS = {
    "decode: token past the vocabulary": (lambda r: r.decode({"a": VOCAB}), "tokens"),
    "decode: negative token": (lambda r: r.decode({"a": -1}), "tokens"),
    "decode: float token": (lambda r: r.decode({"a": 3.5}), "tokens"),
    "decode: unknown request": (lambda r: r.decode({"a": 3, "ghost": 5}), "req_ids"),
    "decode: empty batch": (lambda r: r.decode({}), "tokens"),
    "decode: not a dict": (lambda r: r.decode([1, 2]), "tokens"),
    "extend: empty batch": (lambda r: r.extend({}), "chunks"),
    "extend: float ids": (lambda r: r.extend({"a": torch.tensor([1.0, 2.0])}), "chunks"),
    "extend: bool ids": (lambda r: r.extend({"a": torch.tensor([True])}), "chunks"),
    "extend: token past the vocabulary": (lambda r: r.extend({"b": [1, VOCAB + 3]}), "chunks"),
    "extend: empty chunk": (lambda r: r.extend({"a": [4], "b": []}), "chunks"),
    "extend: 2-D ids": (lambda r: r.extend({"b": [[1, 2]]}), "chunks"),
    "verify: unknown request": (lambda r: r.verify({"ghost": [1, 2]}), "req_ids"),
    "verify: ragged drafts": (lambda r: r.verify({"a": [1, 2], "c": [3]}), "drafts"),
    "verify: bad mode": (lambda r: r.verify({"a": [1]}, mode="decode"), "mode"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_changes_nothing(model, name):
    call, arg = BAD_CALLS[name]
    run, ref = Runner(model, 16, "fp8"), Runner(model, 16, "fp8")
    for r in (run, ref):
        r.extend({"a": toks(70, 0), "c": toks(5, 1)})
    before = state(run)
    with pytest.raises(ValueError, match=arg):
        call(run)
    assert state(run) == before
    assert torch.equal(run.decode({"a": 7, "c": 9}), ref.decode({"a": 7, "c": 9}))


class Boom(RuntimeError):
    pass


def fail_in_layer(monkeypatch, model, layer: int):
    """Make the given layer's attention raise after the earlier layers wrote their caches."""
    attn = model.layers[layer].self_attn

    def boom(*args, **kwargs):
        raise Boom("injected")
    monkeypatch.setattr(attn, "forward", boom)


@pytest.mark.parametrize("call", ["extend-new", "extend-existing", "decode", "verify"])
def test_failed_forward_gives_its_reservation_back(model, monkeypatch, call):
    run, ref = Runner(model, 16, "fp8"), Runner(model, 16, "fp8")
    for r in (run, ref):
        r.extend({"a": toks(63, 2)})
    before = state(run)
    with monkeypatch.context() as m:
        fail_in_layer(m, model, 1)
        with pytest.raises(Boom):
            {"extend-new": lambda: run.extend({"b": toks(130, 3)}),
             "extend-existing": lambda: run.extend({"a": toks(3, 4), "b": toks(2, 5)}),
             "decode": lambda: run.decode({"a": 1}),
             "verify": lambda: run.verify({"a": [1, 2, 3]})}[call]()
    assert state(run) == before
    # the slots the failed call wrote are past every length: the next calls see nothing of it
    assert torch.equal(run.extend({"a": toks(2, 6), "b": toks(66, 7)}), ref.extend({"a": toks(2, 6), "b": toks(66, 7)}))
    assert torch.equal(run.decode({"a": 5, "b": 6}), ref.decode({"a": 5, "b": 6}))


def test_reserve_is_all_or_nothing_and_undo_is_exact():
    a = PageAllocator(8, 4)
    a.allocate("x", 5)
    a.allocate("y", 1)
    a.free("x")  # a free list that is not in id order
    snap = (a.free_page_ids, {r: (a.seq_len(r), a.pages(r)) for r in a.req_ids})
    res = a.reserve({"y": 6, "z": 9, "w": 0})
    assert a.seq_len("y") == 7 and a.seq_len("z") == 9 and a.seq_len("w") == 0
    a.undo(res)
    assert (a.free_page_ids, {r: (a.seq_len(r), a.pages(r)) for r in a.req_ids}) == snap
    with pytest.raises(Exception, match="out of KV pages"):
        a.reserve({"y": 3, "z": 100})
    with pytest.raises(ValueError, match="new_tokens"):
        a.reserve({"y": 3, "z": -1})
    assert (a.free_page_ids, {r: (a.seq_len(r), a.pages(r)) for r in a.req_ids}) == snap
    res = a.reserve({"y": 4})
    a.truncate("y", 1)
    with pytest.raises(ValueError, match="changed since"):
        a.undo(res)


def test_decode_picks_the_mode_in_one_place(model):
    run = Runner(model, 16, "fp8")
    run.extend({"a": toks(10, 8)})
    meta, res = run.prepare({"a": 1})
    assert meta.mode == "decode"
    run.undo(res)
    meta, res = run.prepare({"a": 1, "new": 1})
    assert meta.mode == "extend"  # a new request has no cached token to decode from
    run.undo(res)
    with pytest.raises(ValueError, match="req_ids"):
        run.prepare({"new": 1}, "decode")
    assert run.alloc.req_ids == ["a"] and run.alloc.seq_len("a") == 10


# One call of a random mix: (kind, valid?)
CALLS = st.lists(st.tuples(st.sampled_from(["extend", "decode", "verify"]), st.booleans(), st.integers(0, 10 ** 6)),
                 min_size=1, max_size=5)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=CALLS)
def test_random_mix_of_valid_and_invalid_calls(model, calls):
    """A run that also makes invalid calls (bad ids, unknown requests, an injected failure mid-forward) ends in
    the same state with the same logits as a run of the valid calls alone."""
    run, ref = Runner(model, 24, "fp8"), Runner(model, 24, "fp8")
    for r in (run, ref):
        r.extend({"a": toks(40, 9)})
    for kind, valid, seed in calls:
        g = torch.Generator().manual_seed(seed)
        if kind == "extend":
            batch = {"a": toks(1 + seed % 7, seed), f"n{seed % 3}": toks(1 + seed % 70, seed + 1)}
        elif kind == "decode":
            batch = {r: int(torch.randint(0, VOCAB, (1,), generator=g)) for r in ref.alloc.req_ids}
        else:
            batch = {r: torch.randint(0, VOCAB, (2,), generator=g).tolist() for r in ref.alloc.req_ids}
        do = {"extend": lambda r, b: r.extend(b), "decode": lambda r, b: r.decode(b),
              "verify": lambda r, b: r.verify(b)}[kind]
        if valid:
            assert torch.equal(do(run, batch), do(ref, batch))
            continue
        before = state(run)
        if seed % 2:  # bad input: a token id past the vocabulary
            first = next(iter(batch))
            bad = dict(batch)
            bad[first] = VOCAB if kind == "decode" else [VOCAB] * len(batch[first])
            with pytest.raises(ValueError):
                do(run, bad)
        else:  # a failure in the middle of the forward
            attn = model.layers[1].self_attn
            attn.forward = lambda *a, **k: (_ for _ in ()).throw(Boom("injected"))
            try:
                with pytest.raises(Boom):
                    do(run, batch)
            finally:
                del attn.forward
        assert state(run) == before
    last = {r: 3 for r in ref.alloc.req_ids}
    assert torch.equal(run.decode(last), ref.decode(last))
