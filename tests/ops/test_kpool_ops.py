"""kpool's ops: kpool_expand (groups -> token slots + the tail) and kpool_compress (the pooled index key of a
group), torch reference against a plain formulation written here, Triton (interpreter on CPU) against
the reference; outputs poisoned; bad input a ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

from flashdsa.ops import kpool_compress, kpool_expand
from flashdsa.ops.kpool import reference
from flashdsa.ops.kpool import triton as kernels
from flashdsa.quant import act_quant, hadamard
from flashdsa.testing.inputs import poison_torch_empty

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 128


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    poison_torch_empty(monkeypatch)


# ---- kpool_expand --------------------------------------------------------------------------------------

def _plain_expand(groups, lengths, c, table=None, offsets=None, page_size=64):
    """The contract, one row at a time in Python lists."""
    R, G = groups.shape
    out = []
    for r in range(R):
        L = int(lengths[r])
        n = L // c
        toks = [int(g) * c + i for g in groups[r, : min(G, n)].tolist() for i in range(c)]
        toks += list(range(n * c, L))
        if table is not None:
            row = table[r // (R // table.shape[0])]
            toks = [int(row[t // page_size]) * page_size + t % page_size for t in toks]
        elif offsets is not None:
            toks = [t + int(offsets[r]) for t in toks]
        out.append(toks + [-1] * (G * c + c - 1 - len(toks)))
    return torch.tensor(out, dtype=torch.int32).view(R, G * c + c - 1)


def _groups(lengths, c, G, g):
    """What topk_transform gives for random logits over lengths // c groups: ascending ids, then -1."""
    rows = []
    for L in lengths.tolist():
        n = L // c
        pick = torch.randperm(n, generator=g)[: min(G, n)].sort().values.tolist()
        rows.append(pick + [-1] * (G - len(pick)))
    return torch.tensor(rows, dtype=torch.int32).view(len(lengths), G)


