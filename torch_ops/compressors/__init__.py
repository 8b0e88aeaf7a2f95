"""PyTorch compressors: one module per algorithm family, one class per registered algorithm.

A class names the algorithm it implements (``name = "topk"``) and is registered by that; the
algorithm itself (spec, parameters, wire cost, oracle) is declared in ``hvdcompress.reference``.
The family modules are not listed here: every module of this folder is imported with this
package (``hvdcompress.contract.discover``), so adding an algorithm is adding its module. The
package then registers itself with the core for Horovod's own optimizers (``register_backend``).
"""

from hvdcompress.contract import discover
from hvdcompress.horovod_interop import register_backend
from hvdcompress.spec import CompressionSpec, build_from

from .base import COMPRESSORS, Compressor, ExchangeContext, OneRoundCompressor, TakesMomentum
from .dgc_selection import sampled_threshold_select
from .selection import topk_indices


def compressor_class(spec: CompressionSpec):
    """The PyTorch class implementing ``spec`` (ValueError if none does)."""
    return build_from(COMPRESSORS, spec, "PyTorch", make=False)


def build_compressor(spec: CompressionSpec) -> Compressor:
    """The PyTorch compressor for a validated spec."""
    return build_from(COMPRESSORS, spec, "PyTorch")


discover(__name__)  # the family modules of this folder register their classes
register_backend("torch", compressor_class)  # specs in Horovod's own optimizers, on torch tensors

__all__ = ["Compressor", "ExchangeContext", "OneRoundCompressor", "TakesMomentum", "COMPRESSORS", "build_compressor",
           "compressor_class", "topk_indices", "sampled_threshold_select"]
