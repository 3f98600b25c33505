"""Shared by the benchmark scripts: loading the peer kernels, timing, the result table.

Peers (DeepGEMM, FlashMLA / sgl-kernel fast_topk) are optional: a script skips a peer that does not
import. Install them with `pip install sgl-deep-gemm sglang-kernel` (versions matching your torch), or
put their wheels and the two sgl-kernel libraries (flashmla_ops.abi3.so, common_ops.abi3.so) under
.anchors/ and .anchors/sglk/ in the repository root.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashdsa.bench import capture_graph, cos_diff, time_us  # noqa: E402,F401 (shared with `flashdsa bench`)


def load_deep_gemm():
    try:
        import deep_gemm  # noqa: F401
        return deep_gemm
    except Exception as e:  # noqa: BLE001 - any import failure means "peer absent"
        print(f"[peer] deep_gemm unavailable: {e!r}")
        return None


def load_sgl_ops() -> bool:
    """Load FlashMLA sparse ops and fast_topk into torch.ops.sgl_kernel; False if absent."""
    ok = True
    for name in ("flashmla_ops.abi3.so", "common_ops.abi3.so"):
        path = ROOT / ".anchors" / "sglk" / name
        try:
            if path.exists():
                torch.ops.load_library(str(path))
            else:
                import sgl_kernel  # noqa: F401
        except Exception as e:  # noqa: BLE001
            print(f"[peer] {name} unavailable: {e!r}")
            ok = False
    return ok


def bench(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median time of fn in microseconds (CUDA events via triton.testing.do_bench)."""
    import triton.testing
    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def timed(fn, dev: str, graph: bool = False, **kw) -> float:
    """Median µs of ``fn`` on a GPU: :func:`bench` (``kw``: its warm-up / repeat times), or with ``graph`` a
    CUDA-graph replay of one call (the plain call if capture fails). With ``dev`` "cpu" (the scripts'
    smoke runs under the interpreter) the wall time of one call, which means nothing."""
    if dev != "cuda":
        t = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t)
    return time_us(fn, graph) if graph else bench(fn, **kw)




def print_table(rows: list[dict], title: str) -> None:
    """One line per row, columns in first-seen order."""
    if not rows:
        print(f"== {title}: no rows")
        return
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    widths = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols}
    print(f"== {title}")
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print(" | ".join(fmt(r.get(c, "")).ljust(widths[c]) for c in cols))


def write_json(rows: list[dict], name: str, path: str | None = None) -> None:
    out = path or (os.path.join(os.environ["OUT"], f"{name}.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
