"""TensorFlow 2 / Keras backend of hvdcompress. Users import it as ``import hvdcompress.keras as hvc``
(or ``hvdcompress.tensorflow``).

Horovod's Keras layer needs Keras 2 (tf-keras): ``TF_USE_LEGACY_KERAS=1`` is set here, which works
when this package is imported before TensorFlow; a script that imports TensorFlow first must set it
itself.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from hvdcompress.spec import Compression, CompressionSpec, parse_spec  # noqa: E402

from .callbacks import CompressionStatsCallback, DelayedAveragingFlushCallback, SparsityWarmupCallback  # noqa: E402
from .compression import GradientCompression  # noqa: E402
from .compressors import COMPRESSORS, Compressor, ExchangeContext, build_compressor  # noqa: E402
from .optimizer import DistributedOptimizer  # noqa: E402
from .tape import DistributedGradientTape  # noqa: E402
from .diloco import DiLoCo, DiLoCoCallback  # noqa: E402

__all__ = ["Compression", "CompressionSpec", "parse_spec", "COMPRESSORS", "Compressor", "ExchangeContext",
           "build_compressor", "GradientCompression", "DistributedGradientTape", "DistributedOptimizer",
           "SparsityWarmupCallback", "CompressionStatsCallback", "DelayedAveragingFlushCallback",
           "DiLoCo", "DiLoCoCallback"]
