"""The host path of the ops: value-check modes, the device checks and their deferred errors, and the
launch plans (``ops/_launch.py``).

On the CPU the device checks run in Triton's interpreter (``_checks.DEVICE_CHECKS_ON_CPU``): every bad
value of the host checks' cases is still reported as a ValueError naming the argument, now deferred to
the next op call or ``ops.check_errors()``, the call itself reads nothing through the bad value (its
rows come out empty; a bad page id of the paged logits: at least the positions on that page), and good inputs
give the host mode's bits. Plans are checked against Triton's own
binding of the same launch (``_launch.VERIFY``) with a recording stand-in for the compiled kernel; on the
GPU the same with the real ones, and the deferred errors with real device checks."""

from __future__ import annotations

import re

import pytest
import torch

from flashdsa import _checks, ops
from flashdsa.cache import layouts
from flashdsa.ops import _launch
from flashdsa.ops.indexer_quant import rope_model_dtype
from flashdsa.quant import FP8

NAN, INF = float("nan"), float("inf")
SM = 576 ** -0.5


def _i32(*vals, device="cpu") -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.int32, device=device)


def _fp8(*shape, g) -> torch.Tensor:
    return torch.randint(-6, 7, shape, generator=g).float().to(FP8)


def _paged(device="cpu"):
    g = torch.Generator().manual_seed(4)
    a = dict(q_fp8=_fp8(2, 2, 4, 128, g=g),
             index_cache=layouts.pack_index_pages(_fp8(192, 128, g=g), 2.0 ** torch.randint(-3, 3, (192,), generator=g)
                                                  .float()),
             weights=torch.randint(-3, 4, (4, 4), generator=g).float(), context_lens=_i32(5, 6, 70, 71).view(2, 2),
             block_table=_i32(2, 0, 1, 0).view(2, 2), max_context_len=80)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}


def _topk(device="cpu"):
    g = torch.Generator().manual_seed(1)
    a = dict(logits=torch.randint(-20, 20, (3, 100), generator=g).float(), lengths=_i32(0, 8, 65), topk=8,
             page_table=_i32(5, 2, 7, 1, 3, 0).view(3, 2), row_starts=_i32(7, 0, 30))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}


def _topk_offsets(device="cpu"):
    g = torch.Generator().manual_seed(2)
    a = dict(logits=torch.randn(3, 70, generator=g), lengths=_i32(70, 1, 9), topk=8, out_offsets=_i32(0, 70, 71))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}


def _ragged(device="cpu"):
    g = torch.Generator().manual_seed(3)
    a = dict(q_fp8=_fp8(3, 4, 128, g=g), k_fp8=_fp8(70, 128, g=g),
             k_scale=2.0 ** torch.randint(-2, 3, (70,), generator=g).float(),
             weights=torch.randint(-3, 4, (3, 4), generator=g).float(), ks=_i32(0, 5, 9), ke=_i32(10, 70, 9))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}


def _quant(device="cpu"):
    g = torch.Generator().manual_seed(5)
    a = dict(x=torch.randn(3, 2, 128, generator=g).to(torch.bfloat16), cos=torch.rand(3, 32, generator=g),
             sin=torch.rand(3, 32, generator=g), interleave=False)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}


def _put(name, index, value):
    def change(a):
        t = a[name].clone()
        if t.dtype == FP8:
            t.view(torch.uint8)[index] = torch.tensor(value).to(FP8).view(torch.uint8)
        else:
            t[index] = value
        a[name] = t
        return a
    return change


def _set(**new):
    def change(a):
        a.update({k: v(a) if callable(v) else v for k, v in new.items()})
        return a
    return change


