"""One DeepSeek-V4 attention layer's step for one request, on flashdsa's ops (issue #43, exact mode).

:class:`V4LayerStep` adopts an HF ``DeepseekV4Attention`` (its projections, norms, rotary tables and sinks:
the weights stay HF's) and runs a chunk of a request's tokens — a prompt, one decode token, an extend —
through flashdsa's pieces: the compressor (:func:`~flashdsa.v4.compressor.compress`), the indexer's exact
selection (:func:`~flashdsa.v4.indexer.select_exact`) and the attention core (:func:`~flashdsa.v4.attention.attend`)
over the window's rows and the entries. What a request keeps between chunks is a :class:`RequestState`:

* ``window``: the last ``sliding_window - 1`` tokens' K = V rows (RoPE applied), what the next query's window
  reaches back to;
* ``entries`` / ``index_keys``: every compressed entry so far (RMS-normalised, RoPE at ``n * rate``), and in
  CSA layers the indexer's keys of the same windows;
* ``comp`` / ``index_comp``: the compressors' open windows (:class:`~flashdsa.v4.compressor.CompressState`).

Plain per-request tensors for now: the paged window ring and entry caches (and batching requests into one
launch) are the next step; this one fixes the numerics and the state against HF, chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdsa.quant import apply_rope
from flashdsa.v4.attention import attend, attend_fp8, causal_entry_indices, fp8_rows, window_indices
from flashdsa.v4.compressor import CompressState, compress
from flashdsa.v4.config import CSA, HCA
from flashdsa.v4.indexer import quantize, select_exact, select_fp8

PRECISIONS = ("exact", "fp8")


@dataclass(frozen=True)
class RequestState:
    """One request's state in one V4 layer (see the module docstring); ``length``: tokens seen. Rows in the model
    dtype (exact) or as fp8 MLA rows (``[n, 656] uint8``, fp8 mode, whose indexer keys are e4m3 with
    ``index_scales``)."""
    window: torch.Tensor
    entries: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    index_scales: torch.Tensor | None = None
    comp: CompressState | None = None
    index_comp: CompressState | None = None
    length: int = 0


def _rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's RoPE: interleaved pairs over the trailing ``2 * cos.shape[-1]`` channels of ``x [S, ..., D]``,
    in fp32, back to x's dtype (HF's ``apply_rotary_pos_emb``)."""
    r = 2 * cos.shape[-1]
    rot = apply_rope(x[..., -r:], cos.float(), sin.float(), True).to(x.dtype)
    return torch.cat((x[..., :-r], rot), dim=-1)


def _append(acc: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if acc is None else torch.cat((acc, new))


def _entries(module, h, state: CompressState | None, overlap: bool):
    """Pool ``h [S, hidden]`` through compressor ``module``: the new entries, normalised and rotated at their
    positions, and the compressor's new state."""
    raw, new = compress(module.kv_proj(h), module.gate_proj(h), module.position_bias, module.compress_rate, overlap,
                        state)
    first = state.entries if state is not None else 0
    normed = module.kv_norm(raw)
    pos = ((torch.arange(raw.shape[0], device=h.device) + first) * module.compress_rate)[None]
    cos, sin = module.rotary_emb(normed[None], position_ids=pos, layer_type=module.rope_layer_type)
    return _rope_tail(normed, cos[0], sin[0]), new


class V4LayerStep:
    """A chunk of one request through an adopted HF ``DeepseekV4Attention`` ``attn`` on flashdsa's ops.

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

    def empty_state(self, dtype: torch.dtype, device=None) -> RequestState:
        if self.precision == "fp8":
            return RequestState(torch.zeros(0, 656, dtype=torch.uint8, device=device))
        return RequestState(torch.zeros(0, self.attn.head_dim, dtype=dtype, device=device))

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_rows(x) if self.precision == "fp8" else x

    @torch.no_grad()
    def __call__(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 state: RequestState) -> tuple[torch.Tensor, RequestState]:
        """``h [S, hidden]`` the chunk's hidden states at ``positions [S]`` (``state.length ..``), ``cos, sin
        [S, R / 2]`` of this layer's rope type (HF's ``position_embeddings[attn.rope_layer_type]``) -> the
        layer's output ``[S, hidden]`` and the request's new state (``state`` itself is left as it was)."""
        a = self.attn
        S, D = h.shape[0], a.head_dim
        q_res = a.q_a_norm(a.q_a_proj(h))
        q = _rope_tail(a.q_b_norm(a.q_b_proj(q_res).view(S, -1, D)), cos[:, None], sin[:, None])
        kv = self._rows(_rope_tail(a.kv_norm(a.kv_proj(h)), cos, sin))
        raw = torch.cat((state.window, kv))  # the raw rows a query's window may reach
        rows = raw
        base = state.length - state.window.shape[0]  # the position of rows[0]
        lists = [window_indices(positions - base, a.sliding_window)]
        entries, index_keys, index_scales = state.entries, state.index_keys, state.index_scales
        comp, index_comp = state.comp, state.index_comp
        if self.kind in (CSA, HCA):
            new, comp = _entries(a.compressor, h, comp, self.kind == CSA)
            entries = _append(entries, self._rows(new))
            if self.kind == HCA:
                lists.append(causal_entry_indices(positions, a.compressor.compress_rate, entries.shape[0],
                                                  rows.shape[0]))
            else:
                ix = a.compressor.indexer
                new, index_comp = _entries(ix, h, index_comp, True)
                icos, isin = ix.rotary_emb(h[None], position_ids=positions[None], layer_type=ix.rope_layer_type)
                q_ix = _rope_tail(ix.q_b_proj(q_res).view(S, -1, ix.head_dim), icos[0][:, None], isin[0][:, None])
                w = ix.scorer.weights_proj(h).float() * ix.scorer.weights_scaling
                if self.precision == "fp8":
                    new, new_scales = quantize(new)
                    index_keys, index_scales = _append(index_keys, new), _append(index_scales, new_scales)
                    q_fp8, q_scale = quantize(q_ix)
                    picks = select_fp8(q_fp8, index_keys, index_scales, w * q_scale * ix.head_dim ** -0.5, positions,
                                       ix.compress_rate, ix.index_topk, backend=self.backend)
                else:
                    index_keys = _append(index_keys, new)
                    picks = select_exact(q_ix, index_keys, w, positions, ix.compress_rate, ix.index_topk)
                lists.append(torch.where(picks >= 0, picks + rows.shape[0], -1).to(torch.int32))
            rows = torch.cat((rows, entries))
        run = attend_fp8 if self.precision == "fp8" else attend
        out = run(q, rows, torch.cat(lists, dim=1), a.sinks, a.scaling, cos, sin, backend=self.backend).to(h.dtype)
        out = a.o_b_proj(a.o_a_proj(out.reshape(S, a.config.o_groups, -1)).flatten(-2))
        window = raw[-(a.sliding_window - 1):] if a.sliding_window > 1 else kv[:0]
        return out, RequestState(window, entries, index_keys, index_scales, comp, index_comp, state.length + S)
