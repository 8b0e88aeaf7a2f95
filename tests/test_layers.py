"""The layers point one way: the framework-neutral core imports no framework and no backend.

* ``lint-imports`` keeps the contracts of ``.importlinter`` (the core imports no framework, no
  backend, no face and no tool; tools over faces over backends; torch_ops and tf_ops never import
  each other; no import circle among a package's modules);
* import-linter reads import statements only, so a core module may not load a framework or a
  backend by name either (``importlib.import_module``, ``__import__``, ``discover``): a backend
  registers itself with the core when it is imported, never the other way round.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "hvdcompress")
# children of hvdcompress/ that stand above the backends (.importlinter says so too)
ABOVE_THE_CORE = {"torch.py", "keras.py", "tensorflow.py", "ddp.py", "fsdp.py", "cli.py", "bench"}
FRAMEWORKS_AND_BACKENDS = ("torch", "tensorflow", "tf_keras", "keras", "horovod", "torch_ops", "tf_ops")
LOADERS = {"import_module", "__import__", "find_spec", "discover", "reload"}
# the one loader that takes a name it is given: discovery imports the calling package's own folder
# (a family registers its modules), and every call of it passes ``__name__``
GENERIC_LOADERS = {("contract.py", "discover")}


def core_files():
    for dirpath, dirnames, filenames in os.walk(CORE):
        rel = os.path.relpath(dirpath, CORE)
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not (rel == "." and d in ABOVE_THE_CORE))
        for name in sorted(filenames):
            if name.endswith(".py") and not (rel == "." and name in ABOVE_THE_CORE):
                yield os.path.join(dirpath, name)


def _names_backend(text: str) -> bool:
    return text.split(".")[0] in FRAMEWORKS_AND_BACKENDS


def _module_path_of_backend(text: str) -> bool:
    """A string that is a backend's module path (``"torch_ops.compressors"``, ``"tf_ops"``,
    ``"horovod.torch"``): a table of names to load later. A bare ``"torch"`` is a framework's name,
    as a tensor's type reports it, and passes."""
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", text) or not _names_backend(text):
        return False
    return "." in text or text in ("torch_ops", "tf_ops")


def _loader_name(call: ast.Call):
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                yield body[0].value


def dynamic_imports_of_backends(path: str):
    """``file:line: why`` for each place in ``path`` that loads a framework or backend by name."""
    rel = os.path.relpath(path, ROOT)
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []
    enclosing = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                enclosing.setdefault(id(node), fn.name)
    docs = {id(d) for d in _docstrings(tree)}
    loader_args = {id(node.args[0]) for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and node.args and _loader_name(node) in LOADERS}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _loader_name(node)
            if name not in LOADERS or not node.args:
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if _names_backend(arg.value):
                    found.append(f"{rel}:{node.lineno}: {name}({arg.value!r})")
            elif isinstance(arg, ast.Name) and arg.id == "__name__":
                continue
            elif (os.path.basename(path), enclosing.get(id(node))) not in GENERIC_LOADERS:
                found.append(f"{rel}:{node.lineno}: {name}({ast.unparse(arg)}) loads a module named at run time")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
              and id(node) not in loader_args and _module_path_of_backend(node.value)):
            found.append(f"{rel}:{node.lineno}: the module name {node.value!r} (a backend loaded by name?)")
    return found


def test_import_contracts_hold():
    """``lint-imports`` (import-linter, requirements/base.txt) keeps every contract of .importlinter."""
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: install import-linter (requirements/base.txt; make install does)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([exe, "--no-logo", "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"lint-imports found broken contracts:\n{run.stdout}\n{run.stderr}"
    assert "0 broken" in run.stdout, run.stdout


def test_core_loads_no_backend_by_name():
    found = [hit for path in core_files() for hit in dynamic_imports_of_backends(path)]
    assert not found, ("the core loads a framework or backend by name (import-linter cannot see it); "
                       "let the backend register itself with the core instead:\n" + "\n".join(found))


def test_the_name_check_sees_what_it_must(tmp_path):
    """The check above is not blind: each way of loading a backend by name is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text('import importlib\n'
                   'BACKENDS = {"torch": "torch_ops.compressors"}\n'
                   'def f(name):\n'
                   '    importlib.import_module("tf_ops")\n'
                   '    __import__("horovod.torch")\n'
                   '    return importlib.import_module(name)\n')
    hits = dynamic_imports_of_backends(str(bad))
    assert len(hits) == 4, hits
    assert any("'torch_ops.compressors'" in h for h in hits) and any("import_module('tf_ops')" in h for h in hits)
    assert any("__import__('horovod.torch')" in h for h in hits) and any("named at run time" in h for h in hits)


def test_a_backend_registers_itself_with_the_core():
    """Horovod's codec of a spec comes from the backend that registered itself: before the torch
    backend is imported, a torch tensor gets an error saying what to import; after, the codec."""
    code = ("import sys, torch, hvdcompress\n"
            "assert 'torch_ops' not in sys.modules\n"
            "try:\n"
            "    hvdcompress.Compression.fp16.compress(torch.ones(2))\n"
            "except RuntimeError as e:\n"
            "    print('refused:', e)\n"
            "import hvdcompress.torch\n"
            "payload, _ = hvdcompress.Compression.fp16.compress(torch.ones(2))\n"
            "print('payload:', payload.dtype)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "refused:" in run.stdout and "import hvdcompress.torch" in run.stdout, run.stdout
    assert "payload: torch.float16" in run.stdout, run.stdout
