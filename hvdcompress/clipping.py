"""DGC's local gradient clipping (Lin et al., ICLR 2018, section 3.2): the two scopes, one rule.

Each worker clips its own gradient *before* it enters the momentum / velocity memory, to the
threshold ``clip_norm / sqrt(N)`` (N workers: the summed gradient of N independent workers has
about sqrt(N) times the norm of one), with the coefficient ``(clip_norm / sqrt(N)) / (norm + 1e-6)``
applied when it is below 1. ``clip_scope`` says whose norm:

``tensor``  every tensor's own norm (each member of a merged group on its own, so the result does
            not depend on the merge schedule).
``global``  the norm of the worker's whole gradient, as the paper (and ``clip_grad_norm_``) does.
            Exchanges launch during backward, before the whole gradient exists, so the norm used
            at step t is the whole local gradient's norm *of the last step before t* (one step
            late); the first step, before any norm is known, is not clipped. Every tensor of a
            step uses the same coefficient, whatever the grouping, and the norm is summed with
            ``math.fsum`` over per-tensor sums of squares (float64), so it does not depend on the
            merge schedule or on the order in which groups launch. The lag is the price of keeping
            the launches in backward: a gradient that explodes at step t is clipped from step
            t+1 on (the clipping coefficient at t is that of t-1).

``GlobalNorm`` keeps the per-tensor sums of squares of the current step and the finished norm;
its ``state()`` goes into the optimizer's checkpoint so a resumed run clips as the original.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

CLIP_SCOPES = ("tensor", "global")


def clip_coefficient(norm: Optional[float], clip_norm: Optional[float], world: int) -> Optional[float]:
    """The factor to multiply the gradient by, or None when it is not clipped (no threshold, no
    norm yet, or the norm already below the threshold). Computed in float64."""
    if clip_norm is None or norm is None:
        return None
    coef = (clip_norm / math.sqrt(world)) / (norm + 1e-6)
    return coef if coef < 1.0 else None


class GlobalNorm:
    """The whole local gradient's norm, one step late (see the module doc).

    ``record(step, name, sumsq)`` for every tensor of a step (a tensor recorded twice in a step
    keeps its last value); ``norm_before(step)`` is the norm of the last recorded step before
    ``step`` (None before any), and forgets the older steps' tensors.
    """

    def __init__(self):
        self._steps: Dict[int, Dict[str, float]] = {}
        self.norm: Optional[float] = None
        self.norm_step: Optional[int] = None

    def record(self, step: int, name: str, sumsq: float) -> None:
        self._steps.setdefault(int(step), {})[name] = float(sumsq)

    def norm_before(self, step: int) -> Optional[float]:
        done = [s for s in self._steps if s < step]
        if done:
            last = max(done)
            self.norm = math.sqrt(math.fsum(self._steps[last].values()))
            self.norm_step = last
            for s in done:
                del self._steps[s]
        return self.norm

    def state(self) -> Dict[str, Any]:
        return {"norm": self.norm, "norm_step": self.norm_step,
                "steps": {str(s): dict(d) for s, d in self._steps.items()}}

    def load(self, state: Optional[Dict[str, Any]]) -> None:
        state = state or {}
        self.norm = None if state.get("norm") is None else float(state["norm"])
        self.norm_step = None if state.get("norm_step") is None else int(state["norm_step"])
        self._steps = {int(s): {k: float(x) for k, x in d.items()} for s, d in state.get("steps", {}).items()}
