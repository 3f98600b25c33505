"""Every public op and cache reader / writer, fed bad and edge-case inputs by class, on both backends.

Classes: stride (a non-contiguous view of EVERY tensor argument: permuted-then-permuted-back, every
other row, every other column, expanded from one row), dtype, rank, shape, value range, empty (0 rows,
0 keys, 0 heads, 0 length), NaN / inf. Each case ends in one of two ways, and nothing else passes:

- a ``ValueError`` whose message starts with the name of the argument at fault (``"lengths: expected
  ..."``), raised before any kernel runs, the same message on both backends; or
- the same result as the torch reference on contiguous copies of the same inputs: bit for bit where
  the math is exact, within the op's own numerical tolerance where it is not (sparse / dense MLA).

The indexer inputs are small integers with power-of-two scales, so every logit is exact in fp32 and the
Triton indexer matches the reference bit for bit (and top-k over those logits, ties included). Gaps
of the strided views and the parts of a cache a writer was not given hold NaN / 0x7F poison, so a
kernel that reads through the wrong stride, or a writer that writes outside its slots, fails. Without
a GPU the Triton backend runs in the interpreter, so shapes are tiny.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from helpers import assert_close

from flashdsa import ops
from flashdsa.cache import layouts
from flashdsa.cache.pool import KVPool
from flashdsa.config import DSAConfig
from flashdsa.quant import FP8

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

SM = 576 ** -0.5
RAW_SCALE = 0.013
INT_POISON = 2 ** 31 - 1
# FlashMLA's tolerances (tests/ops/test_sparse_mla_triton.py): out within 1e-3 + 2/128 relative, lse
# within 1e-6 + 8/65536 relative; the interpreter keeps P in fp32, so these hold with room to spare.
OUT_TOL = dict(atol=1e-3, rtol=2.01 / 128, max_cos_diff=5e-6)
LSE_TOL = dict(atol=1e-6, rtol=8.01 / 65536)


# ---- comparisons ------------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _tensors(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def same_bits(out, ref) -> None:
    for i, (o, r) in enumerate(zip(_tensors(out), _tensors(ref), strict=True)):
        assert o.dtype == r.dtype and o.shape == r.shape, f"output {i}: {o.dtype} {list(o.shape)} != {r.dtype} {list(r.shape)}"
        if not torch.equal(_bits(o), _bits(r)):
            bad = (_bits(o) != _bits(r)).nonzero()[0].tolist()
            raise AssertionError(f"output {i} differs first at {bad}: {o[tuple(bad)]} != {r[tuple(bad)]}")


def mla_close(out, ref) -> None:
    (o, lo), (r, lr) = out, ref
    assert o.dtype == r.dtype == torch.bfloat16 and o.shape == r.shape
    assert_close(lo, lr, name="lse", **LSE_TOL)
    assert_close(o, r, name="out", **OUT_TOL)


# ---- inputs -----------------------------------------------------------------------------------------

def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ints_fp8(*shape, g, lo=-6, hi=7) -> torch.Tensor:
    """Small integers in e4m3 (exact), never all zero: dot products of them are exact in fp32."""
    return torch.randint(lo, hi, shape, generator=g).float().to(FP8)


def _i32(*vals) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.int32)


def _index_cache(pages: int, g) -> torch.Tensor:
    return layouts.pack_index_pages(_ints_fp8(pages * 64, 128, g=g),
                                    2.0 ** torch.randint(-3, 3, (pages * 64,), generator=g).float())


def _mla_cache(fmt: str, pages: int, g) -> torch.Tensor:
    kv = torch.randn(pages * 64, 576, generator=g).to(torch.bfloat16)
    rows = layouts.encode_mla(kv, fmt, RAW_SCALE if fmt == "fp8_raw" else None)
    return rows.view(pages, 64, rows.shape[-1])


def _bf16(*shape, g) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


# ---- the ops under test -----------------------------------------------------------------------------
# Each op: a function of (backend, **args), a builder of fresh valid args, the tensor args, the backends
# and the comparison of a backend's result with the torch reference's.

@dataclass(frozen=True)
class Op:
    fn: Callable
    make: Callable[[], dict]
    backends: tuple[str, ...] = ("torch", "triton")
    compare: Callable = same_bits
    # args whose rank the op does not fix ([T, ..., 128], [..., d]): no rank mutation for them
    free_rank: tuple[str, ...] = ()
    # Triton is slow in the interpreter: the args whose strided views run on it one at a time (None: all;
    # "together": one call per view kind with every argument strided at once)
    triton_stride: tuple[str, ...] | str | None = None

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.make().items() if isinstance(v, torch.Tensor))


def _call(name):
    fn = getattr(ops, name)
    return lambda backend, **a: fn(**a, backend=backend)


def _topk_pages():
    g = _g(1)
    return dict(logits=torch.randint(-20, 20, (3, 100), generator=g).float(), lengths=_i32(0, 8, 65), topk=8,
                page_table=_i32(5, 2, 7, 1, 3, 0).view(3, 2), row_starts=_i32(7, 0, 30))


def _topk_offsets():
    g = _g(2)
    return dict(logits=torch.randn(3, 70, generator=g), lengths=_i32(70, 1, 9), topk=8, out_offsets=_i32(0, 70, 71))


def _ragged():
    g = _g(3)
    return dict(q_fp8=_ints_fp8(3, 4, 128, g=g), k_fp8=_ints_fp8(70, 128, g=g),
                k_scale=2.0 ** torch.randint(-2, 3, (70,), generator=g).float(),
                weights=torch.randint(-3, 4, (3, 4), generator=g).float(), ks=_i32(0, 5, 9), ke=_i32(10, 70, 9))


def _topk_ragged():
    return dict(_ragged(), topk=8, out_offsets=_i32(3, 0, 100))


def _paged():
    g = _g(4)
    return dict(q_fp8=_ints_fp8(2, 2, 4, 128, g=g), index_cache=_index_cache(3, g),
                weights=torch.randint(-3, 4, (4, 4), generator=g).float(),
                context_lens=_i32(5, 6, 70, 71).view(2, 2), block_table=_i32(2, 0, 1, 0).view(2, 2),
                max_context_len=80)


def _quant():
    g = _g(5)
    return dict(x=torch.randn(3, 2, 128, generator=g).to(torch.bfloat16), cos=torch.rand(3, 32, generator=g),
                sin=torch.rand(3, 32, generator=g), interleave=False)


def _decode(fmt):
    def make():
        g = _g(6)
        idx = torch.randint(-1, 128, (2, 1, 8), generator=g).to(torch.int32)
        idx[0, 0] = -1  # a row with nothing to attend
        return dict(q=_bf16(2, 1, 2, 576, g=g), kv_cache=_mla_cache(fmt, 2, g), indices=idx, sm_scale=SM,
                    **({"kv_scale": RAW_SCALE} if fmt == "fp8_raw" else {}))
    return make


def _prefill():
    g = _g(7)
    return dict(q=_bf16(3, 2, 576, g=g), kv=_bf16(20, 576, g=g),
                indices=torch.randint(-1, 22, (3, 8), generator=g).to(torch.int32), sm_scale=SM)


def _dense():
    g = _g(8)
    return dict(q=_bf16(3, 2, 576, g=g), kv=_bf16(20, 576, g=g), cu_seqlens_q=_i32(0, 1, 1, 3),
                cu_seqlens_kv=_i32(0, 5, 9, 20), sm_scale=SM)


def _merge():
    g = _g(9)
    lse_b = torch.randn(2, 3, generator=g)
    lse_b[0, 0] = float("-inf")
    return dict(out_a=_bf16(2, 3, 16, g=g), lse_a=torch.randn(2, 3, generator=g), out_b=_bf16(2, 3, 16, g=g),
                lse_b=lse_b)


def _dense_close(out, ref):
    # bf16 P and bf16 out on the GPU: |out - ref| <= 2^-8 max|v| (tests/ops/test_dense_mla_triton.py)
    (o, lo), (r, lr) = out, ref
    assert o.dtype == r.dtype == torch.bfloat16 and o.shape == r.shape
    assert_close(lo, lr, name="lse", **LSE_TOL)
    assert_close(o, r, name="out", atol=2.0 ** -8 * 4.5, max_cos_diff=7e-6)


# cache writers return what they wrote into; readers what they read
def _store_index(backend, index_cache, slots, k_fp8, k_scale):
    layouts.store_index_keys(index_cache, slots, k_fp8, k_scale)
    return index_cache


def _store_mla(backend, kv_cache, slots, kv, scale=None):
    layouts.store_mla(kv_cache, slots, kv, scale)
    return kv_cache


def _cache_args(fmt):
    def make():
        g = _g(10)
        return dict(kv_cache=_mla_cache(fmt, 2, g), slots=torch.tensor([3, 64, 127, 0]), kv=_bf16(4, 576, g=g),
                    **({"scale": RAW_SCALE} if fmt == "fp8_raw" else {}))
    return make


def _gather_mla_args(fmt):
    def make():
        a = _cache_args(fmt)()
        del a["kv"]
        return a
    return make


def _index_args():
    g = _g(11)
    return dict(index_cache=_index_cache(2, g), slots=torch.tensor([5, 64, 127, 1], dtype=torch.int32),
                k_fp8=_ints_fp8(4, 128, g=g), k_scale=torch.rand(4, generator=g))


def _gather_index_args():
    a = _index_args()
    return dict(index_cache=a["index_cache"], slots=a["slots"])


_TINY = DSAConfig.preset("tiny")


def _pool(fmt="fp8") -> KVPool:
    pool = KVPool(_TINY, 2, fmt, kv_scale=RAW_SCALE if fmt == "fp8_raw" else None)
    g = _g(12)
    pool.write(0, torch.arange(128), torch.randn(128, 576, generator=g), _ints_fp8(128, 128, g=g), torch.rand(128, generator=g))
    return pool


def _pool_write(backend, **a):
    pool = _pool()
    pool.write(0, **a)
    return pool.mla_cache(0), pool.index_cache(0)


def _pool_write_args():
    g = _g(13)
    return dict(slots=torch.tensor([3, 64, 127]), kv=torch.randn(3, 576, generator=g),
                index_k_fp8=_ints_fp8(3, 128, g=g), index_k_scale=torch.rand(3, generator=g),
                index_slots=torch.tensor([4, 65, 0]))


TORCH = ("torch",)
OPS = {
    "topk_transform-pages": Op(_call("topk_transform"), _topk_pages),
    "topk_transform-offsets": Op(_call("topk_transform"), _topk_offsets),
    "indexer_logits_ragged": Op(_call("indexer_logits_ragged"), _ragged),
    # a composition of the two ops above (each fuzzed argument by argument): all views at once on Triton
    "indexer_topk_ragged": Op(_call("indexer_topk_ragged"), _topk_ragged, triton_stride="together"),
    "indexer_logits_paged": Op(_call("indexer_logits_paged"), _paged),
    "indexer_quant": Op(_call("indexer_quant"), _quant, free_rank=("x",)),
    "sparse_mla_decode-bf16": Op(_call("sparse_mla_decode"), _decode("bf16"), compare=mla_close),
    # q and indices do not depend on the cache format: bf16 covers them
    "sparse_mla_decode-fp8": Op(_call("sparse_mla_decode"), _decode("fp8"), compare=mla_close,
                                triton_stride=("kv_cache",)),
    "sparse_mla_decode-fp8_raw": Op(_call("sparse_mla_decode"), _decode("fp8_raw"), compare=mla_close,
                                    triton_stride=("kv_cache",)),
    "sparse_mla_prefill": Op(_call("sparse_mla_prefill"), _prefill, compare=mla_close),
    "dense_mla_prefill": Op(_call("dense_mla_prefill"), _dense, compare=_dense_close),
    "merge_attention": Op(lambda backend, **a: ops.merge_attention(**a), _merge, TORCH,
                          free_rank=("out_a", "lse_a", "out_b", "lse_b")),
    "store_index_keys": Op(_store_index, _index_args, TORCH),
    "gather_index_keys": Op(lambda backend, **a: layouts.gather_index_keys(**a), _gather_index_args, TORCH),
    "pack_index_pages": Op(lambda backend, **a: layouts.pack_index_pages(**a),
                           lambda: {k: v for k, v in _index_args().items() if k in ("k_fp8", "k_scale")}, TORCH),
    "unpack_index_pages": Op(lambda backend, **a: layouts.unpack_index_pages(**a),
                             lambda: dict(pages=_index_cache(2, _g(14)), n=70), TORCH),
    **{f"store_mla-{f}": Op(_store_mla, _cache_args(f), TORCH) for f in layouts.MLA_FORMATS},
    **{f"gather_mla-{f}": Op(lambda backend, **a: layouts.gather_mla(**a), _gather_mla_args(f), TORCH)
       for f in layouts.MLA_FORMATS},
    "encode_mla-fp8": Op(lambda backend, **a: layouts.encode_mla(**a, fmt="fp8"),
                         lambda: dict(kv=_bf16(4, 576, g=_g(15))), TORCH),
    "decode_mla-fp8": Op(lambda backend, **a: layouts.decode_mla(**a), lambda: dict(rows=_mla_cache("fp8", 1, _g(16))),
                         TORCH, free_rank=("rows",)),
    "decode_mla-fp8_raw": Op(lambda backend, **a: layouts.decode_mla(**a, scale=RAW_SCALE),
                             lambda: dict(rows=_mla_cache("fp8_raw", 1, _g(17))), TORCH, free_rank=("rows",)),
    "KVPool.write": Op(_pool_write, _pool_write_args, TORCH),
    "KVPool.read": Op(lambda backend, **a: _pool().read(0, **a), lambda: dict(slots=torch.tensor([3, 64, 127, 3])), TORCH),
    "KVPool.read_index": Op(lambda backend, **a: _pool().read_index(0, **a),
                            lambda: dict(index_slots=torch.tensor([0, 127, 64], dtype=torch.int32)), TORCH),
}


# ---- the oracle -------------------------------------------------------------------------------------

def _fresh(v):
    return v.clone(memory_format=torch.contiguous_format) if isinstance(v, torch.Tensor) else v


def _run(op: Op, args: dict, backend: str):
    """("ok", result) or ("error", message); any other exception fails the test (an unclear error)."""
    try:
        return "ok", op.fn(backend, **args)
    except ValueError as e:
        return "error", str(e)


def _names_arg(msg: str, names) -> bool:
    return any(msg.startswith(n) and msg[len(n):len(n) + 1] in (":", " ", ",") for n in names)


def check_case(op: Op, args: dict, backend: str, culprit: str | None, *, must_fail: bool = False) -> None:
    """``args`` (already mutated; ``culprit`` = the argument mutated) on ``backend`` against the torch
    reference on contiguous copies of the same values."""
    ref = _run(op, {k: _fresh(v) for k, v in args.items()}, "torch")
    out = _run(op, args, backend)
    all_args = tuple(op.make())
    if out[0] == "error":
        msg = out[1]
        if ref[0] == "error":
            assert _names_arg(msg, all_args + ("ke - ks", "row_starts + lengths", "start, end", "cu_seqlens_kv - cu_seqlens_q")), msg
        else:
            # accepted contiguous, rejected as given: only for the layout of the argument it names, on both backends
            assert culprit is not None and _names_arg(msg, (culprit,)), f"rejected with {msg!r}, contiguous copy accepted"
            if backend != "torch":
                assert _run(op, args, "torch") == out, "the backends reject differently"
        return
    assert not must_fail, f"{culprit}: accepted, expected a ValueError"
    assert ref[0] == "ok", f"{backend} accepted what the reference rejects: {ref[1]}"
    op.compare(out[1], ref[1])


# ---- class: stride ----------------------------------------------------------------------------------

def _poison_like(t: torch.Tensor, shape) -> torch.Tensor:
    if t.dtype == FP8 or t.dtype == torch.uint8:
        return torch.full(shape, 0x7F, dtype=torch.uint8).view(t.dtype)  # e4m3 NaN
    if t.is_floating_point():
        return torch.full(shape, float("nan"), dtype=t.dtype)
    return torch.full(shape, INT_POISON if t.dtype != torch.int8 else 127, dtype=t.dtype)


def strided(t: torch.Tensor, kind: str) -> torch.Tensor | None:
    """A non-contiguous view of ``t`` (same values, except "expand": row 0 repeated); None if none exists."""
    if kind == "permuted":
        if t.dim() < 2:
            return None
        order = tuple(reversed(range(t.dim())))
        return t.permute(order).contiguous().permute(order)
    if kind in ("rows2", "cols2"):
        d = 0 if kind == "rows2" or t.dim() == 1 else t.dim() - 1
        if kind == "cols2" and t.dim() == 1:
            return None
        shape = list(t.shape)
        shape[d] *= 2
        buf = _poison_like(t, shape)
        idx = [slice(None)] * t.dim()
        idx[d] = slice(None, None, 2)
        view = buf[tuple(idx)]
        view.copy_(t) if t.dtype != FP8 else view.view(torch.uint8).copy_(t.view(torch.uint8))
        return view
    if kind == "expand":
        d = next((i for i, n in enumerate(t.shape) if n > 1), None)
        return None if d is None else t.narrow(d, 0, 1).expand(t.shape)
    raise AssertionError(kind)


VIEWS = ("permuted", "rows2", "cols2", "expand")


def _stride_cases():
    for name, op in OPS.items():
        args = op.make()
        for arg in op.tensors:
            for kind in VIEWS:
                view = strided(args[arg], kind)
                if view is None or view.is_contiguous():
                    continue
                for b in op.backends:
                    if b == "torch" or op.triton_stride is None or arg in op.triton_stride:
                        yield pytest.param(name, arg, kind, b, id=f"{name}-{arg}-{kind}-{b}")
        if op.triton_stride == "together":
            yield from (pytest.param(name, None, kind, "triton", id=f"{name}-all-{kind}-triton") for kind in VIEWS)


def _outside(view: torch.Tensor) -> torch.Tensor:
    """The elements of ``view``'s base that the view does not cover."""
    base = view._base
    mask = torch.ones(base.shape, dtype=torch.bool)
    mask.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()).fill_(False)
    return _bits(base)[mask]


@pytest.mark.parametrize("name,arg,kind,backend", list(_stride_cases()))
def test_stride(name, arg, kind, backend):
    """Same result as on contiguous copies, or a ValueError naming the argument on both backends;
    nothing outside a strided view changes (writers write into their view only). ``arg`` None: every
    argument that has such a view at once."""
    op = OPS[name]
    args = op.make()
    views = {a: strided(args[a], kind) for a in ([arg] if arg else op.tensors)}
    views = {a: v for a, v in views.items() if v is not None and not v.is_contiguous()}
    args.update(views)
    around = {a: _outside(v).clone() for a, v in views.items() if v._base is not None}
    check_case(op, args, backend, arg)
    for a, before in around.items():
        assert torch.equal(_outside(views[a]), before), f"{a}: elements outside the view changed"