# (op, inputs, change, the argument the error names, rows the call must leave empty)
BAD = {
    "paged-lens-past-width": ("indexer_logits_paged", _paged, _put("context_lens", (1, 1), 81), "context_lens", [2, 3]),
    "paged-lens-negative": ("indexer_logits_paged", _paged, _put("context_lens", (0, 0), -1), "context_lens", [0, 1]),
    # a bad page id is never read: the positions on it (request 1's page 1: columns 64..) score -inf
    "paged-page-past-P": ("indexer_logits_paged", _paged, _put("block_table", (1, 1), 3), "block_table",
                          ([2, 3], slice(64, None))),
    "paged-page-negative": ("indexer_logits_paged", _paged, _put("block_table", (1, 1), -1), "block_table",
                            ([2, 3], slice(64, None))),
    "paged-nan-q": ("indexer_logits_paged", _paged, _put("q_fp8", (1, 0, 2, 7), NAN), "q_fp8", []),
    "topk-lengths-past-L": ("topk_transform", _topk, _put("lengths", 1, 101), "lengths", [1]),
    "topk-lengths-negative": ("topk_transform", _topk, _put("lengths", 2, -3), "lengths", [2]),
    "topk-starts-negative": ("topk_transform", _topk, _put("row_starts", 1, -1), "row_starts", [1]),
    "topk-starts-plus-lengths": ("topk_transform", _topk, _put("row_starts", 2, 40), "row_starts + lengths", [2]),
    "topk-table-too-narrow": ("topk_transform", _topk, _set(page_table=lambda a: a["page_table"][:, :1]),
                              "page_table", [2]),
    "topk-page-overflow": ("topk_transform", _topk, _put("page_table", (2, 0), 2 ** 30), "page_table", [2]),
    "topk-offsets-negative": ("topk_transform", _topk_offsets, _put("out_offsets", 1, -2), "out_offsets", [1]),
    "topk-offsets-overflow": ("topk_transform", _topk_offsets, _put("out_offsets", 0, 2 ** 31 - 10), "out_offsets",
                              [0]),
    "ragged-ks-past-ke": ("indexer_logits_ragged", _ragged, _put("ks", 0, 11), "ke - ks", [0]),
    "ragged-ke-past-N": ("indexer_logits_ragged", _ragged, _put("ke", 1, 71), "ke", [1]),
    "ragged-ks-negative": ("indexer_logits_ragged", _ragged, _put("ks", 1, -1), "ks", [1]),
    "ragged-nan-q": ("indexer_logits_ragged", _ragged, _put("q_fp8", (1, 2, 5), NAN), "q_fp8", []),
    "ragged-nan-k": ("indexer_logits_ragged", _ragged, _put("k_fp8", (6, 3), NAN), "k_fp8", []),
    "quant-nan-x": ("indexer_quant", _quant, _put("x", (1, 0, 70), NAN), "x", []),
    "quant-inf-x": ("indexer_quant", _quant, _put("x", (2, 1, 3), INF), "x", []),
    "quant-huge-x": ("indexer_quant", _quant, _put("x", (0, 1, 5), 3e38), "x", []),
    "quant-huge-cos": ("indexer_quant", _quant, _put("cos", (1, 0), 2.5), "cos", []),
    "quant-inf-sin": ("indexer_quant", _quant, _put("sin", (2, 31), -INF), "sin", []),
}
GOOD = {"paged": ("indexer_logits_paged", _paged), "paged-junk-unreachable": (
    "indexer_logits_paged", lambda d="cpu": _put("block_table", (0, 1), -5)(_paged(d))),
    "topk": ("topk_transform", _topk), "topk-offsets": ("topk_transform", _topk_offsets),
    "ragged": ("indexer_logits_ragged", _ragged), "quant": ("indexer_quant", _quant)}


@pytest.fixture
def device_checks(monkeypatch):
    """The default mode's device checks for CPU tensors (their kernels run in the interpreter)."""
    monkeypatch.setattr(_checks, "DEVICE_CHECKS_ON_CPU", True)
    monkeypatch.setattr(_checks, "_MODE", "device")
    try:
        _checks.check_errors()
    except ValueError:
        pass
    yield
    try:
        _checks.check_errors()
    except ValueError:
        pass


def _empty_rows(op: str, out, rows) -> bool:
    """Whether ``out``'s rows ``rows`` (or ``(rows, columns)``) read nothing: -inf logits, -1 slots."""
    if not rows:
        return True
    if isinstance(rows, tuple):
        rows, cols = rows
        return bool(torch.isneginf(out[rows][:, cols]).all())
    if op == "indexer_logits_paged" or op == "indexer_logits_ragged":
        return bool(torch.isneginf(out[rows]).all())
    return bool((out[rows] == -1).all())


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(BAD))
def test_device_checks_defer_the_host_error(case, device_checks):
    """A bad value: the call returns (its bad rows empty: nothing read through the value), the error word
    holds the host check's ValueError, which check_errors() raises once; the next call raises it too."""
    op, make, change, name, rows = BAD[case]
    fn = getattr(ops, op)
    out = fn(**change(make()), backend="triton")
    assert _empty_rows(op, out, rows)
    with pytest.raises(ValueError, match=f"^{re.escape(name)}: expected .* earlier {op} call"):
        ops.check_errors()
    ops.check_errors()  # raised once
    fn(**change(make()), backend="triton")
    with pytest.raises(ValueError, match=f"^{re.escape(name)}: expected"):  # the next op call raises it
        ops.topk_transform(torch.zeros(1, 4), _i32(4), 2)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [c for c in BAD if c.startswith("paged")] + ["paged-good"])
def test_paged_check_kernel_zeroes_the_bad_request(case, device_checks):
    """The check kernel run before the Gluon paged kernel (which has none in-kernel): the same deferred
    error as the Triton kernel's own checks, and the lengths of a request with a bad length or reachable
    page id zeroed (nothing is read for it); a NaN query is reported and changes no length; good inputs
    pass unchanged."""
    from flashdsa.ops import _device_checks
    a = _paged() if case == "paged-good" else BAD[case][2](_paged())
    ctx = _device_checks.check_paged(a["q_fp8"].contiguous(), a["context_lens"], a["block_table"], a["max_context_len"],
                                     a["index_cache"].shape[0])
    want = a["context_lens"].clone()
    if case != "paged-good":
        name, rows = BAD[case][3], BAD[case][4]
        for r in (rows[0] if isinstance(rows, tuple) else rows):
            want[r // 2] = 0
        with pytest.raises(ValueError, match=f"^{re.escape(name)}: expected .* earlier indexer_logits_paged call"):
            ops.check_errors()
    ops.check_errors()
    assert torch.equal(ctx, want)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(GOOD))
