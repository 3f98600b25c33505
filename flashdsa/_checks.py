"""Value-range checks shared by the ops, the cache writers and the pool, and their three modes.

Shape, dtype and device checks are free and always run. Value checks (lengths, page ids, slots, NaN)
look at the data, so where they run matters:

* ``"device"`` (the default): an op running its Triton kernel on CUDA checks the values ON THE DEVICE
  and never stops the host: ``topk_transform``, ``indexer_logits_paged`` and ``indexer_quant`` inside
  their own kernel (no extra launch), ``indexer_logits_ragged`` (prefill) in one small check kernel
  launched before its own. A row with a bad value gets length 0, so a bad
  value never makes the op's kernel read out of bounds, and the first error is recorded in a
  host-mapped error word.
  The error is DEFERRED: the first flashdsa op called after the check kernel ran, or
  :func:`check_errors` (which synchronises), raises a ``ValueError`` naming the argument, as the host
  check would have; the output of the call that had the bad input is invalid. Everything else (CPU
  tensors, the torch reference backend, the cache writers) checks on the host as in ``"sync"``: there
  reading the values costs no device round trip (or the code reads them anyway).
* ``"sync"``: every check on the host, before any kernel runs (a host sync per check on CUDA): the
  thorough debug mode, immediate errors.
* ``"off"``: no value checks (shape / dtype checks still run).

Set with ``flashdsa.ops.set_value_checks(True | False | "device" | "sync" | "off")`` or
``FLASHDSA_CHECK_VALUES=1 | 0 | device | sync | off``. Value checks are also skipped inside CUDA-graph
capture and under :func:`trusted_inputs` (the engine's per-layer calls on metadata it built itself).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch

MODES = ("device", "sync", "off")
_ALIASES = {"1": "device", "true": "device", "on": "device", "0": "off", "false": "off", "debug": "sync"}


def _parse_mode(value, name: str) -> str:
    if isinstance(value, bool):
        return "device" if value else "off"
    mode = _ALIASES.get(str(value).strip().lower(), str(value).strip().lower())
    if mode not in MODES:
        raise ValueError(f"{name}: expected True, False or one of {MODES}, got {value!r}")
    return mode


_MODE = _parse_mode(os.environ.get("FLASHDSA_CHECK_VALUES", "device"), "FLASHDSA_CHECK_VALUES")
# Set while flashdsa's own engine calls the ops on metadata it built on the host (see trusted_inputs).
_TRUSTED = contextvars.ContextVar("flashdsa_trusted_inputs", default=False)
# Test hook: the device checks for CPU tensors too (their kernels then run in Triton's interpreter).
DEVICE_CHECKS_ON_CPU = False

HOST, DEVICE = "host", "device"


def set_value_checks(enabled) -> None:
    """Value checks of every op: ``True`` / ``"device"`` (default: on the device where an op runs Triton on
    CUDA, deferred errors), ``"sync"`` (on the host, immediate errors, a host sync per check), ``False`` /
    ``"off"`` (none). Shape / dtype checks always run."""
    global _MODE
    _MODE = _parse_mode(enabled, "enabled")


def value_check_setting() -> str:
    """The current mode: ``"device"``, ``"sync"`` or ``"off"``."""
    return _MODE


@contextlib.contextmanager
def trusted_inputs():
    """Skip the value checks of the ops called inside (shape / dtype checks still run).

    For the engine's per-layer calls: their lengths, block tables and slots were built on the host from the
    page allocator, in bounds by construction, and even a device check costs a launch per op.
    """
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def value_checks_enabled(*tensors: torch.Tensor) -> bool:
    """Whether value checks run for a call on ``tensors`` (off, trusted or capturing: no)."""
    if _MODE == "off" or _TRUSTED.get():
        return False
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        return False
    return True


def value_check_mode(t: torch.Tensor, device_capable: bool) -> str | None:
    """How an op checks the values of a call whose tensors live where ``t`` does: None (no value
    checks), ``HOST`` or ``DEVICE``. ``device_capable``: the op's chosen backend has device checks (its
    Triton kernel); only then, and only on CUDA in the default mode, are they used."""
    if _MODE == "off" or _TRUSTED.get():
        return None
    if t.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return None
        return DEVICE if device_capable and _MODE == "device" else HOST
    return DEVICE if device_capable and DEVICE_CHECKS_ON_CPU and _MODE == "device" else HOST


def check_mode_and_capture(t: torch.Tensor) -> tuple:
    """``(value_check_mode(t, True), capturing)`` in one pass, for the ops' fast paths (their kernels check on
    the device): whether the current stream is being captured is asked once, for the mode and the launcher's
    scratch."""
    if _MODE == "off" or _TRUSTED.get():
        return None, t.is_cuda and torch.cuda.is_current_stream_capturing()
    if t.is_cuda:
        capturing = torch.cuda.is_current_stream_capturing()
        return (None if capturing else DEVICE if _MODE == "device" else HOST), capturing
    return value_check_mode(t, True), False


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_range(name: str, t: torch.Tensor, lo: int | None, hi: int | None, what: str = "values") -> None:
    """Raise ValueError unless every element lies in [lo, hi] (inclusive); skipped when value checks are off.
    Reads ``t`` on the host (a sync on CUDA)."""
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
    (two rows for one slot would leave whichever the scatter happened to store last). On the host."""
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
    torch does), and ``bound`` for those whose intermediates would overflow to inf. On the host."""
    if t.numel() == 0 or not value_checks_enabled(t):
        return
    if t.dtype == torch.float8_e4m3fn:
        if bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
            fail(name, "finite values", E4M3_NAN)
        return
    amax = float(t.detach().abs().amax())  # NaN if any element is NaN
    if not amax <= (float("inf") if bound is None else bound) or amax == float("inf"):
        fail(name, finite_text(bound), f"max |value| {amax}")


E4M3_NAN = "an e4m3 NaN code (0x7F / 0xFF)"


def finite_text(bound: float | None) -> str:
    return "finite values" if bound is None else f"finite values with |values| <= {bound:g}"


# ---- deferred errors of the device checks ---------------------------------------------------------------
# A check kernel that finds a bad value stores one int64 word into a host-mapped (pinned) buffer:
# ``code << 32 | (value & 0xFFFFFFFF)``. A single 8-byte store, so a word is never torn; when several
# programs fail, one of their words survives. ``code`` indexes _CODES (argument, expectation, op).

_CODES: list[tuple[str, str, str, str | None]] = [("", "", "", None)]  # code 0: no error
_CODE_OF: dict[tuple, int] = {}
_FLAGS: dict[str, torch.Tensor] = {}  # "cuda" (pinned, mapped into every device) / "cpu" (interpreter)
_VIEWS: list = []  # numpy views of the flags: the host reads them without touching the device


def error_code(op: str, name: str, expected: str, got: str | None = None) -> int:
    """The code a check kernel stores for "``name``: expected ``expected``, got <the value>" (``got``: a
    fixed text instead of the value, e.g. for NaN), found by ``op``."""
    key = (name, expected, op, got)
    code = _CODE_OF.get(key)
    if code is None:
        code = _CODE_OF[key] = len(_CODES)
        _CODES.append(key)
    return code


def error_word(code: int) -> int:
    """The int64 a check kernel stores for ``code``; it ORs the offending value's low 32 bits in."""
    return code << 32


