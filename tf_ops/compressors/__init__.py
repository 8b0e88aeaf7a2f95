"""TensorFlow compressors: one module per algorithm family, one class per registered algorithm
(``name = "topk"`` registers it; the algorithm is declared in ``hvdcompress.reference``). Every
module of this folder is imported with this package (``hvdcompress.contract.discover``): adding an
algorithm is adding its module. The package then registers itself with the core for Horovod's own
optimizers (``register_backend``)."""

from hvdcompress.contract import discover
from hvdcompress.horovod_interop import register_backend
from hvdcompress.spec import CompressionSpec, build_from

from .base import COMPRESSORS, Compressor, ExchangeContext, OneRoundCompressor, TakesMomentum, selected_count
from .selection import random_selection, sampled_threshold_select, threshold_indices, topk_indices


def compressor_class(spec: CompressionSpec):
    """The TensorFlow class implementing ``spec`` (ValueError if none does)."""
    return build_from(COMPRESSORS, spec, "TensorFlow", make=False)


def build_compressor(spec: CompressionSpec) -> Compressor:
    """The TensorFlow compressor for a validated spec."""
    return build_from(COMPRESSORS, spec, "TensorFlow")


discover(__name__)  # the family modules of this folder register their classes
register_backend("tensorflow", compressor_class)  # specs in Horovod's own optimizers, on tensorflow tensors

__all__ = ["Compressor", "ExchangeContext", "OneRoundCompressor", "TakesMomentum", "COMPRESSORS", "build_compressor",
           "compressor_class", "selected_count", "topk_indices", "threshold_indices", "random_selection",
           "sampled_threshold_select"]
