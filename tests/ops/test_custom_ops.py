"""Every public op as a torch custom op: ``torch.library.opcheck`` passes, and ``torch.compile(fullgraph=True)``
of a function calling it gives the eager result bit for bit (the op is one opaque node: the same
implementation runs). CPU: the torch backend everywhere and the Triton interpreter for a few ops,
compiled with ``aot_eager`` (one whole decode step with inductor). GPU: the Triton kernels, inductor,
and CUDA graphs (``mode="reduce-overhead"``)."""

from __future__ import annotations

import inspect

import pytest
import torch

from flashdsa import ops
from flashdsa.cache import layouts
from flashdsa.quant import FP8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SM = 576 ** -0.5
RAW_SCALE = 0.013


def _i32(*vals, device="cpu") -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.int32, device=device)


def _fp8(*shape, g, device) -> torch.Tensor:
    """Small integers in e4m3: exact dot products, so both backends give the same bits."""
    return torch.randint(-6, 7, shape, generator=g).float().to(FP8).to(device)


def _bf16(*shape, g, device) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)


def cases(device) -> dict:
    """name -> (public function, args, kwargs); small shapes (the interpreter runs some of them)."""
    g = torch.Generator().manual_seed(0)
    d = device
    index_cache = layouts.pack_index_pages(_fp8(192, 128, g=g, device="cpu"),
                                           2.0 ** torch.randint(-2, 3, (192,), generator=g).float()).to(d)
    mla = layouts.encode_mla(torch.randn(128, 576, generator=g), "fp8").view(2, 64, 656).to(d)
    mla_bf16 = torch.randn(2, 64, 576, generator=g).to(torch.bfloat16).to(d)
    logits = torch.randint(-20, 20, (3, 100), generator=g).float().to(d)
    q_paged = _fp8(2, 2, 4, 128, g=g, device=d)
    w4 = torch.randint(-3, 4, (4, 4), generator=g).float().to(d)
    q_r, k_r = _fp8(3, 4, 128, g=g, device=d), _fp8(70, 128, g=g, device=d)
    ks_r, ke_r = _i32(0, 5, 9, device=d), _i32(10, 70, 9, device=d)
    k_scale = (2.0 ** torch.randint(-2, 3, (70,), generator=g).float()).to(d)
    w3 = torch.randint(-3, 4, (3, 4), generator=g).float().to(d)
    idx = torch.randint(-1, 128, (2, 1, 8), generator=g).to(torch.int32).to(d)
    return {
        "topk_transform-pages": (ops.topk_transform, (logits, _i32(0, 8, 65, device=d), 8),
                                 dict(page_table=_i32(5, 2, 7, 1, 3, 0, device=d).view(3, 2),
                                      row_starts=_i32(7, 0, 30, device=d))),
        "topk_transform-offsets": (ops.topk_transform, (logits, _i32(70, 1, 9, device=d), 8),
                                   dict(out_offsets=_i32(0, 70, 71, device=d))),
        "indexer_logits_paged": (ops.indexer_logits_paged, (q_paged, index_cache, w4, _i32(5, 6, 70, 71, device=d)
                                                           .view(2, 2), _i32(2, 0, 1, 0, device=d).view(2, 2), 80), {}),
        "indexer_logits_ragged": (ops.indexer_logits_ragged, (q_r, k_r, k_scale, w3, ks_r, ke_r), {}),
        "indexer_topk_ragged": (ops.indexer_topk_ragged, (q_r, k_r, k_scale, w3, ks_r, ke_r, 8),
                                dict(out_offsets=_i32(3, 0, 100, device=d), max_logits_bytes=400)),
        "indexer_quant": (ops.indexer_quant, (_bf16(3, 2, 128, g=g, device=d), torch.rand(3, 32, generator=g).to(d),
                                              torch.rand(3, 32, generator=g).to(d), True), {}),
        "sparse_mla_decode-fp8": (ops.sparse_mla_decode, (_bf16(2, 1, 16, 576, g=g, device=d), mla, idx, SM), {}),
        "sparse_mla_decode-bf16": (ops.sparse_mla_decode, (_bf16(2, 1, 16, 576, g=g, device=d), mla_bf16, idx, SM),
                                   dict(d_v=100)),
        "sparse_mla_prefill": (ops.sparse_mla_prefill, (_bf16(3, 16, 576, g=g, device=d), _bf16(20, 576, g=g, device=d),
                                                        torch.randint(-1, 22, (3, 8), generator=g).to(torch.int32)
                                                        .to(d), SM), {}),
        "dense_mla_prefill": (ops.dense_mla_prefill, (_bf16(3, 16, 576, g=g, device=d), _bf16(20, 576, g=g, device=d),
                                                      _i32(0, 1, 1, 3, device=d), _i32(0, 5, 9, 20, device=d), SM), {}),
        "merge_attention": (ops.merge_attention, (torch.randn(2, 3, 16, generator=g).to(d),
                                                  torch.randn(2, 3, generator=g).to(d),
                                                  torch.randn(2, 3, 16, generator=g).to(d),
                                                  torch.full((2, 3), float("-inf")).to(d)), {}),
        "attention_sinks": (ops.attention_sinks, (_bf16(2, 3, 16, g=g, device=d),
                                                  torch.tensor([[0.5, -1.0, float("-inf")], [2.0, 0.0, 1.0]]).to(d),
                                                  torch.tensor([0.0, float("-inf"), 1.5]).to(d)), {}),
        # kpool, c = 4: one request's first 6 tokens (groups 0 and the unfinished 1), nothing in the ring yet
        "kpool_compress": (ops.kpool_compress, (_bf16(6, 128, g=g, device=d), _bf16(6, 128, g=g, device=d),
                                                _bf16(1, 4, 2, 128, g=g, device=d),
                                                torch.randn(4, 128, generator=g).to(d),
                                                _i32(0, 1, 2, 3, 4, 5, device=d), _i32(0, 0, 0, 0, 0, 0, device=d),
                                                _i32(0, 0, 0, 0, 0, 0, device=d), _i32(3, 5, device=d)), {}),
        "kpool_expand": (ops.kpool_expand, (_i32(0, 2, -1, -1, device=d).view(2, 2), _i32(13, 3, device=d), 4),
                         dict(page_table=_i32(1, 0, 2, 3, device=d).view(2, 2), page_size=256)),
        "store_index_keys": (layouts.store_index_keys, (index_cache.clone(), _i32(5, 64, 127, 1, device=d),
                                                        _fp8(4, 128, g=g, device=d), torch.rand(4, generator=g).to(d)),
                             {}),
        "store_mla-fp8": (layouts.store_mla, (mla.clone(), torch.tensor([3, 64, 127, 0], device=d),
                                              _bf16(4, 576, g=g, device=d)), {}),
        "store_mla-fp8_raw": (layouts.store_mla, (layouts.encode_mla(torch.randn(128, 576, generator=g), "fp8_raw",
                                                                     RAW_SCALE).view(2, 64, 576).to(d),
                                                  torch.tensor([3, 64], device=d), _bf16(2, 576, g=g, device=d),
                                                  RAW_SCALE), {}),
    }


