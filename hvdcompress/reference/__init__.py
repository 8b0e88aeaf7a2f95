"""numpy reference implementations: the oracle both backends are tested against, and the place
where every algorithm is declared (``spec.register``) -- one module per algorithm family. The
family modules are not listed anywhere: this package imports every module of its folder
(``hvdcompress.contract.discover``), so an algorithm is added by adding its module; the
``hvdcompress`` package imports this one, so every built-in is declared before a name is asked.

Written for clarity, not speed: each module follows the published definition step by step. An
oracle is a per-rank exchange generator (``oracle.Oracle``), simulated over N ranks by
``oracle.simulate``; ``exchange`` keeps the one-round helpers the tests call by name.
"""

from .codecs import bf16_decode, bf16_encode, fp16_decode, fp16_encode
from .exchange import reference_decompress, reference_exchange, reference_payload
from ..contract import ExchangeContext, Member
from .oracle import ORACLES, Oracle, oracle_for, simulate
from .selection import threshold_indices, topk_indices
from ..contract import discover

__all__ = [
    "bf16_decode", "bf16_encode", "fp16_decode", "fp16_encode",
    "reference_exchange", "reference_payload", "reference_decompress",
    "threshold_indices", "topk_indices", "ORACLES", "ExchangeContext", "Member", "Oracle", "oracle_for",
    "simulate",
]

discover(__name__)  # the family modules of this folder declare their algorithms

