"""What each kind of case measures: one setup function per kind (:data:`SETUPS`) builds the inputs, our
call, its check, the peers' calls and the valid work (bytes, FLOPs), as :class:`~flashdsa.bench.checks.Bench`.

Inputs are random (never zeros), built on the device in our byte layouts (flashdsa.testing.inputs): DeepGEMM
reads our indexer pages viewed ``[P, 64, 1, 132]``, FlashMLA our 656-B pages viewed ``[P, 64, 1, 656]``.
"""

from __future__ import annotations

import torch

from flashdsa.bench.checks import (Bench, _check_attention, _check_logits, _check_same, _deepgemm_paged,
                                   _flashmla_decode, _masked_cos, _same_slot_sets, _token_table, _topk_peers)
from flashdsa.cache.layouts import MLA_BF16_BYTES, MLA_FP8_BYTES, dequantize_mla_656
from flashdsa.testing import peers
from flashdsa.testing.inputs import (CHUNK_PAGES, decode_slots, index_cache, mla_cache, paged_batch, prefill_indices,
                                     randn, rows_subset)

SM_SCALE = 576 ** -0.5


def _setup_paged(p: dict, dev, status) -> list[tuple[str, Bench]]:
    from flashdsa import ops
    from flashdsa.quant import FP8
    B, n, ctx, H = p["B"], p["n"], p["ctx"], p["H"]
    g = torch.Generator(device=dev).manual_seed(ctx + n)
    seq, bt, P = paged_batch(B, ctx, n, g, dev)
    cache = index_cache(P, g, dev)
    lens = (seq[:, None] - n + 1 + torch.arange(n, device=dev)[None, :]).to(torch.int32)  # verify rows
    max_len = bt.shape[1] * 64
    q, w = randn((B, n, H, 128), g, dev, FP8), randn((B * n, H), g, dev)
    # the default backend on CUDA (the Gluon kernel from next_n 4 on on sm_90, else Triton: the op's rule); the
    # Triton kernel on the CPU (interpreted: the CPU default is the torch reference itself)
    backend = None if q.is_cuda else "triton"
    ours = lambda: ops.indexer_logits_paged(q, cache, w, lens, bt, max_len, backend=backend)  # noqa: E731

    def check():
        sub = rows_subset(B, 4, dev)
        rows = (sub[:, None] * n + torch.arange(n, device=dev)).flatten()
        ref = ops.indexer_logits_paged(q[sub], cache, w[rows], lens[sub], bt[sub], max_len, backend="torch")
        return _check_logits(ours()[rows], ref)

    pairs = int(lens.sum())
    peer = {"DeepGEMM": _deepgemm_paged(q, cache, w, lens, bt, max_len, ours)} \
        if status["DeepGEMM"]["ok"] and n <= 2 else {}  # DeepGEMM: next_n <= 2 on Hopper
    return [("", Bench(ours, check, peer, bytes=q.numel() + 4 * w.numel() + 132 * int(seq.sum()) + 4 * pairs,
                       flops=2 * pairs * H * 128, dtype="fp8"))]


