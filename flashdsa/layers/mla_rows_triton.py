"""The Triton kernel of :func:`flashdsa.layers.mla_rows.mla_rows` (its docstring: what it replaces, its numerics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdsa.layers.mla_rows import mla_rows_torch, norm_eps, norm_form
from flashdsa.ops._launch import KernelLauncher, aligned
from flashdsa.ops._triton_utils import interpreting
from flashdsa.ops.indexer_quant.triton import _round_bf16


@triton.jit
def _cast(v, DT: tl.constexpr, SOFT: tl.constexpr):
    """fp32 -> DT rounding to nearest even: the interpreter's own cast to bf16 truncates (SOFT: integer code)."""
    if SOFT and DT == tl.bfloat16:
        v = _round_bf16(v, True)
    return v.to(DT)


@triton.jit
def _rope_pairs(src, dst, cs, sn, j, m, DT: tl.constexpr, SOFT: tl.constexpr):
    """Interleaved pairs (2j, 2j + 1) at ``src`` rotated by the angles ``cs, sn`` in fp32, stored at ``dst``
    (pointer blocks of any shape that broadcast with ``j``)."""
    a = tl.load(src + 2 * j, mask=m, other=0.0).to(tl.float32)
    b = tl.load(src + 2 * j + 1, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + 2 * j, _cast(a * cs - b * sn, DT, SOFT), mask=m)
    tl.store(dst + 2 * j + 1, _cast(b * cs + a * sn, DT, SOFT), mask=m)


@triton.jit
def mla_rows_kernel(q_lat, s_lt, s_lh, q_pe, s_pt, s_ph, kv, s_kv, w, cos, sin, s_cos, q_out, kv_out, H, eps,
                    LAT: tl.constexpr, R: tl.constexpr, HF_FORM: tl.constexpr,
                    ROUND_PRODUCT: tl.constexpr, SOFT: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_R: tl.constexpr):
    """Program (t, i): heads [i BLOCK_H, (i + 1) BLOCK_H) of token t's query, or (i = last) token t's row."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    DT = q_out.dtype.element_ty
    D: tl.constexpr = LAT + R
    c = tl.arange(0, LAT)
    j = tl.arange(0, BLOCK_R)
    jm = j < R // 2
    cs = tl.load(cos + t * s_cos + j, mask=jm, other=0.0)
    sn = tl.load(sin + t * s_cos + j, mask=jm, other=0.0)
    if i * BLOCK_H < H:
        hs = i * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = hs < H
        lat = tl.load(q_lat + t * s_lt + hs[:, None] * s_lh + c[None, :], mask=hm[:, None], other=0.0)
        qd = q_out + (t * H + hs[:, None]) * D
        tl.store(qd + c[None, :], _cast(lat.to(tl.float32), DT, SOFT), mask=hm[:, None])
        if R > 0:
            _rope_pairs(q_pe + t * s_pt + hs[:, None] * s_ph, qd + LAT, cs[None, :], sn[None, :], j[None, :],
                        hm[:, None] & jm[None, :], DT, SOFT)
    else:
        XT = kv.dtype.element_ty
        x = tl.load(kv + t * s_kv + c).to(tl.float32)
        r = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / LAT + eps))
        wv = tl.load(w + c).to(tl.float32)
        if HF_FORM:  # weight * (x * rsqrt).to(dtype): the product in the promoted dtype
            y = _cast(x * r, XT, SOFT).to(tl.float32) * wv
            if ROUND_PRODUCT:
                y = _cast(y, XT, SOFT).to(tl.float32)
        else:        # (weight * x * rsqrt).to(dtype), in fp32
            y = _cast(wv * x * r, XT, SOFT).to(tl.float32)
        kd = kv_out + t * D
        tl.store(kd + c, _cast(y, DT, SOFT))
        if R > 0:
            _rope_pairs(kv + t * s_kv + LAT, kd + LAT, cs, sn, j, jm, DT, SOFT)


@triton.jit
def rms_norm_kernel(x, s_x, w, out, D, eps, HF_FORM: tl.constexpr, SOFT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program t: row t of ``x`` normed as the module's form (see :func:`mla_rows_kernel`'s cache row)."""
    t = tl.program_id(0).to(tl.int64)
    XT = x.dtype.element_ty
    c = tl.arange(0, BLOCK_D)
    m = c < D
    v = tl.load(x + t * s_x + c, mask=m, other=0.0).to(tl.float32)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(v * v, axis=0) / D + eps))
    wv = tl.load(w + c, mask=m, other=0.0).to(tl.float32)
    if HF_FORM:  # the product rounds to out's dtype (the promoted one) at the store
        y = _cast(v * r, XT, SOFT).to(tl.float32) * wv
    else:
        y = wv * v * r
    tl.store(out + t * D + c, _cast(y, out.dtype.element_ty, SOFT), mask=m)


