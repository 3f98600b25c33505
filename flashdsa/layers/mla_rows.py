"""The tail of :meth:`DSAAttention.prepare`: the absorbed query and the cache row of each new token, in torch
ops and in one Triton launch.

In torch this is ~37 small kernels a layer (RoPE on the query's and the key's rope parts: ~10 each; the
latent RMSNorm: ~7; the casts and the two ``cat``): an eager decode step (``flashdsa.hf`` with
``cuda_graphs=False``, a notebook) pays their host cost at every layer, and a CUDA graph replays them all.
The kernel writes both outputs in one launch: one program per (token, block of heads) for the query, one
more per token for the cache row. :func:`rms_norm` is the same norm for the query latent (``q_a_layernorm``:
~8 kernels in torch, one launch).

Numerics. The query and the rope part of the row are the torch ops' bits (the products in fp32, rounded,
then subtracted: the kernel is compiled without FMA contraction). The RMSNorm's sum of squares and
``rsqrt`` round differently from torch's reduction, so a latent value can differ by an ulp or two of the
model dtype (tests/layers/test_mla_rows.py derives the bound). So ``flashdsa.hf``'s exact mode keeps the torch
ops (HF's bits); the fp8 mode and the engine take the kernel. (In Triton's interpreter, whose own cast to
bf16 truncates, the kernels round to nearest even in integer code: the CPU tests see the GPU's bits.)

Two RMSNorm forms are known (:func:`norm_form`): transformers' DSA models (``weight * x_normed.to(dtype)``:
the product in the model dtype) and flashdsa's own :class:`~flashdsa.layers.attention.RMSNorm`
(``(weight * x * rsqrt).to(dtype)`` in fp32, DeepSeek's reference). Any other norm module runs the torch ops.
"""

from __future__ import annotations

import torch

from flashdsa.ops._common import pick_backend
from flashdsa.quant import apply_rope

# transformers' RMSNorm classes of the DSA models, all ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)``
HF_NORMS = ("DeepseekV32RMSNorm", "GlmMoeDsaRMSNorm", "Glm5NextTextRMSNorm", "Glm5NextRMSNorm")


def norm_form(norm: torch.nn.Module) -> str | None:
    """``"hf"`` for transformers' RMSNorm of a DSA model, ``"fp32"`` for flashdsa's own, None for any other
    module (whose formula the kernel does not know)."""
    from flashdsa.layers.attention import RMSNorm
    if type(norm) is RMSNorm:
        return "fp32"
    cls = type(norm)
    if cls.__name__ in HF_NORMS and cls.__module__.startswith("transformers.") and "forward" not in norm.__dict__:
        return "hf"
    return None


def mla_rows_torch(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, norm: torch.nn.Module,
                   cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops (module docstring). Args as :func:`mla_rows`."""
    T, H, lat = q_lat.shape
    rope = q_pe.shape[-1]
    c, k_pe = kv.split([lat, rope], dim=-1)
    q_pe = apply_rope(q_pe, cos, sin, interleave=True)
    k_pe = apply_rope(k_pe, cos, sin, interleave=True)
    q_abs = torch.cat((q_lat, q_pe), dim=-1).to(out_dtype)
    kv_rows = torch.cat((norm(c).float(), k_pe), dim=-1).to(out_dtype)
    return q_abs, kv_rows


def norm_eps(norm: torch.nn.Module) -> float:
    return norm.eps if hasattr(norm, "eps") else norm.variance_epsilon


def rms_norm(x: torch.Tensor, norm: torch.nn.Module, *, backend: str | None = None) -> torch.Tensor:
    """``norm(x)`` for ``x [T, D]``: the module ("torch") or one launch ("triton"; None: Triton on CUDA) for the
    two known RMSNorm forms, within 2 ulps of the module's (the cache row's latent bound)."""
    if pick_backend(backend, _IMPLS, x.device, "rms_norm") is mla_rows_torch:
        return norm(x)
    from flashdsa.layers.mla_rows_triton import rms_norm_triton
    return rms_norm_triton(x, norm)


def _triton(*args):
    from flashdsa.layers.mla_rows_triton import mla_rows_triton  # importing triton is slow: on first use
    return mla_rows_triton(*args)


_IMPLS = {"torch": mla_rows_torch, "triton": _triton}


def mla_rows(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, norm: torch.nn.Module, cos: torch.Tensor,
             sin: torch.Tensor, out_dtype: torch.dtype, *, backend: str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed query and the cache rows of T new tokens.

    Args:
        q_lat:     ``[T, h, 512]`` the query's nope part mapped into the latent space (any float dtype).
        q_pe:      ``[T, h, R]`` the query's rope part before RoPE (R = 64, or 0 for NoPE).
        kv:        ``[T, 512 + R]`` ``kv_a_proj_with_mqa``'s output: the latent, then the key's rope part.
        norm:      ``kv_a_layernorm`` (an RMSNorm over the latent).
        cos, sin:  ``[T, R / 2] float32`` the tokens' angles (interleaved pairs, DeepSeek's MLA layout).
        out_dtype: the rows' dtype (bf16, or fp32 for the "fp32" cache).
        backend:   "torch" (the ops), "triton" (one launch), None (Triton on CUDA).

    Returns ``q [T, h, 512 + R]`` and ``kv_rows [T, 512 + R]`` in ``out_dtype``: ``[latent | RoPE'd rope part]``
    (NoPE: the latent alone, the cache's NoPE rows).
    """
    impl = pick_backend(backend, _IMPLS, q_lat.device, "mla_rows")
    return impl(q_lat, q_pe, kv, norm, cos, sin, out_dtype)