_CUDA: dict = {}


def is_cuda(device: torch.device) -> bool:
    """``device.type == "cuda"``, remembered per device: the attribute builds a new string on every read
    (0.3 us), and every op call asks a few times."""
    cuda = _CUDA.get(device)
    if cuda is None:
        cuda = _CUDA[device] = device.type == "cuda"
    return cuda


def error_flag(device: torch.device) -> torch.Tensor:
    """The ``[1] int64`` error word the device checks of ``device`` write: pinned host memory for CUDA
    (a kernel stores into it directly; the host reads it without a sync), a CPU tensor in the interpreter."""
    kind = "cuda" if is_cuda(device) else "cpu"
    flag = _FLAGS.get(kind)
    if flag is None:
        flag = torch.zeros(1, dtype=torch.int64, pin_memory=kind == "cuda")
        _FLAGS[kind] = flag
        _VIEWS.append(flag.numpy())
    return flag


def raise_deferred() -> None:
    """Raise the ValueError a device check recorded (and clear it); nothing when none did. Host memory
    only: the error appears once the check kernel has run (after a sync, or some later call)."""
    for view in _VIEWS:
        if view[0]:
            word = int(view[0])
            view[0] = 0
            code, value = word >> 32, word & 0xFFFFFFFF
            value = value - (1 << 32) if value >= 1 << 31 else value
            name, expected, op, got = _CODES[code] if 0 < code < len(_CODES) else ("?", "?", "?", None)
            raise ValueError(f"{name}: expected {expected}, got {value if got is None else got} (found by the "
                             f"device check of an earlier {op} call, whose output is invalid)")


def check_errors(sync: bool = True) -> None:
    """Raise the deferred ValueError of a device value check, if any (``sync``: after waiting for the
    current device's work, so every check launched so far has run). Call it where a bad input must
    surface at a known point, e.g. after a step; any later flashdsa op raises it too."""
    if sync and "cuda" in _FLAGS and torch.cuda.is_available():
        torch.cuda.synchronize()
    raise_deferred()
