"""The Gluon paged indexer (``ops/indexer/gluon.py``, sm_90; the public op's kernel from next_n 4 on for calls
without device value checks, and with ``backend="gluon"``).

Triton's interpreter cannot run Gluon, so its numerics are tested on an sm_90 GPU (``-m gpu``): the fp32
reference on the same fp8 inputs, NaN-poisoned outputs, junk (NaN) keys and scales past every length and junk
page ids past each request's pages, lengths 0 / 1 / 64 / 65 / 700 / 2049 / 3000, next_n 1..4, several items a
persistent CTA. Tolerance as for the compiled Triton kernel (test_indexer_triton.py):
Hopper's fp8 wgmma accumulates in less than fp32 (~2e-4 of the largest logit measured), so 1e-3 of it
elementwise and a cosine diff of 1e-6, with the exact -inf pattern. On the CPU: the kernel compiles for sm_90
through Triton's code generator and ptxas, without ptxas serialising its wgmma; the config and argument errors.
"""

from __future__ import annotations

import pytest
import torch
from test_indexer_triton import PTXAS_NOTES, _bits, _check, _paged_inputs, compile_without_interpreter

from flashdsa.ops import indexer_logits_paged
from flashdsa.ops._gluon import GluonKernels
from flashdsa.testing.inputs import poison

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon kernel needs an sm_90 GPU")

SEQ_LENS = [3000, 1, 64, 65, 700, 0, 2049]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("config", [
    {}, {"chunk_pages": 1, "max_ctas": 3}, {"chunk_pages": 2, "max_ctas": 3}, {"chunk_pages": 4, "max_ctas": 2},
], ids=["default", "one-page-items-3-ctas", "two-page-items-3-ctas", "four-page-items-2-ctas"])
def test_gluon_paged_matches_reference(n, config):
    from flashdsa.ops.indexer.gluon import indexer_logits_paged_gluon
    q, cache, w, ctx, bt, width = _paged_inputs(SEQ_LENS, n, 64, None, 77, seed=n * 7 + 64, device="cuda")
    q = q.contiguous()
    out = indexer_logits_paged_gluon(q, cache, w, ctx, bt, width, out=poison((q.shape[0] * n, width), device="cuda"),
                                     **config)
    ref = indexer_logits_paged(*(t.cpu() for t in (q, cache, w, ctx, bt)), width, backend="torch")
    _check(out.cpu(), ref, rel=1e-3, max_cos_diff=1e-6)
    again = indexer_logits_paged_gluon(q, cache, w, ctx, bt, width, **config)
    assert torch.equal(_bits(out), _bits(again))


@pytest.mark.gpu
@needs_sm90
def test_gluon_paged_rejects_what_it_cannot_run():
    from flashdsa.ops.indexer.gluon import indexer_logits_paged_gluon
    q, cache, w, ctx, bt, width = _paged_inputs([100, 200], 2, 64, None, 7, seed=1, device="cuda")
    with pytest.raises(ValueError, match="q_fp8"):
        indexer_logits_paged_gluon(q.transpose(2, 3).contiguous().transpose(2, 3), cache, w, ctx, bt, width)
    with pytest.raises(ValueError, match="heads"):
        indexer_logits_paged_gluon(q[:, :, :32].contiguous(), cache, w[:, :32], ctx, bt, width)
    with pytest.raises(ValueError, match="out"):
        indexer_logits_paged_gluon(q, cache, w, ctx, bt, width, out=torch.empty(4, width + 1, device="cuda"))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("checks", ["off", "sync", "device"])
