"""TensorFlow compressors: one module per algorithm family, one class per registered algorithm
(``name = "topk"`` registers it; the algorithm is declared in ``hvdcompress.reference``)."""

from hvdcompress.spec import CompressionSpec, build_from

from .base import COMPRESSORS, Compressor, ExchangeContext, OneRoundCompressor, TakesMomentum, selected_count
# the built-in algorithm families (importing a module registers its classes)
from .dense import BF16Compressor, FP16Compressor, NoneCompressor
from .dgc import DGCCompressor
from .powersgd import PowerSGDCompressor
from .quantizers import EFSignSGDCompressor, OneBitCompressor, QSGDCompressor, SignSGDCompressor, TernGradCompressor
from .selection import random_selection, sampled_threshold_select, threshold_indices, topk_indices
from .sketch import SketchCompressor
from .sparseloco import SparseLoCoCompressor
from .sparse import RandomKCompressor, ThresholdCompressor, TopKCompressor


def compressor_class(spec: CompressionSpec):
    """The TensorFlow class implementing ``spec`` (ValueError if none does)."""
    return build_from(COMPRESSORS, spec, "TensorFlow", make=False)


def build_compressor(spec: CompressionSpec) -> Compressor:
    """The TensorFlow compressor for a validated spec."""
    return build_from(COMPRESSORS, spec, "TensorFlow")


__all__ = ["Compressor", "ExchangeContext", "OneRoundCompressor", "TakesMomentum", "COMPRESSORS", "build_compressor",
           "compressor_class", "BF16Compressor", "FP16Compressor", "NoneCompressor", "RandomKCompressor",
           "ThresholdCompressor", "TopKCompressor", "DGCCompressor", "SketchCompressor", "PowerSGDCompressor",
           "EFSignSGDCompressor", "OneBitCompressor", "QSGDCompressor", "SignSGDCompressor", "TernGradCompressor",
           "selected_count", "topk_indices", "threshold_indices", "random_selection", "sampled_threshold_select",
           "SparseLoCoCompressor"]
