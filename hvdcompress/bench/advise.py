"""``hvdcompress advise``: which compressor pays on this link, for this model, predicted.

It takes a workload and a link, and predicts with the cost model the optimizer plans with.

The workload, measured or assumed:

- ``--model``: measured. A bench model (``--model vgg``), the user's own
  (``--model pkg.module:function``, a function returning an ``nn.Module``, with
  ``--input-shape``) or an emulated-GPU model (``--model emulated:resnet50-v100``, tensors
  ``--emulated-scale`` times smaller, as ``hvdcompress bench --compute emulated:...`` runs it):
  its forward, backward per parameter and update are timed here
  (``torch_ops.profiling.profile_workload``), so whatever the model really costs on this machine
  -- an emulated layer's overhead beyond its nominal time included -- is in the workload.
  Under Horovod (``--measure-link``, ``hvdcompress bench --advise``) the workload is then
  calibrated to a few real training steps (``reference_steps``: the real optimizer, the dense
  gradient sent as one group): forward, backward and update scaled to the *slowest* rank's (a
  synchronous step waits for it; the isolated timing averages the ranks), and the optimizer's
  per-tensor hook time, which no cost-model fit holds, added to each tensor's backward time.
- ``--profile vgg16-v100``: assumed. The profile's nominal per-layer times and parameter shapes;
  nothing is run. A quick "what if" for a model one has not built.

The link, measured or assumed:

- ``--measure-link`` (under ``horovodrun``): measured. The real transport's fitted model
  (``torch_ops.profiling``: the cached fit of this world and host set, else timed now), its
  per-collective costs included; every rank measures, rank 0 prints.
- ``--gbps`` (``--latency-us``, ``--workers``): assumed. An ideal ring of that rate
  (``CostModel.from_link``): no per-collective overhead of the transport, no sharing of cores.

Compression times are always measured on this machine's CPU for every candidate spec
(``torch_ops.profiling.time_compression``, fitted as the optimizer's planner fits them).

For every candidate it prints the planner's predicted step time (its default schedule for that
spec), the bytes each rank sends per step, the distance to the compute-only step, and
recommends the fastest; then the per-group decisions ``codec_choice="auto"`` would make for the
chosen compressing spec (each group: the spec, fp16 or dense). ``--json`` writes all of it;
``--plot`` draws predicted step time against link rate, the crossover rates (where the best of
{the spec, fp16, dense} changes) marked. Every number is a PREDICTION of the cost model.
``hvdcompress bench --advise`` checks the predictions against measured steps: in every launch
the workers run this measurement on the live link and the table sets advise's predicted step
beside the measured one.

Two link classes (``--nodes N --gpus-per-node L --intra-gbps X --inter-gbps Y``, ASSUMED links):
the main table is the flat exchange of N*L workers over the inter-node link (as ``--workers N*L
--gbps Y``); a second table gives, per spec, the best two-level route (dense or fp16 reduce-scatter
inside a node, the spec across on 1/L of the gradient, allgather inside; spec none: Horovod's
hierarchical allreduce), its time on each hop and the bytes a node sends across, flat against
two-level; then the route and spec the planner would choose per group
(``hvdcompress.schedule.twolevel``). A node's ranks share ``--nics-per-node`` NICs for the cross hop.
At run time the optimizer chooses from fewer routes: flat or two-level with dense inside, per
group of its one-link plan, then measured (``torch_ops.twolevel.RouteChoice``, docs/two-level.md).

    hvdcompress advise --profile vgg16-v100 --workers 4 --gbps 1 --plot advise.png --json advise.json
    hvdcompress advise --model vgg --gbps 0.1 --quick
    hvdcompress advise --model emulated:resnet50-v100 --emulated-scale 32 --gbps 1
    hvdcompress advise --profile resnet50-v100 --nodes 16 --gpus-per-node 8 --intra-gbps 2400 --inter-gbps 10
    horovodrun -np 4 hvdcompress advise --model mypkg.models:build --input-shape 32,3,224,224 --measure-link
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hvdcompress.schedule.costmodel import ComputeFit, CostModel, fit_compute, payload
from hvdcompress.schedule.groups import check_mergeable
from hvdcompress.schedule.planner import Workload
from hvdcompress.schedule.twolevel import (GTOPK, GTOPK_SPECS, INSIDE, TWO_LEVEL, Candidate, Route, TwoLevelCostModel,
                                           candidates, plan_routes, step_bytes)
from hvdcompress.spec import resolve

CANDIDATES = ("none", "fp16", "topk:ratio=0.01", "dgc:ratio=0.001", "powersgd:rank=4", "signsgd", "efsignsgd",
              "onebit", "terngrad", "qsgd", "sketch:ratio=0.01")
ALTERNATIVES = ("fp16", "none")
SWEEP_GBPS = tuple(float(x) for x in np.logspace(-2, 2, 13))  # 10 Mbit/s .. 100 Gbit/s
UNLIMITED_GBPS = 1e4
WITHIN = 0.02  # a spec within 2% of the fastest counts as as fast: the simplest of them is recommended


# --- the workload ---------------------------------------------------------------------------------
def workload_from_profile(name_or_path: str, scale: float = 1.0, update_seconds: float = 0.0) -> Workload:
    """An emulated-GPU profile as a ``Workload``, tensors in backward order: a layer's backward
    time precedes its first parameter's gradient, its other parameters follow at once."""
    from .emulated import load_profile, scaled_shape
    prof = load_profile(name_or_path)
    names, sizes, t_b, shapes = [], [], [], []
    pending = 0.0  # backward time of layers without parameters: it precedes the next gradient
    for layer in reversed(prof["layers"]):
        pending += float(layer["backward_s"])
        for pname, shape in layer["params"].items():
            shape = scaled_shape(shape, scale) if scale != 1 else shape
            names.append(f"{layer['name']}.{pname}")
            shapes.append(tuple(int(x) for x in shape))
            sizes.append(4.0 * float(np.prod(shape)))
            t_b.append(pending)
            pending = 0.0
    forward = float(sum(layer["forward_s"] for layer in prof["layers"]))
    return Workload(tuple(names), tuple(sizes), tuple(t_b), forward, update_seconds, tuple(shapes))


