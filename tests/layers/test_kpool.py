"""kpool in the layer (DSAAttention.store_kpool / select_kpool) against a plain PyTorch formulation of the
pooled indexer, written here: the pooled key of every complete group in float64 from its c tokens, the
groups each row scores (complete ones only), the top topk / c of them by float64 logits of the stored keys
(ties to the smaller group), each expanded to its c tokens, and the unfinished tail always added.

The layer is driven with synthetic indexer outputs (keys, gates, fp8 queries and head gates per token of a
fixed sequence), so every path sees bit-identical inputs: prefill in chunks that split groups, decode
across several group boundaries, MTP verify with next_n drafts crossing a group boundary. Caches and
rings start as random finite bytes, so a read of anything not written shows.
"""

from __future__ import annotations

import pytest
import torch

from flashdsa.cache.metadata import DECODE, EXTEND, TARGET_VERIFY
from flashdsa.config import DSAConfig
from flashdsa.engine import Runner
from flashdsa.layers import DSAAttention, Indexer, IndexerOutput
from flashdsa.quant import FP8, act_quant, hadamard

H = 4      # indexer heads of the tiny preset
D = 128


def _cfg(c: int) -> DSAConfig:
    return DSAConfig.preset("tiny").replace(num_hidden_layers=1, index_kpool=c)  # top-64


