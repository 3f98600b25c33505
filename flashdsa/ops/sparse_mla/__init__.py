"""Sparse MLA over the top-k selected tokens: decode over paged caches, prefill over gathered KV."""

from __future__ import annotations

import functools
import importlib

import torch

from flashdsa._library import op
from flashdsa.cache.layouts import MLA_DIM, MLA_LATENT, PAGE_SIZE, mla_cache_layout
from flashdsa.ops._common import check_scalar, check_tensor, dense, facts, fail, pick_backend, raise_deferred, remember
from flashdsa.ops._gluon import GluonKernels
from flashdsa.ops._triton_utils import num_sms  # torch only: no triton import
from flashdsa.ops.sparse_mla import reference

# imported on first use: importing triton is slow and CPU-only users never need it
_module = functools.cache(importlib.import_module)


def _triton_decode(*args, **kwargs):
    return _module("flashdsa.ops.sparse_mla.triton").sparse_mla_decode(*args, **kwargs)


def _triton_prefill(*args, **kwargs):
    return _module("flashdsa.ops.sparse_mla.triton").sparse_mla_prefill(*args, **kwargs)


# The Gluon kernels (sm_90): the fp8 656-B decode kernel, and the two-consumer kernel over bf16 rows (prefill's
# gathered KV and the bf16 paged cache)
_GLUON_FP8 = "flashdsa.ops.sparse_mla.gluon"
_GLUON_BF16 = "flashdsa.ops.sparse_mla.gluon_bf16"
_GLUONS = GluonKernels(lambda name: _module(name))  # which ran, which failed their first launch (ops/_gluon.py)


def _run_gluon(mod: str, op_name: str, fallback, *args):
    return _GLUONS.run(mod, f"sparse_mla_{op_name}", fallback, *args, op=f"sparse_mla_{op_name}",
                       fallback_name="Triton kernels")


def _gluon_decode_module(kv_cache) -> str:
    """The Gluon module that decodes over ``kv_cache``'s pages: the bf16 kernel for bf16 pages, else the fp8 one."""
    return _GLUON_BF16 if kv_cache.dtype == torch.bfloat16 else _GLUON_FP8


def _gluon_decode(q, kv_cache, indices, sm_scale, d_v, kv_scale):
    return _run_gluon(_gluon_decode_module(kv_cache), "decode", _triton_decode, q, kv_cache, indices, sm_scale, d_v,
                      kv_scale)


def _gluon_prefill(q, kv, indices, sm_scale, d_v):
    return _run_gluon(_GLUON_BF16, "prefill", _triton_prefill, q, kv, indices, sm_scale, d_v)


def gluon_decode_ran() -> bool:
    """Whether a Gluon decode kernel has run in this process (the default dispatch picks one on sm_90 where it
    applies: README.md), for reports that name the kernels behind their figures."""
    return any(entry == "sparse_mla_decode" for _, entry in _GLUONS.ran)


def _gluon_unsupported(mod: str, *args) -> str | None:
    return _GLUONS.unsupported(mod, *args)


def _pick(backend, impls, triton_impl, gluon_impl, why_not, dev, name, fills=None):
    """The one rule: Gluon wherever its kernel applies (``why_not()`` is None) and, by default, fills the GPU
    (``fills()``, when given, is True), Triton elsewhere on CUDA; ``backend`` forces one (a forced Gluon it does
    not apply to is a ValueError naming what is missing)."""
    impl = pick_backend(backend, impls, dev, name)
    if impl is triton_impl and backend is None or impl is gluon_impl:
        why = why_not()
        if why is None and (impl is gluon_impl or fills is None or fills()):
            return gluon_impl
        if impl is gluon_impl:
            fail("backend", f"'gluon' for a call it supports: it needs {why}", "'gluon'")
    return impl


