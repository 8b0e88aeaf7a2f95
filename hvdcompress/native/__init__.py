"""The compiled one-pass kernels of ``kernels.cpp``, loaded with ctypes (optional), shared by the
PyTorch and TensorFlow backends.

    python -m hvdcompress.native          # build (scripts/install.sh runs this), report

The library is plain C++ with a C interface (no Python, torch or TensorFlow headers; about ten
seconds of one core to compile). It is built into ``$HVDCOMPRESS_NATIVE_CACHE`` if set, else
``$HVDCOMPRESS_CACHE/native`` (default ``~/.cache/hvdcompress/native``), under a name that holds a
hash of the source and the flags, so an edited source is rebuilt and one directory serves every
checkout and process. At
first use, when the library is missing and a C++ compiler is on PATH, it is built then (under a
file lock, renamed into place, so concurrent workers build it once). Without a compiler, or with
``HVDCOMPRESS_NATIVE=0``, ``lib()`` returns None and the callers use the pure numpy/torch/TF paths,
which give the same results bit for bit (tests/test_selection.py, tests/test_paths.py and
tests/test_tf_paths.py check both).

``HVDCOMPRESS_TORCH_ONLY=1`` (or ``set_torch_only(True)``) goes further: no compiled kernel and no
numpy view of a tensor either, so every compressor runs the branch that device tensors take (torch
ops, TF ops) on CPU (tests/test_paths.py and tests/test_tf_paths.py check that branch against the
oracle for every compressor). On TensorFlow both switches select the TF ops.

The numpy-level entry points both backends call (raw addresses in, so neither framework's tensors
are needed here) are in ``quant`` (the quantizers), ``select`` (DGC's pass and top-k) and ``sketch``.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import Optional

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.cpp")
# -ffp-contract=off: no fused multiply-add, so every float operation rounds as numpy's does
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
ABI = 7

_lib = None
_tried = False


def _cache_dir() -> str:
    """$HVDCOMPRESS_NATIVE_CACHE, else $HVDCOMPRESS_CACHE/native, else ~/.cache/hvdcompress/native."""
    own = os.environ.get("HVDCOMPRESS_NATIVE_CACHE")
    if own:
        return own
    base = os.environ.get("HVDCOMPRESS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hvdcompress")
    return os.path.join(base, "native")


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def library_path() -> str:
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return os.path.join(_cache_dir(), f"hvdc_kernels-{digest}.so")


def build(verbose: bool = False) -> str:
    """Compile the library if it is not there yet; returns its path. Raises on failure."""
    path = library_path()
    if os.path.exists(path):
        return path
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):  # built by another process while this one waited
            return path
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        try:
            cmd = [cxx, *FLAGS, "-o", tmp, SOURCE]
            if verbose:
                print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, capture_output=not verbose)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _bind(path: str):
    lib = ctypes.CDLL(path)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for suffix, real in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        fns = {
            "ge": [p, i64, real, p, i64],
            "add_ge": [p, p, i64, real, p, i64],
            "add_ge_to": [p, p, p, i64, real, p, i64],
            "dgc_sample": [p, p, p, i64, real, i32, i64, i64, p],
            "dgc_pass": [p, p, p, i64, real, i32, i64, i64, p, real, p, p, i64, p, p],
            "dgc_pass_to": [p, p, p, p, p, i64, real, i32, i64, i64, p, real, p, p, i64, p, p],
            "take_and_zero": [p, p, i64, p, i64, p],
            "topk_small": [p, i64, i64, p, p],
        }
        for name, args in fns.items():
            fn = getattr(lib, f"hvdc_{name}_{suffix}")
            fn.argtypes = args
            fn.restype = i64
    lib.hvdc_q_encode.argtypes = [i32, p, p, p, i64, p, i64, i32, ctypes.c_uint32, p, i64]
    lib.hvdc_q_encode.restype = i64
    lib.hvdc_q_decode_sum.argtypes = [i32, p, i64, i64, i64, p, i64, i32, ctypes.c_float, p]
    lib.hvdc_q_decode_sum.restype = i64
    lib.hvdc_q1c_encode.argtypes = [p, p, p, i64, p, i64, p, i64]
    lib.hvdc_q1c_encode.restype = i64
    lib.hvdc_q1c_decode_sum.argtypes = [p, i64, i64, i64, p, i64, ctypes.c_float, p]
    lib.hvdc_q1c_decode_sum.restype = i64
    lib.hvdc_sk_update_sketch.argtypes = [p, p, p, i64, ctypes.c_float, p, p, i32, i64, p]
    lib.hvdc_sk_update_sketch.restype = i64
    lib.hvdc_sk_update_sketch_to.argtypes = [p, p, p, p, p, i64, ctypes.c_float, p, p, i32, i64, p]
    lib.hvdc_sk_update_sketch_to.restype = i64
    lib.hvdc_sk_estimates_abs.argtypes = [p, i64, p, p, i32, i64, p]
    lib.hvdc_sk_estimates_abs.restype = i64
    lib.hvdc_sk_estimates_abs_at.argtypes = [p, i64, p, p, i32, i64, i64, i64, i64, p]
    lib.hvdc_sk_estimates_abs_at.restype = i64
    lib.hvdc_sk_estimates_ge.argtypes = [p, i64, p, p, i32, i64, ctypes.c_float, p, p, i64]
    lib.hvdc_sk_estimates_ge.restype = i64
    lib.hvdc_abi_version.restype = ctypes.c_int
    if lib.hvdc_abi_version() != ABI:
        raise RuntimeError("stale kernel library")
    return lib


_enabled = True
_torch_only = os.environ.get("HVDCOMPRESS_TORCH_ONLY", "0") not in ("", "0")


def torch_only() -> bool:
    """True when the torch-only branch is forced (``HVDCOMPRESS_TORCH_ONLY=1`` or
    ``set_torch_only``): callers then take neither the compiled kernels nor numpy views."""
    return _torch_only


def set_torch_only(flag: bool) -> None:
    """Tests and benchmarks: force (True) or release (False) the torch-only branch on CPU."""
    global _torch_only
    _torch_only = bool(flag)


def lib():
    """The loaded library, or None (disabled, torch-only, no compiler, failed build): callers fall back."""
    global _lib, _tried
    if not _enabled or _torch_only:
        return None
    if not _tried:
        _tried = True
        if os.environ.get("HVDCOMPRESS_NATIVE", "1") != "0":
            try:
                _lib = _bind(build())
            except Exception:  # no compiler, read-only cache, ...: the pure paths give the same results
                _lib = None
    return _lib


def set_enabled(enabled: bool) -> None:
    """Tests and benchmarks: use the compiled kernels (when they load) or the pure paths."""
    global _enabled
    _enabled = bool(enabled)


def main() -> int:
    try:
        path = build(verbose=True)
        _bind(path)
    except Exception as e:  # the install goes on: the pure paths work without the kernels
        print(f"hvdcompress native kernels not built ({e}); the pure paths are used")
        return 0
    print(f"hvdcompress native kernels: {path}")
    return 0

