"""KV pool: cache shapes per format, writes touch only their slots, skip layers, kpool, memory accounting."""

from __future__ import annotations

import pytest
import torch

from flashdsa import ops
from flashdsa.cache import KVPool, OutOfPagesError, layouts, page_bytes
from flashdsa.config import DSAConfig
from flashdsa.quant import act_quant

FORMATS = ["bf16", "fp8", "fp8_raw", "fp32"]
SCALE = {"bf16": None, "fp8": None, "fp8_raw": 0.02, "fp32": None}
WIDTH = {"bf16": (torch.bfloat16, 576), "fp8": (torch.uint8, 656), "fp8_raw": (torch.uint8, 576),
         "fp32": (torch.float32, 576)}


def tiny(c: int = 1) -> DSAConfig:
    cfg = DSAConfig.preset("tiny")
    return cfg if c == 1 else cfg.replace(index_kpool=c)


def fill_random(pool: KVPool) -> None:
    """Random bytes everywhere, so a stray write (even of zeros) shows up."""
    g = torch.Generator().manual_seed(7)
    for t in pool.mla_caches + list(pool.index_caches.values()):
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))


def all_bytes(pool: KVPool) -> dict:
    out = {("mla", i): t.view(torch.uint8).clone() for i, t in enumerate(pool.mla_caches)}
    out.update({("index", i): t.clone() for i, t in pool.index_caches.items()})
    return out


def index_keys(m: int):
    k, s = act_quant(torch.randn(m, 128) * 3, block=128)
    return k, s.squeeze(-1)


