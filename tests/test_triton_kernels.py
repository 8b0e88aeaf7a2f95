"""The Triton GPU codecs (``torch_ops/gpu``) on CPU under Triton's interpreter, against the oracle.

The cases (``scenarios/triton_kernels.py``) run in one child process: loading Triton after
Horovod's TensorFlow ops, which conftest imports, crashes a process. There ``TRITON_INTERPRET=1``
runs the kernels on CPU tensors and ``set_triton(force=True)`` sends them down the branch CUDA
tensors take, so each case exercises the compressors' real dispatch: two simulated ranks, two
steps, payload bytes, results and state bit for bit against the numpy oracle, at 1 and 7
entries, a partial last block, a merged group whose members split bytes and buckets, all-zero
gradients, NaN and inf. A second child compiles every kernel for a GPU (without one). The
switches are checked here, without importing triton.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from scenarios import triton_kernels
from torch_ops import gpu

# one xdist worker runs every case: the module's fixture runs all of them in one child process (about 23 s)
pytestmark = pytest.mark.xdist_group("triton-interpreter")

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def triton_dir():
    """Where the kernels' test processes find triton: "" when it is on this interpreter's path (a CUDA
    torch's), else the folder scripts/install.sh puts it in (off the path: loaded beside Horovod's
    TensorFlow ops it crashes a process), else None."""
    if importlib.util.find_spec("triton") is not None:
        return ""
    folder = os.environ.get("HVDCOMPRESS_TRITON_PATH",  # set by conftest from the user's cache
                            os.path.join(os.path.expanduser("~"), ".cache", "hvdcompress", "triton-3.9.0"))
    return folder if os.path.isfile(os.path.join(folder, "triton", "__init__.py")) else None


def triton_version(folder):
    """The version of the triton in ``folder`` ("" when on this interpreter's path), read without importing it."""
    from importlib import metadata
    if folder == "":
        return metadata.version("triton")
    dists = list(metadata.distributions(path=[folder], name="triton"))
    return dists[0].version if dists else "0"


def _release(version):
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())


TRITON_DIR = triton_dir()
needs_triton = pytest.mark.skipif(TRITON_DIR is None,
                                  reason="triton is not installed (scripts/install.sh puts triton 3.9.0 in "
                                         "~/.cache/hvdcompress/triton-3.9.0): the GPU kernels cannot be tested")
# Triton 3.6's interpreter turns a runtime loop bound into a Python int with int() of a one-element
# array, which numpy 2.5 refuses; the while loops that avoid it crash the same Triton's compiler for
# sm_90 (both seen on an H200 with triton 3.6.0 and numpy 2.5.2). The kernels keep their range loops
# (compiled and checked against the oracle on the GPU by benchmarks/cuda_check.py); their
# interpreter cases run where the interpreter can (triton 3.9, or numpy < 2.5).
OLD_INTERPRETER = (TRITON_DIR is not None and _release(triton_version(TRITON_DIR)) < (3, 9)
                   and _release(__import__("numpy").__version__) >= (2, 5))
interpreter_runs = pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.9's interpreter with numpy >= 2.5 cannot "
                                      "run a kernel loop with a runtime bound (int() of a one-element array)")


@pytest.fixture(scope="module")
def results(request):
    ids = [item.callspec.params["case"] for item in request.session.items
           if item.module.__name__ == __name__ and hasattr(item, "callspec") and "case" in item.callspec.params]
    cache = os.path.join(os.environ.get("HVDCOMPRESS_CACHE", TESTS), "triton")  # not the user's ~/.triton
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_CACHE_DIR=cache,
               PYTHONPATH=os.pathsep.join(p for p in [ROOT, TESTS, TRITON_DIR, os.environ.get("PYTHONPATH", "")] if p))
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "scenarios", "triton_kernels.py"), *ids],
                          cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    if proc.returncode != 0 or not line:
        pytest.fail(f"the Triton cases' process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULTS "):])


@needs_triton
@interpreter_runs
@pytest.mark.parametrize("case", list(triton_kernels.CASES))
def test_triton_kernels_are_the_oracle(results, case):
    assert results.get(case) == "ok", f"{case}: {results.get(case)}"


@pytest.mark.extended  # the compiler for sm_90: the interpreter cases above prove the results
@needs_triton
def test_kernels_compile_for_a_gpu(tmp_path):
    """Every kernel, one variant per algorithm, compiled to an sm_90 binary without a GPU
    (``scenarios/triton_compile.py``): what only the compiler rejects fails here too."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(p for p in [ROOT, TESTS, TRITON_DIR, os.environ.get("PYTHONPATH", "")] if p))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "scenarios", "triton_compile.py")],
                          cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    bad = {k: v for k, v in json.loads(line[-1][len("RESULTS "):]).items() if v != "ok"}
    assert not bad, bad


def test_switch_off_serves_nothing():
    gpu.set_triton(False)
    try:
        assert not gpu.serves(torch.zeros(4)) and not gpu.enabled()
    finally:
        gpu.set_triton(True)
    assert gpu.enabled()
    assert not gpu.serves(torch.zeros(4))  # a CPU tensor, not forced


def test_forcing_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        gpu.set_triton(True, force=True)


def test_environment_switch_turns_the_kernels_off():
    code = "from torch_ops import gpu; print(gpu.enabled())"
    env = dict(os.environ, HVDCOMPRESS_TRITON="0", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("text", ["qsgd", "topk:ratio=0.01", "dgc:ratio=0.01,warmup_epochs=0,min_sparse_numel=256",
                                  "sketch:ratio=0.01"])
def test_cpu_exchanges_never_load_the_kernels(text):
    """The branch CUDA tensors take, run on CPU tensors without ``force``: the Triton kernels are
    not imported (in this process, loading triton after Horovod's TensorFlow ops would crash it)."""
    from hvdcompress import parse_spec
    from scenarios.local_world import run_lockstep
    from torch_ops.compressors import ExchangeContext, build_compressor, native

    comp = build_compressor(parse_spec(text))
    shape = (80, 60)
    native.set_torch_only(True)
    try:
        state = {}
        for step in range(2):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(step)).reshape(-1)
            run_lockstep([comp.exchange(x, ExchangeContext("w", step, 1, 1.0, state, shape, 0, 0))])
    finally:
        native.set_torch_only(False)
    loaded = [m for m in ("torch_ops.gpu.quant_kernels", "torch_ops.gpu.select_kernels",
                          "torch_ops.gpu.sketch_kernels") if m in sys.modules]
    assert not loaded, loaded