def profile_shapes(workload: Workload, name_or_path: str, scale: float = 1.0) -> Optional[Workload]:
    """``workload`` (of the emulated model of that profile, its parameters named as the bench's
    model names them) with its tensors' shapes from the profile; None where a name is not found."""
    from .emulated import load_profile, scaled_shape
    known = {}
    for layer in load_profile(name_or_path)["layers"]:
        for pname, shape in layer["params"].items():
            known[f"{layer['name']}.{pname}"] = tuple(scaled_shape(shape, scale) if scale != 1 else shape)
    shapes = []
    for n in workload.names:
        key = next((k for k in (n, n.replace("layers.", "", 1).replace("__", ".")) if k in known), None)
        if key is None:
            return None
        shapes.append(known[key])
    return workload.with_shapes(tuple(shapes))


def _user_model(path: str):
    mod, _, fn = path.partition(":")
    if not fn:
        raise ValueError(f"model: expected 'package.module:function' or a bench model name; got {path!r}")
    try:
        return getattr(importlib.import_module(mod), fn)()
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model: cannot load {path!r}: {e}") from None


EMULATED = "emulated:"


def default_input_shape(name: str) -> Tuple[int, ...]:
    """The batch a bench model or an emulated one is run with (an emulated model: its profile's
    batch; its layers ignore the input's values, only their times count)."""
    from .torch_models import INPUT_SHAPE
    batch = 32
    if name.startswith(EMULATED):
        from .emulated import load_profile
        batch = int(load_profile(name[len(EMULATED):])["batch"])
    return (batch, *INPUT_SHAPE)


def workload_from_model(name: str, input_shape: Optional[Sequence[int]] = None, iters: int = 3,
                        scale: float = 1.0, average: bool = False, device=None) -> Workload:
    """A bench model (``hvdcompress.bench.torch_models``), ``emulated:<profile>`` (the emulated-GPU
    model the bench runs, tensors ``scale`` times smaller) or ``module:function``: its forward,
    backward per parameter and update timed here (``torch_ops.profiling.profile_workload``), on
    random inputs of ``input_shape`` (default: ``default_input_shape``). Measured rather than read
    from a profile, so an emulated layer's real overhead is in it too. ``average``: under Horovod,
    every rank measures at once and the times are averaged over ranks (as they would train).
    ``device``: where the model runs (default the CPU; on CUDA every reading waits for the device)."""
    import torch
    from torch_ops.profiling import profile_workload
    from .torch_models import MODELS, build
    if scale != 1 and not name.startswith(EMULATED):
        raise ValueError(f"emulated scale: applies to 'emulated:<profile>' models only; got model {name!r}")
    if name.startswith(EMULATED) or name in MODELS:
        model = build(name, scale=scale)
    else:
        model = _user_model(name)
    shape = tuple(int(d) for d in (input_shape or default_input_shape(name)))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    if device is not None:
        model, x = model.to(device), x.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def closure():
        out = model(x)
        return out.float().pow(2).mean()

    return profile_workload(model, closure, iters=iters, warmup=1, optimizer=opt, average=average)


# --- the costs ------------------------------------------------------------------------------------
def compression_fits(specs: Sequence, max_elements: int, quick: bool = False, device=None) -> Dict[str, object]:
    """Compression-time fits measured on this CPU (or on ``device``, waiting for it), sizes up to
    the largest tensor (at least 4 sizes)."""
    from torch_ops.profiling import time_compression
    top = max(1 << 12, int(max_elements))
    sizes = sorted({int(x) for x in np.geomspace(1 << 10, min(top, 1 << (18 if quick else 22)), 3 if quick else 5)})
    fits = {}
    for s in specs:
        s = resolve(s)
        if s.name == "none":
            continue
        samples = time_compression(s, sizes, repeats=2 if quick else 3, warmup=1, average=False, device=device)
        fits[str(s)] = fit_compute([d for d, _ in samples], [t for _, t in samples])
    return fits


