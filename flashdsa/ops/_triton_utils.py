"""Small facts every Triton launcher needs."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def upcast_bf16() -> bool:
    """Kernels upcast bf16 dot operands to fp32 under this constexpr flag: the interpreter's tl.dot on
    bf16 returns garbage (fp8 / fp16 / fp32 dots are right). Compiled kernels keep bf16 tensor cores."""
    return interpreting()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Host-side integer helpers. triton.cdiv / triton.next_power_of_2 are @jit functions: called from Python
# they cost ~2 us each, and a decode step's launchers call them dozens of times.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def prev_pow2(x: int) -> int:
    """The largest power of two <= x (1 for x <= 1)."""
    return 1 << max(0, int(x).bit_length() - 1)
