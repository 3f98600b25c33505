"""One DeepSeek-V4 attention layer's step for a batch of requests, on flashdsa's ops (issue #43).

:class:`V4LayerStep` adopts an HF ``DeepseekV4Attention`` (its projections, norms, rotary tables and sinks:
the weights stay HF's) and runs a chunk of tokens of B requests of equal length — a prompt, one decode token,
an extend — through flashdsa's pieces: the compressor (:func:`~flashdsa.v4.compressor.compress`), the
indexer's selection (:func:`~flashdsa.v4.indexer.select_exact` / ``select_fp8``) and the attention core
(:func:`~flashdsa.v4.attention.attend` / ``attend_fp8``), every request in the same launches. What the
requests keep between chunks is a :class:`V4State` of preallocated buffers:

* ``rows [B, window + capacity, R]``: the K = V rows the attention reads, as one buffer a request so that a
  decode step's keys need no copy: a **ring** of the last ``window`` tokens' rows (token at position p in
  slot ``p % window``; RoPE applied) and then the compressed **entries** (entry n at ``window + n``;
  RMS-normalised, RoPE at ``n * rate``). R = 576 (the head in the first ``head_dim`` dims, zeros after: the
  MLA rows the sparse kernels read) in the model dtype, or 656 bytes (fp8 MLA rows, ``indexer="fp8"``);
* ``index_keys``: CSA's indexer keys, one an entry: ``[B, capacity, d]`` in the model dtype (exact), or in fp8
  mode flashdsa's paged indexer cache ``[B * pages, 8448] uint8`` (64 e4m3 keys of 128 and their scales a page,
  request b's entries on pages ``b * pages ..``), which decode scores with ``ops.indexer_logits_paged`` as
  DSA's decode does (d = 128, the releases');
* ``comp`` / ``index_comp``: the compressors' rings of projected ``(kv, gate)`` tokens ``[B, ring, W]``
  (ring = rate, or 2 rate for CSA's overlapping windows: the open window and the last closed one, whose first
  halves the next entry pools), from which a chunk's first entry is pooled.

``capacity`` grows (doubling) as entries close; ``window + capacity`` stays a multiple of 64 so that fp8 rows
are whole pages. A chunk computes everything, then writes the buffers in place (new entries past the old
length, the rings' slots): a call that fails before its writes leaves the state as it was. A decode step
(:meth:`V4LayerStep.decode`) writes first, into slots no query of its position reads before the write, so a
failed step retried at the same position gives the same result. Either returns the state with its new length;
the state passed in must not be used again after a call that succeeded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashdsa import ops
from flashdsa.cache.layouts import INDEX_DIM, INDEX_PAGE_BYTES, MLA_DIM, MLA_FP8_BYTES, PAGE_SIZE, index_page_views
from flashdsa.v4.attention import attend, attend_fp8, causal_entry_indices, fp8_rows, mla_rows, window_indices
from flashdsa.v4.close_entry import close_entry
from flashdsa.v4.compressor import CompressState, compress
from flashdsa.v4.config import CSA, HCA
from flashdsa.v4.indexer import quantize, select_exact, select_fp8, visible_entries
from flashdsa.v4.rope import rope_tail

PRECISIONS = ("exact", "fp8")


@dataclass(frozen=True)
class V4State:
    """B requests' state in one V4 layer (the module docstring says what each buffer holds); ``length``: tokens
    every request has seen (padding included); ``pads [B] int64``: each request's leading padding tokens (None:
    none), which no query sees in its window."""
    length: int
    rows: torch.Tensor
    index_keys: torch.Tensor | None = None
    comp: tuple[torch.Tensor, torch.Tensor] | None = None
    index_comp: tuple[torch.Tensor, torch.Tensor] | None = None
    pads: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.rows.shape[0]

    def entries(self, window: int) -> int:
        """Rows of entries the buffer can hold past a ring of ``window`` slots."""
        return self.rows.shape[1] - window


def _rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str | None = "torch") -> torch.Tensor:
    """V4's RoPE: interleaved pairs over the trailing ``2 * cos.shape[-1]`` channels of ``x [B, S, ..., D]`` at
    ``cos, sin [B, S, R / 2]`` (each row's own positions), in fp32, back to x's dtype (HF's
    ``apply_rotary_pos_emb``; ``backend`` "torch": its bits, :mod:`flashdsa.v4.rope`)."""
    B, S = x.shape[:2]
    flat = x.reshape(B * S, *x.shape[2:])
    half = cos.shape[-1]  # (not -1: a chunk that closes no entry has S = 0)
    return rope_tail(flat, cos.reshape(B * S, half), sin.reshape(B * S, half), backend=backend).view(x.shape)


def _rows_of(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, B: int):
    """``positions [S] | [B, S]`` and ``cos, sin [S | B, S, R / 2]`` as ``[B, S]`` and ``[B, S, R / 2]``."""
    S = positions.shape[-1]
    return (positions.expand(B, S), cos.expand(B, S, cos.shape[-1]), sin.expand(B, S, sin.shape[-1]))


def _ring_state(ring: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor, rate: int, overlap: bool,
                length: int) -> CompressState:
    """The compressor's state after ``length`` tokens, read from its ring of projected tokens: the open
    window's tokens, and (overlapping) the last closed window's first halves with the position bias added."""
    kv, gate = ring
    n = ring[0].shape[1]
    start = length // rate * rate
    pending = torch.arange(start, length, device=kv.device) % n
    if not overlap or start == 0:
        return CompressState(kv[:, pending], gate[:, pending], entries=length // rate)
    half = kv.shape[-1] // 2
    last = torch.arange(start - rate, start, device=kv.device) % n
    return CompressState(kv[:, pending], gate[:, pending], kv[:, last, :half], gate[:, last, :half] + bias[:, :half],
                         length // rate)


def _write_ring(ring: torch.Tensor, new: torch.Tensor, end: int) -> None:
    """Write tokens ``new [B, S, W]`` at positions ``end - S .. end - 1`` into ``ring [B, n, W]`` (slot = position
    % n; only the last n tokens land)."""
    n = ring.shape[1]
    m = min(new.shape[1], n)
    ring[:, torch.arange(end - m, end, device=ring.device) % n] = new[:, new.shape[1] - m:].to(ring.dtype)


class V4LayerStep:
    """A chunk of B equal-length requests through an adopted HF ``DeepseekV4Attention`` ``attn``.

    ``precision``: "exact" (HF's selection; rows in the model dtype, attention over them in fp32: HF's numbers
    to rounding) or "fp8" (the deployment numerics: the window rows and entries stored once as fp8 MLA rows
    and read by the paged decode kernels, indexer keys and queries Hadamard-rotated e4m3 selected by flashdsa's
    ragged logits and exact top-k)."""

    def __init__(self, attn, backend: str | None = None, precision: str = "exact"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
        self.attn = attn
        self.kind = attn.layer_type
        self.backend = backend
        self.precision = precision
        self.window = attn.sliding_window
        self.rate = attn.compressor.compress_rate if self.kind in (CSA, HCA) else 0
        if precision == "fp8" and self.kind == CSA and attn.compressor.indexer.head_dim != INDEX_DIM:
            raise ValueError(f"attn: fp8 mode keeps indexer keys on flashdsa's {INDEX_DIM}-dim index pages, this "
                             f"layer's index_head_dim is {attn.compressor.indexer.head_dim}")

    def empty_state(self, batch: int, dtype: torch.dtype, device=None, capacity: int = 0,
                    pads: torch.Tensor | None = None) -> V4State:
        """A state of ``batch`` new requests, room for ``capacity`` entries (more is allocated as needed);
        ``pads [B]``: each request's leading padding tokens (left-padded prompts), None for none."""
        a = self.attn
        rows = self._alloc_rows(batch, capacity, dtype, device)
        keys = comp = index_comp = None
        if self.kind in (CSA, HCA):
            comp = self._alloc_ring(a.compressor, batch, dtype, device)
        if self.kind == CSA:
            index_comp = self._alloc_ring(a.compressor.indexer, batch, dtype, device)
            keys = self._alloc_keys(batch, rows.shape[1] - self.window, dtype, device)
        if pads is not None:
            pads = pads.to(device=device, dtype=torch.long).reshape(batch)
        return V4State(0, rows, keys, comp, index_comp, pads)

    def _alloc_rows(self, batch: int, capacity: int, dtype, device) -> torch.Tensor:
        n = -(-(self.window + capacity) // PAGE_SIZE) * PAGE_SIZE
        if self.precision == "fp8":
            return torch.zeros(batch, n, MLA_FP8_BYTES, dtype=torch.uint8, device=device)
        return torch.zeros(batch, n, MLA_DIM, dtype=dtype, device=device)

    def _alloc_keys(self, batch: int, capacity: int, dtype, device) -> torch.Tensor:
        d = self.attn.compressor.indexer.head_dim
        if self.precision == "fp8":
            return torch.zeros(batch * -(-capacity // PAGE_SIZE), INDEX_PAGE_BYTES, dtype=torch.uint8, device=device)
        return torch.zeros(batch, capacity, d, dtype=dtype, device=device)

    def _key_pages(self, state: V4State) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 mode: ``state.index_keys`` as ``keys [B, pages, 64, 128] e4m3`` and ``scales [B, pages, 64]`` views."""
        keys, scales = index_page_views(state.index_keys)
        return keys.view(state.batch, -1, PAGE_SIZE, INDEX_DIM), scales.view(state.batch, -1, PAGE_SIZE)

    @staticmethod
    def _alloc_ring(module, batch: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        W = module.kv_proj.out_features
        n = module.compress_rate * (2 if W != module.kv_norm.weight.shape[0] else 1)  # overlapping: two windows
        return (torch.zeros(batch, n, W, dtype=dtype, device=device),
                torch.zeros(batch, n, W, dtype=dtype, device=device))

    def _grow(self, state: V4State, entries: int) -> V4State:
        """``state`` with room for ``entries`` entries: the buffers copied into larger ones (at least double)."""
        if entries <= state.entries(self.window):
            return state
        cap = max(entries, 2 * state.entries(self.window))
        rows = self._alloc_rows(state.batch, cap, state.rows.dtype, state.rows.device)
        rows[:, :state.rows.shape[1]] = state.rows
        keys = state.index_keys
        if keys is not None:
            old = keys
            keys = self._alloc_keys(state.batch, rows.shape[1] - self.window, old.dtype, old.device)
            if self.precision == "fp8":  # whole pages, request by request
                keys.view(state.batch, -1, INDEX_PAGE_BYTES)[:, :old.shape[0] // state.batch] = \
                    old.view(state.batch, -1, INDEX_PAGE_BYTES)
            else:
                keys[:, :old.shape[1]] = old
        return replace(state, rows=rows, index_keys=keys)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_rows(x, backend=self.backend) if self.precision == "fp8" else mla_rows(x)

    @property
    def _fused_backend(self) -> str | None:
        # exact mode keeps HF's ops (HF's bits: its entries feed HF's selection); fp8 mode takes the one-launch
        # kernels (the compressor's step, RoPE: the same roundings, another order or FMAs) where the backend allows
        return "torch" if self.precision == "exact" else self.backend

    def _entries(self, module, h, ring, length: int, overlap: bool):
        """Pool ``h [B, S, hidden]`` through compressor ``module`` after ``length`` tokens whose projections sit
        in ``ring``: the new entries ``[B, e, D]``, normalised and rotated at their positions, and this chunk's
        projected ``(kv, gate)`` for the ring."""
        kv, gate = module.kv_proj(h), module.gate_proj(h)
        state = _ring_state(ring, module.position_bias, module.compress_rate, overlap, length)
        raw, _ = compress(kv, gate, module.position_bias, module.compress_rate, overlap, state)
        normed = module.kv_norm(raw)
        pos = (torch.arange(raw.shape[1], device=h.device) + state.entries) * module.compress_rate
        cos, sin = module.rotary_emb(normed, position_ids=pos[None], layer_type=module.rope_layer_type)
        return _rope_tail(normed, *(t.expand(normed.shape[0], -1, -1) for t in (cos, sin))), (kv, gate)

    @torch.no_grad()
    def __call__(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 state: V4State) -> tuple[torch.Tensor, V4State]:
        """``h [B, S, hidden]``: the chunk's hidden states, tokens ``state.length ..`` of every request;
        ``positions [S]`` or ``[B, S]``: their position ids (a left-padded request's are its own, as HF's generate
        makes them); ``cos, sin [S | B, S, R / 2]`` of this layer's rope type (HF's
        ``position_embeddings[attn.rope_layer_type]``) -> the layer's output ``[B, S, hidden]`` and the new
        state (module docstring: the buffers are written in place).

        Where the two differ (padding), HF's V4 does as follows, and so does this step: RoPE of queries and keys
        and which entries a query may see (``(position + 1) // rate``) follow the position ids; the window, the
        compressor's windows and the entries' RoPE follow token indices (padding tokens are pooled into entries,
        never seen in a window); a decode step of an HCA layer sees every entry closed so far."""
        B, S, _ = h.shape
        if state.batch != B:
            raise ValueError(f"state: holds {state.batch} requests, h {B}")
        if S == 1:
            return self.decode(h, positions, cos, sin, state)
        positions, cos, sin = _rows_of(positions, cos, sin, B)
        a = self.attn
        D, win, p0 = a.head_dim, self.window, state.length
        q_res = a.q_a_norm(a.q_a_proj(h))
        q = _rope_tail(a.q_b_norm(a.q_b_proj(q_res).view(B, S, -1, D)), cos, sin, self._fused_backend)
        kv = self._rows(_rope_tail(a.kv_norm(a.kv_proj(h)), cos, sin, self._fused_backend))
        seen = min(p0, win - 1)  # earlier tokens a query's window may reach, in token order, then the chunk's
        raw = torch.cat((state.rows[:, torch.arange(p0 - seen, p0, device=h.device) % win], kv), dim=1)
        tokens = torch.arange(p0, p0 + S, device=h.device)
        pads = None if state.pads is None else state.pads - (p0 - seen)  # rows of padding in `raw`
        lists = [window_indices(tokens - (p0 - seen), win, pads=pads)]
        rows, comp, index_comp = raw, None, None
        if self.kind in (CSA, HCA):
            new, comp = self._entries(a.compressor, h, state.comp, p0, self.kind == CSA)
            first, count = p0 // self.rate, p0 // self.rate + new.shape[1]
            state = self._grow(state, count)
            state.rows[:, win + first:win + count] = self._rows(new)  # past the old length: not yet read
            if self.kind == HCA:
                lists.append(causal_entry_indices(positions, self.rate, count, raw.shape[1]))
            else:
                picks, index_comp = self._select(h, q_res, positions, state, first, count)
                lists.append(torch.where(picks >= 0, picks + raw.shape[1], -1).to(torch.int32))
            rows = torch.cat((raw, state.rows[:, win:win + count]), dim=1)
        N = rows.shape[1]
        idx = torch.cat([x.expand(B, -1, -1) if x.dim() == 2 else x for x in lists], dim=-1)
        idx = torch.where(idx >= 0, idx + N * torch.arange(B, device=h.device)[:, None, None].to(idx.dtype), -1)
        run = attend_fp8 if self.precision == "fp8" else attend
        out = run(q.reshape(B * S, -1, D), rows.reshape(B * N, -1), idx.reshape(B * S, -1).to(torch.int32), a.sinks,
                  a.scaling, cos.reshape(B * S, -1), sin.reshape(B * S, -1), backend=self.backend).to(h.dtype)
        out = a.o_b_proj(a.o_a_proj(out.view(B, S, a.config.o_groups, -1)).flatten(-2))
        _write_ring(state.rows[:, :win], kv, p0 + S)
        if comp is not None:
            for ring, new in zip(state.comp, comp):
                _write_ring(ring, new, p0 + S)
        if index_comp is not None:
            for ring, new in zip(state.index_comp, index_comp):
                _write_ring(ring, new, p0 + S)
        return out, replace(state, length=p0 + S)

    def _select(self, h, q_res, positions, state: V4State, first: int, count: int):
        """CSA's indexer over a chunk: its keys of the chunk's new entries written to ``state``'s buffers (past
        the old length), and each query's picks ``[B, S, topk]`` (entry indices, -1 padded)."""
        ix = self.attn.compressor.indexer
        new, index_comp = self._entries(ix, h, state.index_comp, state.length, True)
        self._put_keys(state, slice(first, count), new)
        return self._pick(h, q_res, positions, state, count), index_comp

    def _put_keys(self, state: V4State, where, keys: torch.Tensor, closes: torch.Tensor | None = None) -> None:
        """Write indexer keys ``[B, e, d]`` (RoPE applied) at entries ``where`` (a slice, or ``[1]`` int64 with
        ``closes`` saying whether to write at all), quantised onto the pages in fp8 mode."""
        if self.precision != "fp8":
            if closes is None:
                state.index_keys[:, where] = keys
            else:
                _put(state.index_keys, where, closes, keys)
            return
        k_fp8, k_scale = quantize(keys, backend=self.backend)
        pages, scales = self._key_pages(state)
        if closes is None:
            e = torch.arange(where.start, where.stop, device=keys.device)
            pages[:, e // PAGE_SIZE, e % PAGE_SIZE] = k_fp8
            scales[:, e // PAGE_SIZE, e % PAGE_SIZE] = k_scale
        else:
            e = where.clamp(min=0)
            for buf, value in ((pages.view(torch.uint8), k_fp8.view(torch.uint8)), (scales, k_scale)):
                keep = buf[:, e // PAGE_SIZE, e % PAGE_SIZE]
                buf[:, e // PAGE_SIZE, e % PAGE_SIZE] = torch.where(closes.view((1,) * keep.dim()), value, keep)

    def _pick(self, h, q_res, positions, state: V4State, count: int) -> torch.Tensor:
        """Each query's ``[B, S, topk]`` picks among the first ``count`` entries (those it cannot see scored
        -inf and never picked). fp8 decode scores the paged keys in place (``ops.indexer_logits_paged``, as
        DSA's decode step); an fp8 chunk gathers its requests' keys for the ragged op."""
        a, B, S = self.attn, h.shape[0], h.shape[1]
        ix = a.compressor.indexer
        icos, isin = ix.rotary_emb(h, position_ids=positions, layer_type=ix.rope_layer_type)
        q_ix = _rope_tail(ix.q_b_proj(q_res).view(B, S, -1, ix.head_dim), icos, isin, self._fused_backend)
        w = ix.scorer.weights_proj(h).float() * ix.scorer.weights_scaling
        if self.precision != "fp8":
            return select_exact(q_ix, state.index_keys[:, :count], w, positions, ix.compress_rate, ix.index_topk)
        q_fp8, q_scale = quantize(q_ix, backend=self.backend)
        w = w * q_scale * ix.head_dim ** -0.5
        pages, scales = self._key_pages(state)
        if S > 1:
            e = torch.arange(count, device=h.device)
            return select_fp8(q_fp8, pages[:, e // PAGE_SIZE, e % PAGE_SIZE], scales[:, e // PAGE_SIZE, e % PAGE_SIZE],
                              w, positions, ix.compress_rate, ix.index_topk, backend=self.backend)
        if count == 0:
            return torch.full((B, 1, ix.index_topk), -1, dtype=torch.int32, device=h.device)
        visible = visible_entries(positions, ix.compress_rate).to(h.device).reshape(B).contiguous()
        table = torch.arange(pages.shape[0] * pages.shape[1], device=h.device, dtype=torch.int32).view(B, -1)
        logits = ops.indexer_logits_paged(q_fp8, state.index_keys, w.view(B, -1), visible[:, None], table, count,
                                          backend=self.backend)
        return ops.topk_transform(logits, visible, ix.index_topk, backend=self.backend).view(B, 1, -1)

    def reserve(self, state: V4State, length: int) -> V4State:
        """``state`` with room for the entries of ``length`` tokens: what :meth:`decode` with ``capturable=True``
        needs up front (it never grows the buffers)."""
        return self._grow(state, length // self.rate) if self.rate else state

    @torch.no_grad()
    def decode(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               state: V4State, capturable: bool = False) -> tuple[torch.Tensor, V4State]:
        """One decode token a request (``h [B, 1, hidden]`` at ``positions [1] | [B, 1]``, ``cos, sin`` as
        :meth:`__call__` takes them), the keys read in place: the
        token's row goes into its ring slot, a closing window's entry into the entries, and the attention reads
        the buffer itself (no copy of the context a step, as :meth:`__call__` makes for a chunk).

        ``capturable=True``: nothing read back to the host and every shape fixed by the buffers (the position
        only on the device: entries past it scored -inf, a window that has not closed written as what was
        there; the token's index is its position plus the request's padding) — a CUDA graph can hold the step;
        :meth:`reserve` the capacity first. Otherwise the host's
        ``state.length`` bounds the entries scored (so exact mode's ``torch.topk`` sees HF's row, ties and all).

        Writes land in slots no query of this position reads before the write, so a failed call retried at
        the same position gives the same result; the returned state's ``length`` is ``state.length + 1``.
        """
        a = self.attn
        B = h.shape[0]
        D, win = a.head_dim, self.window
        positions, cos, sin = _rows_of(positions, cos, sin, B)
        if not capturable:
            state = self.reserve(state, state.length + 1)
            t = torch.full((1,), state.length, dtype=torch.long, device=h.device)  # the token's index
        else:  # from the device: position + padding (HF's position ids count a request's real tokens)
            t = positions[:1, 0].long() + (state.pads[:1] if state.pads is not None else 0)
        q_res = a.q_a_norm(a.q_a_proj(h))
        q = _rope_tail(a.q_b_norm(a.q_b_proj(q_res).view(B, 1, -1, D)), cos, sin, self._fused_backend)
        kv = self._rows(_rope_tail(a.kv_norm(a.kv_proj(h)), cos, sin, self._fused_backend))
        rows = state.rows
        rows.index_copy_(1, t % win, kv)  # the ring is the buffer's first `win` rows
        slots = torch.arange(win, device=h.device)
        token = t - (t - slots) % win  # the token each ring slot holds
        seen = token >= (0 if state.pads is None else state.pads[:, None])  # [win] | [B, win]: not before 0 / padding
        lists = [torch.where(seen, slots, -1).view(-1, 1, win)]  # the ring: the whole window
        if self.rate:
            count = state.entries(win) if capturable else (state.length + 1) // self.rate
            n, closes = (t + 1) // self.rate - 1, (t + 1) % self.rate == 0
            entry = close_entry(a.compressor, h, state.comp, t, self.kind == CSA, self._fused_backend)
            _put(rows[:, win:], n, closes, self._rows(entry))
            if self.kind == HCA:  # every entry closed so far (HF's decode step masks none)
                lists.append(causal_entry_indices(t, self.rate, count, win)[None])
            else:
                ix = a.compressor.indexer
                self._put_keys(state, n, close_entry(ix, h, state.index_comp, t, True, self._fused_backend), closes)
                picks = self._pick(h, q_res, positions, state, count)
                lists.append(torch.where(picks >= 0, picks + win, -1).to(torch.int32))
        N = rows.shape[1]
        idx = torch.cat([x.expand(B, 1, -1) for x in lists], dim=-1)
        idx = torch.where(idx >= 0, idx + N * torch.arange(B, device=h.device)[:, None, None].to(idx.dtype), -1)
        run = attend_fp8 if self.precision == "fp8" else attend
        out = run(q.reshape(B, -1, D), rows.view(B * N, -1), idx.view(B, -1).to(torch.int32), a.sinks, a.scaling,
                  cos.reshape(B, -1), sin.reshape(B, -1), backend=self.backend).to(h.dtype)
        out = a.o_b_proj(a.o_a_proj(out.view(B, 1, a.config.o_groups, -1)).flatten(-2))
        return out, replace(state, length=state.length + 1)


def _put(buf: torch.Tensor, n: torch.Tensor, closes: torch.Tensor, value: torch.Tensor) -> None:
    """``buf[:, n] = value`` (``value [B, 1, ...]``) where ``closes`` (``[1]`` bool), else left as it was; no host
    read (``n`` < 0 when nothing closes: slot 0 rewritten as it was)."""
    if buf.dtype == torch.float8_e4m3fn:  # fp8 keys moved as their bytes (CPU has no fp8 index_copy / where)
        buf, value = buf.view(torch.uint8), value.view(torch.uint8)
    i = n.clamp(min=0)
    keep = buf.index_select(1, i)
    mask = closes.view((1,) * value.dim())
    buf.index_copy_(1, i, torch.where(mask, value.to(buf.dtype), keep))
