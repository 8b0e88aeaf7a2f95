"""QSGD Adam for PyTorch: 1-bit Adam's frozen-variance Adam (``onebitadam``'s compressor, the
update it applies and the optimizer it takes over) with the first moment sent as ``qsgd``'s
payload, error feedback on. The math is in the oracle, ``hvdcompress.reference.qsgdadam``."""

from __future__ import annotations

from hvdcompress.reference.qsgdadam import inner_spec
from hvdcompress.spec import CompressionSpec

from .onebitadam import FrozenVarianceAdam
from .quantizers import QSGDCompressor


class QSGDAdamCompressor(FrozenVarianceAdam):
    name = "qsgdadam"

    def __init__(self, spec: CompressionSpec):
        super().__init__(spec, QSGDCompressor(inner_spec(spec)))