def _setup_ragged(p: dict, dev, status) -> list[tuple[str, Bench]]:
    from flashdsa import ops
    from flashdsa.quant import FP8
    T, N, H = p["T"], p["N"], p["H"]
    g = torch.Generator(device=dev).manual_seed(T + N)
    q, k = randn((T, H, 128), g, dev, FP8), randn((N, 128), g, dev, FP8)
    k_scale, w = torch.rand(N, generator=g, device=dev) + 0.5, randn((T, H), g, dev)
    ks = torch.zeros(T, dtype=torch.int32, device=dev)
    ke = (torch.arange(T, device=dev) + N - T + 1).to(torch.int32)  # row i: the N - T prefix keys and itself
    ours = lambda: ops.indexer_logits_ragged(q, k, k_scale, w, ks, ke, backend="triton")  # noqa: E731

    def check():
        sub = rows_subset(T, 32, dev)
        ref = ops.indexer_logits_ragged(q[sub], k, k_scale, w[sub], ks[sub], ke[sub], backend="torch")
        return _check_logits(ours()[sub], ref)

    peer = {}
    if status["DeepGEMM"]["ok"]:
        def make():
            fn = peers.deepgemm_ragged(q, k, k_scale, w, ks, ke)
            out = ours()
            return fn, _masked_cos(out, fn(), torch.isfinite(out))
        peer["DeepGEMM"] = make
    pairs = int((ke - ks).sum())
    return [("", Bench(ours, check, peer, bytes=q.numel() + 4 * w.numel() + 132 * N + 4 * pairs,
                       flops=2 * pairs * H * 128, dtype="fp8"))]