CASES = cases("cpu")
# ops whose Triton kernel the CPU tests run under the interpreter too (the others: torch only, for time)
INTERPRETED = ("topk_transform-pages", "indexer_logits_paged", "indexer_quant", "sparse_mla_decode-fp8",
               "attention_sinks")
WRITERS = ("store_index_keys", "store_mla-fp8", "store_mla-fp8_raw")
# ops whose implementation handles float8 tensors (opcheck's schema test cannot compare those)
FP8_INSIDE = ("indexer_logits_paged", "indexer_logits_ragged", "indexer_topk_ragged", "indexer_quant",
              "kpool_compress",
              "sparse_mla_decode-fp8", "store_index_keys", "store_mla-fp8", "store_mla-fp8_raw")


def _backend_kw(name: str, backend: str | None) -> dict:
    return {} if name in WRITERS or name == "merge_attention" else {"backend": backend}


def _fresh(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _bits(out):
    """The outputs (a writer: its cache) as raw bits, for bitwise comparison."""
    outs = out if isinstance(out, tuple) else (out,)
    return [o.contiguous().view(torch.uint8) if o.is_floating_point() or o.dtype == FP8 else o for o in outs]


def _same(a, b) -> None:
    for x, y in zip(_bits(a), _bits(b), strict=True):
        assert x.shape == y.shape and torch.equal(x, y)


def test_every_public_op_is_registered():
    """Each public op (and the cache writers) is ``torch.ops.flashdsa.<name>``, keeps its documented
    Python signature, and calls the registered op only under torch.compile."""
    public = [getattr(ops, n) for n in ops.__all__ if n not in ("set_value_checks", "check_errors")]
    for fn in public + [layouts.store_index_keys, layouts.store_mla]:
        overload = getattr(torch.ops.flashdsa, fn.__name__).default
        assert fn.op is overload
        assert inspect.signature(fn) == inspect.signature(fn.__wrapped__)
        assert fn.__doc__ == fn.__wrapped__.__doc__
    schema = str(torch.ops.flashdsa.store_mla.default._schema)
    assert "Tensor(a0!) kv_cache" in schema and "Tensor(" not in schema.split("kv_cache")[1]
    assert "Tensor(a0!) index_cache" in str(torch.ops.flashdsa.store_index_keys.default._schema)


def _opcheck_params():
    for name in CASES:
        yield pytest.param(name, None, id=f"{name}-default")
        if name in INTERPRETED:
            yield pytest.param(name, "triton", id=f"{name}-triton")


def _opcheck(name, fn, args, kwargs) -> None:
    """torch.library.opcheck: schema (mutations declared, no aliasing), fake tensors, autograd registration,
    AOT dispatch with dynamic shapes. Its schema test compares every tensor an aten op inside sees with
    ``allclose``, which float8 tensors do not support: for the ops that handle e4m3 tensors that part is
    checked directly instead (only the declared argument changes, no output aliases an input)."""
    utils = [u for u in ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
             if u != "test_schema" or name not in FP8_INSIDE]
    torch.library.opcheck(fn.op, _fresh(args), kwargs, test_utils=utils)
    if name in FP8_INSIDE:
        args = _fresh(args)
        before = [_bits(a)[0].clone() if isinstance(a, torch.Tensor) else a for a in args]
        out = fn.op(*args, **kwargs)
        mutable = {i for i, a in enumerate(fn.op._schema.arguments) if a.alias_info and a.alias_info.is_write}
        for i, (a, b) in enumerate(zip(args, before)):
            if isinstance(a, torch.Tensor) and i not in mutable:
                assert torch.equal(_bits(a)[0], b), f"argument {i} changed"
        storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()}
        for o in (out if isinstance(out, tuple) else (out,) if out is not None else ()):
            assert not o.numel() or o.untyped_storage().data_ptr() not in storages, "an output aliases an input"


