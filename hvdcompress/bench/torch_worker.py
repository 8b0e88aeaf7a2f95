"""One benchmark worker: ``python -m hvdcompress.bench.torch_worker CONFIG.json``.

Started by the harness (``hvdcompress bench``, see ``hvdcompress.bench``) once per rank, with the
Gloo environment already set (rank, size, rendezvous address, interface). It initialises Horovod,
fixes torch to ``threads`` CPU threads, and times one *phase* per entry, each with its own copy of
the model (built from the same seed on every rank, so no broadcast is needed):

- ``compute-only`` (when ``compute_only`` is true): the same model, batch and plain SGD step with
  no exchange at all -- the limit that compression approaches;
- one phase per (compression spec, merge schedule): ``DistributedOptimizer`` with that spec and
  ``schedule``, set to epoch ``epoch`` (``opt.set_epoch``) so a schedule such as DGC's density
  warm-up is timed where asked.

With ``profile`` set, the cost model is fitted once per launch on this link
(``torch_ops.profiling.profile_cost_model``, collectives up to ``profile_max_mib`` MiB per rank,
nothing cached) and handed to every phase, so each plan -- whatever its schedule -- carries the
model's predicted step time; the cost-model schedules plan with it.

With ``advise`` set, the workers then run ``hvdcompress advise``'s measurement on this launch's
link (``advise.measure_job``: the model's workload timed with every rank running and calibrated
to a few real training steps -- the slowest rank's compute, the optimizer's hooks --, compression
timed on the CPU, the link model above -- or one fitted now -- completed with fits for fp16 and
dense) and rank 0 records advise's predicted step for every phase: the spec under the entry's
schedule, the codec_choice="auto" prediction for a ``+choice`` entry, the workload's compute
time for compute-only. All of it before the phases are built, so it costs the timing nothing.

Each phase's ``warmup`` untimed steps run back to back (the optimizer's scheduler measures its
profiling steps from one step's end to the next, so nothing else may run between them; warmup
must exceed ``profile_steps`` for the plan to be made before timing). Then the phases are
*interleaved*: every round times one step
(zero_grad, forward, backward, ``step()``, which waits for the exchange) of every phase in turn
(``timed_round``; the ranks meet, untimed, after the compute-only step, which leaves them apart).
On a shared machine whose load drifts, every phase then sees the same load, so their ratios hold
even when the absolute times move. ``steps`` rounds are timed; with ``phase_budget_s`` set, only
as many rounds as fit in ``phase_budget_s`` x (number of phases) seconds at the last warm-up
round's pace (at least 3), so a slow link does not make a sweep endless.

Per phase it records each timed step's time, the optimizer's own accounting over the timed steps
(payload bytes, dense bytes, compression seconds: ``opt.stats``), the plan (groups, predicted
step time) and the medians of the optimizer's per-step timings (``opt.timings``) and, when ``iface`` is set, the
interface's byte counters (``/sys/class/net/<iface>/statistics``) around each timed step, so the
bytes that really crossed the link can be compared with the payload. The rank writes its figures
as JSON to ``out``. With ``device`` "cuda" every rank's model and batch are on its own GPU
(``cuda:<local rank>``) and every step time waits for the device (``torch_ops.timing.timer_for``);
on the CPU (the default) the host clock is read as before. Plain SGD without momentum is used everywhere, so the compressors that keep
momentum themselves (DGC) fit too; only the time of a step matters here, not what it learns.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from torch_ops.collectives import Communicator
from torch_ops.optimizer import DistributedOptimizer
from torch_ops.timing import timer_for

from . import schedules
from .injected_latency import LatencyTransport
from .torch_models import build, count_parameters, synthetic_batch
from .worker_common import (COMPUTE_ONLY, check_identical, digest, load_config, read_counters, timed_round,
                            timed_rounds)

OPTIONAL = {"schedules": ["auto"], "profile": False, "profile_max_mib": 4.0, "profile_steps": 3,
            "emulated_scale": 1.0, "trace_steps": 0, "tune_steps": 3, "advise": False, "device": "cpu"}
MAX_EXTRA_WARMUP = 500  # warm-up steps added for a measured validation to finish
TIMING_KEYS = ("backward_seconds", "hook_seconds", "synchronize_seconds", "update_seconds")


class Phase:
    """One model + optimizer (compressed exchange, or none at all) and what its timed steps cost."""

    def __init__(self, cfg: dict, spec: Optional[str], rank: int, schedule: Optional[str] = None,
                 cost_model=None):
        self.spec = spec
        self.schedule = schedule
        device = torch.device(cfg["device"])
        self.model = build(cfg["model"], seed=cfg["seed"], scale=cfg["emulated_scale"]).to(device)
        self.x, self.y = (t.to(device) for t in synthetic_batch(cfg["batch"], seed=cfg["seed"] + 1000 * (1 + rank)))
        self.timer = timer_for(device)  # the host clock on the CPU; waits for the device on CUDA
        opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        if spec is not None:
            latency_s = cfg["latency_ms"] / 1000.0
            base = LatencyTransport if latency_s > 0 else Communicator
            if cfg["trace_steps"]:  # records each round's launch and completion in trace_step()
                from .emulated import tracing_transport
                base = tracing_transport(base)
            transport = base(latency_s) if latency_s > 0 else base()
            base, tuned = schedules.split(schedule or "auto")
            opt = DistributedOptimizer(opt, named_parameters=self.model.named_parameters(),
                                       compression=spec, transport=transport, schedule=base,
                                       cost_model=cost_model, profile_steps=cfg["profile_steps"],
                                       tune_steps=cfg["tune_steps"] if tuned else 0,
                                       codec_choice=schedules.codec_choice(schedule or ""))
            opt.set_epoch(cfg["epoch"])  # schedules (DGC's density warm-up) at the epoch asked for
        self.opt = opt
        self.iface = cfg["iface"]
        self.times: List[float] = []
        self.forward_times: List[float] = []
        self.last_forward = 0.0
        self.back_to_back: List[float] = []  # warm-up steps once the plan and its prediction are made
        self.timings: List[dict] = []
        self.wire = {"tx_bytes": 0, "rx_bytes": 0}
        self.traces: List[dict] = []
        self.advise_predicted: Optional[float] = None  # set on rank 0 by advise_for's caller
        self._stats_before: Optional[Dict[str, float]] = None

    @property
    def label(self) -> str:
        return f"{self.spec} @ {self.schedule or 'auto'}" if self.spec is not None else COMPUTE_ONLY

    def digest(self) -> str:
        """The parameters' sha256 after the exchanges in flight are applied (``flush``)."""
        self.opt.flush()
        return digest(p.detach().cpu().numpy() for p in self.model.parameters())

    def step(self) -> float:
        start = self.timer.now()
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(self.x), self.y)
        self.last_forward = self.timer.now() - start
        loss.backward()
        self.opt.step()
        return self.timer.now() - start

    def trace_step(self) -> None:
        """One untimed step with the transport tracing: per tensor the gradient hook's entry and exit,
        per round of collectives its launch and completion (a polling thread), synchronize and
        update -- seconds from the first hook (the predicted timeline's time 0)."""
        transport = self.opt.engine.transport
        transport.start_trace()
        start = self.timer.now()
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(self.x), self.y)
        bwd = self.timer.now()
        loss.backward()
        clock = self.opt.engine.clock  # this step's readings (bench side: read, never changed)
        self.opt.step()
        end = self.timer.now()
        rounds = transport.stop_trace()
        t0 = clock.hooks[0][1] if clock.hooks else bwd
        rel = lambda t: None if t is None else t - t0  # noqa: E731
        self.traces.append({
            "step_start": rel(start), "backward_call": rel(bwd), "step_end": rel(end),
            "hooks": [[n, rel(a), rel(b)] for n, a, b in clock.hooks],
            "rounds": {k: [rel(a), rel(b)] for k, (a, b) in rounds.items()},
            "group_keys": [f"hvc.{g.key}" for g in self.opt.engine.groups],
            "groups": [list(g.names) for g in self.opt.engine.groups],
            "synchronize": [rel(clock.sync[0]), rel(clock.sync[1])],
            "update": [rel(clock.update[0]), rel(clock.update[1])]})

    def note_warmup_step(self) -> None:
        """Keep the step time the optimizer measured (end of the previous step to the end of this
        one) for warm-up steps that ran with the final plan, back to back."""
        plan = getattr(self.opt, "plan", None)
        if _validating(self):  # candidate plans are running, not the final one
            self._planned_before = False
            return
        if plan is not None and plan.predicted_seconds is not None and self.opt.timings.get("iteration_seconds"):
            if self.opt.timings["step"] > 0 and self._planned_before:
                self.back_to_back.append(self.opt.timings["iteration_seconds"])
            self._planned_before = True

    _planned_before = False
    extra_warmup = 0

    def _stats(self) -> Dict[str, float]:
        s = self.opt.stats
        return {"steps": s.steps, "bytes": s.total_bytes, "dense": s.total_dense_bytes,
                "compute": s.total_compute_seconds}

    def start_timing(self) -> None:
        if self.spec is not None:
            self._stats_before = self._stats()

    def end_timing(self) -> None:
        if self.spec is not None:
            self._stats_after = self._stats()

    _stats_after: Optional[Dict[str, float]] = None

    def timed_step(self) -> None:
        before = read_counters(self.iface)
        self.times.append(self.step())
        self.forward_times.append(self.last_forward)
        after = read_counters(self.iface)
        if self.spec is not None:
            self.timings.append(dict(self.opt.timings))
        for key in before:
            self.wire[key] += after[key] - before[key]

    def figures(self) -> dict:
        out = {"compression": self.spec if self.spec is not None else COMPUTE_ONLY, "step_times_s": self.times,
               "forward_times_s": self.forward_times, "advise_predicted_s": self.advise_predicted}
        if self.spec is not None:
            now, was = self._stats_after or self._stats(), self._stats_before
            n = now["steps"] - was["steps"]
            out.update({"bytes_per_step": (now["bytes"] - was["bytes"]) / n,
                        "dense_bytes_per_step": (now["dense"] - was["dense"]) / n,
                        "compute_seconds_per_step": (now["compute"] - was["compute"]) / n,
                        "schedule": self.schedule, "plan": plan_figures(self.opt),
                        "back_to_back_step_times_s": self.back_to_back, "extra_warmup_steps": self.extra_warmup,
                        "timings": {k: statistics.median(t[k] for t in self.timings) for k in TIMING_KEYS}})
        if self.iface:
            out.update({f"iface_{k}": v for k, v in self.wire.items()})
        if self.traces:
            out["traces"] = self.traces
            plan = getattr(self.opt, "plan", None)
            if plan is not None and plan.timeline is not None:
                out["predicted_timeline"] = plan.timeline.as_dict()
        return out


