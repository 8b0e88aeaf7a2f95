"""hvdcompress: communication-efficient distributed training on top of Horovod.

This package is the framework-agnostic core (it imports neither torch nor TensorFlow):
compression specs and their validation, the seeded index scheme, wire statistics and the numpy
reference implementations. The backends are ``hvdcompress.torch`` (PyTorch) and, later,
``hvdcompress.keras`` / ``hvdcompress.tensorflow``.
"""

from .spec import Compression, CompressionSpec, parse_spec, resolve
from .stats import WireStats

__version__ = "0.1.0"
__all__ = ["Compression", "CompressionSpec", "parse_spec", "resolve", "WireStats", "__version__"]
