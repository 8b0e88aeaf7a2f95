"""PyTorch compressors, one class per registered spec name (see ``hvdcompress.spec``)."""

from hvdcompress.spec import REGISTRY, CompressionSpec, build_from

from .base import Compressor, ExchangeContext, OneRoundCompressor
from .dense import BF16Compressor, FP16Compressor, NoneCompressor
from .dgc import DGCCompressor
from .selection import sampled_threshold_select, topk_indices
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
    """The PyTorch compressor for a validated spec."""
    return build_from(COMPRESSORS, spec, "PyTorch")

assert set(COMPRESSORS) <= set(REGISTRY), "every PyTorch compressor needs a spec in hvdcompress.spec"

__all__ = ["Compressor", "ExchangeContext", "OneRoundCompressor", "COMPRESSORS", "build_compressor",
           "BF16Compressor", "FP16Compressor", "NoneCompressor", "RandomKCompressor",
           "ThresholdCompressor", "TopKCompressor", "DGCCompressor", "topk_indices",
           "sampled_threshold_select"]