class Driver:
    """One DSA layer over a model-less runner's pool, fed per token from fixed random sequences."""

    def __init__(self, c: int, seed: int = 0, pages: int = 12):
        self.cfg = cfg = _cfg(c)
        self.c, self.topk = c, cfg.index_topk
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.attn = DSAAttention(cfg, 0)
        with torch.no_grad():
            self.attn.indexer.index_kpool_compress_ape.copy_(torch.randn(c, D, generator=g))
        self.run = Runner.for_layers(cfg, "cpu", pages, "fp8")
        pool = self.run.pool
        # random finite bytes everywhere: index keys below 0x7F (no e4m3 NaN code), positive scales
        for cache in pool.index_caches.values():
            keys = cache[:, :8192]
            keys.copy_(torch.randint(0, 0x7F, keys.shape, dtype=torch.uint8, generator=g))
            cache[:, 8192:].view(torch.float32).copy_(torch.rand(cache.shape[0], 64, generator=g) + 0.5)
        pool.tail_ring(0, torch.bfloat16).copy_(torch.randn(pool.tail_ring(0, torch.bfloat16).shape, generator=g))
        self.seq: dict[str, dict[str, torch.Tensor]] = {}

    def tokens(self, r: str, n: int) -> dict[str, torch.Tensor]:
        """The request's first n tokens' indexer outputs (made on first use, then fixed)."""
        s = self.seq.get(r)
        if s is None or s["k"].shape[0] < n:
            g = self.g
            new = dict(k=torch.randn(n, D, generator=g).to(torch.bfloat16) * 2,
                       gate=torch.randn(n, D, generator=g).to(torch.bfloat16),
                       q=torch.randn(n, H, D, generator=g),
                       w=torch.rand(n, H, generator=g) + 0.1)
            q_fp8, q_scale = act_quant(new["q"])
            new["q"], new["w"] = q_fp8, new["w"] * q_scale[..., 0]
            if s is not None:  # keep what exists, append the rest
                new = {key: torch.cat([s[key], new[key][s[key].shape[0]:]]) for key in s}
            self.seq[r] = s = new
        return s

    def step(self, new: dict[str, int], mode: str | None = None):
        """Run store + select for the batch; returns (meta, selection)."""
        meta, _ = self.run.prepare(new, mode, force_sparse=True)
        rows = {key: [] for key in ("k", "gate", "q", "w")}
        for r, n in new.items():
            end = self.run.alloc.seq_len(r)
            s = self.tokens(r, end)
            for key in rows:
                rows[key].append(s[key][end - n:end])
        cat = {key: torch.cat(v) for key, v in rows.items()}
        idx = IndexerOutput(cat["q"], cat["w"], cat["k"], None, cat["gate"])
        kv_rows = torch.randn(meta.num_tokens, 576, generator=self.g).to(torch.bfloat16)
        with torch.no_grad():
            self.attn.store(kv_rows, idx, meta, self.run.pool)
            sel = self.attn.select(idx, meta, self.run.pool)
        return meta, sel

    # ---- the plain formulation ----------------------------------------------------------------
    def plain_pooled(self, r: str, groups: int) -> torch.Tensor:
        """float64 [groups, D]: Hadamard of the softmax-gated mean of each group's c keys."""
        s, c = self.seq[r], self.c
        ape = self.attn.indexer.index_kpool_compress_ape.detach().double()
        k = s["k"][: groups * c].double().view(groups, c, D)
        w = torch.softmax(s["gate"][: groups * c].double().view(groups, c, D) + ape, dim=1)
        return hadamard((w * k).sum(1))

    def stored(self, r: str, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run.pool.read_index(0, self.run.pool.index_slots(r, 0, groups))

    def check_pooled(self, r: str) -> int:
        """The stored pooled keys of the request's complete groups equal the plain ones up to their rounding:
        bf16 of the mean and of its Hadamard (2^-8 relative, the first spread by the Hadamard over the norm),
        then e4m3 (half a step: 2^-4 relative, 2^-10 of the scale below the smallest normal)."""
        groups = self.run.alloc.seq_len(r) // self.c
        if groups == 0:
            return 0
        k_fp8, k_scale = self.stored(r, groups)
        got = k_fp8.double() * k_scale.double()[:, None]
        want = self.plain_pooled(r, groups)
        tol = (2 ** -4 + 2 ** -7) * want.abs() + 2 ** -7 * want.norm(dim=1, keepdim=True) \
            + 2 ** -10 * k_scale.double()[:, None]
        bad = (got - want).abs() > tol
        assert not bad.any(), f"request {r}: group {int(bad.nonzero()[0, 0])} pooled wrong"
        return groups

    def check_selection(self, meta, sel: torch.Tensor) -> tuple[int, int]:
        """Each row = its top topk / c complete groups (float64 logits of the stored keys, ties to the
        smaller group) expanded to their tokens, then its tail; returns (rows compared as sets, rows
        whose boundary was too close to call: only the structure checked there)."""
        c, G = self.c, self.topk // self.c
        assert sel.shape == (meta.num_tokens, self.topk + c - 1) and sel.dtype == torch.int32
        compared = close = 0
        t = 0
        kv_offset = 0
        for r in meta.req_ids:
            end = self.run.alloc.seq_len(r)
            n = int((meta.kpool_rows == self.run.pool.tail_rows([r])[0]).sum())  # its new tokens
            slots = self.run.alloc.slots(r)
            k_fp8, k_scale = self.stored(r, end // c)
            s = self.seq[r]
            for p in range(end - n, end):
                L = p + 1
                groups = L // c
                q = s["q"][p].double()
                terms = (q @ k_fp8.double().T).relu() * s["w"][p].double()[:, None]   # [H, groups]
                logit = terms.sum(0) * k_scale.double()
                mag = (q.abs() @ k_fp8.double().abs().T * s["w"][p].double()[:, None]).sum(0) * k_scale.double()
                order = sorted(range(groups), key=lambda g: (-float(logit[g]), g))
                pick = order[:G]
                tokens = [g * c + i for g in sorted(pick) for i in range(c)] + list(range(groups * c, L))
                if meta.mode == EXTEND:
                    want = [kv_offset + x for x in tokens]
                else:
                    want = [int(slots[x]) for x in tokens]
                row = sel[t]
                got = row[row >= 0].tolist()
                assert len(got) == len(want) and (row[len(got):] == -1).all(), f"row {t}: wrong count / padding"
                # the tail, always
                tail = [kv_offset + x if meta.mode == EXTEND else int(slots[x]) for x in range(groups * c, L)]
                assert got[len(got) - len(tail):] == tail, f"row {t}: tail missing"
                gap = float(logit[order[G - 1]] - logit[order[G]]) if groups > G else float("inf")
                tol = 1e-5 * float(mag.max()) if groups else 0.0
                # gap 0: an exact tie (all heads' ReLU at 0 for both groups), exact in fp32 too: the smaller wins
                if gap > 2 * tol or gap == 0:
                    assert got == want, f"row {t} (request {r}, position {p}): groups differ"
                    compared += 1
                else:
                    close += 1
                    # still whole groups of complete ones, each selected group's tokens together
                    body = got[: len(got) - len(tail)]
                    assert len(body) == min(G, groups) * c
                t += 1
            kv_offset += end
        return compared, close


def _check(drv: Driver, meta, sel) -> int:
    for r in meta.req_ids:
        drv.check_pooled(r)
    compared, close = drv.check_selection(meta, sel)
    assert close <= max(1, compared // 20), f"{close} rows too close to call, {compared} compared"
    return compared


@pytest.mark.parametrize("c", [2, 4, 8])
def test_prefill_in_chunks_decode_and_verify_match_plain_formulation(c):
    drv = Driver(c, seed=c)
    topk = drv.topk
    # lengths around the boundaries: < c, exactly topk tokens (every group, no tail), topk + 1 (a tail of
    # one), several times topk with a tail; chunks that split groups
    first = {"short": c - 1, "at_topk": topk, "topk_1": topk + 1, "long": 2 * topk + 3}
    _check(drv, *drv.step(first, EXTEND))
    _check(drv, *drv.step({"long": topk + c + 1, "short": 2}, EXTEND))  # a group spans the two chunks
    for i in range(2 * c + 1):  # decode across more than two group boundaries
        _check(drv, *drv.step({r: 1 for r in first}, DECODE))
    _check(drv, *drv.step({r: 3 for r in first}, TARGET_VERIFY))  # three drafts, crossing a boundary for some


def test_decode_token_by_token_writes_the_same_pooled_keys_as_one_prefill():
    c = 4
    one, steps = Driver(c, seed=1), Driver(c, seed=1)
    n0, extra = 70, 2 * c + 3  # 70 % 4 = 2: the first decode completes a group begun in the prefill
    one.step({"a": n0 + extra}, EXTEND)
    steps.tokens("a", n0 + extra)
    one.tokens("a", n0 + extra)
    assert torch.equal(one.seq["a"]["k"], steps.seq["a"]["k"])  # same synthetic sequence
    steps.step({"a": n0}, EXTEND)
    for _ in range(extra):
        steps.step({"a": 1}, DECODE)
    groups = (n0 + extra) // c
    a, b = one.stored("a", groups), steps.stored("a", groups)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
    # and the last unfinished group's tokens sit in the ring of both at the same places
    for d in (one, steps):
        ring = d.run.pool.tail_ring(0, torch.bfloat16)[d.run.pool.tail_rows(["a"])[0]]
        for p in range(groups * c, n0 + extra):
            assert torch.equal(ring[p % d.run.pool.tail_len, 0], d.seq["a"]["k"][p])


def test_pooled_key_is_the_gated_mean_not_the_plain_mean():
    """The gate and the place term matter: a group with one dominant gate pools to (about) that key."""
    drv = Driver(4, seed=3)
    drv.tokens("a", 8)
    s = drv.seq["a"]
    s["gate"][:4] = 0
    s["gate"][4:8] = -30
    s["gate"][5] = 30  # token 5 owns group 1
    drv.step({"a": 8}, EXTEND)
    k_fp8, k_scale = drv.stored("a", 2)
    got = k_fp8.double() * k_scale.double()[:, None]
    assert torch.allclose(got[1], hadamard(s["k"][5].double()), rtol=0.07, atol=0.05 * float(k_scale[1]))
    assert drv.check_pooled("a") == 2


def test_rows_never_see_incomplete_groups_or_later_tokens():
    """Every selected token is visible to its row, and the tokens of a selected group are all selected."""
    c = 4
    drv = Driver(c, seed=5)
    drv.step({"a": 3 * drv.topk + 1}, EXTEND)
    meta, sel = drv.step({"a": 5}, TARGET_VERIFY)
    slots = drv.run.alloc.slots("a")
    pos_of = {int(s): i for i, s in enumerate(slots)}
    base = drv.run.alloc.seq_len("a") - 5
    for j in range(5):
        chosen = [pos_of[int(x)] for x in sel[j] if x >= 0]
        assert max(chosen) <= base + j  # never a later draft
        if (base + j + 1) % c:  # its group unfinished: the tail, itself included, is always selected
            assert set(range((base + j + 1) // c * c, base + j + 1)) <= set(chosen)
        full = set(x // c for x in chosen if x < (base + j + 1) // c * c)
        for g in full:
            assert {g * c + i for i in range(c)} <= set(chosen)


class ExactDriver(Driver):
    """The same layer in exact precision: fp32 queries, keys and gates (no fp8), pooled at selection time
    (``select_kpool_exact``: ``pool_as_hf`` over the stored keys and gates)."""

    def tokens(self, r: str, n: int) -> dict[str, torch.Tensor]:
        s = self.seq.get(r)
        if s is None or s["k"].shape[0] < n:
            g = self.g
            new = dict(k=torch.randn(n, D, generator=g) * 2, gate=torch.randn(n, D, generator=g),
                       q=torch.randn(n, H, D, generator=g), w=torch.rand(n, H, generator=g) + 0.1)
            if s is not None:
                new = {key: torch.cat([s[key], new[key][s[key].shape[0]:]]) for key in s}
            self.seq[r] = s = new
        return s

    def check_exact(self, meta, sel: torch.Tensor) -> int:
        """Each row = its top topk / c complete groups by float64 scores of the float64 pooled keys (ties to
        the smaller group) expanded, then its tail; rows whose boundary is within fp32 rounding are skipped
        (returns the rows compared)."""
        c, G = self.c, self.topk // self.c
        ape = self.attn.indexer.index_kpool_compress_ape.detach().double()
        compared, t, kv_offset = 0, 0, 0
        for r in meta.req_ids:
            end = self.run.alloc.seq_len(r)
            n = int((meta.kpool_rows == self.run.pool.tail_rows([r])[0]).sum())
            slots, s = self.run.alloc.slots(r), self.seq[r]
            k = s["k"][: end // c * c].double().view(-1, c, D)
            pooled = (torch.softmax(s["gate"][: end // c * c].double().view(-1, c, D) + ape, dim=1) * k).sum(1)
            for p in range(end - n, end):
                L, groups = p + 1, (p + 1) // c
                heads = (s["q"][p].double() @ pooled[:groups].T) * D ** -0.5                 # [H, groups]
                logit = (heads.relu() * s["w"][p].double()[:, None]).sum(0)
                order = sorted(range(groups), key=lambda g: (-float(logit[g]), g))
                tokens = [g * c + i for g in sorted(order[:G]) for i in range(c)] + list(range(groups * c, L))
                want = [kv_offset + x if meta.mode == EXTEND else int(slots[x]) for x in tokens]
                row = sel[t]
                got = row[row >= 0].tolist()
                gap = float(logit[order[G - 1]] - logit[order[G]]) if groups > G else float("inf")
                clear = groups == 0 or gap == 0 or gap > 1e-4 * float(logit.abs().max())
                if clear:
                    assert got == want and (row[len(got):] == -1).all(), f"row {t} (request {r}, position {p})"
                    compared += 1
                t += 1
            kv_offset += end
        return compared


@pytest.mark.parametrize("c", [4, 16])
def test_exact_kpool_in_chunks_and_decode_match_plain_formulation(c):
    """Exact precision with kpool outside HF (the engine's position rule for ties): prefill in chunks that
    split groups, then decode across group boundaries, against float64 pooling and scores."""
    drv = ExactDriver(c, seed=c)
    drv.attn.indexer.precision = "exact"
    topk, compared = drv.topk, 0
    first = {"short": c - 1, "at_topk": topk, "topk_1": topk + 1, "long": 2 * topk + 3}
    compared += drv.check_exact(*drv.step(first, EXTEND))
    compared += drv.check_exact(*drv.step({"long": topk + c + 1, "short": 2}, EXTEND))
    for _ in range(c + 1):
        compared += drv.check_exact(*drv.step({r: 1 for r in first}, DECODE))
    rows = sum(first.values()) + topk + c + 3 + 4 * (c + 1)
    assert compared >= 0.95 * rows


def test_indexer_kpool_outputs_and_parameters():
    cfg = _cfg(4)
    ind = Indexer(cfg)
    assert ind.index_kpool_compress_gate.shape == (D, cfg.hidden_size)
    assert ind.index_kpool_compress_gate.dtype == torch.bfloat16
    assert ind.index_kpool_compress_ape.shape == (4, D) and ind.index_kpool_compress_ape.dtype == torch.float32
    assert not hasattr(Indexer(_cfg(1)), "index_kpool_compress_gate")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ind.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    T = 5
    x = torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16)
    qr = torch.randn(T, cfg.q_lora_rank, generator=g).to(torch.bfloat16)
    cos, sin = torch.ones(T, 32), torch.zeros(T, 32)  # position 0
    out = ind(x, qr, cos, sin)
    assert out.pooled and out.k_scale is None and out.q.dtype == FP8
    assert out.k.dtype == out.gate.dtype == torch.bfloat16 and out.k.shape == out.gate.shape == (T, D)
    torch.testing.assert_close(out.gate, (x.float() @ ind.index_kpool_compress_gate.float().T).to(torch.bfloat16),
                               rtol=2 ** -7, atol=1e-3)
    # the key before rotation: LayerNorm of wk x (RoPE at position 0 is the identity)
    kn = torch.nn.functional.layer_norm(ind.wk(x).float(), (D,), ind.k_norm.weight, ind.k_norm.bias, 1e-6)
    assert torch.equal(out.k, kn.to(torch.bfloat16))
    plain = Indexer(_cfg(1))
    plain.load_state_dict({k: v for k, v in ind.state_dict().items() if "kpool" not in k})
    ref = plain(x, qr, cos, sin)
    assert torch.equal(ref.q.view(torch.uint8), out.q.view(torch.uint8)) and torch.equal(ref.weights, out.weights)