def link_model(workers: int, gbps: float, latency_s: float, fits) -> CostModel:
    """An ideal ring of ``gbps`` and ``latency_s`` per hop (assumed: no transport overhead)."""
    return CostModel.from_link(workers, gbps, latency_s, fits)


def with_compression_fits(model: CostModel, fits: Dict[str, ComputeFit]) -> CostModel:
    """``model`` with its compression fits replaced by ``fits`` where both have one (advise's own
    timings, at the workload's tensor sizes), everything else kept."""
    return replace(model, compress={**model.compress, **fits})


def measured_link(specs: Sequence, fits: Dict[str, ComputeFit], max_bytes: Optional[float] = None,
                  fitted: Optional[CostModel] = None, cached: bool = True) -> CostModel:
    """The live transport's model (under Horovod; call on every rank): ``fitted`` (a model already
    fitted on this link) completed with fits for every spec of ``specs`` (and, where missing, the
    fp16 allreduce and the burst start-up: ``profiling.with_fits``); else the cached fit of
    this world and host set (``cached``) or a fresh one, not saved (collectives timed up to
    ``max_bytes`` per rank) -- ``torch_ops.profiling``. Its compression fits are then ``fits``."""
    from torch_ops import profiling
    if fitted is not None:
        model = profiling.with_fits(fitted, specs, comm_bytes=profiling.comm_sizes_up_to(max_bytes), transport=True)
    elif cached:
        model = profiling.load_or_profile(specs, max_bytes=max_bytes, transport=True)
    else:
        model = profiling.profile_cost_model(specs, comm_bytes=profiling.comm_sizes_up_to(max_bytes), save=False)
    return with_compression_fits(model, fits)


def every_spec(specs: Sequence, auto_spec=None) -> list:
    """The specs to fit: the candidates, the alternatives of the auto choice and its spec."""
    return list(dict.fromkeys([*(resolve(s) for s in specs), *(resolve(a) for a in ALTERNATIVES),
                               *([resolve(auto_spec)] if auto_spec is not None else [])]))


# --- what a training step adds to the isolated measurements (under Horovod) ---------------------
REFERENCE_STEPS = 4  # timed steps of the reference run (after one untimed)


def reference_steps(model_name: str, input_shape: Optional[Sequence[int]] = None, scale: float = 1.0,
                    steps: int = REFERENCE_STEPS, warmup: int = 1, device=None) -> dict:
    """A few real training steps of the model under Horovod (call on every rank), with the real
    ``DistributedOptimizer`` sending the dense gradient as one group (``schedule="single"``: its one
    exchange starts when backward is done, so it slows no backward): what every step costs on the
    compute stream, timed as the harness times a step -- per step, the *slowest* rank.

    - ``compute_seconds``: forward, backward without the optimizer's hooks, and update; per step
      the maximum over ranks, median over steps. A synchronous step waits for the slowest rank,
      while ``profile_workload`` averages the ranks' times.
    - ``hook_seconds``: the optimizer's gradient hooks (per step, maximum over ranks; median):
      per tensor, Python and a copy into its group's buffer, which the cost model has no fit for.

    ``device``: where the model runs (default the CPU); on CUDA the readings wait for the device.
    """
    import torch
    import horovod.torch as hvd
    from torch_ops.optimizer import DistributedOptimizer
    from torch_ops.timing import timer_for
    from .torch_models import MODELS, build
    model = build(model_name, scale=scale) if model_name.startswith(EMULATED) or model_name in MODELS \
        else _user_model(model_name)
    shape = tuple(int(d) for d in (input_shape or default_input_shape(model_name)))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    if device is not None:
        model, x = model.to(device), x.to(device)
    timer = timer_for(x)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                               named_parameters=[(f"hvc.advise.ref.{n}", p) for n, p in model.named_parameters()],
                               schedule="single", tune_steps=0)
    mine = []
    hvd.barrier()
    for it in range(warmup + steps):
        t0 = timer.now()
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        t1 = timer.now()
        loss.backward()
        t2 = timer.now()
        opt.step()
        timings = opt.timings
        hooks = float(timings.get("hook_seconds") or 0.0)
        if it >= warmup:
            mine.append(((t1 - t0) + max(0.0, (t2 - t1) - hooks) + float(timings.get("update_seconds") or 0.0),
                         hooks))
    ranks = hvd.allgather_object(mine, name="hvc.advise.reference")
    per_step = [[r[i] for r in ranks] for i in range(len(mine))]
    return {"compute_seconds": float(np.median([max(v[0] for v in s) for s in per_step])),
            "hook_seconds": float(np.median([max(v[1] for v in s) for s in per_step])),
            "steps": len(mine), "ranks": len(ranks)}


