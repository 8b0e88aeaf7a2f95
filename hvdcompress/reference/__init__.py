"""numpy reference implementations: the oracle both backends are tested against.

Written for clarity, not speed: each function follows the published definition step by step.
``payloads`` holds the per-worker encodings (what one rank puts on the wire); ``exchange``
simulates N workers exchanging them, with error feedback, the way the backends' pipelines do.
"""

from .codecs import bf16_decode, bf16_encode, fp16_decode, fp16_encode
from .exchange import reference_exchange, reference_payload, reference_decompress
from .selection import threshold_indices, topk_indices

__all__ = [
    "bf16_decode", "bf16_encode", "fp16_decode", "fp16_encode",
    "reference_exchange", "reference_payload", "reference_decompress",
    "threshold_indices", "topk_indices",
]
