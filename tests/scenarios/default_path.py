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


def default_and_off(steps: int) -> dict:
    """The user's default (codec_choice unset) and codec_choice="off", one after the other."""
    import horovod.torch as hvd
    hvd.init()
    return {"default": _run(None, steps), "off": _run("off", steps)}