def calibrated_workload(workload: Workload, model: CostModel, reference: dict) -> Workload:
    """``workload`` as a training step runs it (``reference_steps``): forward, backward and update
    scaled to the slowest rank's compute, and each tensor's share of the optimizer's hooks beyond
    what the cost model charges the dense exchange (``group_cpu_seconds``) added to its backward
    time (the hooks run on the compute stream, before the gradient's group can be sent)."""
    scale = reference["compute_seconds"] / workload.compute_seconds if workload.compute_seconds > 0 else 1.0
    modelled = float(model.group_cpu_seconds("none", sum(workload.sizes_bytes)))
    per_tensor = max(0.0, reference["hook_seconds"] - modelled) / max(1, len(workload.names))
    return Workload(workload.names, workload.sizes_bytes, tuple(t * scale + per_tensor for t in workload.t_b),
                    workload.forward_seconds * scale, workload.update_seconds * scale, workload.shapes)


@dataclass(frozen=True)
class Measured:
    """What advise measured in a running job: the workload (calibrated to real training steps
    when ``reference`` is set), the compression fits, the link, the reference steps and the
    workload as ``profile_workload`` timed it (``isolated``)."""

    workload: Workload
    fits: Dict[str, ComputeFit]
    model: CostModel
    reference: Optional[dict] = None
    isolated: Optional[Workload] = None

    @property
    def compute_only_seconds(self) -> float:
        """The predicted step without any exchange: the reference steps' slowest-rank compute (no
        optimizer hooks in such a step), else the workload's compute."""
        return float(self.reference["compute_seconds"]) if self.reference else self.workload.compute_seconds


def measure_job(model_name: str, specs: Sequence, input_shape: Optional[Sequence[int]] = None,
                scale: float = 1.0, quick: bool = False, fitted: Optional[CostModel] = None,
                cached: bool = True, max_comm_bytes: Optional[float] = None, reference: bool = True,
                device=None) -> Measured:
    """advise's measurement under Horovod (call on every rank; ``hvd.init()`` done): the model's
    workload timed with every rank running (times averaged over ranks), compression timed on this
    CPU at its tensor sizes for every spec (and the auto choice's alternatives), and the live
    transport's fitted model (``measured_link``; collectives up to ``max_comm_bytes``, default the
    whole gradient). With ``reference``, the workload is then calibrated to a few real training
    steps (``reference_steps``, ``calibrated_workload``): the slowest rank's compute and the
    optimizer's hooks. What ``advise --measure-link`` and ``hvdcompress bench --advise`` predict from.
    ``device``: where compute and codecs are timed (default the CPU)."""
    workload = workload_from_model(model_name, input_shape, scale=scale, average=True, device=device)
    every = every_spec(specs)
    fits = compression_fits(every, max(workload.sizes_bytes) / 4, quick, device)
    model = measured_link(every, fits, max_bytes=max_comm_bytes or sum(workload.sizes_bytes), fitted=fitted,
                          cached=cached)
    if not reference:
        return Measured(workload, fits, model)
    ref = reference_steps(model_name, input_shape, scale, device=device)
    return Measured(calibrated_workload(workload, model, ref), fits, model, ref, workload)


def schedule_for(spec, schedule: str = "auto", choosing: bool = False) -> str:
    """The schedule ``spec`` runs with when ``schedule`` is asked for (the optimizer's default:
    "auto"): "layerwise" where the spec cannot merge and "auto" was asked without the codec
    choice (``choosing``; with it the planner merges the fp16 / dense groups), else ``schedule``."""
    return schedule if check_mergeable(schedule, resolve(spec), choosing) else "layerwise"


def bytes_per_step(plan, workload: Workload, spec, codecs: Optional[Sequence[str]] = None) -> float:
    """Bytes each rank sends per step under ``plan`` (per group: its spec's wire rule)."""
    total = 0.0
    for k, g in enumerate(plan.groups):
        d = sum(workload.sizes_bytes[i] for i in g) / 4
        total += float(payload(codecs[k] if codecs else spec, d)[2])
    return total


def label(spec) -> str:
    """A spec as a person writes it: its name, its main knob (ratio, rank, levels, threshold) and
    the parameters that differ from the defaults."""
    spec = resolve(spec)
    defaults = {p.name: p.default for p in spec.info.params}
    changed = [f"{k}={v}".lower() for k, v in spec.params.items()
               if k in defaults and (v != defaults[k] or k in ("ratio", "rank", "levels", "threshold"))]
    return spec.name + (":" + ",".join(changed) if changed else "")


def predict(workload: Workload, model: CostModel, spec, alternatives: Sequence = (),
            schedule: str = "auto") -> dict:
    """The planner's plan and predicted step for ``spec`` under ``schedule`` (``schedule_for``);
    with ``alternatives`` (``ALTERNATIVES``), the codec_choice="auto" plan."""
    spec = resolve(spec)
    plan = workload.plan(schedule_for(spec, schedule, bool(alternatives)), model, spec, alternatives=alternatives)
    step = float(plan.predicted_seconds)
    return {"spec": str(spec), "label": label(spec), "schedule": plan.schedule, "groups": len(plan.groups), "step_seconds": step,
            "bytes_per_step": bytes_per_step(plan, workload, spec, plan.codecs),
            "over_compute_seconds": step - workload.compute_seconds,
            "over_compute": step / workload.compute_seconds - 1.0, "codecs": plan.codecs,
            "plan_groups": plan.groups}


