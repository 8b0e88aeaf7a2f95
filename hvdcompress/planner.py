"""Layer-merging planner: which consecutive gradient tensors to compress and send as one group.

Pure functions over sizes and timings (no torch, no Horovod). The model is that of
``hvdcompress.timeline`` (read its doc for the formulas and the two ``overlap`` assumptions):
tensors in backward order, backward time ``t_b`` per tensor, compression time ``t_s(bytes)`` and
exchange time ``t_c(bytes)`` per group, exchanges serialized; a group is compressed when its last
(in backward order) gradient is ready.

The API the optimizer calls::

    plan = make_plan(schedule, sizes_bytes, t_b, cost_model, spec, world_size)
    plan.groups             # [[0, 1, 2], [3], ...]: tensor indices in backward order, consecutive
    plan.predicted_seconds  # forward + backward/exchange timeline end + update, or None
    plan.timeline           # per group: ready, compress start/end, exchange start/end

``schedule`` is a string (``parse_schedule``):

    "layerwise"      one group per tensor (what Horovod does without fusion)
    "single"         one group holding every tensor (sent once backward is done)
    "size:<MB>"      Horovod-fusion-like: tensors join the open group while it stays <= MB MiB
    "mgs"            the partition minimising the modelled time, compression time included
                     (Merged Gradient Sparsification, Shi et al., INFOCOM 2020)
    "mgwfbp"         the same with compression time taken as 0 in the search (MG-WFBP, INFOCOM 2019)
    "mgs:greedy", "mgwfbp:greedy"  the papers' greedy rule instead of the exact optimum
    "auto" or None   "mgs" for gathered (sparse) compressors, "mgwfbp" for summed (dense) ones

``cost_model`` is a ``hvdcompress.costmodel.CostModel``; it gives t_c for the compressor ``spec``
at ``world_size`` and t_s (the prediction always includes t_s when the model has a fit for the
spec). ``layerwise``/``single``/``size`` need no cost model; without one (or without t_b) the
prediction is None.

Search (``optimal``): the exact minimum over all 2^(L-1) consecutive partitions, by dynamic
programming over the end of the last group. With ``overlap="parallel"`` the state after tensors
0..k-1 is the exchange end time C (the best prefix is the one with the smallest C, as everything
later is non-decreasing in C): O(L^2). With ``overlap="shared"`` the future also depends on S,
the compression time already spent on the compute stream, so each prefix keeps its Pareto front
of (S, C) pairs; both transitions ``S' = S + t_s``, ``C' = max(C, R_k + S') + t_c`` are
non-decreasing in (S, C), so dropping dominated pairs is exact. Cost O(L^2 * F), F the front size
(a handful in practice). ``greedy`` is the MGS rule: walking in backward order, the next tensor
joins the open group when the extra time the group's data would wait for it is less than the
start-up cost saved by sending one exchange fewer, t_c(a) + t_c(b) - t_c(a+b). ``brute_force``
enumerates every partition (tests only).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .spec import GATHERED, resolve
from .timeline import (Timeline, as_cost_fn, check_inputs, check_overlap, group_ends, groups_from_ends,
                       predict)

MIB = 1 << 20
COST_MODEL_SCHEDULES = ("mgs", "mgwfbp")
ACCEPTED = ("'layerwise', 'single', 'size:<MB>' (e.g. 'size:64'), 'mgs', 'mgwfbp' (either followed by "
            "':greedy' for the papers' greedy rule instead of the exact optimum), or 'auto'/None (mgs for "
            "gathered compressors, mgwfbp for summed ones)")


# --- fixed partitions ---------------------------------------------------------------------------
def layerwise(n: int) -> List[List[int]]:
    return [[i] for i in range(n)]


def single(n: int) -> List[List[int]]:
    return [list(range(n))] if n else []


def by_size(sizes_bytes: Sequence[float], threshold_bytes: float) -> List[List[int]]:
    """Fusion by size: a tensor joins the open group while the group stays <= threshold bytes;
    otherwise it starts a new one (a tensor larger than the threshold is a group of its own)."""
    groups: List[List[int]] = []
    total = 0.0
    for i, s in enumerate(sizes_bytes):
        if groups and total + s <= threshold_bytes:
            groups[-1].append(i)
            total += s
        else:
            groups.append([i])
            total = s
    return groups


# --- search -------------------------------------------------------------------------------------
def optimal(sizes, t_b, t_s: Callable, t_c: Callable, overlap: str = "shared") -> Tuple[List[List[int]], float]:
    """The exact optimum (module doc): (groups, backward/exchange end time)."""
    check_overlap(overlap)
    sizes, t_b = check_inputs(sizes, t_b)
    n = len(sizes)
    if n == 0:
        return [], 0.0
    ts_fn, tc_fn = as_cost_fn(t_s), as_cost_fn(t_c)
    shared = overlap == "shared"
    cum = np.concatenate([[0.0], np.cumsum(sizes)])
    ready = np.concatenate([[0.0], np.cumsum(t_b)])
    pool = _StatePool(4 * n + 16)  # state 0: nothing done, at boundary 0
    for k in range(1, n + 1):
        spent, comm, boundary = pool.view()
        group_bytes = cum[k] - cum[:k]  # bytes of the group [b, k) for every boundary b < k
        ts, tc = ts_fn(group_bytes)[boundary], tc_fn(group_bytes)[boundary]
        new_spent = spent + ts if shared else np.zeros_like(spent)
        new_comm = np.maximum(comm, ready[k] + new_spent + (0.0 if shared else ts)) + tc
        order = np.lexsort((new_comm, new_spent))
        sorted_comm = new_comm[order]
        keep = np.ones(len(order), dtype=bool)
        keep[1:] = sorted_comm[1:] < np.minimum.accumulate(sorted_comm)[:-1]
        parents = order[keep]
        pool.append(new_spent[parents], new_comm[parents], k, parents)
    spent, comm, boundary = pool.view()
    last = np.flatnonzero(boundary == n)
    best = int(last[np.argmin(comm[last])])
    ends = []
    while best > 0:
        ends.append(int(pool.boundary[best]))
        best = int(pool.parent[best])
    return groups_from_ends(ends[::-1]), float(comm[last].min())


class _StatePool:
    """Append-only arrays of DP states: compression time spent, exchange end, boundary, parent."""

    def __init__(self, capacity: int):
        self.spent, self.comm = np.zeros(capacity), np.zeros(capacity)
        self.boundary = np.zeros(capacity, dtype=np.int64)
        self.parent = np.full(capacity, -1, dtype=np.int64)
        self.size = 1

    def view(self):
        m = self.size
        return self.spent[:m], self.comm[:m], self.boundary[:m]

    def append(self, spent, comm, boundary: int, parent) -> None:
        m, add = self.size, len(spent)
        if m + add > len(self.spent):
            grow = max(2 * len(self.spent), m + add)
            for name in ("spent", "comm", "boundary", "parent"):
                old = getattr(self, name)
                new = np.zeros(grow, dtype=old.dtype)
                new[:m] = old[:m]
                setattr(self, name, new)
        self.spent[m:m + add], self.comm[m:m + add] = spent, comm
        self.boundary[m:m + add], self.parent[m:m + add] = boundary, parent
        self.size = m + add


def greedy(sizes, t_b, t_s: Callable, t_c: Callable, overlap: str = "shared") -> Tuple[List[List[int]], float]:
    """The MGS / MG-WFBP greedy rule (module doc): (groups, backward/exchange end time)."""
    check_overlap(overlap)
    sizes, t_b = check_inputs(sizes, t_b)
    n = len(sizes)
    if n == 0:
        return [], 0.0
    ts_fn, tc_fn = as_cost_fn(t_s), as_cost_fn(t_c)

    def ts(b):
        return float(ts_fn(np.array([b]))[0])

    def tc(b):
        return float(tc_fn(np.array([b]))[0])

    groups, start, open_bytes = [], 0, float(sizes[0])
    now = float(t_b[0])  # when the open group's last gradient is ready on the compute stream
    comm_free = 0.0
    for x in range(1, n):
        alone_ready = now + ts(open_bytes)           # close the open group: compressed at ...
        alone_start = max(comm_free, alone_ready)    # ... and on the wire at
        merged = open_bytes + float(sizes[x])
        merged_ready = now + float(t_b[x]) + ts(merged)
        wait = merged_ready - alone_start            # extra wait of the open group's data
        saved = tc(open_bytes) + tc(float(sizes[x])) - tc(merged)
        if wait < saved:
            open_bytes = merged
            now += float(t_b[x])
        else:
            groups.append(list(range(start, x)))
            comm_free = alone_start + tc(open_bytes)
            now = (alone_ready if overlap == "shared" else now) + float(t_b[x])
            start, open_bytes = x, float(sizes[x])
    groups.append(list(range(start, n)))
    return groups, predict(groups, sizes, t_b, t_s, t_c, overlap).end


def brute_force(sizes, t_b, t_s: Callable, t_c: Callable, overlap: str = "shared",
                max_tensors: int = 16) -> Tuple[List[List[int]], float]:
    """Every one of the 2^(L-1) partitions, timed by ``timeline.predict`` (for tests)."""
    sizes, t_b = check_inputs(sizes, t_b)
    n = len(sizes)
    if n > max_tensors:
        raise ValueError(f"brute_force: {n} tensors means 2^{n - 1} partitions; at most {max_tensors}")
    if n == 0:
        return [], 0.0
    best, best_groups = math.inf, None
    for cuts in itertools.product((False, True), repeat=n - 1):
        ends = [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        groups = groups_from_ends(ends)
        end = predict(groups, sizes, t_b, t_s, t_c, overlap).end
        if end < best:
            best, best_groups = end, groups
    return best_groups, best


# --- schedules ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    """A parsed schedule string: kind, the size threshold (MiB) for "size", the search for mgs/mgwfbp."""

    kind: str
    threshold_mb: Optional[float] = None
    search: str = "dp"

    def __str__(self) -> str:
        if self.kind == "size":
            return f"size:{self.threshold_mb:g}"
        if self.kind in COST_MODEL_SCHEDULES and self.search == "greedy":
            return f"{self.kind}:greedy"
        return self.kind


def parse_schedule(text: Union[str, Schedule, None]) -> Schedule:
    """Parse a schedule string (module doc); ValueError naming the accepted forms otherwise."""
    if isinstance(text, Schedule):
        return text
    if text is None:
        return Schedule("auto")
    if not isinstance(text, str):
        raise ValueError(f"schedule: expected a string; got {text!r}. Accepted: {ACCEPTED}")
    name, colon, arg = text.strip().lower().partition(":")
    arg = arg.strip()
    if name in ("auto", "layerwise", "single") and not colon:
        return Schedule(name)
    if name in COST_MODEL_SCHEDULES and (not colon or arg in ("dp", "greedy")):
        return Schedule(name, search=arg or "dp")
    if name == "size" and colon:
        try:
            mb = float(arg)
        except ValueError:
            mb = math.nan
        if not (math.isfinite(mb) and mb >= 0):
            raise ValueError(f"schedule: 'size:<MB>' needs a finite number of MiB >= 0; got {text!r}")
        return Schedule("size", threshold_mb=mb)
    raise ValueError(f"schedule: unknown schedule {text!r}; accepted: {ACCEPTED}")


@dataclass(frozen=True)
class Plan:
    """A partition of the tensors (backward order) into groups, with its modelled timeline."""

    schedule: str                       # the schedule that made it ("auto" resolved)
    groups: List[List[int]]
    predicted_seconds: Optional[float]  # forward + timeline end + update; None without a model
    timeline: Optional[Timeline]
    overlap: str
    notes: Tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"schedule": self.schedule, "groups": self.groups, "predicted_seconds": self.predicted_seconds,
                "overlap": self.overlap, "notes": list(self.notes),
                "timeline": self.timeline.as_dict() if self.timeline is not None else None}


def make_plan(schedule, sizes_bytes: Sequence[float], t_b: Optional[Sequence[float]] = None, cost_model=None,
              spec=None, world_size: Optional[int] = None, *, overlap: str = "shared",
              forward_seconds: float = 0.0, update_seconds: float = 0.0, itemsize: int = 4,
              density: Optional[float] = None) -> Plan:
    """Plan the groups for ``spec`` (a compressor spec or string; default none) and predict the
    step time. ``sizes_bytes``/``t_b`` per tensor in backward order; ``world_size`` defaults to the
    cost model's (another one is extrapolated, see ``CostModel.for_world_size``); ``density`` is
    the fraction of entries a threshold-like compressor sends (unknown: 1, an upper bound)."""
    sched = parse_schedule(schedule)
    spec = resolve(spec)
    check_overlap(overlap)
    if sched.kind == "auto":
        sched = Schedule("mgs" if spec.exchange == GATHERED else "mgwfbp")
    sizes = np.asarray(sizes_bytes, dtype=float)
    if t_b is not None:
        sizes, t_b = check_inputs(sizes, t_b)
    else:
        check_inputs(sizes, np.zeros_like(sizes))
    n = len(sizes)
    notes: List[str] = []
    t_s = t_c = None
    if cost_model is not None:
        world = cost_model.world_size if world_size is None else int(world_size)

        def t_c(b):
            return cost_model.comm_seconds(spec, b, world, itemsize, density)

        if cost_model.has_compress_fit(spec):
            def t_s(b):
                return cost_model.compress_seconds(spec, b, itemsize)
        else:
            notes.append(f"no compression-time fit for '{spec}': compression counted as 0 s")

            def t_s(b):
                return np.zeros_like(np.asarray(b, dtype=float))

    if sched.kind in COST_MODEL_SCHEDULES:
        if cost_model is None or t_b is None:
            raise ValueError(f"schedule '{sched}' needs a cost model and per-tensor backward times t_b "
                             "(torch_ops.profiling measures both); 'layerwise', 'single' and 'size:<MB>' "
                             "do not")
        if sched.kind == "mgs" and notes:
            raise ValueError(f"schedule 'mgs' needs the compression time of '{spec}': the cost model has no "
                             "fit for it (profile it, or use 'mgwfbp', which ignores compression time)")
        search_ts = t_s if sched.kind == "mgs" else (lambda b: np.zeros_like(np.asarray(b, dtype=float)))
        search = optimal if sched.search == "dp" else greedy
        groups, _ = search(sizes, t_b, search_ts, t_c, overlap)
    elif sched.kind == "layerwise":
        groups = layerwise(n)
    elif sched.kind == "single":
        groups = single(n)
    else:
        groups = by_size(sizes, sched.threshold_mb * MIB)

    timeline = predicted = None
    if cost_model is not None and t_b is not None:
        timeline = predict(groups, sizes, t_b, t_s, t_c, overlap)
        predicted = float(forward_seconds) + timeline.end + float(update_seconds)
    return Plan(str(sched), [list(g) for g in groups], predicted, timeline, overlap, tuple(notes))


__all__ = ["Plan", "Schedule", "make_plan", "parse_schedule", "optimal", "greedy", "brute_force",
           "layerwise", "single", "by_size", "group_ends", "predict"]