BLOCK_H = 16


def _kernel_form(norm: torch.nn.Module, dtype: torch.dtype) -> tuple[str | None, torch.dtype]:
    """The norm's form where the kernels compute it for inputs of ``dtype`` (None: run the torch module), and
    the dtype of HF's product ``weight * x_normed`` (its promoted dtype: the input's, or fp32)."""
    form = norm_form(norm)
    product = torch.promote_types(norm.weight.dtype, dtype)
    return (None if form == "hf" and product not in (dtype, torch.float32) else form), product


def mla_rows_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, norm: torch.nn.Module,
                    cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mla_rows_torch` in one launch (the module docstring's numerics). Args as :func:`mla_rows`.

    Launched from a plan (ops/_launch.py: Triton's own launch costs tens of µs of host time, which is what this
    kernel is for)."""
    T, H, lat = q_lat.shape
    rope = q_pe.shape[-1]
    form, product = _kernel_form(norm, kv.dtype)
    w = norm.weight
    if form is None or any(a.stride(-1) != 1 for a in (q_lat, q_pe, kv, cos, sin)) or cos.stride() != sin.stride():
        return mla_rows_torch(q_lat, q_pe, kv, norm, cos, sin, out_dtype)
    q_abs = torch.empty(T, H, lat + rope, dtype=out_dtype, device=q_lat.device)
    kv_rows = torch.empty(T, lat + rope, dtype=out_dtype, device=q_lat.device)
    if T == 0:
        return q_abs, kv_rows
    eps = float(norm_eps(norm))
    ptrs = (q_lat.data_ptr(), q_pe.data_ptr(), kv.data_ptr(), w.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            q_abs.data_ptr(), kv_rows.data_ptr())
    key = (q_lat.device, T, H, lat, rope, q_lat.stride(), q_pe.stride(), kv.stride(), cos.stride(), q_lat.dtype,
           q_pe.dtype, kv.dtype, w.dtype, cos.dtype, out_dtype, eps, form) if aligned(*ptrs) else None

    def build():
        return (T, triton.cdiv(H, BLOCK_H) + 1), dict(
            q_lat=q_lat, s_lt=q_lat.stride(0), s_lh=q_lat.stride(1), q_pe=q_pe, s_pt=q_pe.stride(0),
            s_ph=q_pe.stride(1), kv=kv, s_kv=kv.stride(0), w=w, cos=cos, sin=sin, s_cos=cos.stride(0), q_out=q_abs,
            kv_out=kv_rows, H=H, eps=eps, LAT=lat, R=rope, HF_FORM=form == "hf",
            ROUND_PRODUCT=product != torch.float32, SOFT=interpreting(), BLOCK_H=BLOCK_H,
            BLOCK_R=triton.next_power_of_2(max(rope // 2, 1)), num_warps=4,
            enable_fp_fusion=False)  # the torch ops' roundings (module docstring)

    _LAUNCH(key, ptrs, build)
    return q_abs, kv_rows


_LAUNCH = KernelLauncher(mla_rows_kernel, ("q_lat", "q_pe", "kv", "w", "cos", "sin", "q_out", "kv_out"))


def rms_norm_triton(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """``norm(x)`` for ``x [T, D]`` in one launch (from a plan); the torch module where its form is unknown."""
    form, product = _kernel_form(norm, x.dtype)
    w = norm.weight
    if form is None or x.dim() != 2 or x.stride(-1) != 1:
        return norm(x)
    T, D = x.shape
    # HF: weight * x_normed.to(dtype) in the promoted dtype; flashdsa's: (weight * x * rsqrt).to(x.dtype)
    out = torch.empty(T, D, dtype=product if form == "hf" else x.dtype, device=x.device)
    if T == 0:
        return out
    eps = float(norm_eps(norm))
    ptrs = (x.data_ptr(), w.data_ptr(), out.data_ptr())
    key = (x.device, T, D, x.stride(0), x.dtype, w.dtype, out.dtype, eps, form) if aligned(*ptrs) else None

    def build():
        return (T,), dict(x=x, s_x=x.stride(0), w=w, out=out, D=D, eps=eps, HF_FORM=form == "hf",
                          SOFT=interpreting(), BLOCK_D=triton.next_power_of_2(D), num_warps=4,
                          enable_fp_fusion=False)

    _NORM(key, ptrs, build)
    return out


_NORM = KernelLauncher(rms_norm_kernel, ("x", "w", "out"))
