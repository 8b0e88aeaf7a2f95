"""The default path's work per step, against codec_choice="off", inside real Horovod workers
(launched by tests/test_default_path.py). Counts, not times: what each step hands the transport
(launches, waits, object collectives, barriers) and how many bytes of compression state it
copies from one group layout to another, step by step, through profiling, the measured
validation and the steps after the decision. Plain Python data back; the pytest side asserts.
"""

from __future__ import annotations

import collections

import torch
import torch.nn as nn

from scenarios.kit import torch_batch, torch_identical, torch_mlp
from scenarios.schedules import hand_model

SPEC = "dgc:ratio=0.01,warmup_epochs=0"  # the default's spec family; 1% so every exchange sends entries
MLP = (20, 64, 64, 64, 4)
TRANSPORT_CALLS = ("launch", "wait", "poll", "batch", "allreduce_", "allgather", "barrier", "allgather_object",
                   "broadcast_object")


def _count_calls(transport, counts):
    """Count every call of the transport's collectives (the instance's methods wrapped)."""
    for name in TRANSPORT_CALLS:
        method = getattr(transport, name, None)
        if method is None:
            continue

        def counted(*args, _method=method, _name=name, **kwargs):
            counts[_name] += 1
            return _method(*args, **kwargs)
        setattr(transport, name, counted)


def _count_copies(copied):
    """Count the bytes the session copies to join member states into a merged group's layout and to
    split them back (``torch_ops.grouping.join_state`` / ``split_state`` as the session calls them)."""
    import torch_ops.session as session

    def counting(fn, split):
        def wrapped(state, numels, *args, **kwargs):
            out = fn(state, numels, *args, **kwargs)
            if len(numels) > 1:
                copied["bytes"] += sum(t.numel() * t.element_size() for st in (out if split else [out])
                                       for t in st.values())
            return out
        wrapped.counting = fn
        return wrapped

    originals = session.join_state, session.split_state
    session.join_state, session.split_state = counting(originals[0], False), counting(originals[1], True)
    return originals


def _run(choice, steps):
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    import torch_ops.session as session
    model = torch_mlp(sizes=MLP, acts=("relu",) * 3)
    kw = {} if choice is None else {"codec_choice": choice}
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                                   compression=SPEC, cost_model=hand_model(hvd.size(), SPEC, "fp16", "none"),
                                   profile_steps=1, tune_steps=1, **kw)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    engine = opt.engine
    counts, copied = collections.Counter(), {"bytes": 0}
    _count_calls(engine.transport, counts)
    originals = _count_copies(copied)
    regroup = engine.regroup
    between = {"bytes": 0}

    def counted_regroup(groups):  # copies made here are between steps: outside every step's clock
        before = copied["bytes"]
        regroup(groups)
        between["bytes"] += copied["bytes"] - before
        copied["bytes"] = before
    engine.regroup = counted_regroup
    log = []
    try:
        for step in range(steps):
            tuning = engine.scheduler.tuning
            before, copied["bytes"], between["bytes"] = dict(counts), 0, 0
            opt.zero_grad()
            x, y = torch_batch(hvd.rank(), step)
            nn.CrossEntropyLoss()(model(x), y).backward()
            groups = len(engine.groups)  # the groups this step exchanged (a switch happens in step())
            opt.step()
            log.append({"step": step, "tuning": tuning, "decided": engine.scheduler.done, "groups": groups,
                        "calls": {k: counts[k] - before.get(k, 0) for k in counts if counts[k] - before.get(k, 0)},
                        "copied_in_step": copied["bytes"], "copied_between": between["bytes"],
                        "identical": torch_identical(model)})
    finally:
        session.join_state, session.split_state = originals
    plan = engine.scheduler.plan
    return {"codec_choice": opt.codec_choice, "revalidate_every": engine.scheduler.revalidate_every,
            "watching": engine.scheduler.watching, "kept": plan.tuning["kept_label"] if plan.tuning else None,
            "noise_z": plan.tuning.get("noise_z") if plan.tuning else None,
            "state_bytes": sum(t.numel() * t.element_size() for st in engine.param_state().values() for t in st.values()),
            "log": log}


# the house's own modules, whose calls per step depend neither on the data nor on when a round
# completes: the front end, session, scheduler and policy (torch_ops/*.py) and the planner
# (hvdcompress/schedule/). The transport's polling and waiting (collectives.py) and the
# compressors' data-dependent selection are left out: the transport calls count those.
COUNTED = ("torch_ops", "hvdcompress/schedule")
NOT_COUNTED = ("collectives.py",
               "codec_choice.py")  # a group the plan sends dense: its exchange, as a compressor's is


