"""DeepSeek-V4's attention core on flashdsa's sparse MLA kernels (issue #43, first step).

Why no new attention kernel: V4's attention is MQA with one K = V head of ``head_dim`` <= 512 dims, and a
query attends to a list of keys (its window, and in CSA / HCA layers compressed entries). flashdsa's sparse
MLA ops compute exactly that over a list of rows when the K = V head sits in the rows' 512-dim latent part
(the value) with a zero rope part, and q has a zero rope part too:

    s_i = scale * q . k_i   (the rope parts add 0)        out = sum_i softmax(s)_i * k_i[:512]

V4's per-head **sinks** add ``exp(sink_h)`` to the softmax denominator and nothing to the numerator: that is a merge
with an empty partial attention whose lse is the sink, ``out / (1 + exp(sink - lse))`` (``ops.attention_sinks``, one
elementwise launch), so the attention kernels need no change for them. The output's trailing RoPE slice is rotated
back by the query's position (the value carried the keys' RoPE, as HF's model undoes it).

Rows and indices: the caller lays every key a query may see out as rows of one ``kv [N, head_dim]`` buffer
(the window's raw tokens, then the compressed entries) and gives each query row its list
(:func:`window_indices`, :func:`causal_entry_indices`, or an indexer's picks offset into the entries' rows).
The layer step (:mod:`flashdsa.v4.layer`) keeps them across calls as one buffer a request: a ring of the
window's rows, then the entries.
"""

from __future__ import annotations

import torch

from flashdsa import ops
from flashdsa.cache.layouts import MLA_DIM, MLA_FP8_BYTES, MLA_LATENT, PAGE_SIZE, encode_mla
from flashdsa.ops._common import pick_backend
from flashdsa.v4.rope import rope_tail


