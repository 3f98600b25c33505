"""The indexer's deployment numerics in one op: RoPE, Hadamard rotation, block fp8 quantisation."""

from __future__ import annotations

import functools
import importlib

import torch

from flashdsa._library import op
from flashdsa.ops._common import (DEVICE, HOST, check_finite, check_tensor, dense, fail, pick_backend,
                                  raise_deferred, value_check_mode)
from flashdsa.ops.indexer_quant import reference

HEAD_DIM = 128
ROPE_HALF = 32
# |x| <= 2^118 and |cos|, |sin| <= 2 (a YaRN table is scaled by its mscale, ~1.4) keep every fp32
# intermediate finite: RoPE <= 2^120, the unnormalised Hadamard sums of 128 <= 2^127 < fp32's 2^128
X_BOUND = 2.0 ** 118
COS_BOUND = 2.0


# imported on first use: importing triton is slow and CPU-only users never need it
_module = functools.cache(importlib.import_module)


def _triton_indexer_quant(*args, **kwargs):
    return _module("flashdsa.ops.indexer_quant.triton").indexer_quant(*args, **kwargs)


def _triton_rope(*args, **kwargs):
    return _module("flashdsa.ops.indexer_quant.triton").indexer_rope(*args, **kwargs)


_IMPLS = {"torch": reference.indexer_quant, "triton": _triton_indexer_quant}
_ROPE_IMPLS = {"torch": reference.rope_model_dtype, "triton": _triton_rope}


def rope_model_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, *,
                     backend: str | None = None) -> torch.Tensor:
    """:func:`indexer_quant`'s first step alone, the same bits: ``x.dtype(indexer_rope(x, cos, sin, interleave))``
    (``[T, ..., 128]`` bfloat16 / float32, ``cos, sin [T, 32] float32`` or ``[T, 0]`` for NoPE; a new
    contiguous tensor of x's dtype). kpool's keys are pooled between the RoPE and the Hadamard (docs/DSA.md §7).

    Internal to the indexer layer, which passes its own tensors: no value checks and not a registered op.
    """
    return pick_backend(backend, _ROPE_IMPLS, x.device, "rope_model_dtype")(x, cos, sin, interleave)


def _triton_weights(x, cos, sin, interleave, gate, gate_scale, head_scale):
    if gate.dtype not in (torch.bfloat16, torch.float32):  # the kernel reads bf16 / fp32 gates: the same bits
        return reference.indexer_quant_weights(x, cos, sin, interleave, gate, gate_scale, head_scale)
    x_fp8, _, w = _triton_indexer_quant(x, cos, sin, interleave, gate=(gate, gate_scale, head_scale))
    return x_fp8, w


_WEIGHTS_IMPLS = {"torch": reference.indexer_quant_weights, "triton": _triton_weights}


def indexer_quant_weights(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, gate: torch.Tensor,
                          gate_scale: float, head_scale: float, *,
                          backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's queries and head weights in one launch, the layer's bits: ``x [T, H, 128]`` (bfloat16 /
    float32) quantised as :func:`indexer_quant` does, and ``w = ((gate.float() * gate_scale) * scale) *
    head_scale`` for ``gate [T, H]`` (bfloat16 / float32: ``weights_proj``'s output) with the quantisation's
    ``scale [T, H]``, each product rounded in fp32 -> ``x_fp8 [T, H, 128] float8_e4m3fn``, ``w [T, H] float32``.
    The layer's four elementwise kernels after ``weights_proj`` (cast, scale, times the q scale, scale) run
    inside the quantisation's launch on the GPU.

    Internal to the indexer layer, which passes its own tensors: no value checks and not a registered op.
    """
    impl = pick_backend(backend, _WEIGHTS_IMPLS, x.device, "indexer_quant_weights")
    return impl(x, cos, sin, interleave, gate, gate_scale, head_scale)


def _quant_fake(x, cos, sin, interleave, *, backend=None):
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))


@op("indexer_quant", _quant_fake)
def indexer_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, *,
                  backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the first 64 dims, rounding to the model dtype, Sylvester Hadamard, fp8 with a UE8M0 scale.

    Per head (docs/DSA.md §3), exactly as ``flashdsa.quant`` composes it::

        y = x.dtype(indexer_rope(x, cos, sin, interleave))   # layout [rope 64 | nope 64]
        z = x.dtype(H128 y / sqrt(128))                        # hadamard(): fp32 butterflies
        x_fp8, scale = act_quant(z, block=128)                 # scale = 2^ceil(log2(max(amax, 1e-4) / 448))

    Both backends give the same bits; the Triton one (default on CUDA) is one launch for any T and head
    count. Use it for the queries ``[T, H, 128]`` and the key ``[T, 128]`` alike. NaN / inf in x, cos or
    sin, ``|x| > 2^118`` or ``|cos|, |sin| > 2`` (where RoPE or the Hadamard sums could overflow) are a
    ValueError when value checks are on: the kernel's amax and casts do not propagate NaN / inf as torch
    does, so with the checks off such inputs give unspecified results (with the Triton kernel on CUDA
    these checks run on the device: a deferred ValueError, ``flashdsa._checks``).

    Args:
        x:          ``[T, ..., 128]`` bfloat16 or float32 (the model dtype), unit stride not required.
        cos, sin:   ``[T, 32] float32`` RoPE tables of each row's position; ``[T, 0]`` for a NoPE model
                    (GLM-5.3-Flash): no rotation, the Hadamard and the quantisation alone.
        interleave: ``False``: NeoX pairs (i, i + 32); ``True``: GPT-J pairs (2i, 2i + 1).

    Returns:
        ``x_fp8 [T, ..., 128] float8_e4m3fn`` and ``scale [T, ...] float32`` (powers of two) with
        ``z ≈ x_fp8 * scale[..., None]``.
    """
    raise_deferred()
    check_tensor("x", x, dtype=(torch.bfloat16, torch.float32))
    if x.dim() < 2 or x.shape[-1] != HEAD_DIM:
        fail("x", f"a [T, ..., {HEAD_DIM}] tensor", f"shape {list(x.shape)}")
    T = x.shape[0]
    check_tensor("cos", cos, dtype=torch.float32, shape=(T, None), device=x.device)
    if cos.shape[1] not in (ROPE_HALF, 0):
        fail("cos", f"[T, {ROPE_HALF}] (or [T, 0]: NoPE, no rotation)", f"shape {list(cos.shape)}")
    check_tensor("sin", sin, dtype=torch.float32, shape=tuple(cos.shape), device=x.device)
    # 0 / 1 as well: torch.ops.flashdsa.indexer_quant turns any number into a bool before the op sees it
    if not (isinstance(interleave, bool) or type(interleave) is int and interleave in (0, 1)):
        fail("interleave", "a bool (or 0 / 1)", repr(interleave))
    interleave = bool(interleave)
    cos, sin = dense(cos, sin)
    impl = pick_backend(backend, _IMPLS, x.device, "indexer_quant")
    mode = value_check_mode(x, impl is _triton_indexer_quant)
    if mode is HOST:
        check_finite("x", x, X_BOUND)
        check_finite("cos", cos, COS_BOUND)
        check_finite("sin", sin, COS_BOUND)
    elif mode is DEVICE:
        return impl(x, cos, sin, interleave, check=True)  # checked by the kernel itself, in the rows it reads
    return impl(x, cos, sin, interleave)
