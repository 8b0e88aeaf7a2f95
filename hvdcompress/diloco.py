"""The DiLoCo family's outer loop, framework-neutral: arguments, fragments and the sync schedule.

DiLoCo (Douillard et al. 2023): every worker takes ``sync_every`` (H) steps of its own inner
optimizer, exchanging nothing; then the pseudo-gradient ``Delta_i = theta_global - theta_i``
(global MINUS local) is averaged over the workers, an outer optimizer (SGD, lr 0.7, momentum 0.9,
Nesterov) steps ``theta_global`` with it, and every worker restarts from ``theta_global``.

Streaming DiLoCo (Douillard et al. 2025): the parameters are split into P ``fragments``; every
H / P inner steps one fragment is synchronised, in turn, so each fragment still syncs every H
steps. A fragment's exchange is launched ``overlap_steps`` (tau) inner steps before it is applied
and runs while those steps compute; when it is applied the outer optimizer steps that fragment's
``theta_global`` and the local parameters become ``theta_global + mix * (theta_local -
theta_global)`` (``mix`` = alpha; 0: the global parameters alone).

The step counter ``t`` counts completed inner steps (``t = 1`` after the first). With
``interval = H // P``: fragment ``(t // interval - 1) % P`` is applied after inner step ``t``
whenever ``t % interval == 0``, and its exchange is launched after inner step ``t - tau``.
``tau < interval``, so at most one fragment is in flight at a time. P = 1, tau = 0, alpha = 0
is DiLoCo itself.

The numpy reference (``hvdcompress.reference.diloco``), PyTorch (``torch_ops.diloco``) and
TensorFlow (``tf_ops.diloco``) implementations all take their arguments, fragments and schedule
from here, so they agree on which fragment syncs when.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .spec import CompressionSpec, resolve

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
OUTER_NESTEROV = True


def _int(name: str, value, low: int, high: Optional[int] = None) -> int:
    rng = f"an int in [{low}, {'inf' if high is None else high}]"
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer()):
        raise ValueError(f"DiLoCo: {name} must be {rng}; got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        raise ValueError(f"DiLoCo: {name} must be {rng}; got {value!r}")
    return value


@dataclass(frozen=True)
class OuterConfig:
    """Validated DiLoCo arguments (``check_arguments``)."""

    sync_every: int
    fragments: int
    overlap_steps: int
    mix: float
    compression: CompressionSpec

    @property
    def interval(self) -> int:
        """Inner steps between two fragment syncs: H / P."""
        return self.sync_every // self.fragments

    def applied_at(self, t: int) -> Optional[int]:
        """The fragment applied after inner step ``t`` (None if none)."""
        if t <= 0 or t % self.interval:
            return None
        return (t // self.interval - 1) % self.fragments

    def launched_at(self, t: int) -> Optional[int]:
        """The fragment whose exchange is launched after inner step ``t`` (None if none)."""
        return self.applied_at(t + self.overlap_steps)

    def due(self, t_launch: int) -> int:
        """The inner step after which an exchange launched after ``t_launch`` is applied."""
        return t_launch + self.overlap_steps


def check_arguments(num_tensors: int, sync_every, fragments=1, overlap_steps=0, mix=0.0,
                    compression=None) -> OuterConfig:
    """Validate the outer loop's arguments; ValueError naming the parameter and its accepted range.

    Pure (no collective), so every rank raises the same error before any collective starts.
    """
    if num_tensors < 1:
        raise ValueError("DiLoCo: the model has no parameters to synchronise")
    H = _int("sync_every", sync_every, 1)
    P = _int("fragments", fragments, 1, min(H, num_tensors))
    if H % P:
        raise ValueError(f"DiLoCo: sync_every ({H}) must be divisible by fragments ({P}): each fragment "
                         "syncs every sync_every steps, one every sync_every / fragments steps")
    tau = _int("overlap_steps", overlap_steps, 0, H // P - 1)
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not math.isfinite(mix) or not 0.0 <= mix <= 1.0:
        raise ValueError(f"DiLoCo: mix must be a float in [0.0, 1.0]; got {mix!r}")
    spec = resolve(compression)
    if float(spec.params.get("momentum", 0.0) or 0.0) > 0.0:
        raise ValueError(f"DiLoCo: compression {spec} keeps a momentum of its own; the outer optimizer holds "
                         "the momentum of the outer loop: give the compressor momentum=0")
    return OuterConfig(H, P, tau, float(mix), spec)


def split_fragments(sizes: Sequence[int], fragments: int) -> List[List[int]]:
    """Split tensors (in model order, with ``sizes`` elements each) into ``fragments`` consecutive,
    non-empty runs of about equal element count: tensor i goes to the fragment in which the midpoint
    of its elements falls (cumulative count before it plus half its size, over total / P). Returns
    the tensor indices of each fragment. Every implementation splits the same way."""
    n = len(sizes)
    P = int(fragments)
    if not 1 <= P <= n:
        raise ValueError(f"DiLoCo: fragments must be an int in [1, {n}] (the number of parameters); got {P}")
    total = float(sum(int(s) for s in sizes)) or 1.0
    owner, before = [], 0
    for i, s in enumerate(sizes):
        want = min(P - 1, int((before + int(s) / 2.0) * P / total))
        before += int(s)
        prev = owner[-1] if owner else -1
        # consecutive (the previous fragment or the next one), and enough tensors left for the rest
        owner.append(min(max(want, prev, P - n + i), prev + 1))
    out: List[List[int]] = [[] for _ in range(P)]
    for i, f in enumerate(owner):
        out[f].append(i)
    return out
