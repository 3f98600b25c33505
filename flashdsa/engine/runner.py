"""The runner: drives a DSA model over the paged caches in the forward modes of a serving engine.

    extend         new tokens on top of a cached prefix (prefill, chunked or not): ragged indexer ->
                   top-k with offsets into the gathered KV -> sparse MLA prefill; or the dense fallback
    decode         one token per request: paged indexer -> top-k + slot translation -> sparse MLA decode
    target_verify  next_n draft tokens per request, each row causal over the drafts before it
    draft_extend   same path as target_verify (the draft model's extend over accepted tokens)

Metadata is built once per batch (``engine.metadata``) and shared by all layers; a skip-top-k layer
reuses the previous layer's selection as is. On CUDA, decode can be captured once in a CUDA graph and
replayed with the metadata refreshed in place (:class:`DecodeGraph`).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from flashdsa import ops
from flashdsa._checks import trusted_inputs
from flashdsa.cache.allocator import OutOfPagesError
from flashdsa.cache.layouts import PAGE_SIZE
from flashdsa.cache.pool import KVPool
from flashdsa.config import DSAConfig
from flashdsa.engine.metadata import (DECODE, DRAFT_EXTEND, EXTEND, TARGET_VERIFY, BatchMetadata, build_decode,
                                      build_extend)
from flashdsa.engine.model import DSAModel
from flashdsa.layers.attention import DSAAttention
from flashdsa.layers.indexer import exact_logits_paged, exact_logits_ragged


class Runner:
    """Owns the KV pool of one model and runs batches through it.

    Args:
        model:           a :class:`DSAModel` (weights on the device the caches should live on). A caller that
                         runs its own model (``flashdsa.hf``) makes the runner with :meth:`for_layers` and
                         calls :meth:`attention` per layer instead of :meth:`forward`.
        num_pages:       pages in the pool (each ``config.page_size`` tokens, every layer).
        kv_format:       MLA cache format: "fp8" (656 B, default), "bf16" or "fp8_raw" (needs kv_scale).
        backend:         force the ops' backend ("torch" / "triton"); default per device.
        dense_threshold: extend runs the dense fallback when every kv length <= this (default index_topk);
                         0 disables the fallback.
        record:          keep each layer's selection of the last batch in ``self.selections`` (tests).
        max_logits_bytes: the largest indexer-logits buffer one prefill chunk of query rows may use.

    An indexer with ``precision="exact"`` keeps its float keys in ``self.exact_keys`` (one ``[P * page_size,
    128]`` store per top-k layer, made on first use) instead of the fp8 pages, and is scored in fp32.
    """

    def __init__(self, model: DSAModel | None, num_pages: int, kv_format: str = "fp8", *,
                 backend: str | None = None, dense_threshold: int | None = None, kv_scale: float | None = None,
                 record: bool = False, max_dense_tokens: int = 1 << 16, max_logits_bytes: int = 1 << 30,
                 config: DSAConfig | None = None, device: torch.device | str | None = None):
        if model is not None:
            config, device = model.config, next(model.parameters()).device
        elif config is None or device is None:
            raise ValueError("model: expected a DSAModel, or model=None with config= and device= (Runner.for_layers)")
        self.model = model
        self.cfg = config
        if self.cfg.index_kpool > 1:
            raise NotImplementedError("index_kpool > 1: the pooled-key indexer path (SPEC §7) is not built yet; "
                                      "the pool and config support it, the runner does not")
        device = torch.device(device)
        self.pool = KVPool(self.cfg, num_pages, kv_format, device, kv_scale)
        self.alloc = self.pool.allocator
        self.backend = backend
        self.dense_threshold = self.cfg.index_topk if dense_threshold is None else dense_threshold
        self.max_dense_tokens = max_dense_tokens
        self.max_logits_bytes = max_logits_bytes
        self.record = record
        self.selections: dict[int, torch.Tensor] = {}
        self.exact_keys: dict[int, torch.Tensor] = {}

    @classmethod
    def for_layers(cls, config: DSAConfig, device: torch.device | str, num_pages: int, kv_format: str = "fp8",
                   **kwargs) -> "Runner":
        """A runner that owns the caches but not the model: its caller runs the rest of the model and calls
        :meth:`attention` for each layer (how ``flashdsa.hf`` drives HF's own models). Keywords as in
        the constructor."""
        return cls(None, num_pages, kv_format, config=config, device=device, **kwargs)

    # ---- requests ------------------------------------------------------------------------------
    def free(self, req_id: Hashable) -> None:
        self.alloc.free(req_id)

    def reserve(self, new_tokens: dict[Hashable, int]) -> None:
        """Reserve tokens for a whole batch (new requests are created), all or nothing."""
        need = 0
        for r, n in new_tokens.items():
            cur = self.alloc.seq_len(r) if r in self.alloc else 0
            have = len(self.alloc.pages(r)) if r in self.alloc else 0
            need += self.alloc.pages_for(cur + n) - have
        if need > self.alloc.num_free_pages:
            raise OutOfPagesError(list(new_tokens), need, self.alloc.num_free_pages)
        for r, n in new_tokens.items():
            if r in self.alloc:
                self.alloc.extend(r, n)
            else:
                self.alloc.allocate(r, n)

    # ---- forward modes -------------------------------------------------------------------------
    @torch.no_grad()
    def extend(self, chunks: dict[Hashable, Sequence[int] | torch.Tensor], *, force_sparse: bool = False) -> torch.Tensor:
        """Append each request's new tokens (new requests are created) and run them.

        Returns ``[T, vocab] float32`` logits of every new token, requests in dict order.
        """
        ids = [torch.as_tensor(t, dtype=torch.int64).flatten() for t in chunks.values()]
        self.reserve({r: len(t) for r, t in zip(chunks, ids)})
        meta = self.extend_metadata(list(chunks), [len(t) for t in ids], force_sparse=force_sparse)
        return self.forward(torch.cat(ids).to(self.pool.device), meta)

    def extend_metadata(self, req_ids: list, q_lens: list[int], *, force_sparse: bool = False) -> BatchMetadata:
        """Metadata of an extend whose tokens are reserved, with this runner's dense-fallback rule."""
        return build_extend(self.alloc, req_ids, q_lens, dense_threshold=self.dense_threshold,
                            dense_allowed=not force_sparse and self.pool.kv_format != "fp8_raw",
                            max_dense_tokens=self.max_dense_tokens)

    @torch.no_grad()
    def decode(self, tokens: dict[Hashable, int]) -> torch.Tensor:
        """One token per live request. Returns ``[B, vocab] float32``."""
        self.reserve({r: 1 for r in tokens})
        meta = build_decode(self.alloc, list(tokens), 1, DECODE)
        ids = torch.tensor(list(tokens.values()), dtype=torch.int64, device=self.pool.device)
        return self.forward(ids, meta)

    @torch.no_grad()
    def verify(self, drafts: dict[Hashable, Sequence[int]], mode: str = TARGET_VERIFY) -> torch.Tensor:
        """next_n tokens per request (the same n for all), each row causal over the ones before it.

        Returns ``[B, next_n, vocab] float32``. Rejected drafts are dropped with :meth:`truncate`.
        """
        if mode not in (TARGET_VERIFY, DRAFT_EXTEND):
            raise ValueError(f"mode: expected {TARGET_VERIFY!r} or {DRAFT_EXTEND!r}, got {mode!r}")
        rows = [list(d) for d in drafts.values()]
        n = len(rows[0]) if rows else 0
        if n < 1 or any(len(d) != n for d in rows):
            raise ValueError(f"drafts: expected the same number (>= 1) of tokens per request, got {[len(d) for d in rows]}")
        self.reserve({r: n for r in drafts})
        meta = build_decode(self.alloc, list(drafts), n, mode)
        ids = torch.tensor(rows, dtype=torch.int64, device=self.pool.device).flatten()
        return self.forward(ids, meta).view(len(rows), n, -1)

    def truncate(self, req_id: Hashable, seq_len: int) -> None:
        """Drop the tokens past ``seq_len`` (rejected drafts); pages no longer needed go back."""
        self.alloc.truncate(req_id, seq_len)

    # ---- the forward pass ----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """``input_ids [T] int64`` with their metadata -> ``[T, vocab] float32`` logits."""
        m = self.model
        if m is None:
            raise ValueError("this runner has no model (Runner.for_layers): call attention() per layer")
        x = m.embed_tokens(input_ids)
        cos, sin = m.rotary(meta.positions)
        selection = None
        if self.record:
            self.selections = {}
        for layer in m.layers:
            attn_out, selection = self.attention(layer.self_attn, layer.input_layernorm(x), cos, sin, meta, selection)
            x = x + attn_out
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.lm_head(m.norm(x)).float()

    def attention(self, attn: DSAAttention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  meta: BatchMetadata, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One DSA attention layer over the paged caches: write the new tokens' KV (and indexer keys), select
        (indexer -> top-k; a skip-top-k layer reuses ``prev``) and attend (sparse, or the dense fallback).

        Args:
            attn: the layer's :class:`DSAAttention` (its ``layer_id`` picks the caches).
            h:    ``[T, hidden]`` the normed hidden states of the batch's T new tokens, in ``meta``'s order.
            cos, sin: ``[T, rope_dim / 2] float32`` RoPE tables of the tokens' positions.
            meta: the batch's :class:`BatchMetadata` (shared by every layer of one forward).
            prev: the previous layer's selection (``[T, topk] int32``) or None.

        Returns ``([T, hidden] out, selection)``: the selection to hand to the next layer (None after the
        dense fallback).

        ``meta`` comes from the page allocator on the host (in bounds by construction), so the ops run without
        their value checks (no host sync per check; shapes and dtypes are still checked).
        """
        with trusted_inputs():
            return self._attention(attn, h, cos, sin, meta, prev)

    def _attention(self, attn: DSAAttention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: BatchMetadata, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        lid = attn.layer_id
        q, kv_rows, qr = attn.prepare(h, cos, sin)
        idx = attn.indexer(h, qr, cos, sin) if attn.indexer is not None else None
        if idx is None or idx.exact:
            self.pool.write(lid, meta.slot_mapping, kv_rows)
            if idx is not None:
                self._exact_store(lid, idx.k)[meta.slot_mapping] = idx.k
        else:
            self.pool.write(lid, meta.slot_mapping, kv_rows, idx.k_fp8, idx.k_scale)
        topk, sm, be = self.cfg.index_topk, attn.softmax_scale, self.backend
        sel = prev
        if meta.mode == EXTEND:
            kv = self.pool.read(lid, meta.kv_slots)  # [N, 576] bf16: every request's whole KV, gathered
            if meta.use_dense:
                out, _ = ops.dense_mla_prefill(q, kv, meta.cu_seqlens_q, meta.cu_seqlens_kv, sm, backend=be)
                return attn.finish(out), None
            if idx is not None and idx.exact:
                logits = exact_logits_ragged(idx.q, self.exact_keys[lid][meta.kv_slots], idx.weights, meta.ks, meta.ke)
                sel = ops.topk_transform(logits, meta.ke - meta.ks, topk, row_starts=meta.ks, out_offsets=meta.ks,
                                         backend=be)
            elif idx is not None:
                # Chunked over query rows so the [T, N] fp32 logits never exceed max_logits_bytes.
                k_fp8, k_scale = self.pool.read_index(lid, meta.kv_slots)
                sel = ops.indexer_topk_ragged(idx.q_fp8, k_fp8, k_scale, idx.weights, meta.ks, meta.ke, topk,
                                              out_offsets=meta.ks, max_logits_bytes=self.max_logits_bytes, backend=be)
            out, _ = ops.sparse_mla_prefill(q, kv, sel, sm, backend=be)
        else:
            B, n = meta.context_lens.shape
            if idx is not None and idx.exact:
                logits = exact_logits_paged(idx.q.view(B, n, *idx.q.shape[1:]), self.exact_keys[lid], idx.weights,
                                            meta.context_lens, meta.block_table, meta.max_context_len,
                                            self.pool.page_size)
            elif idx is not None:
                logits = ops.indexer_logits_paged(idx.q_fp8.view(B, n, *idx.q_fp8.shape[1:]), self.pool.index_cache(lid),
                                                  idx.weights, meta.context_lens, meta.block_table,
                                                  meta.max_context_len, backend=be)
            if idx is not None:
                sel = ops.topk_transform(logits, meta.context_lens.view(-1), topk, page_table=meta.block_table,
                                         page_size=self.pool.page_size, backend=be)
            cache = self.pool.mla_cache(lid)
            out, _ = ops.sparse_mla_decode(q.view(B, n, *q.shape[1:]), cache.view(-1, PAGE_SIZE, cache.shape[-1]),
                                           sel.view(B, n, -1), sm, kv_scale=self.pool.kv_scale, backend=be)
            out = out.view(B * n, *out.shape[2:])
        if self.record:
            self.selections[lid] = sel
        return attn.finish(out), sel

    def _exact_store(self, lid: int, k: torch.Tensor) -> torch.Tensor:
        """The float key store of an exact-precision indexer layer, by slot (made on first use)."""
        store = self.exact_keys.get(lid)
        if store is None or store.dtype != k.dtype:
            store = torch.zeros(self.pool.num_pages * self.pool.page_size, k.shape[-1], dtype=k.dtype,
                                device=self.pool.device)
            self.exact_keys[lid] = store
        return store


class DecodeGraph:
    """A decode step captured once in a CUDA graph, replayed with the metadata refreshed in place.

    The batch (``req_ids``) is fixed at capture; ``max_pages`` bounds each request's pages so the
    block table and the logits width keep their shapes. Needs CUDA and the Triton backends (the
    torch references read values on the host, which a graph cannot).
    """

    def __init__(self, runner: Runner, req_ids: list, max_pages: int):
        if runner.pool.device.type != "cuda":
            raise ValueError("runner: CUDA graphs need the model and caches on a CUDA device")
        self.runner, self.req_ids, self.max_pages = runner, list(req_ids), max_pages
        self.ids = torch.zeros(len(req_ids), dtype=torch.int64, device=runner.pool.device)
        # Capture on a step whose tokens are reserved, then give them back: replay() reserves its own.
        for r in self.req_ids:
            runner.alloc.extend(r, 1)
        self.meta = build_decode(runner.alloc, self.req_ids, 1, DECODE, max_pages=max_pages)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # warm up: Triton compiles, allocator settles
                runner.forward(self.ids, self.meta)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = runner.forward(self.ids, self.meta)
        for r in self.req_ids:
            runner.truncate(r, runner.alloc.seq_len(r) - 1)

    @torch.no_grad()
    def replay(self, tokens: Sequence[int]) -> torch.Tensor:
        """One decode step for the captured batch: ``tokens [B]`` -> ``[B, vocab] float32`` (a view into
        the graph's output buffer; copy it to keep it past the next replay)."""
        self.runner.reserve({r: 1 for r in self.req_ids})
        fresh = build_decode(self.runner.alloc, self.req_ids, 1, DECODE, max_pages=self.max_pages)
        for name in ("positions", "slot_mapping", "block_table", "context_lens"):
            getattr(self.meta, name).copy_(getattr(fresh, name))
        self.ids.copy_(torch.as_tensor(list(tokens), dtype=torch.int64))
        self.graph.replay()
        return self.logits
