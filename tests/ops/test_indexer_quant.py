"""indexer_quant: the Triton kernel (the interpreter on CPU) against the torch composition, bit for bit.

Inputs are [T, H, 128] queries and [T, 128] keys, T in {0, 1, 5, 64, 65}, H in {1, 3, 64}, bf16 and fp32,
NeoX and GPT-J pairs, with rows of mixed kinds: plain N(0, 1), tiny (amax under the 1e-4 floor), huge
(1e30), a wide log-normal spread, exact powers of two, and two-dim spikes tuned so that amax is exactly
448 * 2^k (the scale's power-of-two branch, where an inexact amax / 448 would round up a power too far).
Outputs are poisoned (NaN bytes) so an unwritten element fails. The kernel's integer bf16 / e4m3
rounding (used by the interpreter, whose casts truncate) is checked against torch's casts on every e4m3
tie and its neighbours. GPU-only: bigger shapes, the hardware casts and other launch configs.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import flashdsa.layers.indexer as indexer_layer
from flashdsa import ops
from flashdsa.config import DSAConfig
from flashdsa.layers import Indexer
from flashdsa.ops.indexer_quant import indexer_quant_weights, reference
from flashdsa.ops.indexer_quant import triton as K
from flashdsa.quant import FP8, act_quant, hadamard, indexer_rope, rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
FP8_NAN = 0x7F


def _spike(k: int, dtype: torch.dtype) -> tuple[float, float] | None:
    """Two values (w, v) of ``dtype`` such that a row that is w and v at two neighbouring dims (zeros
    elsewhere) has Hadamard amax exactly 448 * 2^k: every output is ``dtype(±(w ± v) / sqrt(128))``."""
    target = 448.0 * 2.0 ** k
    t = target * 128 ** 0.5
    w = torch.tensor([t], dtype=torch.float64).to(dtype)
    v = torch.tensor([t - float(w)], dtype=torch.float64).to(dtype)
    up, down = torch.tensor([float("inf")], dtype=dtype), torch.tensor([float("-inf")], dtype=dtype)
    for cand in (v, torch.nextafter(v, up), torch.nextafter(v, down)):
        a, b = w.float() + cand.float(), w.float() - cand.float()   # the butterfly's first stage, fp32
        z = (torch.cat([a, b]) * 128 ** -0.5).to(dtype).float().abs()
        if float(z.max()) == target:
            return float(w), float(cand)
    return None


SPIKES = {d: [s for k in range(-12, 30) if (s := _spike(k, d)) is not None] for d in DTYPES.values()}


def make_x(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """``[T, ..., 128]`` rows of six kinds (see the module docstring), never all zeros."""
    rows = shape[:-1]
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    kind = torch.randint(0, 6, rows + (1,), generator=g)
    wide = torch.exp(torch.randn(rows + (1,), generator=g, dtype=torch.float64) * 4)
    pow2 = torch.sign(x) * 2.0 ** torch.randint(-20, 20, shape, generator=g)
    x = torch.where(kind == 1, x * 1e-9, x)         # amax under the 1e-4 floor
    x = torch.where(kind == 2, x * 1e30, x)         # huge
    x = torch.where(kind == 3, x * wide, x)         # scales spread over e^±12
    x = torch.where(kind == 4, pow2, x)             # exact powers of two
    # a spike on nope dims 100, 101 (zeros elsewhere): Hadamard amax exactly 448 * 2^k, the scale 2^k
    spikes = torch.tensor(SPIKES[dtype], dtype=torch.float64)
    pick = torch.randint(0, len(spikes), rows, generator=g)
    spike = torch.zeros(shape, dtype=torch.float64)
    spike[..., 100:102] = spikes[pick]
    x = torch.where(kind == 5, spike, x)
    return x.to(dtype).to(DEVICE)


def make_rope(T: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 100_000, (T,), generator=g)
    cos, sin = rope_cos_sin(pos)
    return cos.to(DEVICE), sin.to(DEVICE)


def run_triton(x, cos, sin, interleave, **kw):
    """The launcher with ``IndexerQuantConfig(**kw)``, writing into poisoned outputs (e4m3 NaN bytes, fp32 NaN)."""
    q = torch.full(x.shape, FP8_NAN, dtype=torch.uint8, device=x.device).view(FP8)
    s = torch.full(x.shape[:-1], float("nan"), dtype=torch.float32, device=x.device)
    out = K.indexer_quant(x, cos, sin, interleave, out=(q, s), config=K.IndexerQuantConfig(**kw))
    assert out[0] is q and out[1] is s
    return q, s


def assert_same_bits(out, ref):
    """Same e4m3 codes and same fp32 scales, bit for bit; a failure counts the differences."""
    (q, s), (q_ref, s_ref) = out, ref
    assert q.shape == q_ref.shape and s.shape == s_ref.shape and q.dtype == FP8 and s.dtype == torch.float32
    for what, got, want, bits in (("e4m3 codes", q, q_ref, torch.uint8), ("scales", s, s_ref, torch.int32)):
        bad = got.view(bits).cpu() != want.view(bits).cpu()
        if bad.any():
            i = tuple(bad.nonzero()[0].tolist())
            raise AssertionError(f"{int(bad.sum())} of {bad.numel()} {what} differ, first at {list(i)}: "
                                 f"{float(got[i].float())} vs {float(want[i].float())}")


CASES = [pytest.param(T, H, d, il, id=f"T{T}-{'k' if H is None else f'H{H}'}-{d}-{'gptj' if il else 'neox'}")
         for T in (0, 1, 5, 64, 65) for H in (None, 1, 3, 64) for d in DTYPES for il in (False, True)
         if not (T == 64 and H != 64)]


@pytest.mark.parametrize("T, H, dtype, interleave", CASES)
def test_matches_reference_bitwise(T, H, dtype, interleave):
    g = torch.Generator().manual_seed(1000 * T + (H or 0))
    shape = (T, 128) if H is None else (T, H, 128)
    x = make_x(shape, DTYPES[dtype], g)
    cos, sin = make_rope(T, g)
    ref = reference.indexer_quant(x, cos, sin, interleave)
    assert_same_bits(run_triton(x, cos, sin, interleave), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_kinds_are_exercised(dtype):
    """The floor, huge and exact-power-of-two rows really reach their branches, and still match."""
    dt = DTYPES[dtype]
    assert len(SPIKES[dt]) >= 10
    T, H = 40, 8
    g = torch.Generator().manual_seed(7)
    x = make_x((T, H, 128), dt, g)
    cos, sin = make_rope(T, g)
    q_ref, s_ref = ref = reference.indexer_quant(x, cos, sin, False)
    assert_same_bits(run_triton(x, cos, sin, False, block_r=32), ref)
    z = hadamard(indexer_rope(x, cos, sin, False).to(dt)).float()
    amax = z.abs().amax(-1)
    assert (amax < 1e-4).sum() >= 5 and (s_ref == 2.0 ** -22).sum() >= 5           # the floor
    assert (amax > 1e30).sum() >= 5                                                 # huge
    exact = amax == 448 * s_ref                                                     # amax = 448 * 2^k
    assert exact.sum() >= 5
    assert (q_ref[exact].float().abs().amax(-1) == 448).all()
    qf = q_ref.float()
    assert ((qf.abs() < 2.0 ** -6) & (qf != 0)).sum() >= 100                       # e4m3 subnormals too


def test_strided_inputs():
    """x with non-unit strides everywhere (a transposed, every-other-dim view) and cos / sin slices."""
    g = torch.Generator().manual_seed(3)
    T, H = 9, 5
    big = make_x((H, T, 256), torch.bfloat16, g)
    x = big.transpose(0, 1)[..., ::2]                  # [T, H, 128], strides (256, T * 256, 2)
    table = make_rope(T, g)
    cos = torch.cat([table[0], table[0]], dim=1)[:, 1::2]   # [T, 32] with strides (64, 2)
    sin = torch.cat([table[1], table[1]], dim=1)[:, 1::2]
    assert x.stride(-1) == 2 and cos.stride() == (64, 2)
    for il in (False, True):
        ref = reference.indexer_quant(x.contiguous(), cos.contiguous(), sin.contiguous(), il)
        assert_same_bits(run_triton(x, cos, sin, il, block_r=8), ref)
    # several middle dims [T, 2, 3, 128], one program per few rows
    x4 = make_x((T, 2, 3, 128), torch.float32, g)
    assert_same_bits(run_triton(x4, *table, True, block_r=4), reference.indexer_quant(x4, *table, True))


def test_bad_config_is_rejected():
    for bad in (dict(block_r=12), dict(block_r=0), dict(num_warps=3)):
        with pytest.raises(ValueError, match=f"config: expected {next(iter(bad))}"):
            K.IndexerQuantConfig(**bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_op_dispatch_and_determinism(dtype):
    g = torch.Generator().manual_seed(5)
    x = make_x((17, 4, 128), DTYPES[dtype], g)
    cos, sin = make_rope(17, g)
    ref = ops.indexer_quant(x, cos, sin, True, backend="torch")
    tri = ops.indexer_quant(x, cos, sin, True, backend="triton")
    assert_same_bits(tri, ref)
    assert_same_bits(ops.indexer_quant(x, cos, sin, True, backend="triton"), tri)
    assert_same_bits(ops.indexer_quant(x, cos, sin, True), ref)   # default: triton on CUDA, torch elsewhere
    empty = ops.indexer_quant(x[:0], cos[:0], sin[:0], False, backend="triton")
    assert empty[0].shape == (0, 4, 128) and empty[1].shape == (0, 4)


def test_indexer_layer_fp8_path():
    """Indexer.forward through the fused op (forced to Triton) = the composition it replaced."""
    torch.manual_seed(0)
    cfg = DSAConfig.preset("tiny")
    T = 6
    for dtype in (torch.bfloat16, torch.float32):
        idx = Indexer(cfg, dtype).to(DEVICE)
        x = torch.randn(T, cfg.hidden_size, dtype=dtype, device=DEVICE)
        qr = torch.randn(T, cfg.q_lora_rank, dtype=dtype, device=DEVICE)
        cos, sin = make_rope(T, torch.Generator().manual_seed(1))
        calls = []

        def fused(*a):
            calls.append(("quant", a[0].shape))
            return ops.indexer_quant(*a, backend="triton")

        def fused_weights(*a):
            calls.append(("weights", a[0].shape))
            return indexer_quant_weights(*a, backend="triton")

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(indexer_layer, "indexer_quant", fused)
            mp.setattr(indexer_layer, "indexer_quant_weights", fused_weights)
            out = idx(x, qr, cos, sin)
        assert calls == [("weights", (T, cfg.index_n_heads, 128)), ("quant", (T, 128))]
        # the composition, by hand
        q = idx.wq_b(qr).view(T, idx.n_heads, idx.head_dim)
        kn = idx.k_norm
        k = torch.nn.functional.layer_norm(idx.wk(x).float(), kn.normalized_shape, kn.weight.float(),
                                           kn.bias.float(), kn.eps).to(dtype)
        q_fp8, q_scale = act_quant(hadamard(indexer_rope(q, cos, sin, idx.interleave).to(dtype)), block=128)
        k_fp8, k_scale = act_quant(hadamard(indexer_rope(k, cos, sin, idx.interleave).to(dtype)), block=128)
        gate = idx.weights_proj(x).float() * idx.n_heads ** -0.5
        assert_same_bits((out.q, out.weights), (q_fp8, gate * q_scale[..., 0] * 128 ** -0.5))
        assert_same_bits((out.k, out.k_scale), (k_fp8, k_scale[..., 0]))


@pytest.mark.parametrize("T", [0, 1, 65])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_dtype", DTYPES)
@pytest.mark.parametrize("rope", [True, False], ids=("rope", "nope"))
def test_quant_weights_matches_the_layers_ops(T, dtype, gate_dtype, rope):
    """indexer_quant_weights (the queries and the head weights in one launch) = the layer's torch ops, bit for
    bit: the gate in the model dtype or fp32 (HF keeps weights_proj in fp32), strided, its products rounded in
    fp32 in the layer's order; with and without RoPE."""
    g = torch.Generator().manual_seed(31 + T)
    H = 7
    x = make_x((T, H, 128), DTYPES[dtype], g)
    gate = (torch.randn(T, 2 * H, generator=g) * 3).to(DEVICE, DTYPES[gate_dtype])[:, ::2]  # strided
    cos, sin = make_rope(T, g) if rope else (torch.empty(T, 0, device=DEVICE),) * 2
    c1, c2 = 32 ** -0.5, 128 ** -0.5
    q_fp8, w = indexer_quant_weights(x, cos, sin, True, gate, c1, c2, backend="triton")
    want_q, want_scale = reference.indexer_quant(x, cos, sin, True)
    assert_same_bits((q_fp8, w.float()), (want_q, gate.float() * c1 * want_scale * c2))
    assert w.dtype == torch.float32 and w.shape == (T, H)
    ref = indexer_quant_weights(x, cos, sin, True, gate, c1, c2, backend="torch")
    assert_same_bits((q_fp8, w), ref)
    # a gate the kernel does not read (fp16) takes the torch ops, the same formula
    half = gate.to(torch.float16)
    assert_same_bits(indexer_quant_weights(x, cos, sin, True, half, c1, c2, backend="triton"),
                     (want_q, half.float() * c1 * want_scale * c2))


