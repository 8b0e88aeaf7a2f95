"""PyTorch compressors: one module per algorithm family, one class per registered algorithm.

A class names the algorithm it implements (``name = "topk"``) and is registered by that;
the algorithm itself (spec, parameters, wire cost, oracle) is declared in ``hvdcompress.reference``.
"""

from hvdcompress.spec import CompressionSpec, build_from

from .base import COMPRESSORS, Compressor, ExchangeContext, OneRoundCompressor, TakesMomentum
# the built-in algorithm families (importing a module registers its classes)
from .dense import BF16Compressor, FP16Compressor, NoneCompressor
from .dgc import DGCCompressor
from .powersgd import PowerSGDCompressor
from .quantizers import EFSignSGDCompressor, OneBitCompressor, QSGDCompressor, SignSGDCompressor, TernGradCompressor
from .dgc_selection import sampled_threshold_select
from .selection import topk_indices
from .sketch import SketchCompressor
from .sparseloco import SparseLoCoCompressor
from .sparse import RandomKCompressor, ThresholdCompressor, TopKCompressor


def compressor_class(spec: CompressionSpec):
    """The PyTorch class implementing ``spec`` (ValueError if none does)."""
    return build_from(COMPRESSORS, spec, "PyTorch", make=False)


def build_compressor(spec: CompressionSpec) -> Compressor:
    """The PyTorch compressor for a validated spec."""
    return build_from(COMPRESSORS, spec, "PyTorch")


__all__ = ["Compressor", "ExchangeContext", "OneRoundCompressor", "TakesMomentum", "COMPRESSORS", "build_compressor",
           "compressor_class", "BF16Compressor", "FP16Compressor", "NoneCompressor", "RandomKCompressor",
           "ThresholdCompressor", "TopKCompressor", "DGCCompressor", "SketchCompressor", "PowerSGDCompressor",
           "EFSignSGDCompressor", "OneBitCompressor", "QSGDCompressor", "SignSGDCompressor", "TernGradCompressor",
           "topk_indices", "sampled_threshold_select", "SparseLoCoCompressor"]