@pytest.mark.parametrize("name,backend", list(_opcheck_params()))
def test_opcheck(name, backend):
    fn, args, kwargs = CASES[name]
    _opcheck(name, fn, args, dict(kwargs, **_backend_kw(name, backend)))


def _compiled_vs_eager(name, device, backend, compile_backend):
    fn, args, kwargs = cases(device)[name]
    kw = dict(kwargs, **_backend_kw(name, backend))

    def f(*a):
        out = fn(*a, **kw)
        # something around the op for the compiler to trace; a writer returns its mutated cache
        return (a[0] + 0) if out is None else out

    torch._dynamo.reset()
    want = f(*_fresh(args))
    got = torch.compile(f, fullgraph=True, backend=compile_backend)(*_fresh(args))
    _same(got, want)


@pytest.mark.parametrize("name", list(CASES))
def test_compile_fullgraph_equals_eager(name):
    """torch.compile(fullgraph=True) traces each op (the writers: as mutations of their cache) without a
    graph break, and the result equals eager bit for bit."""
    _compiled_vs_eager(name, "cpu", None, "aot_eager")


@pytest.mark.parametrize("backend", [None, "triton"])
def test_topk_out_buffer_eager_and_compiled(backend):
    """``topk_transform(out=buf)``: eagerly the result is written into ``buf`` and ``buf`` returned; under
    torch.compile (fullgraph) the registered op's result is copied into it. Both equal the call without
    ``out`` bit for bit. The registered op has no ``out`` parameter (a custom op may not return an input)."""
    fn, args, kwargs = CASES["topk_transform-pages"]
    kwargs = dict(kwargs, backend=backend)
    want = fn(*_fresh(args), **kwargs)
    assert [a.name for a in fn.op._schema.arguments if a.name == "out"] == []
    for compiled in (False, True):
        buf = torch.full_like(want, -7)

        def f(*a):
            return fn(*a, **kwargs, out=buf)
        torch._dynamo.reset()
        got = (torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f)(*_fresh(args))
        assert torch.equal(buf, want) and (compiled or got is buf)


