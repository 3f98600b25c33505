"""Every ``@triton.jit`` function reads only globals Triton's compiler accepts.

The interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels) lets a kernel read any module global,
but the compiler refuses a plain Python number or string: ``NameError: Cannot access global variable X
from within @jit'ed function``. Such a kernel passes every CPU test and fails on the first GPU launch, so
this check walks the kernels' source instead.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap

import triton
from triton.runtime.interpreter import InterpretedFunction

import flashdsa

_PLAIN = (bool, int, float, str, bytes, tuple, list, dict, set)
_JIT = (triton.runtime.jit.JITFunction, InterpretedFunction)  # what @triton.jit gives, compiled or interpreted


def _kernels() -> list:
    found = {}
    for mod in pkgutil.walk_packages(flashdsa.__path__, "flashdsa."):
        try:
            m = importlib.import_module(mod.name)
        except ImportError:  # optional extras (transformers): their modules hold no kernels
            continue
        for v in vars(m).values():
            if isinstance(v, _JIT) and v.fn.__module__ == m.__name__:
                found[f"{m.__name__}.{v.fn.__name__}"] = v
    return [found[k] for k in sorted(found)]


def _bad_globals(k) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(k.fn)))
    fn = tree.body[0]
    local = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            local.add(node.id)
    bad = []
    g = k.fn.__globals__
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
            if node.id in g and isinstance(g[node.id], _PLAIN) and not hasattr(builtins, node.id):
                bad.append(f"{node.id} = {g[node.id]!r} (line {node.lineno})")
    return bad


def test_there_are_kernels_to_check():
    names = {k.fn.__name__ for k in _kernels()}
    assert len(names) > 20, names
    assert "flag_lo_hi" in names


def test_kernels_read_only_constexpr_globals():
    bad = {f"{k.fn.__module__}.{k.fn.__name__}": b for k in _kernels() if (b := _bad_globals(k))}
    assert not bad, ("these kernels read plain Python globals; make them tl.constexpr(...) or pass them in: "
                     f"{bad}")


def test_the_check_catches_a_plain_global(tmp_path):
    """The check itself: a kernel reading a plain int fails it, one reading a constexpr passes."""
    ns = {"tl": triton.language, "triton": triton, "LIMIT": 7, "OK": triton.language.constexpr(7)}
    src = textwrap.dedent("""
        @triton.jit
        def k(x, Y: tl.constexpr):
            z = LIMIT + OK
            tl.store(x, z + Y)
    """)
    path = tmp_path / "kernel.py"  # triton.jit and inspect read a kernel's source from its file
    path.write_text(src)
    exec(compile(src, str(path), "exec"), ns)
    assert [b.split(" =")[0] for b in _bad_globals(ns["k"])] == ["LIMIT"]