def plan_figures(opt) -> Optional[dict]:
    """The plan a phase ran with: its schedule, group sizes and predicted step time."""
    plan = opt.plan
    if plan is None:
        return None
    out = {"schedule": plan.schedule, "groups": len(plan.groups),
           "tensors_per_group": [len(g) for g in plan.groups], "predicted_seconds": plan.predicted_seconds,
           "notes": list(plan.notes)}
    if plan.codecs is not None:  # codec_choice="auto": each group's spec
        out["codecs"] = list(plan.codecs)
    if plan.tuning is not None:  # measured validation: candidates (group counts), medians, the kept one
        t = plan.tuning
        out["tuning"] = {"kept_label": t["kept_label"], "kept": t["kept"], "tune_steps": t["tune_steps"],
                         "candidates": [{"label": c["label"], "groups": len(c["groups"]),
                                         "predicted_seconds": c["predicted_seconds"]} for c in t["candidates"]],
                         "medians_seconds": t["medians_seconds"], "step_noise": t.get("step_noise"),
                         "noise_z": t.get("noise_z")}
    calibration = getattr(getattr(getattr(opt, "engine", None), "scheduler", None), "calibration", None)
    if calibration:
        out["calibration"] = dict(calibration)
    if opt.workload is not None:
        w = opt.workload
        out["workload"] = {"forward_seconds": w.forward_seconds, "backward_seconds": sum(w.t_b),
                           "update_seconds": w.update_seconds}
        out["profiled"] = w.to_dict()  # per tensor: what `python -m hvdcompress.schedule.scaling --bench` reads
        if plan.predicted_seconds is not None:  # what the schedule decides: all but the forward pass
            out["predicted_after_forward_seconds"] = plan.predicted_seconds - w.forward_seconds
    return out


