"""Dense causal MLA over contiguous per-request KV: the fallback when every context fits in top-k."""

from __future__ import annotations

import functools
import importlib

import torch

from flashdsa._library import op
from flashdsa.cache.layouts import MLA_LATENT
from flashdsa.ops._common import (check_range, check_scalar, check_tensor, dense, fail, pick_backend, raise_deferred,
                                  value_checks_enabled)
from flashdsa.ops.dense_mla import reference
from flashdsa.ops.sparse_mla import _out_dtype, _widen_for_fp32, check_rows_kv

# imported on first use: importing triton is slow and CPU-only users never need it
_module = functools.cache(importlib.import_module)


def _triton(*args, **kwargs):
    return _module("flashdsa.ops.dense_mla.triton").dense_mla_prefill(*args, **kwargs)


_IMPLS = {"torch": reference.dense_mla_prefill, "triton": _triton}


def _dense_fake(q, kv, cu_seqlens_q, cu_seqlens_kv, sm_scale, d_v=512, *, backend=None):
    T, h_q, _ = q.shape
    return q.new_empty((T, h_q, d_v), dtype=_out_dtype(q, kv)), q.new_empty((T, h_q), dtype=torch.float32)


@op("dense_mla_prefill", _dense_fake)
def dense_mla_prefill(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
                      sm_scale: float, d_v: int = 512, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each request's new queries over its whole KV (cached prefix + new tokens).

    Args:
        q:             ``[T, h_q, 576] bfloat16``, requests concatenated (float32 with float32 kv; a bf16
                       q is then widened); NoPE: ``[T, h_q, 512]``.
        kv:            ``[N, 576] bfloat16``, each request's full KV concatenated; or float32 (the fp32
                       cache's rows: computed in fp32 throughout, IEEE products); NoPE: ``[N, 512]``.
        cu_seqlens_q:  ``[B + 1] int32`` query offsets; cu_seqlens_kv ``[B + 1] int32`` key offsets.
                       Request b's queries are its LAST ``q_len`` tokens: query i sits at position
                       ``kv_len - q_len + i`` and sees keys ``0 .. kv_len - q_len + i``.

    Returns:
        ``out [T, h_q, d_v]`` bfloat16 (float32 with float32 kv), ``lse [T, h_q] float32`` (natural log).

    Backends: "torch" (fp32 math, the reference) and "triton" (default on CUDA: the sparse prefill
    kernel over every visible key, bf16 operands with fp32 accumulation).
    """
    raise_deferred()
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float32), ndim=3)
    T, h_q, d = q.shape
    dev = q.device
    check_rows_kv(q, kv)
    q = _widen_for_fp32(q, "fp32" if kv.dtype == torch.float32 else "bf16", "kv")
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, ndim=1, device=dev)
    check_tensor("cu_seqlens_kv", cu_seqlens_kv, dtype=torch.int32, shape=tuple(cu_seqlens_q.shape), device=dev)
    if cu_seqlens_q.numel() < 1:
        fail("cu_seqlens_q", "[B + 1] offsets starting at 0", "an empty tensor")
    sm_scale = check_scalar("sm_scale", sm_scale)
    if isinstance(d_v, bool) or not isinstance(d_v, int) or not 1 <= d_v <= MLA_LATENT:
        fail("d_v", f"an int in 1..{MLA_LATENT}", d_v)
    cu_seqlens_q, cu_seqlens_kv = dense(cu_seqlens_q, cu_seqlens_kv)
    if value_checks_enabled(cu_seqlens_q):
        # one host read of both (the Triton backend reads them again anyway: a prefill op)
        cq, ck = torch.stack((cu_seqlens_q, cu_seqlens_kv)).cpu().long()
        if int(cq[0]) != 0 or int(cq[-1]) != T:
            fail("cu_seqlens_q", f"offsets from 0 to T = {T}", cq.tolist())
        if int(ck[0]) != 0 or int(ck[-1]) != kv.shape[0]:
            fail("cu_seqlens_kv", f"offsets from 0 to N = {kv.shape[0]}", ck.tolist())
        check_range("cu_seqlens_q", cq.diff(), 0, None, what="non-decreasing offsets, steps")
        check_range("cu_seqlens_kv - cu_seqlens_q", ck.diff() - cq.diff(), 0, None,
                    what="kv_len >= q_len per request, i.e. differences")
    impl = pick_backend(backend, _IMPLS, dev, "dense_mla_prefill")
    return impl(q, kv, cu_seqlens_q, cu_seqlens_kv, float(sm_scale), d_v)
