"""hvdcompress: communication-efficient distributed training on top of Horovod.

This package is the framework-agnostic core (it imports no framework and no backend; the
backends register themselves with it): the algorithm registry and spec validation (``spec``), the
numpy oracles that declare and define every algorithm (``reference``), the seeded schemes the
backends reproduce, the cost model and merge planner, wire statistics. Above the backends stand
the faces users import, ``hvdcompress.torch`` (PyTorch), ``hvdcompress.keras`` and
``hvdcompress.tensorflow``, and the tools (the benchmark harness ``bench``, the console command).
``.importlinter`` states these layers. See docs/design.md.
"""

from .spec import Compression, CompressionSpec, parse_spec, resolve
from .stats import WireStats
from . import reference  # noqa: F401  (its modules declare every built-in algorithm)

__version__ = "0.1.0"
__all__ = ["Compression", "CompressionSpec", "parse_spec", "resolve", "WireStats", "__version__"]
