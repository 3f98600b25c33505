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

import copy
import functools
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from flashdsa.testing.compare import assert_close

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


def same_bits(out, ref, args=None) -> None:
    for i, (o, r) in enumerate(zip(_tensors(out), _tensors(ref), strict=True)):
        assert o.dtype == r.dtype and o.shape == r.shape, \
            f"output {i}: {o.dtype} {list(o.shape)} != {r.dtype} {list(r.shape)}"
        if not torch.equal(_bits(o), _bits(r)):
            bad = (_bits(o) != _bits(r)).nonzero()[0].tolist()
            raise AssertionError(f"output {i} differs first at {bad}: {o[tuple(bad)]} != {r[tuple(bad)]}")


def mla_close(out, ref, args=None) -> None:
    (o, lo), (r, lr) = out, ref
    # bf16, or fp32 where the KV became fp32 (the fp32 cache format: the op then computes in fp32)
    assert o.dtype == r.dtype and o.dtype in (torch.bfloat16, torch.float32) and o.shape == r.shape
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
# Each op: a function of (backend, **args), a builder of its valid args (seeded), the backends and the
# comparison of a backend's result with the torch reference's: compare(out, ref, args).

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

    @functools.cached_property
    def _base(self) -> dict:
        return self.make()

    def args(self) -> dict:
        """Fresh copies of the op's valid arguments (built once: the builders are seeded)."""
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self._base.items()}

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(self._base)

    @functools.cached_property
    def tensors(self) -> tuple[str, ...]:
        return tuple(k for k, v in self._base.items() if isinstance(v, torch.Tensor))


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


def _dense_close(out, ref, args):
    # bf16 P and bf16 out on the GPU: |out - ref| <= 2^-8 max|v| (tests/ops/test_dense_mla_triton.py)
    (o, lo), (r, lr) = out, ref
    assert o.dtype == r.dtype and o.dtype in (torch.bfloat16, torch.float32) and o.shape == r.shape
    assert_close(lo, lr, name="lse", **LSE_TOL)
    v_max = float(args["kv"][:, :512].float().abs().nan_to_num(0.0, 0.0, 0.0).max()) if args["kv"].numel() else 0.0
    assert_close(o, r, name="out", atol=2.0 ** -8 * v_max, max_cos_diff=7e-6)


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


@functools.cache
def _filled_pool() -> KVPool:
    pool = KVPool(DSAConfig.preset("tiny").replace(num_hidden_layers=1), 2, "fp8")
    g = _g(12)
    pool.write(0, torch.arange(128), torch.randn(128, 576, generator=g), _ints_fp8(128, 128, g=g),
               torch.rand(128, generator=g))
    return pool


def _pool() -> KVPool:
    """A one-layer fp8 pool of 2 pages, every slot written (a fresh copy each call)."""
    return copy.deepcopy(_filled_pool())


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
    "encode_mla-fp8_raw": Op(lambda backend, **a: layouts.encode_mla(**a, fmt="fp8_raw", scale=RAW_SCALE),
                             lambda: dict(kv=torch.randn(4, 576, generator=_g(15))), TORCH),
    "decode_mla-fp8": Op(lambda backend, **a: layouts.decode_mla(**a), lambda: dict(rows=_mla_cache("fp8", 1, _g(16))),
                         TORCH, free_rank=("rows",)),
    "decode_mla-fp8_raw": Op(lambda backend, **a: layouts.decode_mla(**a, scale=RAW_SCALE),
                             lambda: dict(rows=_mla_cache("fp8_raw", 1, _g(17))), TORCH, free_rank=("rows",)),
    "KVPool.write": Op(_pool_write, _pool_write_args, TORCH),
    "KVPool.read": Op(lambda backend, **a: _pool().read(0, **a), lambda: dict(slots=torch.tensor([3, 64, 127, 3])),
                      TORCH),
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


# error messages name an argument, or a relation between two
_RELATIONS = ("ke - ks", "row_starts + lengths", "cu_seqlens_kv - cu_seqlens_q")