def cost_model_for(cfg: dict, hvd):
    """The cost model fitted on this launch's link (None unless ``profile``); not cached."""
    if not cfg["profile"]:
        return None
    from torch_ops.profiling import comm_sizes_up_to, profile_cost_model
    specs = [s for s in cfg["specs"]]
    model = profile_cost_model(specs, comm_bytes=comm_sizes_up_to(cfg["profile_max_mib"] * (1 << 20)),
                               repeats=5, save=False)
    if hvd.rank() == 0:
        from hvdcompress.schedule.costmodel import describe
        for line in describe(model).splitlines():
            print(f"[bench worker] {line}", flush=True)
    return model


def advise_for(cfg: dict, hvd, fitted=None) -> Optional[dict]:
    """``hvdcompress advise``'s measurement on this launch's link (every rank; None unless
    ``advise``) and, on rank 0, its predictions: ``{"predicted": {(spec, entry): seconds or None},
    "compute_seconds", "workload", "link", "seconds"}`` (other ranks: the same without predictions).
    ``fitted``: the launch's cost model, reused as the link's fit (else one is fitted here, not
    cached: a cached fit would be another link's)."""
    if not cfg["advise"]:
        return None
    from . import advise
    from .torch_models import INPUT_SHAPE
    started = time.perf_counter()
    m = advise.measure_job(cfg["model"], cfg["specs"], input_shape=(cfg["batch"], *INPUT_SHAPE),
                           scale=cfg["emulated_scale"], fitted=fitted, cached=False,
                           max_comm_bytes=cfg["profile_max_mib"] * (1 << 20), device=cfg["device"])
    out = {"compute_seconds": m.compute_only_seconds, "workload": m.workload.to_dict(),
           "link": m.model.to_dict(), "seconds": time.perf_counter() - started, "predicted": {},
           "reference": m.reference, "isolated_workload": m.isolated.to_dict() if m.isolated is not None else None}
    if hvd.rank() != 0:
        return out
    for spec in cfg["specs"]:
        for entry in cfg["schedules"]:
            base, _ = schedules.split(entry)
            alternatives = advise.ALTERNATIVES if schedules.chooses(entry) else ()
            try:
                step = advise.predict(m.workload, m.model, spec, alternatives, schedule=base)["step_seconds"]
            except ValueError as e:  # a plan advise cannot make: no prediction, said why
                print(f"[bench worker] advise: no prediction for {spec} @ {entry}: {e}", flush=True)
                step = None
            out["predicted"][(spec, entry)] = step
    steps = ", ".join(f"{s} @ {e} {v:.3f} s" for (s, e), v in out["predicted"].items() if v is not None)
    print(f"[bench worker] advise measured in {out['seconds']:.1f} s: compute-only "
          f"{m.compute_only_seconds:.3f} s; {steps}", flush=True)
    return out


