"""The lightning indexer layer (docs/DSA.md §3): projections, RoPE, then one of two precisions.

``precision="fp8"`` (default) is the deployment numerics of docs/DSA.md §3: RoPE, Hadamard rotation, block fp8
quantisation, the per-(query, head) scale folded into the head gate; the keys go to the 8448-B indexer
pages and the fp8 ops (``indexer_logits_ragged`` / ``_paged``) score them.

``precision="exact"`` is for studying DSA accuracy: Hugging Face's indexer (transformers'
``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``) op for op — LayerNorm and RoPE in the model dtype with HF's
formulas and layout, no Hadamard, no fp8, fp32 scores ``sum_h w[t,h] relu((q[t,h] . k[s]) / sqrt(D))``
with the scale applied before the ReLU as HF does. Ties (the ReLU makes exact zeros common) go to the
smaller position, as CUDA's ``torch.topk`` and flashdsa's top-k send them; where the caller lays its rows
out as HF (``BatchMetadata.index_columns``: ``flashdsa.hf``), :func:`exact_topk` takes ``torch.topk`` over
those rows, so they go as HF's do on the CPU too. Its keys are kept in a float key store addressed by slot (the fp8 pages
cannot hold them) and scored by :func:`exact_logits_ragged` / :func:`exact_logits_paged` below. Switch
precision between sequences: the keys already cached were written in the precision of their time.

With kpool (``index_kpool`` = c > 1, docs/DSA.md §7) the layer also holds GLM-5.3's two pooling
parameters, ``index_kpool_compress_gate [128, hidden]`` (model dtype) and ``index_kpool_compress_ape [c, 128]``
(fp32), and hands back each token's key before rotation plus its gate (``IndexerOutput.gate``): the
attention layer pools every c tokens' keys into the one key the indexer cache holds (``ops.kpool_compress``);
in exact precision it keeps every token's key and gate and pools them as HF's ``Glm5NextTextIndexer`` does,
op for op (:func:`pool_as_hf`, :func:`exact_kpool_groups`), at each selection.

Parameter names follow the Hugging Face DeepSeek-V3.2 checkpoint (``self_attn.indexer.*``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from flashdsa.config import DSAConfig
from flashdsa.ops.indexer_quant import HEAD_DIM, ROPE_HALF, indexer_quant, indexer_quant_weights, rope_model_dtype
from flashdsa.ops.indexer_quant.reference import indexer_quant as indexer_quant_reference
from flashdsa.ops.indexer_quant.reference import indexer_quant_weights as indexer_quant_weights_reference
from flashdsa.ops.indexer_quant.reference import rope_model_dtype as rope_model_dtype_reference
from flashdsa.ops.topk import topk_transform
from flashdsa.quant import FP8

PRECISIONS = ("fp8", "exact")
_CHUNK_BYTES = 256 << 20  # bound on the [rows, H, keys] fp32 intermediate of the exact scores


class IndexerOutput(NamedTuple):
    """What one indexer call produces for T new tokens.

    ``precision="fp8"``: ``q [T, H, D] float8_e4m3fn`` (RoPE, Hadamard, act_quant), ``k [T, D] e4m3``,
    ``k_scale [T] float32``, ``weights [T, H] float32`` = weights_proj * H^-0.5 * q_scale * D^-0.5.

    ``precision="exact"``: ``q [T, H, D]`` and ``k [T, D]`` in the model dtype (RoPE only, HF's layout),
    ``k_scale`` None, ``weights [T, H] float32`` = weights_proj * H^-0.5 (HF's; the scorers apply D^-0.5
    to each head's dot product before the ReLU, as HF does).

    kpool (c > 1): ``q``, ``weights`` as for the precision; ``k [T, D]`` in the model dtype, the key after
    LayerNorm and RoPE and before the rotation (what ``ops.kpool_compress`` pools, or exact's
    :func:`pool_as_hf`); ``k_scale`` None; ``gate [T, D]`` in the model dtype,
    ``index_kpool_compress_gate`` applied to the hidden states.
    """

    q: torch.Tensor
    weights: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor | None
    gate: torch.Tensor | None = None

    @property
    def exact(self) -> bool:
        return self.q.dtype != FP8

    @property
    def pooled(self) -> bool:
        """kpool: the keys are pooled (``ops.kpool_compress``) before they are stored."""
        return self.gate is not None

    # the fp8 path's names, kept for its callers
    @property
    def q_fp8(self) -> torch.Tensor:
        return self.q

    @property
    def k_fp8(self) -> torch.Tensor:
        return self.k


def _check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    return precision


class Indexer(nn.Module):
    """``x [T, hidden]``, ``qr [T, q_lora_rank]`` (the normed MLA query latent) -> :class:`IndexerOutput`.

    ``precision`` ("fp8" | "exact", see the module docstring) can be changed on a live module.
    """

    def __init__(self, cfg: DSAConfig, dtype: torch.dtype = torch.bfloat16, precision: str = "fp8"):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.interleave = cfg.indexer_rope_interleave
        self.kpool = cfg.index_kpool
        self.precision = precision
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=torch.float32)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False, dtype=dtype)
        if self.kpool > 1:
            self.index_kpool_compress_gate = nn.Parameter(torch.empty(self.head_dim, cfg.hidden_size, dtype=dtype))
            self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, self.head_dim, dtype=torch.float32))

    @property
    def precision(self) -> str:
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        self._precision = _check_precision(value)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> IndexerOutput:
        T = x.shape[0]
        q = self.wq_b(qr).view(T, self.n_heads, self.head_dim)
        kn = self.k_norm
        # weights_proj may be kept in fp32 (HF's _keep_in_fp32_modules) while x is bf16
        g = self.weights_proj(x.to(self.weights_proj.weight.dtype))
        if self.precision == "exact":
            gate = g.float() * self.n_heads ** -0.5
            # HF's rounding: LayerNorm and RoPE in the model dtype, so the scores are HF's to the last bit
            k = nn.functional.layer_norm(self.wk(x), kn.normalized_shape, _as(kn.weight, x.dtype),
                                         _as(kn.bias, x.dtype), kn.eps)
            pool_gate = None
            if self.kpool > 1:  # HF's Glm5NextTextIndexer: the gate in the model dtype, the keys kept raw
                pool_gate = nn.functional.linear(x, self.index_kpool_compress_gate.to(x.dtype))
            return IndexerOutput(rope_as_hf(q, cos, sin, self.interleave), gate,
                                 rope_as_hf(k, cos, sin, self.interleave), None, pool_gate)
        # deployment: LayerNorm in fp32 whatever dtype its parameters have, rounded to the model dtype
        k = nn.functional.layer_norm(self.wk(x).float(), kn.normalized_shape, _as(kn.weight, torch.float32),
                                     _as(kn.bias, torch.float32), kn.eps).to(x.dtype)
        q_fp8, w = self._quant_weights(q, cos, sin, g)
        if self.kpool > 1:
            # the key as indexer_quant rounds it before rotating: pooled first, rotated and quantised after
            k = self._rope(k, cos, sin)
            pool_gate = nn.functional.linear(x.to(self.index_kpool_compress_gate.dtype), self.index_kpool_compress_gate)
            return IndexerOutput(q_fp8, w, k, None, pool_gate.to(x.dtype))
        k_fp8, k_scale = self._quant(k, cos, sin)
        return IndexerOutput(q_fp8, w, k_fp8, k_scale)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE rounded to the model dtype (kpool's key before pooling): the first step of :meth:`_quant`, in
        the same kernel where that one runs, the torch composition otherwise (same bits)."""
        if _fused_shapes(x, cos):
            return rope_model_dtype(x, cos, sin, self.interleave)
        return rope_model_dtype_reference(x, cos, sin, self.interleave)

    def _quant_weights(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries quantised as :meth:`_quant` and the head weights ``w = g H^-0.5 q_scale D^-0.5`` (fp32,
        rounded after each product): one launch where the fused op takes the shapes, the torch ops otherwise
        (the same bits)."""
        fn = indexer_quant_weights if _fused_shapes(q, cos) else indexer_quant_weights_reference  # any head dim
        return fn(q, cos, sin, self.interleave, g, self.n_heads ** -0.5, self.head_dim ** -0.5)

    def _quant(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE, rounding to the model dtype, Hadamard, act_quant: ``[T, ..., D] -> e4m3 [T, ..., D], f32 [T, ...]``.

        One fused op for the shapes of V3.2 / GLM-5 (D 128, rope 64, bf16 / fp32) and GLM-5.3-Flash (no rope);
        the same composition in plain torch otherwise."""
        if _fused_shapes(x, cos):
            return indexer_quant(x, cos, sin, self.interleave)
        return indexer_quant_reference(x, cos, sin, self.interleave)  # any head dim / rope width


def _fused_shapes(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """The shapes ``indexer_quant``'s kernel takes (V3.2 / GLM-5: head dim 128, RoPE on 64; GLM-5.3-Flash: no
    RoPE, cos [T, 0]; bf16 / fp32)."""
    return x.shape[-1] == HEAD_DIM and cos.shape[-1] in (ROPE_HALF, 0) and x.dtype in (torch.bfloat16, torch.float32)


def _as(p: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if p is None else p.to(dtype)


def rope_as_hf(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The indexer RoPE of transformers' DSA models, op for op in ``x``'s dtype: ``x [T, ..., D]`` -> same.

    The first ``2 * cos.shape[-1]`` dims rotate (``[rope | nope]``), ``cos, sin [T, R / 2]`` (any float
    dtype; rounded to ``x``'s as HF holds them). NeoX pairs: ``x * cos + rotate_half(x) * sin``;
    interleaved pairs (GLM) come out de-interleaved, ``[a c - b s | b c + a s]``, as HF writes them — q and k
    alike, so only the order of the dot product's terms differs from deployment's layout.
    """
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.to(x.dtype).reshape(shape), sin.to(x.dtype).reshape(shape)
    rot = x[..., :r]
    if interleave:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    else:
        a, b = rot[..., : r // 2], rot[..., r // 2:]
        out = torch.cat((a * c + (-b) * s, b * c + a * s), dim=-1)
    return torch.cat((out, x[..., r:]), dim=-1)


# ---- exact scoring (precision="exact") ---------------------------------------------------------------

def _exact_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``q [..., H, D], k [..., n, D], weights [..., H] -> [..., n] f32`` in HF's op order: every head's
    ``relu((q . k) * D^-0.5)``, then the head sum weighted by ``weights`` (one fp32 matmul each)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.matmul(weights.unsqueeze(-2), s.relu_()).squeeze(-2)


def exact_logits_ragged(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ks: torch.Tensor,
                        ke: torch.Tensor) -> torch.Tensor:
    """Exact-precision counterpart of ``ops.indexer_logits_ragged`` (prefill / extend), plain PyTorch.

    Args:
        q:       ``[T, H, D]`` float (bf16 / fp32), an exact :class:`IndexerOutput`'s ``q``.
        k:       ``[N, D]`` float, keys of all requests concatenated.
        weights: ``[T, H] float32`` head gates with H^-0.5 folded in (D^-0.5 is applied here).
        ks, ke:  ``[T]`` int; row i scores keys in ``[ks[i], ke[i])``.

    Returns:
        ``[T, N] float32``: ``sum_h weights[i, h] * relu(q[i, h] . k[s] / sqrt(D))`` in the row's range, ``-inf``
        elsewhere. Rows are scored in chunks over their key window so the ``[rows, H, keys]`` fp32
        intermediate stays under 256 MB (this reads ks / ke on the host: a prefill op).
    """
    T, H, D = q.shape
    N = k.shape[0]
    if k.dim() != 2 or k.shape[1] != D or weights.shape != (T, H) or ks.shape != (T,) or ke.shape != (T,):
        raise ValueError(f"q, k, weights, ks, ke: expected [T, H, D], [N, D], [T, H], [T], [T], got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(weights.shape)}, {list(ks.shape)}, {list(ke.shape)}")
    out = torch.full((T, N), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or N == 0:
        return out
    ks_h, ke_h = ks.long().tolist(), ke.long().tolist()
    if min(ks_h) < 0 or max(ke_h) > N or any(e < s for s, e in zip(ks_h, ke_h)):
        raise ValueError(f"ks, ke: expected 0 <= ks <= ke <= N ({N})")
    pos = torch.arange(N, device=q.device)
    t0 = 0
    while t0 < T:
        # grow the chunk while its window times its rows fits the budget (at least one row)
        lo, hi, t1 = ks_h[t0], ke_h[t0], t0 + 1
        while t1 < T:
            nlo, nhi = min(lo, ks_h[t1]), max(hi, ke_h[t1])
            if (t1 + 1 - t0) * H * max(nhi - nlo, 1) * 4 > _CHUNK_BYTES:
                break
            lo, hi, t1 = nlo, nhi, t1 + 1
        if hi > lo:
            s = _exact_scores(q[t0:t1], k[None, lo:hi], weights[t0:t1])
            p = pos[None, lo:hi]
            visible = (p >= ks[t0:t1, None]) & (p < ke[t0:t1, None])
            out[t0:t1, lo:hi] = torch.where(visible, s, float("-inf"))
        t0 = t1
    return out


def exact_logits_paged(q: torch.Tensor, key_store: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                       block_table: torch.Tensor, max_context_len: int, page_size: int = 64) -> torch.Tensor:
    """Exact-precision counterpart of ``ops.indexer_logits_paged`` (decode / MTP verify), plain PyTorch.

    Args:
        q:            ``[B, n, H, D]`` float.
        key_store:    ``[S, D]`` float, the exact keys by slot (``slot = page * page_size + row``).
        weights:      ``[B * n, H] float32``.
        context_lens: ``[B, n]`` int; row (b, j) scores positions ``< context_lens[b, j]``.
        block_table:  ``[B, maxp]`` int; position p of request b is slot
                      ``block_table[b, p // page_size] * page_size + p % page_size``.
        max_context_len: output width, ``<= maxp * page_size``.

    Returns:
        ``[B * n, max_context_len] float32``, ``-inf`` at and past each row's length. No host reads.
    """
    B, n, H, D = q.shape
    L = max_context_len
    if L > block_table.shape[1] * page_size:
        raise ValueError(f"max_context_len: expected <= block_table width x page_size "
                         f"({block_table.shape[1] * page_size}), got {L}")
    p = torch.arange(L, device=q.device)
    slots = block_table.long()[:, p // page_size] * page_size + p % page_size     # [B, L]
    k = key_store[slots]                                                             # [B, L, D]
    logits = _exact_scores(q, k[:, None], weights.view(B, n, H))                     # [B, n, L]
    visible = p[None, None, :] < context_lens[:, :, None]
    return torch.where(visible, logits, float("-inf")).view(B * n, L)


# ---- exact selection (precision="exact"): HF's torch.topk ---------------------------------------------

def exact_topk(logits: torch.Tensor, topk: int, columns: torch.Tensor) -> torch.Tensor:
    """HF's top-k of one request's rows: ``torch.topk`` over the rows as HF lays them out.

    Args:
        logits:  ``[r, L] float32`` the request's rows by position, ``-inf`` where a row sees no key.
        topk:    ``index_topk``.
        columns: ``[W] int64`` the position each of the W columns of HF's forward (cached + new, padding
                 included) holds, -1 for padding.

    Returns:
        ``[r, topk] int64`` positions, ascending, -1 padded.

    Ties (exact zeros from the ReLU are common) go as ``torch.topk`` sends them. On the CPU it permutes
    them by a partial sort of the whole row, so the row is rebuilt as HF's — W columns, the masked ones
    -inf (HF's finfo.min compares the same) — and its values must be HF's bits. (CUDA's keeps the first of
    equal values in column order: the smaller position, flashdsa's own rule.)
    """
    W = columns.shape[0]
    rows = logits.new_full((logits.shape[0], W), float("-inf"))
    real = (columns >= 0).nonzero().squeeze(1)
    rows[:, real] = logits[:, columns[real]]
    vals, idx = rows.topk(min(topk, W), dim=-1)
    pos = torch.where(vals > float("-inf"), columns[idx], -1)
    # ascending positions, -1 last: the order flashdsa's top-k returns (the attention sums in this order)
    big = torch.iinfo(torch.int64).max
    pos = torch.where(pos < 0, big, pos).sort(dim=-1).values
    pos = torch.where(pos == big, -1, pos)
    return torch.nn.functional.pad(pos, (0, topk - pos.shape[1]), value=-1)


# ---- exact kpool (precision="exact", c > 1): HF's Glm5NextTextIndexer ----------------------------------

def pool_as_hf(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """One request's pooled keys, op for op as HF's ``Glm5NextTextIndexer.get_pooled_states``.

    Args:
        keys:  ``[L, D]`` the request's index keys by position (model dtype, after LayerNorm).
        gates: ``[L, D]`` their ``index_kpool_compress_gate`` projections (model dtype).
        ape:   ``[c, D]`` ``index_kpool_compress_ape`` (any float dtype).

    Returns:
        ``[L // c, D]`` in ``keys.dtype``: group j pools tokens ``j c .. j c + c - 1`` with
        ``softmax_i(gate_i + ape_i)`` computed in fp32, rounded to the model dtype, then the weighted sum in
        the model dtype (HF's rounding; the fp8 path's ``ops.kpool_compress`` sums in fp32). Only complete
        groups: an unfinished one is never scored (its tokens are the row's tail).
    """
    c, D = ape.shape
    n = keys.shape[0] // c
    k = keys[: n * c].reshape(1, n, c, D)
    logits = gates[: n * c].reshape(1, n, c, D).float() + ape.float()[None, None]
    p = torch.nan_to_num(logits.softmax(dim=2)).to(k.dtype)
    return (p * k).sum(dim=2)[0]


def exact_kpool_groups(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor, lengths: torch.Tensor,
                       c: int, groups: int, width: int | None = None, backend: str | None = None) -> torch.Tensor:
    """The top ``groups`` complete groups of one request's query rows by their pooled keys' exact scores.

    Args:
        q:       ``[r, H, D]`` float, an exact :class:`IndexerOutput`'s ``q``.
        weights: ``[r, H] float32``.
        pooled:  ``[n, D]`` the request's pooled keys (:func:`pool_as_hf`).
        lengths: ``[r]`` int, the tokens each row sees; group j is selectable iff ``(j + 1) c <= length``
                 (HF: a pool is selectable only when its last token is visible).
        width:   HF's number of pool columns in this forward (the most complete groups of any batch row),
                 or None. Given, ``torch.topk`` runs over rows of that width as HF's (:func:`exact_topk`:
                 the CPU's ties go as HF's); None, ties go to the smaller group (``ops.topk_transform``).

    Returns:
        ``[r, groups] int32`` group ids, ascending, -1 padded.
    """
    n = pooled.shape[0]
    W = n if width is None else width
    if W < n:
        raise ValueError(f"width: expected >= the request's {n} complete groups, got {W}")
    keys = torch.cat((pooled, pooled.new_zeros(W - n, pooled.shape[1])))   # HF's row shape for the matmul
    logits = _exact_scores(q, keys[None], weights)                           # [r, W]
    visible = lengths.long()[:, None] // c
    logits = torch.where(torch.arange(W, device=q.device)[None] < visible, logits, float("-inf"))
    if width is None:
        return topk_transform(logits, visible.squeeze(1).to(torch.int32), groups, backend=backend)
    return exact_topk(logits, groups, torch.arange(W, device=q.device)).to(torch.int32)