def test_device_checks_pass_good_inputs_unchanged(case, device_checks, monkeypatch):
    """Good inputs: no error, and the same bits as with the host checks."""
    op, make = GOOD[case]
    fn = getattr(ops, op)
    got = fn(**make(), backend="triton")
    ops.check_errors()
    monkeypatch.setattr(_checks, "_MODE", "sync")
    want = fn(**make(), backend="triton")
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g.view(torch.uint8) if g.dtype == FP8 else g, w.view(torch.uint8) if w.dtype == FP8 else w)


@pytest.mark.interpreter
def test_topk_repeated_call_skips_only_what_it_already_checked(device_checks, monkeypatch):
    """top-k's fast path: a call whose host-known facts (types, dtypes, shapes, strides, devices, the ints,
    the check mode) equal an earlier checked call's launches without the argument checks, with the same
    bits and the same device checks; a call differing in any of them is checked again (and refused where
    wrong), and a call whose metadata had to be made contiguous is never remembered."""
    from flashdsa.ops import topk
    monkeypatch.setattr(topk, "_FAST", {})
    checked = []
    real = topk.check_tensor
    monkeypatch.setattr(topk, "check_tensor", lambda name, *a, **k: checked.append(name) or real(name, *a, **k))
    want = ops.topk_transform(**_topk(), backend="torch")

    def call(**change):
        checked.clear()
        return ops.topk_transform(**dict(_topk(), **change), backend="triton")

    for first in (True, False):
        assert torch.equal(call(), want) and bool(checked) == first
    assert len(topk._FAST) == 1
    for change, error in [(dict(lengths=_i32(0, 8, 65).long()), "lengths: expected dtype torch.int32"),
                          (dict(lengths=_i32(0, 8)), "lengths: expected shape [3]"),
                          (dict(topk=True), "topk: expected an int >= 1"),
                          (dict(page_size=64.0), "page_size: expected an int >= 1"),
                          (dict(row_starts=_i32(7, 0, 30).view(3, 1)), "row_starts: expected shape [3]"),
                          (dict(logits=_topk()["logits"].t().contiguous().t()), "logits: expected unit stride")]:
        with pytest.raises(ValueError, match=f"^{re.escape(error)}"):
            call(**change)
        assert checked
    strided = _i32(0, -1, 8, -1, 65, -1)[::2]
    for _ in range(2):
        assert torch.equal(call(lengths=strided), want) and checked
    assert len(topk._FAST) == 1
    # the device checks run on the fast path too: a bad value is still reported
    call(lengths=_i32(0, 8, 101))
    assert not checked
    with pytest.raises(ValueError, match="^lengths: expected values <= .*, got 101 .found by the device check"):
        ops.check_errors()
    # another check mode is another key: "sync" checks on the host, at once
    monkeypatch.setattr(_checks, "_MODE", "sync")
    with pytest.raises(ValueError, match="^lengths: expected values <= 100"):
        call(lengths=_i32(0, 8, 101))
    monkeypatch.setattr(_checks, "_MODE", "off")
    for first in (True, False):
        assert torch.equal(call(), want) and bool(checked) == first
    assert len(topk._FAST) == 2


@pytest.mark.interpreter
def test_topk_out_buffer(device_checks, monkeypatch):
    """``topk_transform(out=buf)`` writes the result into ``buf`` (returned), on the fast path too and with
    either backend, with the bits of a call without it; a buffer of the wrong dtype, shape, device or
    layout is a ValueError naming ``out``."""
    from flashdsa.ops import topk
    monkeypatch.setattr(topk, "_FAST", {})
    want = ops.topk_transform(**_topk(), backend="torch")
    for backend in ("triton", "triton", "torch"):
        buf = torch.full_like(want, -7)
        assert ops.topk_transform(**_topk(), backend=backend, out=buf) is buf and torch.equal(buf, want)
    assert len(topk._FAST) == 1
    for bad, error in [(torch.empty(3, 8, dtype=torch.int64), "out: expected dtype torch.int32"),
                       (torch.empty(3, 9, dtype=torch.int32), "out: expected shape [3, 8]"),
                       (torch.empty(8, 3, dtype=torch.int32).t(), "out: expected a contiguous tensor"),
                       (torch.empty(3, 8, dtype=torch.int32, device="meta"), "out: expected a tensor on cpu")]:
        with pytest.raises(ValueError, match=f"^{re.escape(error)}"):
            ops.topk_transform(**_topk(), backend="triton", out=bad)