def _decode_step(q_paged, index_cache, w, context_lens, block_table, q, mla, backend):
    B, n = context_lens.shape
    logits = ops.indexer_logits_paged(q_paged, index_cache, w, context_lens, block_table, 64 * block_table.shape[1],
                                      backend=backend)
    sel = ops.topk_transform(logits, context_lens.view(-1), 8, page_table=block_table, backend=backend)
    out, lse = ops.sparse_mla_decode(q, mla, sel.view(B, n, -1), SM, backend=backend)
    return out.float() * 2, lse, sel + 1  # exact ops around ours: no rounding the compiler could reorder


def _decode_inputs(device):
    g = torch.Generator().manual_seed(1)
    index_cache = layouts.pack_index_pages(_fp8(192, 128, g=g, device="cpu"), torch.rand(192, generator=g) + 0.5)
    mla = layouts.encode_mla(torch.randn(192, 576, generator=g), "fp8").view(3, 64, 656)
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in (
        _fp8(2, 1, 4, 128, g=g, device="cpu"), index_cache, torch.randn(2, 4, generator=g),
        _i32(70, 100).view(2, 1), _i32(2, 0, 1, 0).view(2, 2), _bf16(2, 1, 16, 576, g=g, device="cpu"), mla)]


def test_compile_decode_step_inductor():
    """A whole decode step (paged logits -> top-k with slots -> sparse MLA) compiled by inductor for the
    CPU, fullgraph: equal to eager."""
    args = _decode_inputs("cpu")
    torch._dynamo.reset()
    want = _decode_step(*args, None)
    got = torch.compile(_decode_step, fullgraph=True)(*args, None)
    _same(got, want)


