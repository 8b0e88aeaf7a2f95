"""The timeline of one backward pass whose gradients are compressed and sent in merged groups.

Tensors are numbered in *backward order* (0 = the first gradient backward produces, i.e. the
last layer's). A plan is a partition of 0..L-1 into consecutive groups. For tensor i, ``t_b[i]``
is the backward compute that precedes its gradient (the gap between two gradient hooks);
``t_s(bytes)`` is the time to compress a group, ``t_c(bytes)`` the time to exchange it (both take
the group's dense size in bytes). Time 0 is the start of backward.

Two models of where compression runs (``overlap``):

``"shared"`` (default; the MGS reference's model, and what a backward hook does on a CPU or on a
single CUDA stream): compression runs on the compute stream, so it delays the backward of the
layers after it. With ``R_i = t_b[0] + ... + t_b[i]`` and groups g = 1..G ending at tensor e_g::

    compress_end[g] = R_{e_g} + t_s(1) + ... + t_s(g)          (backward and compression in turn)
    comm_end[g]     = max(comm_end[g-1], compress_end[g]) + t_c(g)

``"parallel"`` (docs/design.md's formula, tau_s[l] = tau_b[l] + t_b[l]; tau_c[l] = max(tau_c[l+1] +
t_c[l+1], tau_s[l] + t_s[l])): compression of a group starts as soon as its last gradient is
ready and runs beside backward and beside other groups' compression::

    compress_end[g] = R_{e_g} + t_s(g)
    comm_end[g]     = max(comm_end[g-1], compress_end[g]) + t_c(g)

In both, communication is serialized (one group on the wire at a time, in order) and the step's
backward-plus-exchange time is ``comm_end[G]``. With t_s = 0 both are MG-WFBP's model.

Optionally ``t_d(bytes)``, the time to turn a group's collective results back into gradients
(decompress, aggregate, scatter into ``.grad``). That runs in ``synchronize()``, on the compute
stream once backward is done, group after group as their exchanges end::

    finish[g] = max(finish[g-1], comm_end[g], backward_end) + t_d(g),   end = finish[G]

The searches leave t_d out (it is nearly proportional to the total size, whatever the grouping);
predictions include it when the cost model has a fit.

Optionally ``t_close(bytes)``: extra time of the *closing* exchange, the last group's, which is
launched once backward is done. A collective ends when the slowest rank has contributed, and the
ranks drift apart over a step (load, unequal shares of the cores), so the exchange that closes the
step waits for the latest rank; exchanges launched during backward wait mostly for the backward
that follows them anyway. ``CostModel.closing_seconds`` measures it (``exchange_skew``)::

    comm_end[G] = max(comm_end[G-1], compress_end[G]) + t_c(G) + t_close(G)

Optionally, in place of t_c, the exchange time at the start-ups a collective pays in a training
step (``CostModel.start_ups``): ``t_alone(bytes)`` for a group alone in Horovod's negotiation
cycle, ``t_queued(bytes)`` for one ready before the previous group's exchange started
(``compress_end[g] <= comm_start[g-1]``), which is negotiated together with what else waits::

    comm_end[g] = max(comm_end[g-1], compress_end[g]) + (t_queued(g) if queued else t_alone(g))

Like t_d, the searches leave them out (whether a group queues depends on the timeline the
partition makes, which their recurrences do not track); predictions include them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

OVERLAPS = ("shared", "parallel")
CostFn = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Timeline:
    """Per group (arrays in group order): when its last gradient is ready on the compute stream,
    when its compression starts and ends, when its exchange starts and ends."""

    groups: Tuple[Tuple[int, ...], ...]
    ready: np.ndarray
    compress_start: np.ndarray
    compress_end: np.ndarray
    comm_start: np.ndarray
    comm_end: np.ndarray
    backward_end: float  # all local compute (backward and every compression) is done
    finish_end: Optional[float] = None  # the last group's results are gradients again (with t_d)

    @property
    def end(self) -> float:
        """Backward + exchange time of the step: the last group's exchange ends (and, with t_d,
        its results are scattered back)."""
        if self.finish_end is not None:
            return self.finish_end
        return float(self.comm_end[-1]) if len(self.comm_end) else self.backward_end

    @property
    def exposed_comm(self) -> float:
        """How long the step waits for the network after the compute stream is done."""
        return self.end - self.backward_end

    def as_dict(self) -> dict:
        return {"groups": [list(g) for g in self.groups], "ready": self.ready.tolist(),
                "compress_start": self.compress_start.tolist(), "compress_end": self.compress_end.tolist(),
                "comm_start": self.comm_start.tolist(), "comm_end": self.comm_end.tolist(),
                "backward_end": self.backward_end, "finish_end": self.finish_end, "end": self.end}


def check_overlap(overlap: str) -> str:
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap: must be one of {', '.join(map(repr, OVERLAPS))}; got {overlap!r}")
    return overlap


def as_cost_fn(fn: Callable) -> CostFn:
    """Wrap a cost function so it maps an array of byte counts to an array of seconds (a plain
    scalar function, e.g. one using ``math.log``, is applied element by element)."""
    def vectorised(x):
        x = np.asarray(x, dtype=float)
        try:
            with warnings.catch_warnings():  # math.* on a 1-element array: a scalar function
                warnings.simplefilter("error", DeprecationWarning)
                y = np.asarray(fn(x), dtype=float)
            if y.shape == x.shape:
                return y
            if y.ndim == 0:
                return np.full(x.shape, float(y))
        except (TypeError, ValueError, DeprecationWarning):
            pass
        return np.array([float(fn(float(v))) for v in x.ravel()], dtype=float).reshape(x.shape)
    return vectorised


def check_inputs(sizes: Sequence[float], t_b: Sequence[float]) -> Tuple[np.ndarray, np.ndarray]:
    sizes = np.asarray(sizes, dtype=float)
    t_b = np.asarray(t_b, dtype=float)
    if sizes.ndim != 1 or t_b.shape != sizes.shape:
        raise ValueError(f"sizes and t_b must be 1-D and of equal length; got shapes {sizes.shape}, {t_b.shape}")
    if not (np.all(np.isfinite(sizes)) and np.all(sizes >= 0)):
        raise ValueError("sizes: every tensor size (bytes) must be finite and >= 0")
    if not (np.all(np.isfinite(t_b)) and np.all(t_b >= 0)):
        raise ValueError("t_b: every backward time (seconds) must be finite and >= 0")
    return sizes, t_b


def check_partition(groups: Sequence[Sequence[int]], n: int) -> Tuple[Tuple[int, ...], ...]:
    """Groups must be non-empty runs of consecutive indices that cover 0..n-1 in order."""
    flat = [int(i) for g in groups for i in g]
    if any(len(g) == 0 for g in groups) or flat != list(range(n)):
        raise ValueError(f"groups must partition 0..{n - 1} into non-empty consecutive runs, in backward "
                         f"order; got {[list(g) for g in groups]}")
    for g in groups:
        if list(g) != list(range(g[0], g[0] + len(g))):
            raise ValueError(f"group {list(g)} is not a run of consecutive indices")
    return tuple(tuple(int(i) for i in g) for g in groups)


def group_ends(groups: Sequence[Sequence[int]]) -> List[int]:
    """Exclusive end index of every group: [[0, 1], [2]] -> [2, 3]."""
    return [int(g[-1]) + 1 for g in groups]


def groups_from_ends(ends: Sequence[int]) -> List[List[int]]:
    starts = [0] + list(ends[:-1])
    return [list(range(a, b)) for a, b in zip(starts, ends)]


def predict(groups: Sequence[Sequence[int]], sizes: Sequence[float], t_b: Sequence[float],
            t_s: Callable, t_c: Callable, overlap: str = "shared", t_d: Optional[Callable] = None,
            t_close: Optional[Callable] = None, t_step: Optional[Tuple[Callable, Callable]] = None) -> Timeline:
    """The timeline of the module doc for this partition (``t_d``, ``t_close``, ``t_step``:
    (t_alone, t_queued), see the module doc)."""
    check_overlap(overlap)
    sizes, t_b = check_inputs(sizes, t_b)
    groups = check_partition(groups, len(sizes))
    nbytes = group_bytes(groups, sizes)
    close = None
    if t_close is not None and len(groups):
        close = float(as_cost_fn(t_close)(nbytes[-1:])[0])
    step = None if t_step is None else tuple(as_cost_fn(f)(nbytes) for f in t_step)
    return predict_costs(groups, t_b, as_cost_fn(t_s)(nbytes), as_cost_fn(t_c)(nbytes), overlap,
                         None if t_d is None else as_cost_fn(t_d)(nbytes), close, step)


def group_bytes(groups: Sequence[Sequence[int]], sizes: Sequence[float]) -> np.ndarray:
    """Bytes of every group (a partition of the tensors, in order)."""
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(sizes, dtype=float))])
    ends = group_ends(groups)
    starts = [0] + ends[:-1]
    return np.array([cum[e] - cum[s] for s, e in zip(starts, ends)], dtype=float)


def predict_costs(groups: Sequence[Sequence[int]], t_b: Sequence[float], ts: Sequence[float],
                  tc: Sequence[float], overlap: str = "shared", td: Optional[Sequence[float]] = None,
                  close: Optional[float] = None, step: Optional[Tuple[Sequence[float], Sequence[float]]] = None
                  ) -> Timeline:
    """The timeline of a checked partition from per-group costs already evaluated: compression
    ``ts``, exchange ``tc``, optionally decompression ``td``, the closing exchange's extra
    ``close`` and ``step``: the exchange times (alone, queued) that replace ``tc`` (``predict``
    evaluates them from cost functions of the group's bytes)."""
    groups = tuple(tuple(int(i) for i in g) for g in groups)
    ends = group_ends(groups)
    R = np.concatenate([[0.0], np.cumsum(np.asarray(t_b, dtype=float))])
    ts = np.asarray(ts, dtype=float)
    tc = np.array(tc, dtype=float)  # a copy: the closing term is added in place
    n = len(groups)
    alone = queued = None
    if step is not None:
        alone, queued = (np.array(x, dtype=float) for x in step)
        if alone.shape != tc.shape or queued.shape != tc.shape:
            raise ValueError(f"step: one alone and one queued exchange time per group ({n})")
    if close is not None and n:
        tc[-1] += float(close)
        if step is not None:
            alone[-1] += float(close)
            queued[-1] += float(close)
    ready, cs, ce, ms, me = (np.zeros(n) for _ in range(5))
    stream = 0.0  # shared: compression done so far, pushing the compute stream back
    comm_free = 0.0
    for g, e in enumerate(ends):
        ready[g] = R[e] + stream if overlap == "shared" else R[e]
        cs[g] = ready[g]
        ce[g] = cs[g] + ts[g]
        if overlap == "shared":
            stream += ts[g]
        ms[g] = max(comm_free, ce[g])
        if step is None:
            cost = tc[g]
        else:  # queued: ready before the previous exchange started, negotiated with what else waits
            cost = queued[g] if g > 0 and ce[g] <= ms[g - 1] else alone[g]
        me[g] = comm_free = ms[g] + cost
    backward_end = float(R[-1] + stream) if overlap == "shared" else float(max(R[-1], ce.max(initial=0.0)))
    finish = None
    if td is not None:
        finish = backward_end
        for end_g, d in zip(me, td):
            finish = max(finish, float(end_g)) + float(d)
    return Timeline(groups, ready, cs, ce, ms, me, backward_end, finish)