def _setup_topk(p: dict, dev, status) -> list[tuple[str, Bench]]:
    from flashdsa import ops
    R, L, k = p["R"], p["L"], p["k"]
    g = torch.Generator(device=dev).manual_seed(R + L)
    x = randn((R, L), g, dev)
    lengths = torch.full((R,), L, dtype=torch.int32, device=dev)
    pt = torch.randperm(R * -(-L // 64), generator=g, device=dev).view(R, -1).to(torch.int32) if p["pages"] else None
    ours = lambda: ops.topk_transform(x, lengths, k, page_table=pt, backend="triton")  # noqa: E731

    def check():
        sub = rows_subset(R, 16, dev)
        ref = ops.topk_transform(x[sub], lengths[sub], k, page_table=None if pt is None else pt[sub], backend="torch")
        return _check_same(ours()[sub], ref)

    peer = _topk_peers(x, lengths, k, status) if pt is None else {}
    return [("", Bench(ours, check, peer, bytes=4 * R * L + 4 * R * k))]


def _attention_work(n_valid: int, h: int, row_bytes: int, q: torch.Tensor, idx: torch.Tensor) -> dict:
    rows = q.numel() // q.shape[-1]
    return dict(bytes=n_valid * row_bytes + 2 * q.numel() + rows * (2 * 512 + 4) + 4 * idx.numel(),
                flops=2 * h * (576 + 512) * n_valid, dtype="bf16")


def _attention_calls(op, q, kv, idx, rows: int):
    """Sparse MLA ``op`` (decode or prefill) as the bench calls it — the default backend on CUDA (ops' rule: Gluon
    where it applies on sm_90, else Triton), the Triton kernels on the CPU (interpreted: the CPU default is the
    torch reference itself) — and its check on ``rows`` random query rows against the torch reference."""
    backend = None if q.is_cuda else "triton"

    def ours():
        return op(q, kv, idx, SM_SCALE, backend=backend)

    def check():
        sub = rows_subset(q.shape[0], rows, q.device)
        out, lse = ours()
        return _check_attention(out[sub], lse[sub], *op(q[sub], kv, idx[sub], SM_SCALE, backend="torch"))
    return ours, check


def _setup_decode(p: dict, dev, status) -> list[tuple[str, Bench]]:
    """Sparse MLA decode over fp8 656-B pages (``fmt`` "fp8") or bf16 pages ("bf16"); FlashMLA always reads
    fp8 pages of the same tokens (its sparse decode has no bf16 cache: SGLang's bf16-cache decode on the
    H200 is the case this compares)."""
    from flashdsa import ops
    B, s_q, h, topk, ctx, fmt = p["B"], p["s_q"], p["h"], p["topk"], p["ctx"], p.get("fmt", "fp8")
    g = torch.Generator(device=dev).manual_seed(ctx)
    per_req = -(-ctx // 64)
    cache = mla_cache(B * per_req, g, dev, fmt)
    bt = torch.randperm(B * per_req, generator=g, device=dev).view(B, per_req)
    idx = decode_slots(bt, ctx, s_q, topk, g)
    q = randn((B, s_q, h, 576), g, dev, torch.bfloat16)
    ours, check = _attention_calls(ops.sparse_mla_decode, q, cache, idx, 4)

    peer = {}
    if status["FlashMLA"]["ok"] and h in (64, 128):
        seqlens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        # the same tokens as fp8 pages: a generator in the state ``cache`` was drawn from
        peer_cache = cache if fmt == "fp8" else mla_cache(B * per_req, torch.Generator(device=dev).manual_seed(ctx),
                                                           dev)
        peer["FlashMLA" if fmt == "fp8" else "FlashMLA (fp8 pages)"] = _flashmla_decode(q, peer_cache, idx, SM_SCALE,
                                                                                         seqlens, ours)
    row_bytes = MLA_FP8_BYTES if fmt == "fp8" else MLA_BF16_BYTES
    return [("", Bench(ours, check, peer, **_attention_work(idx.numel(), h, row_bytes, q, idx)))]


def _setup_prefill(p: dict, dev, status) -> list[tuple[str, Bench]]:
    from flashdsa import ops
    T, N, h, topk = p["T"], p["N"], p["h"], p["topk"]
    g = torch.Generator(device=dev).manual_seed(T + N)
    kv, q = randn((N, 576), g, dev, torch.bfloat16), randn((T, h, 576), g, dev, torch.bfloat16)
    idx = prefill_indices(T, N, topk, g, dev)
    ours, check = _attention_calls(ops.sparse_mla_prefill, q, kv, idx, 16)

    peer = {}
    if status["FlashMLA"]["ok"] and h % 64 == 0 and topk % 128 == 0:
        def make():
            fn = peers.flashmla_prefill(q, kv, idx, SM_SCALE)
            out = ours()[0]
            return fn, _masked_cos(out.float(), fn()[0], torch.ones_like(out, dtype=torch.bool))
        peer["FlashMLA"] = make
    return [("", Bench(ours, check, peer, **_attention_work(idx.numel(), h, 1152, q, idx)))]


def selection_inputs(B: int, ctx: int, H: int, dev) -> tuple:
    """Decode selection's inputs at next_n 1, seeded by ``ctx``: ``(q [B, 1, H, 128] fp8, index cache, weights
    [B, H] f32, context_lens [B, 1] i32, block table [B, pages] i32, max_len, seq [B])``, contexts ~U(0.7, 1.3)
    x ctx (``paged_batch``)."""
    from flashdsa.quant import FP8
    g = torch.Generator(device=dev).manual_seed(ctx + 17)
    seq, bt, P = paged_batch(B, ctx, 1, g, dev)
    cache = index_cache(P, g, dev)
    q, w = randn((B, 1, H, 128), g, dev, FP8), randn((B, H), g, dev)
    return q, cache, w, seq.view(B, 1).to(torch.int32), bt, bt.shape[1] * 64, seq


def _setup_selection(p: dict, dev, status) -> list[tuple[str, Bench]]:
    """Decode selection at next_n 1: paged logits -> top-k -> physical slots, ours as the runner chains them
    (``indexer_logits_paged`` then ``topk_transform`` through the block table), against DeepGEMM's paged
    logits -> sgl-kernel's ``fast_topk_transform_fused`` (what SGLang's DSA decode runs; its page table is
    per token). Checked: the logits against the torch reference (a few requests), and the slots against the
    torch top-k on our logits; the peer's slots are compared with ours as sets (information)."""
    from flashdsa import ops
    B, ctx, H, k = p["B"], p["ctx"], p["H"], p.get("k", 2048)
    q, cache, w, lens, bt, max_len, seq = selection_inputs(B, ctx, H, dev)
    rows_len = lens.view(-1).contiguous()
    backend = None if q.is_cuda else "triton"

    def logits():
        return ops.indexer_logits_paged(q, cache, w, lens, bt, max_len, backend=backend)

    def ours():
        return ops.topk_transform(logits(), rows_len, k, page_table=bt, backend=backend)

    def check():
        sub = rows_subset(B, 4, dev)
        ref = ops.indexer_logits_paged(q[sub], cache, w[sub], lens[sub], bt[sub], max_len, backend="torch")
        x = logits()
        got = _check_logits(x[sub], ref)
        same = _check_same(ours()[sub], ops.topk_transform(x[sub], rows_len[sub], k, page_table=bt[sub],
                                                           backend="torch"))
        return {"ok": got["ok"] and same["ok"], "summary": f"logits {got['summary']}; slots {same['summary']}"}

    peer = {}
    if status["DeepGEMM"]["ok"] and status["fast_topk_transform_fused"]["ok"] and k == 2048:
        def make():
            dg = _deepgemm_paged(q, cache, w, lens, bt, max_len, logits)()[0]
            topk = peers.fast_topk_transform_fused(rows_len, _token_table(bt, max_len), k)
            chain = lambda: topk(dg())  # noqa: E731
            return chain, _same_slot_sets(chain(), ours())
        peer["DeepGEMM+fast_topk_transform_fused"] = make
    pairs = int(lens.sum())
    return [("", Bench(ours, check, peer,
                       bytes=q.numel() + 4 * w.numel() + 132 * int(seq.sum()) + 2 * 4 * pairs + 4 * B * k,
                       flops=2 * pairs * H * 128, dtype="fp8"))]


def _filled_pool(cfg, B: int, ctx: int, extra: int, g: torch.Generator, dev):
    """One layer's fp8 KVPool with B requests (ids 0..B-1) of ``ctx`` tokens each, written with random MLA rows
    and indexer keys, and room for ``extra`` more tokens a request: ``(pool, write)``, ``write(slots)`` writing
    random rows at ``slots``. Requests grow in turns of 16 pages, so their pages interleave as in serving."""
    from flashdsa.cache.pool import KVPool
    from flashdsa.quant import FP8
    page = cfg.page_size
    pool = KVPool(cfg, B * -(-(ctx + extra) // page), "fp8", dev)
    alloc = pool.allocator
    for r in range(B):
        alloc.allocate(r, 0)
    for start in range(0, ctx, 16 * page):
        for r in range(B):
            alloc.extend(r, min(16 * page, ctx - start))

    def write(slots):
        for i in range(0, slots.numel(), CHUNK_PAGES * 64):
            s = slots[i:i + CHUNK_PAGES * 64]
            pool.write(0, s, randn((s.numel(), 576), g, dev, torch.bfloat16), randn((s.numel(), 128), g, dev, FP8),
                       torch.rand(s.numel(), generator=g, device=dev) + 0.5)
    if ctx:
        write(torch.cat([alloc.slots(r) for r in range(B)]))
    return pool, write


class _StageChecks:
    """A composite case's stage checks, remembered as they run, so the composite's own check (the decode step,
    the prefill chunk) reports on them: ``wrap(name, check)`` is the stage's check; ``composite(names)`` is ok
    when every named stage's check ran and was ok."""

    def __init__(self):
        self.done: dict[str, dict] = {}

    def wrap(self, name: str, fn):
        def run():
            self.done[name] = fn()
            return self.done[name]
        return run

    def composite(self, names) -> dict:
        bad = [n for n in names if not self.done.get(n, {}).get("ok")]
        return {"ok": not bad, "summary": "stages ok" if not bad else f"failed: {', '.join(bad)}"}


def _setup_layer(p: dict, dev, status) -> list[tuple[str, Bench]]:
    """One decode step of one layer on a KVPool, through the layer's own step (``DSAAttention.score_paged``
    -> ``topk_paged`` -> ``attend``, what ``DSAAttention.forward`` runs at decode) on random inputs. ``h``
    (optional): the attention heads a GPU holds (a tensor-parallel shard of the preset's); ``n`` (default 1):
    query rows a request (MTP verify at n > 1). FlashMLA, which takes 64 or 128 heads, gets q padded with
    zero heads to the next of those, as engines pad it."""
    import dataclasses

    from flashdsa.cache.metadata import DECODE, TARGET_VERIFY, build_decode
    from flashdsa.config import DSAConfig
    from flashdsa.layers.attention import DSAAttention
    from flashdsa.layers.indexer import IndexerOutput
    from flashdsa.quant import FP8
    cfg = DSAConfig.preset(p["preset"]).replace(num_hidden_layers=1)  # the caches of one layer
    if p.get("h"):
        cfg = cfg.replace(num_attention_heads=p["h"])
    B, ctx, topk, n = p["B"], p["ctx"], cfg.index_topk, p.get("n", 1)
    H_I, h = cfg.index_n_heads, cfg.num_attention_heads
    g = torch.Generator(device=dev).manual_seed(ctx)
    with torch.device("meta"):  # the step's stages read the caches and the inputs, not the weights
        attn = DSAAttention(cfg, 0)
    pool, write = _filled_pool(cfg, B, ctx, n, g, dev)
    alloc, reqs = pool.allocator, list(range(B))
    for r in reqs:
        alloc.extend(r, n)  # this step's tokens, written before attending as the layer does
    meta = build_decode(alloc, reqs, n, DECODE if n == 1 else TARGET_VERIFY)  # default backends (Gluon on sm_90)
    if torch.device(dev).type != "cuda":  # the CPU default is the torch reference itself: interpret the kernels
        meta = dataclasses.replace(meta, backend="triton")
    write(meta.slot_mapping)
    R = B * n  # query rows
    idx = IndexerOutput(randn((R, H_I, 128), g, dev, FP8), randn((R, H_I), g, dev) * H_I ** -0.5, None, None)
    q = randn((R, h, 576), g, dev, torch.bfloat16)
    lens, bt, max_len = meta.context_lens, meta.block_table, meta.max_context_len
    sub = rows_subset(B, 4, dev)  # requests; ``rows`` their query rows
    rows = (sub[:, None] * n + torch.arange(n, device=dev)).flatten()
    # the torch reference on a few requests: the same step with the rows' metadata and backend="torch"
    ref_meta = dataclasses.replace(meta, context_lens=lens[sub], block_table=bt[sub], backend="torch")
    ref_idx = IndexerOutput(idx.q[rows], idx.weights[rows], None, None)

    def indexer():
        return attn.score_paged(idx, meta, pool)

    def select(logits):
        return attn.topk_paged(logits, meta, pool)

    def attend(sel):
        return attn.attend(q, sel, meta, pool)

    logits = indexer()  # the fixed inputs of the later stages
    sel = select(logits)
    checks = _StageChecks()

    def check_attention():
        out, lse = attend(sel)
        return _check_attention(out[rows], lse[rows], *attn.attend(q[rows], sel[rows], ref_meta, pool))

    mla = pool.mla_pages(0)
    stages = {
        "indexer": Bench(indexer, checks.wrap("indexer", lambda: _check_logits(
            indexer()[rows], attn.score_paged(ref_idx, ref_meta, pool))),
            bytes=idx.q.numel() + 4 * idx.weights.numel() + 132 * int(lens.sum()) + 4 * int(lens.sum()),
            flops=2 * int(lens.sum()) * H_I * 128, dtype="fp8"),
        "top-k": Bench(lambda: select(logits), checks.wrap("top-k", lambda: _check_same(
            select(logits)[rows], attn.topk_paged(logits[rows], ref_meta, pool))),
            bytes=4 * logits.numel() + 4 * R * topk),
        "attention": Bench(lambda: attend(sel), checks.wrap("attention", check_attention),
                           **_attention_work(sel.numel(), h, 656, q, sel)),
    }
    seqlens = lens.view(-1).contiguous()  # a query row's
    q_fp8, w = idx.q.view(B, n, H_I, 128), idx.weights
    if status["DeepGEMM"]["ok"] and n <= 2:  # DeepGEMM's paged logits take next_n <= 2 on Hopper
        stages["indexer"].peers["DeepGEMM"] = _deepgemm_paged(q_fp8, pool.index_cache(0), w, lens, bt, max_len, indexer)
    if status["fast_topk_transform_fused"]["ok"] and topk == 2048:
        def make_topk():  # SGLang's decode call: top-k with the slot translation fused, like ours
            fn = peers.fast_topk_transform_fused(seqlens, _token_table(bt, max_len).repeat_interleave(n, 0), topk)
            return (lambda: fn(logits)), _same_slot_sets(fn(logits), select(logits))
        stages["top-k"].peers["fast_topk_transform_fused"] = make_topk
    elif status["fast_topk"]["ok"] and topk == 2048:  # an sgl-kernel without it: positions, untranslated
        stages["top-k"].peers["fast_topk"] = _topk_peers(logits, seqlens, topk, status)["fast_topk"]
    if status["FlashMLA"]["ok"] and h <= 128:
        h_pad = 64 if h <= 64 else 128
        q_pad = torch.cat((q.view(B, n, h, 576), q.new_zeros(B, n, h_pad - h, 576)), dim=2)
        name = "FlashMLA" if h == h_pad else f"FlashMLA (q padded to {h_pad} heads)"
        stages["attention"].peers[name] = _flashmla_decode(q_pad, mla, sel.view(B, n, topk), attn.softmax_scale,
                                                           lens[:, -1].contiguous(),
                                                           lambda: (attend(sel)[0].view(B, n, h, -1),))

    def step():
        return attend(select(indexer()))

    total = Bench(step, lambda: checks.composite(stages), bytes=sum(s.bytes for s in stages.values()),
                  flops=sum(s.flops for s in stages.values()), parts=tuple(stages.values()))
    if all(s.peers for s in stages.values()):
        def make_chain():  # the peers' three ops back to back
            fns = [make()[0] for s in stages.values() for make in s.peers.values()]
            return (lambda: [f() for f in fns]), {"summary": "the three in a row"}
        total.peers["+".join(p for s in stages.values() for p in s.peers)] = make_chain
    return [(f": {n}", b) for n, b in stages.items()] + [(": step", total)]


def _setup_layer_prefill(p: dict, dev, status) -> list[tuple[str, Bench]]:
    """One layer's prefill of a ``ctx``-token prompt in chunks of ``chunk`` query rows, through the layer's own
    extend stages on a KVPool of fp8 pages (what ``DSAAttention.forward`` runs in EXTEND mode once the chunk's rows
    are stored): ``select`` (the prompt's index keys gathered, then ``indexer_topk_ragged``: logits and top-k in
    query chunks within ``max_logits_bytes``), ``pool.read`` (the MLA pages dequantised to a bf16 ``[N, 576]``)
    and ``sparse_mla_prefill``. Rows: the last chunk's three stages, the last chunk, and the whole prompt (every
    chunk in turn: the causal prefill of one layer). Peers: DeepGEMM's ragged logits -> sgl-kernel ``fast_topk``
    (materialising the chunk's ``[T, N]`` fp32 logits) -> FlashMLA's prefill, on the same gathered keys and KV
    (the two gathers are ours in both chains: an engine reads its cache too). Timed as plain calls (the
    selection reads its row bounds on the host, as prefill does), each with the extra peak memory of one call."""
    import dataclasses

    from flashdsa import ops
    from flashdsa.cache.metadata import build_extend
    from flashdsa.config import DSAConfig
    from flashdsa.layers.attention import DSAAttention
    from flashdsa.layers.indexer import IndexerOutput
    from flashdsa.quant import FP8
    cfg = DSAConfig.preset(p["preset"]).replace(num_hidden_layers=1)
    ctx, chunk, topk = p["ctx"], p["chunk"], cfg.index_topk
    H_I, h = cfg.index_n_heads, cfg.num_attention_heads
    g = torch.Generator(device=dev).manual_seed(ctx + 3)
    with torch.device("meta"):
        attn = DSAAttention(cfg, 0)
    pool, _ = _filled_pool(cfg, 1, ctx, 0, g, dev)  # the whole prompt stored: each chunk's rows before it selects
    backend = None if torch.device(dev).type == "cuda" else "triton"
    T0 = min(chunk, ctx)
    idx0 = IndexerOutput(randn((T0, H_I, 128), g, dev, FP8), randn((T0, H_I), g, dev) * H_I ** -0.5, None, None)
    q0 = randn((T0, h, 576), g, dev, torch.bfloat16)
    metas, inputs = [], []
    for end in range(ctx, 0, -chunk):  # the last chunk first; built on the host up front, as a runner would
        T = min(chunk, end)
        meta = build_extend(pool.allocator, [0], [T], dense_threshold=0, backend=backend)
        # build_extend takes a request's last T tokens as the new ones: the chunk ending at ``end`` is that of a
        # prompt of ``end`` tokens, so its key range and gathered slots stop there (what select / read use)
        meta = dataclasses.replace(meta, kv_slots=meta.kv_slots[:end], ke=meta.ke - (ctx - end),
                                   bounds_host=meta.bounds_host - torch.tensor([[0], [ctx - end]], dtype=torch.int32))
        metas.append(meta)
        # every chunk's queries are the last chunk's first T rows: the work, not the values, is what is timed
        inputs.append((IndexerOutput(idx0.q[:T], idx0.weights[:T], None, None), q0[:T]))
    meta, (idx, q) = metas[0], inputs[0]

    def select(m, i):
        return attn.select(i, m, pool)

    def gather(m):
        return pool.read(0, m.kv_slots)

    def attend(q_, kv, sel):
        return ops.sparse_mla_prefill(q_, kv, sel, attn.softmax_scale, backend=backend)

    def chunk_step(m, i, q_):
        return attend(q_, gather(m), select(m, i))

    sel, kv = select(meta, idx), gather(meta)
    T, N = q.shape[0], kv.shape[0]
    sub = rows_subset(T, 16, dev)
    k_fp8, k_scale = pool.read_index(0, meta.kv_slots)
    checks = _StageChecks()

    def check_select():
        # the unfused path's logits (ours: the top-k must equal the torch top-k of exactly these; a reference
        # pipeline would round the logits differently and part at near-ties), checked against the torch logits
        x = ops.indexer_logits_ragged(idx.q, k_fp8, k_scale, idx.weights, meta.ks, meta.ke, backend=backend)[sub]
        lg = _check_logits(x, ops.indexer_logits_ragged(idx.q[sub], k_fp8, k_scale, idx.weights[sub], meta.ks[sub],
                                                        meta.ke[sub], backend="torch"))
        ref = ops.topk_transform(x, meta.ke[sub] - meta.ks[sub], topk, row_starts=meta.ks[sub],
                                 out_offsets=meta.ks[sub], backend="torch")
        same = _check_same(select(meta, idx)[sub], ref)
        return {"ok": lg["ok"] and same["ok"], "summary": f"logits {lg['summary']}; top-k {same['summary']}"}

    def check_attention():
        out, lse = attend(q, kv, sel)
        return _check_attention(out[sub], lse[sub], *ops.sparse_mla_prefill(q[sub], kv, sel[sub], attn.softmax_scale,
                                                                             backend="torch"))

    def check_gather():  # the gathered rows against the 656-B layout decoded from the raw page bytes
        rows = meta.kv_slots[sub.long()]
        ref = dequantize_mla_656(pool.mla_pages(0).reshape(-1, MLA_FP8_BYTES)[rows])
        same = bool(torch.equal(gather(meta)[sub.long()], ref))
        return {"ok": same, "summary": "same bits" if same else "rows differ"}

    pairs = int((meta.ke - meta.ks).sum())
    stages = {
        "selection": Bench(lambda: select(meta, idx), checks.wrap("selection", check_select),
                           bytes=idx.q.numel() + 4 * idx.weights.numel() + 132 * N + 4 * T * topk,
                           flops=2 * pairs * H_I * 128, dtype="fp8", graph=False, memory=True),
        "kv gather": Bench(lambda: gather(meta), checks.wrap("kv gather", check_gather), bytes=(656 + 1152) * N,
                           graph=False, memory=True),
        "attention": Bench(lambda: attend(q, kv, sel), checks.wrap("attention", check_attention), graph=False,
                           memory=True, **_attention_work(sel.numel(), h, 1152, q, sel)),
    }
    peers_ok = status["DeepGEMM"]["ok"] and status["fast_topk"]["ok"] and status["FlashMLA"]["ok"] \
        and topk == 2048 and h % 64 == 0

    def peer_select(m, i):  # DeepGEMM ragged logits -> fast_topk, one chunk
        kf, ksc = pool.read_index(0, m.kv_slots)
        logits = peers.deepgemm_ragged(i.q, kf, ksc, i.weights, m.ks, m.ke)()
        out = torch.empty(logits.shape[0], topk, dtype=torch.int32, device=logits.device)
        torch.ops.sgl_kernel.fast_topk(logits, out, m.ke - m.ks, None)
        return out

    def peer_chunk(m, i, q_):  # ... -> FlashMLA
        return peers.flashmla_prefill(q_, gather(m), peer_select(m, i), attn.softmax_scale)()

    if peers_ok:
        def make_select():
            call = lambda: peer_select(meta, idx)  # noqa: E731
            return call, _same_slot_sets(call(), select(meta, idx))
        stages["selection"].peers["DeepGEMM+fast_topk"] = make_select

        def make_attend():
            fn = peers.flashmla_prefill(q, kv, sel, attn.softmax_scale)
            out = attend(q, kv, sel)[0]
            return fn, _masked_cos(out.float(), fn()[0], torch.ones_like(out, dtype=torch.bool))
        stages["attention"].peers["FlashMLA"] = make_attend

    def stages_check():
        return checks.composite(stages)

    last = Bench(lambda: chunk_step(meta, idx, q), stages_check, bytes=sum(s.bytes for s in stages.values()),
                 flops=sum(s.flops for s in stages.values()), parts=tuple(stages.values()), graph=False, memory=True)
    def whole_prompt(step):  # each chunk's output dropped before the next, so the peak is one chunk's work
        for m, (i, q_) in zip(metas, inputs):
            step(m, i, q_)
    whole = Bench(lambda: whole_prompt(chunk_step), stages_check, graph=False, memory=True)
    if peers_ok:
        last.peers["DeepGEMM+fast_topk+FlashMLA"] = lambda: ((lambda: peer_chunk(meta, idx, q)),
                                                             {"summary": "the three in a row"})
        whole.peers["DeepGEMM+fast_topk+FlashMLA"] = lambda: ((lambda: whole_prompt(peer_chunk)),
                                                              {"summary": "every chunk"})
    return [(f": {n}", b) for n, b in stages.items()] + [(": last chunk", last), (f": whole prompt ({len(metas)} "
                                                                                 f"chunks)", whole)]


SETUPS = {"paged": _setup_paged, "ragged": _setup_ragged, "topk": _setup_topk, "selection": _setup_selection,
          "decode": _setup_decode, "prefill": _setup_prefill, "layer": _setup_layer,
          "layer_prefill": _setup_layer_prefill}
