"""The runner: drives a DSA model over the paged caches in the forward modes of a serving engine.

    extend         new tokens on top of a cached prefix (prefill, chunked or not): ragged indexer ->
                   top-k with offsets into the gathered KV -> sparse MLA prefill; or the dense fallback
    decode         one token per request: paged indexer -> top-k + slot translation -> sparse MLA decode
    target_verify  next_n draft tokens per request, each row causal over the drafts before it
    draft_extend   same path as target_verify (the draft model's extend over accepted tokens)

The runner prepares batches — checks the inputs, reserves pages, builds the metadata once for all layers
(:meth:`Runner.prepare`) — and runs the layer loop; each layer's DSA step (write the caches, select,
attend) is :meth:`flashdsa.layers.DSAAttention.forward`. A call is all or nothing: bad input is rejected
before anything is reserved, and a forward that fails gives its reservation back, so the requests are
exactly as before. :class:`flashdsa.engine.graph.DecodeGraph` captures decode in a CUDA graph.
"""

from __future__ import annotations

import contextlib
from typing import Hashable, Iterator, Sequence

import torch

from flashdsa.cache.allocator import Reservation
from flashdsa.cache.metadata import (DECODE, DRAFT_EXTEND, EXTEND, TARGET_VERIFY, BatchMetadata, add_kpool,
                                     build_decode, build_extend)
from flashdsa.cache.offload import OffloadConfig, OffloadKVPool
from flashdsa.cache.pool import KVPool
from flashdsa.config import DSAConfig
from flashdsa.engine.model import DSAModel
from flashdsa.parallel import Parallel

_DRAFT_MODES = (TARGET_VERIFY, DRAFT_EXTEND)


