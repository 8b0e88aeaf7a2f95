"""TensorFlow compressors, one class per registered spec name (see ``hvdcompress.spec``)."""

from hvdcompress.spec import REGISTRY, CompressionSpec, build_from

from .base import Compressor, ExchangeContext, OneRoundCompressor, selected_count
from .dense import BF16Compressor, FP16Compressor, NoneCompressor
from .dgc import DGCCompressor
from .selection import random_selection, sampled_threshold_select, threshold_indices, topk_indices
from .sparse import RandomKCompressor, ThresholdCompressor, TopKCompressor

COMPRESSORS = {
    "none": NoneCompressor,
    "fp16": FP16Compressor,
    "bf16": BF16Compressor,
    "topk": TopKCompressor,
    "randomk": RandomKCompressor,
    "threshold": ThresholdCompressor,
    "dgc": DGCCompressor,
}


def build_compressor(spec: CompressionSpec) -> Compressor:
    """The TensorFlow compressor for a validated spec."""
    return build_from(COMPRESSORS, spec, "TensorFlow")

assert set(COMPRESSORS) <= set(REGISTRY), "every TensorFlow compressor needs a spec in hvdcompress.spec"

__all__ = ["Compressor", "ExchangeContext", "OneRoundCompressor", "COMPRESSORS", "build_compressor",
           "BF16Compressor", "FP16Compressor", "NoneCompressor", "RandomKCompressor",
           "ThresholdCompressor", "TopKCompressor", "DGCCompressor", "selected_count", "topk_indices",
           "threshold_indices", "random_selection", "sampled_threshold_select"]