# lengths around the group and top-k boundaries: empty, < c, = c, one group + tail, exactly topk tokens
# (G groups, no tail), topk + 1 (G groups of G + 1 possible... and a tail of 1), long
@pytest.mark.parametrize("c, G", [(1, 6), (2, 5), (4, 4), (8, 3)], ids=lambda v: str(v))
@pytest.mark.parametrize("mode", ["plain", "offsets", "table", "table-g3"])
def test_expand_matches_plain_formulation(c, G, mode):
    g = torch.Generator().manual_seed(c * 10 + G)
    lengths = torch.tensor([0, 1, c - 1, c, c + 1, G * c, G * c + 1, G * c + c - 1, 5 * G * c + 3, 3 * c + 2,
                            7, 100, 64 * c, 64 * c + 1], dtype=torch.int32)
    if mode == "table-g3":  # verify: 3 rows per request share its page table row
        lengths = lengths[:12]
    groups = _groups(lengths, c, G, g)
    R = len(lengths)
    kw, table, offsets = {}, None, None
    page_size = 16 * c
    if mode == "offsets":
        offsets = torch.randint(0, 1000, (R,), generator=g, dtype=torch.int32)
        kw = dict(out_offsets=offsets)
    elif mode.startswith("table"):
        rows = R if mode == "table" else R // 3
        pages = int(lengths.max()) // page_size + 1
        table = torch.randperm(rows * pages, generator=g).view(rows, pages).to(torch.int32)
        kw = dict(page_table=table, page_size=page_size)
    want = _plain_expand(groups, lengths, c, table, offsets, page_size)
    got = kpool_expand(groups, lengths, c, backend="torch", **kw)
    assert torch.equal(got, want)
    tri = kpool_expand(groups.to(DEVICE), lengths.to(DEVICE), c, backend="triton",
                       **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    assert torch.equal(tri.cpu(), want)
    assert torch.equal(kpool_expand(groups, lengths, c, backend="torch", **kw), got)  # deterministic
    if mode in ("plain", "offsets"):  # positions stay ascending: groups ascending, then the tail
        valid = got >= 0
        assert ((got[:, 1:] > got[:, :-1]) | ~valid[:, 1:]).all()


def test_expand_tail_is_always_selected():
    c, G = 4, 2
    lengths = torch.tensor([3, 9, 1000, 1001, 1003], dtype=torch.int32)
    groups = torch.tensor([[-1, -1], [0, 1], [3, 200], [0, 249], [7, 8]], dtype=torch.int32)
    out = kpool_expand(groups, lengths, c, backend="torch")
    for r, L in enumerate(lengths.tolist()):
        tail = set(range(L // c * c, L))
        assert tail <= set(out[r].tolist())
        assert (out[r] >= 0).sum() == min(G, L // c) * c + L % c


def test_expand_errors():
    c = 4
    lengths = torch.tensor([9, 13], dtype=torch.int32)
    good = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="groups"):  # group 2 is not complete for 9 tokens
        kpool_expand(torch.tensor([[0, 2], [1, 2]], dtype=torch.int32), lengths, c)
    with pytest.raises(ValueError, match="groups"):  # a -1 before the last selected column
        kpool_expand(torch.tensor([[-1, 1], [1, 2]], dtype=torch.int32), lengths, c)
    with pytest.raises(ValueError, match="groups"):
        kpool_expand(good.long(), lengths, c)
    with pytest.raises(ValueError, match="^c:"):
        kpool_expand(good, lengths, 0)
    with pytest.raises(ValueError, match="out_offsets"):
        kpool_expand(good, lengths, c, page_table=good, out_offsets=lengths)
    with pytest.raises(ValueError, match="page_table"):  # 13 tokens need 2 pages of 8
        kpool_expand(good, lengths, c, page_table=torch.tensor([[0], [1]], dtype=torch.int32), page_size=8)
    with pytest.raises(ValueError, match="page_table"):
        kpool_expand(good, lengths, c, page_table=torch.zeros(3, 4, dtype=torch.int32))


# ---- kpool_compress ------------------------------------------------------------------------------------

def _batch(dtype, c, S, g):
    """Two requests: row 1 continues at position 10 (its ring holds 6..9: the group 8..11 spans the ring and
    the batch) with 13 tokens (groups 2, 3, 4 complete, 5 filling), row 0 starts at 0 with 3 tokens
    (a group still filling). Returns the full sequences too: ``seq[row] = (keys [n, D], gates [n, D])``."""
    R = 3
    ring = torch.randn(R, S, 2, D, generator=g).to(dtype) * 3  # stale rows are random, never zero
    seq = {1: (torch.randn(23, D, generator=g).to(dtype), torch.randn(23, D, generator=g).to(dtype)),
           0: (torch.randn(3, D, generator=g).to(dtype), torch.randn(3, D, generator=g).to(dtype))}
    for p in range(10 - S + 1, 10):  # what earlier steps wrote for row 1
        ring[1, p % S, 0], ring[1, p % S, 1] = seq[1][0][p], seq[1][1][p]
    positions = torch.cat([torch.arange(10, 23), torch.arange(0, 3)])
    rows = torch.tensor([1] * 13 + [0] * 3)
    first = torch.tensor([0] * 13 + [13] * 3)
    k = torch.cat([seq[1][0][10:], seq[0][0]])
    gate = torch.cat([seq[1][1][10:], seq[0][1]])
    ape = torch.randn(c, D, generator=g)
    return k, gate, ring, ape, positions, rows, first, seq


def _plain_pool(seq, ape, row, p, c):
    """float64: the softmax-gated mean of the group of position p over its members <= p, and its magnitude
    ``sum_i w_i |k_i|`` (what the fp32 rounding errors scale with: the terms may cancel)."""
    keys, gates = seq[row]
    g0 = p // c * c
    s = gates[g0:p + 1].double() + ape[: p + 1 - g0].double()
    w = torch.softmax(s, dim=0)
    k = keys[g0:p + 1].double()
    return (w * k).sum(0), (w * k.abs()).sum(0)


# fp32 pooling: exp, c products and sums, one division, each a rounding of 2^-24 relative to the terms'
# magnitude; 8 of them cover c <= 4 with room. Then one rounding to the model dtype (half its ulp).
F32_TERMS = 8 * 2.0 ** -24
HALF_ULP = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}  # relative, at a power of two


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("c", [2, 4])
def test_pool_keys_match_plain_formulation(dtype, c):
    g = torch.Generator().manual_seed(c)
    S = c + 3
    k, gate, ring, ape, positions, rows, first, seq = _batch(dtype, c, S, g)
    anchors = torch.arange(16)  # every token: each pools its group up to itself
    got = reference.pool_keys(k, gate, ring, ape, positions, rows, first, anchors)
    plain = [_plain_pool(seq, ape, int(rows[t]), int(positions[t]), c) for t in anchors.tolist()]
    want = torch.stack([w for w, _ in plain])
    mag = torch.stack([m for _, m in plain])
    assert got.dtype == dtype
    err = (got.double() - want).abs()
    tol = F32_TERMS * mag + HALF_ULP[dtype] * want.abs()
    assert (err <= tol).all(), float((err / tol).max())
    tri = kernels.pool_keys(*(t.to(DEVICE) for t in (k, gate, ring, ape, positions, rows, first, anchors)))
    # Triton's exp may differ from torch's in its last bit, and each side rounds to the model dtype once
    err = (tri.cpu().double() - got.double()).abs()
    tol = 2 * F32_TERMS * mag + 2 * HALF_ULP[dtype] * want.abs()
    assert (err <= tol).all(), float((err / tol).max())


def test_pool_keys_ignore_future_ring_rows():
    """A filling group pools only what it has: ring rows past the anchor (stale, here huge) never count."""
    c, S = 4, 4
    g = torch.Generator().manual_seed(5)
    k, gate, ring, ape, positions, rows, first, seq = _batch(torch.float32, c, S, g)
    # row 1's anchors 20 and 21 (tokens 10, 11: the group 20..23 is filling), row 0's 0 and 1
    anchors = torch.tensor([10, 11, 13, 14])
    for impl in (reference.pool_keys, kernels.pool_keys):
        base = impl(k, gate, ring, ape, positions, rows, first, anchors)
        poisoned = ring.clone()
        poisoned[0], poisoned[1, 22 % S], poisoned[1, 23 % S] = 1e6, 1e6, 1e6
        assert torch.equal(impl(k, gate, poisoned, ape, positions, rows, first, anchors), base)
        assert torch.equal(base[2], k[13])  # one member: its own key
    # and the ring rows the group does read matter: row 1's group 8..11 takes 8, 9 from the ring
    ring2 = ring.clone()
    ring2[1, 8 % S] += 1
    one = torch.tensor([1])
    assert not torch.equal(reference.pool_keys(k, gate, ring2, ape, positions, rows, first, one),
                           reference.pool_keys(k, gate, ring, ape, positions, rows, first, one))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compress_is_pool_then_rotate_and_quantise(backend):
    c, S = 4, 6
    g = torch.Generator().manual_seed(7)
    k, gate, ring, ape, positions, rows, first, _ = _batch(torch.bfloat16, c, S, g)
    anchors = torch.tensor([1, 5, 9, 12, 15])
    args = [t.to(DEVICE) for t in (k, gate, ring, ape, positions, rows, first, anchors)]
    k_fp8, k_scale = kpool_compress(*args, backend=backend)
    impl = reference.pool_keys if backend == "torch" else kernels.pool_keys
    want_fp8, want_scale = act_quant(hadamard(impl(*args)))
    assert torch.equal(k_fp8.view(torch.uint8), want_fp8.view(torch.uint8))
    assert torch.equal(k_scale, want_scale[:, 0])
    again = kpool_compress(*args, backend=backend)
    assert torch.equal(again[0].view(torch.uint8), k_fp8.view(torch.uint8))


def test_compress_no_anchors():
    g = torch.Generator().manual_seed(1)
    k, gate, ring, ape, positions, rows, first, _ = _batch(torch.bfloat16, 4, 6, g)
    k_fp8, k_scale = kpool_compress(k, gate, ring, ape, positions, rows, first, torch.zeros(0, dtype=torch.long))
    assert k_fp8.shape == (0, D) and k_scale.shape == (0,)


def test_compress_errors():
    g = torch.Generator().manual_seed(2)
    k, gate, ring, ape, positions, rows, first, _ = _batch(torch.bfloat16, 4, 6, g)
    anchors = torch.tensor([3])
    args = dict(k=k, gate=gate, ring=ring, ape=ape, positions=positions, rows=rows, first=first, anchors=anchors)

    def call(**change):
        kpool_compress(**{**args, **change})

    with pytest.raises(ValueError, match="gate"):
        call(gate=gate.float())
    with pytest.raises(ValueError, match="ring"):
        call(ring=ring[:, :3])  # fewer positions per row than c
    with pytest.raises(ValueError, match="ape"):
        call(ape=ape[:, :64])
    with pytest.raises(ValueError, match="anchors"):
        call(anchors=torch.tensor([16]))
    with pytest.raises(ValueError, match="rows"):
        call(rows=rows + 2)
    with pytest.raises(ValueError, match="positions"):  # request 1's tokens not consecutive
        call(positions=torch.cat([positions[:5], positions[5:13] + 1, positions[13:]]))
    with pytest.raises(ValueError, match="first"):
        call(first=torch.zeros(16, dtype=torch.long) + 15)