def rows_of(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    flat = cache.view(torch.uint8).reshape(-1, cache.shape[-1] * cache.element_size())
    return flat[slots]


def assert_only_rows_changed(pool, before, layer, mla_slots, index_slots):
    """Every byte outside the given rows of the given layer is as before."""
    for (kind, i), old in before.items():
        new = (pool.mla_caches[i].view(torch.uint8) if kind == "mla" else pool.index_caches[i]).clone()
        if i == layer and kind == "mla":
            flat_new, flat_old = new.reshape(-1, new.shape[-1]), old.reshape(-1, old.shape[-1])
            keep = torch.ones(flat_new.shape[0], dtype=torch.bool)
            keep[mla_slots] = False
            assert torch.equal(flat_new[keep], flat_old[keep]), f"layer {i} MLA: a row outside the slots changed"
        elif i == layer and kind == "index" and index_slots is not None:
            keys_n, sc_n = layouts.index_page_views(new)
            keys_o, sc_o = layouts.index_page_views(old)
            keep = torch.ones(keys_n.shape[0] * 64, dtype=torch.bool)
            keep[index_slots] = False
            assert torch.equal(keys_n.reshape(-1, 128).view(torch.uint8)[keep], keys_o.reshape(-1, 128).view(torch.uint8)[keep])
            assert torch.equal(sc_n.reshape(-1).view(torch.int32)[keep], sc_o.reshape(-1).view(torch.int32)[keep])
        else:
            assert torch.equal(new, old), f"{kind} cache of layer {i} changed; only layer {layer} was written"


@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_shapes_per_format(fmt):
    cfg = tiny()
    pool = KVPool(cfg, 5, fmt, kv_scale=SCALE[fmt])
    dtype, width = WIDTH[fmt]
    assert len(pool.mla_caches) == cfg.num_hidden_layers
    for layer in range(cfg.num_hidden_layers):
        t = pool.mla_cache(layer)
        assert t.shape == (5, 64, width) and t.dtype == dtype and t.is_contiguous()
        assert layouts.mla_cache_format(t) == fmt
    assert sorted(pool.index_caches) == cfg.topk_layers == [0, 1, 3]
    for layer in cfg.topk_layers:
        assert pool.index_cache(layer).shape == (5, 8448) and pool.index_cache(layer).dtype == torch.uint8


def test_skip_layer_has_no_indexer_cache():
    cfg = tiny()
    assert cfg.skip_topk_layers == [2]
    pool = KVPool(cfg, 2, "fp8")
    assert not pool.has_index_cache(2) and pool.has_index_cache(3)
    with pytest.raises(ValueError, match="layer 2 skips top-k .* no indexer cache"):
        pool.index_cache(2)
    with pytest.raises(ValueError, match="layer"):
        pool.mla_cache(4)
    pool.allocator.allocate("r", 10)
    s = pool.slots("r")
    with pytest.raises(ValueError, match="no indexer cache"):
        pool.read_index(2, s)
    fill_random(pool)
    before = all_bytes(pool)
    k, ks = index_keys(10)
    with pytest.raises(ValueError, match="layer 2 skips top-k"):
        pool.write(2, s, torch.randn(10, 576), k, ks)
    assert_only_rows_changed(pool, before, 2, [], None)  # nothing written, not even the MLA rows
    pool.write(2, s, torch.randn(10, 576))  # MLA alone is fine on a skip layer
    assert_only_rows_changed(pool, before, 2, s, None)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lens", [(1,), (63, 64, 65), (130, 0, 7)], ids=lambda l: "n" + "-".join(map(str, l)))
def test_write_touches_only_given_slots(fmt, lens):
    pool = KVPool(tiny(), 9, fmt, kv_scale=SCALE[fmt])
    fill_random(pool)
    for i, n in enumerate(lens):
        pool.allocator.allocate(i, n)
    layer = 1
    for i, n in enumerate(lens):
        before = all_bytes(pool)
        start = n // 3  # write a suffix (as an extend step would), not always the whole request
        s = pool.slots(i, start, n)
        kv = torch.randn(n - start, 576, dtype=torch.bfloat16)
        k, ks = index_keys(n - start)
        pool.write(layer, s, kv, k, ks)
        assert_only_rows_changed(pool, before, layer, s, s)
        want = layouts.encode_mla(kv, fmt, SCALE[fmt]).view(torch.uint8).reshape(len(s), pool.mla_cache(layer)[0, 0].nbytes)
        assert torch.equal(rows_of(pool.mla_cache(layer), s), want)
        got_k, got_s = pool.read_index(layer, s)
        assert torch.equal(got_k.view(torch.uint8), k.view(torch.uint8)) and torch.equal(got_s, ks)
        if fmt in ("bf16", "fp32"):  # kept as written (fp32: bf16 inputs widen exactly)
            got = pool.read(layer, s)
            assert got.dtype == WIDTH[fmt][0] and torch.equal(got.float(), kv.float())


def test_failed_write_changes_nothing():
    pool = KVPool(tiny(), 3, "fp8")
    fill_random(pool)
    pool.allocator.allocate("r", 70)
    s = pool.slots("r")
    kv = torch.randn(70, 576)
    k, ks = index_keys(70)
    before = all_bytes(pool)
    bad = [
        (dict(slots=s[:-1]), "kv"),
        (dict(kv=kv[:, :512]), "kv"),
        (dict(slots=s.float()), "slots"),
        (dict(slots=torch.full((70,), 3 * 64)), "slots"),
        (dict(index_k_fp8=k[:5]), "index_k_fp8"),
        (dict(index_k_fp8=k.float()), "index_k_fp8"),
        (dict(index_k_scale=ks.double()), "index_k_scale"),
        (dict(index_k_scale=None), "index_k_scale"),
        (dict(index_slots=torch.full((70,), 3 * 64)), "index_slots"),
        # documented as distinct, accepted before issue #15 (the scatter kept whichever row came last)
        (dict(slots=torch.cat([s[:-1], s[:1]])), "slots: expected distinct slots"),
        (dict(index_slots=torch.cat([s[1:], s[-1:]])), "index_slots: expected distinct slots"),
        (dict(slots=s.clone().fill_(s[3])), "slots: expected distinct slots"),
        # a NaN key is refused by store_index_keys: it must be refused before the MLA rows are written
        (dict(index_k_fp8=torch.cat([k[:-1], torch.full((1, 128), float("nan")).to(k.dtype)])), "index_k_fp8"),
    ]
    for change, name in bad:
        args = dict(slots=s, kv=kv, index_k_fp8=k, index_k_scale=ks) | change
        with pytest.raises(ValueError, match=name):
            pool.write(0, **args)
        assert_only_rows_changed(pool, before, 0, [], None)
    with pytest.raises(ValueError, match="index_slots"):
        pool.write(0, s, kv, index_slots=s)  # slots for keys that were not given


def test_constructor_arguments():
    cfg = tiny()
    with pytest.raises(ValueError, match="kv_format"):
        KVPool(cfg, 2, "fp16")
    with pytest.raises(ValueError, match="kv_scale"):
        KVPool(cfg, 2, "fp8_raw")
    with pytest.raises(ValueError, match="kv_scale"):
        KVPool(cfg, 2, "fp8_raw", kv_scale=0.0)
    with pytest.raises(ValueError, match="kv_scale"):
        KVPool(cfg, 2, "bf16", kv_scale=1.0)
    with pytest.raises(ValueError, match="num_pages"):
        KVPool(cfg, 0, "bf16")
    with pytest.raises(ValueError, match="config"):
        KVPool(cfg.replace(qk_rope_head_dim=32), 2, "bf16")


def test_pool_allocator_runs_out_cleanly():
    pool = KVPool(tiny(), 2, "fp8")
    pool.allocator.allocate("a", 100)
    with pytest.raises(OutOfPagesError, match="needs 1 more page"):
        pool.allocator.allocate("b", 1)
    assert pool.allocator.num_free_pages == 0 and "b" not in pool.allocator


def _expected_memory(cfg: DSAConfig, fmt: str, pages: int) -> dict:
    mla = cfg.num_hidden_layers * pages * cfg.page_size * layouts.BYTES_PER_TOKEN[fmt]
    index = len(cfg.topk_layers) * pages * 8448
    return {"mla": mla, "index": index, "total": mla + index}


@pytest.mark.parametrize("fmt", FORMATS)
def test_nope_model_gets_rows_without_a_rope_part(fmt):
    """qk_rope_head_dim 0 (GLM-5.3-Flash): 512-dim rows, 528 B in fp8; written and read back as 512 dims,
    counted at their size; a 576-dim row is refused."""
    cfg = tiny().replace(qk_rope_head_dim=0)
    pool = KVPool(cfg, 3, fmt, kv_scale=SCALE[fmt])
    dtype, width = WIDTH[fmt]
    width = 528 if fmt == "fp8" else 512
    assert pool.mla_dim == 512
    for t in pool.mla_caches:
        assert t.shape == (3, 64, width) and t.dtype == dtype and layouts.mla_cache_layout(t) == (fmt, 0)
    row = {"bf16": 1024, "fp8": 528, "fp8_raw": 512, "fp32": 2048}[fmt]
    assert pool.memory_bytes()["mla_per_token"] == cfg.num_hidden_layers * row
    assert page_bytes(cfg, fmt) == pool.memory_bytes()["total"] // 3
    kv = torch.randn(5, 512)
    slots = torch.tensor([0, 3, 64, 65, 191])
    pool.write(2, slots, kv)
    want = layouts.decode_mla(layouts.encode_mla(kv, fmt, SCALE[fmt]), SCALE[fmt])
    assert torch.equal(pool.read(2, slots), want)
    with pytest.raises(ValueError, match=r"^kv: expected a float tensor \[5, 512\]"):
        pool.write(2, slots, torch.randn(5, 576))


@pytest.mark.parametrize("preset,pages", [("tiny", 3), ("v32", 2)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_memory_accounting(preset, pages, fmt):
    cfg = DSAConfig.preset(preset)
    pool = KVPool(cfg, pages, fmt, kv_scale=SCALE[fmt])
    m = pool.memory_bytes()
    exp = _expected_memory(cfg, fmt, pages)
    assert {k: m[k] for k in exp} == exp
    held = {"mla": sum(t.numel() * t.element_size() for t in pool.mla_caches),
            "index": sum(t.numel() * t.element_size() for t in pool.index_caches.values())}
    assert held["mla"] == m["mla"] and held["index"] == m["index"]
    tokens = pages * cfg.page_size
    assert m["total_per_token"] == pool.bytes_per_token() == m["total"] / tokens
    assert m["mla_per_token"] == cfg.num_hidden_layers * {"bf16": 1152, "fp8": 656, "fp8_raw": 576, "fp32": 2304}[fmt]
    assert m["index_per_token"] == len(cfg.topk_layers) * 132
    assert page_bytes(cfg, fmt) == m["total"] // pages
    if preset == "v32" and fmt == "fp8":
        # docs/DSA.md §4: 61 layers, fp8 MLA ~ 40 KB/token, + indexer ~ 48 KB, indexer ~ 17 %.
        assert (m["mla_per_token"], m["total_per_token"]) == (61 * 656, 61 * (656 + 132))
        assert 0.16 < m["index_per_token"] / m["total_per_token"] < 0.18


@pytest.mark.parametrize("fmt", ["fp8", "bf16", "fp32"])
def test_from_memory(fmt):
    cfg = tiny()
    per_page = page_bytes(cfg, fmt)
    assert per_page == 4 * 64 * layouts.BYTES_PER_TOKEN[fmt] + 3 * 8448
    for budget, pages in [(per_page, 1), (7 * per_page, 7), (7 * per_page + per_page - 1, 7)]:
        pool = KVPool.from_memory(cfg, budget, fmt)
        assert pool.num_pages == pages and pool.memory_bytes()["total"] <= budget
    with pytest.raises(ValueError, match="bytes_budget"):
        KVPool.from_memory(cfg, per_page - 1, fmt)
    c4 = tiny(4)
    assert KVPool.from_memory(c4, 3 * page_bytes(c4, fmt), fmt).num_pages == 3


def test_kpool_config_and_shapes():
    cfg = tiny(4)
    assert cfg.index_kpool == 4 and cfg.page_size == 256 and cfg.index_topk % 4 == 0
    pool = KVPool(cfg, 4, "fp8")
    assert pool.mla_cache(0).shape == (4, 256, 656)
    assert pool.index_cache(0).shape == (4, 8448)  # one page still holds 64 (pooled) keys
    m = pool.memory_bytes()
    assert m["index"] == 3 * 4 * 8448 and m["index_per_token"] == 3 * 132 / 4
    assert m["mla"] == 4 * 4 * 256 * 656


def test_kpool_slots_share_page_ids():
    """c = 4: token p at page pages[p // 256]; pooled key g (tokens 4g .. 4g + 3) at page pages[g // 64]."""
    c = 4
    pool = KVPool(tiny(c), 3, "bf16")
    fill_random(pool)
    a = pool.allocator
    a.allocate("gap", 1)
    a.allocate("r", 300)
    a.free("gap")
    a.extend("r", 300)  # 600 tokens on pages (1, 2, 0): out of order on purpose
    pages = a.pages("r")
    assert pages == (1, 2, 0)
    n_pooled = -(-600 // c)
    ts, gs = pool.slots("r"), pool.index_slots("r")
    assert ts.shape == (600,) and gs.shape == (n_pooled,)
    for g in range(n_pooled):
        assert gs[g] == pages[g // 64] * 64 + g % 64
        for p in range(c * g, min(c * g + c, 600)):
            assert ts[p] // 256 == gs[g] // 64, "a pooled key and its tokens must share a page id"
    assert pool.index_slots("r", 10, 70).tolist() == gs[10:70].tolist()
    with pytest.raises(ValueError, match="start, end"):
        pool.index_slots("r", 0, n_pooled + 1)
    before = all_bytes(pool)
    kv = torch.randn(600, 576, dtype=torch.bfloat16)
    k, ks = index_keys(n_pooled)
    with pytest.raises(ValueError, match="index_slots"):
        pool.write(0, ts, kv, k, ks)  # with c > 1 the pooled keys' slots must be given
    pool.write(0, ts, kv, k, ks, index_slots=gs)
    assert_only_rows_changed(pool, before, 0, ts, gs)
    assert torch.equal(pool.read(0, ts), kv)
    got_k, got_s = pool.read_index(0, gs)
    assert torch.equal(got_k.view(torch.uint8), k.view(torch.uint8)) and torch.equal(got_s, ks)


def test_block_table_feeds_paged_indexer():
    """Keys written through the pool and read by indexer_logits_paged via pool.block_table give the same
    logits as the ragged op on the same keys, so the table is what the paged op expects."""
    pool = KVPool(tiny(), 8, "fp8")
    fill_random(pool)
    lens = [70, 1, 129]
    keys = []
    for i, n in enumerate(lens):
        pool.allocator.allocate(i, n)
        if i == 0:
            pool.allocator.allocate("gap", 64)
    pool.allocator.free("gap")
    pool.allocator.extend(1, 100)
    lens[1] += 100
    for i, n in enumerate(lens):
        k, ks = index_keys(n)
        pool.write(3, pool.slots(i), torch.randn(n, 576), k, ks)
        keys.append((k, ks))
    B, H = len(lens), 4
    q, _ = act_quant(torch.randn(B, 1, H, 128), block=128)
    w = torch.randn(B, H)
    table = pool.block_table(range(B))
    ctx = torch.tensor(lens, dtype=torch.int32)[:, None]
    paged = ops.indexer_logits_paged(q, pool.index_cache(3), w, ctx, table, max(lens), backend="torch")
    for b, (k, ks) in enumerate(keys):
        z = torch.zeros(1, dtype=torch.int32)
        ragged = ops.indexer_logits_ragged(q[b, 0][None], k, ks, w[b][None], z, z + lens[b], backend="torch")
        assert torch.equal(paged[b, : lens[b]], ragged[0])
        assert torch.isneginf(paged[b, lens[b]:]).all()
