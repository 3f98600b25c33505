"""DSA attention: MLA in its absorbed (MQA) form with the indexer choosing the keys — one layer's whole DSA
step in one place.

Parameter names follow the Hugging Face DeepSeek-V3.2 checkpoint (``self_attn.*``)::

    q_a_proj [q_lora, hidden]  q_a_layernorm  q_b_proj [h * (nope + rope), q_lora]
    kv_a_proj_with_mqa [512 + rope, hidden]  kv_a_layernorm  kv_b_proj [h * (nope + v), 512]
    o_proj [hidden, h * v]     indexer.* (top-k layers only)

Absorbed form: ``kv_b_proj`` splits per head into W_uk [nope, 512] and W_uv [v, 512]. The query's
nope part is mapped into the latent space (``q_nope @ W_uk``) so every head attends over the same
576-dim cache rows (512 latent + 64 rope; D = 512 rows without a rope part for a NoPE model, GLM-5.3-Flash),
and the attention output (512-dim latent) is mapped back with W_uv before ``o_proj``. MLA's own RoPE uses
interleaved pairs (DeepSeek's layout).

The step (:meth:`DSAAttention.forward`), for the batch's new tokens::

    prepare   projections -> absorbed query q [T, h, D], cache rows kv [T, D], query latent qr
    indexer   (top-k layers) q / weights / keys in fp8 (or exact precision)
    exchange  several ranks (batch.parallel): CP all-gathers every rank's kv rows and index keys, DCP keeps
              this rank's shard (flashdsa.parallel)
    store     kv rows (and index keys) into the paged caches at batch.slot_mapping
    select    extend: ragged logits -> top-k into the gathered KV;  decode / verify: paged logits -> top-k
              with slot translation;  skip-top-k layer: the previous layer's selection as is
              (kpool, c > 1: store_kpool pools every c tokens' keys into one; select_kpool scores the
              pooled keys, takes the top topk / c groups and expands them to their tokens, plus the
              unfinished tail group: topk + c - 1 slots per row)
    attend    sparse MLA prefill / decode over the selection, or the dense fallback (extend, short contexts)
    combine   DCP: every rank's partial (out, lse) merged
    finish    W_uv, o_proj

The caller (``engine.Runner`` or ``flashdsa.hf``) prepares the batch — reserves pages and builds the
:class:`~flashdsa.cache.metadata.BatchMetadata` once for all layers — and runs the layer loop.
"""

from __future__ import annotations

import torch
from torch import nn

from flashdsa import ops
from flashdsa._checks import trusted_inputs
from flashdsa.cache.metadata import EXTEND, BatchMetadata
from flashdsa.cache.pool import KVPool
from flashdsa.config import DSAConfig
from flashdsa.layers.indexer import (Indexer, IndexerOutput, exact_kpool_groups, exact_logits_paged, exact_logits_ragged,
                                     exact_topk, pool_as_hf)
