"""What the PyTorch ``DistributedOptimizer`` checks before it wraps anything: its arguments (with
Horovod's names and meanings), the parameter names, and that every rank wraps the same model.
Every bad value is a ValueError naming the argument and its accepted values, raised on every rank
before any gradient collective. Also what ``load_state_dict`` checks before it loads anything."""

from __future__ import annotations

from typing import Dict

import torch

from hvdcompress.delay import check_delay, check_sync_every

from .scheduling import check_cost_model, check_profile_steps, check_schedule


def check_arguments(optimizer, backward_passes_per_step, op, gradient_predivide_factor, schedule, profile_steps,
                    cost_model, delay, sync_every):
    """Validate the wrapper's arguments; returns (op, gradient_predivide_factor as float)."""
    from . import transport as hvd  # the op constants, with Horovod's values, without importing Horovod

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer: expected a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("optimizer: LBFGS re-evaluates the closure several times per step and cannot "
                         "be wrapped (as in Horovod)")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step: must be an int >= 1; "
                         f"got {backward_passes_per_step!r}")
    op = hvd.Average if op is None else op
    if op == hvd.Adasum:
        raise ValueError("op: Adasum is not supported with compression; accepted: hvd.Average, hvd.Sum")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op: accepted values are hvd.Average and hvd.Sum; got {op!r}")
    try:
        factor = float(gradient_predivide_factor)
    except (TypeError, ValueError):
        factor = float("nan")
    if not factor > 0 or factor == float("inf"):
        raise ValueError("gradient_predivide_factor: must be a finite float > 0; "
                         f"got {gradient_predivide_factor!r}")
    if factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor: values other than 1.0 require op=hvd.Average")
    check_schedule(schedule)
    check_profile_steps(profile_steps)
    check_delay(delay)
    check_sync_every(sync_every)
    check_cost_model(cost_model)
    return op, factor


def check_same_model(transport, by_name: Dict[str, torch.Tensor]) -> None:
    """Every rank must wrap the same parameters (names, shapes, dtypes): a model that differs
    across ranks would exchange mismatched tensors, or hang. One object allgather at construction;
    a difference is a ValueError on every rank, naming the first parameter that differs."""
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in by_name.items()]
    every = transport.allgather_object(mine, "hvc.check.model")
    for rank, theirs in enumerate(every):
        if theirs == every[0]:
            continue
        a, b = dict((n, (s, d)) for n, s, d in every[0]), dict((n, (s, d)) for n, s, d in theirs)
        for name in list(a) + [n for n in b if n not in a]:
            if a.get(name) != b.get(name):
                raise ValueError(f"named_parameters: the model differs across ranks: parameter '{name}' is "
                                 f"{a.get(name, 'absent')} (shape, dtype) on rank 0 and {b.get(name, 'absent')} on "
                                 f"rank {rank}; every rank must build the same model")
        raise ValueError(f"named_parameters: ranks 0 and {rank} list their parameters in different orders")


def parameter_names(param_groups, named_parameters) -> Dict[torch.Tensor, str]:
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(param_groups)
                for j, p in enumerate(g["params"])}
    named_parameters = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named_parameters:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError("named_parameters: parameter names must be unique; found duplicates: "
                         + ", ".join(sorted(dups)))
    by_id = {id(p): name for name, p in named_parameters}
    names = {}
    for g in param_groups:
        for p in g["params"]:
            if id(p) not in by_id:
                raise ValueError("named_parameters was specified, but one or more model parameters "
                                 "were not named (the optimizer holds a parameter of shape "
                                 f"{tuple(p.shape)} that is not in named_parameters)")
            names[p] = by_id[id(p)]
    return names


