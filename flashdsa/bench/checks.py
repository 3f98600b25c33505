"""What a case hands the runner (:class:`Bench`), how its answers are judged, and the peers' calls as
Bench factories.

Before timing, ours is compared with the torch reference (``backend="torch"``) on the same inputs (a
subsample of rows for big shapes): logits need the same -inf pattern and cosine diff <= 1e-6, top-k the
same bits, attention cosine diff <= 1e-5 and |lse diff| <= 1e-3. Peers are compared with ours too
(information, never a failure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flashdsa.testing import peers
from flashdsa.testing.compare import cos_diff, masked_cos_diff, topk_tie_safe
from flashdsa.testing.inputs import rows_subset

LOGITS_COS, ATTN_COS, LSE_ABS = 1e-6, 1e-5, 1e-3  # ours vs the torch reference (see the module docstring)


@dataclass
class Bench:
    """``ours``: the call to time. ``check``: ours vs the torch reference -> ``{"ok", "summary", ...}``.
    ``peers``: name -> a factory returning ``(call to time, its check dict)`` (run only when timing).
    ``bytes`` / ``flops``: valid work, for GB/s, TFLOP/s and the roofline; ``dtype``: the matmul rate
    that bounds it ("fp8" / "bf16", None = memory only). ``graph`` / ``memory``: see the fields."""
    ours: Callable[[], Any]
    check: Callable[[], dict]
    peers: dict[str, Callable[[], tuple[Callable[[], Any], dict]]] = field(default_factory=dict)
    bytes: float = 0.0
    flops: float = 0.0
    dtype: str | None = None
    parts: tuple["Bench", ...] = ()  # a composite (the layer step): its roofline is the sum of its parts'
    graph: bool = True   # timed as a CUDA-graph replay (False: plain calls, e.g. prefill's host-read row bounds)
    memory: bool = False  # also measure the extra peak memory of one call (ours and each peer's)


def _check_logits(out: torch.Tensor, ref: torch.Tensor) -> dict:
    same_inf = bool(torch.equal(torch.isneginf(out), torch.isneginf(ref)) and not torch.isnan(out).any())
    cd = cos_diff(out, ref)
    return {"ok": same_inf and cd <= LOGITS_COS, "inf_pattern": same_inf, "cos_diff": cd,
            "summary": f"cos {cd:.1e}" + ("" if same_inf else ", -inf pattern differs")}


def _check_same(out: torch.Tensor, ref: torch.Tensor) -> dict:
    same = bool(torch.equal(out, ref))
    return {"ok": same, "same_bits": same, "summary": "same bits" if same else "selections differ"}


def _check_attention(out, lse, ref_out, ref_lse) -> dict:
    cd = cos_diff(out.float(), ref_out.float())
    same_inf = bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)))
    fin = torch.isfinite(ref_lse)
    lerr = float((lse - ref_lse)[fin].abs().max()) if fin.any() else 0.0
    ok = same_inf and cd <= ATTN_COS and lerr <= LSE_ABS and not bool(torch.isnan(out).any())
    return {"ok": ok, "cos_diff": cd, "lse_max_abs": lerr, "summary": f"cos {cd:.1e}, lse {lerr:.1e}"}


def _masked_cos(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> dict:
    cd = masked_cos_diff(a, b, valid)
    return {"cos_diff_vs_ours": cd, "summary": f"cos {cd:.1e} vs ours"}


def _topk_exact(x: torch.Tensor, lengths: torch.Tensor, idx: torch.Tensor, k: int) -> dict:
    """A peer's picks, tie-safely (compare.topk_tie_safe): exact whatever its tie rule."""
    exact = topk_tie_safe(x, lengths, idx, k)[0]
    return {"exact": exact, "summary": "exact" if exact else "NOT exact"}


# ---- peers: the Bench factories of the calls in flashdsa.testing.peers -------------------------------

def _deepgemm_paged(q_fp8, cache, w, lens, bt, max_len, ours):
    """DeepGEMM's paged logits over our pages; schedule made once, untimed."""
    def make():
        fn = peers.deepgemm_paged(q_fp8, cache, w, lens, bt, max_len)
        # DeepGEMM leaves garbage past each row's length: compare inside the lengths only
        valid = torch.arange(max_len, device=lens.device)[None, :] < lens.reshape(-1, 1)
        return fn, _masked_cos(ours(), fn(), valid)
    return make


def _token_table(block_table: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[B, max_len] int32``: the slot of each position through ``block_table`` (SGLang's page table of page
    size 1, what fast_topk_transform_fused translates through)."""
    j = torch.arange(max_len, device=block_table.device)
    return (block_table.long()[:, j // 64] * 64 + j % 64).to(torch.int32).contiguous()


def _same_slot_sets(theirs: torch.Tensor, mine: torch.Tensor) -> dict:
    """A peer's translated top-k against ours, as sets a row (its order within a row is its own)."""
    a, b = theirs.reshape(mine.shape).sort(dim=-1).values, mine.sort(dim=-1).values
    same = (a == b).all(dim=-1).float().mean()
    return {"summary": f"same slots (as sets) in {same:.1%} of rows"}


def _flashmla_decode(q, cache, idx, sm_scale, seqlens, ours):
    """FlashMLA's sparse decode over our 656-B pages; where ``q`` carries padding heads past ours' (zeros, as
    engines pad a tensor-parallel shard to FlashMLA's 64), only ours' heads are compared."""
    def make():
        fn = peers.flashmla_decode(q, cache, idx, sm_scale, seqlens)
        out = ours()[0]
        theirs = fn()[0][..., :out.shape[-2], :]
        return fn, _masked_cos(out.float(), theirs, torch.ones_like(out, dtype=torch.bool))
    return make


def _topk_peers(x, lengths, k, status) -> dict:
    out = {}
    if status["fast_topk"]["ok"] and k == 2048:
        def make_fast():
            fn, picks = peers.fast_topk(x, lengths, k)
            fn()
            sub = rows_subset(x.shape[0], 64, x.device)
            return fn, _topk_exact(x[sub], lengths[sub], picks[sub], k)
        out["fast_topk"] = make_fast
    out["torch.topk"] = lambda: ((lambda: torch.topk(x, k, dim=1)), {})  # exact by construction, untranslated
    return out
