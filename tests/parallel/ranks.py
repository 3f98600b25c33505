"""Run a function on p gloo processes (CPU) and collect what each rank returns or raises.

``run_ranks(fn, world, *args)`` spawns ``world`` processes; rank r calls ``fn(comm, *args)`` after joining
a gloo group (``timeout_s``), and its return value (anything ``torch.save`` takes) or its error
message comes back. The parent never waits longer than ``deadline_s``: a rank still running then is
killed and reported as a hang, so a test can fail but never hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback

import torch

GROUP_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world: int, port: int, out_dir: str, timeout_s: float, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # p processes share the machine's cores
    result = None
    try:
        from flashdsa.parallel import init

        comm = init("cpu", timeout_s=timeout_s)
        result = {"ok": fn(comm, *args)}
    except BaseException as e:  # noqa: BLE001 (reported to the parent)
        result = {"error": f"{type(e).__name__}: {e}", "type": type(e).__name__,
                  "traceback": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    # no destroy_process_group: after a failure it could wait for ranks that are gone
    os._exit(0)


def run_ranks(fn, world: int, *args, deadline_s: float = 240.0, timeout_s: float = GROUP_TIMEOUT_S) -> list[dict]:
    """``[{"ok": value} | {"error": message, "type": name, "traceback": text}]`` per rank."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_child, args=(fn, r, world, port, out_dir, timeout_s, args), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        assert not hung, f"ranks {hung} still running after {deadline_s} s: a hang"
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pt")
            assert os.path.exists(path), f"rank {r} died without a result (exit code {procs[r].exitcode})"
            results.append(torch.load(path, weights_only=False))
        return results
