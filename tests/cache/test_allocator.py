"""Page allocator: property tests over random allocate / extend / free sequences, then the edges one by one."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flashdsa import ops
from flashdsa.cache import BLOCK_TABLE_PAD, OutOfPagesError, PageAllocator


def snapshot(a: PageAllocator):
    """Everything observable about the allocator's state."""
    return (a.free_page_ids, a.num_free_pages, a.num_used_pages,
            {r: a.pages(r) for r in a.req_ids}, {r: a.seq_len(r) for r in a.req_ids})


def formula_slots(pages, start, end, page_size):
    """Slots by the block-table formula, one position at a time (independent of the vectorised code)."""
    return [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]


def check_invariants(a: PageAllocator, model: dict) -> None:
    """No page or slot shared by two live requests, nothing leaked, sizes as the model says."""
    assert sorted(a.req_ids, key=repr) == sorted(model, key=repr)
    free = list(a.free_page_ids)
    assert len(free) == len(set(free)), f"duplicate page in the free list: {free}"
    used = [p for r in a.req_ids for p in a.pages(r)]
    assert len(used) == len(set(used)), "a page belongs to two live requests"
    assert not set(used) & set(free), "a live request's page is also free"
    assert sorted(used + free) == list(range(a.num_pages)), "pages leaked or invented"
    assert a.num_free_pages + a.num_used_pages == a.num_pages and a.num_used_pages == len(used)
    all_slots = []
    for r, n in model.items():
        assert a.seq_len(r) == n
        assert len(a.pages(r)) == -(-n // a.page_size), "pages added before needed (or missing)"
        s = a.slots(r)
        assert s.dtype == torch.int64 and s.shape == (n,)
        assert s.tolist() == formula_slots(a.pages(r), 0, n, a.page_size)
        all_slots += s.tolist()
    assert len(all_slots) == len(set(all_slots)), "a physical slot is shared between live requests"
    assert all(0 <= s < a.num_pages * a.page_size for s in all_slots)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / extend / free with random sizes on a small pool, so running out is common."""

    @initialize(num_pages=st.integers(0, 12), page_size=st.sampled_from([1, 3, 64]))
    def setup(self, num_pages, page_size):
        self.a = PageAllocator(num_pages, page_size)
        self.model: dict[int, int] = {}
        self.next_id = 0

    def _tokens(self, data):
        ps = self.a.page_size
        return data.draw(st.one_of(st.integers(0, 4 * ps + 1), st.sampled_from([ps - 1, ps, ps + 1])))

    def _try(self, fn, needed):
        """Run an allocate/extend; on OutOfPagesError it must have been right to fail and change nothing."""
        before = snapshot(self.a)
        try:
            return fn()
        except OutOfPagesError as e:
            assert needed > before[1], "raised although enough pages were free"
            assert (e.needed, e.free) == (needed, before[1])
            assert snapshot(self.a) == before, "a failed allocation changed the allocator"
            return None

    @rule(data=st.data())
    def allocate(self, data):
        n = self._tokens(data)
        rid, self.next_id = self.next_id, self.next_id + 1
        new = self._try(lambda: self.a.allocate(rid, n), self.a.pages_for(n))
        if new is not None:
            assert len(new) == self.a.pages_for(n)
            self.model[rid] = n

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def extend(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        n = self._tokens(data)
        old_pages = self.a.pages(rid)
        needed = self.a.pages_for(self.model[rid] + n) - len(old_pages)
        new = self._try(lambda: self.a.extend(rid, n), needed)
        if new is not None:
            assert len(new) == needed
            assert self.a.pages(rid) == old_pages + tuple(new), "extend must keep the existing pages in place"
            self.model[rid] += n

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        pages, n_free = self.a.pages(rid), self.a.num_free_pages
        assert tuple(self.a.free(rid)) == pages
        assert self.a.num_free_pages == n_free + len(pages)
        if pages:
            assert self.a.free_page_ids[-len(pages):] == pages, "freed pages join the back of the free list"
        del self.model[rid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        n = data.draw(st.integers(0, self.model[rid]))
        pages, n_free = self.a.pages(rid), self.a.num_free_pages
        keep = self.a.pages_for(n)
        assert tuple(self.a.truncate(rid, n)) == pages[keep:]
        assert self.a.pages(rid) == pages[:keep] and self.a.num_free_pages == n_free + len(pages) - keep
        self.model[rid] = n

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def bad_calls_change_nothing(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        before = snapshot(self.a)
        with pytest.raises(ValueError, match="req_id"):
            self.a.allocate(rid, 1)  # already live
        with pytest.raises(ValueError, match="n_new_tokens"):
            self.a.extend(rid, -1)
        with pytest.raises(ValueError, match="n_tokens"):
            self.a.truncate(rid, self.model[rid] + 1)
        assert snapshot(self.a) == before

    @invariant()
    def consistent(self):
        check_invariants(self.a, self.model)

    @invariant()
    def block_table_matches(self):
        rids = sorted(self.model)
        t = self.a.block_table(rids)
        width = max([len(self.a.pages(r)) for r in rids] + [1])
        assert t.dtype == torch.int32 and t.shape == (len(rids), width)
        for b, r in enumerate(rids):
            p = self.a.pages(r)
            assert t[b, : len(p)].tolist() == list(p)
            assert (t[b, len(p):] == BLOCK_TABLE_PAD).all()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("page_size", [1, 64], ids=lambda p: f"ps{p}")
def test_long_random_sequence(page_size):
    """A few thousand random ops on one pool (longer than hypothesis' runs), checked every 50 ops."""
    rng = random.Random(1234 + page_size)
    a, model, nid, fails = PageAllocator(40, page_size), {}, 0, 0
    for step in range(3000):
        op = rng.choice(["alloc", "alloc", "extend", "extend", "extend", "free", "truncate"])
        n = rng.choice([0, 1, page_size - 1, page_size, page_size + 1, rng.randint(0, 6 * page_size)])
        try:
            if op == "alloc":
                a.allocate(nid, n)
                model[nid], nid = n, nid + 1
            elif op == "extend" and model:
                r = rng.choice(list(model))
                a.extend(r, n)
                model[r] += n
            elif op == "truncate" and model:
                r = rng.choice(list(model))
                model[r] = rng.randint(0, model[r])
                a.truncate(r, model[r])
            elif op == "free" and model:
                r = rng.choice(list(model))
                a.free(r)
                del model[r]
        except OutOfPagesError:
            fails += 1
        if step % 50 == 0:
            check_invariants(a, model)
    check_invariants(a, model)
    assert fails > 50, "the sequence never ran the pool dry; the test would not see out-of-pages paths"
    for r in list(model):
        a.free(r)
    assert a.num_free_pages == 40 and sorted(a.free_page_ids) == list(range(40))


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 128, 129])
def test_allocate_page_count(n):
    a = PageAllocator(10, 64)
    pages = a.allocate("r", n)
    assert len(pages) == -(-n // 64) and a.seq_len("r") == n and a.num_free_pages == 10 - len(pages)


def test_extend_adds_pages_only_when_needed():
    a = PageAllocator(10, 64)
    a.allocate("r", 63)
    assert a.extend("r", 1) == [] and len(a.pages("r")) == 1 and a.seq_len("r") == 64
    assert len(a.extend("r", 1)) == 1 and a.seq_len("r") == 65
    assert a.extend("r", 0) == [] and a.extend("r", 63) == []
    assert len(a.extend("r", 1)) == 1 and a.seq_len("r") == 129 and len(a.pages("r")) == 3
    a.allocate("e", 0)
    assert a.pages("e") == () and len(a.extend("e", 1)) == 1


def test_out_of_pages_error_and_nothing_changes():
    a = PageAllocator(4, 64)
    a.allocate("a", 100)  # 2 pages
    before = snapshot(a)
    with pytest.raises(OutOfPagesError, match=r"needs 3 more page\(s\), 2 free") as e:
        a.allocate("b", 129)
    assert isinstance(e.value, RuntimeError) and (e.value.needed, e.value.free, e.value.req_id) == (3, 2, "b")
    assert snapshot(a) == before and "b" not in a
    with pytest.raises(OutOfPagesError, match=r"needs 3 more page\(s\), 2 free"):
        a.extend("a", 193)  # 293 tokens need 5 pages, it has 2
    assert snapshot(a) == before
    a.extend("a", 28)  # exactly fills page 2: no new page
    a.allocate("b", 128)  # exactly the 2 free pages
    assert a.num_free_pages == 0
    with pytest.raises(OutOfPagesError):
        a.extend("b", 1)
    a.allocate("c", 0)  # zero tokens need zero pages, even on a full pool
    with pytest.raises(OutOfPagesError):
        PageAllocator(0, 64).allocate("x", 1)


def test_truncate_returns_only_pages_past_the_new_length():
    a = PageAllocator(6, 64)
    pages = a.allocate("r", 200)  # 4 pages
    assert a.truncate("r", 200) == [] and a.truncate("r", 193) == []
    assert a.truncate("r", 192) == pages[3:] and a.pages("r") == tuple(pages[:3]) and a.seq_len("r") == 192
    assert a.truncate("r", 129) == [] and a.truncate("r", 65) == pages[2:3] and a.truncate("r", 1) == pages[1:2]
    assert a.slots("r").tolist() == [pages[0] * 64]
    assert a.truncate("r", 0) == pages[:1] and a.pages("r") == () and a.num_free_pages == 6
    assert "r" in a and a.extend("r", 64) and a.seq_len("r") == 64


def test_free_returns_exactly_its_pages_and_they_are_reused():
    a = PageAllocator(6, 64)
    a.allocate("a", 64)
    pb = a.allocate("b", 130)
    a.allocate("c", 64)
    assert a.free("b") == pb and a.num_free_pages == 6 - 2
    assert a.free_page_ids[-3:] == tuple(pb)  # freed pages join the back of the free list
    got = a.allocate("d", 4 * 64)  # the 1 never-used page, then b's pages
    assert got == [5] + pb
    with pytest.raises(ValueError, match="req_id"):
        a.free("b")  # double free
    with pytest.raises(ValueError, match="req_id"):
        a.slots("b")


def test_slots_formula_on_fragmented_pages():
    a = PageAllocator(8, 64)
    for r in "abcd":
        a.allocate(r, 64)  # pages 0, 1, 2, 3
    a.allocate("fill", 4 * 64)  # pages 4..7
    for r in ("c", "a", "fill"):
        a.free(r)  # free list: 2, 0, 4, 5, 6, 7
    a.allocate("x", 150)
    pages = a.pages("x")
    assert pages == (2, 0, 4)  # out of order, so a formula that assumes contiguous pages fails
    for start, end in [(0, 150), (60, 70), (63, 65), (128, 150), (0, 0), (150, 150), (64, 65)]:
        s = a.slots("x", start, end)
        assert s.dtype == torch.int64 and s.tolist() == formula_slots(pages, start, end, 64)
    assert a.slots("x", 63, 66).tolist() == [2 * 64 + 63, 0, 1]
    # fractional bounds used to reach torch.arange, which rounds them up (issue #15)
    for start, end in [(-1, 3), (5, 4), (0, 151), (True, 3), (0, 2.5), (0.5, 3), (0.0, 3)]:
        with pytest.raises(ValueError, match="start, end"):
            a.slots("x", start, end)


def test_block_table_padding_and_width():
    a = PageAllocator(8, 64)
    a.allocate("a", 130)
    a.allocate("b", 1)
    a.allocate("z", 0)
    t = a.block_table(["a", "b", "z"])
    assert t.dtype == torch.int32 and t.shape == (3, 3)
    assert t.tolist() == [[0, 1, 2], [3, BLOCK_TABLE_PAD, BLOCK_TABLE_PAD], [BLOCK_TABLE_PAD] * 3]
    assert BLOCK_TABLE_PAD == 0  # documented: a valid page id, so stray reads stay in bounds
    assert a.block_table(["b", "a"], max_pages=5, pad=-1).tolist() == [[3, -1, -1, -1, -1], [0, 1, 2, -1, -1]]
    assert a.block_table(["z"]).shape == (1, 1)  # never zero-width
    assert a.block_table([]).shape == (0, 1)
    with pytest.raises(ValueError, match="max_pages"):
        a.block_table(["a"], max_pages=2)
    with pytest.raises(ValueError, match="req_id"):
        a.block_table(["a", "nope"])


def test_bad_arguments():
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="num_pages"):
            PageAllocator(bad, 64)
    for bad in (0, -64, 2.0):
        with pytest.raises(ValueError, match="page_size"):
            PageAllocator(4, bad)
    a = PageAllocator(4, 64)
    a.allocate("a", 1)
    before = snapshot(a)
    for bad in (-1, 2.0, False, None):
        with pytest.raises(ValueError, match="n_tokens"):
            a.allocate("b", bad)
    with pytest.raises(ValueError, match="req_id"):
        a.allocate("a", 1)
    with pytest.raises(ValueError, match="req_id"):
        a.extend("b", 1)
    with pytest.raises(ValueError, match="req_id"):
        a.seq_len("b")
    for unhashable in (["a"], {"a": 1}, {1, 2}):  # a TypeError from the dict before (issue #15)
        for call in (lambda r: a.allocate(r, 1), lambda r: a.extend(r, 1), a.seq_len, a.pages, a.free, a.slots,
                     lambda r: a.block_table([r])):
            with pytest.raises(ValueError, match="req_id: expected a hashable id"):
                call(unhashable)
        assert unhashable not in a
    for bad in (0.5, 1.0, True, 2 ** 31, "0"):
        with pytest.raises(ValueError, match="pad"):
            a.block_table(["a"], pad=bad)
    assert snapshot(a) == before


@pytest.mark.parametrize("page_size", [64, 256], ids=lambda p: f"ps{p}")
def test_block_table_matches_topk_slot_translation(page_size):
    """The table and page size we hand out translate positions exactly as topk_transform does."""
    a = PageAllocator(12, page_size)
    lens = [3 * page_size + 5, page_size, 1]
    for i, n in enumerate(lens):
        a.allocate(i, n)
        a.allocate(f"gap{i}", 1)  # interleave so pages are not contiguous per request
    for i in range(3):
        a.free(f"gap{i}")
    a.extend(2, page_size)  # request 2 now spans a freed gap page
    lens[2] += page_size
    L = max(lens)
    logits = torch.randn(3, L)
    table = a.block_table(range(3))
    out = ops.topk_transform(logits, torch.tensor(lens, dtype=torch.int32), topk=L, page_table=table,
                             page_size=page_size, backend="torch")
    for i, n in enumerate(lens):
        assert out[i, :n].tolist() == a.slots(i).tolist()
        assert (out[i, n:] == -1).all()
