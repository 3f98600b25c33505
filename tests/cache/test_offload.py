"""Host offload of the MLA cache (issue 22): the resident map's promises under random operation sequences
(hypothesis), its LRU order, and the offloading pool against the on-device pool, byte for byte.

The resident map is checked against a model of the bytes: every host slot carries a version that each
write bumps, every device row remembers which (slot, version) was copied into it, so a row handed out for
a slot it does not hold (another token, or an older write of the same one) fails the comparison.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashdsa import ops
from flashdsa.cache import KVPool
from flashdsa.cache.metadata import DECODE, TARGET_VERIFY, build_decode
from flashdsa.cache.offload import OffloadConfig, OffloadKVPool, ResidentMap
from flashdsa.config import DSAConfig
from flashdsa.quant import act_quant

CFG = DSAConfig.preset("tiny")  # topk 64, 4 layers, layer 2 skips top-k
TOPK = CFG.index_topk
FORMATS = ["bf16", "fp8", "fp8_raw"]
SCALE = {"bf16": None, "fp8": None, "fp8_raw": 0.02}


# ---- the resident map, property-tested ----------------------------------------------------------------

L, REQS, SLOTS_PER_REQ, BUFFERS, ROWS = 2, 4, 24, 3, 8
S = REQS * SLOTS_PER_REQ  # request q owns slots q * 24 .. q * 24 + 23 (its "pages")


def owned(q: int) -> list[int]:
    return list(range(q * SLOTS_PER_REQ, (q + 1) * SLOTS_PER_REQ))


class Model:
    """The map under test plus the bytes it stands for: host (layer, slot) -> version, device row -> (slot, version)."""

    def __init__(self):
        self.map = ResidentMap(L, S, BUFFERS, ROWS)
        self.host = {(layer, s): 0 for layer in range(L) for s in range(S)}
        self.dev = [dict() for _ in range(L)]

    def state(self):
        m = self.map
        return (m.row_of_slot.clone(), m.slot_of_row.clone(), m.last_used.clone(), dict(m._buffer), list(m._free))

    def assert_state(self, before):
        for a, b in zip(before[:3], self.state()[:3]):
            assert torch.equal(a, b)
        assert before[3:] == self.state()[3:]

    def select(self, q: int, layer: int, sel: torch.Tensor) -> None:
        m = self.map
        try:
            m.acquire([q])
        except ValueError:
            assert m.num_free_buffers == 0 and m.buffer(q) is None
            return
        b = m.buffer(q)
        chosen = set(sel[sel >= 0].tolist())
        before = {s: int(m.row_of_slot[layer, s]) for s in chosen}
        rows, slots = m.swap_in(layer, sel.view(1, -1), torch.tensor([b]))
        # never evicts a row selected this step: no copy lands on a row that held a selected slot
        assert not (set(rows.tolist()) & {r for r in before.values() if r >= 0})
        for r, s in zip(rows.tolist(), slots.tolist()):  # the pool copies host -> device
            self.dev[layer][r] = (s, self.host[layer, s])
        got = m.translate(layer, sel)
        assert got.dtype == torch.int32 and got.shape == sel.shape
        assert torch.equal(got < 0, sel < 0)
        for s, r in zip(sel.tolist(), got.tolist()):
            if s < 0:
                continue
            assert b * ROWS <= r < (b + 1) * ROWS, "a row outside the request's buffer"
            assert self.dev[layer][r] == (s, self.host[layer, s]), "a row holding another token (or an older write)"
            if before[s] >= 0:
                assert r == before[s], "a selected resident row moved"
        m.check()

    def write(self, layer: int, s: int) -> None:
        self.host[layer, s] += 1
        self.map.drop(torch.tensor([s]), layer)
        self.map.check()

    def free(self, q: int) -> None:
        b = self.map.buffer(q)
        self.map.release(q)
        if b is not None:
            rows = slice(b * ROWS, (b + 1) * ROWS)
            assert (self.map.slot_of_row[:, rows] == -1).all() and (self.map.last_used[:, rows] == -1).all()
            ros = self.map.row_of_slot
            assert not ((ros >= b * ROWS) & (ros < (b + 1) * ROWS)).any(), "a slot still maps into a freed buffer"
        self.map.check()


@st.composite
def operations(draw):
    ops_ = []
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["select", "select", "select", "write", "truncate", "free", "too_many"]))
        q = draw(st.integers(0, REQS - 1))
        layer = draw(st.integers(0, L - 1))
        if kind == "select":
            # up to ROWS distinct slots of the request, some repeated (verify rows overlap), -1 padded
            chosen = draw(st.lists(st.sampled_from(owned(q)), min_size=0, max_size=ROWS, unique=True))
            extra = draw(st.lists(st.sampled_from(chosen), max_size=4)) if chosen else []
            pad = draw(st.integers(0, 3))
            order = draw(st.permutations(chosen + extra + [-1] * pad))
            ops_.append(("select", q, layer, list(order)))
        elif kind == "write":
            ops_.append(("write", q, layer, draw(st.sampled_from(owned(q)))))
        elif kind == "truncate":
            ops_.append(("truncate", q, layer, draw(st.lists(st.sampled_from(owned(q)), max_size=6))))
        else:
            ops_.append((kind, q, layer, None))
    return ops_


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations())
def test_resident_map_promises(seq):
    model = Model()
    for kind, q, layer, arg in seq:
        if kind == "select":
            model.select(q, layer, torch.tensor(arg + [-1], dtype=torch.int32))  # never an empty row
        elif kind == "write":
            model.write(layer, arg)
        elif kind == "truncate":
            model.map.drop(torch.tensor(arg, dtype=torch.int64))
            model.map.check()
        elif kind == "free":
            model.free(q)
        else:  # more distinct slots than a buffer holds: refused, nothing changed
            if model.map.buffer(q) is None and model.map.num_free_buffers:
                model.map.acquire([q])
            if model.map.buffer(q) is None:
                continue
            before = model.state()
            with pytest.raises(ValueError, match="device_buffer"):
                model.map.swap_in(layer, torch.tensor([owned(q)[: ROWS + 1]]), torch.tensor([model.map.buffer(q)]))
            model.assert_state(before)
    for q in range(REQS):  # every request ends: nothing is left resident, every buffer is free
        model.free(q)
    assert model.map.resident_rows() == 0 and (model.map.row_of_slot == -1).all()
    assert model.map.num_free_buffers == BUFFERS


def test_lru_evicts_the_least_recently_selected_rows_first():
    m = ResidentMap(1, 64, 1, 4)
    m.acquire(["a"])
    buf = torch.tensor([0])

    def step(slots):
        rows, copied = m.swap_in(0, torch.tensor([slots]), buf)
        return dict(zip(copied.tolist(), rows.tolist()))

    assert step([10, 11, 12, 13]) == {10: 0, 11: 1, 12: 2, 13: 3}  # empty rows first, in order
    assert step([11, 13]) == {}                                     # hits: nothing copied
    assert step([12, 20]) == {20: 0}                                # 10 is the oldest
    assert step([30, 31]) == {30: 1, 31: 3}                         # then 11 and 13 (12 and 20 are newer)
    assert m.translate(0, torch.tensor([12, 20, 30, 31, 10, -1])).tolist() == [2, 0, 1, 3, -1, -1]
    m.check()


def test_acquire_is_all_or_nothing_and_release_reuses_buffers():
    m = ResidentMap(2, 64, 2, 4)
    m.acquire(["a"])
    with pytest.raises(ValueError, match="max_requests"):
        m.acquire(["b", "c"])
    assert m.buffer("b") is None and m.buffer("c") is None and m.num_free_buffers == 1
    m.swap_in(1, torch.tensor([[5, 6]]), torch.tensor([m.buffer("a")]))
    m.release("a")
    m.release("a")  # a request without a buffer: nothing to do
    m.acquire(["b", "c"])
    assert m.resident_rows() == 0
    m.check()


@pytest.mark.parametrize("bad", [dict(device_buffer=100), dict(device_buffer=0), dict(device_buffer=True),
                                 dict(max_requests=0), dict(max_requests=2.0),
                                 dict(device_buffer=2 ** 40),  # rows are addressed as int32
                                 dict(device_buffer=2 ** 27, max_requests=16)])
def test_offload_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        OffloadConfig(**bad)


def test_device_buffer_must_hold_one_selection():
    assert OffloadConfig().rows(TOPK) == 2 * TOPK and OffloadConfig(device_buffer=TOPK).rows(TOPK) == TOPK
    with pytest.raises(ValueError, match="device_buffer"):
        OffloadKVPool(CFG.replace(index_topk=128), 8, offload=OffloadConfig(device_buffer=64))
    with pytest.raises(ValueError, match="offload"):
        OffloadKVPool(CFG, 8, offload={"device_buffer": 64})
    # with kpool a row selects index_topk + c - 1 = 67 tokens: the message says which number it means
    with pytest.raises(ValueError,
                       match=r"^device_buffer: expected >= index_topk \+ index_kpool - 1 \(64 \+ 4 - 1 = 67\)"):
        OffloadKVPool(CFG.replace(index_kpool=4), 8, offload=OffloadConfig(device_buffer=64))
    with pytest.raises(ValueError, match=r"^device_buffer: expected >= index_topk \(128\)"):
        OffloadKVPool(CFG.replace(index_topk=128), 8, offload=OffloadConfig(device_buffer=64))


def test_device_buffer_cannot_exceed_the_pool():
    """No request holds more tokens than the pool (8 pages x 64), so more rows would never be filled: refused
    before the host caches are made."""
    assert OffloadKVPool(CFG, 8, offload=OffloadConfig(device_buffer=512)).buffer_rows == 512
    with pytest.raises(ValueError, match=r"^device_buffer: expected <= 512, the pool's tokens"):
        OffloadKVPool(CFG, 8, offload=OffloadConfig(device_buffer=576))


# ---- the pool against the on-device pool ------------------------------------------------------------

def _pools(fmt: str, rows: int = TOPK, max_requests: int = 4, pages: int = 24):
    on = KVPool(CFG, pages, fmt, kv_scale=SCALE[fmt])
    off = OffloadKVPool(CFG, pages, fmt, kv_scale=SCALE[fmt],
                        offload=OffloadConfig(device_buffer=rows, max_requests=max_requests))
    g = torch.Generator().manual_seed(3)
    for b in off.buffers:  # random bytes: a row the swap-in forgets to fill cannot pass as a zero row
        v = b.view(torch.uint8)
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=g))
    return on, off


def _write_both(on, off, req_lens: dict, g: torch.Generator) -> None:
    for r, n in req_lens.items():
        for pool in (on, off):
            pool.allocator.reserve({r: n})
        slots = on.slots(r, on.allocator.seq_len(r) - n)
        assert torch.equal(slots, off.slots(r, off.allocator.seq_len(r) - n))
        for layer in range(CFG.num_hidden_layers):
            kv = torch.randn(n, 576, generator=g).to(torch.bfloat16)
            keys = None
            if on.has_index_cache(layer):
                k, s = act_quant(torch.randn(n, 128, generator=g), block=128)
                keys = (k, s.squeeze(-1))
            for pool in (on, off):
                pool.write(layer, slots, kv, *(keys or ()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_writes_land_on_the_host_and_read_back_bitwise(fmt):
    on, off = _pools(fmt)
    g = torch.Generator().manual_seed(1)
    _write_both(on, off, {"a": 150, "b": 70}, g)
    for layer in range(CFG.num_hidden_layers):
        assert torch.equal(off.mla_cache(layer).view(torch.uint8), on.mla_cache(layer).view(torch.uint8))
        assert off.mla_cache(layer).device.type == "cpu"
        slots = torch.cat([on.slots("b"), on.slots("a")[::3]])
        assert torch.equal(off.read(layer, slots), on.read(layer, slots))
    for layer in CFG.topk_layers:
        assert torch.equal(off.index_cache(layer), on.index_cache(layer))


@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_over_swapped_rows_is_bitwise_the_on_device_attention(fmt):
    """Decode and verify steps with random selections that change a lot between steps, a buffer of exactly
    top-k rows (so rows are evicted), repeated slots across a request's verify rows, -1 padding, and a
    token rewritten after it was swapped in."""
    on, off = _pools(fmt, rows=2 * TOPK)  # verify steps with 2 rows per request fit
    g = torch.Generator().manual_seed(2)
    lens = {"a": 300, "b": 40, "c": 150}
    _write_both(on, off, lens, g)
    swapped, needed = 0, set()
    for step in range(12):
        n = 2 if step % 4 == 3 else 1
        meta = build_decode(off.allocator, list(lens), n, TARGET_VERIFY if n > 1 else DECODE)
        B = len(lens)
        sel = torch.full((B * n, TOPK), -1, dtype=torch.int32)
        for b, r in enumerate(lens):
            slots = on.slots(r)
            for j in range(n):
                k = min(TOPK - (step % 3), slots.numel())
                pick = torch.randperm(slots.numel(), generator=g)[:k]
                sel[b * n + j, :k] = slots[pick].to(torch.int32)
                if j == 1:  # verify rows of one request share tokens
                    sel[b * n + j, : k // 2] = sel[b * n, : k // 2]
        q = torch.randn(B, n, CFG.num_attention_heads, 576, generator=g).to(torch.bfloat16)
        for layer in range(CFG.num_hidden_layers):
            before = sum(s["rows"] for s in off.stats.values())
            p_on, i_on = on.mla_for_attention(layer, sel, meta)
            p_off, i_off = off.mla_for_attention(layer, sel, meta)
            assert p_off.shape[1:] == p_on.shape[1:] and p_off.shape[0] == off.max_requests * 2 * TOPK // 64
            a = ops.sparse_mla_decode(q, p_on, i_on.view(B, n, -1), 0.1, kv_scale=on.kv_scale, backend="torch")
            b = ops.sparse_mla_decode(q, p_off, i_off.view(B, n, -1), 0.1, kv_scale=off.kv_scale, backend="torch")
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"step {step} layer {layer}"
            swapped += sum(s["rows"] for s in off.stats.values()) - before
            needed |= {(layer, s) for s in sel[sel >= 0].tolist()}
        off.resident.check()
        if step == 5:  # rewrite resident tokens of "a": the next steps must read the new bytes
            rewritten = on.slots("a")[:150]
            for layer in range(CFG.num_hidden_layers):
                kv = torch.randn(150, 576, generator=g).to(torch.bfloat16)
                on.write(layer, rewritten, kv)
                off.write(layer, rewritten, kv)
    # more copies than distinct (layer, token) pairs: rows were evicted (or rewritten) and swapped in again
    assert swapped > len(needed) + 200


def test_verify_batch_that_might_not_fit_is_refused_before_any_row_moves():
    on, off = _pools("fp8", rows=TOPK)
    _write_both(on, off, {"a": 3 * TOPK}, torch.Generator().manual_seed(4))
    off.allocator.reserve({"a": 2})
    meta = build_decode(off.allocator, ["a"], 2, TARGET_VERIFY)
    sel = off.slots("a")[-TOPK:].to(torch.int32).repeat(2, 1)
    with pytest.raises(ValueError, match="device_buffer"):
        off.mla_for_attention(0, sel, meta)
    assert off.resident.buffer("a") is None and off.resident.resident_rows() == 0


def test_free_and_truncate_drop_the_device_rows():
    on, off = _pools("fp8", max_requests=2)
    _write_both(on, off, {"a": 100, "b": 90, "c": 30}, torch.Generator().manual_seed(5))
    meta = build_decode(off.allocator, ["a", "b"], 1, DECODE)
    sel = torch.stack([off.slots("a")[-TOPK:], off.slots("b")[-TOPK:]]).to(torch.int32)
    for layer in range(CFG.num_hidden_layers):
        off.mla_for_attention(layer, sel, meta)
    assert off.resident.resident_rows() == 2 * TOPK * CFG.num_hidden_layers
    with pytest.raises(ValueError, match="max_requests"):  # both buffers are held
        off.mla_for_attention(0, off.slots("c").to(torch.int32).view(1, -1),
                              build_decode(off.allocator, ["c"], 1, DECODE))
    dropped = off.slots("a")[80:]
    off.truncate("a", 80)
    assert off.allocator.seq_len("a") == 80
    assert (off.resident.translate(0, dropped) == -1).all() and off.resident.resident_rows() == (TOPK + 44) * 4
    with pytest.raises(ValueError, match="n_tokens"):
        off.truncate("a", 81)
    off.free("a")
    assert "a" not in off.allocator and off.resident.buffer("a") is None
    assert off.resident.resident_rows() == TOPK * CFG.num_hidden_layers
    off.resident.check()
    off.free("b")
    assert off.resident.resident_rows() == 0 and off.resident.num_free_buffers == 2


def test_memory_accounting_puts_the_mla_cache_on_the_host():
    on, off = _pools("fp8", rows=2 * TOPK, max_requests=3)
    m_on, m_off = on.memory_bytes(), off.memory_bytes()
    assert m_off["host"] == m_on["mla"] == sum(t.numel() * t.element_size() for t in off.mla_caches)
    buffers = 3 * 2 * TOPK * 656 * CFG.num_hidden_layers
    assert m_off["device_buffers"] == buffers
    assert m_off["device"] == m_on["index"] + buffers + off.resident.nbytes()
    assert m_off["total"] == m_off["device"] + m_off["host"]
    assert "host" in repr(off) and "device" in repr(off)


def test_extend_batches_do_not_use_the_hook():
    on, off = _pools("fp8")
    off.allocator.reserve({"a": 3})
    from flashdsa.cache.metadata import build_extend
    meta = build_extend(off.allocator, ["a"], [3], dense_threshold=0)
    with pytest.raises(ValueError, match="batch"):
        off.mla_for_attention(0, torch.zeros(3, TOPK, dtype=torch.int32), meta)


@pytest.mark.gpu
def test_cuda_pool_pins_the_host_cache_and_swaps_bitwise():
    cfg = CFG
    on = KVPool(cfg, 24, "fp8", device="cuda")
    off = OffloadKVPool(cfg, 24, "fp8", device="cuda", offload=OffloadConfig(device_buffer=TOPK, max_requests=2))
    assert all(t.is_pinned() and t.device.type == "cpu" for t in off.mla_caches)
    assert all(b.is_cuda for b in off.buffers) and off.resident.row_of_slot.is_cuda
    g = torch.Generator(device="cuda").manual_seed(0)
    for pool in (on, off):
        pool.allocator.reserve({"a": 300})
    slots = on.slots("a")
    for layer in range(cfg.num_hidden_layers):
        kv = torch.randn(300, 576, generator=g, device="cuda").to(torch.bfloat16)
        on.write(layer, slots, kv)
        off.write(layer, slots, kv)
    meta = build_decode(off.allocator, ["a"], 1, DECODE)
    gc = torch.Generator().manual_seed(1)
    for _ in range(6):
        sel = slots[torch.randperm(300, generator=gc)[:TOPK].cuda()].to(torch.int32).view(1, -1)
        q = torch.randn(1, 1, cfg.num_attention_heads, 576, device="cuda", generator=g).to(torch.bfloat16)
        for layer in range(cfg.num_hidden_layers):
            outs = []
            for pool in (on, off):
                pages, rows = pool.mla_for_attention(layer, sel, meta)
                outs.append(ops.sparse_mla_decode(q, pages, rows.view(1, 1, -1), 0.1))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    off.resident.check()