def _validating(phase) -> bool:
    """The phase's optimizer is still measuring candidate plans (``tune_steps``)."""
    scheduler = getattr(getattr(phase.opt, "engine", None), "scheduler", None)
    return bool(scheduler is not None and (scheduler.tuning or scheduler.tune_steps and scheduler.needs_model
                                           and scheduler.plan is None))


def run(cfg: dict, hvd) -> Tuple[List[dict], Optional[dict], Optional[dict]]:
    """Warm up every phase, then time ``timed_rounds`` interleaved rounds; the phases' figures, the
    cost model fitted on the link (as a dict; None without ``profile``) and what advise measured
    and predicted (``advise_summary``; None without ``advise``)."""
    model = cost_model_for(cfg, hvd)
    advice = advise_for(cfg, hvd, model)
    phases = [Phase(cfg, None, hvd.rank())] if cfg["compute_only"] else []
    phases += [Phase(cfg, spec, hvd.rank(), sched, model) for spec in cfg["specs"] for sched in cfg["schedules"]]
    if advice is not None and hvd.rank() == 0:
        for p in phases:
            p.advise_predicted = (advice["compute_seconds"] if p.spec is None
                                  else advice["predicted"].get((p.spec, p.schedule)))
    hvd.barrier()
    last_round_s = 0.0
    for p in phases:  # back to back: the schedulers measure their profiling steps here
        last = 0.0
        for _ in range(cfg["warmup"]):
            last = p.step()
            p.note_warmup_step()
        extra = 0  # a measured validation still running: warm up until it is done (same step on every rank)
        while _validating(p) and extra < MAX_EXTRA_WARMUP:
            last = p.step()
            p.note_warmup_step()
            extra += 1
        p.extra_warmup = extra
        last_round_s += last
    rounds = timed_rounds(cfg, last_round_s, len(phases), hvd)
    if hvd.rank() == 0:
        print(f"[bench worker] timing {rounds} interleaved rounds of {len(phases)} phases", flush=True)
    hvd.barrier()
    for p in phases:
        p.start_timing()
    for _ in range(rounds):
        timed_round(phases, hvd.barrier)
    hvd.barrier()
    for p in phases:
        p.end_timing()
    for p in phases:  # after the timed rounds, so tracing costs them nothing
        if p.spec is not None:
            for _ in range(cfg["trace_steps"]):
                p.trace_step()
    exchanged = [p for p in phases if p.spec is not None]  # compute-only: each rank its own batch, no exchange
    check_identical([p.label for p in exchanged], [p.digest() for p in exchanged], hvd)
    return ([p.figures() for p in phases], (model.to_dict() if model is not None else None),
            advise_summary(advice))


