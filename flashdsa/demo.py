"""The main job: the DSA pipeline of one attention layer, end to end, on paged caches, with its checks.

A batch of requests whose contexts straddle ``index_topk`` is written into the two paged caches
(scattered pages), then one decode step, one MTP verify step and one ragged prefill run through
indexer -> top-k -> sparse MLA. Checks: sparse == dense where every context fits in top-k; every verify
row selects only positions it may see; the fp8 656 cache agrees with the bf16 cache.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from flashdsa import ops
from flashdsa.cache import layouts
from flashdsa.config import DSAConfig
from flashdsa.quant import act_quant, hadamard


def _indexer_q(T: int, H: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rotated, quantised indexer queries and their folded head gates (SPEC §3 steps 3-5)."""
    q = hadamard(torch.randn(T, H, 128, generator=gen).to(device))
    q_fp8, q_scale = act_quant(q)
    w = torch.randn(T, H, generator=gen).to(device) * H ** -0.5 * q_scale[..., 0] * 128 ** -0.5
    return q_fp8, w


def run_demo(preset: str = "tiny", device: str = "cpu", next_n: int = 2, seed: int = 0,
             backend: str | None = None, log: Callable[[str], None] | None = print) -> dict:
    log = log or (lambda *_: None)
    cfg = DSAConfig.preset(preset)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch sees no CUDA device")
    if next_n < 1:
        raise ValueError(f"next_n: expected >= 1, got {next_n}")
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    k, H, h_q = cfg.index_topk, cfg.index_n_heads, cfg.num_attention_heads
    sm_scale = cfg.softmax_scale
    # Contexts below, at and above top-k, so both the dense-equivalent and the truly sparse case run.
    lens = [k // 2, k, k + 1, 3 * k + 7]
    B = len(lens)
    stages: dict[str, float] = {}

    def timed(name: str, fn):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        stages[name] = stages.get(name, 0.0) + time.perf_counter() - t0
        return out

    # ---- caches: pages handed out in a shuffled order so block tables are not the identity ----------
    maxp = (max(lens) + 63) // 64
    n_pages = B * maxp
    perm = torch.randperm(n_pages, generator=gen)
    block_table = perm.view(B, maxp).to(torch.int32).to(dev)
    index_cache = torch.zeros(n_pages, layouts.INDEX_PAGE_BYTES, dtype=torch.uint8, device=dev)
    cache_fp8 = torch.zeros(n_pages, 64, layouts.MLA_FP8_BYTES, dtype=torch.uint8, device=dev)
    cache_bf16 = torch.zeros(n_pages, 64, layouts.MLA_DIM, dtype=torch.bfloat16, device=dev)
    kvs, keys = [], []
    log(f"[demo] preset={preset} device={device} requests={B} contexts={lens} topk={k} next_n={next_n}")

    def fill():
        for b, S in enumerate(lens):
            pos = torch.arange(S, device=dev)
            slots = block_table[b, pos // 64].long() * 64 + pos % 64
            kv = torch.randn(S, layouts.MLA_DIM, generator=gen).to(dev).bfloat16()
            key_fp8, key_scale = act_quant(hadamard(torch.randn(S, 128, generator=gen).to(dev)))
            layouts.store_mla(cache_fp8, slots, kv)
            layouts.store_mla(cache_bf16, slots, kv)
            layouts.store_index_keys(index_cache, slots, key_fp8, key_scale[:, 0])
            kvs.append(kv)
            keys.append((key_fp8, key_scale[:, 0]))
    timed("cache_write", fill)

    ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
    checks: dict[str, object] = {}

    # ---- decode: paged logits -> top-k with slot translation -> sparse MLA --------------------------
    q_fp8, w = _indexer_q(B, H, gen, dev)
    logits = timed("indexer", lambda: ops.indexer_logits_paged(q_fp8.view(B, 1, H, 128), index_cache, w, ctx.view(B, 1),
                                                               block_table, max(lens), backend=backend))
    slots = timed("topk", lambda: ops.topk_transform(logits, ctx, k, page_table=block_table, backend=backend))
    q = torch.randn(B, 1, h_q, layouts.MLA_DIM, generator=gen).to(dev).bfloat16()
    out8, lse8 = timed("sparse_mla", lambda: ops.sparse_mla_decode(q, cache_fp8, slots.view(B, 1, k), sm_scale, backend=backend))
    out16, _ = ops.sparse_mla_decode(q, cache_bf16, slots.view(B, 1, k), sm_scale, backend=backend)
    # Dense attention over each whole context, from the bf16 cache.
    dense, _ = ops.dense_mla_prefill(q.view(B, h_q, -1), torch.cat(kvs), torch.arange(B + 1, dtype=torch.int32, device=dev),
                                     torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32), sm_scale)
    fits = [b for b, S in enumerate(lens) if S <= k]
    checks["dense_equivalence_max_abs"] = float((out16.view(B, h_q, -1)[fits].float() - dense[fits].float()).abs().max())
    cos = torch.nn.functional.cosine_similarity(out8.float().flatten(), out16.float().flatten(), dim=0)
    checks["fp8_vs_bf16_cache_cosine"] = float(cos)

    # ---- MTP verify: next_n drafts per request, per-row causal lengths ------------------------------
    n = next_n
    vlens = torch.tensor([[S - n + j + 1 for j in range(n)] for S in lens], dtype=torch.int32, device=dev)
    vq, vw = _indexer_q(B * n, H, gen, dev)
    vlogits = timed("indexer", lambda: ops.indexer_logits_paged(vq.view(B, n, H, 128), index_cache, vw, vlens, block_table,
                                                                max(lens), backend=backend))
    vpos = ops.topk_transform(vlogits, vlens.view(-1), k, backend=backend)
    causal = bool(((vpos < vlens.view(-1, 1)) | (vpos == -1)).all())
    checks["verify_rows_causal"] = causal

    # ---- prefill (ragged): every request's queries against its own keys -----------------------------
    T = sum(lens)
    starts = torch.tensor([0] + lens[:-1], device=dev).cumsum(0)
    ks = torch.cat([torch.full((S,), int(s0), dtype=torch.int32, device=dev) for s0, S in zip(starts, lens)])
    ke = torch.cat([torch.arange(int(s0) + 1, int(s0) + S + 1, dtype=torch.int32, device=dev) for s0, S in zip(starts, lens)])
    pq, pw = _indexer_q(T, H, gen, dev)
    all_k = torch.cat([kk for kk, _ in keys])
    all_s = torch.cat([ss for _, ss in keys])
    plogits = timed("indexer", lambda: ops.indexer_logits_ragged(pq, all_k, all_s, pw, ks, ke, backend=backend))
    pidx = timed("topk", lambda: ops.topk_transform(plogits, ke - ks, k, row_starts=ks, out_offsets=ks, backend=backend))
    pq_mla = torch.randn(T, h_q, layouts.MLA_DIM, generator=gen).to(dev).bfloat16()
    kv_all = torch.cat(kvs)
    pout, _ = timed("sparse_mla", lambda: ops.sparse_mla_prefill(pq_mla, kv_all, pidx, sm_scale, backend=backend))
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    pdense, _ = ops.dense_mla_prefill(pq_mla, kv_all, cu, cu, sm_scale)
    # Rows whose visible prefix is <= topk select everything they see: sparse must equal dense there.
    short = (ke - ks <= k)
    checks["prefill_dense_equivalence_max_abs"] = float((pout[short].float() - pdense[short].float()).abs().max())

    ok = (checks["dense_equivalence_max_abs"] < 2e-2 and checks["prefill_dense_equivalence_max_abs"] < 2e-2
          and checks["fp8_vs_bf16_cache_cosine"] > 0.99 and causal)
    total = sum(stages.values())
    kv_bytes = {"bf16": layouts.MLA_BF16_BYTES, "fp8": layouts.MLA_FP8_BYTES, "fp8_raw": layouts.MLA_FP8_RAW_BYTES,
                "index": layouts.INDEX_BYTES_PER_TOKEN}
    report = {"ok": ok, "device": device, "preset": preset, "backend": backend or ("triton" if dev.type == "cuda" else "torch"),
              "contexts": lens, "next_n": n, "stages_s": stages, "tokens_per_s": (T + B + B * n) / total,
              "kv_bytes_per_token_per_layer": kv_bytes, **checks}
    for name, sec in stages.items():
        log(f"[demo] {name:<12} {sec * 1e3:9.2f} ms")
    for name, val in checks.items():
        log(f"[demo] check {name}: {val}")
    log(f"[demo] KV bytes/token/layer: MLA fp8 {kv_bytes['fp8']} (bf16 {kv_bytes['bf16']}, raw {kv_bytes['fp8_raw']}) + indexer {kv_bytes['index']}")
    log(f"[demo] {'ok' if ok else 'FAILED'}")
    return report