from flashdsa.layers.mla_rows import mla_rows, rms_norm
from flashdsa.ops.topk.reference import translate


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class DSAAttention(nn.Module):
    """One DSA attention layer: its projections and its step over the paged caches (module docstring).

    ``self.index_topk`` tokens are selected per query row (``+ c - 1`` with kpool: the tail group);
    ``self.indexer`` is None on a skip-top-k layer.
    """

    def __init__(self, cfg: DSAConfig, layer_id: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.layer_id = layer_id
        self.h, self.nope, self.rope, self.v = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                                                cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.kv_lora_rank = cfg.kv_lora_rank
        self.softmax_scale = cfg.softmax_scale
        self.index_topk = cfg.index_topk
        self.kpool = cfg.index_kpool
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.h * (self.nope + self.rope), bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.kv_lora_rank + self.rope, bias=False, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.h * (self.nope + self.v), bias=False, dtype=dtype)
        self.o_proj = nn.Linear(self.h * self.v, cfg.hidden_size, bias=False, dtype=dtype)
        self.indexer = Indexer(cfg, dtype) if layer_id in cfg.topk_layers else None

    def _w_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.h, self.nope + self.v, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]  # W_uk [h, nope, 512], W_uv [h, v, 512]

    # The dtype of the absorbed query and the cache rows that prepare() hands to the caches and kernels:
    # bf16 for the bf16 / fp8 caches; fp32 for the "fp32" cache, whose kernels are exact to fp32 rounding
    # (set per layer by whoever makes the pool, e.g. flashdsa.hf for an fp32 model).
    mla_dtype: torch.dtype = torch.bfloat16
    # One launch for the RoPE / norm / casts of prepare() (its last-ulp norm differs from the torch ops':
    # flashdsa.hf's exact mode clears it to keep HF's bits)
    fused_rows: bool = True

    def prepare(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str | None = None):
        """``x [T, hidden]`` -> (``q [T, h, D]`` absorbed query, ``kv [T, D]`` cache rows (D = 576, or 512 NoPE), in
        ``self.mla_dtype`` (bf16 or fp32), ``qr [T, q_lora]`` the normed query latent the indexer reads).

        The query latent's norm, and the RoPE, latent norm and casts of the rows, run as one launch each
        (:mod:`flashdsa.layers.mla_rows`) where ``backend`` picks Triton and ``self.fused_rows`` is set; the
        torch ops otherwise."""
        T = x.shape[0]
        be = backend if self.fused_rows else "torch"
        qr = rms_norm(self.q_a_proj(x), self.q_a_layernorm, backend=be)
        q = self.q_b_proj(qr).view(T, self.h, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        w_uk, _ = self._w_kv_b()
        # In the weights' dtype (fp32 accumulation inside the GEMM): an fp32 copy of W_uk per call would
        # move 3x its bytes every decode step, and q is rounded to mla_dtype for the kernels anyway.
        q_lat = torch.einsum("thn,hnc->thc", q_nope.to(w_uk.dtype), w_uk)
        kv = self.kv_a_proj_with_mqa(x)
        q_abs, kv_rows = mla_rows(q_lat, q_pe, kv, self.kv_a_layernorm, cos, sin, self.mla_dtype, backend=be)
        return q_abs, kv_rows, qr

    def finish(self, out_latent: torch.Tensor) -> torch.Tensor:
        """``out_latent [T, h, 512]`` (bf16, or fp32 from an fp32 cache) -> ``[T, hidden]`` (W_uv per head,
        then o_proj)."""
        _, w_uv = self._w_kv_b()
        o = torch.einsum("thc,hvc->thv", out_latent.to(w_uv.dtype), w_uv).to(self.o_proj.weight.dtype)
        return self.o_proj(o.flatten(1))

    # ---- the step -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: BatchMetadata, pool: KVPool,
                prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's DSA step for the batch's T new tokens.

        Args:
            x:        ``[T, hidden]`` the normed hidden states of the new tokens, in ``batch``'s order.
            cos, sin: ``[T, rope_dim / 2] float32`` RoPE tables of the tokens' positions.
            batch:    the batch's metadata (shared by every layer of one forward).
            pool:     the paged caches; ``self.layer_id`` picks this layer's.
            prev:     the previous layer's selection, which a skip-top-k layer reuses; None otherwise.

        Returns ``(out [T, hidden], selection)``: the selection to hand to the next layer — ``[T, topk]
        int32`` slots (decode / verify) or rows of the gathered KV (extend) — or None after the dense fallback.

        The ops run without their value checks: ``batch`` was built on the host from the page allocator
        (in bounds by construction), and each check would be a host sync (shapes and dtypes are still
        checked).
        """
        with trusted_inputs():
            q, kv_rows, qr = self.prepare(x, cos, sin, batch.backend)
            idx = self.indexer(x, qr, cos, sin) if self.indexer is not None else None
            par = batch.parallel  # several ranks (flashdsa.parallel): CP gathers the sequence, DCP keeps a shard
            if par is not None:
                kv_rows, idx = par.exchange(kv_rows, idx)
            self.store(kv_rows, idx, batch, pool)
            if batch.mode == EXTEND:
                kv = pool.read(self.layer_id, batch.kv_slots)  # [N, D] bf16: every request's whole KV
                if batch.use_dense:
                    out, _ = ops.dense_mla_prefill(q, kv, batch.cu_seqlens_q, batch.cu_seqlens_kv, self.softmax_scale,
                                                   backend=batch.backend)
                    return self.finish(out), None
                sel = prev if idx is None else self.select(idx, batch, pool)
                out, lse = ops.sparse_mla_prefill(q, kv, sel, self.softmax_scale, backend=batch.backend)
            else:
                sel = prev if idx is None else self.select(idx, batch, pool)
                out, lse = self.attend(q, sel, batch, pool)
            if par is not None:
                out = par.combine(out, lse)
            return self.finish(out), sel

    def store(self, kv_rows: torch.Tensor, idx: IndexerOutput | None, batch: BatchMetadata, pool: KVPool) -> None:
        """Write the new tokens' cache rows ``kv_rows [T, D]`` and index keys at ``batch.slot_mapping``."""
        lid = self.layer_id
        if idx is not None and idx.pooled and not idx.exact:
            return self.store_kpool(kv_rows, idx, batch, pool)
        if idx is None or idx.exact:
            pool.write(lid, batch.slot_mapping, kv_rows)
            if idx is not None:
                pool.exact_index_cache(lid, idx.k.dtype)[batch.slot_mapping] = idx.k
                if idx.pooled:  # exact kpool pools at selection time, from every token's key and gate
                    pool.exact_index_cache(lid, idx.k.dtype, gate=True)[batch.slot_mapping] = idx.gate
        else:
            pool.write(lid, batch.slot_mapping, kv_rows, idx.k, idx.k_scale)

    def select(self, idx: IndexerOutput, batch: BatchMetadata, pool: KVPool) -> torch.Tensor:
        """The top-k of every query row: ``[T, topk] int32``, -1 padded.

        extend: rows of the gathered KV (``batch.kv_slots`` order), scored in query chunks so the ``[T, N]``
        fp32 logits never exceed ``batch.max_logits_bytes``. decode / verify: physical slots.
        """
        lid, topk, be = self.layer_id, self.index_topk, batch.backend
        if batch.parallel is not None and batch.parallel.shards_kv:  # DCP: this rank holds part of the keys
            return batch.parallel.select(self, idx, batch, pool)
        if idx.pooled:
            return self.select_kpool_exact(idx, batch, pool) if idx.exact else self.select_kpool(idx, batch, pool)
        if idx.exact:
            return self.select_exact(idx, batch, pool)
        if batch.mode != EXTEND:
            return self.topk_paged(self.score_paged(idx, batch, pool), batch, pool)
        k_fp8, k_scale = pool.read_index(lid, batch.kv_slots)
        return ops.indexer_topk_ragged(idx.q, k_fp8, k_scale, idx.weights, batch.ks, batch.ke, topk,
                                       out_offsets=batch.ks, max_logits_bytes=batch.max_logits_bytes, backend=be,
                                       host_bounds=batch.bounds_host)

    def select_exact(self, idx: IndexerOutput, batch: BatchMetadata, pool: KVPool) -> torch.Tensor:
        """Exact precision's top-k, in :meth:`select`'s output: rows of the gathered KV (extend) or slots
        (decode / verify). Ties go to the smaller position (``topk_transform``: what CUDA's ``torch.topk``
        picks too), unless the caller lays the rows out as HF does (``batch.index_columns``, set by
        ``flashdsa.hf``) off CUDA: then HF's own ``torch.topk`` over those rows (:func:`exact_topk`), whose
        partial sort sends ties elsewhere on the CPU."""
        topk, cols, be = self.index_topk, batch.index_columns, batch.backend
        store = pool.exact_index_cache(self.layer_id, idx.k.dtype)
        hf_rows = cols is not None and not idx.q.is_cuda
        if batch.mode == EXTEND:
            logits = exact_logits_ragged(idx.q, store[batch.kv_slots], idx.weights, batch.ks, batch.ke)
            if not hf_rows:
                return ops.topk_transform(logits, batch.ke - batch.ks, topk, row_starts=batch.ks,
                                          out_offsets=batch.ks, backend=be)
            cq, ckv = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_kv.tolist()
            # request b: its rows over its own keys; positions then offset by its first key (= its rows' ks)
            pos = [exact_topk(logits[cq[b]:cq[b + 1], ckv[b]:ckv[b + 1]], topk, cols[b]) for b in range(len(cq) - 1)]
            return translate(torch.cat(pos), None, batch.ks, pool.page_size)
        logits = self.score_paged(idx, batch, pool)
        if not hf_rows:
            return self.topk_paged(logits, batch, pool)
        n = batch.context_lens.shape[1]
        pos = [exact_topk(logits[b * n:(b + 1) * n], topk, cols[b]) for b in range(cols.shape[0])]
        return translate(torch.cat(pos), batch.block_table, None, pool.page_size)

    # ---- kpool (docs/DSA.md §7): a second kind of store and select ----------------------------------
    def store_kpool(self, kv_rows: torch.Tensor, idx: IndexerOutput, batch: BatchMetadata, pool: KVPool) -> None:
        """Write the MLA rows, the pooled key of every group the batch touches (a group still filling is
        written as far as it goes and rewritten when it fills: no row scores it before it is complete),
        then the raw keys of each request's last tokens into its tail ring (after: the pooling reads the
        ring's older tokens)."""
        lid, c = self.layer_id, self.kpool
        ring = pool.tail_ring(lid, idx.k.dtype)
        # every new token's position: under prefill CP the batch's own are this rank's query rows
        positions = batch.positions if batch.parallel is None else batch.parallel.new_positions
        k_fp8, k_scale = ops.kpool_compress(idx.k, idx.gate, ring, self.indexer.index_kpool_compress_ape.float(),
                                            positions, batch.kpool_rows, batch.kpool_first,
                                            batch.kpool_anchors, backend=batch.backend)
        # pooled key g of a request sits at page block_table[g // 64], row g % 64: its token p = g c + i at
        # page block_table[p // 64 c], row p % 64 c, so the index slot is the token's slot // c
        every = batch.kpool_every_token  # decode: anchors and ring tokens are all tokens, skip the gathers
        index_slots = (batch.slot_mapping if every else batch.slot_mapping[batch.kpool_anchors]) // c
        pool.write(lid, batch.slot_mapping, kv_rows, k_fp8, k_scale, index_slots=index_slots)
        if every:
            pool.write_tail(lid, batch.kpool_rows, positions, idx.k, idx.gate)
        else:
            tail = batch.kpool_tail_tokens
            pool.write_tail(lid, batch.kpool_rows[tail], positions[tail], idx.k[tail], idx.gate[tail])

    def select_kpool(self, idx: IndexerOutput, batch: BatchMetadata, pool: KVPool) -> torch.Tensor:
        """kpool's top-k of every query row: the top ``topk / c`` complete groups by the logits of their pooled
        keys (exact, ties to the smaller group), each expanded to its c tokens, then the row's unfinished
        tail group: ``[T, topk + c - 1] int32``, -1 padded; rows of the gathered KV (extend) or physical
        slots (decode / verify), as :meth:`select`."""
        c, be = self.kpool, batch.backend
        groups = self.index_topk // c
        if batch.mode == EXTEND:
            k_fp8, k_scale = pool.read_index(self.layer_id, batch.kpool_slots)
            top = ops.indexer_topk_ragged(idx.q, k_fp8, k_scale, idx.weights, batch.kpool_ks, batch.kpool_ke, groups,
                                          max_logits_bytes=batch.max_logits_bytes, backend=be)
            return ops.kpool_expand(top, batch.ke - batch.ks, c, out_offsets=batch.ks, backend=be)
        B, n = batch.context_lens.shape
        pooled_lens = batch.context_lens // c  # complete groups each row sees
        logits = ops.indexer_logits_paged(idx.q.view(B, n, *idx.q.shape[1:]), pool.index_cache(self.layer_id),
                                          idx.weights, pooled_lens, batch.block_table, batch.max_context_len // c,
                                          backend=be)
        top = ops.topk_transform(logits, pooled_lens.view(-1), groups, backend=be)
        return ops.kpool_expand(top, batch.context_lens.view(-1), c, page_table=batch.block_table,
                                page_size=pool.page_size, backend=be)

    def select_kpool_exact(self, idx: IndexerOutput, batch: BatchMetadata, pool: KVPool) -> torch.Tensor:
        """Exact precision's kpool selection, in :meth:`select_kpool`'s output: HF's ``Glm5NextTextIndexer``
        — each request's complete groups pooled from the stored keys and gates (:func:`pool_as_hf`),
        scored exactly, the top ``topk / c`` (:func:`exact_kpool_groups`; HF's ``torch.topk`` rows where
        ``batch.index_columns`` lays them out off CUDA), expanded with the row's tail. Re-pools the whole
        context each call: a study path, O(context) per layer and step."""
        c, lid, be = self.kpool, self.layer_id, batch.backend
        if batch.parallel is not None:
            raise NotImplementedError("exact-precision kpool under context parallelism: the pooled keys are made "
                                      "at selection time from one process's stores; use indexer='fp8'")
        keys = pool.exact_index_cache(lid, idx.k.dtype)
        gates = pool.exact_index_cache(lid, idx.k.dtype, gate=True)
        ape = self.indexer.index_kpool_compress_ape
        cols = batch.index_columns if not idx.q.is_cuda else None
        width = None if cols is None else int(((cols.max(dim=1).values + 1) // c).max())
        if batch.mode == EXTEND:
            lengths = batch.ke - batch.ks
            cq, ckv = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_kv.tolist()
            parts = [(slice(cq[b], cq[b + 1]), batch.kv_slots[ckv[b]:ckv[b + 1]]) for b in range(len(cq) - 1)]
        else:
            B, n = batch.context_lens.shape
            lengths = batch.context_lens.view(-1)
            ps = pool.page_size
            parts = []
            for b, L in enumerate(batch.context_lens.max(dim=1).values.tolist()):
                p = torch.arange(L, device=keys.device)
                parts.append((slice(b * n, (b + 1) * n), batch.block_table[b, p // ps].long() * ps + p % ps))
        top = torch.cat([exact_kpool_groups(idx.q[rows], idx.weights[rows], pool_as_hf(keys[s], gates[s], ape),
                                            lengths[rows], c, self.index_topk // c, width, backend=be)
                         for rows, s in parts])
        if batch.mode == EXTEND:
            return ops.kpool_expand(top, lengths, c, out_offsets=batch.ks, backend=be)
        return ops.kpool_expand(top, lengths, c, page_table=batch.block_table, page_size=pool.page_size, backend=be)

    def score_paged(self, idx: IndexerOutput, batch: BatchMetadata, pool: KVPool) -> torch.Tensor:
        """Decode / verify indexer logits ``[B * n, max_context_len] float32`` over the paged keys."""
        B, n = batch.context_lens.shape
        q = idx.q.view(B, n, *idx.q.shape[1:])
        if idx.exact:
            return exact_logits_paged(q, pool.exact_index_cache(self.layer_id, idx.k.dtype), idx.weights,
                                      batch.context_lens, batch.block_table, batch.max_context_len, pool.page_size)
        return ops.indexer_logits_paged(q, pool.index_cache(self.layer_id), idx.weights, batch.context_lens,
                                        batch.block_table, batch.max_context_len, backend=batch.backend)

    def topk_paged(self, logits: torch.Tensor, batch: BatchMetadata, pool: KVPool) -> torch.Tensor:
        """Exact top-k of decode / verify logits, translated to physical slots: ``[B * n, topk] int32``."""
        return ops.topk_transform(logits, batch.context_lens.view(-1), self.index_topk, page_table=batch.block_table,
                                  page_size=pool.page_size, backend=batch.backend)

    def attend(self, q: torch.Tensor, sel: torch.Tensor, batch: BatchMetadata,
               pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse MLA decode / verify of ``q [B * n, h, D] bf16`` over the selected slots ``sel [B * n, topk]``:
        latent outputs ``[B * n, h, 512] bf16`` and their ``lse [B * n, h] float32``.

        The pages and indices come from ``pool.mla_for_attention``: the layer's cache and ``sel`` itself, or,
        with host offload, the device buffer the selected rows were just swapped into and their rows there."""
        B, n = batch.context_lens.shape
        pages, indices = pool.mla_for_attention(self.layer_id, sel, batch)
        out, lse = ops.sparse_mla_decode(q.view(B, n, *q.shape[1:]), pages, indices.view(B, n, -1),
                                         self.softmax_scale, kv_scale=pool.kv_scale, backend=batch.backend)
        return out.view(B * n, *out.shape[2:]), lse.view(B * n, -1)
