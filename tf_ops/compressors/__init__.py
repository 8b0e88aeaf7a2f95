"""TensorFlow compressors: one module per algorithm family, one class per registered algorithm
(``name = "topk"`` registers it; the algorithm is declared in ``hvdcompress.reference``)."""

from hvdcompress.spec import CompressionSpec, build_from

from .base import COMPRESSORS, Compressor, ExchangeContext, OneRoundCompressor, selected_count
from .dense import BF16Compressor, FP16Compressor, NoneCompressor
from .dgc import DGCCompressor
from .sketch import SketchCompressor  # noqa: F401  (Sketched-SGD)
from .selection import random_selection, sampled_threshold_select, threshold_indices, topk_indices
from .sparse import RandomKCompressor, ThresholdCompressor, TopKCompressor
from .quantizers import EFSignSGDCompressor, OneBitCompressor, QSGDCompressor, SignSGDCompressor, TernGradCompressor  # noqa: F401
from .powersgd import PowerSGDCompressor  # noqa: F401

def compressor_class(spec: CompressionSpec):
    """The TensorFlow class implementing ``spec`` (ValueError if none does)."""
    return build_from(COMPRESSORS, spec, "TensorFlow", make=False)


def build_compressor(spec: CompressionSpec) -> Compressor:
    """The TensorFlow compressor for a validated spec."""
    return build_from(COMPRESSORS, spec, "TensorFlow")


__all__ = ["Compressor", "ExchangeContext", "OneRoundCompressor", "COMPRESSORS", "build_compressor", "compressor_class",
           "BF16Compressor", "FP16Compressor", "NoneCompressor", "RandomKCompressor",
           "ThresholdCompressor", "TopKCompressor", "DGCCompressor", "selected_count", "topk_indices",
           "threshold_indices", "random_selection", "sampled_threshold_select"]
