"""The engine's promises the demo checks, each by comparing the logits of two runs of the same tokens:

    dense_equivalence      sparse path vs dense fallback where every context <= index_topk
                           (n/a for the fp8_raw cache, which never takes the dense path)
    chunked_vs_oneshot     the long prompt in chunks vs in one extend (both sparse)
    verify_vs_decode       next_n drafts verified at once vs n sequential decodes
    skip_layers_reuse      skip-top-k layers use the previous layer's selection as is
                           (n/a for a model without skip-top-k layers)
    offload (--offload)    the scenario served with the MLA cache in host memory (flashdsa.cache.offload)
                           vs the same scenario all on the device: bitwise the same logits

With ``kpool`` the long prompt's chunks split pooled groups, so chunked_vs_oneshot also checks a group
written across two chunks. A check that does not apply is reported as None (JSON null, "n/a" in the text),
never as a number.

Each check takes ``runner``, which makes a fresh :class:`~flashdsa.engine.Runner` on the demo's model.
Prefills go one request per extend, and comparisons run over row blocks, so the [rows, vocab] logits held
at once stay those of one prompt (the memory estimate counts them so).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from flashdsa.config import DSAConfig
from flashdsa.engine import Runner

# The checks compare logits of two runs that differ only in how the work was batched. Both sides
# round in bf16, and on a GPU cuBLAS picks other GEMM algorithms for other row counts, so the bits
# differ; random weights then amplify rounding through the layers (and can flip a top-k boundary).
# A real bug (a chunk not seeing its prefix, a draft seeing its future) moves the logits by O(1), so
# ok is judged on the relative RMS error, with the max abs error (relative to the logits' scale)
# reported beside it. The rounding noise grows about linearly with depth (v32 shapes on an H200:
# 0.26-0.40 % RMS after 1 layer, 0.8 % after 2, 1.5-2.0 % after 4), hence a budget per layer.
TOL_RMS_PER_LAYER = 6e-3


class _Diff:
    """Relative RMS (``|a - b| / |b|``) and max abs error (``max |a - b| / max(max |b|, 1)``) of ``a`` vs
    ``b``, accumulated over row blocks so [rows, vocab] logits never get full-size temporaries."""

    def __init__(self) -> None:
        self.err_sq = self.ref_sq = self.err_max = self.ref_max = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor, block: int = 256) -> "_Diff":
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        for i in range(0, a.shape[0], block):
            d = a[i:i + block].double() - b[i:i + block].double()
            ref = b[i:i + block].double()
            self.err_sq += float(d.square().sum())
            self.ref_sq += float(ref.square().sum())
            self.err_max = max(self.err_max, float(d.abs().max()))
            self.ref_max = max(self.ref_max, float(ref.abs().max()))
        return self

    @property
    def rel_rms(self) -> float:
        return math.sqrt(self.err_sq) / max(math.sqrt(self.ref_sq), 1e-30)

    @property
    def rel_max_abs(self) -> float:
        return self.err_max / max(self.ref_max, 1.0)


def _fmt_check(diff: _Diff | None, why: str = "") -> str:
    return f"n/a ({why})" if diff is None else f"{diff.rel_rms:.2e} | {diff.rel_max_abs:.2e}"


class _Lockstep:
    """Stands in for a Runner in the serving scenario: every call runs on both runners, returns the first
    one's logits, and ``diff`` keeps how far the second one's are from them."""

    def __init__(self, first: Runner, second: Runner):
        self.first, self.second, self.diff = first, second, _Diff()

    def __getattr__(self, name: str):
        a, b = getattr(self.first, name), getattr(self.second, name)

        def both(*args, **kw):
            out = a(*args, **kw)
            self.diff.add(b(*args, **kw), out)
            return out
        return both


# ---- the checks --------------------------------------------------------------------------------------

def verify_vs_decode(runner: Callable[..., Runner], prompts: dict, drafts: dict, next_n: int) -> _Diff:
    """The drafts verified in one step vs decoded one by one, after the same prefills."""
    ref, verify_ref = runner(), runner()
    for r, p in prompts.items():
        ref.extend({r: p}, force_sparse=True)
        verify_ref.extend({r: p}, force_sparse=True)
    v = verify_ref.verify(drafts)
    d = torch.stack([ref.decode({r: drafts[r][j] for r in prompts}) for j in range(next_n)], dim=1)
    return _Diff().add(v, d)


def chunked_vs_oneshot(runner: Callable[..., Runner], long: torch.Tensor, cuts: list[int]) -> _Diff:
    """The long prompt in the scenario's three chunks vs in one extend, both sparse."""
    one = runner().extend({"long": long}, force_sparse=True)
    chunked, chunk = runner(), _Diff()
    for i in range(3):
        chunk.add(chunked.extend({"long": long[cuts[i]:cuts[i + 1]]}, force_sparse=True), one[cuts[i]:cuts[i + 1]])
    return chunk


def dense_equivalence(runner: Callable[..., Runner], prompts: dict) -> tuple[_Diff, bool]:
    """The prompts that fit top-k, sparse vs the dense fallback; and whether the fallback ran."""
    fit = {r: prompts[r] for r in ("short", "at_topk")}
    dense_run = runner(record=True)
    dense_logits = dense_run.extend(fit)
    ran = all(s is None for s in dense_run.selections.values())  # the dense path selects nothing
    return _Diff().add(runner().extend(fit, force_sparse=True), dense_logits), ran


def skip_layers_reuse(run: Runner, cfg: DSAConfig) -> bool | None:
    """Whether each skip-top-k layer of a recording runner reused the previous selection object and holds no
    index cache; None without such layers."""
    if not cfg.skip_topk_layers:
        return None
    return all(run.selections[layer] is run.selections[layer - 1] and not run.pool.has_index_cache(layer)
               for layer in cfg.skip_topk_layers)


def offload_vs_on_device(runner: Callable[..., Runner], off_cfg, serve: Callable) -> _Diff:
    """The scenario served (``serve``) with host offload and all on the device, in lockstep."""
    # The reference takes the sparse path everywhere too (the dense fallback is off with offload), so
    # the two runs do the same math on the same bytes and must agree bit for bit.
    both = _Lockstep(runner(dense_threshold=0), runner(off_cfg))
    serve(both, lambda _name, fn: fn(), lambda *_: None)
    return both.diff
