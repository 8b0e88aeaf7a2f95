"""Layer-merging planner: which consecutive gradient tensors to compress and send as one group.

Pure functions over sizes and timings (no torch, no Horovod). The model is that of
``hvdcompress.schedule.timeline`` (read its doc for the formulas and the two ``overlap`` assumptions):
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

``cost_model`` is a ``hvdcompress.schedule.costmodel.CostModel``; it gives t_c for the compressor ``spec``
at ``world_size`` (``CostModel.exchange_seconds``: the alpha-beta time; the last group's exchange,
which closes the step, also gets ``CostModel.closing_seconds``, the measured ``exchange_skew``
term), t_s (compression, when the model has a fit for the spec, plus the CPU time of
handing the group's collectives to Horovod: ``CostModel.group_cpu_seconds``) and, when fitted,
t_d (decompression and scatter after backward; in the prediction only, see ``timeline``). ``layerwise``/``single``/``size`` need no cost model; without one (or without t_b) the
prediction is None.

Per-group codec choice (``alternatives``, e.g. ``("fp16", "none")``; ``codec_choice="auto"`` in
the backends): every group is also given the spec, among ``spec`` and the alternatives, that makes
the modelled step shortest, jointly with the partition (``search.optimal_choice``: the same DP,
one transition per group and spec; for the fixed schedules over their own partition), with each
spec's own compression time, wire rule and closing term; ``Plan.codecs`` lists them per group.
A compressor that never merges (``merge=LAYERWISE``: state shaped by the tensor) is planned
layerwise on its own; with alternatives it is chosen only for groups of one tensor, while the
groups sent with fp16 or dense merge as the search finds best (``search.Option.merges``).

The searches live in ``hvdcompress.schedule.search``: ``optimal`` (dynamic programming over the end of
the last group; exact, O(L^2) for ``overlap="parallel"``, Pareto fronts with branch and bound for
``"shared"``, with a certified bound ``gap`` should a front have to be thinned), ``greedy`` (the
MGS paper's rule) and ``brute_force`` (tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .search import Option, Search, brute_force, by_size, greedy, layerwise, optimal, optimal_choice, predict_choice, single
from ..contract import LAYERWISE
from ..spec import GATHERED, resolve
from .timeline import Timeline, check_inputs, check_overlap, predict, predict_costs

MIB = 1 << 20
COST_MODEL_SCHEDULES = ("mgs", "mgwfbp")
ACCEPTED = ("'layerwise', 'single', 'size:<MB>' (e.g. 'size:64'), 'mgs', 'mgwfbp' (either followed by "
            "':greedy' for the papers' greedy rule instead of the exact optimum), or 'auto'/None (mgs for "
            "gathered compressors, mgwfbp for summed ones)")


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
class Workload:
    """What a step of one model costs locally, tensors in backward order: parameter names, sizes
    in bytes, backward time before each gradient (t_b), and the time outside backward (forward,
    and the optimizer's update). ``torch_ops.profiling.profile_workload`` measures one."""

    names: Tuple[str, ...]
    sizes_bytes: Tuple[float, ...]
    t_b: Tuple[float, ...]
    forward_seconds: float = 0.0
    update_seconds: float = 0.0
    shapes: Optional[Tuple[Tuple[int, ...], ...]] = None  # per tensor, when known (``make_plan``)

    def __post_init__(self):
        check_inputs(self.sizes_bytes, self.t_b)
        if len(self.names) != len(self.sizes_bytes):
            raise ValueError(f"workload: {len(self.names)} names for {len(self.sizes_bytes)} tensors")
        for field_name in ("names", "sizes_bytes", "t_b"):
            object.__setattr__(self, field_name, tuple(getattr(self, field_name)))
        if self.shapes is not None:
            shapes = tuple(tuple(int(x) for x in sh) for sh in self.shapes)
            if len(shapes) != len(self.names):
                raise ValueError(f"workload: {len(shapes)} shapes for {len(self.names)} tensors")
            object.__setattr__(self, "shapes", shapes)

    def with_shapes(self, shapes) -> "Workload":
        """This workload with per-tensor ``shapes``."""
        return replace(self, shapes=shapes)

    @property
    def compute_seconds(self) -> float:
        """A step without any exchange: forward + backward + update."""
        return self.forward_seconds + float(np.sum(self.t_b)) + self.update_seconds

    def plan(self, schedule, cost_model, spec=None, world_size: Optional[int] = None, **kw) -> "Plan":
        kw.setdefault("shapes", self.shapes)
        return make_plan(schedule, self.sizes_bytes, self.t_b, cost_model, spec, world_size,
                         forward_seconds=self.forward_seconds, update_seconds=self.update_seconds, **kw)

    def to_dict(self) -> dict:
        out = {"names": list(self.names), "sizes_bytes": list(self.sizes_bytes), "t_b": list(self.t_b),
               "forward_seconds": self.forward_seconds, "update_seconds": self.update_seconds}
        if self.shapes is not None:
            out["shapes"] = [list(sh) for sh in self.shapes]
        return out

    @classmethod
    def from_dict(cls, d) -> "Workload":
        return cls(tuple(d["names"]), tuple(float(x) for x in d["sizes_bytes"]),
                   tuple(float(x) for x in d["t_b"]), float(d.get("forward_seconds", 0.0)),
                   float(d.get("update_seconds", 0.0)),
                   tuple(tuple(sh) for sh in d["shapes"]) if d.get("shapes") is not None else None)


@dataclass(frozen=True)
class Plan:
    """A partition of the tensors (backward order) into groups, with its modelled timeline."""

    schedule: str                       # the schedule that made it ("auto" resolved)
    groups: List[List[int]]
    predicted_seconds: Optional[float]  # forward + timeline end + update; None without a model
    timeline: Optional[Timeline]
    overlap: str
    gap: Optional[float] = None         # seconds above the optimum at most (0: optimal; None: unknown)
    notes: Tuple[str, ...] = ()
    tuning: Optional[dict] = None       # measured validation (hvdcompress.schedule.tuning): candidates, medians, kept
    codecs: Optional[List[str]] = None  # per group, the spec it is sent with (None: the compressor's, all)

    def as_dict(self) -> dict:
        return {"schedule": self.schedule, "groups": self.groups, "predicted_seconds": self.predicted_seconds,
                "overlap": self.overlap, "gap": self.gap, "notes": list(self.notes), "tuning": self.tuning,
                "codecs": self.codecs,
                "timeline": self.timeline.as_dict() if self.timeline is not None else None}


def _costs(cost_model, spec, world: int, itemsize: int, density: Optional[float]):
    """(t_s, t_c, t_close or None, t_d or None, t_step or None) of sending a group with ``spec``
    (module doc)."""
    def t_c(b):
        return cost_model.exchange_seconds(spec, b, world, itemsize, density)

    def t_s(b):  # compression and the hand-over of the group's collectives
        return cost_model.group_cpu_seconds(spec, b, itemsize)

    t_close = t_d = None
    if cost_model.exchange_skew:
        def t_close(b):  # the last group's exchange: what the ranks' drift adds (costmodel)
            return cost_model.closing_seconds(spec, b, world, itemsize, density)
    if cost_model.has_decompress_fit(spec):
        def t_d(b):
            return cost_model.decompress_seconds(spec, b, itemsize)
    return t_s, t_c, t_close, t_d, step_costs(cost_model, spec, world, itemsize, density)


def step_costs(cost_model, spec, world: Optional[int] = None, itemsize: int = 4,
               density: Optional[float] = None) -> Optional[Tuple]:
    """(t_alone, t_queued): a group's exchange time at the start-ups a collective pays in a
    training step (``CostModel.start_ups``), for the prediction; None where they were not timed."""
    start_ups = getattr(cost_model, "start_ups", None)
    if start_ups is None:
        return None
    alone, queued = start_ups

    def t_alone(b):
        return cost_model.comm_seconds(spec, b, world, itemsize, density, start_up=alone)

    def t_queued(b):
        return cost_model.comm_seconds(spec, b, world, itemsize, density, start_up=queued)
    return t_alone, t_queued


def tensor_comm(shapes, cost_model, spec, world: int, itemsize: int) -> Callable:
    """A function of a tensor's index: (t_c, (t_alone, t_queued) or None) of that tensor sent alone
    by ``spec``, at its shape's wire cost (``CostModel.tensor_comm_seconds``)."""
    start_ups = getattr(cost_model, "start_ups", None)

    def costs(i):
        shape = tuple(shapes[i])
        tc = cost_model.tensor_comm_seconds(spec, shape, world, itemsize)
        step = None if start_ups is None else tuple(
            cost_model.tensor_comm_seconds(spec, shape, world, itemsize, start_up=a) for a in start_ups)
        return tc, step
    return costs


def predict_shaped(groups, sizes, t_b, shapes, cost_model, spec, world: int, itemsize: int, overlap: str,
                   t_s: Callable, t_d: Optional[Callable], t_close: Optional[Callable]) -> Timeline:
    """The timeline of one tensor per group, each exchange charged the wire cost of its tensor's
    shape (``CostModel.tensor_comm_seconds``; at the step's start-ups where timed, as
    ``step_costs``); compression, decompression and the closing term by its bytes."""
    if len(shapes) != len(sizes):
        raise ValueError(f"shapes: one per tensor ({len(sizes)}); got {len(shapes)}")
    groups = tuple(tuple(int(i) for i in g) for g in groups)
    nbytes = np.array([sizes[g[0]] for g in groups], dtype=float)
    costs = [tensor_comm(shapes, cost_model, spec, world, itemsize)(g[0]) for g in groups]
    tc = np.array([c[0] for c in costs], dtype=float)
    step = None
    if costs and costs[0][1] is not None:  # the step's start-ups were timed
        step = tuple(np.array([c[1][k] for c in costs], dtype=float) for k in (0, 1))
    close = float(np.asarray(t_close(nbytes[-1:]), dtype=float)[0]) if t_close is not None and len(groups) else None
    return predict_costs(groups, t_b, np.asarray(t_s(nbytes), dtype=float), tc, overlap,
                         None if t_d is None else np.asarray(t_d(nbytes), dtype=float), close, step)


def codec_options(spec, alternatives: Sequence = ()) -> List:
    """The specs a group may be sent with: ``spec`` first, then each alternative not equal to it."""
    out = [resolve(spec)]
    for alt in alternatives:
        alt = resolve(alt)
        if all(str(alt) != str(o) for o in out):
            out.append(alt)
    return out


def make_plan(schedule, sizes_bytes: Sequence[float], t_b: Optional[Sequence[float]] = None, cost_model=None,
              spec=None, world_size: Optional[int] = None, *, overlap: str = "shared",
              forward_seconds: float = 0.0, update_seconds: float = 0.0, itemsize: int = 4,
              density: Optional[float] = None, alternatives: Sequence = (),
              shapes: Optional[Sequence[Sequence[int]]] = None) -> Plan:
    """Plan the groups for ``spec`` (a compressor spec or string; default none) and predict the
    step time. ``sizes_bytes``/``t_b`` per tensor in backward order; ``world_size`` defaults to the
    cost model's (another one is extrapolated, see ``CostModel.for_world_size``); ``density`` is
    the fraction of entries a threshold-like compressor sends (unknown: 1, an upper bound).

    ``alternatives`` (e.g. ``("fp16", "none")``): other specs a group may be sent with; then
    every group also gets the spec of least modelled step time, chosen jointly with the partition
    (``search.optimal_choice``; for the fixed schedules, over their partition), compression time
    included whatever the schedule, and ``Plan.codecs`` lists them.

    ``shapes`` (per tensor, optional): where every group is one tensor and no alternatives are
    given, the predicted timeline charges each exchange the wire cost of its tensor's shape
    (``CostModel.tensor_comm_seconds``) rather than of its element count."""
    sched = parse_schedule(schedule)
    spec = resolve(spec)
    check_overlap(overlap)
    asked_auto = sched.kind == "auto"
    if asked_auto:
        sched = Schedule("mgs" if spec.exchange == GATHERED else "mgwfbp")
    sizes = np.asarray(sizes_bytes, dtype=float)
    if t_b is not None:
        sizes, t_b = check_inputs(sizes, t_b)
    else:
        check_inputs(sizes, np.zeros_like(sizes))
    n = len(sizes)
    notes: List[str] = []
    specs = codec_options(spec, alternatives)
    choosing = len(specs) > 1
    merges = spec.info.merge != LAYERWISE
    if not merges and not choosing and (asked_auto or sched.kind in COST_MODEL_SCHEDULES):
        sched = Schedule("layerwise")  # its tensors are never merged: a searched schedule is layerwise
    t_s = t_c = gap = t_close = t_d = t_step = None
    if cost_model is not None:
        world = cost_model.world_size if world_size is None else int(world_size)
        costs = [_costs(cost_model, o, world, itemsize, density if i == 0 else None) for i, o in enumerate(specs)]
        t_s, t_c, t_close, t_d, t_step = costs[0]
        if not cost_model.has_compress_fit(spec):
            notes.append(f"no compression-time fit for '{spec}': compression counted as 0 s")
    if choosing:
        missing = [str(o) for o in specs if cost_model is not None and not cost_model.has_compress_fit(o)]
        if cost_model is None or t_b is None or missing:
            raise ValueError("alternatives: choosing a spec per group needs a cost model, per-tensor backward "
                             "times t_b and a compression-time fit for every candidate spec"
                             + (f" (no fit for {', '.join(missing)})" if missing else ""))

    if sched.kind in COST_MODEL_SCHEDULES:
        if cost_model is None or t_b is None:
            raise ValueError(f"schedule '{sched}' needs a cost model and per-tensor backward times t_b "
                             "(torch_ops.profiling measures both); 'layerwise', 'single' and 'size:<MB>' "
                             "do not")
        if sched.kind == "mgs" and notes:
            raise ValueError(f"schedule 'mgs' needs the compression time of '{spec}': the cost model has no "
                             "fit for it (profile it, or use 'mgwfbp', which ignores compression time)")
        search_ts = t_s if sched.kind == "mgs" else (lambda b: np.zeros_like(np.asarray(b, dtype=float)))
        if choosing and sched.search == "dp":
            groups = None  # the joint search below
        else:
            search = optimal if sched.search == "dp" else greedy
            found = search(sizes, t_b, search_ts, t_c, overlap, t_close=t_close)
            groups, gap = found.groups, found.gap
            if sched.kind == "mgwfbp":
                gap = None  # optimal for the search's model (no compression time), not the predicted one
    elif sched.kind == "layerwise":
        groups = layerwise(n)
    elif sched.kind == "single":
        groups = single(n)
    else:
        groups = by_size(sizes, sched.threshold_mb * MIB)

    codecs = None
    timeline = predicted = None
    if choosing:
        options = [Option(c[0], c[1], c[2], merges or i > 0, c[4]) for i, c in enumerate(costs)]
        cuts = None if groups is None else [g[-1] + 1 for g in groups]
        found = optimal_choice(sizes, t_b, options, overlap, cuts=cuts)
        groups, codecs = found.groups, [str(specs[c]) for c in found.choices]
        gap = found.gap if cuts is None else None
        shaped = None
        if shapes is not None:
            shaped = [None if o.info.merge != LAYERWISE else tensor_comm(shapes, cost_model, o, world, itemsize)
                      for o in specs]
        timeline = predict_choice(groups, found.choices, sizes, t_b, options, overlap, [c[3] for c in costs], shaped)
        predicted = float(forward_seconds) + timeline.end + float(update_seconds)
    elif cost_model is not None and t_b is not None and shapes is not None and all(len(g) == 1 for g in groups):
        timeline = predict_shaped(groups, sizes, t_b, shapes, cost_model, spec, world, itemsize, overlap,
                                  t_s, t_d, t_close)
        predicted = float(forward_seconds) + timeline.end + float(update_seconds)
    elif cost_model is not None and t_b is not None:
        timeline = predict(groups, sizes, t_b, t_s, t_c, overlap, t_d, t_close, t_step)
        predicted = float(forward_seconds) + timeline.end + float(update_seconds)
    return Plan(str(sched), [list(g) for g in groups], predicted, timeline, overlap, gap, tuple(notes),
                codecs=codecs)


__all__ = ["codec_options", "Plan", "Schedule", "Workload", "Search", "make_plan", "parse_schedule", "optimal", "greedy", "brute_force",
           "layerwise", "single", "by_size", "predict"]
