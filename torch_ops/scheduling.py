"""Which gradient groups the optimizer exchanges, when they are chosen, and what each step measured.

``schedule`` (the ``DistributedOptimizer`` argument) is one of ``hvdcompress.schedule.planner``'s schedule
strings -- "layerwise", "single", "size:<MB>", "mgs", "mgwfbp" (":greedy"), "auto" (default: mgs
for gathered compressors, mgwfbp for summed ones) -- or an explicit list of groups of parameter
names. Groups are consecutive in *backward order*, which only a backward pass shows, so:

* step 0 always runs layerwise; its gradient hooks give the backward order (rank 0's is used);
* fixed schedules ("layerwise", "single", "size:<MB>", explicit groups) take effect from step 1;
* cost-model schedules ("mgs", "mgwfbp", "auto") exchange everything as one group while they
  measure ``profile_steps`` more steps (steps 1..profile_steps), so no exchange competes with the
  backward pass being timed: per-parameter backward times t_b from the hooks' clocks, the time
  before backward (data, forward) and the wrapped optimizer's update.
  At the end of step ``profile_steps`` the cost model is taken (the one given, else the cached
  fit for this world and host set, else a few seconds of profiling on the live transport,
  ``torch_ops.profiling.load_or_profile``), calibrated to the profiled steps (``_calibrate``),
  and the plan is made. The calibration also measures ``exchange_skew`` (``CostModel.closing_seconds``):
  whatever the profiled steps took beyond the calibrated model's prediction for their one group
  is charged to that group's exchange -- a collective ends when the slowest rank has compressed
  and contributed, which no fit timed behind a barrier sees -- in proportion to the group's
  compression and transfer time; every plan's *closing* exchange (its last group's, launched when
  backward is done, as the profiled one was) is charged the same way. Exchanges launched during
  backward are not: the rest of backward hides the ranks' drift.
* measured validation (``tune_steps`` > 0, the default for cost-model schedules): the model can
  still be wrong, so ``hvdcompress.schedule.tuning.propose`` lists a few candidate plans (the model's,
  the other search's, ``single``, two size plans, perhaps ``layerwise``) take turns, one step each,
  the model's first: a settling round (uncounted), then ``tune_steps`` measured rounds, so a load
  that drifts weighs on every candidate alike. Every rank records its own
  step times (end of the previous step to the end of the update); after the last candidate they
  are gathered, rank 0 keeps the candidate whose median step (slowest rank) is smallest
  (``hvdcompress.schedule.tuning.select``: within 2% of it, the earliest; with the codec choice the
  model's pick unless another gains more than the measured step noise, ``tuning.NOISE_Z``) and
  broadcasts it, and every rank regroups at the same step. A switch between candidates lays the
  compression state out for the new groups before the next step's clock starts
  (``Engine.regroup``), so no measured step pays for the copies. While candidates run, ``plan`` is the model's plan and ``groups``
  the candidate's; afterwards ``plan`` holds the kept groups, their predicted time and
  ``plan.tuning`` (every candidate's groups and median). Compressor state is per parameter, so
  switching plans loses none of it. A checkpoint taken while candidates run saves the progress
  (candidates, position, this rank's times) and a resumed run goes on from there, on every rank
  alike; one taken afterwards holds the kept plan, which a resume with the same schedule uses
  without tuning again.
* re-validation on drift (``revalidate_every`` > 0; by default 100 with a per-group codec choice,
  else off): after a measured validation every rank records its step times; every
  ``revalidate_every`` steps they are gathered (``allgather_object``, at the same step on every
  rank, as each counts its own steps: the watch's only collective) and every rank takes the
  median of the slowest rank's step (``tuning.window_median``) from the same gathered times. The first window after a decision
  sets the reference; a later window whose median differs from it by more than
  ``tuning.DRIFT_THRESHOLD`` (25%), slower or faster, runs the measured validation again over the
  same candidates, and its decision starts a new reference. ``plan.tuning`` counts the
  re-validations and holds what triggered the latest (``revalidations``, ``drift``). A checkpoint
  holds the watch (reference, this rank's window so far), so a resumed run checks at the same steps.

Per-group codec choice (``codec_choice="auto"``: ``alternatives`` = fp16, none): the plan also
gives every group the spec it is sent with (``Plan.codecs``; ``codec_of`` tells the optimizer at
launch, ``torch_ops.codec_choice`` runs the others). The cost model then needs compression fits
for the alternatives too (profiled with the spec); a fixed schedule is profiled with its own
groups and its partition kept; measured validation runs the fixed choices beside the choice
(``tuning.with_fixed_choices``: the compressor, fp16 and dense, each on every group of the plan
the planner makes for that spec alone) and, for a cost-model schedule, the compressor on every
group of each candidate the validation without the choice would measure (``_spec_alone``), so
the plan kept is never measurably slower than the best of them, nor than what the compressor
alone would keep. The codecs in use are saved with the plan and restored with it.

Flat or two-level per group (a two-level transport with a ``route_choice``,
``torch_ops.twolevel.RouteChoice``): when the cost model is taken, each hop is fitted beside it;
every ``_use`` of groups gives them the model's routes; once a plan is kept (after its measured
validation, or at once without one) the routes are measured (the model's, all flat, all
two-level), a step per candidate's settling and ``tune_steps`` steps each, before the drift watch
starts; the routes in use are saved with the plan.

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

import math
from dataclasses import replace

import numpy as np
import torch
from typing import Dict, List, Optional, Sequence, Tuple, Union

from hvdcompress.contract import LAYERWISE
from hvdcompress.schedule import tuning
from hvdcompress.schedule.costmodel import CostModel, skew_factor
from hvdcompress.schedule.groups import check_mergeable
from hvdcompress.schedule.planner import Plan, Schedule, Workload, codec_options, make_plan, parse_schedule, step_costs
from hvdcompress.spec import CompressionSpec
from hvdcompress.schedule.search import Option, predict_choice
from hvdcompress.schedule.timeline import check_partition

from .timing import HOST_TIMER, HostTimer, timer_for

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


check_tune_steps = tuning.check_tune_steps
DEFAULT_TUNE_STEPS = tuning.DEFAULT_TUNE_STEPS
check_revalidate_every = tuning.check_revalidate_every


def check_cost_model(model) -> Optional[CostModel]:
    """The one-link model a schedule plans with: ``model`` itself, or a ``TwoLevelCostModel``'s flat
    one (its hops then serve the per-group route choice, ``torch_ops.twolevel.RouteChoice``)."""
    from hvdcompress.schedule.twolevel import TwoLevelCostModel
    if isinstance(model, TwoLevelCostModel):
        return model.flat
    if model is not None and not isinstance(model, CostModel):
        raise ValueError("cost_model: expected an hvdcompress.schedule.costmodel.CostModel or None (cached or "
                         "profiled at first use), or a hvdcompress.schedule.twolevel.TwoLevelCostModel; got "
                         f"{type(model).__name__}")
    return model


class StepClock:
    """Clock readings of one step: hook entries and exits, synchronize, update."""

    def __init__(self, prev_end: Optional[float]):
        self.prev_end = prev_end
        self.hooks: List[Tuple[str, float, float]] = []  # (name, entered, left), in firing order
        self.sync = (0.0, 0.0)
        self.update = (0.0, 0.0)
        self.finish = 0.0  # in synchronize: the exchanges' code after their collectives, and the scatter

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
                 sizes_bytes: Dict[str, float], world_size: int, comm=None, tune_steps: int = 0,
                 alternatives: Sequence[str] = (), revalidate_every: Optional[int] = None, device=None):
        self.comm = comm  # the optimizer's Communicator: every collective here runs on its process set
        # specs a group may be sent with instead of ``spec`` (torch_ops.codec_choice); the plan picks
        self.alternatives = tuple(alternatives)
        self._codecs: Dict[Tuple[str, ...], str] = {}  # group members -> its alternative, where one is used
        self.tune_steps = check_tune_steps(tune_steps)
        self.revalidate_every = check_revalidate_every(revalidate_every, bool(self.alternatives))
        self._tuner: Optional[_Tuner] = None  # candidates being measured (measured validation)
        self._watch: Optional[_Watch] = None  # the kept plan's step times, watched for drift
        self.schedule = check_schedule(schedule)
        if not check_mergeable(self.text, spec, bool(self.alternatives)):  # cannot merge: auto -> layerwise
            self.schedule = parse_schedule("layerwise")
        self.spec = spec
        self.cost_model = check_cost_model(cost_model)
        # flat or two-level per group (torch_ops.twolevel.RouteChoice), where the transport chooses
        self.routes = getattr(comm, "route_choice", None)
        if self.routes is not None and self.cost_model is not cost_model:  # hops given with the model
            if cost_model.topology != self.routes.transport.topology:
                raise ValueError(f"cost_model: a TwoLevelCostModel of topology {cost_model.topology}, but the "
                                 f"exchanges run on {self.routes.transport.topology}")
            self.routes.given = cost_model
        self.profile_steps = check_profile_steps(profile_steps)
        self.sizes = dict(sizes_bytes)
        self.world = world_size
        # where the gradients are: the codecs of a cost model profiled here are timed there
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._device_timer = timer_for(self.device)
        if isinstance(self.schedule, list):
            from .grouping import make_groups
            make_groups(self.schedule, {n: (1,) for n in self.sizes})  # names checked now, on every rank
        self.plan: Optional[Plan] = None
        self.workload: Optional[Workload] = None
        self.calibration: Optional[Dict[str, float]] = None  # factors applied to the cost model (_calibrate)
        self.order: Optional[List[str]] = None
        self._runs: List[StepClock] = []
        self._profiled_groups: List[List[int]] = []  # the groups exchanged while profiling (indices)
        self._calibrated: Optional[CostModel] = None  # the model the plan was made with (_calibrate)
        self._step_seconds = 0.0
        self._codec_list: List[Optional[str]] = []

    def restarted(self, world_size: int) -> "Scheduler":
        """A scheduler for the same schedule starting over on ``world_size`` ranks (Horovod Elastic
        reset): the cost model is kept only for the same world size, and the plan is made anew
        without measured validation (the candidates would be timed on a changing set of ranks)."""
        return Scheduler(self.schedule if isinstance(self.schedule, list) else self.text, self.spec,
                         self.cost_model if self.world == world_size else None, self.profile_steps, self.sizes,
                         world_size, self.comm, alternatives=self.alternatives,
                         revalidate_every=self.revalidate_every, device=self.device)

    @property
    def text(self) -> str:
        """The schedule as given: its string, or "explicit" for explicit groups."""
        return "explicit" if isinstance(self.schedule, list) else str(self.schedule)

    @property
    def searches(self) -> bool:
        """A cost-model schedule: the partition itself is searched."""
        return not isinstance(self.schedule, list) and self.schedule.kind in ("mgs", "mgwfbp", "auto")

    @property
    def needs_model(self) -> bool:
        """A cost-model schedule, or a fixed one whose groups' specs are chosen (codec choice)."""
        return self.searches or (not isinstance(self.schedule, list) and bool(self.alternatives))

    def codec_of(self, names: Sequence[str]) -> Optional[str]:
        """The spec the group of these members is sent with when it is not the compressor's own
        ("fp16", "none"), else None."""
        return self._codecs.get(tuple(names))

    @property
    def codecs(self) -> List[Optional[str]]:
        """Per group in use (launch order of ``_use``): its alternative spec, or None."""
        return list(self._codec_list)

    def _use(self, groups: Sequence[Sequence[int]], codecs: Optional[Sequence[str]]) -> List[List[str]]:
        """Groups (indices in backward order) and their specs (None: all the compressor's) from
        the next step on; returns the groups as names."""
        named = [[self.order[i] for i in g] for g in groups]
        own = str(self.spec)
        self._codec_list = [None if codecs is None or codecs[k] == own else codecs[k] for k in range(len(named))]
        self._codecs = {tuple(n): c for n, c in zip(named, self._codec_list) if c is not None}
        if self.routes is not None:
            self.routes.assign(named, [sum(self.sizes[n] for n in g) for g in named],
                               [own if c is None else c for c in self._codec_list])
        return named

    def timer(self) -> HostTimer:
        """The timer this step's clock readings take: while the plan is being made (profiling,
        measured validation) the gradients' device's (``timer_for``: on CUDA it waits for the queued
        kernels, so the per-layer readings time them, not their launches); once the plan is
        settled, the host clock, so a run is not slowed by a wait in every gradient hook. The drift
        watch then compares whole steps, end to end, which the host clock times once the host
        waits for the device each step (the exchange's synchronize does). On the CPU both are
        the host clock."""
        return HOST_TIMER if self.done else self._device_timer

    @property
    def done(self) -> bool:
        """The plan is made and validated: nothing left to measure before it is used (a drift
        watch, ``watching``, may still re-validate it later)."""
        return self._tuner is None and not self.validating_routes and self.plan is not None and (
            self.plan.predicted_seconds is not None or self.cost_model is None and not self.needs_model)

    @property
    def validating_routes(self) -> bool:
        """The routes per group are being measured now (``RouteChoice.start_trial``)."""
        return self.routes is not None and self.routes.validating

    @property
    def tuning(self) -> bool:
        """Candidate plans are being measured now (see the module doc)."""
        return self._tuner is not None

    @property
    def watching(self) -> bool:
        """The kept plan's step times are watched for drift (``revalidate_every``; module doc)."""
        return self._watch is not None

    def adopt(self, plan: Plan, order: Sequence[str]) -> None:
        """A plan restored from a checkpoint (same schedule): used as is; only a missing prediction
        (a fixed schedule given a cost model) is still measured."""
        self.plan, self.order = plan, list(order)

    def same_schedule(self, saved) -> bool:
        """Whether a saved plan was made for this schedule: the same string, and for explicit
        groups the same groups (any other explicit groups are another schedule)."""
        if saved is None or saved["schedule"] != self.text:
            return False
        if (saved.get("plan_codecs") is not None) != bool(self.alternatives):
            return False  # planned with the codec choice and now without it, or the other way round
        if self.text != "explicit":
            return True
        named = sorted(sorted(saved["order"][i] for i in g) for g in saved["groups"])
        return named == sorted(sorted(g) for g in self.schedule)

    def plan_dict(self):
        """The plan in use as checkpoint data (None before one is made). While candidates are
        measured, ``groups`` are the candidate's and ``tuning["in_progress"]`` the progress."""
        if self.plan is None:
            return None
        out = {"schedule": self.text, "resolved": self.plan.schedule, "order": list(self.order),
               "groups": self.plan.groups, "predicted_seconds": self.plan.predicted_seconds,
               "tuning": self.plan.tuning, "plan_codecs": self.plan.codecs}
        if self._tuner is not None:
            out["groups"] = [list(g) for g in self._tuner.current.groups]
            out["tuning"] = {"in_progress": self._tuner.to_dict(), "model_groups": self.plan.groups}
        if self._codecs:  # the specs of the groups in use (``groups``), where not the compressor's
            out["codecs"] = [self._codecs.get(tuple(self.order[i] for i in g)) for g in out["groups"]]
        if self._watch is not None:  # the drift watch: its reference and this rank's window so far
            out["watch"] = self._watch.to_dict()
        if self.routes is not None:
            out["routes"] = self.routes.to_dict()
        return out

    def restore(self, saved) -> Optional[List[List[str]]]:
        """A checkpoint's plan (``plan_dict``) for this schedule: adopted (a measured validation in
        progress goes on where it was); returns the groups (names) to use now, or None when the
        checkpoint has no plan for this schedule."""
        if not self.same_schedule(saved):
            return None
        order, tuned = list(saved["order"]), saved.get("tuning")
        progress = tuned.get("in_progress") if isinstance(tuned, dict) else None
        plan_groups = tuned["model_groups"] if progress else saved["groups"]
        plan = Plan(saved.get("resolved", saved["schedule"]), [list(g) for g in plan_groups],
                    saved["predicted_seconds"], None, "shared", tuning=None if progress else tuned,
                    codecs=saved.get("plan_codecs"))
        self.adopt(plan, order)
        if self.routes is not None:
            self.routes.load(saved.get("routes"))
        self._tuner = _Tuner.from_dict(progress) if progress else None
        watch = saved.get("watch")
        self._watch = None
        if self._tuner is None and self._watches(plan):  # goes on where it was; a fresh one if none was saved
            self._watch = _Watch.from_dict(watch) if watch else _Watch()
        return self._use(saved["groups"], saved.get("codecs"))

    def end_of_step(self, clock: StepClock) -> Optional[List[List[str]]]:
        """Called on every rank after each step with its clock; returns the groups (names) to use
        from the next step on when they change, else None. Runs collectives when a decision is
        due, which is at the same step on every rank."""
        if self.validating_routes:
            if self.routes.trial_step(_step_seconds(clock), self._comm()):
                self.plan = replace(self.plan, notes=self.plan.notes + (self.routes.summary(),))
            return None
        if self._watch is not None:
            return self._watch_step(clock)
        if self.done:
            return None
        if self._tuner is not None:
            return self._tune(clock)
        if self.order is None:  # the first step: learn the backward order
            self.order = self._comm().broadcast_object(self._order(clock), "hvc.plan.order")
            if self.searches and self.spec.info.merge == LAYERWISE:  # never merged: profiled layerwise
                self._profiled_groups = [[i] for i in range(len(self.order))]
                return [[n] for n in self.order]
            if self.searches:  # measure with one group: no exchange competes with backward
                self._profiled_groups = [list(range(len(self.order)))]
                return [list(self.order)]
            self.plan = _broadcast_result(self._comm(), self._fixed_plan, "hvc.plan.fixed")
            self._profiled_groups = self.plan.groups
            return self._use(self.plan.groups, None)
        self._runs.append(clock)
        if len(self._runs) < self.profile_steps:
            return None
        self.workload = self._workload()
        model = self.cost_model
        if model is None:
            from .profiling import load_or_profile
            model = self.cost_model = load_or_profile([self.spec, *self.alternatives], max_bytes=sum(self.sizes.values()),
                                                      comm=self._comm(), device=self.device)
        elif self.alternatives:  # a model given by the caller: time the alternatives it has no fit for
            from .profiling import with_fits
            model = self.cost_model = with_fits(model, [self.spec, *self.alternatives], comm=self._comm(),
                                                device=self.device)
        calibrated = self._calibrate(model)  # identical on every rank: from gathered readings
        if self.routes is not None:  # each hop's fit beside the flat one (a collective on every rank)
            self.routes.fit(calibrated, max_bytes=sum(self.sizes.values()), device=self.device)
        plan, candidates = _broadcast_result(self._comm(), lambda: self._model_plan(calibrated), "hvc.plan.model")
        note = ("cost model calibrated to the profiled steps: compression x{compress:.3g}, "
                "decompression x{decompress:.3g}, exchange skew {skew:.3g}".format(**self.calibration))
        plan = replace(plan, notes=plan.notes + (note,))
        changed = self.plan is None or plan.groups != self.plan.groups or plan.codecs is not None
        self.plan = plan
        self._runs = []
        if len(candidates) > 1:  # measured validation: the candidates run, the model's first
            self._tuner = _Tuner(candidates, self.tune_steps)
            return self._use(candidates[0].groups, candidates[0].codecs)
        if not changed and self.routes is None:
            return None
        groups = self._use(plan.groups, plan.codecs)  # with routes: the plan's groups' routes, modelled
        self._validate_routes()
        return groups if changed else None

    def _validate_routes(self) -> None:
        """Once a plan is kept: measure its routes per group (``RouteChoice.start_trial``)."""
        if self.routes is not None:
            self.routes.start_trial(self.tune_steps)

    def _tune(self, clock: StepClock) -> Optional[List[List[str]]]:
        """One step of the measured validation (module doc); the same decisions on every rank."""
        t = self._tuner
        if t.round > 0:  # round 0 settles every candidate, uncounted
            t.times[t.index].append(_step_seconds(clock))
        t.index += 1
        if t.index == len(t.candidates):
            t.index, t.round = 0, t.round + 1
        if t.round <= t.tune_steps:  # the candidates take turns, one step each, so a drifting load hits all alike
            return self._use(t.current.groups, t.current.codecs)
        per_rank = self._comm().allgather_object(t.times, "hvc.plan.tune.times")
        noise_z = tuning.NOISE_Z if self.alternatives else 0.0  # the choice's long list: the model's pick within noise

        def decide():
            times = tuning.step_times(per_rank)
            return tuning.select(times, noise_z=noise_z) + (tuning.step_noise(times),)

        chosen, medians, noise = _broadcast_result(self._comm(), decide, "hvc.plan.tune.kept")
        kept = t.candidates[chosen]
        record = {"candidates": [c.to_dict() for c in t.candidates], "medians_seconds": medians,
                  "kept": chosen, "kept_label": kept.label, "tune_steps": t.tune_steps,
                  "revalidations": t.drift["count"] if t.drift else 0, "drift": t.drift,
                  "step_noise": noise, "noise_z": noise_z}
        timeline = None
        if self.workload is not None and self._calibrated is not None:
            timeline = predict_explicit(kept.groups, self.workload, self._calibrated, self.spec, self.world,
                                        kept.codecs).timeline
        plan = self.plan
        self.plan = replace(plan, groups=[list(g) for g in kept.groups], predicted_seconds=kept.predicted_seconds,
                            codecs=None if kept.codecs is None else list(kept.codecs),
                            timeline=timeline if chosen else plan.timeline, gap=plan.gap if chosen == 0 else None,
                            notes=plan.notes + (tuning.summary(t.candidates, medians, chosen),), tuning=record)
        self._tuner = None
        self._watch = _Watch() if self._watches(self.plan) else None  # its first window: the new reference
        if chosen == len(t.candidates) - 1:
            self._validate_routes()
            return None  # the last candidate measured is the one kept: nothing changes
        groups = self._use(kept.groups, kept.codecs)
        self._validate_routes()
        return groups

    def _watch_step(self, clock: StepClock) -> Optional[List[List[str]]]:
        """One step of the drift watch: at the end of every window of ``revalidate_every`` steps,
        the ranks' step times are gathered (one object collective per window, nothing in the steps
        between) and every rank decides from the same gathered times (``tuning.window_median``,
        ``tuning.drifted``: pure, so alike everywhere): the first window gives the reference; a
        later one that drifted from it starts the measured validation again (``_revalidate``). The
        same steps on every rank: each counts its own steps since the last window."""
        w = self._watch
        w.times.append(_step_seconds(clock))
        if len(w.times) < self.revalidate_every:
            return None
        per_rank = self._comm().allgather_object(list(w.times), "hvc.plan.watch.times")
        median = tuning.window_median(per_rank)
        drift = tuning.drifted(median, w.reference)
        w.times = []
        if w.reference is None:
            w.reference = median if math.isfinite(median) and median > 0 else None
            return None
        if not drift:
            return None
        return self._revalidate({"reference_seconds": w.reference, "window_seconds": median})

    def _revalidate(self, trigger: dict) -> List[List[str]]:
        """The measured validation again, over the kept plan's candidates (the cost model has not
        changed, so they are the ones it would propose), the choice first; ``trigger`` (reference
        and window medians) and the count go into the record of its decision."""
        record = self.plan.tuning
        candidates = [tuning.Candidate.from_dict(c) for c in record["candidates"]]
        first = candidates[0]
        timeline = None
        if self.workload is not None and self._calibrated is not None:
            timeline = predict_explicit(first.groups, self.workload, self._calibrated, self.spec, self.world,
                                        first.codecs).timeline
        self.plan = replace(self.plan, groups=[list(g) for g in first.groups], predicted_seconds=first.predicted_seconds,
                            codecs=None if first.codecs is None else list(first.codecs), timeline=timeline, gap=None,
                            tuning=None)
        drift = dict(trigger, count=int(record.get("revalidations", 0)) + 1)
        self._watch = None
        self._tuner = _Tuner(candidates, self.tune_steps, drift=drift)
        return self._use(first.groups, first.codecs)

    def _watches(self, plan: Optional[Plan]) -> bool:
        """Whether the drift watch runs over ``plan``: a measured validation chose it, and neither
        ``tune_steps`` nor ``revalidate_every`` is 0."""
        return bool(self.revalidate_every and self.tune_steps and plan is not None
                    and isinstance(plan.tuning, dict) and plan.tuning.get("candidates"))

    # -- internals -------------------------------------------------------------------------------
    def _comm(self):
        if self.comm is None:  # a scheduler made without an optimizer: all ranks
            from .collectives import Communicator
            self.comm = Communicator()
        return self.comm

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
        return make_plan(self.schedule, sizes, spec=self.spec, world_size=self.world)  # codecs: once profiled

    def _model_plan(self, model: CostModel):
        """(the plan, the candidates to measure: empty unless tuning applies) -- on rank 0."""
        if isinstance(self.schedule, list):
            return predict_explicit(self.plan.groups, self.workload, model, self.spec, self.world), []
        alt = self.alternatives
        plan = self.workload.plan(self.schedule, model, self.spec, self.world, alternatives=alt)
        if not (self.needs_model and self.tune_steps):
            return plan, []
        if self.searches:
            candidates = tuning.propose(lambda s: plan if s == plan.schedule else
                                        self.workload.plan(s, model, self.spec, self.world, alternatives=alt),
                                        plan.schedule, self.workload.sizes_bytes)
        else:  # a fixed partition: only its choice of specs is measured
            candidates = [tuning.candidate(plan.schedule, plan)]
        if alt:
            fixed = self._fixed_choices(model)
            alone = self._spec_alone(model, replace(fixed[0][1], codecs=None)) if self.searches else []
            candidates = tuning.with_fixed_choices(candidates, fixed, spec_alone=alone)
        return plan, candidates

    def _spec_alone(self, model: CostModel, alone: Plan) -> List[tuning.Candidate]:
        """The candidates the measured validation runs for the compressor alone (without the codec
        choice: ``tuning.propose`` over the plans the planner makes for it, ``alone`` its own plan,
        the first fixed choice), each with the compressor on every group, so that the choice's
        validation measures them too. None for a compressor that never merges: alone, its schedule
        is layerwise, its fixed choice."""
        if self.spec.info.merge == LAYERWISE:
            return []
        found = tuning.propose(lambda s: alone if s == alone.schedule else
                               self.workload.plan(s, model, self.spec, self.world),
                               alone.schedule, self.workload.sizes_bytes)
        name = "dense" if self.spec.name == "none" else self.spec.name
        return [tuning.everywhere(c, str(self.spec), name) for c in found]

    def _fixed_choices(self, model: CostModel) -> List[Tuple[str, Plan]]:
        """(label, plan) per spec the codec choice picks from (the compressor, then each
        alternative), that spec on every group of the plan the planner makes for it alone: for a
        cost-model schedule its own search ("auto": mgs for the compressor, mgwfbp for fp16 and
        dense), for a fixed one the same partition. Labels: "<schedule> (all <spec name>)", dense
        for "none"."""
        out = []
        for option in codec_options(self.spec, self.alternatives):
            alone = self.workload.plan(self.schedule, model, option, self.world)
            name = "dense" if option.name == "none" else option.name
            out.append((f"{alone.schedule} (all {name})", replace(alone, codecs=[str(option)] * len(alone.groups))))
        return out

    def _workload(self) -> Workload:
        """Per profiled step, the slowest rank -- a group's exchange starts when its last gradient
        is ready on *every* rank, so a step's ready times (cumulative backward) are the maximum over
        ranks, and so are its forward and update times -- then the median over the steps. Also
        keeps, the same way, the time the hooks spent (compression, launches) and the time
        ``synchronize()`` spent in the exchanges' own code and the scatter, for ``_calibrate``."""
        mine = []
        for c in self._runs:
            gaps = c.backward_gaps()
            fwd = c.hooks[0][1] - c.prev_end if c.hooks else 0.0
            hooks = sum(b - a for _, a, b in c.hooks)
            end = c.update[1] or c.sync[1]
            mine.append((np.cumsum([gaps.get(n, 0.0) for n in self.order]).tolist(), fwd,
                         c.update[1] - c.update[0], hooks, c.finish,
                         end - c.prev_end if c.prev_end is not None else 0.0))
        ranks = self._comm().allgather_object(mine, "hvc.plan.workload")
        steps = [[r[s] for r in ranks] for s in range(len(mine))]
        ready = np.median([np.max([r[0] for r in step], axis=0) for step in steps], axis=0)
        fwd, upd, self._hook_seconds, self._finish_seconds, self._step_seconds = (
            float(np.median([max(r[k] for r in step) for step in steps])) for k in (1, 2, 3, 4, 5))
        t_b = np.diff(np.maximum.accumulate(ready), prepend=0.0).clip(min=0.0).tolist()
        return Workload(tuple(self.order), tuple(self.sizes[n] for n in self.order), tuple(t_b), fwd, upd)

    def _calibrate(self, model: CostModel) -> CostModel:
        """Scale the model's compression (and launch) and decompression times so that, for the
        groups the profiled steps ran with, they add up to what those steps measured (slowest rank,
        median step): isolated micro-benchmarks miss cache effects, the other ranks' threads
        competing for the cores and rank skew. Factors outside [0.25, 10] are clipped.

        Cost-model schedules profile with one group; what their steps took (slowest rank, median)
        beyond the calibrated model's prediction for it is charged to that group's exchange
        (``CostModel.exchange_skew``, ``costmodel.skew_factor``); plans pay it on their closing
        exchange only (``CostModel.closing_seconds``)."""
        groups = self._profiled_groups
        sizes = np.array([sum(self.sizes[self.order[i]] for i in g) for g in groups])
        factors = []
        for measured, modelled in ((self._hook_seconds, model.group_cpu_seconds(self.spec, sizes)),
                                   (self._finish_seconds, model.decompress_seconds(self.spec, sizes))):
            total = float(np.sum(modelled))
            factors.append(min(10.0, max(0.25, measured / total)) if total > 0 and measured > 0 else 1.0)
        calibrated = model.scaled(*factors).with_skew(0.0)
        skew = 0.0
        if self.searches and len(groups) == 1 and self._step_seconds > 0:
            predicted = predict_explicit(groups, self.workload, calibrated, self.spec, self.world).predicted_seconds
            transfer = float(calibrated.comm_seconds(self.spec, sizes, self.world)[0])
            cpu = float(calibrated.group_cpu_seconds(self.spec, sizes)[0])
            skew = skew_factor(transfer + max(0.0, self._step_seconds - predicted), transfer, cpu)
        self.calibration = {"compress": factors[0], "decompress": factors[1], "skew": skew}
        self._calibrated = calibrated.with_skew(skew)
        return self._calibrated