def test_public_op_dispatches_next_n_4_to_gluon_from_a_verified_plan(checks, monkeypatch):
    """The public op at next_n 4 runs the Gluon kernel (after the check kernel in the default mode) from a plan
    whose grid and arguments (the cached descriptors encoded) equal Triton's own binding (``_launch.VERIFY``);
    the logits match the reference as the kernel's own test asks, bitwise repeatably and the same in every
    mode; a bad length raises at once in "sync" and as a deferred error in "device", its request's rows -inf
    and the other request's untouched."""
    from flashdsa import _checks, ops
    from flashdsa.ops import _launch, indexer
    from flashdsa.ops.indexer import gluon
    monkeypatch.setattr(_checks, "_MODE", checks)
    monkeypatch.setattr(_launch, "VERIFY", True)
    monkeypatch.setattr(gluon._PLANNED, "plans", {})
    q, cache, w, ctx, bt, width = _paged_inputs(SEQ_LENS, 4, 64, None, 77, seed=11, device="cuda")
    q = q.contiguous()
    ref = indexer_logits_paged(*(t.cpu() for t in (q, cache, w, ctx, bt)), width, backend="torch")
    outs = [indexer_logits_paged(q, cache, w, ctx, bt, width) for _ in range(3)]
    assert indexer._GLUONS.ran == {(indexer._GLUON, "indexer_logits_paged_planned")} and not indexer._GLUONS.failed
    assert len(gluon._PLANNED.plans) == 1
    _check(outs[0].cpu(), ref, rel=1e-3, max_cos_diff=1e-6)
    assert all(torch.equal(_bits(outs[0]), _bits(o)) for o in outs[1:])
    monkeypatch.setattr(_checks, "_MODE", "off")
    assert torch.equal(_bits(outs[0]), _bits(indexer_logits_paged(q, cache, w, ctx, bt, width)))
    monkeypatch.setattr(_checks, "_MODE", checks)
    bad = ctx.clone()
    bad[1, 0] = width + 1
    if checks == "sync":
        with pytest.raises(ValueError, match="^context_lens: expected values <="):
            ops.indexer_logits_paged(q, cache, w, bad, bt, width)
    elif checks == "device":
        out = ops.indexer_logits_paged(q, cache, w, bad, bt, width)
        with pytest.raises(ValueError, match="^context_lens: expected values <=.* earlier indexer_logits_paged"):
            ops.check_errors()
        assert torch.isneginf(out[4:8]).all() and torch.equal(_bits(out[:4]), _bits(outs[0][:4]))


def test_dispatch_rule(monkeypatch):
    """The public op's rule, on CPU with the kernels stood in for: Gluon from next_n 4 on where it applies, in
    every check mode (the default one runs the check kernel first and hands Gluon its sanitised lengths),
    Triton otherwise; ``backend="gluon"`` forces it at any next_n it takes and refuses a call it cannot run;
    a Gluon whose first launch fails falls back to Triton with a warning, for good."""
    from flashdsa import _checks
    from flashdsa.ops import _common, indexer
    ran = []
    monkeypatch.setattr(indexer, "_triton_paged", lambda *a, check=False: ran.append(("triton", check)) or "t")
    monkeypatch.setattr(indexer._module(indexer._GLUON), "indexer_logits_paged_planned",
                        lambda *a: ran.append(("gluon", a[3].tolist())) or "g")
    monkeypatch.setitem(indexer._PAGED, "triton", indexer._triton_paged)
    monkeypatch.setattr(indexer, "pick_backend", lambda b, impls, d, o: _common.pick_backend(b or "triton", impls, d, o))
    monkeypatch.setattr(indexer, "_GLUONS", GluonKernels(indexer._module))
    monkeypatch.setattr(indexer, "_PAGED_FAST", {})
    why = {"value": None}
    real_unsupported = indexer._gluon_paged_unsupported
    monkeypatch.setattr(indexer, "_gluon_paged_unsupported", lambda q, c: why["value"] or (
        real_unsupported(q, c) if indexer._GLUONS.failed else None))
    monkeypatch.setattr(_checks, "DEVICE_CHECKS_ON_CPU", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def call(n, mode, backend=None, bad_len=False):
        monkeypatch.setattr(_checks, "_MODE", mode)
        ran.clear()
        q, cache, w, ctx, bt, width = _paged_inputs([100, 200], n, 64, None, 7, seed=n)
        if bad_len:
            ctx[1, 0] = width + 1
        indexer.indexer_logits_paged(q, cache, w, ctx, bt, width, backend=backend)
        return ran[0][:1] if ran[0][0] == "gluon" else ran[0]

    assert call(4, "off") == ("gluon",) and call(4, "sync") == ("gluon",) and call(4, "device") == ("gluon",)
    assert call(3, "off") == ("triton", False) and call(3, "device") == ("triton", True)
    with _checks.trusted_inputs():
        assert call(4, "device") == ("gluon",)
    # the default mode's check kernel: request 1's bad length zeroes its lengths, the error is deferred
    call(4, "device", bad_len=True)
    assert ran[0][1][0] == [97, 98, 99, 100] and ran[0][1][1] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="^context_lens: expected values <= min.max_context_len.* got 208 .found by "
                                         "the device check of an earlier indexer_logits_paged call"):
        _checks.check_errors()
    assert call(2, "device", backend="gluon") == ("gluon",) and call(1, "off", backend="gluon") == ("gluon",)
    assert call(4, "off", backend="triton") == ("triton", False)
    why["value"] = "an sm_90 GPU"
    indexer._PAGED_FAST.clear()  # (the real reasons are facts of the fast path's key; this stand-in is not)
    assert call(4, "off") == ("triton", False)
    with pytest.raises(ValueError, match="^backend: expected 'gluon' for a call it supports: it needs an sm_90"):
        call(4, "off", backend="gluon")
    why["value"] = None
    indexer._PAGED_FAST.clear()

    def broken(*a):
        raise RuntimeError("no such Gluon op")
    monkeypatch.setattr(indexer._module(indexer._GLUON), "indexer_logits_paged_planned", broken)
    with pytest.raises(RuntimeError, match="no such Gluon op"):  # it ran before: a failure now is a real one
        call(4, "off")
    indexer._GLUONS.ran.clear()
    with pytest.warns(RuntimeWarning, match=r"Gluon kernel \(gluon.py\) failed on this Triton .RuntimeError: no such Gluon op"):
        assert call(4, "off") == ("triton", False)
    assert call(4, "off") == ("triton", False)  # no second attempt
    with pytest.raises(ValueError, match="its first launch failed"):
        call(4, "off", backend="gluon")


