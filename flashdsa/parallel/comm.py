"""The process group flashdsa's parallel modes talk over, and the two collectives they use.

Everything goes through ``torch.distributed``: NCCL between GPUs, gloo between CPU processes. The group
has a timeout, and every collective turns a failure (a peer that crashed closes its sockets; one that
hangs runs into the timeout) into a :class:`ParallelError` that names this rank and what it was
gathering, so a rank that fails makes every rank stop with a clear error instead of waiting forever.

Tensors of any dtype travel as bytes: several per-token tensors are packed into one ``[n, W] uint8``
row per token (:func:`pack_rows`) and moved in ONE all-gather, which works for fp8 on any backend.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
# newer torch names it all_gather_single (and deprecates the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ParallelError(RuntimeError):
    """A collective failed: another rank failed, or did not arrive within the group's timeout."""


@dataclass(frozen=True)
class Comm:
    """A process group (None: the default one) and the device its tensors live on (NCCL: this rank's GPU).

    ``timeout_s`` is the group's timeout (for the error messages; set it in :func:`init`).
    """

    device: torch.device
    group: dist.ProcessGroup | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def _failed(self, what: str, e: BaseException) -> ParallelError:
        return ParallelError(f"rank {self.rank} of {self.world}: the all-gather of {what} failed ({e}); this is "
                             f"where a rank that failed, or did not arrive within the {self.timeout_s:g} s timeout, "
                             f"stops the others")

    def all_gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """``x [n, ...]`` of equal shape on every rank -> ``[world, n, ...]`` in rank order."""
        x = x.contiguous()
        out = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        try:
            _all_gather(out, x, group=self.group)  # the concatenated form (gloo takes no other for N-D)
        except Exception as e:  # noqa: BLE001 (backends raise RuntimeError, DistBackendError, ...)
            raise self._failed(what, e) from e
        return out.view(self.world, *x.shape)

    def all_gather_object(self, obj, what: str) -> list:
        """A small picklable object from every rank, in rank order (host-side agreement, not data)."""
        out = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:  # noqa: BLE001
            raise self._failed(what, e) from e
        return out


def init(device: str | torch.device = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> Comm:
    """Join the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``) and return its :class:`Comm`.

    ``device``: "cpu" (gloo) or "cuda" (NCCL on ``cuda:LOCAL_RANK``; "cuda:N" is taken as is). Raises
    ValueError naming ``device`` when torchrun's variables are missing or the GPU does not exist.
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):  # torch's own message does not name the argument
        raise ValueError(f"device: expected 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from None
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing and not dist.is_initialized():
        raise ValueError(f"device: context parallelism runs one process per rank under torchrun "
                         f"(torchrun --nproc-per-node P -m flashdsa ...); {', '.join(missing)} not set")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device} requested but torch sees "
                             f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s)")
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ValueError(f"device: expected 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device}")
    if not dist.is_initialized():
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return Comm(device, None, timeout_s)


def pack_rows(*parts: torch.Tensor) -> torch.Tensor:
    """Tensors with the same first dim n (any dtypes, e.g. bf16 [n, 576], fp8 [n, 128], f32 [n]) -> their
    bytes side by side, ``[n, W] uint8``; :func:`unpack_rows` takes them apart."""
    n = parts[0].shape[0]
    return torch.cat([p.contiguous().view(n, math.prod(p.shape[1:])).view(torch.uint8) for p in parts], dim=1)


def unpack_rows(rows: torch.Tensor, like: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """``rows [n, W] uint8`` -> one tensor per ``(dtype, shape without the first dim)`` of ``like``."""
    n, out, col = rows.shape[0], [], 0
    for dtype, shape in like:
        width = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append(rows[:, col:col + width].contiguous().view(dtype).view(n, *shape))
        col += width
    if col != rows.shape[1]:
        raise ValueError(f"like: expected {rows.shape[1]} bytes per row, the parts add up to {col}")
    return out


def layout(*parts: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The ``like`` of :func:`unpack_rows` for these tensors."""
    return [(p.dtype, tuple(p.shape[1:])) for p in parts]