@pytest.mark.interpreter
def test_paged_repeated_call_skips_only_what_it_already_checked(device_checks, monkeypatch):
    """indexer_logits_paged's fast path: a call whose host-known facts equal an earlier checked call's runs
    the same kernel with the same device checks and without the argument checks, with the same bits; a call
    differing in any of them is checked again (and refused where wrong); strided metadata is never
    remembered; "sync" checks on the host at once."""
    from flashdsa.ops import indexer
    monkeypatch.setattr(indexer, "_PAGED_FAST", {})
    checked = []
    real = indexer.check_tensor
    monkeypatch.setattr(indexer, "check_tensor", lambda name, *a, **k: checked.append(name) or real(name, *a, **k))

    def call(**change):
        checked.clear()
        return ops.indexer_logits_paged(**dict(_paged(), **change), backend="triton")

    want = call()
    for _ in range(2):
        assert torch.equal(call(), want) and not checked
    assert len(indexer._PAGED_FAST) == 1
    a = _paged()
    for change, error in [(dict(context_lens=a["context_lens"].long()), "context_lens: expected dtype torch.int32"),
                          (dict(weights=a["weights"][:3]), "weights: expected shape [4, 4]"),
                          (dict(max_context_len=True), "max_context_len: expected an int >= 0"),
                          (dict(block_table=a["block_table"][:1]), "block_table: expected 2 rows")]:
        with pytest.raises(ValueError, match=f"^{re.escape(error)}"):
            call(**change)
        assert checked
    strided = torch.stack([a["block_table"], a["block_table"]], -1)[..., 0]
    for _ in range(2):
        assert torch.equal(call(block_table=strided), want) and checked
    assert len(indexer._PAGED_FAST) == 1
    out = call(**BAD["paged-lens-past-width"][2](_paged()))  # the device checks run on the fast path too
    assert not checked and _empty_rows("indexer_logits_paged", out, [2, 3])
    with pytest.raises(ValueError, match="^context_lens: expected values <= .* earlier indexer_logits_paged"):
        ops.check_errors()
    monkeypatch.setattr(_checks, "_MODE", "sync")
    with pytest.raises(ValueError, match="^context_lens: expected values <="):
        call(**BAD["paged-lens-past-width"][2](_paged()))


@pytest.mark.interpreter
def test_sparse_mla_decode_repeated_call_skips_only_what_it_already_checked(monkeypatch):
    """sparse_mla_decode's fast path: a call whose host-known facts equal an earlier checked call's runs the
    kernel that call picked without the argument checks, with the same bits; a call differing in any of them
    is checked again (and refused where wrong); a call whose q was widened or whose indices were made
    contiguous is never remembered; a kernel stood in later is the one that runs."""
    from flashdsa.ops import sparse_mla
    monkeypatch.setattr(sparse_mla, "_FAST", {})
    checked = []
    real = sparse_mla.check_tensor
    monkeypatch.setattr(sparse_mla, "check_tensor", lambda name, *a, **k: checked.append(name) or real(name, *a, **k))
    g = torch.Generator().manual_seed(6)
    cache = layouts.encode_mla(torch.randn(128, 576, generator=g), "fp8").view(2, 64, 656)
    q = torch.randn(2, 1, 16, 576, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, 128, (2, 1, 8), generator=g).to(torch.int32)
    want = ops.sparse_mla_decode(q, cache, idx, SM, backend="torch")
    sparse_mla._FAST.clear()

    def call(**change):
        checked.clear()
        a = dict(q=q, kv_cache=cache, indices=idx, sm_scale=SM, backend="triton")
        a.update(change)
        return ops.sparse_mla_decode(**a)

    for first in (True, False):
        out, lse = call()
        assert bool(checked) == first
        assert (out.float() - want[0].float()).abs().max() <= 2 ** -8 * (want[0].float().abs().max() + 1)
    first_out = out
    assert torch.equal(call()[0], first_out) and len(sparse_mla._FAST) == 1
    for change, error in [(dict(indices=idx.long()), "indices: expected dtype torch.int32"),
                          (dict(q=q.float()), "q: expected dtype torch.bfloat16 with a fp8 cache"),
                          (dict(sm_scale=-SM), "sm_scale: expected a finite positive number"),
                          (dict(d_v=0), "d_v: expected an int in 1..512"),
                          (dict(kv_scale=1.0), "kv_scale: expected None for a 'fp8' cache"),
                          (dict(indices=idx[:1]), "indices: expected shape [2, 1, *]")]:
        with pytest.raises(ValueError, match=f"^{re.escape(error)}"):
            call(**change)
        assert checked
    strided = torch.stack([idx, idx], -1)[..., 0]
    for _ in range(2):
        assert torch.equal(call(indices=strided)[0], first_out) and checked
    assert len(sparse_mla._FAST) == 1
    fp32 = torch.randn(2, 64, 576, generator=g)  # the fp32 cache: a bf16 q is widened each call, never remembered
    for _ in range(2):
        call(kv_cache=fp32)
        assert checked
    assert len(sparse_mla._FAST) == 1
    monkeypatch.setitem(sparse_mla._DECODE, "triton", lambda *a: ("stand-in",))
    assert call() == ("stand-in",)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["paged-lens-past-width", "topk-lengths-past-L", "ragged-ke-past-N", "quant-nan-x"])
def test_sync_mode_raises_before_any_kernel(case, monkeypatch):
    """"sync": the host checks, an immediate ValueError, as today's default on CPU tensors."""
    monkeypatch.setattr(_checks, "DEVICE_CHECKS_ON_CPU", True)
    op, make, change, name, _ = BAD[case]
    ops.set_value_checks("sync")
    try:
        with pytest.raises(ValueError, match=f"^{re.escape(name)}: expected"):
            getattr(ops, op)(**change(make()), backend="triton")
    finally:
        ops.set_value_checks(True)