def _gluon_decode_fills(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the Gluon decode kernel fills the GPU: the fp8 kernel splits each query's top-k list over CTAs
    where the queries are few (``gluon.decode_splits``), so always; the bf16-page kernel does not split, so
    where its CTAs — one per (query row, 64 heads) — cover a third of the SMs (below that the Triton kernels,
    which split the list: H200, benchmarks/sparse_decode_grid.py, 2026-12-03)."""
    if _gluon_decode_module(kv_cache) == _GLUON_FP8:
        return True
    B, s_q, h_q, _ = q.shape
    return 3 * B * s_q * -(-h_q // 64) >= num_sms(q.device)


_DECODE = {"torch": reference.sparse_mla_decode, "triton": _triton_decode, "gluon": _gluon_decode}
_PREFILL = {"torch": reference.sparse_mla_prefill, "triton": _triton_prefill, "gluon": _gluon_prefill}


def check_rows_kv(q: torch.Tensor, kv: torch.Tensor) -> None:
    """Prefill's ``q [T, h_q, D]`` and ``kv [N, D]`` (bf16 or fp32) with D 576, or 512 for NoPE rows."""
    d = q.shape[-1]
    if d not in (MLA_DIM, MLA_LATENT):
        fail("q", f"last dim {MLA_DIM} (512 latent + 64 rope) or {MLA_LATENT} (NoPE)", d)
    check_tensor("kv", kv, dtype=(torch.bfloat16, torch.float32), ndim=2, device=q.device)
    if kv.shape[1] not in (MLA_DIM, MLA_LATENT):
        fail("kv", f"[N, {MLA_DIM}] or [N, {MLA_LATENT}] (NoPE) rows", list(kv.shape))
    _check_q_width(d, kv.shape[1] - MLA_LATENT, "kv")


def _check_q_width(d: int, rope: int, kv_name: str) -> None:
    """q's last dim is the KV rows' 512 + rope: the rope dims are part of every score, so a mismatch is a caller's
    error (a NoPE model's 512-dim q against 576-dim rows, or the reverse), never padded here."""
    if d != MLA_LATENT + rope:
        fail("q", f"last dim {MLA_LATENT + rope} (512 latent + {rope} rope, as the {kv_name}'s rows)", d)


def _check_d_v(d_v) -> None:
    if isinstance(d_v, bool) or not isinstance(d_v, int) or not 1 <= d_v <= MLA_LATENT:
        fail("d_v", f"an int in 1..{MLA_LATENT} (the value is the leading latent dims)", d_v)


def _widen_for_fp32(q: torch.Tensor, kv_fmt: str, kv_name: str) -> torch.Tensor:
    """The query in the precision of the KV it meets: fp32 next to fp32 KV (a bf16 query widens exactly),
    bf16 otherwise (an fp32 query is refused rather than rounded: rounding it is the caller's choice)."""
    if kv_fmt == "fp32":
        return q.float()
    if q.dtype != torch.bfloat16:
        fail("q", f"dtype torch.bfloat16 with a {kv_fmt} {kv_name} (float32 only with float32 KV)", q.dtype)
    return q


def _check_cache_strides(kv_cache: torch.Tensor, fmt: str) -> None:
    """The cache is read in place through its page and row strides (a slice of a bigger pool is fine),
    never copied: each token row must be contiguous, and in the 656-B layout 4-byte aligned (its fp32
    scales and bf16 rope are read as such)."""
    if kv_cache.stride(-1) != 1:
        fail("kv_cache", "token rows with unit stride (the cache is read in place, never copied)",
             f"strides {kv_cache.stride()}")
    if fmt == "fp8" and (kv_cache.data_ptr() % 4 or kv_cache.stride(0) % 4 or kv_cache.stride(1) % 4):
        fail("kv_cache", "4-byte aligned token rows for the 656-B layout",
             f"data_ptr % 4 = {kv_cache.data_ptr() % 4}, strides {kv_cache.stride()}")


def _out_dtype(q: torch.Tensor, kv: torch.Tensor) -> torch.dtype:
    """The attention output's dtype: float32 over a float32 cache / KV (a bf16 q is widened), else q's."""
    return torch.float32 if kv.dtype == torch.float32 else q.dtype


def _decode_fake(q, kv_cache, indices, sm_scale, d_v=512, *, kv_scale=None, backend=None):
    B, s_q, h_q, _ = q.shape
    return (q.new_empty((B, s_q, h_q, d_v), dtype=_out_dtype(q, kv_cache)),
            q.new_empty((B, s_q, h_q), dtype=torch.float32))


@op("sparse_mla_decode", _decode_fake)
def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                      d_v: int = 512, *, kv_scale: float | None = None,
                      backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode / verify over a paged MLA cache.

    Args:
        q:        ``[B, s_q, h_q, 576] bfloat16`` absorbed queries (512 latent + 64 rope); s_q = 1 for
                  decode, next_n for MTP verify; any h_q. float32 with an fp32 cache (a bf16 q is then
                  widened: the fp32 path computes in fp32 throughout, IEEE products, no tf32).
                  ``[B, s_q, h_q, 512]`` over a NoPE cache (rows without a rope part: GLM-5.3-Flash).
        kv_cache: ``[P, 64, 656] uint8`` (fp8 latent + 4 fp32 scales + bf16 rope, FlashMLA's layout),
                  ``[P, 64, 576] bfloat16``, ``[P, 64, 576] uint8`` (raw fp8, needs ``kv_scale``) or
                  ``[P, 64, 576] float32`` (the "fp32" format); NoPE rows ``[P, 64, 528] uint8``,
                  ``[P, 64, 512]`` bfloat16 / uint8 / float32 (``cache/layouts.py``).
                  Any page / row stride (read in place), unit stride within a token row.
        indices:  ``[B, s_q, topk] int32`` physical slots ``page * 64 + row``; -1 or >= P * 64 = skip.
        sm_scale: softmax scale.
        d_v:      value dims (the first d_v of the latent).
        kv_scale: per-tensor scale of the raw fp8 cache; None for the other formats.
        backend:  None (the rule below), "gluon", "triton" or "torch" (the fp32 reference).

    Backends: on an sm_90 GPU with d_v 512 and 16-byte aligned rows, a warp-specialised Gluon kernel: over
    the fp8 656-B (or 528-B NoPE) cache ``gluon.py``, any h_q (64-head CTAs, heads past h_q masked), the top-k
    list split over CTAs where the queries are few (``gluon.decode_splits``: B 1 h_q 128 within 1.06x of
    FlashMLA on the H200); over
    the bf16 cache ``gluon_bf16.py``, h_q a multiple of 64, where its CTAs (one per query row and 64 heads,
    no split) cover a third of the SMs. Everywhere else on CUDA (other GPUs, caches, the interpreter) the
    Triton kernels, which split the top-k list over CTAs where the rows do not fill the GPU.
    All round P and the output to bf16, as FlashMLA does:
    ``|out - ref| <= 2^-8 (max |v| + |ref|)`` of the fp32 reference. Every backend dequantises the fp8
    cache with the reference's arithmetic (e4m3 -> fp32, times the fp32 scale, rounded once to bf16), for
    any scale.
    ``backend="gluon"`` where it does not apply is a ValueError.

    Returns:
        ``out [B, s_q, h_q, d_v] bfloat16`` (float32 with an fp32 cache) and ``lse [B, s_q, h_q] float32``
        (natural log). A row with no valid index gives out = 0 and lse = -inf.
    """
    raise_deferred()
    # Fast path: a call whose every host-known fact (types, dtypes, shapes, strides, devices, the cache's
    # alignment, the scalars, the backend) equals an earlier call's that passed the checks below launches the
    # kernel that call picked (the checks and the dispatch cost ~7 us of Python a call on a desktop CPU)
    try:
        key = (facts(q), facts(kv_cache), kv_cache.data_ptr() & 15, facts(indices), type(sm_scale), sm_scale,
               type(d_v), d_v, type(kv_scale), kv_scale, backend)
        hit = _FAST.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks below say what is wrong
        hit = key = None
    if hit is not None and _DECODE[hit[0]] is hit[1]:  # (tests stand other kernels in there)
        return hit[1](q, kv_cache, indices, hit[2], d_v, hit[3])
    if torch.Tensor in (type(sm_scale), type(kv_scale)):  # not remembered: the key would hold the object,
        key = None                                       # whose value may change
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float32), ndim=4)
    B, s_q, h_q, d = q.shape
    dev = q.device
    if d not in (MLA_DIM, MLA_LATENT):
        fail("q", f"last dim {MLA_DIM} (512 latent + 64 rope) or {MLA_LATENT} (NoPE)", d)
    check_tensor("kv_cache", kv_cache, ndim=3, device=dev)
    fmt, rope = mla_cache_layout(kv_cache)
    _check_q_width(d, rope, "cache")
    if kv_cache.shape[1] != PAGE_SIZE:
        fail("kv_cache", f"pages of {PAGE_SIZE} tokens [P, {PAGE_SIZE}, width]", list(kv_cache.shape))
    _check_cache_strides(kv_cache, fmt)
    given = (q, indices)
    q = _widen_for_fp32(q, fmt, "cache")
    if fmt == "fp8_raw":
        kv_scale = check_scalar("kv_scale", kv_scale)
    elif kv_scale is not None:
        fail("kv_scale", f"None for a {fmt!r} cache (only the raw fp8 cache has a per-tensor scale)", kv_scale)
    check_tensor("indices", indices, dtype=torch.int32, shape=(B, s_q, None), device=dev)
    scale = check_scalar("sm_scale", sm_scale)
    _check_d_v(d_v)
    (indices,) = dense(indices)
    if fmt == "bf16":
        why_not = lambda: _gluon_unsupported(_GLUON_BF16, q, kv_cache, d_v)  # noqa: E731
    else:
        why_not = lambda: _gluon_unsupported(_GLUON_FP8, q, kv_cache, fmt, d_v)  # noqa: E731
    impl = _pick(backend, _DECODE, _triton_decode, _gluon_decode, why_not, dev, "sparse_mla_decode",
                 lambda: _gluon_decode_fills(q, kv_cache))
    res = impl(q, kv_cache, indices, scale, d_v, kv_scale)
    name = next((n for n, f in _DECODE.items() if f is impl), None)
    # remembered where nothing was converted (q widened, indices made contiguous) and the kernel picked is the
    # one that ran (a Gluon kernel whose first launch failed fell back to Triton: not remembered)
    if key is not None and name is not None and given[0] is q and given[1] is indices and not (
            impl is _gluon_decode and _gluon_decode_module(kv_cache) in _GLUONS.failed):
        remember(_FAST, key, (name, impl, scale, kv_scale), 256)
    return res


# sparse_mla_decode's call signature (see its fast path) -> (backend name, implementation, sm_scale, kv_scale)
_FAST: dict = {}


def _prefill_fake(q, kv, indices, sm_scale, d_v=512, *, backend=None):
    T, h_q, _ = q.shape
    return q.new_empty((T, h_q, d_v), dtype=_out_dtype(q, kv)), q.new_empty((T, h_q), dtype=torch.float32)


@op("sparse_mla_prefill", _prefill_fake)
def sparse_mla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                       d_v: int = 512, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill over a gathered bf16 KV buffer.

    Args:
        q:       ``[T, h_q, 576] bfloat16`` (float32 with float32 kv; a bf16 q is then widened); NoPE:
                 ``[T, h_q, 512]``.
        kv:      ``[N, 576] bfloat16`` (the requests' KV, gathered and dequantised), or float32 (the
                 fp32 cache's rows: computed in fp32 throughout, IEEE products); NoPE: ``[N, 512]``.
        indices: ``[T, topk] int32`` rows of ``kv``; -1 or >= N = skip.

    Backends: on an sm_90 GPU with bf16 kv (16-byte aligned rows), h_q a multiple of 64 and d_v 512 the
    warp-specialised Gluon kernel (``gluon_bf16.py``, FlashMLA's sm90 prefill schedule); elsewhere on CUDA
    the Triton kernels; ``backend`` forces one ("gluon", "triton", "torch"), as in :func:`sparse_mla_decode`,
    with its tolerance.

    Returns:
        ``out [T, h_q, d_v]`` bfloat16 (float32 with float32 kv), ``lse [T, h_q] float32`` (natural log;
        -inf for empty rows). A row's result does not depend on the other rows of the call (chunked
        prefill == one-shot).
    """
    raise_deferred()
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float32), ndim=3)
    T, h_q, d = q.shape
    dev = q.device
    check_rows_kv(q, kv)
    q = _widen_for_fp32(q, "fp32" if kv.dtype == torch.float32 else "bf16", "kv")
    check_tensor("indices", indices, dtype=torch.int32, shape=(T, None), device=dev)
    sm_scale = check_scalar("sm_scale", sm_scale)
    _check_d_v(d_v)
    (indices,) = dense(indices)
    impl = _pick(backend, _PREFILL, _triton_prefill, _gluon_prefill,
                 lambda: _gluon_unsupported(_GLUON_BF16, q, kv, d_v), dev, "sparse_mla_prefill")
    return impl(q, kv, indices, float(sm_scale), d_v)