def check_case(op: Op, args: dict, backend: str, culprit: str | None, expect: str | None = None) -> None:
    """``args`` (``culprit`` = the argument mutated) on ``backend`` against the torch reference on
    contiguous copies of the same values. ``expect``: None (either outcome), "ok", "error" (a ValueError
    naming any argument), or the name the ValueError must start with."""
    ref = _run(op, {k: _fresh(v) for k, v in args.items()}, "torch")
    out = _run(op, args, backend)
    if out[0] == "error":
        msg = out[1]
        if expect not in (None, "error"):
            assert expect != "ok", f"expected a result, got ValueError {msg!r}"
            named = _names_arg(msg, (expect,))
            assert named, f"expected a ValueError naming {expect!r}, got {msg!r}"
        elif ref[0] == "error":
            named = _names_arg(msg, op.names + _RELATIONS)
            assert named, f"a ValueError that names no argument: {msg!r}"
        else:
            # accepted contiguous, rejected as given: only for the layout of the argument it names
            named = culprit is not None and _names_arg(msg, (culprit,))
            assert named, f"rejected {msg!r}, contiguous accepted"
        if backend != "torch":
            assert _run(op, args, "torch") == out, "the backends reject differently"
        return
    assert expect in (None, "ok"), f"accepted, expected a ValueError ({expect})"
    assert ref[0] == "ok", f"{backend} accepted what the reference rejects: {ref[1]}"
    op.compare(out[1], ref[1], args)


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
        args = op.args()
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
    args = op.args()
    views = {a: strided(args[a], kind) for a in ([arg] if arg else op.tensors)}
    views = {a: v for a, v in views.items() if v is not None and not v.is_contiguous()}
    args.update(views)
    around = {a: _outside(v).clone() for a, v in views.items() if v._base is not None}
    check_case(op, args, backend, arg)
    for a, before in around.items():
        assert torch.equal(_outside(views[a]), before), f"{a}: elements outside the view changed"


# ---- classes: dtype, rank, shape ----------------------------------------------------------------------

_WIDER = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32,
          torch.int32: torch.int64, torch.int64: torch.int32, torch.uint8: torch.int8, FP8: torch.uint8}


