"""Fused GPU codecs written in Triton: the branch CUDA tensors take when Triton is importable.

The unfused torch ops of ``torch_ops/compressors`` stay the reference and the fallback; these
kernels do an exchange's encode in one pass over the gradient (two where a per-segment reduction
must finish first) and the decode + sum over ranks in one pass, with the oracle's arithmetic
(``docs/gpu-kernels.md``):

    quant     the quantizers (signsgd, efsignsgd, onebit, terngrad, qsgd)
    select    top-k, threshold and DGC's selection
    sketch    the count sketch
    census    what an exchange launches and where it waits for the device, counted on the host

Switches: ``HVDCOMPRESS_TRITON=0`` or ``set_triton(False)`` turns the kernels off (the torch ops
run). ``set_triton(force=True)`` also runs them on CPU tensors, which Triton executes only with
its interpreter (``TRITON_INTERPRET=1`` set before the kernels are first imported): the tests
run the real dispatch that way on machines without a GPU.

Triton is imported on first use only (a CUDA tensor, or the forced CPU branch), never at import.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

_enabled = os.environ.get("HVDCOMPRESS_TRITON", "1") != "0"
_force = False
_available: Optional[bool] = None


def available() -> bool:
    """Whether ``triton`` imports (checked once). Not in a process that loaded Horovod's
    TensorFlow ops first: loading Triton's library after them crashes the process (triton 3.9.0,
    horovod 0.28.1), so the torch ops run there."""
    global _available
    if _available is None:
        if "triton" not in sys.modules and "horovod.tensorflow" in sys.modules:
            return False
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
            _available = True
        except Exception:  # ImportError, or a broken install
            _available = False
    return _available


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def set_triton(enabled: bool = True, force: bool = False) -> None:
    """Turn the Triton kernels on or off; ``force=True`` runs them on CPU tensors as well, which
    needs ``TRITON_INTERPRET=1`` (a ValueError otherwise, since compiled Triton kernels read
    device memory only)."""
    global _enabled, _force
    if force and not interpreted():
        raise ValueError("set_triton: force=True runs the kernels on CPU tensors, which needs Triton's "
                         "interpreter; set TRITON_INTERPRET=1 before the kernels are imported")
    _enabled, _force = bool(enabled), bool(force and enabled)


def enabled() -> bool:
    """The switch (``HVDCOMPRESS_TRITON`` / ``set_triton``), whether or not triton imports."""
    return _enabled


def serves(t: torch.Tensor) -> bool:
    """Whether the kernels run for tensor ``t``: switched on, triton importable, and ``t`` on a
    CUDA device (or on CPU with ``set_triton(force=True)``)."""
    if not _enabled:
        return False
    if not (t.is_cuda or (_force and t.device.type == "cpu")):
        return False
    return available()
