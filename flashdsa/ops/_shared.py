"""What every layer of ``flashdsa.ops`` shares and that imports nothing of it: the int32 bound of the kernels'
indices and the bounded per-shape host caches. The checks (``_common``), the launch plans (``_launch``) and the
device checks (``_device_checks``) all import it, so none of them needs another."""

from __future__ import annotations

INT32_MAX = 2 ** 31 - 1


def remember(cache: dict, key, value, cap: int):
    """``cache[key] = value`` with at most ``cap`` entries (the oldest goes first); returns ``value``. The host
    paths' per-shape caches: a decode loop has a handful of keys, so the bound only stops a runaway."""
    if len(cache) >= cap:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value
