"""The pieces of flashdsa.parallel that need no process group: who owns which token, the DCP shards and
their allocator, the exact merge of per-rank top-ks (simulated ranks, adversarial ties), byte packing."""

from __future__ import annotations

import pytest
import torch

from flashdsa import ops
from flashdsa.cache.allocator import OutOfPagesError, PageAllocator
from flashdsa.parallel import KVShards, ShardedAllocator, merge_topk, token_owners
from flashdsa.parallel.comm import layout, pack_rows, unpack_rows

BATCHES = [[7], [1], [0, 3], [5, 2, 1], [100, 37, 5, 1], [13, 13, 13], [64, 1, 0, 9]]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("split", ["interleave", "zigzag"])
@pytest.mark.parametrize("q_lens", BATCHES, ids=lambda q: "-".join(map(str, q)))
def test_every_rank_holds_floor_or_ceil_of_t_over_p(q_lens, split, world):
    owners = token_owners(q_lens, world, split)
    T = sum(q_lens)
    assert owners.shape == (T,) and owners.dtype == torch.int64
    counts = torch.bincount(owners, minlength=world)
    assert counts.shape == (world,) and int(counts.sum()) == T
    assert int(counts.max()) == -(-T // world) and int(counts.min()) == T // world  # the padded gather's rows


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("q_lens", BATCHES, ids=lambda q: "-".join(map(str, q)))
def test_zigzag_gives_rank_r_chunks_r_and_2p_minus_1_minus_r(q_lens, world):
    owners = token_owners(q_lens, world, "zigzag").tolist()
    start = 0
    for n in q_lens:
        o, base, at = owners[start:start + n], n // (2 * world), 0
        start += n
        # chunks 0 .. 2p-1 in order, n // 2p or n // 2p + 1 tokens each; the middle two are both rank
        # p-1's and read as one run of twice that
        runs = [(r, 1) for r in range(world - 1)] + [(world - 1, 2)] + [(r, 1) for r in reversed(range(world - 1))]
        for r, parts in runs:
            size = 0
            while at < n and o[at] == r and size < parts * (base + 1):
                at, size = at + 1, size + 1
            assert parts * base <= size <= parts * (base + 1), (n, o)
        assert at == n, (n, o)


def test_interleave_is_token_mod_p():
    assert token_owners([3, 4], 3, "interleave").tolist() == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("kw, name", [
    (dict(q_lens=[3], world=0, split="zigzag"), "world"), (dict(q_lens=[3], world=2, split="ring"), "split"),
    (dict(q_lens=[-1], world=2, split="zigzag"), "q_lens"), (dict(q_lens=[1.5], world=2, split="zigzag"), "q_lens"),
])
def test_token_owners_rejects_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=name):
        token_owners(**kw)


@pytest.mark.parametrize("world, block", [(1, 1), (2, 1), (3, 1), (2, 3), (3, 64)])
def test_kv_shards_partition_positions_in_order(world, block):
    t = torch.arange(1000)
    seen = torch.zeros(1000, dtype=torch.bool)
    for rank in range(world):
        sh = KVShards(world, rank, block)
        mine = t[sh.owner(t) == rank]
        assert not seen[mine].any()
        seen[mine] = True
        assert torch.equal(sh.local(mine), torch.arange(mine.numel()))  # local order is position order
        assert torch.equal(sh.to_global(torch.arange(mine.numel())), mine)
        for n in (0, 1, block, world * block - 1, 999, 1000):
            assert sh.count(n) == int((mine < n).sum()) == int(sh.counts(torch.tensor(n)))
    assert seen.all()


@pytest.mark.parametrize("kw, name", [(dict(world=0, rank=0), "world"), (dict(world=2, rank=2), "rank"),
                                      (dict(world=2, rank=0, block=0), "block")])
def test_kv_shards_reject_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=name):
        KVShards(**kw)


