"""PyTorch backend of hvdcompress. Users import it as ``import hvdcompress.torch as hvc``."""

from hvdcompress.spec import Compression, CompressionSpec, parse_spec

from .compressors import COMPRESSORS, Compressor, ExchangeContext, build_compressor
from .diloco import DiLoCo
from .optimizer import DistributedOptimizer

__all__ = ["Compression", "CompressionSpec", "parse_spec", "COMPRESSORS", "Compressor",
           "ExchangeContext", "build_compressor", "DistributedOptimizer", "DiLoCo"]
