"""The Triton kernels' loops run under every Triton the project meets, interpreter included.

Triton 3.6's interpreter turns a loop bound into a Python int with ``int()`` of a one-element
array, which numpy 2.5 refuses ("only 0-dimensional arrays can be converted to Python scalars"): a
``for ... in range(n)`` whose bound is a kernel argument or a loaded value fails every case there
(the first GPU run: triton 3.6.0, numpy 2.5.2), while Triton 3.9 and the compiled kernels are
fine. So, read from the source (no triton needed): in a ``@triton.jit`` function, ``range`` /
``tl.range`` bounds are literals or ``tl.constexpr`` parameters; a runtime bound takes a
``while`` loop (a condition goes through ``bool``, which both accept).
"""

from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = sorted(glob.glob(os.path.join(ROOT, "torch_ops", "gpu", "*_kernels.py")))


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _constexprs(fn: ast.FunctionDef):
    return {a.arg for a in fn.args.args if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)}


def runtime_bounds(source: str, filename: str = "<kernels>"):
    """``file:line: the loop`` for every range loop of a jit function with a bound that is neither a
    literal nor built from constexpr parameters (and module-level constants: upper-case names)."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not (isinstance(fn, ast.FunctionDef) and _is_jit(fn)):
            continue
        static = _constexprs(fn)
        for loop in ast.walk(fn):
            if not (isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call)):
                continue
            name = ast.unparse(loop.iter.func)
            if name not in ("range", "tl.range"):
                continue
            names = {n.id for a in loop.iter.args for n in ast.walk(a) if isinstance(n, ast.Name)}
            if any(n not in static and not n.isupper() for n in names):
                found.append(f"{os.path.basename(filename)}:{loop.lineno}: for ... in {ast.unparse(loop.iter)}")
    return found


def test_no_runtime_loop_bounds_in_the_kernels():
    assert KERNELS
    found = [hit for path in KERNELS for hit in runtime_bounds(open(path).read(), path)]
    assert found == [], "use a while loop for a runtime bound:\n" + "\n".join(found)


def test_the_check_sees_a_runtime_bound():
    src = ("import triton\nimport triton.language as tl\n@triton.jit\n"
           "def k(p, world, B: tl.constexpr):\n    for r in range(0, world):\n        pass\n"
           "    for j in range(B):\n        pass\n    for s in tl.static_range(world):\n        pass\n")
    assert runtime_bounds(src) == ["<kernels>:5: for ... in range(0, world)"]
