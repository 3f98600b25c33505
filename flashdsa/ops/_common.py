"""Shared input checks and backend choice for the public ops.

Every public op checks shapes, dtypes and devices first (host facts: no device access) and then the
values that could make a kernel read out of bounds or the backends disagree (lengths, page ids, NaN),
as ``flashdsa._checks`` describes: by default on the device for a Triton launch on CUDA (deferred
errors, no host sync), on the host elsewhere; ``flashdsa.ops.set_value_checks`` picks the mode. These
helpers sit on every call's path, so they do only what the host already knows, in as few Python steps
as they can.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

import torch

from flashdsa._checks import (DEVICE, HOST, check_errors, check_finite, check_mode_and_capture,  # noqa: F401 (re-exported)
                              check_range, fail, is_cuda, raise_deferred, set_value_checks, value_check_mode,
                              value_checks_enabled)
from flashdsa.ops._shared import INT32_MAX, remember  # noqa: F401 (re-exported)

BACKENDS = ("torch", "triton", "gluon")  # gluon: the ops that have a Gluon kernel (sparse_mla_decode)
_Tensor = torch.Tensor


def check_tensor(name: str, t, *, dtype: torch.dtype | Iterable[torch.dtype] | None = None,
                 ndim: int | None = None, shape: tuple | None = None, device: torch.device | None = None,
                 contiguous_last: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``t`` is a tensor of the given dtype / rank / shape / device.

    ``shape`` may hold None for a free dimension.
    """
    if not isinstance(t, _Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if dtype is not None and t.dtype is not dtype:
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in dtypes:
            fail(name, f"dtype {' or '.join(str(d) for d in dtypes)}", t.dtype)
    if ndim is not None and t.dim() != ndim:
        fail(name, f"a {ndim}-D tensor", f"shape {list(t.shape)}")
    if shape is not None:
        got = t.shape
        if None in shape:
            bad = len(got) != len(shape) or any(s is not None and s != d for s, d in zip(shape, got))
        else:
            bad = got != shape  # torch.Size is a tuple: one C comparison
        if bad:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            fail(name, f"shape {want}", list(got))
    if device is not None and t.device != device:
        fail(name, f"a tensor on {device} (like the first argument)", t.device)
    if contiguous_last and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        fail(name, "unit stride in the last dim", f"strides {t.stride()}")


def dense(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The small metadata arguments (lengths, offsets, page tables, head gates, slot lists) made
    contiguous, so that every backend may index them densely: a strided view such as
    ``context_lens[:, 0]`` then means the same on both. Free when already contiguous; never used for
    the caches or the [T, N] logits, which are rejected or read through their strides instead."""
    return tuple([t if t is None or t.is_contiguous() else t.contiguous() for t in tensors])  # a list: no generator


def _bytes(t: torch.Tensor) -> tuple[int, int]:
    """``[first, end)`` byte addresses a tensor's elements span (torch strides are never negative)."""
    lo = t.data_ptr()
    if t.is_contiguous():  # the common case, 10x cheaper than the strides' sum (a plain call's host time)
        return lo, lo + t.nbytes
    return lo, lo + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def check_no_overlap(name: str, out: torch.Tensor, **inputs: torch.Tensor | None) -> None:
    """ValueError naming ``name`` when ``out`` shares bytes with one of ``inputs``: a kernel that reads an
    input while it writes ``out`` would read its own results."""
    if out.numel() == 0:
        return
    a0, a1 = _bytes(out)
    dev = out.device
    for k, t in inputs.items():
        if t is not None and isinstance(t, _Tensor) and t.numel() and t.device == dev:
            b0, b1 = _bytes(t)
            if a0 < b1 and b0 < a1:
                fail(name, f"a buffer that does not overlap {k}", "one that shares its memory")


def check_int(name: str, x, lo: int) -> int:
    """A Python int (not a bool) >= ``lo``."""
    if type(x) is not int and (isinstance(x, bool) or not isinstance(x, int)) or x < lo:
        fail(name, f"an int >= {lo}", repr(x))
    return x


def check_translation(R: int, device: torch.device, page_table, out_offsets) -> None:
    """The output translation of ``topk_transform`` / ``kpool_expand`` (shapes, dtypes, devices): at most
    one of ``page_table [R / g, maxp] int32`` (g rows share a table row) and ``out_offsets [R] int32``."""
    if page_table is not None and out_offsets is not None:
        fail("out_offsets", "None when page_table is given (one translation per call)", "both")
    if out_offsets is not None:
        check_tensor("out_offsets", out_offsets, dtype=torch.int32, shape=(R,), device=device)
    if page_table is not None:
        check_tensor("page_table", page_table, dtype=torch.int32, ndim=2, device=device)
        rows = page_table.shape[0]
        if rows == 0 and R or rows and R % rows:
            fail("page_table", f"a row count that divides R = {R}", rows)


def check_translation_values(lengths: torch.Tensor, page_table, out_offsets, page_size: int) -> None:
    """The translation's values on the host (a sync per check on CUDA), for rows of ``lengths [R]``
    positions: ``out_offsets + lengths - 1`` fits the int32 output; the table holds the pages the longest
    row of each table row needs, each a page id whose slots fit int32."""
    if out_offsets is not None:
        check_range("out_offsets", out_offsets.long() + lengths - 1, None, INT32_MAX, what="out_offsets + lengths - 1")
    if page_table is not None and lengths.numel():
        need = (lengths.view(page_table.shape[0], -1).amax(dim=1).long() + page_size - 1) // page_size
        check_range("page_table", need, None, page_table.shape[1], what="pages needed by lengths")
        used = torch.arange(page_table.shape[1], device=lengths.device)[None, :] < need[:, None]
        check_range("page_table", page_table[used], 0, (INT32_MAX + 1) // page_size - 1, what="page ids (int32 slots)")


def check_scalar(name: str, x, *, positive: bool = True) -> float:
    """A float argument: a Python float or int, or a one-element real tensor (read on the host), the
    spellings ``torch.ops.flashdsa.*`` turns into a float before the op sees it (torch's schema rules also
    take a bool there; a bool is refused here)."""
    if isinstance(x, _Tensor) and x.numel() == 1 and not (x.is_complex() or x.dtype is torch.bool):
        x = x.item()
    if type(x) is not float and (isinstance(x, bool) or not isinstance(x, (int, float))):
        fail(name, "a Python float (or a one-element tensor)", type(x).__name__)
    x = float(x)
    if positive and not (x > 0 and x != float("inf")):
        fail(name, "a finite positive number", x)
    return x


def pick_backend(backend: str | None, impls: dict[str, Callable], device: torch.device, op: str) -> Callable:
    """The implementation to run: ``backend`` if given, else Triton on CUDA when it exists, else torch."""
    if backend is None:
        if is_cuda(device):
            impl = impls.get("triton")
            if impl is not None:
                return impl
        backend = "torch"
    elif backend not in BACKENDS:
        fail("backend", f"one of {BACKENDS} or None", repr(backend))
    if backend not in impls:
        raise ValueError(f"backend: {op} has no {backend!r} implementation (available: {sorted(impls)})")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got {device}")
    return impls[backend]


def facts(t) -> tuple | None:
    """The host-known facts of a tensor argument (type, dtype, shape, strides, device), for the ops' fast
    paths: a call whose facts all equal an earlier call's passes the same shape / dtype / device checks."""
    return None if t is None else (type(t), t.dtype, t.shape, t.stride(), t.device)


def device_checks():
    """The device value checks (``_device_checks``), imported on first use: they are Triton kernels."""
    from flashdsa.ops import _device_checks
    return _device_checks