def recommend(rows: Sequence[dict]) -> dict:
    """The fastest row; among those within ``WITHIN`` of it, the first in the candidates' order
    (dense first: the simplest that is as fast)."""
    best = min(r["step_seconds"] for r in rows)
    return next(r for r in rows if r["step_seconds"] <= best * (1 + WITHIN))


def decisions(row: dict, workload: Workload) -> List[dict]:
    """Per group of an auto plan: its tensors, bytes and the spec chosen."""
    out = []
    for g, codec in zip(row["plan_groups"], row["codecs"] or [row["spec"]] * len(row["plan_groups"])):
        out.append({"tensors": [workload.names[i] for i in g],
                    "bytes": float(sum(workload.sizes_bytes[i] for i in g)), "spec": codec, "label": label(codec)})
    return out


def sweep(workload: Workload, fits, workers: int, latency_s: float, specs: Sequence, auto_spec,
          rates: Sequence[float] = SWEEP_GBPS) -> dict:
    """Predicted step per link rate for every spec and for the auto choice of ``auto_spec``."""
    curves = {str(resolve(s)): [] for s in specs}
    auto = []
    for g in rates:
        model = link_model(workers, g, latency_s, fits)
        for s in specs:
            curves[str(resolve(s))].append(predict(workload, model, s)["step_seconds"])
        if auto_spec is not None:
            auto.append(predict(workload, model, auto_spec, ALTERNATIVES)["step_seconds"])
    return {"gbps": list(rates), "curves": curves, "auto": auto if auto_spec is not None else None}


def crossovers(workload: Workload, fits, workers: int, latency_s: float, spec, lo: float = 1e-3,
               hi: float = UNLIMITED_GBPS) -> List[dict]:
    """Link rates where the best of {spec, fp16, dense} changes (bisection on a log grid)."""
    fixed = [str(resolve(s)) for s in dict.fromkeys([str(resolve(spec)), *ALTERNATIVES])]

    def best(g):
        model = link_model(workers, g, latency_s, fits)
        steps = [predict(workload, model, s)["step_seconds"] for s in fixed]
        return fixed[int(np.argmin(steps))]

    grid = list(np.geomspace(lo, hi, 15))
    picks = [best(g) for g in grid]
    out = []
    for a, b, pa, pb in zip(grid, grid[1:], picks, picks[1:]):
        if pa == pb:
            continue
        for _ in range(8):  # log bisection: within a factor (hi/lo)^(1/14/256) of the crossover
            mid = math.sqrt(a * b)
            if best(mid) == pa:
                a = mid
            else:
                b = mid
        out.append({"gbps": math.sqrt(a * b), "below": pa, "above": pb})
    return out


def plot(path: str, swept: dict, cross: Sequence[dict], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for spec, steps in swept["curves"].items():
        ax.plot(swept["gbps"], np.array(steps) * 1e3, label=label(spec), lw=1.2)
    if swept["auto"] is not None:
        ax.plot(swept["gbps"], np.array(swept["auto"]) * 1e3, "k--", lw=2, label="codec_choice=auto")
    for c in cross:
        ax.axvline(c["gbps"], color="grey", ls=":", lw=1)
        ax.annotate(f"{c['gbps']:.3g} Gbit/s\n{label(c['below'])} | {label(c['above'])}", (c["gbps"], ax.get_ylim()[1]),
                    fontsize=7, rotation=90, va="top", ha="right")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Gbit/s)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.subplots_adjust(left=0.1, right=0.97, top=0.92, bottom=0.11)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- two link classes -------------------------------------------------------------------------------
def two_level_row(workload: Workload, model: TwoLevelCostModel, spec, gtopk: bool = False) -> dict:
    """The fastest two-level route for ``spec`` (dense or fp16 inside; with ``gtopk``, for top-k and
    DGC, also a global top-k across), planned as ``predict`` plans the flat one; its busy time per
    hop (the sum over its groups) and bytes: per worker inside, per node across, and the flat
    plan's bytes across for comparison."""
    spec = resolve(spec)
    aggregates = ["gather"] + ([GTOPK] if gtopk and spec.name in GTOPK_SPECS else [])
    best = None
    for agg in aggregates:
        for inside in INSIDE:
            route = Route(TWO_LEVEL, inside, agg)
            row = predict(workload, model.for_route(route), spec)
            if best is None or row["step_seconds"] < best[1]["step_seconds"]:
                best = (route, row)
    route, row = best
    groups = row["plan_groups"]
    b = np.array([sum(workload.sizes_bytes[i] for i in g) for g in groups], dtype=float)
    intra, inter, _, _ = model.comm(route, spec, b)
    sent = step_bytes(model, groups, workload.sizes_bytes, [Candidate(route, spec)] * len(groups))
    flat = predict(workload, model.flat, spec)
    flat_sent = step_bytes(model, flat["plan_groups"], workload.sizes_bytes, [Candidate(Route(), spec)] * len(
        flat["plan_groups"]))
    return {"spec": str(spec), "label": label(spec), "route": Candidate(route, spec).label, **route.as_dict(),
            "step_seconds": row["step_seconds"], "flat_step_seconds": flat["step_seconds"],
            "schedule": row["schedule"], "groups": row["groups"],
            "intra_seconds": float(np.sum(intra)), "inter_seconds": float(np.sum(inter)),
            "intra_bytes_per_worker": sent["intra"], "inter_bytes_per_node": sent["inter_per_node"],
            "flat_inter_bytes_per_node": flat_sent["inter_per_node"]}