def check_devices(parameter: str, tensors) -> torch.device:
    """The one device ``tensors`` (tensors, or ``(name, tensor)`` pairs) are on: a compressed exchange
    merges them into buffers on one device, so a model spread over several devices (or left partly on
    the CPU after ``.to(device)`` missed a module) is a ValueError naming ``parameter`` and every
    device found, with a few tensors of each. Raised before any collective; it looks at this rank's
    tensors only, so ranks that run the same code raise together. No tensors: the CPU."""
    found: Dict[str, list] = {}
    for i, item in enumerate(tensors):
        name, t = item if isinstance(item, tuple) else (f"#{i}", item)
        found.setdefault(str(t.device), []).append(name)
    if len(found) > 1:
        listed = "; ".join(f"{dev}: {len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                           for dev, names in found.items())
        raise ValueError(f"{parameter}: every tensor must be on one device (move the model with .to(device) "
                         f"before wrapping it); found {len(found)} devices: {listed}")
    return torch.device(next(iter(found))) if found else torch.device("cpu")


def check_topology(topology, transport, default_flat: bool = False):
    """The ``topology=`` argument of a front end on ``transport`` -> a ``hvdcompress.topology.Topology``
    (flat: one level). None takes the launcher's (``LOCAL_WORLD_SIZE`` / ``HOROVOD_LOCAL_SIZE``)
    where a two-level exchange can run (a torch.distributed transport on the whole job, or Horovod's
    on the whole job with its node process sets at hand: ``collectives.can_make_process_sets``),
    else flat; anything else is explicit and must be runnable. ValueError naming ``topology`` and
    the accepted forms, raised by every rank alike before any collective."""
    from hvdcompress.topology import FORMS, Topology, resolve_topology
    world = transport.size()
    if topology is None and (default_flat or not transport.included() or not _whole_job(transport)):
        return Topology(world, world)
    topo = resolve_topology(topology, world)
    if topo.flat:
        return topo
    from .collectives import Communicator
    from .dist_collectives import TorchDistCommunicator
    if isinstance(transport, Communicator):
        return _horovod_topology(topology, topo, transport)
    if not isinstance(transport, TorchDistCommunicator):
        if topology is None:  # the launcher's layout, on a transport without two levels: flat
            return Topology(world, world)
        raise ValueError(f"topology={topology!r}: a two-level exchange runs on torch.distributed (backend='torch', "
                         f"or the DDP hook) or Horovod's transport, not on {type(transport).__name__}; "
                         f"accepted here: topology='flat' or None. Forms: {FORMS}")
    return topo


def _horovod_topology(topology, topo, transport):
    """``topo`` (two-level) on Horovod's transport: its node and cross-node process sets must be at
    hand (registered by ``hvdcompress.torch.init``, or Horovod adds sets after its init) and the
    transport must span the whole job. The launcher's (``topology`` None) is flat otherwise; an
    explicit one is a ValueError saying what to do."""
    from hvdcompress.topology import FORMS, Topology, launcher_homogeneous

    from .collectives import can_make_process_sets
    from .elastic import elastic_mode
    if topology is None and (elastic_mode() or not launcher_homogeneous()):  # a changing world; or ranks
        return Topology(topo.world, topo.world)                             # that read different layouts
    if elastic_mode():
        raise ValueError(f"topology={topology!r}: a two-level exchange does not run under Horovod Elastic (the "
                         "world changes size, its process sets would not follow); accepted here: topology='flat' "
                         f"or None. Forms: {FORMS}")
    whole = transport.size() == transport.world_size()
    if whole and can_make_process_sets(topo.local_groups() + topo.cross_groups()):
        return topo
    if topology is None:
        return Topology(topo.world, topo.world)
    why = (f"on Horovod it runs on the whole job (process_set of {transport.size()} of {transport.world_size()} "
           "ranks here)" if not whole else
           "on Horovod it needs the node and cross-node process sets: call hvdcompress.torch.init() instead of "
           "hvd.init() (it registers the launcher's), or hvd.init(process_sets='dynamic') / "
           "HOROVOD_DYNAMIC_PROCESS_SETS=1 (any topology)")
    raise ValueError(f"topology={topology!r}: a two-level exchange {why}; accepted here: topology='flat' or None. "
                     f"Forms: {FORMS}")


def _whole_job(transport) -> bool:
    """Whether ``transport`` spans the whole job (the launcher's layout describes its ranks)."""
    group = getattr(transport, "group", None)
    if group is None:
        return True
    import torch.distributed as dist
    return transport.size() == dist.get_world_size()