def test_modes_and_their_switch(monkeypatch):
    monkeypatch.setattr(_checks, "_MODE", _checks.value_check_setting())  # restored after the test
    for value, mode in ((False, "off"), ("sync", "sync"), ("debug", "sync"), ("0", "off"), (True, "device"),
                        ("device", "device")):
        ops.set_value_checks(value)
        assert _checks.value_check_setting() == mode
    with pytest.raises(ValueError, match="^enabled: expected"):
        ops.set_value_checks("sometimes")
    with pytest.raises(ValueError, match="^FLASHDSA_CHECK_VALUES: expected"):
        _checks._parse_mode("2", "FLASHDSA_CHECK_VALUES")
    t = torch.zeros(1)
    assert _checks.value_check_mode(t, True) == "host"  # CPU tensors: host checks
    with _checks.trusted_inputs():
        assert _checks.value_check_mode(t, True) is None
    monkeypatch.setattr(_checks, "DEVICE_CHECKS_ON_CPU", True)
    assert _checks.value_check_mode(t, True) == "device" and _checks.value_check_mode(t, False) == "host"
    ops.set_value_checks(False)
    assert _checks.value_check_mode(t, True) is None


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["topk-lengths-past-L", "paged-page-past-P", "quant-nan-x", "ragged-ke-past-N"])
def test_trusted_inputs_launch_no_check(case, device_checks, monkeypatch):
    """Under trusted_inputs no check runs: no check kernel, and the op kernels' own checks compiled out
    (a bad value then raises nothing, deferred or not)."""
    from flashdsa.ops import _device_checks as dc
    calls = []
    monkeypatch.setattr(dc, "check_ragged", lambda *a, **k: calls.append("check_ragged"))
    real = _launch.KernelLauncher.__call__

    def launch(self, key, ptrs, build):
        if build()[1].get("CHECK"):
            calls.append("CHECK")
        return real(self, key, ptrs, build)

    monkeypatch.setattr(_launch.KernelLauncher, "__call__", launch)
    op, make, change, _, _ = BAD[case]
    with _checks.trusted_inputs():
        getattr(ops, op)(**change(make()), backend="triton")
    _checks.check_errors()
    assert not calls


# ---- launch plans ---------------------------------------------------------------------------------------

class _Compiled:
    """Stands in for a CompiledKernel: records the planned launches (nothing runs)."""
    packed_metadata = None
    function = None

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *args):
        self.log.append(("plan", (g0, g1, g2), len(args)))


class _Recording:
    """Stands in for a @triton.jit kernel: runs the real (interpreted) kernel, returns a _Compiled."""

    def __init__(self, real, log):
        self.real, self.log, self.arg_names = real, log, real.arg_names
        self.__name__ = real.__name__ if hasattr(real, "__name__") else str(real)

    def __getitem__(self, grid):
        def run(**kwargs):
            self.real[grid](**kwargs)
            self.log.append(("triton", grid))
            return _Compiled(self.log)
        return run


def _launchers():
    from flashdsa.ops import _device_checks
    from flashdsa.ops.indexer import paged, ragged
    from flashdsa.ops.indexer_quant import triton as quant
    from flashdsa.ops.sparse_mla import triton as mla
    from flashdsa.ops.topk import launch
    found = []
    for mod in (_device_checks, paged, ragged, quant, mla, launch):
        for v in vars(mod).values():
            found += [v] if isinstance(v, _launch.KernelLauncher) else \
                [x for x in v.values() if isinstance(x, _launch.KernelLauncher)] if isinstance(v, dict) else []
    return found


@pytest.fixture
def recording(monkeypatch):
    """Every launcher plans in the interpreter, with a recording compiled kernel, and verifies each plan
    against Triton's binding of the same call."""
    log = []
    monkeypatch.setattr(_launch, "PLANS_IN_INTERPRETER", True)
    monkeypatch.setattr(_launch, "VERIFY", True)
    for launcher in _launchers():
        monkeypatch.setattr(launcher, "kernel", _Recording(launcher.kernel, log))
        monkeypatch.setattr(launcher, "plans", {})
        monkeypatch.setattr(launcher, "refused", False)  # restored afterwards: a test may leave it set
    yield log
    assert not [lch.kernel for lch in _launchers() if lch.refused]


def _mla_decode(fmt):
    def make(device="cpu"):
        g = torch.Generator().manual_seed(6)
        kv = torch.randn(128, 576, generator=g)
        cache = layouts.encode_mla(kv, fmt, 0.013 if fmt == "fp8_raw" else None).view(2, 64, -1)
        # top-520: two splits of the top-k list (flash-decoding), so the combine kernel runs too
        a = dict(q=torch.randn(2, 1, 16, 576, generator=g).to(torch.bfloat16), kv_cache=cache,
                 indices=torch.randint(-1, 128, (2, 1, 520), generator=g).to(torch.int32), sm_scale=SM,
                 **({"kv_scale": 0.013} if fmt == "fp8_raw" else {}))
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    return make


