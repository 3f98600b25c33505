"""Compile a Triton kernel for sm_90 on a machine without a GPU and report its registers, spills and
global load / store widths (what the H200 would run, up to Triton version differences).

    python benchmarks/sass_report.py topk [--sass FILE]
    python benchmarks/sass_report.py kernels [--sass FILE]   # indexer, sparse MLA, indexer_quant

Uses the ptxas / nvdisasm that ship inside Triton, so no CUDA toolkit or GPU is needed. Each case
below builds the launch the library would make (same constexprs, num_warps, register cap) for one
shape; the arguments' 16-divisibility is specialised as Triton's launcher does for tensors and for
integers divisible by 16. The GPU box may run another Triton: treat the numbers as a guide and confirm
speed there.

To check that a change keeps the SASS, run ``--sass`` on both versions (the older one from a
``git worktree``, with its own copy of this script) and diff the files; kernel names may differ.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_TY = {torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8",
       torch.float8_e4m3fn: "*fp8e4nv", torch.bfloat16: "*bf16"}


def compile_sm90(kernel, args: dict, constexprs: dict, num_warps: int, maxnreg: int = 0):
    """triton.compile of ``kernel`` for sm_90 with ``args`` (name -> tensor / int) as the launcher would
    specialise them. Returns the compiled kernel (``.asm['ptx']``, ``.asm['cubin']``)."""
    fn = kernel
    names = fn.arg_names
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        v = args[name]
        if isinstance(v, torch.Tensor):
            sig[name] = _TY[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i64" if abs(int(v)) >= 2 ** 31 else "i32"
            if int(v) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def ptxas_and_sass(k) -> tuple[str, str]:
    """``ptxas -v``'s report of a compiled kernel's PTX (registers, spills, the C75xx notes) and its SASS."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(k.asm["ptx"])
        (Path(d) / "k.cubin").write_bytes(k.asm["cubin"])
        # the ptxas Triton itself uses for sm_90 (Triton 3.9 ships an older one beside it that rejects its PTX)
        ptxas = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(Path(d) / "k.ptx"), "-o",
                                str(Path(d) / "k2.cubin")], capture_output=True, text=True).stderr
        sass = subprocess.run([str(_BIN / "nvdisasm"), "-c", str(Path(d) / "k.cubin")], capture_output=True,
                              text=True).stdout
    return ptxas, sass


def gluon_report(k, name: str, sass_dir: str | None = None, ir: str = "llir") -> str:
    """One line of what ptxas made of a compiled (Gluon) kernel ``k``: shared memory, setmaxnreg, spills, the
    tensor-core and barrier counts, ptxas' C75xx notes; ``sass_dir``: also write its SASS and ``ir`` (llir with
    debug locations: which source line each barrier stands in front of; or ptx) there as ``name``.sass / .ir."""
    ptxas, sass = ptxas_and_sass(k)
    if sass_dir:
        Path(sass_dir).mkdir(parents=True, exist_ok=True)
        (Path(sass_dir) / f"{name}.sass").write_text(sass)
        (Path(sass_dir) / f"{name}.{ir}").write_text(k.asm[ir])
    notes = [ln.split(": ", 1)[-1] for ln in ptxas.splitlines() if "C75" in ln]
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    regs = re.findall(r"setmaxnreg[.]\w+[.]sync[.]aligned[.]u32\s+(\d+)", k.asm["ptx"])
    # named barriers by id (each partition syncs its own warps on its own id)
    bars = re.findall(r"BAR\.SYNC\.DEFER_BLOCKING (0x[0-9a-f]+)", sass)
    return (f"{name}: shared {k.metadata.shared} B, setmaxnreg {regs}, spill st/ld {spill.groups() if spill else '?'} B, "
            f"HGMMA {sass.count('HGMMA')}, QGMMA {sass.count('QGMMA')}, DEPBAR {len(re.findall(r'WARPGROUP.DEPBAR', sass))}, "
            f"LDG.128 {sass.count('LDG.E.128')}, STS.128 {sass.count('STS.128')}, named barriers "
            f"{dict(sorted((b, bars.count(b)) for b in set(bars)))}, notes {notes or 'none'}")


