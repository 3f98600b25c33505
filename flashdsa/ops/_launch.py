"""Lean Triton launches: a compiled kernel launched from a cached per-shape plan.

``kernel[grid](**kwargs)`` costs tens of µs of host time a call: Triton binds and specialises every
argument (dtype, 16-byte alignment of each pointer, ``== 1`` / ``% 16`` of each int), hashes the result
into its cache key and looks the compiled kernel up. A launcher that knows which of its arguments vary
per call can do that once per shape: :class:`KernelLauncher` keeps, per key, the compiled kernel, the
grid and the full positional argument list with the per-call pointers left blank, and launches through
``CompiledKernel.run`` (the call ``JITFunction.run`` itself ends with, the same in Triton 3.6 and 3.9).

The key is the caller's promise: it must fix every argument but the pointers, so the caller builds it
from shapes, strides, ints and the config (all the values Triton specialises on), and uses the plan
only when every pointer is 16-byte aligned (``aligned``), the one pointer property Triton specialises
on. Anything else (the first call of a key, a misaligned pointer, another current device, the
interpreter) takes Triton's own launch, which is always right.

Under Triton 3.6's launcher (:func:`_raw_launch` recognises its shape) a plan goes one step further and
calls the generated C launch function itself: ``CudaLauncher.__call__`` only adds its scratch allocations
(none for our kernels: checked), and for a kernel taking a tensor descriptor the wrapper around the C
function re-encodes the CUtensorMap on every call (a Python loop over every argument, then
``cuTensorMapEncodeTiled``); a plan encodes each descriptor once (:func:`_encoded`). Measured on the H200
host: 6.6 -> 4.6 µs for top-k's launch, 10.2 -> 4.1 µs for the paged logits' TMA launch. Launch hooks
(profilers) take the full path.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Callable

import torch
from triton import knobs

from flashdsa.ops._shared import remember

# Plans kept per kernel; a decode loop has a handful of shapes, a new max_context_len every 64 tokens.
MAX_PLANS = 256
# Test hooks. VERIFY: before each planned launch, build Triton's own launch too and check that the plan
# passes the same grid and arguments (AssertionError otherwise). PLANS_IN_INTERPRETER: make plans in the
# interpreter as well (tests stand a recording kernel in for the compiled one there).
VERIFY = False
PLANS_IN_INTERPRETER = False


def aligned(*ptrs: int) -> bool:
    """Every address a multiple of 16 (Triton's pointer specialisation: then all agree with the plan's)."""
    acc = 0
    for p in ptrs:
        acc |= p
    return not acc & 15


class _Plan:
    """One shape's launch: the compiled kernel, its grid, the argument list with the per-call pointers at
    ``slots``, and ``launch(ptrs) -> bool``, generated for this plan so that a call does no list work."""
    __slots__ = ("compiled", "grid", "args", "slots", "device", "launch", "used", "raw")

    def __init__(self, compiled, grid, args, slots, device, current_device, get_stream):
        self.compiled, self.used = compiled, False
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.args, self.slots, self.device = args, slots, device
        names = [f"c{i}" for i in range(len(args))]
        for k, i in enumerate(slots):
            names[i] = f"p{k}"
        env = {f"c{i}": a for i, a in enumerate(args) if i not in slots}
        env.update(_dev=device, _cur=current_device, _stream=get_stream, _rt=knobs.runtime,
                   _run=compiled.run,  # the launcher object (its handles were loaded by the first launch)
                   _fn=compiled.function, _packed=compiled.packed_metadata, _grid=self.grid,
                   _meta=compiled.launch_metadata, _g0=self.grid[0], _g1=self.grid[1], _g2=self.grid[2])
        ptrs = ", ".join(f"p{k}" for k in range(len(slots)))
        call = ", ".join(names)
        # Triton's own launch: launch metadata is only read by launch hooks (profilers); an empty HookChain
        # has no calls
        full = [f"meta = _meta(_grid, stream, {call}) if enter is not None and getattr(enter, 'calls', True) "
                "else None",
                f"_run(_g0, _g1, _g2, stream, _fn, _packed, meta, enter, leave, {call})"]
        self.raw = _raw_launch(compiled, len(args))
        if self.raw is None:
            body = full
        else:
            c_launch, head, descs = self.raw
            env.update(_c=c_launch, _head=head, _enc=_encoded)
            env.update({f"_m{i}": m for i, m in descs.items()})
            # a descriptor argument (per call when it is a pointer slot) expands to its encoded arguments
            raw_call = ", ".join(f"*_enc({n}, _m{i})" if i in descs else n for i, n in enumerate(names))
            body = ["if (enter is None or not getattr(enter, 'calls', True)) and "
                    "(leave is None or not getattr(leave, 'calls', True)):",
                    f"    _c(_g0, _g1, _g2, stream, _fn, *_head, {raw_call})",
                    "else:",
                    *(f"    {line}" for line in full)]
        src = "\n".join([f"def launch(ptrs, {', '.join(f'{k}={k}' for k in env)}):",
                         f"    {ptrs}{',' if len(slots) == 1 else ''} = ptrs",
                         "    dev = _cur()",
                         "    if dev != _dev:",
                         "        return False",
                         "    stream = _stream(dev)",
                         "    enter, leave = _rt.launch_enter_hook, _rt.launch_exit_hook",
                         *(f"    {line}" for line in body),
                         "    return True\n"])
        ns = dict(env)
        exec(src, ns)  # noqa: S102 - generated from the kernel's own argument list
        self.launch = ns["launch"]


# The C launch function's leading arguments after (gridX, gridY, gridZ, stream, function), in Triton 3.6:
# cooperative grid, PDL, global scratch, profile scratch, kernel metadata, launch metadata, enter / exit hooks.
_LAUNCHER_CALL = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
_WRAPPED = ("launcher", "tensordesc_indices", "tensordesc_meta")


def _raw_launch(compiled, nargs: int):
    """``(c_launch, head, descs)`` for a plan to call the compiled kernel's C launch function directly, or
    None (then it calls ``compiled.run``, which is always right).

    Only for the launcher shape of Triton 3.6, recognised by its call signature: a ``CudaLauncher`` whose
    ``__call__(gridX, gridY, gridZ, stream, function, *args)`` passes ``launch(gridX, gridY, gridZ, stream,
    function, cooperative, pdl, global_scratch, profile_scratch, *args)``, with no scratch to allocate, and
    whose ``launch`` is the C function or the tensor-descriptor wrapper around it (closure names checked).
    ``head``: the arguments after ``function``, up to the kernel's (hooks None: the plan calls this only
    without hooks); ``descs``: {kernel argument index: descriptor metadata} of the wrapper."""
    run = getattr(compiled, "run", None)
    if type(run).__name__ != "CudaLauncher" or _INTERPRET:
        return None
    try:
        if list(inspect.signature(type(run).__call__).parameters) != _LAUNCHER_CALL:
            return None
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        head = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata, None, None, None)
        launch = run.launch
        code = getattr(launch, "__code__", None)
        if code is None:
            return launch, head, {}  # the C function itself: no descriptor arguments
        if launch.__name__ != "inner" or code.co_freevars != _WRAPPED:
            return None
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
        indices = sorted(cells["tensordesc_indices"])
        meta = cells["tensordesc_meta"] or [None] * len(indices)
        if len(meta) != len(indices) or any(i >= nargs for i in indices):
            return None
        return cells["launcher"], head, dict(zip(indices, meta))
    except (AttributeError, TypeError, ValueError):
        return None


class Address:
    """A cached tensor descriptor's base: an address and a dtype, no reference to the tensor (the launcher
    reads ``base.data_ptr()`` only), so a descriptor kept per (address, shape) for planned launches pins no
    memory."""
    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


_ENCODED: dict = {}


def _encoded(desc, meta) -> list:
    """The C launch's arguments for tensor descriptor ``desc`` (Triton's ``make_tensordesc_arg``: the
    encoded CUtensorMap, then shape and strides), encoded once per descriptor object. Planned launches
    pass descriptors that the op caches per (address, shape) and never changes, so the encoding stays
    right; the cache holds the descriptor, so its ``id`` is not reused while the entry lives."""
    hit = _ENCODED.get(id(desc))
    if hit is not None and hit[0] is desc:
        return hit[1]
    return remember(_ENCODED, id(desc), (desc, _make_tensordesc_arg(desc, meta)), 256)[1]


def _make_tensordesc_arg(desc, meta) -> list:
    from triton.backends.nvidia.driver import make_tensordesc_arg
    return make_tensordesc_arg(desc, meta)


class KernelLauncher:
    """Launches one ``@triton.jit`` kernel, from a cached plan when its key was seen before.

    ``pointers`` names the kernel's per-call arguments (tensors, passed to a plan as ``data_ptr()`` ints,
    or tensor descriptors); every other argument must be fixed by the key. A plan whose other arguments
    hold a tensor is refused (it would pin a stale pointer): such a launch always takes Triton's path.
    """

    def __init__(self, kernel, pointers: tuple[str, ...]):
        self.kernel = kernel
        self.pointers = tuple(pointers)
        self.plans: dict = {}
        self.refused = False  # a launch site that cannot be planned (see _make_plan)

    def __call__(self, key, ptrs: tuple, build: Callable[[], tuple[tuple, dict]]):
        """Launch; returns the compiled kernel (None in the interpreter). ``key``: None for no plan, else a
        hashable fixing every non-pointer argument (and the pointers' alignment: pass None unless
        :func:`aligned`); ``ptrs``: the per-call values in ``pointers`` order (ints for tensors);
        ``build() -> (grid, kwargs)``: Triton's full launch."""
        plan = self.plans.get(key) if key is not None else None
        if plan is not None:
            if VERIFY:
                self._verify(plan, ptrs, build)
            try:
                if plan.launch(ptrs):
                    plan.used = True
                    return plan.compiled
            except TypeError:
                # the launcher refused the arguments before launching (a Triton whose launcher takes them
                # otherwise): Triton's own path from now on; a plan that launched before re-raises
                if plan.used:
                    raise
                warnings.warn(f"flashdsa: planned launches of {getattr(self.kernel, '__name__', 'a kernel')} "
                              "failed on this Triton; using its own launch path", RuntimeWarning)
                self.plans.clear()
                self.refused = True
        grid, kwargs = build()
        compiled = self.kernel[grid](**kwargs)
        if key is not None and plan is None and not self.refused:
            plan = self._make_plan(compiled, grid, kwargs)
            if plan is not None:
                remember(self.plans, key, plan, MAX_PLANS)
        return compiled

    def _make_plan(self, compiled, grid, kwargs: dict) -> _Plan | None:
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            if not (PLANS_IN_INTERPRETER and compiled is not None):
                return None  # the interpreter (no compiled kernel), or a Triton without these internals
        names = list(self.kernel.arg_names)
        # every argument by name (the rest of kwargs are launch options: num_warps, ...)
        if any(n not in kwargs for n in names) or any(p not in names for p in self.pointers):
            self.refused = True
            return None
        slots = tuple(names.index(p) for p in self.pointers)
        args = [kwargs[n] for n in names]
        for i in slots:
            args[i] = None
        if any(isinstance(a, torch.Tensor) or hasattr(a, "data_ptr") for a in args):
            self.refused = True  # a tensor outside ``pointers``: a plan would launch on a stale address
            return None
        try:
            if _INTERPRET:
                return _Plan(compiled, grid, args, slots, 0, lambda: 0, lambda dev: 0)
            from triton.runtime import driver
            drv = driver.active
            return _Plan(compiled, grid, args, slots, drv.get_current_device(), _current_device,
                         drv.get_current_stream)
        except AttributeError:  # a Triton without these internals: its own launch path
            self.refused = True
            return None

    def _verify(self, plan: _Plan, ptrs: tuple, build) -> None:
        grid, kwargs = build()
        want = [_plain(kwargs[n]) for n in self.kernel.arg_names]
        got = list(plan.args)
        for i, v in zip(plan.slots, ptrs):
            got[i] = v
        descs = plan.raw[2] if plan.raw is not None else {}
        # a pre-encoded descriptor: its shape / strides arguments as Triton would encode them now
        names = self.kernel.arg_names
        encoded = [(names[i], _encoded(got[i], m)[1:], _make_tensordesc_arg(kwargs[names[i]], m)[1:])
                   for i, m in descs.items()]
        got = [_plain(v) for v in got]
        full = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        bad = [(n, g, w) for n, g, w in zip(names, got, want) if g != w]
        bad += [(n + " (encoded)", g, w) for n, g, w in encoded if list(g) != list(w)]
        if bad or full != plan.grid:
            raise AssertionError(f"{getattr(self.kernel, '__name__', self.kernel)}: the plan launches grid {plan.grid} "
                                 f"(Triton: {full}) and differs in (name, plan, Triton) {bad}")


def _plain(v):
    """A launch argument as the launcher sees it: a tensor (or descriptor base) by address."""
    if isinstance(v, torch.Tensor):
        return v.data_ptr()
    if hasattr(v, "base") and hasattr(v, "block_shape"):  # a TensorDescriptor
        return ("desc", v.base.data_ptr(), list(v.shape), list(v.strides), list(v.block_shape), v.padding)
    return v


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the current CUDA device: torch.cuda.current_device() without its Python wrapper (lazy-init check), which
# a plan only reaches after a launch has initialised CUDA
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


_CAPS: dict = {}


def capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, remembered (it queries the device properties)."""
    cap = _CAPS.get(device)
    if cap is None:
        cap = _CAPS[device] = torch.cuda.get_device_capability(device)
    return cap