def advise_summary(advice: Optional[dict]) -> Optional[dict]:
    """``advise_for``'s result as JSON: its predictions as a list of
    ``{"compression", "schedule", "predicted_s"}``."""
    if advice is None:
        return None
    rows = [{"compression": s, "schedule": e, "predicted_s": v} for (s, e), v in advice["predicted"].items()]
    return dict(advice, predicted=rows)


def memory_pass_seconds(numel: int, repeats: int = 7, device="cpu") -> float:
    """One pass over a gradient-sized fp32 buffer -- ``r.add_(g)``: one read of g, one read and
    write of r (error feedback's a = g + r) -- median of ``repeats``, on this worker's threads
    (or on ``device``, waiting for it)."""
    g, r = torch.ones(numel, device=device), torch.zeros(numel, device=device)
    r.add_(g)  # pages touched once before timing
    timer = timer_for(g)
    times = []
    for _ in range(repeats):
        t0 = timer.now()
        r.add_(g)
        times.append(timer.now() - t0)
    return statistics.median(times)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hvdcompress.bench.torch_worker CONFIG.json", file=sys.stderr)
        return 2
    cfg = load_config(argv[0], OPTIONAL)

    torch.set_num_threads(int(cfg["threads"]))
    import horovod
    import horovod.torch as hvd

    hvd.init()
    if cfg["device"] == "cuda":  # every rank on its own GPU
        torch.cuda.set_device(hvd.local_rank())
        cfg["device"] = f"cuda:{hvd.local_rank()}"
    params, tensors = count_parameters(build(cfg["model"], seed=cfg["seed"], scale=cfg["emulated_scale"]))
    pass_s = memory_pass_seconds(params, device=cfg["device"])
    figures, cost_model, advice = run(cfg, hvd)
    if hvd.rank() == 0:
        for phase in figures:
            times = sorted(phase["step_times_s"])
            label = phase["compression"] + (f" @ {phase['schedule']}" if phase.get("schedule") else "")
            plan = phase.get("plan") or {}
            pred = plan.get("predicted_seconds")
            advised = phase.get("advise_predicted_s")
            print(f"[bench worker] {label}: median step {times[len(times) // 2]:.3f} s"
                  + (f", {plan['groups']} groups, predicted {pred:.3f} s" if pred else "")
                  + (f", advise predicted {advised:.3f} s" if advised else ""), flush=True)
        print("[bench worker] parameters identical on every rank in every phase", flush=True)
    result = {"rank": hvd.rank(), "size": hvd.size(), "threads": torch.get_num_threads(),
              "model": cfg["model"], "parameters": params, "parameter_tensors": tensors,
              "iface": cfg["iface"], "phases": figures, "cost_model": cost_model, "memory_pass_s": pass_s,
              "advise": advice,
              "versions": {"torch": torch.__version__, "horovod": horovod.__version__,
                           "python": sys.version.split()[0]}}
    with open(cfg["out"].format(rank=hvd.rank()), "w") as f:
        json.dump(result, f)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
