"""Comparisons, in the order FlashMLA / DeepGEMM check: the positions of inf / -inf / NaN first, then an
elementwise tolerance, then a cosine-style diff ``1 - 2ab / (a² + b²)``; a failure names the worst
element. Top-k selections are checked tie-safely: every pick scores at least the row's k-th best score,
whatever rule breaks the ties, so the check holds for any exact top-k (ours, a peer's, torch.topk's).
"""

from __future__ import annotations

import torch


def cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``1 - 2ab / (a² + b²)`` over the elements finite in both, in float64 (0 = identical, 2 = opposite).

    ``a``, ``b``: same shape, any float dtype. Two tensors with no finite nonzero element give 0.
    """
    a, b = a.double(), b.double()
    m = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[m], b[m]
    denom = (a * a + b * b).sum()
    return 0.0 if denom == 0 else float(1 - 2 * (a * b).sum() / denom)


def masked_cos_diff(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> float:
    """:func:`cos_diff` over the elements where ``valid`` (bool, broadcastable to ``a``) holds: for outputs
    only partly defined, e.g. DeepGEMM's logits, garbage past each row's length."""
    return cos_diff(torch.where(valid, a.double(), 0.0), torch.where(valid, b.double(), 0.0))


def assert_close(out: torch.Tensor, ref: torch.Tensor, *, atol: float, rtol: float = 0.0,
                 max_cos_diff: float | None = None, name: str = "out") -> None:
    """Raise AssertionError unless ``out`` matches ``ref``: same shape; the same positions of NaN, +inf and
    -inf; ``|out - ref| <= atol + rtol |ref|`` where ``ref`` is finite; and, if given, ``cos_diff <=
    max_cos_diff``. The message names ``name`` and the first (pattern) or worst (value) element.

    ``out``, ``ref``: any float dtype and device (compared in float64 on the CPU).
    """
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.double().cpu(), ref.double().cpu()
    for what, f in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        mo, mr = f(o), f(r)
        if not torch.equal(mo, mr):
            bad = (mo != mr).nonzero()[0].tolist()
            raise AssertionError(f"{name}: {what} pattern differs, first at {bad}: out={o[tuple(bad)]} ref={r[tuple(bad)]}")
    fin = torch.isfinite(r)
    err = torch.where(fin, (o - r).abs() - rtol * r.abs(), torch.zeros_like(o))
    if err.numel() and float(err.max()) > atol:
        worst = tuple(torch.nonzero(err == err.max())[0].tolist())
        raise AssertionError(f"{name}: |out - ref| exceeds {atol} + {rtol}|ref| at {list(worst)}: "
                             f"out={float(o[worst])} ref={float(r[worst])}")
    if max_cos_diff is not None:
        cd = cos_diff(o, r)
        assert cd <= max_cos_diff, f"{name}: cosine diff {cd:.3e} > {max_cos_diff:.1e}"


def assert_close_to_scale(a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    """``max|a - b| <= tol * max(max|b|, 1)`` (the engine tests' end-to-end bound); returns ``max|a - b|``."""
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= tol * max(scale, 1.0), f"max abs diff {err} (scale {scale})"
    return err


# ---- top-k -----------------------------------------------------------------------------------------

def topk_order_keys(x: torch.Tensor) -> torch.Tensor:
    """``x [...] float32 -> [...] int32`` keys whose signed integer order is topk_transform's score order
    (NaN = -inf, -0.0 = +0.0), built from the bits as the Triton kernel builds them."""
    b = x.contiguous().view(torch.int32)
    b = torch.where(b == -2 ** 31, 0, b)                          # -0.0 -> +0.0
    b = torch.where((b & 0x7FFFFFFF) > 0x7F800000, -8388608, b)   # NaN -> the bits of -inf
    return b ^ ((b >> 31) & 0x7FFFFFFF)                            # negatives: larger magnitude, smaller key


def topk_tie_safe(scores: torch.Tensor, lengths: torch.Tensor, idx: torch.Tensor, k: int, *,
                  ascending: bool = False) -> tuple[bool, float]:
    """Whether ``idx`` is an exact top-k of every row whatever the tie rule, and the worst row's recall.

    ``scores [R, L] float`` (NaN counts as -inf), ``lengths [R] int`` (row r's candidates are
    ``scores[r, :lengths[r]]``), ``idx [R, k] int`` positions, -1 = no pick (padding).
    Exact: each row holds ``min(k, length)`` picks, distinct, every one a candidate (in ``[0, length)``)
    scoring >= the row's k-th largest candidate score; with ``ascending``, also in strictly ascending
    position order (topk_transform's order).
    Recall: the fraction of a row's ``min(k, length)`` picks that are in range and score that high,
    the smallest over the rows (1.0 without rows).
    """
    if scores.dim() != 2 or idx.dim() != 2 or idx.shape[0] != scores.shape[0] or lengths.shape != scores.shape[:1]:
        raise ValueError(f"idx, lengths: expected [R, k] and [R] for scores [R, L], got idx {list(idx.shape)}, "
                         f"lengths {list(lengths.shape)}, scores {list(scores.shape)}")
    R, L = scores.shape
    s = torch.where(torch.isnan(scores), float("-inf"), scores.float())
    s = torch.cat((s, s.new_full((R, 1), float("-inf"))), dim=1)  # column L: what an out-of-range pick reads
    n = lengths.to(s.device).long()[:, None]
    idx = idx.to(s.device).long()
    in_range = (idx >= 0) & (idx < n)
    picks = torch.where(in_range, idx, -1)
    srt = torch.sort(picks, dim=1).values
    distinct = ((srt[:, 1:] != srt[:, :-1]) | (srt[:, 1:] < 0)).all(dim=1)
    need = n[:, 0].clamp(max=k)  # picks a row must hold
    count = (in_range.sum(dim=1) == need) & (in_range | (idx == -1)).all(dim=1)  # no pick outside the row
    cand = torch.where(torch.arange(L + 1, device=s.device)[None, :] < n, s, float("-inf"))
    kth = torch.topk(cand, max(1, min(k, L)), dim=1).values[:, -1:]  # -inf when a row has < k candidates
    good = in_range & (torch.gather(s, 1, torch.where(in_range, idx, L)) >= kth)
    ok = distinct & count & (good | ~in_range).all(dim=1)
    if ascending and idx.shape[1] > 1:  # each pick above every earlier pick (-1 never raises the max)
        ok &= (~in_range[:, 1:] | (picks[:, 1:] > torch.cummax(picks, dim=1).values[:, :-1])).all(dim=1)
    recall = torch.where(need > 0, good.sum(dim=1) / need.clamp(min=1), 1.0)  # nothing to pick: all found
    return bool(ok.all()), float(recall.min()) if R else 1.0