def _merge_fake(out_a, lse_a, out_b, lse_b):
    return torch.empty_like(out_a, memory_format=torch.contiguous_format), torch.empty_like(
        lse_a, memory_format=torch.contiguous_format)


@op("merge_attention", _merge_fake)
def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets into the attention over their union.

    ``out_*: [..., d_v]`` (any float dtype, the result takes out_a's), ``lse_*: [...] float32`` natural
    log. Exact for empty parts: a part with lse = -inf contributes nothing; two empty parts give
    out = 0, lse = -inf.
    """
    raise_deferred()
    check_tensor("out_a", out_a, dtype=(torch.bfloat16, torch.float16, torch.float32, torch.float64))
    if out_a.dim() < 1:
        fail("out_a", "a tensor [..., d_v]", "a 0-d tensor")
    check_tensor("lse_a", lse_a, dtype=torch.float32, shape=tuple(out_a.shape[:-1]), device=out_a.device)
    check_tensor("out_b", out_b, dtype=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
                 shape=tuple(out_a.shape), device=out_a.device)
    check_tensor("lse_b", lse_b, dtype=torch.float32, shape=tuple(out_a.shape[:-1]), device=out_a.device)
    return reference.merge_attention(out_a, lse_a, out_b, lse_b)


def _sinks_torch(out, lse, sinks):
    return reference.attention_sinks(out, lse, sinks)


def _sinks_triton(out, lse, sinks):
    from flashdsa.ops.sparse_mla import sinks as kernel
    return kernel.attention_sinks(out, lse, sinks)


_SINKS = {"torch": _sinks_torch, "triton": _sinks_triton}


def _sinks_fake(out, lse, sinks, *, backend=None):
    return torch.empty_like(out, memory_format=torch.contiguous_format)


@op("attention_sinks", _sinks_fake)
def attention_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, *,
                    backend: str | None = None) -> torch.Tensor:
    """Attention sinks (DeepSeek-V4): add ``exp(sinks[h])`` to each head's softmax denominator, after the fact.

    Args:
        out:   ``[..., h, d_v]`` an attention's output (bfloat16, float16 or float32).
        lse:   ``[..., h] float32`` its natural-log sum of exponentials (-inf: nothing attended).
        sinks: ``[h] float32`` per-head sink logits.

    Returns ``out / (1 + exp(sinks - lse))`` (``[..., h, d_v]``, out's dtype): the attention with the sink in the
    denominator, as the merge of ``(out, lse)`` with an empty partial of lse = sink. One Triton launch on CUDA.
    """
    raise_deferred()
    check_tensor("out", out, dtype=(torch.bfloat16, torch.float16, torch.float32))
    if out.dim() < 2:
        fail("out", "a tensor [..., h, d_v]", f"{out.dim()}-d")
    check_tensor("lse", lse, dtype=torch.float32, shape=tuple(out.shape[:-1]), device=out.device)
    check_tensor("sinks", sinks, dtype=torch.float32, shape=(out.shape[-2],), device=out.device)
    out, lse, sinks = out.contiguous(), lse.contiguous(), sinks.contiguous()
    return pick_backend(backend, _SINKS, out.device, "attention_sinks")(out, lse, sinks)
