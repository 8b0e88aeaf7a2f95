"""Which gradient groups the optimizer exchanges, when they are chosen, and what each step measured.

``schedule`` (the ``DistributedOptimizer`` argument) is one of ``hvdcompress.planner``'s schedule
strings -- "layerwise", "single", "size:<MB>", "mgs", "mgwfbp" (":greedy"), "auto" (default: mgs
for gathered compressors, mgwfbp for summed ones) -- or an explicit list of groups of parameter
names. Groups are consecutive in *backward order*, which only a backward pass shows, so:

* step 0 always runs layerwise; its gradient hooks give the backward order (rank 0's is used);
* fixed schedules ("layerwise", "single", "size:<MB>", explicit groups) take effect from step 1;
* cost-model schedules ("mgs", "mgwfbp", "auto") keep running layerwise while they measure
  ``profile_steps`` more steps (steps 1..profile_steps): per-parameter backward times t_b from the
  hooks' clocks, the time before backward (data, forward) and the wrapped optimizer's update.
  At the end of step ``profile_steps`` the cost model is taken (the one given, else the cached
  fit for this world and host set, else a few seconds of profiling on the live transport,
  ``torch_ops.profiling.load_or_profile``) and the plan is made.

Rank 0 makes the plan and broadcasts it, so every rank exchanges the same groups, and a failure
there is raised on every rank. A fixed schedule given a ``cost_model`` also gets a predicted step
time, computed at the same point from the same measurements.

The backward time before a gradient is measured as the gap from the *end* of the previous
gradient's hook to the start of this one's, so the compression the hooks themselves run is not
counted as backward compute (the timeline adds it back from the cost model's t_s). The time from
the end of the previous step to the first hook (data, zero_grad, forward, the backward of the
last layer) is the plan's ``forward_seconds``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from typing import Dict, List, Optional, Sequence, Tuple, Union

from hvdcompress.costmodel import CostModel
from hvdcompress.planner import Plan, Schedule, Workload, make_plan, parse_schedule
from hvdcompress.spec import CompressionSpec
from hvdcompress.timeline import check_partition, predict

Explicit = List[List[str]]


def check_schedule(schedule) -> Union[Schedule, Explicit]:
    """A parsed schedule string, or explicit groups (lists of names); ValueError otherwise."""
    if isinstance(schedule, (list, tuple)) and schedule and all(isinstance(g, (list, tuple)) for g in schedule):
        if not all(isinstance(n, str) for g in schedule for n in g):
            raise ValueError("schedule: explicit groups must be lists of parameter names (str)")
        return [list(g) for g in schedule]
    return parse_schedule(schedule)


def check_profile_steps(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1000:
        raise ValueError(f"profile_steps: must be an int in [1, 1000]; got {n!r}")
    return n


def check_cost_model(model) -> Optional[CostModel]:
    if model is not None and not isinstance(model, CostModel):
        raise ValueError("cost_model: expected an hvdcompress.costmodel.CostModel or None (cached or "
                         f"profiled at first use); got {type(model).__name__}")
    return model


class StepClock:
    """Clock readings of one step: hook entries and exits, synchronize, update."""

    def __init__(self, prev_end: Optional[float]):
        self.prev_end = prev_end
        self.hooks: List[Tuple[str, float, float]] = []  # (name, entered, left), in firing order
        self.sync = (0.0, 0.0)
        self.update = (0.0, 0.0)

    def timings(self, step: int, predicted: Optional[float]) -> Dict[str, Optional[float]]:
        """What the step measured (seconds); ``None`` where there is nothing to measure."""
        end = self.update[1] or self.sync[1]
        first = self.hooks[0][1] if self.hooks else None
        return {
            "step": step,
            "iteration_seconds": end - self.prev_end if self.prev_end is not None else None,
            "forward_seconds": first - self.prev_end if first is not None and self.prev_end is not None else None,
            "backward_seconds": self.hooks[-1][2] - first if first is not None else None,
            "hook_seconds": sum(b - a for _, a, b in self.hooks),
            "synchronize_seconds": self.sync[1] - self.sync[0],
            "update_seconds": self.update[1] - self.update[0],
            "predicted_seconds": predicted,
        }

    def backward_gaps(self) -> Dict[str, float]:
        """name -> backward compute before its gradient (0 for the first; see the module doc)."""
        gaps, prev = {}, None
        for name, entered, left in self.hooks:
            gaps[name] = 0.0 if prev is None else max(0.0, entered - prev)
            prev = left
        return gaps


class Scheduler:
    """Holds the schedule, collects the profiled steps and makes the plan (see the module doc)."""

    def __init__(self, schedule, spec: CompressionSpec, cost_model: Optional[CostModel], profile_steps: int,
                 sizes_bytes: Dict[str, float], world_size: int, elementwise_state: bool):
        self.schedule = check_schedule(schedule)
        self.spec = spec
        self.cost_model = check_cost_model(cost_model)
        self.profile_steps = check_profile_steps(profile_steps)
        self.sizes = dict(sizes_bytes)
        self.world = world_size
        if isinstance(self.schedule, list):
            from .grouping import make_groups
            make_groups(self.schedule, {n: (1,) for n in self.sizes})  # names checked now, on every rank
        if not elementwise_state and str(self.schedule) != "layerwise":
            raise ValueError(f"schedule: compression '{spec}' keeps state that is not elementwise, so its "
                             "tensors cannot be merged; use schedule='layerwise'")
        self.plan: Optional[Plan] = None
        self.workload: Optional[Workload] = None
        self.order: Optional[List[str]] = None
        self._runs: List[StepClock] = []

    @property
    def text(self) -> str:
        """The schedule as given: its string, or "explicit" for explicit groups."""
        return "explicit" if isinstance(self.schedule, list) else str(self.schedule)

    @property
    def needs_model(self) -> bool:
        return not isinstance(self.schedule, list) and self.schedule.kind in ("mgs", "mgwfbp", "auto")

    @property
    def done(self) -> bool:
        """Nothing left to measure or decide."""
        return self.plan is not None and (self.plan.predicted_seconds is not None or self.cost_model is None
                                          and not self.needs_model)

    def adopt(self, plan: Plan, order: Sequence[str]) -> None:
        """A plan restored from a checkpoint (same schedule): used as is; only a missing prediction
        (a fixed schedule given a cost model) is still measured."""
        self.plan, self.order = plan, list(order)

    def end_of_step(self, clock: StepClock) -> Optional[List[List[str]]]:
        """Called on every rank after each step with its clock; returns the groups (names) to use
        from the next step on when they change, else None. Runs collectives when a decision is
        due, which is at the same step on every rank."""
        if self.done:
            return None
        if self.order is None:  # the first step: learn the backward order
            self.order = _broadcast(self._order(clock), "hvc.plan.order")
            if self.needs_model:
                return None
            self.plan = _broadcast_result(self._fixed_plan, "hvc.plan.fixed")
            return self._names(self.plan)
        self._runs.append(clock)
        if len(self._runs) < self.profile_steps:
            return None
        self.workload = self._workload()
        model = self.cost_model
        if model is None:
            from .profiling import load_or_profile
            model = self.cost_model = load_or_profile([self.spec], max_bytes=sum(self.sizes.values()))
        plan = _broadcast_result(lambda: self._model_plan(model), "hvc.plan.model")
        changed = self.plan is None or plan.groups != self.plan.groups
        self.plan = plan
        self._runs = []
        return self._names(plan) if changed else None

    # -- internals -------------------------------------------------------------------------------
    def _order(self, clock: StepClock) -> List[str]:
        fired = [name for name, _, _ in clock.hooks]
        seen = set(fired)
        return fired + [n for n in self.sizes if n not in seen]  # no gradient: last

    def _fixed_plan(self) -> Plan:
        if isinstance(self.schedule, list):
            index = {n: i for i, n in enumerate(self.order)}
            groups = sorted((sorted(index[n] for n in g) for g in self.schedule), key=min)
            try:
                check_partition(groups, len(self.order))
            except ValueError:
                raise ValueError("schedule: explicit groups must hold parameters that are consecutive in "
                                 f"backward order; the backward order is {self.order}") from None
            return Plan("explicit", groups, None, None, "shared")
        sizes = [self.sizes[n] for n in self.order]
        return make_plan(self.schedule, sizes, spec=self.spec, world_size=self.world)

    def _model_plan(self, model: CostModel) -> Plan:
        if isinstance(self.schedule, list):
            return predict_explicit(self.plan.groups, self.workload, model, self.spec, self.world)
        return self.workload.plan(self.schedule, model, self.spec, self.world)

    def _workload(self) -> Workload:
        """Medians over the profiled steps, then the slowest rank: a group's exchange starts when
        its last gradient is ready on *every* rank, so the ready times (cumulative backward) are
        the maximum over ranks, and so are the forward and update times."""
        gaps = [c.backward_gaps() for c in self._runs]
        t_b = [statistics.median(g.get(n, 0.0) for g in gaps) for n in self.order]
        fwd = statistics.median(c.hooks[0][1] - c.prev_end if c.hooks else 0.0 for c in self._runs)
        upd = statistics.median(c.update[1] - c.update[0] for c in self._runs)
        ranks = _hvd().allgather_object((t_b, fwd, upd), name="hvc.plan.workload")
        ready = np.max([np.cumsum(r[0]) for r in ranks], axis=0)
        t_b = np.diff(ready, prepend=0.0).clip(min=0.0).tolist()
        fwd, upd = max(r[1] for r in ranks), max(r[2] for r in ranks)
        return Workload(tuple(self.order), tuple(self.sizes[n] for n in self.order), tuple(t_b), fwd, upd)

    def _names(self, plan: Plan) -> List[List[str]]:
        return [[self.order[i] for i in g] for g in plan.groups]


def predict_explicit(plan_groups, workload: Workload, model: CostModel, spec, world: int) -> Plan:
    """Explicit groups (indices in backward order) with their prediction under ``model``."""
    t_d = (lambda b: model.decompress_seconds(spec, b)) if model.has_decompress_fit(spec) else None
    tl = predict(plan_groups, workload.sizes_bytes, workload.t_b, lambda b: model.group_cpu_seconds(spec, b),
                 lambda b: model.comm_seconds(spec, b, world), "shared", t_d)
    return Plan("explicit", [list(g) for g in plan_groups], workload.forward_seconds + tl.end +
                workload.update_seconds, tl, "shared")


def _hvd():
    import horovod.torch as hvd
    return hvd


def _broadcast(obj, name: str):
    return _hvd().broadcast_object(obj, root_rank=0, name=name)


def _broadcast_result(fn, name: str):
    """Rank 0 computes ``fn()``; every rank gets its value, or raises its error (no rank hangs)."""
    hvd = _hvd()
    value = error = None
    if hvd.rank() == 0:
        try:
            value = fn()
        except ValueError as exc:
            error = str(exc)
    value, error = hvd.broadcast_object((value, error), root_rank=0, name=name)
    if error is not None:
        raise ValueError(error)
    return value


def now() -> float:
    return time.perf_counter()
