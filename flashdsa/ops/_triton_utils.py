"""Small facts every Triton launcher needs."""

from __future__ import annotations

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
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