PLANNED = {
    "paged": (ops.indexer_logits_paged, _paged),
    "topk-pages": (ops.topk_transform, _topk),
    "topk-offsets": (ops.topk_transform, _topk_offsets),
    "ragged": (ops.indexer_logits_ragged, _ragged),
    "quant": (ops.indexer_quant, _quant),
    "rope": (rope_model_dtype, _quant),  # indexer_quant's kernel, rope only (kpool's key): no value checks
    "decode-fp8-split": (ops.sparse_mla_decode, _mla_decode("fp8")),
    "decode-bf16": (ops.sparse_mla_decode, _mla_decode("bf16")),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("checks", ["device", "off"])
@pytest.mark.parametrize("case", list(PLANNED))
def test_second_call_launches_the_verified_plan(case, checks, recording, device_checks, monkeypatch):
    """The first call of a shape takes Triton's launch and makes a plan; the second (new tensors, same
    shapes) launches the plan, whose grid and arguments equal Triton's binding of that call (VERIFY).
    With the device checks on, their kernels are planned and verified the same way."""
    fn, make = PLANNED[case]
    monkeypatch.setattr(_checks, "_MODE", checks)
    fn(**make(), backend="triton")
    first = list(recording)
    assert first and all(e[0] == "triton" for e in first)
    recording.clear()
    fn(**make(), backend="triton")
    assert [e[0] for e in recording] == ["plan"] * len(first)


@pytest.mark.interpreter
def test_launcher_variants_plan_and_verify(recording, monkeypatch):
    """The launch variants tests and benchmarks reach through a config: the TMA paged kernel (interpreted),
    top-k split mode (one launch a row group, cached counters) and fused, misaligned pointers (no plan)."""
    from flashdsa.ops.indexer import paged
    from flashdsa.ops.topk import launch
    a = _paged()
    for cfg in (paged.PagedConfig(tma=True), paged.PagedConfig()):
        for _ in range(2):
            paged.indexer_logits_paged(*[a[k] for k in ("q_fp8", "index_cache", "weights", "context_lens",
                                                       "block_table", "max_context_len")], config=cfg)
    t = _topk()
    for kind in ("split", "fused", "rows"):
        cfg = launch.default_config(3, 100, 8, 4, kind=kind)
        for _ in range(2):
            launch.topk_transform(t["logits"], t["lengths"], 8, t["page_table"], t["row_starts"], None, 64, config=cfg)
    assert [e[0] for e in recording] == ["triton", "plan"] * 5
    recording.clear()
    logits = torch.zeros(3 * 100 + 1)[1:].view(3, 100)  # 4-byte aligned, not 16: Triton's own launch
    for _ in range(2):
        launch.topk_transform(logits, t["lengths"], 8, None, None, None, 64)
    assert [e[0] for e in recording] == ["triton", "triton"]


@pytest.mark.interpreter
def test_a_launcher_that_refuses_plans_falls_back(recording, monkeypatch):
    """Should a Triton's launcher take the plan's arguments otherwise (a TypeError before launching), the
    launch goes Triton's own way, with a warning, and planning stops for that kernel."""
    from flashdsa.ops.topk import launch
    t = _topk()

    def refuse(self, *args):
        raise TypeError("launch() takes other arguments")

    monkeypatch.setattr(_Compiled, "run", refuse)
    call = lambda: launch.topk_transform(t["logits"], t["lengths"], 8, None, None, None, 64)  # noqa: E731
    call()
    with pytest.warns(RuntimeWarning, match="planned launches of topk_fused_kernel failed"):
        call()
    call()
    assert [e[0] for e in recording] == ["triton"] * 3 and launch._FUSED.refused
    monkeypatch.setattr(launch._FUSED, "refused", False)  # for the fixture's check


def _only(cache: dict, buf: torch.Tensor) -> bool:
    return len(cache) == 1 and next(iter(cache.values())) is buf


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["fused", "split"])
def test_topk_scratch_is_kept_per_stream_for_eager_calls(kind, monkeypatch):
    """Eager top-k calls on one stream share one scratch buffer, grown for a larger shape; calls as the
    registered op (compiled graphs), with the cache switched off, or above the size cap allocate their own
    and leave the cache as it was. Every call gives the reference's bits."""
    from flashdsa.ops.topk import launch
    monkeypatch.setattr(launch, "_SCRATCH", {})
    used = []
    real = launch.scratch_buffer
    monkeypatch.setattr(launch, "scratch_buffer", lambda dev, n, capturing=None: used.append(real(dev, n, capturing)) or used[-1])
    g = torch.Generator().manual_seed(3)

    def call(rows, fn=None):
        logits = torch.randn(rows, 100, generator=g)
        lengths = torch.randint(0, 101, (rows,), generator=g, dtype=torch.int32)
        cfg = launch.default_config(rows, 100, 8, 4, kind=kind)
        out = launch.topk_transform(logits, lengths, 8, None, None, None, 64, config=cfg) if fn is None else \
            fn(logits, lengths, 8, backend="triton")
        assert torch.equal(out, ops.topk_transform(logits, lengths, 8, backend="torch"))

    call(3)
    call(3)
    assert used[0] is used[1] and _only(launch._SCRATCH, used[0])
    call(6)  # more rows: more scratch, the cache grows
    assert used[2].numel() > used[0].numel() and _only(launch._SCRATCH, used[2])
    call(3, torch.ops.flashdsa.topk_transform)  # the registered op: its own
    monkeypatch.setattr(launch, "CACHED_SCRATCH", False)
    call(3)
    monkeypatch.setattr(launch, "CACHED_SCRATCH", True)
    monkeypatch.setattr(launch, "SCRATCH_CACHE_MAX", used[0].numel() - 1)
    call(3)
    assert len(used) == 6 and all(u is not used[2] for u in used[3:])
    assert _only(launch._SCRATCH, used[2])


