"""Top-k Adam for PyTorch: 1-bit Adam's frozen-variance Adam (``onebitadam``'s compressor, the
update it applies and the optimizer it takes over) with the first moment sent as ``topk``'s
payload, error feedback on. The math is in the oracle, ``hvdcompress.reference.topkadam``."""

from __future__ import annotations

from hvdcompress.reference.topkadam import inner_spec
from hvdcompress.spec import CompressionSpec

from .onebitadam import FrozenVarianceAdam
from .sparse import TopKCompressor


class TopKAdamCompressor(FrozenVarianceAdam):
    name = "topkadam"

    def __init__(self, spec: CompressionSpec):
        super().__init__(spec, TopKCompressor(inner_spec(spec)))