def test_gluon_paged_rejects_cpu_tensors():
    pytest.importorskip("triton.experimental.gluon")
    from flashdsa.ops.indexer.gluon import indexer_logits_paged_gluon
    q, cache, w, ctx, bt, width = _paged_inputs([100, 200], 1, 64, None, 7, seed=1)
    with pytest.raises(ValueError, match="sm_90"):
        indexer_logits_paged_gluon(q, cache, w, ctx, bt, width)


def test_launch_config_errors_and_defaults():
    pytest.importorskip("triton.experimental.gluon")
    from flashdsa.ops.indexer.gluon import launch_config
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="chunk_pages"):
        launch_config(64, 1, 32768, cpu, chunk_pages=0)
    with pytest.raises(ValueError, match="next_n"):
        launch_config(64, 5, 32768, cpu)
    want = {1: (2, 2, 0, 8, 2, 8), 2: (4, 1, 1, 16, 1, None), 3: (2, 1, 0, 16, 1, None), 4: (2, 1, 0, 16, 1, None)}
    for n, (nc, dp, pta, nbuf, ctas, chunk) in want.items():
        c = launch_config(64, n, 32768, cpu)
        assert (c["NC"], c["DP"], c["PTA"], c["NBUF"], c["ctas"]) == (nc, dp, pta, nbuf, ctas)
        assert (c["CHUNK_PAGES"] == chunk) if chunk else (8 <= c["CHUNK_PAGES"] <= 64)
        assert c["NBUF"] % c["NC"] == 0   # four consumers: a ring of NBUF / 4 each
        # the consumers' warpgroups and the producers' (padded to one): setmaxnreg's split must fit what the
        # launch reserved, and the launch's CTAs an SM the register file
        warps = 4 * c["NC"] + 4
        assert c["NC"] * 128 * c["REGS_C"] + 128 * c["REGS_P"] <= warps * 32 * c["maxnreg"]
        assert c["ctas"] * warps * 32 * c["maxnreg"] <= 65536
    assert launch_config(64, 2, 32768, cpu, chunk_pages=3)["CHUNK_PAGES"] == 3


_COMPILE_SCRIPT = PTXAS_NOTES + r'''
from flashdsa.ops.indexer import gluon as G
for n in (1, 2, 3, 4):
    k = G.compile_sm90(n)
    assert k.asm["cubin"] and "setmaxnreg" in k.asm["ptx"], n
    notes = ptxas_notes(k)
    assert "C7514" not in notes and "C7515" not in notes, (n, notes[-2000:])
print("compiled")
'''


def test_gluon_kernel_compiles_for_hopper():
    """Every next_n compiles for sm_90 through Triton's code generator and ptxas without a GPU, and ptxas does
    not serialise the wgmma chains (the C7514 note a chain in flight across the loop's back edge causes)."""
    pytest.importorskip("triton.experimental.gluon")
    compile_without_interpreter(_COMPILE_SCRIPT)