def report(name: str, k, sass_path: str | None = None) -> dict:
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        sass = subprocess.run([str(_BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
        res = subprocess.run([str(_BIN / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    if sass_path:
        Path(sass_path).write_text(sass)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    row = {"kernel": name, "regs": int(regs.group(1)) if regs else None,
           "stack_bytes": int(stack.group(1)) if stack else None,
           "LDL": len(re.findall(r"\bLDL\b", sass)), "STL": len(re.findall(r"\bSTL\b", sass)),
           "BAR": len(re.findall(r"\bBAR\.SYNC", sass))}
    loads = re.findall(r"ld\.global[\w.:]*", ptx)
    widths = ("v4.b32", "v2.b64", "v2.b32", ".b32", ".b64")
    row["ld.global"] = {w: sum(1 for x in loads if x.endswith(w)) for w in widths}
    row["sass_lines"] = sass.count("\n")
    return row


# (rows, length, output, ragged row starts): shapes whose default launches (k = 2048, an H200) cover the three
# kernels (64 x 8192 is the rows kernel's), both sizes of the fused one, the streamed finisher of split mode and
# every translation
TOPK_CASES = ((4096, 8192, "plain", False), (4096, 8192, "pages", False), (4096, 8192, "offsets", False),
              (4096, 8192, "offsets", True), (1024, 4096, "pages", False), (64, 3072, "pages", False),
              (4096, 32768, "plain", False), (4096, 32768, "pages", False), (4096, 32768, "offsets", True),
              (64, 32768, "plain", False), (64, 8192, "pages", False), (64, 32768, "pages", False),
              (64, 32768, "offsets", True), (64, 131072, "plain", False), (8, 131072, "pages", False))


def topk_cases():
    """(name, kernel, args, constexprs, num_warps, maxnreg) of the default top-k launch of each TOPK_CASES
    shape: the launcher runs on empty CPU tensors (only shapes, strides and dtypes matter) with
    ``default_config(..., sms=132)`` and the kernels replaced by a recorder."""
    from flashdsa.ops.topk import launch
    cases = []
    for R, L, output, ragged in TOPK_CASES:
        x = torch.empty(R, L)
        n = torch.empty(R, dtype=torch.int32)
        table = torch.empty(R, (L + 63) // 64, dtype=torch.int32) if output == "pages" else None
        offsets = torch.empty(R, dtype=torch.int32) if output == "offsets" else None
        starts = torch.empty(R, dtype=torch.int32) if ragged else None
        captured = {}

        class _Grab:
            def __init__(self, kern):
                self.kern = kern

            def __getitem__(self, grid):
                def launch(*a, **kw):
                    captured.update(kern=self.kern, args=a, kw=kw)
                return launch
        # the launchers hold the kernels (launch._FUSED / _SPLIT / _ROWS, ops/_launch.KernelLauncher)
        saved = launch._FUSED.kernel, launch._SPLIT.kernel, launch._ROWS.kernel, launch.interpreting
        launch._FUSED.kernel, launch._SPLIT.kernel, launch._ROWS.kernel = _Grab(saved[0]), _Grab(saved[1]), _Grab(saved[2])
        launch.interpreting = lambda: False
        try:
            launch.topk_transform(x, n, 2048, table, starts, offsets, 64,
                                  config=launch.default_config(R, L, 2048, sms=132))
        finally:
            launch._FUSED.kernel, launch._SPLIT.kernel, launch._ROWS.kernel, launch.interpreting = saved
            for launcher in (launch._FUSED, launch._SPLIT, launch._ROWS):
                launcher.plans.clear()
        kern, a, kw = captured["kern"], captured["args"], dict(captured["kw"])
        nw, mr = kw.pop("num_warps"), kw.pop("maxnreg", 0)
        names = kern.arg_names
        consts = {k: v for k, v in kw.items() if k in names and not isinstance(v, torch.Tensor)
                  and k[:1].isupper()}
        args = dict(zip(names, a))
        args.update({k: v for k, v in kw.items() if k not in consts})
        name = f"{kern.fn.__name__} {R}x{L} {output}" + (" row_starts" if ragged else "")
        cases.append((name, kern, args, consts, nw, mr))
    return cases


# ---- the default launches of the indexer, sparse MLA and indexer_quant kernels ------------------------------

class _CompileForSm90:
    """Inside ``with _CompileForSm90() as kernels:`` a ``kernel[grid](...)`` launch compiles for sm_90 instead of
    running: Triton's own binder specialises the arguments (constexprs, 16-divisibility, launch options) as the
    GPU launcher would, and the compiled kernel is appended to ``kernels``. ``num_sms`` reads 132 (an H200) in
    every launcher module, so the launch shapes are the H200's."""

    def __enter__(self) -> list:
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature
        kernels = []
        target = GPUTarget("cuda", 90, 32)

        def run(fn, *args, grid, warmup, **kw):
            kw.update(debug=False, instrumentation_mode="", fpsan_homomorphic_casts=False)
            backend = make_backend(target)
            bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kw)
            options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, options)
            k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
            kernels.append((fn.fn.__name__, k))
            return k

        from flashdsa.ops._launch import KernelLauncher
        self.saved = [(JITFunction, "run", JITFunction.run), (KernelLauncher, "_make_plan", KernelLauncher._make_plan)]
        JITFunction.run = run
        KernelLauncher._make_plan = lambda *a: None  # compiled, never launched: no launch plan to keep
        for name, mod in list(sys.modules.items()):
            if name.startswith("flashdsa.ops.") and hasattr(mod, "num_sms"):
                self.saved.append((mod, "num_sms", mod.num_sms))
                mod.num_sms = lambda device: 132
        return kernels

    def __exit__(self, *exc) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)


def kernel_cases() -> list[tuple[str, object]]:
    """(name, launch) of each default launch at a production shape; the launch calls the library's launcher
    on CPU tensors (the contents do not matter, only shapes, strides and dtypes)."""
    from flashdsa.cache.layouts import INDEX_PAGE_BYTES
    from flashdsa.ops.indexer import paged as indexer_paged
    from flashdsa.ops.indexer import ragged as indexer_ragged
    from flashdsa.ops.indexer_quant import triton as quant
    from flashdsa.ops.sparse_mla import triton as sparse
    from flashdsa.quant import FP8, rope_cos_sin

    def paged(n: int, tma: bool):
        B, H, max_len, maxp = 64, 64, 42600, 666
        q = torch.zeros(B, n, H, 128, dtype=FP8)
        cache = torch.zeros(B * maxp, INDEX_PAGE_BYTES, dtype=torch.uint8)
        w = torch.zeros(B * n, H)
        ctx = torch.zeros(B, n, dtype=torch.int32)
        bt = torch.zeros(B, maxp, dtype=torch.int32)
        # the interpreter-free CPU launch takes the pointer kernel; tma=True takes the sm_90 default's path
        cfg = indexer_paged.PagedConfig(tma=True) if tma else None
        return lambda: indexer_paged.indexer_logits_paged(q, cache, w, ctx, bt, max_len, config=cfg)

    def ragged():
        T, N, H = 4096, 16384, 64
        q, k = torch.zeros(T, H, 128, dtype=FP8), torch.zeros(N, 128, dtype=FP8)
        ks = torch.zeros(T, dtype=torch.int32)
        ke = (torch.arange(T) + N - T + 1).to(torch.int32)
        return lambda: indexer_ragged.indexer_logits_ragged(q, k, torch.zeros(N), torch.zeros(T, H), ks, ke)

    def decode(fmt: str, h_q: int):
        B, pages, topk = 64, 512, 2048
        q = torch.zeros(B, 1, h_q, 576, dtype=torch.bfloat16)
        cache = (torch.zeros(pages, 64, 656, dtype=torch.uint8) if fmt == "fp8"
                 else torch.zeros(pages, 64, 576, dtype=torch.bfloat16))
        idx = torch.zeros(B, 1, topk, dtype=torch.int32)
        return lambda: sparse.sparse_mla_decode(q, cache, idx, 576 ** -0.5, 512, None)

    def prefill(h_q: int):
        T, N, topk = 4096, 8192, 2048
        q = torch.zeros(T, h_q, 576, dtype=torch.bfloat16)
        kv = torch.zeros(N, 576, dtype=torch.bfloat16)
        idx = torch.zeros(T, topk, dtype=torch.int32)
        return lambda: sparse.sparse_mla_prefill(q, kv, idx, 576 ** -0.5, 512)

    def rope_quant(heads: int | None):
        T = 4096
        x = torch.zeros((T, 128) if heads is None else (T, heads, 128), dtype=torch.bfloat16)
        cos, sin = rope_cos_sin(torch.arange(T))
        return lambda: quant.indexer_quant(x, cos, sin, False)

    return [("indexer-paged-ptr-n1", paged(1, False)), ("indexer-paged-ptr-n2", paged(2, False)),
            ("indexer-paged-tma-n1", paged(1, True)), ("indexer-paged-tma-n2", paged(2, True)),
            ("indexer-ragged-H64", ragged()),
            ("sparse-decode-fp8-h128", decode("fp8", 128)), ("sparse-decode-fp8-h16", decode("fp8", 16)),
            ("sparse-decode-bf16-h128", decode("bf16", 128)), ("sparse-decode-bf16-h16", decode("bf16", 16)),
            ("sparse-prefill-h128", prefill(128)),
            ("indexer-quant-q-H64", rope_quant(64)), ("indexer-quant-k", rope_quant(None))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("op", choices=["topk", "kernels"])
    ap.add_argument("--sass", help="write the SASS of each case to FILE.<i>")
    a = ap.parse_args()
    if a.op == "kernels":
        for case, launch in kernel_cases():
            with _CompileForSm90() as kernels:
                launch()
            for kname, k in kernels:
                print(report(f"{case} {kname}", k, f"{a.sass}.{case}.{kname}" if a.sass else None), flush=True)
        return
    for i, (name, kern, args, consts, nw, mr) in enumerate(topk_cases()):
        k = compile_sm90(kern, args, consts, nw, mr)
        print(report(name, k, f"{a.sass}.{i}" if a.sass else None))


if __name__ == "__main__":
    main()
