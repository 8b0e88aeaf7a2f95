"""Our specs inside Horovod's own optimizers: ``hvd.DistributedOptimizer(opt, compression=spec)``.

Horovod's optimizers (``horovod.torch``, ``horovod.tensorflow``, ``horovod.tensorflow.keras``)
accept any object with ``compress(tensor) -> (payload, ctx)`` and ``decompress(payload, ctx)``
and allreduce the payload in between (summed, then averaged by Horovod for ``op=Average``). A
``CompressionSpec`` has both methods, so ``hvc.Compression.fp16`` works in Horovod's optimizer as
in ours. They forward here, which picks the backend from the tensor's type (torch or
TensorFlow; the backend module is imported on first use) and the codec from the spec.

Only specs whose payload one allreduce can sum, with no state, fit that protocol:

    none   the tensor itself
    fp16   floating tensors cast to IEEE half, summed in half by Horovod, cast back (what
           ``hvd.Compression.fp16`` does)
    bf16   Horovod 0.28.1 cannot sum bfloat16: its DataType enum has no bfloat16 and, checked on
           2 Gloo workers, ``hvd.allreduce`` of a bfloat16 tensor raises in torch ("Tensor type
           torch.BFloat16Tensor is not supported.") and in TF (HorovodAllreduce allows uint8,
           int8, int32, int64, half, float, double). So the values are rounded to bfloat16
           (nearest even, as our ``bf16``) and travel as float32: the same rounding as our bf16,
           but 4 bytes per entry on the wire, not 2 -- no bytes saved

Everything else raises ``ValueError`` from ``compress`` -- on every rank, before Horovod launches
any collective -- saying why and what to use instead (``HOROVOD_REFUSALS``).
"""

from __future__ import annotations

import importlib
from typing import Any, Tuple

SUPPORTED = ("none", "fp16", "bf16")

_BACKENDS = {"torch": "torch_ops.horovod_compression", "tensorflow": "tf_ops.horovod_compression"}

_USE_OURS = "use hvdcompress's own DistributedOptimizer (same arguments) with this spec instead"

HOROVOD_REFUSALS = {
    "randomk": "its indices are shared through (seed, step, tensor name), and Horovod's compress(tensor) "
               "is told neither the step nor the name (and its error-feedback residual would be state "
               "Horovod does not checkpoint)",
    "powersgd": "it needs two allreduce rounds (P, then Q) and state (Q, the residual); Horovod's "
                "protocol has one allreduce and no state",
    "sketch": "it needs two rounds (the summed sketch, then the values at the candidates)",
}


def refusal(spec) -> str:
    """Why ``spec`` cannot run inside Horovod's own optimizer ('' when it can)."""
    if spec.name in SUPPORTED:
        if spec.params.get("residual"):
            return ("error feedback (residual=true) keeps a residual per tensor, and Horovod's "
                    "compress(tensor) is told no tensor name and saves no compression state")
        return ""
    if spec.name in HOROVOD_REFUSALS:
        return HOROVOD_REFUSALS[spec.name]
    if spec.exchange != "allreduce":
        return "its payload is gathered (allgather), not summed: Horovod's protocol sums one payload"
    return "it has no codec for Horovod's one-allreduce protocol"


def _codec(spec, tensor):
    why = refusal(spec)
    if why:
        raise ValueError(f"compression {str(spec)!r} cannot run inside Horovod's own DistributedOptimizer: "
                         f"{why}; {_USE_OURS}. Horovod's optimizers take: "
                         f"{', '.join('Compression.' + n for n in SUPPORTED)} (without residual)")
    root = type(tensor).__module__.split(".")[0]
    if root not in _BACKENDS:
        raise TypeError(f"compression {str(spec)!r}: compress() takes a torch or TensorFlow tensor; "
                        f"got {type(tensor).__name__}")
    return importlib.import_module(_BACKENDS[root]).CODECS[spec.name]


def compress(spec, tensor) -> Tuple[Any, Any]:
    return _codec(spec, tensor).compress(tensor)


def decompress(spec, tensor, ctx) -> Any:
    return _codec(spec, tensor).decompress(tensor, ctx)