def _counted(path: str):
    """``path`` as "<package>/<file>" when it is a module of ``COUNTED`` (not a subpackage's),
    else None."""
    path = path.replace("\\", "/")
    for package in COUNTED:
        _, sep, tail = path.rpartition(f"/{package}/")
        if sep and "/" not in tail and tail not in NOT_COUNTED:
            return f"{package}/{tail}"
    return None


def _train_step(opt, model, step: int, prof=None) -> None:
    """One step on this rank's batch; ``prof`` (a cProfile.Profile) runs over backward and
    ``opt.step()``, where the optimizer works."""
    import horovod.torch as hvd
    opt.zero_grad()
    x, y = torch_batch(hvd.rank(), step)
    loss = nn.CrossEntropyLoss()(model(x), y)
    if prof is not None:
        prof.enable()
    loss.backward()
    opt.step()
    if prof is not None:
        prof.disable()


def _steady_profile(opt, model, first: int, steps: int) -> dict:
    """Steps ``first..first+steps-1`` under cProfile: calls of each function of the ``COUNTED``
    modules ("<module>:<function>", summed over the steps), what the steps handed the transport,
    and whether every rank ended each step with identical parameters."""
    import cProfile
    import pstats

    counts = collections.Counter()
    _count_calls(opt.engine.transport, counts)
    prof, identical = cProfile.Profile(), []
    for step in range(first, first + steps):
        _train_step(opt, model, step, prof)
        identical.append(torch_identical(model))
    calls = collections.Counter()
    for (path, _, func), (_, ncalls, *_) in pstats.Stats(prof).stats.items():
        module = _counted(path)
        if module is not None:
            calls[f"{module}:{func}"] += ncalls
    return {"calls": dict(calls), "transport": dict(counts), "identical": all(identical)}


def _kept_spec(codecs):
    """The one spec every group of a kept plan is sent with (``Scheduler.codecs``: None for the
    compressor's own), or None when the plan mixes specs (no fixed choice has that plan)."""
    from hvdcompress.spec import resolve
    kinds = {SPEC if c is None else resolve(c).name for c in codecs}
    return kinds.pop() if len(kinds) == 1 else None


def same_plan(steps: int) -> dict:
    """The default (codec_choice unset) until it has decided, then ``steps`` steady steps profiled;
    then the fixed choice with the default's kept plan -- codec_choice="off", the kept groups as
    explicit groups, the spec the plan sends them with (the compressor's, or dense / fp16 where the
    validation kept that fixed choice) -- the same steps profiled once its plan is made. Same model
    and data: after its decision the default should do what that fixed choice does. ``fixed`` is
    None when the default kept a plan that mixes specs."""
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    out, kept = {}, None
    for label in ("default", "fixed"):
        model = torch_mlp(sizes=MLP, acts=("relu",) * 3)
        if label == "default":
            spec, kw = SPEC, {"tune_steps": 1}
        else:
            spec = _kept_spec(out["default"]["codecs"])
            if spec is None:
                out[label] = None
                break
            kw = {"codec_choice": "off", "schedule": kept, "tune_steps": 0}
        opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), compression=spec,
                                       cost_model=hand_model(hvd.size(), SPEC, "fp16", "none"), profile_steps=1, **kw)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        step = 0
        while not opt.engine.scheduler.done or step < 2:
            assert step < 100, "no plan decided in 100 steps"
            _train_step(opt, model, step)
            step += 1
        _train_step(opt, model, step)  # the first step with the kept groups
        kept = kept or opt.engine.group_names()
        out[label] = dict(_steady_profile(opt, model, step + 1, steps), groups=opt.engine.group_names(),
                          codecs=opt.engine.scheduler.codecs, codec_choice=opt.codec_choice, spec=spec,
                          watching=opt.engine.scheduler.watching)
    return out


def default_and_off(steps: int, profiled: int = 0) -> dict:
    """The user's default (codec_choice unset) and codec_choice="off", one after the other; with
    ``profiled`` > 0 also ``same_plan(profiled)``."""
    import horovod.torch as hvd
    hvd.init()
    out = {"default": _run(None, steps), "off": _run("off", steps)}
    if profiled:
        out["same_plan"] = same_plan(profiled)
    return out
