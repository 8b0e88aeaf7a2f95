"""numpy reference implementations: the oracle both backends are tested against, and the place
where every algorithm is declared (``spec.register``) -- one module per algorithm family.

Written for clarity, not speed: each module follows the published definition step by step. An
oracle is a per-rank exchange generator (``oracle.Oracle``), simulated over N ranks by
``oracle.simulate``; ``exchange`` keeps the one-round helpers the tests call by name.
"""

from . import dense, dgc, powersgd, quantizers, sketch, sparse, sparseloco  # noqa: F401  (importing registers the built-ins)
from .codecs import bf16_decode, bf16_encode, fp16_decode, fp16_encode
from .exchange import reference_decompress, reference_exchange, reference_payload
from .oracle import ORACLES, Member, Oracle, OracleContext, oracle_for, simulate
from .selection import threshold_indices, topk_indices

__all__ = [
    "bf16_decode", "bf16_encode", "fp16_decode", "fp16_encode",
    "reference_exchange", "reference_payload", "reference_decompress",
    "threshold_indices", "topk_indices", "ORACLES", "Member", "Oracle", "OracleContext", "oracle_for",
    "simulate",
]
