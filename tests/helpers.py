"""Numerical checks used across the tests, in the order FlashMLA / DeepGEMM check: the positions of
inf / -inf / NaN first, then an elementwise tolerance, then a cosine-style diff; a failure names the
worst element."""

from __future__ import annotations

import torch


def poison(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN (or 0x7F bytes for integer dtypes) so unwritten elements fail."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).max, dtype=dtype, device=device)


def poison_torch_empty(monkeypatch) -> None:
    """Make every ``torch.empty`` an op allocates start as NaN (0x7F.. for ints), so an unwritten element
    fails. For an autouse fixture of a test module: ``poison_torch_empty(monkeypatch)``."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)
        return t

    monkeypatch.setattr(torch, "empty", empty)


def cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``1 - 2ab / (a² + b²)`` over the finite elements, in float64 (0 = identical)."""
    a, b = a.double(), b.double()
    m = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[m], b[m]
    denom = (a * a + b * b).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (a * b).sum() / denom)


def assert_close(out: torch.Tensor, ref: torch.Tensor, *, atol: float, rtol: float = 0.0,
                 max_cos_diff: float | None = None, name: str = "out") -> None:
    """Same shape; identical inf/-inf/NaN pattern; |out - ref| <= atol + rtol |ref| elsewhere; cosine diff."""
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
