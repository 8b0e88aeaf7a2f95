"""Layer merging (``schedule=``) inside real Horovod workers, launched by
tests/test_multiprocess_schedules.py.

Every scenario returns plain Python data; the pytest side asserts on it. ``everything`` runs
them all in one launch (a launch costs seconds), each part guarded so a failing part reports its
traceback instead of hanging the others. Parameters are compared across ranks bit for bit by
allgathering them (``torch_core._identical_across_ranks``).

The test model's tensors in backward order are 4.bias (16 B), 4.weight (512 B), 2.bias (128 B),
2.weight (4096 B), 0.bias (128 B), 0.weight (2560 B), so "size:0.004" (4194 B) makes three
groups, two of them merged.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.nn as nn

from scenarios.torch_core import TRAIN_SPECS
from scenarios.kit import (
    torch_batch as _batch,
    torch_flat as _flat,
    torch_identical as _identical_across_ranks,
    torch_mlp as _model,
)

STEPS = 6
PROFILE_STEPS = 2  # cost-model schedules: step 0 learns the order, 1-2 measure, merged from step 3
SIZE = "size:0.004"
EXACT_SPECS = ["none", "fp16", "topk:ratio=1.0"]  # elementwise exact with 2 ranks: merging changes nothing


def hand_model(world, *specs):
    """A cost model built by hand (no profiling): 5 ms per hop makes every exchange latency
    bound, so the cost-model schedules merge; a compression fit for each of ``specs``."""
    from hvdcompress.schedule.costmodel import ComputeFit, CostModel
    fit = ComputeFit("linear", 1e-9, 2e-5)
    return CostModel.from_link(world, gbit_per_s=1.0, latency_s=5e-3, compress={s: fit for s in specs})


def make(spec, schedule, model=None, lr=0.1, momentum=0.9, **kw):
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    model = model if model is not None else _model()
    kw.setdefault("tune_steps", 0)  # the model's plan as made (measured validation: tests/test_mp_tuning.py)
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                   named_parameters=model.named_parameters(), compression=spec,
                                   schedule=schedule, **kw)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def run_steps(model, opt, start, stop, bpps=1):
    """Steps ``start..stop-1``; per step: identical across ranks, its timings, and the number of
    groups after it (a plan made at the end of a step is used from the next one)."""
    import horovod.torch as hvd
    log = []
    for step in range(start, stop):
        opt.set_epoch(step // 2)
        opt.zero_grad()
        for micro in range(bpps):
            x, y = _batch(hvd.rank(), step * bpps + micro)
            nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        log.append({"identical": _identical_across_ranks(model), "timings": dict(opt.timings),
                    "groups_after": len(opt.groups)})
    return log


def train(spec, schedule, steps=STEPS, bpps=1, **kw):
    model, opt = make(spec, schedule, backward_passes_per_step=bpps, **kw)
    return model, opt, run_steps(model, opt, 0, steps, bpps)


def order_of(opt):
    return list(opt.state_dict()["hvdcompress"]["plan"]["order"])


def summary(opt, log) -> dict:
    plan = opt.plan
    return {"groups": opt.groups, "schedule": opt.schedule,
            "plan": None if plan is None else {"schedule": plan.schedule, "groups": plan.groups,
                                               "predicted": plan.predicted_seconds},
            "log": log, "identical": all(r["identical"] for r in log),
            "workload": None if opt.workload is None else list(opt.workload.names),
            "cost_model_world": None if opt.cost_model is None else opt.cost_model.world_size}


# --- merged schedules give what layerwise gives ---------------------------------------------------
def equivalence(world) -> dict:
    """none / fp16 / top-k at ratio 1 are elementwise exact with 2 ranks, so every grouping must
    give the layerwise parameters bit for bit."""
    out = {}
    for spec in EXACT_SPECS:
        ref_model, ref_opt, _ = train(spec, "layerwise")
        ref, order = _flat(ref_model), order_of(ref_opt)
        cm = hand_model(world, spec)
        runs = {"single": dict(schedule="single"), SIZE: dict(schedule=SIZE),
                "explicit": dict(schedule=[order[:2], order[2:5], order[5:]], cost_model=cm,
                                 profile_steps=PROFILE_STEPS),
                "auto": dict(schedule="auto", cost_model=cm, profile_steps=PROFILE_STEPS),
                "mgs": dict(schedule="mgs", cost_model=cm, profile_steps=PROFILE_STEPS)}
        res = {"order": order, "layerwise": summary(ref_opt, [])}
        for label, kw in runs.items():
            model, opt, log = train(spec, **kw)
            res[label] = dict(summary(opt, log), equal=bool(torch.equal(_flat(model), ref)))
        out[spec] = res
    return out


def profiled(cache_dir) -> dict:
    """"auto" without a cost model: the real ``load_or_profile`` runs (the cache is empty) and the
    plan it makes still gives the layerwise parameters."""
    os.environ["HVDCOMPRESS_CACHE"] = cache_dir
    before = sorted(os.listdir(cache_dir))
    ref_model, _, _ = train("none", "layerwise", steps=4)
    model, opt, log = train("none", "auto", steps=4, profile_steps=1)
    return dict(summary(opt, log), equal=bool(torch.equal(_flat(model), _flat(ref_model))),
                cache_before=before, cache_after=sorted(os.listdir(cache_dir)),
                model_has_none=opt.cost_model.has_compress_fit("none"))


def all_specs(world) -> dict:
    """Every compressor under a merged schedule: ranks identical after every step, and trains."""
    out = {}
    start = _flat(_model())
    for i, spec in enumerate(TRAIN_SPECS):
        schedule = "single" if i % 2 == 0 else SIZE
        model, opt, log = train(spec, schedule, steps=4)
        out[spec] = dict(summary(opt, log), moved=float((_flat(model) - start).abs().max()),
                         each_step=[r["identical"] for r in log])
    # DGC under a cost-model schedule too (a hand fit for the spec the optimizer ends up with)
    spec = "dgc:ratio=0.05,warmup_epochs=2,min_sparse_numel=256"
    _, probe = make(spec, "layerwise")
    model, opt, log = train(spec, "auto", steps=5, cost_model=hand_model(world, str(probe.compression)),
                            profile_steps=PROFILE_STEPS)
    out["dgc/auto"] = dict(summary(opt, log), moved=float((_flat(model) - start).abs().max()),
                           each_step=[r["identical"] for r in log])
    return out


# --- checkpoints ----------------------------------------------------------------------------------
def _state(opt):
    return {n: {k: t.clone() for k, t in st.items()} for n, st in opt.state_dict()["hvdcompress"]["state"].items()}


def _same_state(a, b) -> bool:
    return a.keys() == b.keys() and all(a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k])
                                                                            for k in a[n]) for n in a)


def _resume_case(spec, world, **kw) -> dict:
    import copy
    model, opt, _ = train(spec, steps=3, **kw)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    groups_at_save, plan_at_save = opt.groups, summary(opt, [])["plan"]
    straight = run_steps(model, opt, 3, 6)
    model2, opt2 = make(spec, **kw)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    groups_after_load = opt2.groups
    resumed = run_steps(model2, opt2, 3, 6)
    hv = saved_opt["hvdcompress"]
    return {"equal": bool(torch.equal(_flat(model), _flat(model2))), "groups_at_save": groups_at_save,
            "groups_after_load": groups_after_load, "groups_end": opt2.groups,
            "identical": all(r["identical"] for r in straight + resumed),
            "state_keys": sorted(hv["state"]), "names": sorted(n for n, _ in model.named_parameters()),
            "state_entries": sorted({k for st in hv["state"].values() for k in st}),
            "saved_plan": hv["plan"], "plan_at_save": plan_at_save, "plan_after": summary(opt2, [])["plan"],
            "workload_after": opt2.workload is not None}


def resume(world) -> dict:
    """A merged plan is saved and restored: the continuation is bit-identical; state is saved per
    parameter, so checkpoints move between groupings."""
    out = {}
    topk = "topk:ratio=0.05"
    cm = hand_model(world, topk)
    out["topk/auto"] = _resume_case(topk, world, schedule="auto", cost_model=cm, profile_steps=1)
    out["topk/size"] = _resume_case(topk, world, schedule=SIZE)
    out["dgc/single"] = _resume_case("dgc:ratio=0.05,warmup_epochs=3,min_sparse_numel=256", world,
                                     schedule="single")

    # a layerwise checkpoint loads into a merged optimizer (and a merged one into a layerwise one)
    _, lw, _ = train(topk, "layerwise", steps=3)
    _, merged, _ = train(topk, "single", steps=3)
    cross = {}
    for label, src, schedule in (("layerwise->single", lw, "single"), ("single->layerwise", merged, "layerwise"),
                                 ("layerwise->size", lw, SIZE)):
        model, opt = make(topk, schedule)
        opt.load_state_dict(src.state_dict())
        loaded = _same_state(_state(opt), _state(src))
        log = run_steps(model, opt, 3, 6)
        cross[label] = {"loaded": loaded, "groups": opt.groups, "identical": all(r["identical"] for r in log),
                        "step": opt.state_dict()["hvdcompress"]["step"]}
    out["cross"] = cross

    # explicit groups are part of the schedule: a checkpoint saved under other groups keeps its
    # state but not its plan
    order = order_of(lw)
    _, a, _ = train(topk, [order[:3], order[3:]], steps=2)
    model, b = make(topk, [order[:1], order[1:]])
    b.load_state_dict(a.state_dict())
    loaded = _same_state(_state(b), _state(a))
    run_steps(model, b, 2, 3)
    out["explicit_other_groups"] = {"groups": b.groups, "asked": [order[:1], order[1:]],
                                    "saved": a.groups, "loaded": loaded}
    return out


# --- no gradient, accumulation ----------------------------------------------------------------
class Branchy(nn.Module):
    """The test model, a layer no rank uses, and a head only rank 0 uses."""

    def __init__(self):
        super().__init__()
        self.body = _model()
        self.unused = nn.Linear(20, 8)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        import horovod.torch as hvd
        y = self.body(x)
        return self.head(y) if hvd.rank() == 0 else y


def no_gradient(world) -> dict:
    """Merged groups holding parameters without a gradient (on every rank, or on some) are sent
    at synchronize with zeros: nothing hangs, ranks stay identical, as under layerwise."""
    out = {}
    for spec in ("none", "topk:ratio=0.5"):
        ref = None
        for schedule in ("layerwise", "single", SIZE):
            torch.manual_seed(3)
            model, opt = make(spec, schedule, model=Branchy(), momentum=0.0)
            unused = _flat(model.unused).clone()
            log = run_steps(model, opt, 0, 4)
            flat = _flat(model)
            ref = flat if ref is None else ref
            out[f"{spec}/{schedule}"] = dict(summary(opt, log), order=order_of(opt),
                                             unused_unchanged=bool(torch.equal(_flat(model.unused), unused)),
                                             equal_to_layerwise=bool(torch.equal(flat, ref)))
    return out


def accumulation(world) -> dict:
    """backward_passes_per_step=2 with merged groups: the accumulated gradients, exchanged once;
    and gradient_predivide_factor with a merged group."""
    out = {}
    for spec in ("none", "fp16"):
        ref, _, _ = train(spec, "layerwise", steps=4, bpps=2)
        for schedule in ("single", SIZE):
            model, opt, log = train(spec, schedule, steps=4, bpps=2)
            out[f"{spec}/{schedule}"] = dict(summary(opt, log), equal=bool(torch.equal(_flat(model), _flat(ref))))
    # gradient_predivide_factor scales a merged group's own buffer in place: same result as layerwise
    ref, _, _ = train("none", "layerwise", steps=3, gradient_predivide_factor=2.0)
    model, opt, log = train("none", "single", steps=3, gradient_predivide_factor=2.0)
    out["none/single/predivide"] = dict(summary(opt, log), equal=bool(torch.equal(_flat(model), _flat(ref))))
    return out


# --- bad arguments ----------------------------------------------------------------------------
def bad_arguments(world) -> dict:
    """Bad schedule / profile_steps / cost_model raise ValueError on every rank before any
    collective; groups that are not consecutive in backward order, and a cost model without the
    fit "mgs" needs, raise on every rank when the plan is made; a collective works afterwards."""
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    cases = {
        "unknown": dict(schedule="fastest"),
        "type": dict(schedule=3),
        "size": dict(schedule="size:-4"),
        "explicit_type": dict(schedule=[[names[0], 7]]),
        "explicit_unknown": dict(schedule=[names + ["nope"]]),
        "explicit_missing": dict(schedule=[names[:-1]]),
        "explicit_twice": dict(schedule=[names, names[:1]]),
        "explicit_empty": dict(schedule=[names, []]),
        "profile_steps": dict(profile_steps=0),
        "profile_steps_type": dict(profile_steps=2.5),
        "cost_model": dict(cost_model={"world_size": world}),
        "revalidate_every": dict(codec_choice="auto", revalidate_every=2),
    }
    errors = {}
    for label, kwargs in cases.items():
        try:
            hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression="topk:ratio=0.1",
                                     **kwargs)
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)

    _, lw, _ = train("none", "layerwise", steps=1)
    order = order_of(lw)
    late = {"not_consecutive": ("none", dict(schedule=[[order[0], order[2]], [order[1]], order[3:]])),
            "mgs_without_fit": ("topk:ratio=0.1", dict(schedule="mgs", cost_model=hand_model(world),
                                                       profile_steps=1))}
    raised_at = {}
    for label, (spec, kw) in late.items():
        model, opt = make(spec, **kw)
        errors[label], raised_at[label] = None, None
        try:
            run_steps(model, opt, 0, 3)
        except ValueError as e:
            errors[label], raised_at[label] = str(e), opt.state_dict()["hvdcompress"]["step"]
    after = hvd.allreduce(torch.ones(1), name="check.after.schedules", op=hvd.Sum)
    return {"errors": errors, "raised_at": raised_at, "after": float(after)}


# --- per-group codec choice: groups switch between the compressor and dense ---------------------
def _codec_steps(model, opt, start, stop, lr, saves=()):
    """Steps ``start..stop-1`` with plain SGD; per step: identical across ranks, the specs of the
    groups in use after it and the parameters; the mean over ranks of the local gradients summed;
    and (model, optimizer) state copies taken before each step in ``saves``."""
    import copy
    import horovod.torch as hvd
    log, given, saved = [], torch.zeros_like(_flat(model)), {}
    for step in range(start, stop):
        if step in saves:
            saved[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        grads = torch.autograd.grad(nn.CrossEntropyLoss()(model(x), y), list(model.parameters()))
        given += hvd.allreduce(torch.cat([g.reshape(-1) for g in grads]), name=f"check.given.{step}")
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        plan = opt.state_dict()["hvdcompress"]["plan"] or {}
        log.append({"identical": _identical_across_ranks(model), "codecs": plan.get("codecs"),
                    "params": _flat(model).clone()})
    return log, given, saved


def _mean_residual(model, opt, name):
    """The residuals of every parameter (zeros where none), averaged over the ranks."""
    import horovod.torch as hvd
    state = opt.state_dict()["hvdcompress"]["state"]
    held = torch.cat([state[n]["residual"].reshape(-1) if "residual" in state[n] else torch.zeros(p.numel())
                      for n, p in model.named_parameters()])
    return hvd.allreduce(held, name=name)


def _resumed(spec, kw, saved):
    """A fresh model and optimizer loaded from a (model, optimizer) state copy."""
    model, opt = make(spec, **kw)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    return model, opt


def _dear_topk_model(world, spec):
    """A hand-built cost model (1 Gbit/s, 5 ms per hop) in which top-k costs 50 ms per group to
    compress and fp16 next to nothing: the choice sends every group dense or in fp16."""
    from hvdcompress.schedule.costmodel import ComputeFit, CostModel
    return CostModel.from_link(world, gbit_per_s=1.0, latency_s=5e-3,
                               compress={spec: ComputeFit("linear", 1e-9, 5e-2), "fp16": ComputeFit("linear", 1e-12, 1e-7)})


def codec_switch(world) -> dict:
    """codec_choice="auto" with a model that makes top-k dearer than dense everywhere: the plan
    sends every group dense or fp16; measured validation runs it in turn with top-k everywhere (and
    size plans), so groups switch between compressed and dense step after step. Error feedback
    loses nothing: (p_0 - p_T) / lr + the mean residual = the sum of the mean gradients. A
    checkpoint taken while the candidates run resumes bit for bit up to the decision (which is
    measured, so may differ), one taken after it to the end."""
    from hvdcompress.schedule.costmodel import ComputeFit, CostModel
    from hvdcompress.schedule.tuning import MAX_CHOICE_CANDIDATES
    # profiled at step 1, decided after at most MAX_CHOICE_CANDIDATES x (1 settling + 1 measured) steps
    spec, lr, during = "topk:ratio=0.05", 0.1, 4
    after = 2 + 2 * MAX_CHOICE_CANDIDATES
    steps = after + 2
    kw = dict(schedule="mgs", cost_model=_dear_topk_model(world, spec), profile_steps=1, tune_steps=1,
              codec_choice="auto", momentum=0.0, lr=lr)
    model, opt = make(spec, **kw)
    start = _flat(model).clone()
    log, given, saved = _codec_steps(model, opt, 0, steps, lr, saves=(during, after))
    # profile at step 1; then every candidate x (1 settling + 1 measured round)
    decided = 1 + 2 * len(opt.plan.tuning["candidates"])
    held = _mean_residual(model, opt, "check.held")
    moved = (start - _flat(model)) / lr
    resumed = {}
    for at in (during, after):
        model2, opt2 = _resumed(spec, kw, saved[at])
        stop = decided + 1 if at == during else steps
        again, _, _ = _codec_steps(model2, opt2, at, stop, lr)
        resumed[at] = {"equal": all(torch.equal(a["params"], b["params"]) for a, b in zip(again, log[at:stop])),
                       "steps": len(again),  # the specs in use after each step but the decision's (measured)
                       "codecs_equal": [a["codecs"] for a in again][:stop - 1 - at] ==
                       [b["codecs"] for b in log[at:stop - 1]] if at == during else
                       [a["codecs"] for a in again] == [b["codecs"] for b in log[at:stop]],
                       "identical": all(a["identical"] for a in again)}
    # a given model with no fit for the alternatives: they are timed on this machine at the plan
    partial = CostModel.from_link(world, gbit_per_s=1.0, latency_s=5e-3,
                                  compress={spec: ComputeFit("linear", 1e-9, 5e-2)})
    model3, opt3 = make(spec, **dict(kw, cost_model=partial, tune_steps=0))
    log3, _, _ = _codec_steps(model3, opt3, 0, 3, lr)
    return {"codecs": [r["codecs"] for r in log], "identical": all(r["identical"] for r in log),
            "untimed_alternatives": {"planned": opt3.plan is not None and opt3.plan.codecs is not None,
                                     "identical": all(r["identical"] for r in log3)},
            "lost": float((moved + held - given).abs().max()), "scale": float(given.abs().max()),
            "resumed_during_tuning": resumed[during], "resumed_after_tuning": resumed[after],
            "plan_codecs": opt.plan.codecs, "decided_at": decided,
            "tuning": opt.plan.tuning is not None and [c["label"] for c in opt.plan.tuning["candidates"]],
            "candidates": opt.plan.tuning and [dict(label=c["label"], codecs=c["codecs"])
                                               for c in opt.plan.tuning["candidates"]]}


def _lowrank_model(world, spec):
    """A hand-built cost model (0.1 Mbit/s, 5 ms per hop, cheap compression): PowerSGD pays on the
    weight matrices, while the small tensors are better merged and sent dense or in fp16."""
    from hvdcompress.schedule.costmodel import ComputeFit, CostModel
    fit = ComputeFit("linear", 1e-10, 1e-6)
    return CostModel.from_link(world, gbit_per_s=1e-4, latency_s=5e-3,
                               compress={spec: fit, "fp16": fit, "none": ComputeFit("linear", 1e-12, 1e-7)})


def lowrank_switch(world) -> dict:
    """codec_choice="auto" for PowerSGD, whose state (``q``) is shaped by the tensor so it never
    merges: the plan sends some weights with PowerSGD (groups of one) and merges the other tensors
    into fp16 / dense groups; the measured validation runs PowerSGD everywhere (layerwise), fp16
    and dense beside it, so tensors move in and out of merged groups with ``q`` and the residual
    carried. Checked: identical parameters every step, nothing lost (error feedback), a
    checkpoint taken after the decision resumes bit for bit."""
    spec, lr, steps, after = "powersgd:rank=2", 0.1, 12, 10
    kw = dict(schedule="auto", cost_model=_lowrank_model(world, spec), profile_steps=1, tune_steps=1,
              codec_choice="auto", momentum=0.0, lr=lr)
    model, opt = make(spec, **kw)
    start = _flat(model).clone()
    log, given, saved = _codec_steps(model, opt, 0, steps, lr, saves=(after,))
    decided = 1 + 2 * len(opt.plan.tuning["candidates"])
    held = _mean_residual(model, opt, "check.lowrank.held")
    moved = (start - _flat(model)) / lr
    model2, opt2 = _resumed(spec, kw, saved[after])
    again, _, _ = _codec_steps(model2, opt2, after, steps, lr)
    choice = opt.plan.tuning["candidates"][0]
    return {"identical": all(r["identical"] for r in log), "decided_at": decided, "steps": steps,
            "lost": float((moved + held - given).abs().max()), "scale": float(given.abs().max()),
            "choice": {"groups": choice["groups"], "codecs": choice["codecs"]},
            "labels": [c["label"] for c in opt.plan.tuning["candidates"]],
            "q_kept": sorted(n for n, st in opt.state_dict()["hvdcompress"]["state"].items() if "q" in st),
            "resumed": {"equal": all(torch.equal(a["params"], b["params"]) for a, b in zip(again, log[after:])),
                        "identical": all(a["identical"] for a in again), "steps": len(again)}}


DRIFT_SLEEP_S = 0.2  # the slowdown injected into every step: several times a step of the test model


def _drift_steps(model, opt, start, stop_when, slow, lr, max_steps, saves=()):
    """Steps from ``start`` until ``stop_when(opt)`` after a step (the same on every rank: it reads
    what rank 0 decided) or ``max_steps`` steps; a step in ``slow`` sleeps ``DRIFT_SLEEP_S`` first.
    Per step what ``_codec_steps`` logs, and the scheduler's state after it; (model, optimizer)
    copies taken before each step in ``saves``."""
    import copy
    import time
    import horovod.torch as hvd
    log, given, saved, step = [], torch.zeros_like(_flat(model)), {}, start
    while step < start + max_steps:
        if step in saves:
            saved[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        if step in slow:
            time.sleep(DRIFT_SLEEP_S)
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        grads = torch.autograd.grad(nn.CrossEntropyLoss()(model(x), y), list(model.parameters()))
        given += hvd.allreduce(torch.cat([g.reshape(-1) for g in grads]), name=f"check.drift.given.{step}")
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        plan = opt.state_dict()["hvdcompress"]["plan"] or {}
        watch = plan.get("watch")
        record = opt.plan.tuning if opt.plan is not None and not opt.engine.scheduler.tuning else None
        log.append({"step": step, "identical": _identical_across_ranks(model), "codecs": plan.get("codecs"),
                    "params": _flat(model).clone(), "tuning": opt.engine.scheduler.tuning,
                    "window": None if watch is None else len(watch["times"]),
                    "reference": None if watch is None else watch["reference_seconds"],
                    "revalidations": None if record is None else record.get("revalidations")})
        step += 1
        if stop_when(opt):
            break
    return log, given, saved


def _watch_of(opt):
    return (opt.state_dict()["hvdcompress"]["plan"] or {}).get("watch")


def codec_drift(world) -> dict:
    """codec_choice="auto" with the drift watch (``revalidate_every=3``). After the measured
    validation the first window sets the reference; a slowdown injected into every step (a sleep
    before the forward pass, on every rank) makes the next window drift, and the validation runs
    again over the same candidates (compressed and dense groups switching again), every rank
    deciding at the same step; lifting the slowdown drifts the other way and re-validates again.
    Parameters stay identical across ranks every step and nothing is lost (error feedback: the
    residual goes out with a group that turns dense). A checkpoint taken inside a window resumes
    the watch at the same steps, bit for bit up to the decision of the re-validation it triggers
    (measured, so it may differ)."""
    spec, lr, every, cap = "topk:ratio=0.05", 0.1, 3, 40
    kw = dict(schedule="mgs", cost_model=_dear_topk_model(world, spec), profile_steps=1, tune_steps=1,
              codec_choice="auto", revalidate_every=every, momentum=0.0, lr=lr)
    model, opt = make(spec, **kw)
    start = _flat(model).clone()

    def referenced(count):  # the re-validations so far, and the watch's new reference set
        def stop(o):
            w, t = _watch_of(o), o.plan.tuning if o.plan is not None else None
            return bool(w and w["reference_seconds"] is not None and t and t.get("revalidations") == count)
        return stop

    # validation, then the first window: the reference
    log, given, _ = _drift_steps(model, opt, 0, referenced(0), (), lr, cap)
    referenced_at = log[-1]["step"]
    # one more step at the same speed, a checkpoint, then every step slowed down
    slow_from = referenced_at + 2
    slow = set(range(slow_from, slow_from + 2 * cap))
    more, g2, saved = _drift_steps(model, opt, referenced_at + 1, referenced(1), slow, lr, cap, saves=(slow_from,))
    log += more
    given += g2
    slowed_reference = (_watch_of(opt) or {}).get("reference_seconds")
    after_slow = dict(opt.plan.tuning)
    lifted_from = log[-1]["step"] + 1  # the slowdown lifted: faster by far more than 25%
    more, g3, _ = _drift_steps(model, opt, lifted_from, referenced(2), (), lr, cap)
    log += more
    given += g3
    held = _mean_residual(model, opt, "check.drift.held")
    moved = (start - _flat(model)) / lr
    # the checkpoint taken inside the window, resumed by a fresh optimizer with the same slowdown
    model2, opt2 = _resumed(spec, kw, saved[slow_from])
    first = next(i for i, r in enumerate(log) if r["step"] >= slow_from)
    decided = next(i for i in range(first, len(log)) if log[i]["tuning"] and not log[i + 1]["tuning"]) + 1
    again, _, _ = _drift_steps(model2, opt2, slow_from, lambda o: False, slow, lr, decided - first + 1)
    ours = log[first:decided + 1]
    resumed = {"equal": all(torch.equal(a["params"], b["params"]) for a, b in zip(again, ours)),
               "steps": len(again),
               "same_windows": [a["window"] for a in again][:-1] == [b["window"] for b in ours][:-1],
               "same_tuning": [a["tuning"] for a in again][:-1] == [b["tuning"] for b in ours][:-1],
               "same_codecs": [a["codecs"] for a in again][:-1] == [b["codecs"] for b in ours][:-1],
               "identical": all(a["identical"] for a in again)}
    strip = [{k: v for k, v in r.items() if k != "params"} for r in log]
    return {"log": strip, "identical": all(r["identical"] for r in log), "referenced_at": referenced_at,
            "slow_from": slow_from, "lifted_from": lifted_from, "after_slow": after_slow,
            "slowed_reference": slowed_reference, "final": opt.plan.tuning, "resumed": resumed,
            "lost": float((moved + held - given).abs().max()), "scale": float(given.abs().max())}


def default_choice(world) -> dict:
    """The codec choice as a default: an optimizer made with a compressing spec, schedule="auto"
    and every other argument at its default (but the cost model, given, and one profiled step, for
    speed) plans each group's spec and measures the choice against the spec, fp16 and dense each
    on every group; ``codec_choice="off"`` sends the spec on every group at every step. Per step:
    identical parameters, the specs in use (the checkpoint's plan) and the bytes sent."""
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    from hvdcompress.schedule.tuning import MAX_CHOICE_CANDIDATES
    spec = "topk:ratio=0.05"
    steps = 4 + 4 * MAX_CHOICE_CANDIDATES  # profiled at step 1, then at most that many candidates x (1 + 3) steps
    out = {}
    for label, extra in (("default", {}), ("off", {"codec_choice": "off"})):
        model = _model()
        opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=spec,
                                       schedule="auto", cost_model=_dear_topk_model(world, spec), profile_steps=1,
                                       **extra)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        log = []
        for step in range(steps):
            opt.zero_grad()
            x, y = _batch(hvd.rank(), step)
            nn.CrossEntropyLoss()(model(x), y).backward()
            opt.step()
            plan = opt.state_dict()["hvdcompress"]["plan"] or {}
            log.append({"identical": _identical_across_ranks(model), "codecs": plan.get("codecs"),
                        "bytes": opt.stats.last_bytes, "dense_bytes": opt.stats.last_dense_bytes})
        tuning = opt.plan.tuning
        out[label] = {"codec_choice": opt.codec_choice, "revalidate_every": opt.engine.scheduler.revalidate_every,
                      "tuning_now": opt.engine.scheduler.tuning, "plan_codecs": opt.plan.codecs,
                      "candidates": [dict(label=c["label"], codecs=c["codecs"]) for c in tuning["candidates"]],
                      "kept": tuning["kept"], "log": log, "spec": str(opt.compression)}
    return out