def predict_explicit(plan_groups, workload: Workload, model: CostModel, spec, world: int,
                     codecs: Optional[Sequence[str]] = None) -> Plan:
    """Explicit groups (indices in backward order), each sent with ``spec`` or its entry of
    ``codecs``, with their prediction under ``model``."""
    specs = list(codecs) if codecs is not None else [str(spec)] * len(plan_groups)
    kinds = sorted(set(specs))
    options = [Option(lambda b, s=s: model.group_cpu_seconds(s, b), lambda b, s=s: model.exchange_seconds(s, b, world),
                      lambda b, s=s: model.closing_seconds(s, b, world), True, step_costs(model, s, world))
               for s in kinds]
    t_d = [(lambda b, s=s: model.decompress_seconds(s, b)) if model.has_decompress_fit(s) else None for s in kinds]
    tl = predict_choice(plan_groups, [kinds.index(s) for s in specs], workload.sizes_bytes, workload.t_b, options,
                        "shared", t_d)
    return Plan("explicit", [list(g) for g in plan_groups], workload.forward_seconds + tl.end +
                workload.update_seconds, tl, "shared", codecs=None if codecs is None else list(codecs))


class _Tuner:
    """Progress of a measured validation: the candidates, the one running, the round (round 0
    settles each candidate, uncounted; rounds 1..tune_steps are measured), this rank's measured
    step times per candidate, and for a re-validation what triggered it (``drift``: reference and
    window medians, the count; None for the first validation)."""

    def __init__(self, candidates, tune_steps: int, index: int = 0, round: int = 0, times=None,
                 drift: Optional[dict] = None):
        self.candidates = list(candidates)
        self.tune_steps = int(tune_steps)
        self.index, self.round = int(index), int(round)
        self.times: List[List[float]] = times if times is not None else [[] for _ in self.candidates]
        self.drift = None if drift is None else dict(drift)

    @property
    def current(self) -> tuning.Candidate:
        return self.candidates[self.index]

    def to_dict(self) -> dict:
        return {"candidates": [c.to_dict() for c in self.candidates], "tune_steps": self.tune_steps,
                "index": self.index, "round": self.round, "times": [list(t) for t in self.times],
                "drift": None if self.drift is None else dict(self.drift)}

    @classmethod
    def from_dict(cls, d) -> "_Tuner":
        return cls([tuning.Candidate.from_dict(c) for c in d["candidates"]], d["tune_steps"], d["index"],
                   d["round"], [[float(x) for x in t] for t in d["times"]], d.get("drift"))


class _Watch:
    """The drift watch over a kept plan: the reference median step (None until the first window
    after the decision is measured) and this rank's step times of the window so far."""

    def __init__(self, reference: Optional[float] = None, times=None):
        self.reference = None if reference is None else float(reference)
        self.times: List[float] = [float(x) for x in times] if times is not None else []

    def to_dict(self) -> dict:
        return {"reference_seconds": self.reference, "times": list(self.times)}

    @classmethod
    def from_dict(cls, d) -> "_Watch":
        return cls(d.get("reference_seconds"), d.get("times", []))


def _step_seconds(clock: StepClock) -> float:
    """A step's time: the end of the previous step to the end of this one's update (nan for the
    first step, which has no previous end)."""
    end = clock.update[1] or clock.sync[1]
    return end - clock.prev_end if clock.prev_end is not None else float("nan")


def _broadcast_result(comm, fn, name: str):
    """Rank 0 of the process set computes ``fn()``; every rank gets its value, or raises its error
    (no rank hangs)."""
    value = error = None
    if comm.rank() == 0:
        try:
            value = fn()
        except ValueError as exc:
            error = str(exc)
    value, error = comm.broadcast_object((value, error), name)
    if error is not None:
        raise ValueError(error)
    return value