def two_level_choice(workload: Workload, model: TwoLevelCostModel, spec, gtopk: bool = False) -> dict:
    """The route and spec per group the planner chooses (``twolevel.plan_routes``), per group."""
    found = plan_routes(workload.sizes_bytes, workload.t_b, model, spec,
                        candidates(spec, model.topology, gtopk=gtopk), forward_seconds=workload.forward_seconds,
                        update_seconds=workload.update_seconds)
    groups = [{"tensors": [workload.names[i] for i in g], "bytes": float(sum(workload.sizes_bytes[i] for i in g)),
               "route": c.label, "spec": str(c.spec), **c.route.as_dict()} for g, c in zip(found.groups, found.choices)]
    return {"spec": str(resolve(spec)), "label": label(spec), "step_seconds": found.predicted_seconds,
            "counts": found.counts(), "decisions": groups,
            **{k: v for k, v in step_bytes(model, found.groups, workload.sizes_bytes, found.choices).items()}}


def _ints(text: str) -> List[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers; got {text!r}")
    return vals


def main(argv: Optional[Sequence[str]] = None, prog: str = "hvdcompress advise") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="ASSUMED compute: an emulated-GPU profile's nominal per-layer times, nothing "
                                       "run (a shipped name: vgg16-v100, resnet50-v100; or a JSON)")
    src.add_argument("--model", help="MEASURED compute, timed here: a bench model (vgg, mlp, deep), "
                                     "emulated:<profile> (the bench's emulated-GPU model) or package.module:function "
                                     "returning an nn.Module")
    ap.add_argument("--input-shape", type=_ints, default=None,
                    help="--model's input batch shape (default: 32,3,32,32; emulated: the profile's batch)")
    ap.add_argument("--emulated-scale", "--scale", dest="scale", type=float, default=1.0,
                    help="--profile or --model emulated:<profile>: tensors this many times smaller (as the "
                         "bench's --emulated-scale)")
    ap.add_argument("--workers", type=int, default=None, help="default 4; with --nodes: nodes x gpus per node")
    ap.add_argument("--gbps", type=float, default=1.0, help="ASSUMED link: an ideal ring of this rate (Gbit/s)")
    ap.add_argument("--latency-us", type=float, default=50.0, help="ASSUMED link's per-hop latency (microseconds)")
    ap.add_argument("--measure-link", action="store_true",
                    help="MEASURED link, under horovodrun: the real transport's fitted model (cached per world "
                         "and host set)")
    ap.add_argument("--spec", action="append", help="a candidate spec (repeatable; default: a built-in list)")
    ap.add_argument("--auto-spec", help="the compressor codec_choice=auto decides for (default: the fastest compressing candidate)")
    ap.add_argument("--quick", action="store_true", help="fewer compression timings (seconds, less accurate)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where --model's compute and the codecs are timed (cuda: each rank's own GPU, "
                         "readings that wait for the device; default cpu)")
    two = ap.add_argument_group("two link classes (ASSUMED links; module doc)")
    two.add_argument("--nodes", type=int, default=None, help="nodes (with --gpus-per-node)")
    two.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (with --nodes)")
    two.add_argument("--intra-gbps", type=float, default=None, help="link inside a node (Gbit/s)")
    two.add_argument("--inter-gbps", type=float, default=None, help="link between nodes (Gbit/s; default --gbps)")
    two.add_argument("--intra-latency-us", type=float, default=2.0, help="per-hop latency inside a node")
    two.add_argument("--inter-latency-us", type=float, default=None,
                     help="per-hop latency between nodes (default --latency-us)")
    two.add_argument("--nics-per-node", type=int, default=1, help="NICs a node's ranks share across (default 1)")
    two.add_argument("--gtopk", action="store_true", help="also a global top-k across for top-k and DGC")
    ap.add_argument("--json", help="write everything here")
    ap.add_argument("--plot", help="PNG of predicted step time against link rate, crossovers marked")
    args = ap.parse_args(argv)
    try:
        specs = [resolve(s) for s in (args.spec or CANDIDATES)]
        auto_spec = resolve(args.auto_spec) if args.auto_spec else None
        if args.model and args.model.startswith(EMULATED):
            from .emulated import profile_path
            profile_path(args.model[len(EMULATED):])
        elif args.model and args.scale != 1:
            raise ValueError(f"--emulated-scale: applies to --profile and --model emulated:<profile>; "
                             f"got --model {args.model}")
    except ValueError as e:
        ap.error(str(e))
    two_level = any(v is not None for v in (args.nodes, args.gpus_per_node, args.intra_gbps, args.inter_gbps,
                                             args.inter_latency_us)) or args.gtopk or args.nics_per_node != 1
    if two_level:
        if args.nodes is None or args.gpus_per_node is None or args.intra_gbps is None:
            ap.error("two link classes: --nodes, --gpus-per-node and --intra-gbps go together (with --inter-gbps, "
                     "default --gbps)")
        if args.measure_link:
            ap.error("--nodes/--gpus-per-node: the link classes are ASSUMED (--intra-gbps, --inter-gbps); "
                     "--measure-link measures one link")
        if args.nodes < 1 or args.gpus_per_node < 1 or args.nics_per_node < 1 or not args.intra_gbps > 0 \
                or args.intra_latency_us < 0:
            ap.error("--nodes, --gpus-per-node and --nics-per-node must be >= 1, --intra-gbps > 0, "
                     "--intra-latency-us >= 0")
        if args.workers is not None and args.workers != args.nodes * args.gpus_per_node:
            ap.error(f"--workers {args.workers} is not --nodes x --gpus-per-node = {args.nodes * args.gpus_per_node}")
        args.workers = args.nodes * args.gpus_per_node
        args.gbps = args.inter_gbps if args.inter_gbps is not None else args.gbps
        if args.inter_latency_us is not None:
            args.latency_us = args.inter_latency_us
    if args.workers is None:
        args.workers = 4
    if args.workers < 2 or not (args.gbps > 0 and args.latency_us >= 0 and args.scale >= 1):
        ap.error("--workers must be >= 2, --gbps > 0, --latency-us >= 0, --emulated-scale >= 1")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); accepted "
                     "here: --device cpu")
    rank, compute_only, device = 0, None, None
    if args.measure_link:
        import horovod.torch as hvd
        hvd.init()
        rank = hvd.rank()
    if args.device == "cuda":
        local = hvd.local_rank() if args.measure_link else torch.cuda.current_device()
        torch.cuda.set_device(local)  # every rank on its own GPU
        device = f"cuda:{local}"
    scaled = f" (tensors / {args.scale:g})" if args.scale != 1 else ""
    if args.profile:
        workload = workload_from_profile(args.profile, args.scale)
        what = f"profile {args.profile}{scaled} (nominal times, ASSUMED)"
    else:
        workload = workload_from_model(args.model, args.input_shape, scale=args.scale, average=args.measure_link,
                                       device=device)
        what = f"model {args.model}{scaled} (forward, backward, update MEASURED on this machine)"
    if device is not None:
        what += f"; compute and codecs timed on {device} ({torch.cuda.get_device_name(device)})"
    every = every_spec(specs, auto_spec)
    fits = compression_fits(every, max(workload.sizes_bytes) / 4, args.quick, device)
    if args.measure_link:
        model = measured_link(every, fits, max_bytes=sum(workload.sizes_bytes))
        link = f"measured transport (MEASURED), {model.world_size} workers"
        if args.model:  # the workload as training steps run it: the slowest rank, the optimizer's hooks
            ref = reference_steps(args.model, args.input_shape, args.scale, device=device)
            workload, compute_only = calibrated_workload(workload, model, ref), ref["compute_seconds"]
            what += "; calibrated to real training steps (slowest rank, optimizer hooks)"
        workers, latency, gbps = model.world_size, None, None
    else:
        workers, latency, gbps = args.workers, args.latency_us * 1e-6, args.gbps
        model = link_model(workers, gbps, latency, fits)
        link = f"{workers} workers, ideal ring {gbps:g} Gbit/s + {args.latency_us:g} us per hop (ASSUMED)"
    if rank != 0:  # every rank measured; rank 0 reports
        return 0
    rows = [predict(workload, model, s) for s in specs]
    best = recommend(rows)
    compressing = [r for r in rows if resolve(r["spec"]).name not in ("none", "fp16", "bf16")]
    if auto_spec is None and compressing:
        auto_spec = resolve(min(compressing, key=lambda r: r["step_seconds"])["spec"])
    auto = predict(workload, model, auto_spec, ALTERNATIVES) if auto_spec is not None else None

    compute = workload.compute_seconds if compute_only is None else compute_only
    for r in rows + ([auto] if auto else []):  # the distance to the step without any exchange
        r.update(over_compute_seconds=r["step_seconds"] - compute, over_compute=r["step_seconds"] / compute - 1.0)
    print(f"advise: {what}, {len(workload.names)} tensors, {sum(workload.sizes_bytes) / 1e6:.1f} MB of gradients; "
          f"{link}; compute-only step {compute * 1e3:.1f} ms. PREDICTIONS of the cost model.")
    print(f"{'spec':<34} {'schedule':<10} {'step ms':>9} {'MB/step':>9} {'over compute':>13}")
    for r in rows + ([dict(auto, label=f"auto({auto['label']})")] if auto else []):
        print(f"{r['label']:<34} {r['schedule']:<10} {r['step_seconds'] * 1e3:9.1f} {r['bytes_per_step'] / 1e6:9.3f} "
              f"{r['over_compute_seconds'] * 1e3:9.1f} ms {r['over_compute']:+.0%}")
    print(f"recommendation: {best['label']} ({best['step_seconds'] * 1e3:.1f} ms per step; the first of the "
          f"candidates within {WITHIN:.0%} of the fastest)")
    result = {"note": "PREDICTIONS of the cost model (hvdcompress.schedule), not measurements", "workload": what,
              "link": link, "compute_seconds": compute, "rows": rows, "recommendation": best["spec"],
              "fits": {k: v.to_dict() for k, v in fits.items()}}
    if auto is not None:
        groups = decisions(auto, workload)
        counts = {s: sum(1 for g in groups if g["label"] == s) for s in dict.fromkeys(g["label"] for g in groups)}
        print(f"codec_choice=\"auto\" with {label(auto_spec)}: {auto['step_seconds'] * 1e3:.1f} ms; groups by spec: "
              + ", ".join(f"{s} {n}" for s, n in counts.items()))
        for g in groups:
            first = g["tensors"][0] + (f" .. {g['tensors'][-1]}" if len(g["tensors"]) > 1 else "")
            print(f"  {g['label']:<34} {g['bytes'] / 1e6:9.3f} MB  {first} ({len(g['tensors'])} tensors)")
        result["auto"] = dict(auto, decisions=groups)
    if two_level:
        result["two_level"] = _print_two_level(args, workload, fits, specs, auto_spec)
    if gbps is not None and auto_spec is not None:
        cross = crossovers(workload, fits, workers, latency, auto_spec)
        for c in cross:
            print(f"crossover at {c['gbps']:.3g} Gbit/s: {label(c['below'])} below, {label(c['above'])} above")
        result["crossovers"] = cross
        if args.plot:
            shown = list(dict.fromkeys([str(auto_spec), *(str(resolve(a)) for a in ALTERNATIVES), best["spec"]]))
            swept = sweep(workload, fits, workers, latency, shown, auto_spec)
            plot(args.plot, swept, cross, f"{what}; {workers} workers, {args.latency_us:g} us/hop (predicted)")
            result["sweep"] = swept
            print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"json: {args.json}")
    return 0