class Runner:
    """Owns the KV pool of one model and runs batches through it.

    Args:
        model:           a :class:`DSAModel` (weights on the device the caches should live on). A caller that
                         runs its own model (``flashdsa.hf``) makes the runner with :meth:`for_layers`, prepares
                         each batch with :meth:`prepare` and calls every layer's ``DSAAttention`` itself.
        num_pages:       pages in the pool (each ``config.page_size`` tokens, every layer).
        kv_format:       MLA cache format: "fp8" (656 B, default), "bf16" or "fp8_raw" (needs kv_scale).
        backend:         force the ops' backend ("torch" / "triton"); default per device.
        dense_threshold: extend runs the dense fallback when every kv length <= this (default index_topk);
                         0 disables the fallback.
        record:          keep each layer's selection of the last batch in ``self.selections`` (tests; None
                         for a layer that ran the dense fallback).
        max_logits_bytes: the largest indexer-logits buffer one prefill chunk of query rows may use.
        offload:         an :class:`~flashdsa.cache.offload.OffloadConfig` keeps the MLA cache in host memory with
                         small per-request device buffers (``self.pool`` is then an ``OffloadKVPool``); it turns
                         the dense fallback off (dense_threshold must be None or 0) and CUDA-graph capture.
        parallel:        several ranks run every batch together (``flashdsa.parallel``): ``ContextParallel``
                         (prefill CP) or ``DecodeContextParallel`` (DCP; the pool then holds this rank's
                         shard). Every rank is given the same calls; no dense fallback (docs/DSA.md §6).
                         Not together with ``offload`` (not built).
        kpool_max_requests, kpool_max_next_n: kpool (``index_kpool`` > 1) only, ``KVPool``'s ``max_requests`` /
                         ``max_next_n``: the live requests the tail rings hold, the longest verify after which any
                         draft count may be kept.

    The caches (MLA, indexer, and the float key stores of exact-precision indexers, kpool's tail rings) are
    ``self.pool``'s. With kpool each row selects ``index_topk + c - 1`` tokens (docs/DSA.md §7).
    """

    def __init__(self, model: DSAModel | None, num_pages: int, kv_format: str = "fp8", *,
                 backend: str | None = None, dense_threshold: int | None = None, kv_scale: float | None = None,
                 record: bool = False, max_dense_tokens: int = 1 << 16, max_logits_bytes: int = 1 << 30,
                 config: DSAConfig | None = None, device: torch.device | str | None = None,
                 offload: OffloadConfig | None = None, parallel: Parallel | None = None,
                 kpool_max_requests: int = 256, kpool_max_next_n: int = 8):
        if model is not None:
            config, device = model.config, next(model.parameters()).device
        elif config is None or device is None:
            raise ValueError("model: expected a DSAModel, or model=None with config= and device= (Runner.for_layers)")
        if parallel is not None and not isinstance(parallel, Parallel):
            raise ValueError(f"parallel: expected None or a flashdsa.parallel mode (ContextParallel(comm, split) or "
                             f"DecodeContextParallel(comm)), got {parallel!r}")
        if parallel is not None and model is None:
            raise ValueError("parallel: context parallelism needs the runner's own layer loop (Runner(model, ...)), "
                             "which hands each rank its tokens and gathers the hidden states; for_layers callers "
                             "(flashdsa.hf) do not split their batches")
        self.model = model
        self.cfg = config
        if offload is not None and parallel is not None:
            raise ValueError("offload: host offload together with context parallelism is not built; use one of them")
        if self.cfg.index_kpool > 1 and parallel is not None and parallel.shards_kv:
            raise ValueError(f"parallel: decode context parallelism (DCP) with index_kpool = {self.cfg.index_kpool} is "
                             "not built (a pooled group's tokens would sit on several ranks); prefill CP "
                             "(ContextParallel) supports kpool")
        kpool = dict(max_requests=kpool_max_requests, max_next_n=kpool_max_next_n)
        if offload is None:
            self.pool = KVPool(self.cfg, num_pages, kv_format, torch.device(device), kv_scale, **kpool)
        else:
            if dense_threshold not in (None, 0):
                raise ValueError(f"dense_threshold: expected None or 0 with offload (the dense fallback is off when "
                                 f"the MLA cache lives on the host, docs/DSA.md §6), got {dense_threshold!r}")
            dense_threshold = 0
            self.pool = OffloadKVPool(self.cfg, num_pages, kv_format, torch.device(device), kv_scale, offload, **kpool)
        self.offload = offload
        self.parallel = parallel
        self.alloc = self.pool.allocator if parallel is None else parallel.allocator(self.pool.allocator)
        # who reserves, undoes, frees and truncates: the pool (its allocator, and kpool's tail rings / offload's
        # device rows with it; prefill CP too: every rank holds the whole KV), or DCP's sharded allocator
        self._requests = self.alloc if parallel is not None and parallel.shards_kv else self.pool
        self.backend = backend
        self.dense_threshold = self.cfg.index_topk if dense_threshold is None else dense_threshold
        self.max_dense_tokens = max_dense_tokens
        self.max_logits_bytes = max_logits_bytes
        self.record = record
        self.selections: dict[int, torch.Tensor] = {}

    @classmethod
    def for_layers(cls, config: DSAConfig, device: torch.device | str, num_pages: int, kv_format: str = "fp8",
                   **kwargs) -> "Runner":
        """A runner that owns the caches but not the model: its caller runs the rest of the model, prepares
        each batch with :meth:`prepare` and calls each layer's ``DSAAttention(x, cos, sin, batch, runner.pool,
        prev)`` (how ``flashdsa.hf`` drives HF's own models). Keywords as in the constructor."""
        return cls(None, num_pages, kv_format, config=config, device=device, **kwargs)

    # ---- requests ------------------------------------------------------------------------------
    def free(self, req_id: Hashable) -> None:
        """End the request: its pages go back (with kpool its tail ring row, with offload its device rows and
        buffer too)."""
        self._requests.free(req_id)

    def truncate(self, req_id: Hashable, seq_len: int) -> None:
        """Drop the tokens past ``seq_len`` (rejected drafts); pages no longer needed go back (with offload, the
        dropped tokens' device rows too). With kpool, a ValueError (nothing changed) if the new unfinished
        group's raw keys are no longer kept (``KVPool.truncate``)."""
        self._requests.truncate(req_id, seq_len)

    def prepare(self, new_tokens: dict[Hashable, int], mode: str | None = None, *, force_sparse: bool = False,
                max_pages: int | None = None) -> tuple[BatchMetadata, Reservation]:
        """Reserve a batch's new tokens and build the metadata every layer shares — the one place that
        decides the forward mode.

        Args:
            new_tokens: request -> new tokens (>= 0); a request not yet live is created (extend only).
            mode:       None picks decode when every request is live, non-empty and gets exactly one token,
                        extend otherwise; or one of "extend", "decode", "target_verify", "draft_extend"
                        (the last three: live requests, the same count >= 1 for all: next_n).
            force_sparse: extend without the dense fallback.
            max_pages:  decode modes: the block table's width (CUDA graphs keep shapes fixed).

        Returns ``(metadata, reservation)``; give the reservation to :meth:`undo` if the forward fails. All
        or nothing: on any error nothing is reserved (with ``parallel``: on any rank, see ``Parallel.together``).
        """
        if self.parallel is not None:
            return self.parallel.together(lambda: self._prepare(new_tokens, mode, force_sparse, max_pages), self.undo,
                                          (mode, list(new_tokens.items()), force_sparse, max_pages))
        return self._prepare(new_tokens, mode, force_sparse, max_pages)

    def _prepare(self, new_tokens: dict[Hashable, int], mode: str | None, force_sparse: bool,
                 max_pages: int | None) -> tuple[BatchMetadata, Reservation]:
        if mode is None:
            mode = DECODE if new_tokens and all(
                n == 1 and r in self.alloc and self.alloc.seq_len(r) > 0 for r, n in new_tokens.items()) else EXTEND
        if mode != EXTEND:
            counts = set(new_tokens.values())
            if len(counts) > 1 or (mode == DECODE and counts != {1}):
                raise ValueError(f"new_tokens: {mode} needs the same count per request (1 for decode), got "
                                 f"{sorted(counts)}")
            unknown = [r for r in new_tokens if r not in self.alloc]
            if unknown:
                raise ValueError(f"req_ids: {mode} continues live requests; unknown: {unknown[:8]!r} (start a "
                                 f"request with extend)")
        reservation = self._requests.reserve(new_tokens)
        try:
            ids = list(new_tokens)
            c = self.cfg.index_kpool
            kpool = (c, self.pool.tail_rows(ids), self.pool.tail_len) if c > 1 else None
            if self.parallel is not None:  # the mode builds this rank's metadata (flashdsa.parallel)
                meta = self.parallel.build(self.alloc, ids, list(new_tokens.values()), mode, max_pages=max_pages,
                                           backend=self.backend, max_logits_bytes=self.max_logits_bytes,
                                           kpool=kpool)
            elif mode == EXTEND:
                meta = build_extend(self.alloc, ids, list(new_tokens.values()), dense_threshold=self.dense_threshold,
                                    dense_allowed=not force_sparse and self.pool.kv_format != "fp8_raw",
                                    max_dense_tokens=self.max_dense_tokens, backend=self.backend,
                                    max_logits_bytes=self.max_logits_bytes)
            else:
                meta = build_decode(self.alloc, ids, next(iter(new_tokens.values()), 1), mode, max_pages,
                                    backend=self.backend)
            if kpool is not None and self.parallel is None:
                add_kpool(meta, self.alloc, *kpool)
        except BaseException:
            self._requests.undo(reservation)
            raise
        return meta, reservation

    def undo(self, reservation: Reservation) -> None:
        """Give back what :meth:`prepare` reserved (a forward that failed): the requests are as before (kpool's
        tail rings included)."""
        self._requests.undo(reservation)

    @contextlib.contextmanager
    def _batch(self, new_tokens: dict[Hashable, int], mode: str, **kw) -> Iterator[BatchMetadata]:
        meta, reservation = self.prepare(new_tokens, mode, **kw)
        try:
            yield meta
        except BaseException:
            self.undo(reservation)
            raise

    # ---- forward modes -------------------------------------------------------------------------
    @torch.no_grad()
    def extend(self, chunks: dict[Hashable, Sequence[int] | torch.Tensor], *, force_sparse: bool = False) -> torch.Tensor:
        """Append each request's new tokens (``>= 1`` token ids each; new requests are created) and run them.

        Returns ``[T, vocab] float32`` logits of every new token, requests in dict order.
        """
        ids = {r: self._token_ids(f"chunks[{r!r}]", t) for r, t in _check_batch("chunks", chunks).items()}
        with self._batch({r: t.numel() for r, t in ids.items()}, EXTEND, force_sparse=force_sparse) as meta:
            return self.forward(torch.cat(list(ids.values())).to(self.pool.device), meta)

    @torch.no_grad()
    def decode(self, tokens: dict[Hashable, int]) -> torch.Tensor:
        """One token per live request. Returns ``[B, vocab] float32``."""
        ids = self._token_ids("tokens", list(_check_batch("tokens", tokens).values()))
        with self._batch({r: 1 for r in tokens}, DECODE) as meta:
            return self.forward(ids.to(self.pool.device), meta)

    @torch.no_grad()
    def verify(self, drafts: dict[Hashable, Sequence[int]], mode: str = TARGET_VERIFY) -> torch.Tensor:
        """next_n tokens per live request (the same n for all), each row causal over the ones before it.

        Returns ``[B, next_n, vocab] float32``. Rejected drafts are dropped with :meth:`truncate`.
        """
        if mode not in _DRAFT_MODES:
            raise ValueError(f"mode: expected {TARGET_VERIFY!r} or {DRAFT_EXTEND!r}, got {mode!r}")
        rows = {r: self._token_ids(f"drafts[{r!r}]", d) for r, d in _check_batch("drafts", drafts).items()}
        n = {t.numel() for t in rows.values()}
        if len(n) != 1:
            raise ValueError(f"drafts: expected the same number of tokens per request, got "
                             f"{[t.numel() for t in rows.values()]}")
        n = n.pop()
        with self._batch({r: n for r in rows}, mode) as meta:
            return self.forward(torch.cat(list(rows.values())).to(self.pool.device), meta).view(len(rows), n, -1)

    def _token_ids(self, name: str, tokens) -> torch.Tensor:
        """Token ids as ``[n >= 1] int64`` on the host, each in ``[0, vocab_size)``; ValueError naming ``name``."""
        if isinstance(tokens, torch.Tensor):
            t = tokens
        else:
            try:
                t = torch.as_tensor(tokens)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"{name}: expected integer token ids, got {type(tokens).__name__} ({e})") from None
        if t.numel() == 0:  # before the dtype check: torch.as_tensor([]) is float32
            raise ValueError(f"{name}: expected at least one token id, got none")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() > 1:
            raise ValueError(f"{name}: expected integer token ids (a 1-D sequence), got {t.dtype} {list(t.shape)}")
        t = t.reshape(-1).to("cpu", torch.int64)
        vocab = self.cfg.vocab_size
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            bad = t[(t < 0) | (t >= vocab)][0]
            raise ValueError(f"{name}: expected token ids in [0, {vocab}) (the vocabulary), got {int(bad)}")
        return t

    # ---- the forward pass ----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """``input_ids [T] int64`` with their metadata -> ``[T, vocab] float32`` logits."""
        m = self.model
        if m is None:
            raise ValueError("this runner has no model (Runner.for_layers): call each layer's DSAAttention")
        par = meta.parallel
        x = m.embed_tokens(input_ids if par is None else par.local(input_ids))  # CP: this rank's tokens only
        cos, sin = m.rotary(meta.positions)
        selection = None
        if self.record:
            self.selections = {}
        for layer in m.layers:
            attn_out, selection = layer.self_attn(layer.input_layernorm(x), cos, sin, meta, self.pool, selection)
            if self.record:
                self.selections[layer.self_attn.layer_id] = selection
            x = x + attn_out
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if par is not None:
            x = par.unshard(x)
        return m.lm_head(m.norm(x)).float()


def _check_batch(name: str, batch) -> dict:
    """A non-empty dict keyed by hashable request ids."""
    if not isinstance(batch, dict):
        raise ValueError(f"{name}: expected a dict request id -> tokens, got {type(batch).__name__}")
    if not batch:
        raise ValueError(f"{name}: expected at least one request, got an empty batch")
    return batch