class CudaLauncher:
    """Triton 3.6's launcher, as far as a plan relies on it (the name and ``__call__``'s parameters are
    what ``_launch._raw_launch`` recognises): ``__call__`` passes the C launch function the cooperative /
    PDL flags and no scratch, behind the tensor-descriptor wrapper when the kernel takes descriptors."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, c_launch, descs: dict):
        self.launch = c_launch if not descs else _wrap_descs(c_launch, set(descs), list(descs.values()))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None,
                    *args)


def _wrap_descs(launcher, tensordesc_indices, tensordesc_meta):
    """Triton 3.6's ``wrap_handle_tensordesc``: each descriptor argument expanded by the encoder."""
    def inner(*args):
        final_args, k = list(args[:13]), 0
        for i, arg in enumerate(args[13:]):
            if i in tensordesc_indices:
                final_args.extend(_launch._make_tensordesc_arg(arg, tensordesc_meta[k]))
                k += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner


class _CLaunch:
    """The generated C launch function (a callable without Python code): calls the enter / exit hooks
    (arguments 11 and 12) with the launch metadata (10) when they are not None, records its arguments."""
    def __init__(self, calls):
        self.calls = calls

    def __call__(self, *args):
        if args[11] is not None:
            args[11](args[10])
        self.calls.append(args)
        if args[12] is not None:
            args[12](args[10])


class _Desc:
    def __init__(self, ptr):
        self.ptr, self.shape, self.strides = ptr, [ptr % 97, 128], [128, 1]


@pytest.mark.parametrize("with_desc", [False, True])
def test_plan_calls_the_c_launch_as_tritons_launcher_would(with_desc, monkeypatch):
    """Under Triton 3.6's launcher a plan calls the C launch function itself, with exactly the arguments
    the launcher would pass it (hooks None), a descriptor encoded once however often it is launched; with
    a launch hook installed it goes through the launcher (hooks and launch metadata included)."""
    from triton import knobs
    encodes, calls = [], []
    monkeypatch.setattr(_launch, "_INTERPRET", False)
    monkeypatch.setattr(_launch, "_make_tensordesc_arg",
                        lambda d, m: encodes.append(d) or [("map", d.ptr, m), *d.shape, *d.strides])
    descs = {2: {"swizzle": 128}} if with_desc else {}
    run = CudaLauncher(_CLaunch(calls), descs)
    compiled = type("Compiled", (), dict(run=run, function=11, packed_metadata=(4, 1, 0),
                                         launch_metadata=lambda self, grid, stream, *a: ("meta", grid)))()
    args = [None, 3, _Desc(0x1000) if with_desc else None, None, "c"]
    plan = _launch._Plan(compiled, (5, 2), args, (0, 3) if with_desc else (0, 2, 3), 0, lambda: 0, lambda dev: 77)
    assert plan.raw is not None
    ptrs = (0xA0, 0xB0) if with_desc else (0xA0, 0xC0, 0xB0)
    assert plan.launch(ptrs) and plan.launch(ptrs)
    got = calls[:]
    calls.clear()
    full = [0xA0, 3, args[2] if with_desc else 0xC0, 0xB0, "c"]
    run(5, 2, 1, 77, 11, (4, 1, 0), None, None, None, *full)  # what Triton's launch would do, no hooks
    assert got == calls * 2 and encodes == ([args[2]] * 2 if with_desc else [])  # the plan: once; Triton: again
    assert len(got[0]) == 13 + len(full) + (4 if with_desc else 0)
    calls.clear()
    hook = knobs.HookChain()
    hook.add(lambda meta: calls.append(("hook", meta)))
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    assert plan.launch(ptrs)
    assert calls[0] == ("hook", ("meta", (5, 2, 1))) and calls[1][11] is hook  # via the launcher, with metadata


def test_other_launchers_are_called_as_they_are():
    """A launcher of another shape (Triton 3.9's, a stand-in) is never called around: the plan calls
    ``compiled.run``."""
    class CudaLauncher:  # noqa: N801 - the name _raw_launch looks at
        global_scratch_size = profile_scratch_size = 0

        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, enter, leave,
                     *args):
            pass
    compiled = type("Compiled", (), dict(run=CudaLauncher(), function=0, packed_metadata=None,
                                         launch_metadata=lambda self, *a: None))()
    assert _launch._raw_launch(compiled, 3) is None
    assert _launch._raw_launch(_Compiled([]), 3) is None