def _print_two_level(args, workload: Workload, fits, specs, auto_spec) -> dict:
    """advise's two-level table and the per-group route choice (module doc); returns them."""
    model = TwoLevelCostModel.from_links(args.nodes, args.gpus_per_node, args.intra_gbps, args.gbps,
                                         args.intra_latency_us * 1e-6, args.latency_us * 1e-6, args.nics_per_node,
                                         fits)
    t = model.topology
    print(f"two levels: {t.nodes} nodes x {t.local_size} ranks; inside {args.intra_gbps:g} Gbit/s + "
          f"{args.intra_latency_us:g} us, across {args.gbps:g} Gbit/s + {args.latency_us:g} us per hop, "
          f"{args.nics_per_node} NIC(s) per node shared by its ranks (ASSUMED). The table above is flat.")
    rows = [two_level_row(workload, model, s, args.gtopk) for s in specs]
    print(f"{'spec':<26} {'flat ms':>9} {'2-level ms':>10} {'best two-level route':<52} {'intra ms':>9} "
          f"{'inter ms':>9} {'intra MB/w':>10} {'across MB/node flat':>19} {'2-level':>9}")
    for r in rows:
        print(f"{r['label'][:26]:<26} {r['flat_step_seconds'] * 1e3:9.1f} {r['step_seconds'] * 1e3:10.1f} "
              f"{r['route'][:52]:<52} {r['intra_seconds'] * 1e3:9.2f} {r['inter_seconds'] * 1e3:9.2f} "
              f"{r['intra_bytes_per_worker'] / 1e6:10.2f} {r['flat_inter_bytes_per_node'] / 1e6:19.3f} "
              f"{r['inter_bytes_per_node'] / 1e6:9.3f}")
    out = {"topology": str(t), "intra_gbps": args.intra_gbps, "intra_latency_us": args.intra_latency_us,
           "inter_gbps": args.gbps, "inter_latency_us": args.latency_us, "nics_per_node": args.nics_per_node,
           "rows": rows}
    if auto_spec is not None:
        choice = two_level_choice(workload, model, auto_spec, args.gtopk)
        print(f"two-level choice with {label(auto_spec)}: {choice['step_seconds'] * 1e3:.1f} ms; groups by route: "
              + ", ".join(f"{k} {n}" for k, n in choice["counts"].items()))
        for g in choice["decisions"]:
            first = g["tensors"][0] + (f" .. {g['tensors'][-1]}" if len(g["tensors"]) > 1 else "")
            print(f"  {g['route'][:52]:<52} {g['bytes'] / 1e6:9.3f} MB  {first} ({len(g['tensors'])} tensors)")
        print("  (the model's joint choice; a run chooses flat or two-level, dense inside, per group of its plan "
              "and measures it: docs/two-level.md)")
        out["choice"] = choice
    return out


if __name__ == "__main__":
    sys.exit(main())
