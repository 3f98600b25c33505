"""Shared by the benchmark scripts alone: peer loading that prints why a peer is absent, the scripts'
timing call (a wall-clock stand-in in their CPU smoke runs), the result table and JSON. Comparisons,
inputs, peer calls and GPU timing come from flashdsa.testing, as in the tests and ``flashdsa bench``.

Peers (DeepGEMM, FlashMLA / sgl-kernel fast_topk) are optional: a script skips a peer that does not
import. Install them with `pip install sgl-deep-gemm sglang-kernel` (versions matching your torch), or
put their wheels and the sgl-kernel libraries (flashmla_ops.abi3.so, common_ops.abi3.so) under .anchors/
and .anchors/sglk/ in the repository root (or name their folder in $FLASHDSA_SGL_KERNEL_LIBS).
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

from flashdsa.testing.peers import import_deep_gemm, load_sgl_kernel  # noqa: E402
from flashdsa.testing.timing import time_us  # noqa: E402

SGL_LIBS = ROOT / ".anchors" / "sglk"


def load_deep_gemm():
    """The deep_gemm module, or None (and a line saying why)."""
    dg, why = import_deep_gemm()
    if dg is None:
        print(f"[peer] {why}")
    return dg


def load_sgl_ops() -> bool:
    """Load sgl-kernel's ops (FlashMLA sparse decode / prefill, fast_topk) into torch.ops.sgl_kernel from
    .anchors/sglk/ when it exists, else as flashdsa.testing.peers.load_sgl_kernel does; False (and a line
    per failure) if any library failed."""
    _, errors = load_sgl_kernel(str(SGL_LIBS) if SGL_LIBS.is_dir() else None)
    for e in errors:
        print(f"[peer] {e}")
    return not errors


def timed(fn, dev: str, graph: bool = False, **kw) -> float:
    """Median µs of ``fn`` on a GPU (flashdsa.testing.timing.time_us; ``kw``: its ``warmup_ms`` / ``rep_ms``),
    a CUDA-graph replay of one call with ``graph``. With ``dev`` "cpu" (the scripts' smoke runs under the
    interpreter) the wall time of one call, which means nothing."""
    if dev != "cuda":
        t = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t)
    return time_us(fn, graph, **kw)


def peer_selection_us(q, cache, w, lens, bt, max_len: int, x, k: int, status: dict, topk: bool = True) -> dict:
    """The peers' decode selection on our inputs (``ops.indexer_logits_paged``'s arguments; ``x`` our logits of
    them), µs of graph replay: ``peer_logits`` (DeepGEMM's paged logits), with ``topk`` also ``peer_topk``
    (sgl-kernel's fast_topk_transform_fused on ``x``) and ``peer_chain`` (the two in a row); what does not import
    is left out."""
    from flashdsa.bench.checks import _deepgemm_paged, _token_table
    from flashdsa.testing import peers
    out, dg = {}, None
    if status.get("DeepGEMM", {}).get("ok"):
        dg = _deepgemm_paged(q, cache, w, lens, bt, max_len, lambda: x)()[0]
        out["peer_logits"] = time_us(dg)
    if topk and status.get("fast_topk_transform_fused", {}).get("ok"):
        ptopk = peers.fast_topk_transform_fused(lens.view(-1).contiguous(), _token_table(bt, max_len), k)
        out["peer_topk"] = time_us(lambda: ptopk(x))
        if dg is not None:
            out["peer_chain"] = time_us(lambda: ptopk(dg()))
    return out


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
