"""The shared compiled kernels (``hvdcompress.native``) called from TensorFlow, on CPU tensors.

``call(fn, inputs, outputs)`` runs ``fn`` on numpy views of the inputs and returns its numpy
results as tensors of the declared dtypes and static shapes:

* inside ``tf.function`` (what Keras runs) through ``tf.numpy_function``: TensorFlow hands the
  inputs over without copying (a variable's value too), and takes a result whose buffer is
  aligned to 64 bytes (``empty``) without copying either; a variable's ``assign`` of such a result
  adopts its buffer. So a kernel that reads its inputs and writes fresh outputs costs what the
  kernel costs, plus the call (tens of microseconds).
* executing eagerly, directly: ``np.asarray`` of an eager tensor is a view of its buffer; the
  results are copied into tensors (one pass per output; eager training is not the fast path).

``kernels(*tensors)`` says whether the kernels serve tensors: the library loaded and neither
switch set (``HVDCOMPRESS_NATIVE=0``, ``hvdcompress.native.set_enabled(False)`` or the torch-only
switch: then the TF ops run, as on a GPU), float32 (or the dtypes asked), static shapes, and on
CPU -- an eager tensor's own device, or, for a tensor being traced (placed later), no GPU visible
to TensorFlow. On a GPU the TF ops run, so no tensor is copied to the host.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from hvdcompress import native

ALIGN = 64  # bytes: TensorFlow takes a numpy result without copying when its buffer is aligned so

_gpus: Optional[bool] = None


def _gpu_visible() -> bool:
    global _gpus
    if _gpus is None:
        _gpus = bool(tf.config.list_logical_devices("GPU"))
    return _gpus


def _on_cpu(t) -> bool:
    device = getattr(t, "device", "") or ""
    if device:
        return "CPU" in device.upper()
    return not _gpu_visible()


def kernels(*tensors, dtypes=(tf.float32,)):
    """The kernel library when it serves these tensors (of ``dtypes``, static shapes, on CPU), else None."""
    lib = native.lib()
    if lib is None:
        return None
    for t in tensors:
        if t.dtype not in dtypes or not t.shape.is_fully_defined() or not _on_cpu(t):
            return None
    return lib


def empty(n: int, dtype) -> np.ndarray:
    """An uninitialised numpy array of n entries whose buffer starts on an ALIGN-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + n * dtype.itemsize].view(dtype)


class Buffers:
    """Aligned result buffers reused across calls of one exchange: a buffer is handed out again
    only when nothing but this pool refers to it -- TensorFlow holds a reference to every numpy
    result it took without copying (a variable that adopted it, a gradient still in use), and
    drops it when it releases the memory. Reuse spares the page faults of fresh memory (about as
    dear as writing it once)."""

    KEEP = 4  # buffers kept per size and dtype

    def __init__(self):
        self.pool = {}

    def get(self, n: int, dtype) -> np.ndarray:
        """An uninitialised ALIGN-aligned array of n entries nobody else refers to."""
        dtype = np.dtype(dtype)
        kept = self.pool.setdefault((n, dtype.str), [])
        for i in range(len(kept)):
            if sys.getrefcount(kept[i]) == 2:  # the list's reference and this call's argument
                return kept[i]
        a = empty(n, dtype)
        if len(kept) < self.KEEP:
            kept.append(a)
        return a


def address(a: Optional[np.ndarray]) -> Optional[int]:
    """The address of a contiguous numpy array's first entry (None for None)."""
    if a is None:
        return None
    if not a.flags.c_contiguous:
        raise ValueError("host: a kernel argument is not contiguous")
    return a.ctypes.data


Output = Tuple[tf.DType, Sequence[int]]


def call(fn: Callable, inputs: Sequence, outputs: Sequence[Output]) -> Tuple[tf.Tensor, ...]:
    """``fn(*numpy inputs) -> numpy outputs`` as a TensorFlow computation (see the module doc).
    ``inputs``: tensors or variables; ``outputs``: (dtype, static shape) of each result."""
    dtypes = [tf.as_dtype(d) for d, _ in outputs]
    if tf.executing_eagerly():
        values = [np.asarray(t.value() if isinstance(t, tf.Variable) else t) for t in inputs]
        results = fn(*values)
        return tuple(tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, dtypes))
    results = tf.numpy_function(fn, list(inputs), dtypes, stateful=False)
    if not isinstance(results, (list, tuple)):
        results = [results]
    for r, (_, shape) in zip(results, outputs):
        r.set_shape(shape)
    return tuple(results)