# ---- the interpreter's rounding: integer bf16 / e4m3 casts against torch's ----------------------------

@triton.jit
def _casts_kernel(v, out_bf16, out_e4m3, N, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b_v = tl.load(v + o, mask=m, other=0.0)
    tl.store(out_bf16 + o, K._round_bf16(b_v, SOFT), mask=m)
    tl.store(out_e4m3 + o, K._e4m3_bits(tl.minimum(tl.maximum(b_v, -448.0), 448.0), SOFT), mask=m)


def _tie_values() -> torch.Tensor:
    """Every e4m3 value, every midpoint between neighbours (ties), 1 fp32 ulp either side of each, both
    signs; bf16 ties and their neighbours; random values over the whole e4m3 range and beyond."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()               # 0 .. 448
    mids = (codes[1:] + codes[:-1]) / 2                                                # exact in fp32
    base = torch.cat([codes, mids, torch.tensor([2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -12])])
    up, down = torch.nextafter(base, torch.tensor(1e9)), torch.nextafter(base, torch.tensor(-1e9))
    bf_ties = (torch.randint(0, 2 ** 15, (4096,)).to(torch.int32) << 16 | 0x8000).view(torch.float32)
    bf_ties = bf_ties[torch.isfinite(bf_ties)]
    bf_near = torch.cat([torch.nextafter(bf_ties, torch.tensor(1e38)), torch.nextafter(bf_ties, torch.tensor(0.0))])
    rnd = torch.randn(20000) * torch.exp(torch.randn(20000) * 6)
    v = torch.cat([base, up, down, bf_ties, bf_near, rnd, torch.tensor([3.3e38, 1e-40, 0.0])])
    return torch.cat([v, -v])


def test_soft_casts_round_to_nearest_even():
    v = _tie_values().to(DEVICE)
    N = v.numel()
    for soft in ((True, False) if DEVICE == "cuda" else (True,)):
        out_bf16 = torch.full_like(v, float("nan"))
        out_e4m3 = torch.full((N,), FP8_NAN, dtype=torch.uint8, device=DEVICE)
        _casts_kernel[(triton.cdiv(N, 4096),)](v, out_bf16, out_e4m3, N, SOFT=soft, BLOCK=4096)
        ref_bf16 = v.to(torch.bfloat16).float()
        assert torch.equal(out_bf16.view(torch.int32), ref_bf16.view(torch.int32)), f"bf16, soft={soft}"
        ref_e4m3 = v.clamp(-448, 448).to(FP8).view(torch.uint8)
        bad = out_e4m3 != ref_e4m3
        assert not bad.any(), (f"e4m3, soft={soft}: {int(bad.sum())} differ, e.g. {float(v[bad][0])} -> "
                               f"{int(out_e4m3[bad][0]):#x}, torch {int(ref_e4m3[bad][0]):#x}")


# ---- argument checks ------------------------------------------------------------------------------------

def _args(**over):
    a = dict(x=torch.randn(3, 2, 128).bfloat16(), cos=torch.rand(3, 32), sin=torch.rand(3, 32), interleave=False)
    a.update(over)
    return a


NOPE_CASES = [pytest.param(T, H, d, il, id=f"nope-T{T}-{'k' if H is None else f'H{H}'}-{d}-{'gptj' if il else 'neox'}")
              for T in (0, 1, 65) for H in (None, 3, 32) for d in DTYPES for il in (False, True)]


@pytest.mark.parametrize("T, H, dtype, interleave", NOPE_CASES)
def test_nope_matches_reference_bitwise(T, H, dtype, interleave):
    """NoPE (GLM-5.3-Flash: cos, sin [T, 0]): no rotation, the Hadamard and the quantisation alone, the
    reference's bits (the kernel compiled without its RoPE), through the launcher, the rope-only step and the op."""
    g = torch.Generator().manual_seed(5 + T + (H or 0))
    shape = (T, 128) if H is None else (T, H, 128)
    x = make_x(shape, DTYPES[dtype], g)
    cos = sin = torch.empty(T, 0, device=DEVICE)
    ref = reference.indexer_quant(x, cos, sin, interleave)
    assert_same_bits(run_triton(x, cos, sin, interleave), ref)
    assert_same_bits(ops.indexer_quant(x, cos, sin, interleave, backend="triton"), ref)
    assert_same_values(run_triton_rope(x, cos, sin, interleave), reference.rope_model_dtype(x, cos, sin, interleave))
    if T:  # the reference itself: the unrotated row's Hadamard and quantisation
        q, scale = act_quant(hadamard(x), block=128)
        assert_same_bits((q, scale[..., 0]), ref)


@pytest.mark.parametrize("over, name", [
    pytest.param(dict(x=torch.randn(3, 2, 64)), "x", id="D64"),
    pytest.param(dict(x=torch.randn(3, 2, 256)), "x", id="D256"),
    pytest.param(dict(x=torch.randn(128)), "x", id="x-1d"),
    pytest.param(dict(x=torch.randint(0, 9, (3, 2, 128))), "x", id="x-int"),
    pytest.param(dict(x=torch.randn(3, 2, 128).half()), "x", id="x-f16"),
    pytest.param(dict(x=[1.0] * 128), "x", id="x-list"),
    pytest.param(dict(cos=torch.rand(4, 32)), "cos", id="cos-T"),
    pytest.param(dict(cos=torch.rand(3, 64)), "cos", id="cos-64"),
    pytest.param(dict(cos=torch.rand(3, 32).double()), "cos", id="cos-f64"),
    pytest.param(dict(sin=torch.rand(3, 16)), "sin", id="sin-16"),
    pytest.param(dict(cos=torch.rand(3, 0)), "sin", id="cos-nope-sin-32"),
    pytest.param(dict(cos=torch.rand(3, 16), sin=torch.rand(3, 16)), "cos", id="cos-16"),
    pytest.param(dict(sin=torch.rand(3, 1, 32)), "sin", id="sin-3d"),
    pytest.param(dict(interleave=2), "interleave", id="interleave-int2"),
])
def test_bad_arguments(over, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        ops.indexer_quant(**_args(**over))


def test_bad_backend():
    with pytest.raises(ValueError, match="^backend:"):
        ops.indexer_quant(**_args(), backend="cuda")


# ---- GPU-only sizes -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T, H", [(4096, 64), (16384, 1), (3, 64), (1000, 7)],
                         ids=("T4096-H64", "T16384-k", "T3-H64", "T1000-H7"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", (False, True), ids=("neox", "gptj"))
def test_gpu_large_bitwise(T, H, dtype, interleave):
    g = torch.Generator().manual_seed(T + H)
    x = make_x((T, H, 128) if H > 1 else (T, 128), DTYPES[dtype], g)
    cos, sin = make_rope(T, g)
    ref = reference.indexer_quant(x, cos, sin, interleave)
    assert_same_bits(run_triton(x, cos, sin, interleave), ref)
    assert_same_bits(run_triton(x, cos, sin, interleave, soft_casts=True), ref)
    for block_r, num_warps in ((16, 4), (32, 4), (4, 1)):
        assert_same_bits(run_triton(x, cos, sin, interleave, block_r=block_r, num_warps=num_warps), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_dtype", DTYPES)
def test_gpu_quant_weights_bitwise(dtype, gate_dtype):
    """The compiled launch with the head weights (V3.2's 64 indexer heads) against the layer's ops, bit for bit."""
    g = torch.Generator().manual_seed(12)
    x = make_x((4096, 64, 128), DTYPES[dtype], g)
    gate = (torch.randn(4096, 64, generator=g) * 3).to(DEVICE, DTYPES[gate_dtype])
    cos, sin = make_rope(4096, g)
    got = indexer_quant_weights(x, cos, sin, False, gate, 64 ** -0.5, 128 ** -0.5, backend="triton")
    assert_same_bits(got, indexer_quant_weights(x, cos, sin, False, gate, 64 ** -0.5, 128 ** -0.5, backend="torch"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", (False, True), ids=("neox", "gptj"))
def test_gpu_nope_bitwise(dtype, interleave):
    """The compiled NoPE kernel (GLM-5.3-Flash's 32 indexer heads) against the reference, bit for bit."""
    g = torch.Generator().manual_seed(9)
    x = make_x((4096, 32, 128), DTYPES[dtype], g)
    cos = sin = torch.empty(4096, 0, device=DEVICE)
    ref = reference.indexer_quant(x, cos, sin, interleave)
    assert_same_bits(run_triton(x, cos, sin, interleave), ref)
    assert_same_bits(run_triton(x, cos, sin, interleave, soft_casts=True), ref)


# ---- the RoPE step alone (kpool's key before pooling) ------------------------------------------------

def run_triton_rope(x, cos, sin, interleave, **kw):
    """The rope-only launch writing into a NaN-poisoned output of x's dtype."""
    y = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    out = K.indexer_rope(x, cos, sin, interleave, out=y, config=K.IndexerQuantConfig(**kw))
    assert out is y
    return y


def assert_same_values(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    bad = got.view(bits).cpu() != want.view(bits).cpu()
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} differ, first at {bad.nonzero()[0].tolist()}"


ROPE_CASES = [pytest.param(T, H, d, il, id=f"T{T}-{'k' if H is None else f'H{H}'}-{d}-{'gptj' if il else 'neox'}")
              for T in (0, 1, 65) for H in (None, 3) for d in DTYPES for il in (False, True)]


@pytest.mark.parametrize("T, H, dtype, interleave", ROPE_CASES)
def test_rope_only_matches_reference_bitwise(T, H, dtype, interleave):
    g = torch.Generator().manual_seed(77 + T + (H or 0))
    shape = (T, 128) if H is None else (T, H, 128)
    x = make_x(shape, DTYPES[dtype], g)
    cos, sin = make_rope(T, g)
    want = reference.rope_model_dtype(x, cos, sin, interleave)
    assert_same_values(run_triton_rope(x, cos, sin, interleave), want)
    # and it is indexer_quant's first step: the reference's quantisation of it is indexer_quant's
    if T:
        q, scale = act_quant(hadamard(want), block=128)
        assert_same_bits((q, scale[..., 0]), reference.indexer_quant(x, cos, sin, interleave))


def test_rope_only_strided_and_dispatch():
    g = torch.Generator().manual_seed(5)
    T, H = 9, 5
    x = make_x((H, T, 256), torch.bfloat16, g).transpose(0, 1)[..., ::2]
    cos, sin = make_rope(T, g)
    want = reference.rope_model_dtype(x.contiguous(), cos, sin, True)
    got = run_triton_rope(x, cos, sin, True, block_r=8)
    assert_same_values(got, want)
    assert got.is_contiguous()
    from flashdsa.ops.indexer_quant import rope_model_dtype
    assert_same_values(rope_model_dtype(x, cos, sin, True, backend="torch"), want)
    assert_same_values(rope_model_dtype(x, cos, sin, True, backend="triton"), want)


@pytest.mark.gpu
@pytest.mark.parametrize("T, H", [(4096, 1), (3, 64), (1000, 7)], ids=("T4096-k", "T3-H64", "T1000-H7"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", (False, True), ids=("neox", "gptj"))
def test_gpu_rope_only_bitwise(T, H, dtype, interleave):
    g = torch.Generator().manual_seed(T + H + 1)
    x = make_x((T, H, 128) if H > 1 else (T, 128), DTYPES[dtype], g)
    cos, sin = make_rope(T, g)
    want = reference.rope_model_dtype(x, cos, sin, interleave)
    assert_same_values(run_triton_rope(x, cos, sin, interleave), want)
    assert_same_values(run_triton_rope(x, cos, sin, interleave, soft_casts=True), want)