def mla_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` (D <= 512) -> ``[..., 576]``: D in the latent part, zeros after (its rope part included)."""
    if x.shape[-1] > MLA_LATENT:
        raise ValueError(f"x: expected a last dim of at most {MLA_LATENT} (K = V in the latent part), "
                         f"got {x.shape[-1]}")
    return torch.nn.functional.pad(x, (0, MLA_DIM - x.shape[-1]))


def window_indices(positions: torch.Tensor, window: int, first_row: int = 0,
                   pads: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, window] int32``: the rows of the raw tokens query ``positions [T]`` (token indices) sees in its
    sliding window (tokens ``p - window + 1 .. p``; row = ``first_row`` + token), -1 before token 0. ``pads
    [B]``: each request's leading padding tokens, never seen (HF masks them) -> ``[B, T, window]``."""
    offs = torch.arange(window - 1, -1, -1, device=positions.device)
    pos = positions.long()[:, None] - offs[None, :]
    if pads is None:
        return torch.where(pos >= 0, pos + first_row, -1).to(torch.int32)
    seen = (pos >= 0) & (pos >= pads.view(-1, 1, 1).to(pos.device))
    return torch.where(seen, pos + first_row, -1).to(torch.int32)


def causal_entry_indices(positions: torch.Tensor, rate: int, entries: int, first_row: int) -> torch.Tensor:
    """``[..., entries] int32`` for query ``positions [...]``: every compressed entry the query may see (HCA's
    dense set): entry w covers tokens ``w * rate .. (w + 1) * rate - 1`` and is visible once its last token is,
    i.e. ``w < (p + 1) // rate``; row = ``first_row + w``, -1 otherwise."""
    w = torch.arange(entries, device=positions.device)
    visible = w < ((positions.long() + 1) // rate).unsqueeze(-1)
    return torch.where(visible, w + first_row, -1).to(torch.int32)


def _fp8_rows_triton(rows: torch.Tensor) -> torch.Tensor:
    from flashdsa.cache.mla_encode import quantize_mla_656_triton  # (imports triton: on first use)
    return quantize_mla_656_triton(rows)


_FP8_ROWS = {"torch": lambda rows: encode_mla(rows, "fp8"), "triton": _fp8_rows_triton}


def fp8_rows(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``[..., D]`` K = V rows -> ``[..., 656] uint8``: flashdsa's fp8 MLA rows (e4m3 latent in 128-blocks with
    UE8M0 scales, the zero rope part in bf16), what the fp8 mode stores. ``backend``: "torch" (the layout's
    encode), "triton" (the same bits in one launch, flashdsa.cache.mla_encode), None: Triton on CUDA."""
    encode = pick_backend(backend, _FP8_ROWS, x.device, "fp8_rows")
    return encode(mla_rows(x.to(torch.bfloat16)).reshape(-1, MLA_DIM)).view(*x.shape[:-1], MLA_FP8_BYTES)


def attend_fp8(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float,
               cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *,
               backend: str | None = None) -> torch.Tensor:
    """:func:`attend` over fp8 rows (``rows [N, 656] uint8`` from :func:`fp8_rows`), through the paged decode
    kernels: the rows padded to whole 64-row pages are the pages, a row's index its slot. ``q [T, h, D]``
    bfloat16; returns ``[T, h, D]`` bfloat16."""
    T, h, D = q.shape
    pad = -rows.shape[0] % PAGE_SIZE
    if pad:  # whole pages (the layer step's buffers already are: no copy)
        rows = torch.cat((rows, rows.new_zeros(pad, rows.shape[1])))
    pages = rows.view(-1, PAGE_SIZE, rows.shape[1])
    out, lse = ops.sparse_mla_decode(mla_rows(q.to(torch.bfloat16)).view(T, 1, h, MLA_DIM), pages,
                                     indices.view(T, 1, -1), scale, backend=backend)
    # sinks and the RoPE undone in fp32: the kernel's bf16 output and the result are the only roundings
    return _finish(out.view(T, h, -1).float(), lse.view(T, h), sinks, D, cos, sin, backend,
                   backend).to(torch.bfloat16)


def _finish(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, D: int, cos: torch.Tensor | None,
            sin: torch.Tensor | None, backend: str | None, rope_backend: str | None = "torch") -> torch.Tensor:
    """Both paths' end: the sinks on ``out [T, h, 512]`` (in its dtype), its first D channels, then the trailing
    RoPE slice rotated back by the query's position (the values carried the keys'), fp32 from there
    (``rope_backend``: :func:`flashdsa.v4.rope.rope_tail`'s; "torch" keeps HF's bits)."""
    out = ops.attention_sinks(out, lse, sinks.to(device=out.device, dtype=torch.float32), backend=backend)[..., :D]
    if cos is None:
        return out
    return rope_tail(out, cos, sin, inverse=True, out_dtype=torch.float32, backend=rope_backend)


def attend(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float,
           cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *,
           backend: str | None = None) -> torch.Tensor:
    """V4 attention of query rows over their listed keys, with sinks.

    Args:
        q:       ``[T, h, D]`` (D = head_dim <= 512) bfloat16, or float32 with float32 ``kv``; RoPE applied.
        kv:      ``[N, D]`` the shared K = V rows (RoPE applied to their trailing slice), or ``[N, 576]`` the same
                 as MLA rows (:func:`mla_rows`: what the layer step keeps).
        indices: ``[T, k] int32`` rows of ``kv`` per query row; -1 = none.
        sinks:   ``[h]`` per-head sink logits (not scaled).
        scale:   the softmax scale (``head_dim ** -0.5``).
        cos, sin: ``[T, R / 2] float32`` of each query's position: the output's trailing R channels are
                 rotated back (interleaved pairs, as V4's RoPE); None: left as they are.

    Returns ``[T, h, D]`` in q's dtype.
    """
    T, h, D = q.shape
    if kv.shape[-1] not in (D, MLA_DIM):
        raise ValueError(f"kv: expected rows of {D} (q's head_dim) or {MLA_DIM} (MLA rows), got {tuple(kv.shape)}")
    if sinks.shape != (h,):
        raise ValueError(f"sinks: expected shape ({h},), got {tuple(sinks.shape)}")
    rows = kv if kv.shape[-1] == MLA_DIM else mla_rows(kv)
    out, lse = ops.sparse_mla_prefill(mla_rows(q), rows, indices, scale, backend=backend)
    return _finish(out, lse, sinks, D, cos, sin, backend).to(q.dtype)
