"""Indexer numerics (flashdsa.quant) against independent formulations: the act_quant scale rule and
ue8m0 rounding exactly at and around powers of two, e4m3 rounding via an enumerated grid, clamping,
round-trip bounds, the block layout of scales; Hadamard vs an explicit Sylvester matrix; indexer RoPE vs
a hand-written complex rotation."""

from __future__ import annotations

import cmath
import math

import pytest
import torch

from flashdsa.quant import (FP8, act_dequant, act_quant, apply_rope, hadamard, hadamard_matrix, indexer_rope,
                            rope_cos_sin, round_scale_ue8m0)


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32."""
    return torch.tensor(x, dtype=torch.float32).item()


def _next_up(x: float) -> float:
    return torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(math.inf)).item()


def _next_down(x: float) -> float:
    return torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(-math.inf)).item()


def _pow2_ceil(s: float) -> float:
    """Smallest power of two >= s, by search (no log2)."""
    p = 2.0 ** -150
    while p < s:
        p *= 2.0
    return p


# e4m3fn grid: every finite code, and the code's parity (round-half-to-even picks the even code).
_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_VALS = _CODES.view(FP8).double()
_FINITE = ~torch.isnan(_VALS)
_GRID = _VALS[_FINITE]
_GRID_EVEN = (_CODES[_FINITE].int() % 2 == 0)


def _e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3fn grid (values already inside ±448), float64."""
    v = v.double().flatten()
    d = (v[:, None] - _GRID[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = d == best
    # On a tie prefer the even code; the two candidates of a tie are adjacent codes (one even, one odd).
    even = cand & _GRID_EVEN[None, :]
    choose = torch.where(even.any(dim=1, keepdim=True), even, cand)
    idx = choose.int().argmax(dim=1)
    out = _GRID[idx]
    # +0.0 and -0.0 are both on the grid; map a zero to +0.0 vs -0.0 by the input's sign like IEEE.
    return torch.where(out == 0, torch.copysign(torch.zeros_like(out), v), out)


# ---- scale rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [-20, -13, -9, -1, 0, 1, 5, 20])
def test_ue8m0_at_and_around_powers_of_two(k):
    p = 2.0 ** k
    # exactly a power of two stays; one ulp above doubles; one ulp below stays
    s = torch.tensor([p, _next_up(p), _next_down(p), p * 1.5, p * 0.75], dtype=torch.float32)
    got = round_scale_ue8m0(s).tolist()
    assert got == [p, 2 * p, p, 2 * p, p]


def test_ue8m0_random_matches_search():
    s = torch.exp(torch.empty(2000).uniform_(-25, 10)).float()
    got = round_scale_ue8m0(s)
    want = torch.tensor([_pow2_ceil(v) for v in s.tolist()], dtype=torch.float32)
    assert torch.equal(got, want)
    assert (got >= s).all() and (got < 2 * s).all()


@pytest.mark.parametrize("k", [-12, -3, 0, 4])
def test_act_quant_scale_at_power_of_two_amax(k):
    # amax = 448 * 2^k -> amax / 448 is exactly 2^k: ue8m0 keeps it, one ulp more of amax doubles it.
    amax = 448.0 * 2.0 ** k
    x = torch.randn(3, 128).clamp(-1, 1) * amax * 0.5
    x[0, 17] = amax
    x[1, 5] = -_next_up(amax)
    x[2, 99] = _next_down(amax)
    _, s = act_quant(x)
    assert s.dtype == torch.float32 and s.shape == (3, 1)
    assert s[:, 0].tolist() == [2.0 ** k, 2.0 ** (k + 1), 2.0 ** k]
    _, s_plain = act_quant(x, ue8m0=False)
    assert s_plain[:, 0].tolist() == [_f32(amax / 448), _f32(_next_up(amax) / 448), _f32(_next_down(amax) / 448)]


@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("shape,block", [((5, 256), 128), ((2, 3, 128), 128), ((4, 96), 32), ((7, 64), 64),
                                         ((1, 128), 128)], ids=["5x256", "2x3x128", "b32", "b64", "1x128"])
def test_act_quant_scale_rule_and_values(shape, block, ue8m0):
    x = torch.randn(*shape) * torch.exp(torch.randn(*shape[:-1], 1) * 3)
    q, s = act_quant(x, block=block, ue8m0=ue8m0)
    nb = shape[-1] // block
    assert q.dtype == FP8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (*shape[:-1], nb)
    xf = x.reshape(-1, nb, block)
    qf = q.float().reshape(-1, nb, block)
    sf = s.reshape(-1, nb)
    for r in range(xf.shape[0]):
        for j in range(nb):
            blk = xf[r, j].tolist()
            amax = max(max(abs(v) for v in blk), 1e-4)
            want = _f32(_f32(amax) / 448.0)
            if ue8m0:
                want = _pow2_ceil(want)
            assert sf[r, j].item() == want, (r, j)
            # each element: e4m3 round-to-nearest-even of clamp(x / s), x / s computed in fp32
            v = (xf[r, j] / sf[r, j]).clamp(-448, 448)
            assert torch.equal(qf[r, j].double(), _e4m3_round(v)), (r, j)


def test_act_quant_scale_block_layout():
    # Each block gets its own amax, so scale[..., j] must come from dims j*128 .. j*128+127.
    x = torch.rand(2, 3, 512) * 0.5
    for j in range(4):
        x[0, :, j * 128 + 7] = 448.0 * 2.0 ** j
        x[1, :, j * 128 + 100] = -448.0 * 2.0 ** (-j)
    _, s = act_quant(x)
    assert s[0].tolist() == [[1.0, 2.0, 4.0, 8.0]] * 3
    assert s[1].tolist() == [[1.0, 0.5, 0.25, 0.125]] * 3


def test_act_quant_amax_floor_and_zero_block():
    x = torch.zeros(3, 256)
    x[1, :128] = 1e-7  # below the 1e-4 floor
    x[2, 128:] = 3.0
    q, s = act_quant(x, ue8m0=False)
    floor = _f32(_f32(1e-4) / 448.0)
    assert s[0].tolist() == [floor, floor] and s[1].tolist() == [floor, floor]
    assert s[2, 1].item() == _f32(3.0 / 448.0)
    assert torch.isfinite(q.float()).all()
    assert (q.float()[0] == 0).all()
    _, s8 = act_quant(x)
    assert s8[0].tolist() == [_pow2_ceil(floor)] * 2


@pytest.mark.parametrize("ue8m0", [True, False])
def test_act_quant_clamp(ue8m0):
    x = torch.randn(64, 128) * 100
    q, s = act_quant(x, ue8m0=ue8m0)
    qf = q.float()
    assert torch.isfinite(qf).all() and qf.abs().max() <= 448
    if not ue8m0:
        # the largest element maps to ±448 exactly (x / (amax / 448) may round a hair above 448: clamped)
        i = x.abs().argmax(dim=1)
        top = qf.gather(1, i[:, None])[:, 0]
        assert torch.equal(top.abs(), torch.full_like(top, 448.0))
        assert torch.equal(torch.sign(top), torch.sign(x.gather(1, i[:, None])[:, 0]))


def test_act_quant_input_dtypes():
    x = torch.randn(4, 256) * 7
    q32, s32 = act_quant(x)
    qb, sb = act_quant(x.bfloat16())
    q2, s2 = act_quant(x.bfloat16().float())
    assert torch.equal(qb.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(sb, s2)
    qh, sh = act_quant(x.double())
    assert torch.equal(qh.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(sh, s32)


@pytest.mark.parametrize("ue8m0", [True, False])
def test_round_trip_error_bound(ue8m0):
    x = torch.randn(32, 384) * torch.exp(torch.randn(32, 1) * 2)
    q, s = act_quant(x, ue8m0=ue8m0)
    y = act_dequant(q, s)
    assert y.dtype == torch.float32 and y.shape == x.shape
    se = s.repeat_interleave(128, dim=-1)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal spacing 2^-9 -> abs <= 2^-10 * s
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * se
    assert ((y - x).abs() <= bound).all()
    # and dequant is q * s per block (brute force)
    qd, sd = q.float().double(), s.double()
    for j in range(3):
        want = (qd[:, j * 128:(j + 1) * 128] * sd[:, j:j + 1]).float()  # exact in f64, rounded once
        assert torch.equal(y[:, j * 128:(j + 1) * 128], want)


def test_round_trip_exact_for_representable():
    # values that are e4m3 grid points times a power-of-two scale survive exactly
    grid = _GRID[(_GRID.abs() <= 448)].float()
    x = grid[torch.randint(0, grid.numel(), (6, 256))] * 2.0 ** -5
    x[:, 0] = 448 * 2.0 ** -5  # pin amax so the ue8m0 scale is exactly 2^-5
    q, s = act_quant(x)
    assert (s == 2.0 ** -5).all()
    assert torch.equal(act_dequant(q, s), x)


@pytest.mark.parametrize("block", [0, -128, 100, 256])
def test_act_quant_bad_block(block):
    with pytest.raises(ValueError, match="block"):
        act_quant(torch.randn(2, 128), block=block)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.uint8, torch.bool])
def test_act_quant_bad_dtype(dtype):
    with pytest.raises(ValueError, match="x"):
        act_quant(torch.ones(2, 128).to(dtype))


# ---- Hadamard --------------------------------------------------------------------------------------

def _sylvester(n: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j) / sqrt(n), built with Python loops in float64."""
    rows = [[(-1.0) ** bin(i & j).count("1") / math.sqrt(n) for j in range(n)] for i in range(n)]
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_hadamard_matrix_is_sylvester(n):
    H = _sylvester(n)
    assert torch.allclose(hadamard_matrix(n, dtype=torch.float64), H, atol=1e-15, rtol=0)
    assert hadamard_matrix(n).dtype == torch.float32
    assert torch.allclose(H @ H.T, torch.eye(n, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128, 256])
@pytest.mark.parametrize("lead", [(5,), (2, 3), ()], ids=["T5", "T2xH3", "vec"])
def test_hadamard_vs_explicit_matrix(n, lead):
    x = torch.randn(*lead, n)
    H = _sylvester(n)
    y = hadamard(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    want = x.double() @ H
    assert torch.allclose(y.double(), want, atol=1e-5 * math.sqrt(n), rtol=1e-5)


def test_hadamard_dtype_and_orthonormality():
    x = torch.randn(40, 128)
    z = torch.randn(40, 128)
    hx, hz = hadamard(x), hadamard(z)
    assert torch.allclose((hx * hz).sum(-1), (x * z).sum(-1), atol=1e-4, rtol=1e-5)
    assert torch.allclose(hx.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(hadamard(hx), x, atol=1e-5)  # symmetric and orthogonal -> an involution
    xb = x.bfloat16()
    yb = hadamard(xb)
    assert yb.dtype == torch.bfloat16
    want = (xb.double() @ _sylvester(128)).float()
    assert torch.allclose(yb.float(), want, atol=1e-2, rtol=2 ** -8)


@pytest.mark.parametrize("n", [0, 3, 6, 12, 96, 100, 127])
def test_hadamard_not_power_of_two(n):
    with pytest.raises(ValueError, match="x"):
        hadamard(torch.randn(2, n))
    with pytest.raises(ValueError, match="n"):
        hadamard_matrix(n)


def test_hadamard_matrix_negative():
    with pytest.raises(ValueError, match="n"):
        hadamard_matrix(-4)


# ---- indexer RoPE ----------------------------------------------------------------------------------

def _rope_brute(x: torch.Tensor, positions: list[int], rope_dim: int, theta: float, interleave: bool) -> torch.Tensor:
    """x [T, H, D]: rotate the first rope_dim dims of each head as complex numbers, float64 loops."""
    T, H, D = x.shape
    out = x.double().clone()
    half = rope_dim // 2
    for t in range(T):
        for h in range(H):
            for i in range(half):
                a_idx, b_idx = (2 * i, 2 * i + 1) if interleave else (i, i + half)
                z = complex(float(x[t, h, a_idx]), float(x[t, h, b_idx]))
                z *= cmath.exp(1j * positions[t] * theta ** (-2.0 * i / rope_dim))
                out[t, h, a_idx], out[t, h, b_idx] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_indexer_rope_vs_complex_rotation(interleave, theta):
    T, H, D = 6, 3, 128
    positions = [0, 1, 7, 63, 1000, 4095]
    x = torch.randn(T, H, D)
    cos, sin = rope_cos_sin(torch.tensor(positions), 64, theta)
    assert cos.shape == sin.shape == (T, 32) and cos.dtype == torch.float32
    y = indexer_rope(x, cos, sin, interleave)
    assert y.dtype == torch.float32 and y.shape == x.shape
    want = _rope_brute(x, positions, 64, theta, interleave)
    assert torch.allclose(y.double(), want, atol=2e-5, rtol=1e-5)
    # nope dims untouched, bit for bit
    assert torch.equal(y[..., 64:], x[..., 64:])
    # position 0 is the identity
    assert torch.allclose(y[0], x[0], atol=0, rtol=0)


def test_neox_and_interleave_differ():
    x = torch.randn(2, 1, 128)
    cos, sin = rope_cos_sin(torch.tensor([5, 9]), 64)
    a = indexer_rope(x, cos, sin, False)
    b = indexer_rope(x, cos, sin, True)
    assert not torch.allclose(a[..., :64], b[..., :64], atol=1e-3)


def test_rope_cos_sin_values_and_inv_freq():
    pos = torch.tensor([0, 3, 100, 70000])
    cos, sin = rope_cos_sin(pos, 64, 10000.0)
    for t, p in enumerate(pos.tolist()):
        for i in range(32):
            ang = p * 10000.0 ** (-2 * i / 64)
            assert abs(cos[t, i].item() - math.cos(ang)) <= 1e-7
            assert abs(sin[t, i].item() - math.sin(ang)) <= 1e-7
    inv = torch.rand(32, dtype=torch.float64)
    c2, s2 = rope_cos_sin(pos, 64, inv_freq=inv)
    ang = pos.double()[:, None] * inv[None, :]
    assert torch.equal(c2, ang.cos().float()) and torch.equal(s2, ang.sin().float())


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "gptj"])
def test_apply_rope_2d_and_norm_preserving(interleave):
    x = torch.randn(9, 64)
    cos, sin = rope_cos_sin(torch.arange(9) * 37, 64)
    y = apply_rope(x, cos, sin, interleave)
    want = _rope_brute(x[:, None, :], (torch.arange(9) * 37).tolist(), 64, 10000.0, interleave)[:, 0]
    assert torch.allclose(y.double(), want, atol=2e-5)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
