"""Value-range checks shared by the ops, the cache writers and the pool.

Shape and dtype checks are free; value checks (lengths, page ids, slots) read device memory, so they
are skipped inside CUDA-graph capture and can be switched off for production with
``flashdsa.ops.set_value_checks(False)`` or ``FLASHDSA_CHECK_VALUES=0``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch

_VALUE_CHECKS = os.environ.get("FLASHDSA_CHECK_VALUES", "1") != "0"
# Set while flashdsa's own engine calls the ops on metadata it built on the host (see trusted_inputs).
_TRUSTED = contextvars.ContextVar("flashdsa_trusted_inputs", default=False)


def set_value_checks(enabled: bool) -> None:
    """Turn the value-range checks of every op on or off (shape/dtype checks always run)."""
    global _VALUE_CHECKS
    _VALUE_CHECKS = bool(enabled)


@contextlib.contextmanager
def trusted_inputs():
    """Skip the value checks of the ops called inside (shape / dtype checks still run).

    For the engine's per-layer calls: their lengths, block tables and slots were built on the host from the
    page allocator, in bounds by construction, and re-reading them on the device costs a host sync per
    check (13 a layer at decode, ~800 a V3.2 decode step), which stalls eager decode.
    """
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def value_checks_enabled(*tensors: torch.Tensor) -> bool:
    if not _VALUE_CHECKS or _TRUSTED.get():
        return False
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        return False
    return True


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_range(name: str, t: torch.Tensor, lo: int | None, hi: int | None, what: str = "values") -> None:
    """Raise ValueError unless every element lies in [lo, hi] (inclusive); skipped when value checks are off."""
    if t.numel() == 0 or not value_checks_enabled(t):
        return
    if lo is not None:
        m = int(t.min())
        if m < lo:
            fail(name, f"{what} >= {lo}", m)
    if hi is not None:
        m = int(t.max())
        if m > hi:
            fail(name, f"{what} <= {hi}", m)


def check_slots(name: str, slots, limit: int, *, distinct: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``slots`` is a 1-D integer tensor; when value checks are
    on, also unless every slot lies in ``[0, limit)`` and, for a write (``distinct``), no slot repeats
    (two rows for one slot would leave whichever the scatter happened to store last)."""
    if not isinstance(slots, torch.Tensor):
        fail(name, "a 1-D integer tensor", type(slots).__name__)
    if slots.dim() != 1 or slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool:
        fail(name, "a 1-D integer tensor", f"{slots.dtype} {list(slots.shape)}")
    check_range(name, slots, 0, limit - 1, what="slots")
    if distinct and slots.numel() > 1 and value_checks_enabled(slots):
        s = slots.sort().values
        repeated = s[1:][s[1:] == s[:-1]]
        if repeated.numel():
            fail(name, "distinct slots", f"slot {int(repeated[0])} more than once")


def check_finite(name: str, t: torch.Tensor, bound: float | None = None) -> None:
    """Raise ValueError unless every element of ``t`` is finite (float8_e4m3fn: no NaN code, it has no
    inf) and, if given, ``|t| <= bound``; skipped when value checks are off. For inputs on which the
    backends' NaN / inf handling differs (the kernels' max, ReLU and conversions do not propagate NaN as
    torch does), and ``bound`` for those whose intermediates would overflow to inf."""
    if t.numel() == 0 or not value_checks_enabled(t):
        return
    if t.dtype == torch.float8_e4m3fn:
        if bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
            fail(name, "finite values", "an e4m3 NaN code (0x7F / 0xFF)")
        return
    amax = float(t.detach().abs().amax())  # NaN if any element is NaN
    if not amax <= (float("inf") if bound is None else bound) or amax == float("inf"):
        fail(name, "finite values" if bound is None else f"finite values with |values| <= {bound:g}",
             f"max |value| {amax}")