def _recast(t: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "other":  # the neighbouring dtype: same bits for 1-byte types, same values otherwise
        to = _WIDER[t.dtype]
        return t.view(to) if t.element_size() == to.itemsize else t.to(to)
    if kind == "float":
        return (t.view(torch.uint8) if t.dtype == FP8 else t).to(torch.float32) if not t.is_floating_point() \
            else t.to(torch.float64)
    return (t.float().view(torch.int32) if t.dtype != FP8 else t.view(torch.uint8).int()) if t.is_floating_point() \
        else t.to(torch.int16)


DTYPE_CASES = [pytest.param(name, arg, kind, b, id=f"{name}-{arg}-{kind}-{b}")
               for name, op in OPS.items() for arg in op.tensors for kind in ("other", "float", "int")
               for b in op.backends]


@pytest.mark.parametrize("name,arg,kind,backend", DTYPE_CASES)
def test_dtype(name, arg, kind, backend):
    """Another dtype: a ValueError naming the argument, or (a dtype the op takes too) the reference's result
    on the same inputs. Integer arguments as floats and float arguments as integers are always rejected:
    no silent truncation of slots or lengths."""
    op = OPS[name]
    args = op.args()
    was_float = args[arg].is_floating_point()
    args[arg] = _recast(args[arg], kind)
    must_fail = kind == "float" and not was_float or kind == "int" and was_float
    expect = arg if must_fail else None
    if must_fail and kind == "float" and args[arg].shape[-1] == layouts.MLA_DIM and arg in ("kv_cache", "rows"):
        # fp8_raw's 576 bytes as float32 ARE the fp32 format: the per-tensor scale given with it is what is wrong
        expect = "kv_scale" if name.startswith("sparse_mla") else "scale"
    check_case(op, args, backend, arg, expect=expect)


RANK_CASES = [pytest.param(name, arg, kind, b, id=f"{name}-{arg}-{kind}-{b}")
              for name, op in OPS.items() for arg in op.tensors if arg not in op.free_rank
              for kind in ("unsqueeze", "flatten") for b in op.backends]


@pytest.mark.parametrize("name,arg,kind,backend", RANK_CASES)
def test_rank(name, arg, kind, backend):
    """One more or one fewer dimension: always a ValueError naming an argument."""
    op = OPS[name]
    args = op.args()
    t = args[arg]
    args[arg] = t.unsqueeze(0) if kind == "unsqueeze" else t.reshape(-1) if t.dim() > 1 else t.reshape(-1)[0]
    check_case(op, args, backend, arg, expect="error")


SHAPE_CASES = [pytest.param(name, arg, d, b, id=f"{name}-{arg}-dim{d}-{b}")
               for name, op in OPS.items() for arg in op.tensors for d in range(op.args()[arg].dim())
               for b in op.backends if b == "torch" or op.triton_stride is None]


@pytest.mark.parametrize("name,arg,dim,backend", SHAPE_CASES)
def test_shape(name, arg, dim, backend):
    """One more element along a dim (a copy of the first): a ValueError naming an argument, or (an extra
    page, key, column) the reference's result on the same inputs."""
    op = OPS[name]
    args = op.args()
    t = args[arg]
    args[arg] = torch.cat([t.view(torch.uint8), t.view(torch.uint8).narrow(dim, 0, 1)], dim).view(FP8) \
        if t.dtype == FP8 else torch.cat([t, t.narrow(dim, 0, 1)], dim)
    check_case(op, args, backend, arg)


# ---- classes: value range, empty, NaN / inf ---------------------------------------------------------
# op -> [(case id, change of the op's args, expected: "ok" = the reference's result, else the name the
# ValueError must start with[, why the Triton backend is known to differ: a strict xfail])]

def _set(**changes):
    """A change that replaces arguments; a callable value is applied to the current args."""
    def change(a):
        a.update({k: v(a) if callable(v) else v for k, v in changes.items()})
        return a
    return change


def _put(arg, index, value):
    """A change that writes ``value`` at ``index`` of one argument (fp8: the e4m3 value)."""
    def change(a):
        t = a[arg]
        if t.dtype == FP8:
            t.view(torch.uint8)[index] = torch.tensor(value, dtype=torch.float32).to(FP8).view(torch.uint8)
        else:
            t[index] = value
        return a
    return change


def _e(*shape, dtype=torch.int32):
    return torch.zeros(shape, dtype=dtype)


NAN, INF = float("nan"), float("inf")
BIG = 2 ** 31 - 1

EDGES = {
    "topk_transform-pages": [
        ("lengths-past-L", _put("lengths", 1, 101), "lengths"),
        ("lengths-negative", _put("lengths", 0, -1), "lengths"),
        ("starts-negative", _put("row_starts", 0, -1), "row_starts"),
        ("starts-plus-lengths", _put("row_starts", 2, 36), "row_starts + lengths"),
        ("page-negative-reachable", _put("page_table", (2, 1), -1), "page_table"),
        ("page-negative-unreachable", _put("page_table", (1, 1), -1), "ok"),
        ("page-int32-overflow", _put("page_table", (2, 0), 2 ** 30), "page_table"),
        ("table-too-narrow", _set(page_table=lambda a: a["page_table"][:, :1]), "page_table"),
        ("table-rows-not-dividing", _set(page_table=lambda a: a["page_table"][:2]), "page_table"),
        ("topk-0", _set(topk=0), "topk"),
        ("topk-float", _set(topk=8.0), "topk"),
        ("page_size-0", _set(page_size=0), "page_size"),
        ("topk-equal-length", _set(topk=65), "ok"),
        ("topk-length-plus-1", _set(topk=64), "ok"),
        ("topk-past-L", _set(topk=150), "ok"),
        ("all-lengths-0", _set(lengths=_e(3)), "ok"),
        ("empty-R0", _set(logits=torch.randn(0, 100), lengths=_e(0), page_table=_e(0, 2), row_starts=_e(0)), "ok"),
        ("empty-L0", _set(logits=torch.randn(3, 0), lengths=_e(3), page_table=_e(3, 0), row_starts=_e(3)), "ok"),
        ("nan-inf-logits", lambda a: _put("logits", (2, slice(30, 50)), NAN)(_put("logits", (2, 40), INF)(
            _put("logits", (1, slice(0, 4)), -INF)(a))), "ok"),
        ("all-nan-row", _put("logits", 2, NAN), "ok"),
    ],
    "topk_transform-offsets": [
        ("offsets-negative", _put("out_offsets", 1, -2), "out_offsets"),
        ("offsets-int32-overflow", _put("out_offsets", 0, BIG - 10), "out_offsets"),
        ("offsets-and-table", _set(page_table=_e(3, 2)), "out_offsets"),
        ("lengths-63-64-65", _set(lengths=torch.tensor([63, 64, 65], dtype=torch.int32)), "ok"),
        ("topk-1", _set(topk=1), "ok"),
        ("inf-everywhere", _set(logits=lambda a: torch.full_like(a["logits"], INF)), "ok"),
    ],
    "indexer_logits_ragged": [
        ("ks-past-ke", _put("ks", 0, 11), "ke - ks"),
        ("ke-past-N", _put("ke", 1, 71), "ke"),
        ("ks-negative", _put("ks", 1, -1), "ks"),
        ("empty-T0", _set(q_fp8=lambda a: a["q_fp8"][:0], weights=lambda a: a["weights"][:0], ks=_e(0), ke=_e(0)),
         "ok"),
        ("empty-N0", _set(k_fp8=lambda a: a["k_fp8"][:0], k_scale=lambda a: a["k_scale"][:0], ks=_e(3), ke=_e(3)),
         "ok"),
        ("empty-H0", _set(q_fp8=lambda a: a["q_fp8"][:, :0], weights=lambda a: a["weights"][:, :0]), "ok"),
        ("nan-q", _put("q_fp8", (1, 2, 5), NAN), "q_fp8"),
        ("nan-k", _put("k_fp8", (6, 3), NAN), "k_fp8"),
        ("inf-k_scale", _put("k_scale", 7, INF), "ok"),
        ("nan-k_scale", _put("k_scale", 8, NAN), "ok"),
        ("inf-weights", _put("weights", (1, 0), INF), "ok"),
        ("nan-weights", _put("weights", (0, 3), NAN), "ok"),
    ],
    "indexer_topk_ragged": [
        ("ks-past-ke", _put("ks", 0, 11), "ke - ks"),
        ("budget-below-one-row", _set(max_logits_bytes=100), "max_logits_bytes"),
        ("topk-0", _set(topk=0), "topk"),
        ("offsets-negative", _put("out_offsets", 0, -1), "out_offsets"),
        ("empty-T0", _set(q_fp8=lambda a: a["q_fp8"][:0], weights=lambda a: a["weights"][:0], ks=_e(0), ke=_e(0),
                          out_offsets=_e(0)), "ok"),
        ("empty-N0", _set(k_fp8=lambda a: a["k_fp8"][:0], k_scale=lambda a: a["k_scale"][:0], ks=_e(3), ke=_e(3)),
         "ok"),
        ("all-rows-empty", _set(ks=_i32(4, 4, 70), ke=_i32(4, 4, 70)), "ok"),
        ("nan-k", _put("k_fp8", (6, 3), NAN), "k_fp8"),
    ],
    "indexer_logits_paged": [
        ("lens-past-width", _put("context_lens", (1, 1), 81), "context_lens"),
        ("lens-past-table", _set(max_context_len=200, context_lens=lambda a: _put("context_lens", (1, 1), 129)(a)[
            "context_lens"]), "context_lens"),
        ("lens-negative", _put("context_lens", (0, 0), -1), "context_lens"),
        ("page-past-P-reachable", _put("block_table", (1, 1), 3), "block_table"),
        ("page-negative-reachable", _put("block_table", (1, 1), -1), "block_table"),
        ("junk-pages-unreachable", _put("block_table", (0, 1), -5), "ok"),
        ("width-negative", _set(max_context_len=-1), "max_context_len"),
        ("width-wide", _set(max_context_len=130), "ok"),
        ("empty-B0", _set(q_fp8=lambda a: a["q_fp8"][:0], weights=lambda a: a["weights"][:0],
                          context_lens=_e(0, 2), block_table=_e(0, 2)), "ok"),
        ("empty-n0", _set(q_fp8=lambda a: a["q_fp8"][:, :0], weights=lambda a: a["weights"][:0],
                          context_lens=_e(2, 0)), "ok"),
        ("empty-no-pages", _set(index_cache=lambda a: a["index_cache"][:0], context_lens=_e(2, 2)), "ok"),
        ("empty-width-0", _set(context_lens=_e(2, 2), max_context_len=0), "ok"),
        ("empty-table-0", _set(context_lens=_e(2, 2), block_table=_e(2, 0)), "ok"),
        ("nan-key", lambda a: (index_cache_put(a["index_cache"], 1, 3, NAN), a)[1], "ok",
         "a NaN e4m3 key in the cache reads as a finite value in the Triton kernels (the interpreter's fp8 dot, "
         "the fp16 upcast of pre-sm_89 GPUs); not checked (a whole-cache read), the writers reject NaN keys"),
        ("nan-q", _put("q_fp8", (1, 0, 2, 7), NAN), "q_fp8"),
        ("inf-weights", _put("weights", (2, 1), INF), "ok"),
    ],
    "indexer_quant": [
        ("interleave-int2", _set(interleave=2), "interleave"),  # 0 / 1 are bools (as torch.ops takes them)
        ("large-x", _put("x", (0, 1, slice(0, 128)), 2.0 ** 118), "ok"),  # the bound: all intermediates finite
        ("huge-x", _put("x", (0, 1, slice(0, 64)), 3e38), "x"),  # finite, but the Hadamard sums overflow
        ("huge-cos", _put("cos", (1, 0), 2.5), "cos"),
        ("tiny-x", _set(x=lambda a: a["x"] * 1e-30), "ok"),
        ("empty-T0", _set(x=lambda a: a["x"][:0], cos=lambda a: a["cos"][:0], sin=lambda a: a["sin"][:0]), "ok"),
        ("empty-H0", _set(x=lambda a: a["x"][:, :0]), "ok"),
        ("nan-x", _put("x", (1, 0, 70), NAN), "x"),
        ("inf-x", _put("x", (2, 1, 3), INF), "x"),
        ("nan-cos", _put("cos", (0, 4), NAN), "cos"),
        ("inf-sin", _put("sin", (2, 31), -INF), "sin"),
    ],
    "sparse_mla_decode-bf16": [
        ("skip-slots", _set(indices=lambda a: _put("indices", (1, 0, slice(0, 4)), torch.tensor(
            [-7, 128, BIG, -BIG - 1], dtype=torch.int32))(a)["indices"]), "ok"),
        ("sm_scale-0", _set(sm_scale=0.0), "sm_scale"),
        ("sm_scale-nan", _set(sm_scale=NAN), "sm_scale"),
        ("sm_scale-inf", _set(sm_scale=INF), "sm_scale"),
        ("d_v-0", _set(d_v=0), "d_v"),
        ("d_v-513", _set(d_v=513), "d_v"),
        ("d_v-100", _set(d_v=100), "ok"),
        ("kv_scale-with-bf16", _set(kv_scale=0.5), "kv_scale"),
        ("page-size-32", _set(kv_cache=lambda a: a["kv_cache"].view(4, 32, 576)), "kv_cache"),
        ("empty-B0", _set(q=lambda a: a["q"][:0], indices=lambda a: a["indices"][:0]), "ok"),
        ("empty-s_q0", _set(q=lambda a: a["q"][:, :0], indices=lambda a: a["indices"][:, :0]), "ok"),
        ("empty-h_q0", _set(q=lambda a: a["q"][:, :, :0]), "ok"),
        ("empty-topk0", _set(indices=lambda a: a["indices"][..., :0]), "ok"),
        ("empty-no-pages", _set(kv_cache=lambda a: a["kv_cache"][:0]), "ok"),
        ("nan-q", _put("q", (1, 0, 1, 9), NAN), "ok"),
        ("nan-kv-selected", lambda a: _put("kv_cache", (a["indices"][1, 0, 0] // 64, a["indices"][1, 0, 0] % 64, 3),
                                            NAN)(a), "ok"),
        ("inf-kv-skipped", _put("kv_cache", (1, 63, slice(None)), INF), "ok"),
    ],
    "sparse_mla_decode-fp8": [
        ("kv_scale-with-fp8", _set(kv_scale=1.0), "kv_scale"),
        ("misaligned-rows", _set(kv_cache=lambda a: torch.zeros(2 * 64 * 656 + 1, dtype=torch.uint8)[1:].view(
            2, 64, 656)), "kv_cache"),
        ("inf-scale-selected", lambda a: (_fp8_scale_put(a, INF), a)[1], "ok"),
    ],
    "sparse_mla_decode-fp8_raw": [
        ("kv_scale-missing", _set(kv_scale=None), "kv_scale"),
        ("kv_scale-0", _set(kv_scale=0.0), "kv_scale"),
        ("kv_scale-nan", _set(kv_scale=NAN), "kv_scale"),
    ],
    "sparse_mla_prefill": [
        ("skip-slots", _put("indices", (0, slice(0, 3)), torch.tensor([-7, 20, BIG], dtype=torch.int32)), "ok"),
        ("all-skip", _set(indices=lambda a: torch.full_like(a["indices"], -1)), "ok"),
        ("empty-T0", _set(q=lambda a: a["q"][:0], indices=lambda a: a["indices"][:0]), "ok"),
        ("empty-N0", _set(kv=lambda a: a["kv"][:0]), "ok"),
        ("empty-topk0", _set(indices=lambda a: a["indices"][:, :0]), "ok"),
        ("empty-h_q0", _set(q=lambda a: a["q"][:, :0]), "ok"),
        ("nan-q", _put("q", (2, 1, 500), NAN), "ok"),
        ("inf-kv", _put("kv", 4, INF), "ok"),
    ],
    "dense_mla_prefill": [
        ("cu_q-not-from-0", _put("cu_seqlens_q", 0, 1), "cu_seqlens_q"),
        ("cu_q-not-to-T", _put("cu_seqlens_q", 3, 2), "cu_seqlens_q"),
        ("cu_q-decreasing", _put("cu_seqlens_q", 1, 2), "cu_seqlens_q"),
        ("cu_kv-not-to-N", _put("cu_seqlens_kv", 3, 19), "cu_seqlens_kv"),
        ("kv-shorter-than-q", _set(cu_seqlens_kv=torch.tensor([0, 5, 19, 20], dtype=torch.int32)),
         "cu_seqlens_kv - cu_seqlens_q"),
        ("cu-empty", _set(cu_seqlens_q=_e(0), cu_seqlens_kv=_e(0)), "cu_seqlens_q"),
        ("empty-B0", _set(q=lambda a: a["q"][:0], kv=lambda a: a["kv"][:0], cu_seqlens_q=_e(1), cu_seqlens_kv=_e(1)),
         "ok"),
        ("empty-T0", _set(q=lambda a: a["q"][:0], cu_seqlens_q=_e(4)), "ok"),
        ("nan-q", _put("q", (0, 1, 20), NAN), "ok"),
        ("nan-kv", _put("kv", (18, 10), NAN), "ok"),
    ],
    "merge_attention": [
        ("both-empty", _set(lse_a=lambda a: torch.full_like(a["lse_a"], -INF),
                            lse_b=lambda a: torch.full_like(a["lse_b"], -INF)), "ok"),
        ("empty-rows", _set(**{k: (lambda k: lambda a: a[k][:0])(k) for k in ("out_a", "lse_a", "out_b", "lse_b")}),
         "ok"),
        ("int-out", _set(out_a=lambda a: a["out_a"].to(torch.int32), out_b=lambda a: a["out_b"].to(torch.int32)),
         "out_a"),
    ],
    "store_index_keys": [
        ("slots-repeated", _put("slots", 3, 64), "slots"),
        ("slots-past-cache", _put("slots", 0, 128), "slots"),
        ("slots-negative", _put("slots", 0, -1), "slots"),
        ("empty-N0", _set(slots=_e(0), k_fp8=lambda a: a["k_fp8"][:0], k_scale=lambda a: a["k_scale"][:0]), "ok"),
        ("empty-no-pages", _set(index_cache=lambda a: a["index_cache"][:0], slots=_e(0),
                                k_fp8=lambda a: a["k_fp8"][:0], k_scale=lambda a: a["k_scale"][:0]), "ok"),
        ("nan-key", _put("k_fp8", (2, 100), NAN), "k_fp8"),
    ],
    "gather_index_keys": [
        ("slots-past-cache", _put("slots", 0, 128), "slots"),
        ("slots-negative", _put("slots", 2, -1), "slots"),
        ("slots-repeated", _put("slots", 3, 64), "ok"),
        ("empty-N0", _set(slots=_e(0)), "ok"),
    ],
    "unpack_index_pages": [
        ("n-float", _set(n=3.0), "n"),
        ("n-past-pages", _set(n=129), "n"),
        ("n-0", _set(n=0), "ok"),
    ],
    **{f"store_mla-{f}": [
        ("slots-repeated", _put("slots", 3, 64), "slots"),
        ("slots-past-cache", _put("slots", 0, 128), "slots"),
        ("slots-count", _set(slots=lambda a: a["slots"][:3]), "slots"),
        ("empty-N0", _set(slots=_e(0), kv=lambda a: a["kv"][:0]), "ok"),
        ("inf-kv", _put("kv", (1, 7), INF), "ok"),
        ("scale" + ("-missing" if f == "fp8_raw" else "-given"), _set(scale=None if f == "fp8_raw" else 0.5), "scale"),
    ] for f in layouts.MLA_FORMATS},
    **{f"gather_mla-{f}": [
        ("slots-past-cache", _put("slots", 0, 128), "slots"),
        ("slots-negative", _put("slots", 1, -64), "slots"),
        ("empty-N0", _set(slots=_e(0)), "ok"),
    ] for f in layouts.MLA_FORMATS},
    "KVPool.write": [
        ("slots-repeated", _put("slots", 2, 3), "slots"),
        ("index-slots-repeated", _put("index_slots", 2, 4), "index_slots"),
        ("slots-past-pool", _put("slots", 0, 128), "slots"),
        ("empty-N0", _set(**{k: (lambda k: lambda a: a[k][:0])(k) for k in _pool_write_args()}), "ok"),
    ],
    "KVPool.read": [("slots-past-pool", _put("slots", 0, 128), "slots"), ("empty-N0", _set(slots=_e(0)), "ok")],
    "KVPool.read_index": [("slots-negative", _put("index_slots", 0, -1), "index_slots")],
}


def index_cache_put(cache, page, row, value):
    """One key element (and its scale) of an indexer cache set to ``value``."""
    keys, scales = layouts.index_page_views(cache)
    keys.view(torch.uint8)[page, row, 5] = torch.tensor(value).to(FP8).view(torch.uint8)
    scales[page, row + 1] = value


def _fp8_scale_put(a, value):
    slot = int(a["indices"][1, 0, 0])
    scales = a["kv_cache"][slot // 64, slot % 64, 512:528].view(torch.float32)
    scales[1] = value


def _edge_marks(case, backend):
    known = len(case) > 3 and backend != "torch"
    return [pytest.mark.xfail(strict=True, reason=case[3])] if known else []


EDGE_CASES = [pytest.param(name, i, b, id=f"{name}-{case[0]}-{b}", marks=_edge_marks(case, b))
              for name, cases in EDGES.items() for i, case in enumerate(cases) for b in OPS[name].backends]


@pytest.mark.parametrize("name,i,backend", EDGE_CASES)
def test_edges(name, i, backend):
    """Value range, empty and NaN / inf inputs: the expected ValueError, or the reference's result
    (NaN / inf where the reference has them, nowhere else)."""
    op = OPS[name]
    _, change, expect = EDGES[name][i][:3]
    args = change(op.args())
    check_case(op, args, backend, None, expect)


# ---- the cases of issue #15, as reported --------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_issue_15_topk_strided_metadata(backend):
    """``context_lens[:, 0]`` as lengths (its row 1 is 0: all -1, not [0, 1, 2, 3]) and a page table with
    column stride 2: the same slots as from contiguous copies."""
    logits = torch.randn(4, 100, generator=_g(15))
    context_lens = _i32(7, 0, 0, 3, 100, 1, 64, 2).view(4, 2)
    table = (torch.arange(16, dtype=torch.int32).view(4, 2, 2) * 3)[:, :, 0]
    assert context_lens[:, 0].stride() == (2,) and table.stride() == (4, 2)
    got = ops.topk_transform(logits, context_lens[:, 0], 4, page_table=table, backend=backend)
    want = ops.topk_transform(logits, context_lens[:, 0].contiguous(), 4, page_table=table.contiguous(),
                              backend="torch")
    assert got[1].tolist() == [-1] * 4 and torch.equal(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_issue_15_rejected_alike(backend):
    """A strided index cache (Triton copied it, torch refused it) and a kv_scale a bf16 cache ignored."""
    args = OPS["indexer_logits_paged"].args()
    args["index_cache"] = args["index_cache"][::2]
    with pytest.raises(ValueError, match="index_cache: expected a contiguous tensor"):
        ops.indexer_logits_paged(**args, backend=backend)
    args = OPS["sparse_mla_decode-bf16"].args()
    with pytest.raises(ValueError, match="kv_scale: expected None for a 'bf16' cache"):
        ops.sparse_mla_decode(**args, kv_scale=0.5, backend=backend)
    out, lse = ops.sparse_mla_decode(args["q"][:0], args["kv_cache"], args["indices"][:0], SM, backend=backend)
    assert out.shape == (0, 1, 2, 512) and lse.shape == (0, 1, 2)
