"""Measured validation of cost-model plans (``tune_steps``) inside real Horovod workers, launched
by tests/test_mp_tuning.py. Plain Python data back; the pytest side asserts.

Each step is run as synchronize(), a snapshot of the per-parameter compression state, then
``step()`` under ``skip_synchronize()`` (the update, then the scheduler's turn: a plan switch
happens there), and another snapshot: a switch must leave every parameter's state as it was.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.nn as nn

from scenarios.kit import (
    torch_batch as _batch,
    torch_identical as _identical_across_ranks,
    torch_mlp as _model,
)
from scenarios.schedules import hand_model

SPEC = "topk:ratio=0.3"  # residuals are non-zero: state that a lossy regroup would corrupt
TUNE_STEPS = 1


def _make(world, model=None):
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    model = model if model is not None else _model()
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=SPEC,
                                   schedule="mgs", cost_model=hand_model(world, SPEC), profile_steps=1,
                                   tune_steps=TUNE_STEPS, codec_choice="off")  # the spec's own partitions
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def _state(opt):
    return {n: {k: t.clone() for k, t in st.items()} for n, st in opt.state_dict()["hvdcompress"]["state"].items()}


def _same(a, b):
    return a.keys() == b.keys() and all(a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k])
                                                                            for k in a[n]) for n in a)


def _steps(model, opt, start, stop):
    import horovod.torch as hvd
    log = []
    for step in range(start, stop):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.synchronize()
        before, groups_before = _state(opt), opt.groups
        with opt.skip_synchronize():
            opt.step()
        log.append({"identical": _identical_across_ranks(model), "groups": opt.groups,
                    "switched": opt.groups != groups_before, "state_kept": _same(before, _state(opt)),
                    "residual": float(sum(t.abs().sum() for st in before.values() for t in st.values())),
                    "tuning": opt.engine.scheduler.tuning})
    return log


def _plan(opt):
    p = opt.plan
    return None if p is None else {"schedule": p.schedule, "groups": p.groups, "predicted": p.predicted_seconds,
                                   "tuning": p.tuning}


def tuned(world) -> dict:
    model, opt = _make(world)
    steps = 16
    log = _steps(model, opt, 0, 6)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    tuning_at_save, groups_at_save = opt.engine.scheduler.tuning, opt.groups
    log += _steps(model, opt, 6, steps)
    # a fresh optimizer resumed from the checkpoint taken while candidates ran
    model2, opt2 = _make(world, _model())
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    resumed_at_load = {"tuning": opt2.engine.scheduler.tuning, "groups": opt2.groups}
    log2 = _steps(model2, opt2, 6, steps)
    return {"log": log, "plan": _plan(opt), "groups": opt.groups, "tuning_at_save": tuning_at_save,
            "groups_at_save": groups_at_save, "saved_progress": saved_opt["hvdcompress"]["plan"]["tuning"],
            "resumed_at_load": resumed_at_load, "resumed_log": log2, "resumed_plan": _plan(opt2),
            "resumed_groups": opt2.groups, "order": list(opt.state_dict()["hvdcompress"]["plan"]["order"])}


def everything(world_expected: int) -> dict:
    import horovod.torch as hvd
    hvd.init()
    assert hvd.size() == world_expected
    try:
        out = {"tuned": tuned(world_expected)}
    except Exception:  # report, do not hang the other rank on a traceback
        out = {"tuned": {"error": traceback.format_exc()}}
    hvd.shutdown()
    return out
