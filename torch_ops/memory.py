"""Error-feedback memories (the 'memory' role of the compressor contract).

    a = g + r        compensate: add back what earlier steps did not send
    r = a - D(C(a))  update: keep what this step does not send

Nothing the worker computed is dropped, only delayed. The residual lives in the exchange
context's ``state`` dict under ``"residual"``, which the optimizer saves and restores.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from hvdcompress.spec import CompressionSpec


class Memory:
    """No memory: what is not sent is lost (the right choice for lossless or unbiased codecs)."""

    def compensate(self, x: torch.Tensor, state: Dict[str, torch.Tensor]) -> torch.Tensor:
        return x

    def update(self, unsent: Callable[[], torch.Tensor], state: Dict[str, torch.Tensor]) -> None:
        """``unsent()`` computes a - D(C(a)); called only by memories that keep it."""
        return None


class ResidualMemory(Memory):
    """Error feedback with a residual per tensor."""

    def compensate(self, x, state):
        r = state.get("residual")
        if r is None:
            return x
        if r.shape != x.shape:
            raise ValueError(f"residual memory: stored residual has shape {tuple(r.shape)}, "
                             f"gradient has {tuple(x.shape)}")
        if r.dtype != x.dtype:
            return x + r
        # a = g + r in the residual's own buffer (one pass, no allocation; r + g == g + r bit for
        # bit). The residual is thereby consumed: ``update`` stores what is left of a (a
        # sparsifier's ``unsent`` zeroes the sent entries of this same buffer).
        return r.add_(x)

    def update(self, unsent, state):
        state["residual"] = unsent()


def memory_for(spec: CompressionSpec) -> Memory:
    return ResidualMemory() if spec.params.get("residual", False) else Memory()