# ---- GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_opcheck(name):
    fn, args, kwargs = cases("cuda")[name]
    _opcheck(name, fn, args, kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_compile_inductor_equals_eager(name):
    """Inductor (Triton code for the ops around ours) on the GPU, our kernels inside: eager's bits."""
    _compiled_vs_eager(name, "cuda", None, "inductor")


@pytest.mark.gpu
def test_gpu_compile_split_topk_cuda_graphs(monkeypatch):
    """Split-mode top-k (few long rows) under torch.compile(mode="reduce-overhead") with no counters cached
    yet: CUDA-graph trees run the warm-up with its allocations in their private pool and check that pool
    afterwards, so the op keeps no per-stream counters there (in_registered_op); replays equal eager."""
    from flashdsa.ops.topk import split
    monkeypatch.setattr(split, "_ARRIVE", {})
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(4, 8192, generator=g, device="cuda")
    n = torch.tensor([8192, 8000, 3000, 8191], dtype=torch.int32, device="cuda")
    fn = lambda x, n: ops.topk_transform(x, n, 2048) + 1  # noqa: E731
    torch._dynamo.reset()
    step = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, capture, replay
        got = step(x, n).clone()
    assert split._ARRIVE == {}
    assert torch.equal(got, fn(x, n))


@pytest.mark.gpu
def test_gpu_compile_decode_step_cuda_graphs():
    """The decode step under torch.compile(mode="reduce-overhead"): captured into CUDA graphs (default value
    checks on: they run in the warm-up, are skipped in the capture), replays equal eager."""
    args = _decode_inputs("cuda")
    torch._dynamo.reset()
    want = _decode_step(*args, None)
    step = torch.compile(_decode_step, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, capture, replay
        got = step(*args, None)
        _same(tuple(t.clone() for t in got), want)
    ops.check_errors()


@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("overlaps", ["lengths", "logits", "page_table"])
def test_topk_out_overlapping_an_input_is_refused(backend, overlaps):
    """``out=`` sharing memory with an input: the Triton kernel would read rows it already wrote (it returned
    wrong rows, the torch backend right ones). Both refuse it, before any kernel runs; a buffer beside the
    inputs in the same storage is fine."""
    fn, args, kwargs = CASES["topk_transform-pages"]
    logits, lengths, k = _fresh(args)
    table = kwargs["page_table"].clone()
    R = logits.shape[0]
    words = torch.zeros(4 * R * k + logits.numel(), dtype=torch.int32)
    if overlaps == "lengths":
        lengths = words[R * k - 1:R * k - 1 + R].copy_(lengths)
    elif overlaps == "page_table":
        table = words[R * k - 2:R * k - 2 + table.numel()].copy_(table.view(-1)).view(table.shape)
    else:
        logits = words[R * k - 5:R * k - 5 + logits.numel()].view(torch.float32).copy_(logits.view(-1)).view(
            logits.shape)
    kw = dict(kwargs, page_table=table, backend=backend)
    with pytest.raises(ValueError, match="^out: expected a buffer that does not overlap " + overlaps):
        fn(logits, lengths, k, **kw, out=words[:R * k].view(R, k))
    want = fn(logits, lengths, k, **kw)
    beside = words[-R * k:].view(R, k)
    assert fn(logits, lengths, k, **kw, out=beside) is beside and torch.equal(beside, want)


def test_entry_points_refuse_alike():
    """The public function and ``torch.ops.flashdsa.<op>`` refuse the same values (both raise the public
    function's ValueError), and accept the same spellings of a good value: a one-element tensor for a
    float, 0 / 1 for a bool (torch.ops turns those into a float / bool before the op runs). torch.ops also
    turns a bool into a float and any number into a bool: spellings the public function refuses, which
    torch's schema parsing decides before flashdsa sees the call."""
    def both(name, i, value):
        fn, args, kwargs = CASES[name]
        args = list(_fresh(args))
        args[i] = value
        got = []
        for call in (fn, fn.op):
            try:
                got.append(call(*args, **{k: v for k, v in kwargs.items() if k != "backend"}))
            except ValueError as e:
                got.append(str(e))
        return got

    for name, i, bad in (("sparse_mla_decode-fp8", 3, [0.0, -1.0, float("nan"), float("inf"), torch.tensor(-2.0)]),
                         ("sparse_mla_prefill", 3, [0.0, float("nan")]),
                         ("dense_mla_prefill", 4, [-0.5]),
                         ("topk_transform-pages", 2, [0, -3])):
        for value in bad:
            a, b = both(name, i, value)
            assert isinstance(a, str) and a == b, (name, value)
    for name, i, good, same in (("sparse_mla_decode-fp8", 3, torch.tensor(SM), SM),
                                ("indexer_quant", 3, 1, True), ("indexer_quant", 3, 0, False)):
        want = both(name, i, same)[0]
        for got in both(name, i, good):
            _same(got, want)


def test_byte_spans_of_views():
    # check_no_overlap's spans: a contiguous tensor's bytes in one step, any other view's from its strides;
    # both the first to one past the last byte an element covers
    from flashdsa.ops._common import _bytes
    x = torch.arange(60, dtype=torch.float32).view(5, 12)
    for t in (x, x[1:3], x[:, 2:7], x.t(), x[::2, ::3], x[4], x[2, 5:6], x.view(-1)[7:8]):
        end = max(t.data_ptr() + 4 * (sum(i * s for i, s in zip(idx, t.stride())) + 1)
                  for idx in torch.cartesian_prod(*[torch.arange(n) for n in t.shape]).view(-1, t.dim()).tolist())
        assert _bytes(t) == (t.data_ptr(), end), (t.shape, t.stride())
