"""QSGD Adam for TensorFlow: 1-bit Adam's frozen-variance Adam (``onebitadam``'s compressor, its
one allgather a step and its Keras rules) with the first moment sent as ``qsgd``'s packed payload,
error feedback on. The math is in the oracle, ``hvdcompress.reference.qsgdadam``."""

from __future__ import annotations

from hvdcompress.reference.qsgdadam import inner_spec

from .onebitadam import PackedMomentAdam
from .quantizers import QSGDCompressor


class QSGDAdamCompressor(PackedMomentAdam):
    name = "qsgdadam"

    def __init__(self, spec):
        super().__init__(spec, QSGDCompressor(inner_spec(spec)))