def everything(world_expected: int, cache_dir: str) -> dict:
    import horovod.torch as hvd
    hvd.init()
    assert hvd.size() == world_expected
    out = {}
    for name, fn, args in (("equivalence", equivalence, (world_expected,)), ("profiled", profiled, (cache_dir,)),
                           ("all_specs", all_specs, (world_expected,)), ("resume", resume, (world_expected,)),
                           ("no_gradient", no_gradient, (world_expected,)),
                           ("accumulation", accumulation, (world_expected,)),
                           ("bad", bad_arguments, (world_expected,)),
                           ("codec_switch", codec_switch, (world_expected,)),
                           ("lowrank_switch", lowrank_switch, (world_expected,)),
                           ("codec_drift", codec_drift, (world_expected,)),
                           ("default_choice", default_choice, (world_expected,))):
        try:
            out[name] = fn(*args)
        except Exception:  # report, do not hang the other parts on a worker traceback
            out[name] = {"error": traceback.format_exc()}
    hvd.shutdown()
    return out


def merged_training(world_expected: int) -> dict:
    import horovod.torch as hvd
    hvd.init()
    assert hvd.size() == world_expected
    try:
        out = all_specs(world_expected)
    except Exception:
        out = {"error": traceback.format_exc()}
    hvd.shutdown()
    return out