# ---- GPU ----------------------------------------------------------------------------------------------

GPU_BAD = ["paged-lens-past-width", "paged-page-past-P", "paged-nan-q", "topk-lengths-past-L", "topk-table-too-narrow",
           "topk-offsets-overflow", "ragged-ke-past-N", "ragged-nan-k", "quant-huge-cos"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_BAD)
def test_gpu_deferred_error_then_the_device_still_works(case):
    """On CUDA, by default: the call returns without a host sync, its bad rows empty; after a sync the error
    is the host check's ValueError; the device is fine afterwards (no illegal access, no device assert)."""
    op, make, change, name, rows = BAD[case]
    fn = getattr(ops, op)
    ops.check_errors()
    out = fn(**change(make("cuda")))
    torch.cuda.synchronize()
    assert _empty_rows(op, out, rows)
    with pytest.raises(ValueError, match=f"^{re.escape(name)}: expected .* earlier {op} call"):
        ops.check_errors()
    good = fn(**make("cuda"))
    ops.check_errors()
    ops.set_value_checks("sync")
    try:
        want = fn(**make("cuda"))
        with pytest.raises(ValueError, match=f"^{re.escape(name)}: expected"):  # sync mode: immediate
            fn(**change(make("cuda")))
    finally:
        ops.set_value_checks(True)
    for g, w in zip(good if isinstance(good, tuple) else (good,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g.view(torch.uint8) if g.dtype == FP8 else g, w.view(torch.uint8) if w.dtype == FP8 else w)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(PLANNED))
def test_gpu_plans_equal_tritons_launch(case, monkeypatch):
    """Real compiled kernels: every planned launch verified against Triton's binding, and its output equal
    to the first (Triton-launched) call's, bit for bit, with the device checks on and off."""
    fn, make = PLANNED[case]
    monkeypatch.setattr(_launch, "VERIFY", True)
    for mode in (True, False):
        ops.set_value_checks(mode)
        try:
            outs = [fn(**make("cuda")) for _ in range(3)]
        finally:
            ops.set_value_checks(True)
        ops.check_errors()
        for o in outs[1:]:
            for g, w in zip(o if isinstance(o, tuple) else (o,), outs[0] if isinstance(outs[0], tuple) else (outs[0],)):
                assert torch.equal(g, w)
    assert not [lch.kernel for lch in _launchers() if lch.refused]


@pytest.mark.gpu
def test_gpu_graph_capture_with_default_checks():
    """Default checks on: the ops capture into a CUDA graph (the device checks are skipped there) and the
    replays, with the metadata refreshed in place, equal eager calls."""
    from flashdsa.testing.timing import capture_graph
    a = _paged("cuda")
    t = _topk("cuda")
    got = []

    def step():
        got[:] = [ops.indexer_logits_paged(**a), ops.topk_transform(**t)]

    step()
    want = list(got)
    graph = capture_graph(step)  # a warm-up call on a side stream, then the capture: ``got`` holds its outputs
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    a["context_lens"].copy_(_i32(3, 4, 64, 65).view(2, 2))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], ops.indexer_logits_paged(**a))
    ops.check_errors()


@pytest.mark.gpu
# split mode (at 64 x 8K the rows kernel runs: it has no scratch), fused mode
@pytest.mark.parametrize("R,L", [(64, 32768), (512, 4096)])
def test_gpu_cached_scratch_equals_fresh_scratch(R, L, monkeypatch):
    """Top-k on the per-stream cached scratch gives the bits of a fresh scratch each call, eagerly and
    replayed from a CUDA graph; the capture takes a scratch of its own (the graph keeps its address)."""
    from flashdsa.ops.topk import launch
    from flashdsa.testing.timing import capture_graph
    used = []
    real = launch.scratch_buffer
    monkeypatch.setattr(launch, "scratch_buffer", lambda dev, n, capturing=None: used.append(real(dev, n, capturing)) or used[-1])
    g = torch.Generator(device="cuda").manual_seed(R)
    logits = torch.randn(R, L, generator=g, device="cuda")
    lengths = torch.randint(0, L + 1, (R,), generator=g, device="cuda", dtype=torch.int32)
    table = torch.randperm(R * L // 64, generator=g, device="cuda").to(torch.int32).view(R, L // 64)
    call = lambda: ops.topk_transform(logits, lengths, 2048, page_table=table)  # noqa: E731
    monkeypatch.setattr(launch, "CACHED_SCRATCH", False)
    want = call()
    monkeypatch.setattr(launch, "CACHED_SCRATCH", True)
    got = [call() for _ in range(3)]
    assert used[-1] is used[-2] is used[-3]
    for o in got:
        assert torch.equal(o, want)
    out = []
    graph = capture_graph(lambda: out.__setitem__(slice(None), [call()]))
    # the capture's own scratch; the warm-up (on a side stream, not captured) cached one for that stream
    cached = list(launch._SCRATCH.values())
    assert all(used[-1] is not b for b in cached) and any(used[-2] is b for b in cached)
    call()  # an eager call in between does not disturb the replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], want)
    ops.check_errors()
