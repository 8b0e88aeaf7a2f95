"""Our specs inside Horovod's own optimizers: ``hvd.DistributedOptimizer(opt, compression=spec)``.

Horovod's optimizers (``horovod.torch``, ``horovod.tensorflow``, ``horovod.tensorflow.keras``)
accept any object with ``compress(tensor) -> (payload, ctx)`` and ``decompress(payload, ctx)``
and allreduce the payload in between (summed, then averaged by Horovod for ``op=Average``). A
``CompressionSpec`` has both methods, so ``hvc.Compression.fp16`` works in Horovod's optimizer as
in ours. They forward here, which picks the backend from the tensor's type (torch or
TensorFlow; the backend module is imported on first use) and the codec from the spec.

Only specs whose payload one allreduce can sum, with no state, fit that protocol; an algorithm
declares it (``register(..., horovod_codec=True)``, or ``horovod_refusal=`` with the reason it
cannot) and each backend's compressor class carries the codec (``horovod_codec``). The built-ins:

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
any collective -- saying why and what to use instead (``refusal``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from .registry import registered

# the top-level module of a tensor's type ("torch", "tensorflow") -> its backend's
# ``compressor_class(spec)``, whose ``horovod_codec`` is the codec; filled by the backends
BACKENDS: Dict[str, Callable[[Any], Any]] = {}
_FACES = {"torch": "hvdcompress.torch", "tensorflow": "hvdcompress.keras or hvdcompress.tensorflow"}

_USE_OURS = "use hvdcompress's own DistributedOptimizer (same arguments) with this spec instead"


def register_backend(tensor_module: str, compressor_class: Callable[[Any], Any]) -> None:
    """Called by a backend when it is imported: tensors whose type comes from ``tensor_module``
    are encoded by the ``horovod_codec`` of ``compressor_class(spec)``."""
    BACKENDS[tensor_module] = compressor_class


def supported() -> Tuple[str, ...]:
    """The specs that run inside Horovod's own optimizers (declared ``horovod_codec=True``)."""
    return tuple(sorted(n for n, info in registered().items() if info.horovod_codec))


def refusal(spec) -> str:
    """Why ``spec`` cannot run inside Horovod's own optimizer ('' when it can)."""
    info = spec.info
    if info.horovod_codec:
        if spec.params.get("residual"):
            return ("error feedback (residual=true) keeps a residual per tensor, and Horovod's "
                    "compress(tensor) is told no tensor name and saves no compression state")
        return ""
    if info.horovod_refusal:
        return info.horovod_refusal
    if spec.exchange != "allreduce":
        return "its payload is gathered (allgather), not summed: Horovod's protocol sums one payload"
    return "it has no codec for Horovod's one-allreduce protocol"


def _codec(spec, tensor):
    why = refusal(spec)
    if why:
        raise ValueError(f"compression {str(spec)!r} cannot run inside Horovod's own DistributedOptimizer: "
                         f"{why}; {_USE_OURS}. Horovod's optimizers take: "
                         f"{', '.join('Compression.' + n for n in supported())} (without residual)")
    root = type(tensor).__module__.split(".")[0]
    if root not in _FACES:
        raise TypeError(f"compression {str(spec)!r}: compress() takes a torch or TensorFlow tensor; "
                        f"got {type(tensor).__name__}")
    if root not in BACKENDS:
        raise RuntimeError(f"compression {str(spec)!r}: compress() got a {root} tensor, but hvdcompress's "
                           f"{root} backend is not loaded; import {_FACES[root]} before handing a spec "
                           "to Horovod's optimizer")
    return BACKENDS[root](spec).horovod_codec


def compress(spec, tensor) -> Tuple[Any, Any]:
    return _codec(spec, tensor).compress(tensor)


def decompress(spec, tensor, ctx) -> Any:
    return _codec(spec, tensor).decompress(tensor, ctx)
