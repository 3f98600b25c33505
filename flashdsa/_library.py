"""flashdsa's public ops as torch custom ops (``torch.ops.flashdsa.*``), for torch.compile and CUDA graphs.

:func:`op` registers a public function with ``torch.library.custom_op`` (schema from its annotations,
``mutates_args`` for the cache writers, a fake implementation giving the output shapes) and returns a
wrapper with the same signature: eagerly it calls the function directly (the registered op's dispatch
would add 10-25 µs of host time to every call), and while ``torch.compile`` traces it calls the
registered op, which the traced graph holds as one opaque node (its real implementation, checks
included, runs when the graph runs). The registered ops are also what ``torch.library.opcheck`` tests.

Custom ops take no keyword-only tensors, so the registered schema lists every parameter positionally,
in the Python signature's order (``torch.ops.flashdsa.topk_transform(logits, lengths, 8, page_table=t)``
works; so does the public function's own signature).
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Callable

import torch

NAMESPACE = "flashdsa"
_compiling = torch.compiler.is_compiling
# True while a registered op's implementation runs: the call came through torch's dispatcher (a compiled
# graph, torch.ops.flashdsa.*), where the caller (e.g. torch.compile's CUDA-graph trees, which route every
# allocation of their warm-up into a private pool and check that pool) must see no buffer outlive the call.
_REGISTERED = contextvars.ContextVar("flashdsa_registered_op", default=False)


def in_registered_op() -> bool:
    """Whether this call runs as a registered op's implementation (see ``_REGISTERED``): an op then keeps
    no buffer across calls (top-k's cached split-mode counters: fresh zeros instead)."""
    return _REGISTERED.get()


def _generated(name: str, sig: inspect.Signature, body: str, env: dict) -> Callable:
    """``def name(<sig>): <body>`` with the defaults of ``sig`` (a closure-free function: as cheap to call
    as a hand-written one)."""
    params, defaults = [], {}
    star = False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        if p.default is p.empty:
            params.append(p.name)
        else:
            defaults[f"_default_{p.name}"] = p.default
            params.append(f"{p.name}=_default_{p.name}")
    ns = dict(env, **defaults)
    exec(f"def {name}({', '.join(params)}):\n    {body}\n", ns)  # noqa: S102 - our own signatures only
    return ns[name]


def op(name: str, fake: Callable, mutates_args: tuple[str, ...] = (), out: str | None = None
       ) -> Callable[[Callable], Callable]:
    """Register the decorated public function as ``torch.ops.flashdsa.<name>`` with the fake
    implementation ``fake`` (same parameters; returns empty outputs of the right shape, dtype and
    device, contiguous as the real ones are); the decorated name calls the op only under torch.compile.

    ``out``: the name of an optional output-buffer parameter (default None) of the public function. A custom
    op may not return a tensor aliasing an input, so the registered op does not take it: under torch.compile
    the public function calls the op and copies its result into the buffer (one copy, as an out= of a
    compiled graph costs anyway); eagerly the function writes into it directly."""
    def register(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        names = list(sig.parameters)
        reg_params = [p for p in sig.parameters.values() if p.name != out]
        reg_names = [p.name for p in reg_params]
        positional = sig.replace(parameters=[p.replace(kind=p.POSITIONAL_OR_KEYWORD) for p in reg_params])

        def call(ns):
            return ", ".join(n if sig.parameters[n].kind is not inspect.Parameter.KEYWORD_ONLY else f"{n}={n}"
                             for n in ns)
        call_kw, reg_kw = call(names), call(reg_names)
        # the registered implementation and fake: every parameter positional, calling the real ones
        impl = _generated(fn.__name__, positional,
                          f"_tok = _flashdsa_registered.set(True)\n    try:\n        return _fn({reg_kw})\n"
                          "    finally:\n        _flashdsa_registered.reset(_tok)",
                          {"_fn": fn, "_flashdsa_registered": _REGISTERED})
        impl.__signature__ = positional
        impl.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != out}
        impl.__globals__.update(fn.__globals__)  # for the annotations' names (strings under __future__)
        fake_impl = _generated(f"{fn.__name__}_fake", positional, f"return _fn({reg_kw})", {"_fn": fake})
        custom = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=mutates_args)
        custom.register_fake(fake_impl)
        overload = getattr(getattr(torch.ops, NAMESPACE), name).default
        if out is None:
            body = f"return _op({', '.join(reg_names)}) if _compiling() else _fn({call_kw})"
        else:
            body = (f"if _compiling():\n        _r = _op({', '.join(reg_names)})\n"
                    f"        return _r if {out} is None else {out}.copy_(_r)\n    return _fn({call_kw})")
        public = _generated(fn.__name__, sig, body, {"_op": overload, "_fn": fn, "_compiling": _compiling})
        for attr in ("__module__", "__qualname__", "__doc__", "__annotations__"):
            setattr(public, attr, getattr(fn, attr))
        public.__wrapped__ = fn
        public.op = overload
        return public

    return register
