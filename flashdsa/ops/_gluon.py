"""What the ops know about their Gluon kernels in this process: which ran, and which failed their first launch.

Gluon is experimental in Triton: a version whose API moved fails to compile a kernel (measured with 3.6 on
kernels written for 3.9). Such a failure on a kernel's first launch is a version problem: the op warns once,
runs its Triton kernel for that call, and its dispatch rule names the failure from then on. A failure after the
kernel has run once is a real error and propagates.
"""

from __future__ import annotations

import warnings
from typing import Callable


class GluonKernels:
    """The Gluon kernels of one op package, by module name. ``load(module)`` imports one (the package passes
    its own cached importer, which tests stand in for)."""

    def __init__(self, load: Callable[[str], object]):
        self.load = load
        self.ran: set[tuple[str, str]] = set()  # (module, entry) that returned in this process
        self.failed: dict[str, str] = {}       # module -> why its first launch failed

    def run(self, mod: str, entry: str, fallback: Callable, *args, op: str, fallback_name: str = "Triton kernel"):
        """``mod.entry(*args)``; if that raises before any entry of ``mod`` ever returned, warn and return
        ``fallback(*args)`` (``op`` names the public op in the warning)."""
        try:
            out = getattr(self.load(mod), entry)(*args)
        except Exception as e:  # noqa: BLE001 - a version problem only before the first success (module doc)
            if any(m == mod for m, _ in self.ran):
                raise
            self.failed[mod] = f"{type(e).__name__}: {e}"
            warnings.warn(f"{op}: the Gluon kernel ({mod.rsplit('.', 1)[1]}.py) failed on this Triton "
                          f"({self.failed[mod]}); using the {fallback_name}", RuntimeWarning)
            return fallback(*args)
        self.ran.add((mod, entry))
        return out

    def unsupported(self, mod: str, *args) -> str | None:
        """Why the Gluon kernel of ``mod`` cannot run this call (None: it can; ``args`` go to the module's
        ``unsupported``), also where this Triton has no Gluon or the kernel's first launch failed."""
        if mod in self.failed:
            return f"a Triton whose Gluon compiles it (its first launch failed: {self.failed[mod]})"
        try:
            kernel = self.load(mod)
        except (ImportError, AttributeError) as e:  # a Triton without triton.experimental.gluon (or another API)
            return f"Triton's Gluon (import failed: {e})"
        return kernel.unsupported(*args)


def compile_sm90(fn, kw: dict):
    """Compile the Gluon kernel ``fn`` for sm_90 with the keyword arguments ``kw`` of one launch, on any host
    (no GPU), and return Triton's compiled kernel (``asm["ptx"]``, ``asm["llir"]``, ``asm["cubin"]``,
    ``metadata.shared``): the kernels' CPU compile tests and the probes' ``--compile-only``.

    Specialised as the launcher specialises: the kernel's constexpr parameters take their values, tensors
    become 16-byte aligned pointers, TensorDescriptors their own type, integers divisible by 16 carry that
    hint unless the kernel marks them ``do_not_specialize`` (an integer equal to 1, which the launcher turns
    into a constant, stays an argument here). ``num_warps`` / ``maxnreg`` in ``kw`` are compile options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    kw = dict(kw)
    opts = {k: kw.pop(k) for k in ("num_warps", "maxnreg") if k in kw}
    sig, consts, attrs = {}, {}, {}
    for p in fn.params:
        val = kw[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", getattr(val, "value", val)
            continue
        sig[p.name] = mangle_type(val)
        if hasattr(val, "data_ptr") or (isinstance(val, int) and not isinstance(val, bool)
                                        and val % 16 == 0 and not p.do_not_specialize):
            attrs[(p.num,)] = [["tt.divisibility", 16]]
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