def test_sharded_allocator_counts_globally_reserves_locally_and_undoes():
    local = PageAllocator(4, 4)
    alloc = ShardedAllocator(local, KVShards(2, 1))      # rank 1 of 2: odd positions
    res = alloc.reserve({"a": 9, "b": 1})                # a: 4 of its 9 tokens here, b: none
    assert alloc.seq_len("a") == 9 and local.seq_len("a") == 4 and alloc.seq_len("b") == 1 and local.seq_len("b") == 0
    before = (local.free_page_ids, alloc.seq_len("a"))
    res2 = alloc.reserve({"a": 8, "b": 2})
    assert alloc.seq_len("a") == 17 and local.seq_len("a") == 8 and local.seq_len("b") == 1
    alloc.undo(res2)
    assert (local.free_page_ids, alloc.seq_len("a")) == before
    with pytest.raises(OutOfPagesError):
        alloc.reserve({"a": 40})
    assert alloc.seq_len("a") == 9  # nothing changed
    with pytest.raises(ValueError, match="new_tokens"):
        alloc.reserve({"a": -1})
    alloc.truncate("a", 3)
    assert alloc.seq_len("a") == 3 and local.seq_len("a") == 1
    with pytest.raises(ValueError, match="n_tokens"):
        alloc.truncate("a", 4)
    alloc.undo(res)  # the first reservation created both requests
    assert "a" not in alloc and "b" not in alloc and local.num_free_pages == 4


def _levels(R: int, L: int, levels: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (R, L), generator=g).float() / levels
    x[0, ::3] = float("-inf")
    x[1, 5:9] = float("nan")  # topk_transform's rule: NaN counts as -inf
    x[2] = -0.0
    x[2, ::2] = 0.0           # -0.0 == +0.0: a 2-way tie across signs
    return x


@pytest.mark.parametrize("world, block", [(2, 1), (3, 1), (2, 3), (3, 5)])
@pytest.mark.parametrize("levels", [2, 7, 1000])
def test_merge_of_rank_topks_is_the_global_topk_bitwise(world, block, levels):
    R, L, k = 9, 200, 16
    logits = _levels(R, L, levels, seed=levels + world)
    lengths = torch.tensor([200, 150, 77, 16, 15, 3, 1, 0, 199], dtype=torch.int32)
    want = ops.topk_transform(logits, lengths, k, backend="torch").long()
    scores, positions = [], []
    for rank in range(world):  # what each rank computes over the keys it holds
        sh = KVShards(world, rank, block)
        mine = torch.arange(L)[sh.owner(torch.arange(L)) == rank]
        local = logits[:, mine].contiguous()
        pos = ops.topk_transform(local, sh.counts(lengths.long()).to(torch.int32), k, backend="torch")
        scores.append(local.gather(1, pos.clamp(min=0).long()))
        positions.append(torch.where(pos >= 0, sh.to_global(pos.long()), -1))
    got = merge_topk(torch.stack(scores), torch.stack(positions), k, backend="torch")
    assert torch.equal(got, want)


def test_pack_rows_round_trips_any_dtype_and_empty():
    kv = torch.randn(5, 576).bfloat16()
    k = torch.randn(5, 128).to(torch.float8_e4m3fn)
    s = torch.rand(5)
    rows = pack_rows(kv, k, s)
    assert rows.shape == (5, 1152 + 128 + 4) and rows.dtype == torch.uint8
    a, b, c = unpack_rows(rows, layout(kv, k, s))
    assert torch.equal(a, kv) and torch.equal(b.view(torch.uint8), k.view(torch.uint8)) and torch.equal(c, s)
    empty = unpack_rows(pack_rows(kv[:0], k[:0], s[:0]), layout(kv, k, s))
    assert [t.shape for t in empty] == [(0, 576), (0, 128), (0,)]
    with pytest.raises(ValueError, match="like"):
        unpack_rows(rows, layout(kv, k))


@pytest.mark.parametrize("device", ["gpu", "cuda:x", None, 3, "meta"], ids=repr)  # (an id "gpu" would be a marker)
def test_init_names_a_bad_device(device, monkeypatch):
    """Refused before the group is joined, as torchrun's environment would have it."""
    from flashdsa.parallel import init

    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=r"^device: expected 'cpu', 'cuda', 'cuda:N' or a torch\.device, got "):
        init(device)
