"""Merged-group schedules for the TensorFlow backend: which gradients ``GradientCompression``
compresses and exchanges together, and how a group's state is made of per-gradient slots.

``schedule`` (``GradientCompression(schedule=...)``; the tape and Keras wrappers pass it on):

    "layerwise" (default)  one exchange per gradient
    "single"               every gradient in one exchange
    "size:<MB>"            consecutive gradients join the open group while it stays <= MB MiB
    "mgs", "mgwfbp"        the partition into consecutive groups ``hvdcompress.schedule.planner.make_plan``
                           finds fastest under a cost model (":greedy": the papers' greedy rule);
    "auto"                 "mgs" for gathered compressors, "mgwfbp" for summed ones
    [[0, 1], [2, 3, 4]]    explicit groups of gradient positions (indices into the gradient list)

Why "layerwise" is the default here (the PyTorch optimizer defaults to "auto"): a tape hands over
all gradients at once, after backward, so there is no backward pass left to overlap with; merging
only saves per-exchange start-ups and per-tensor compression overhead, and changes what a
sparsifier selects (top-k of the group instead of per tensor). The cost-model schedules therefore
plan with t_b = 0 for every tensor: all gradients are ready at time 0 and the plan minimises
compression plus exchange time (compression on the compute stream, exchanges one after the other:
the planner's "shared" model). They need a ``cost_model`` (``hvdcompress.schedule.costmodel.CostModel``);
without one the cached fit for this world size and host set is used (``cached_cost_model``), and
without that a ValueError says how to get one.

Order: "consecutive" means consecutive in *reverse list order*, the order backward produces the
gradients of a sequential model (last layer first). Groups are listed and exchanged in that order
and a group's flat tensor concatenates its members in that order (highest position first), so
``single`` over gradients [g0, g1, g2] sends cat(g2, g1, g0). Explicit groups need not be
consecutive (every gradient is ready at once); positions no group names are exchanged alone, and
a position at or past the number of gradients raises when the exchange is built. Gradients that
are None are skipped (every rank has the same graph, so the same ones); a group whose members
differ in dtype is exchanged as runs of consecutive members of one dtype.

The compressor sees a merged group as one tensor whose shape (``Group.shape``) is ``(n,)`` when
every member is 1-D (or a scalar) and ``(1, n)`` otherwise, as in ``torch_ops.grouping``: per-tensor
rules such as DGC's "1-D tensors are sent dense" and its local clipping apply to the group as a
whole. State stays per gradient position (``GradientCompression.slots``): see ``join_state``.
"""

from __future__ import annotations

import operator
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from hvdcompress.schedule.costmodel import CostModel, cache_path
from hvdcompress.schedule.groups import MergedGroup
from hvdcompress.schedule.planner import COST_MODEL_SCHEDULES, Plan, Schedule, make_plan, parse_schedule

ACCEPTED = ("'layerwise' (default), 'single', 'size:<MB>' (e.g. 'size:64'), 'mgs' or 'mgwfbp' (either "
            "followed by ':greedy'; planned with a cost model), 'auto' (mgs for gathered compressors, "
            "mgwfbp for summed ones), or explicit groups of gradient positions such as [[0, 1], [2, 3]]")
Explicit = Tuple[Tuple[int, ...], ...]
ScheduleArg = Union[Schedule, Explicit]


# --- the schedule argument ------------------------------------------------------------------------
def check_schedule(schedule) -> ScheduleArg:
    """A parsed schedule string, or explicit groups as a tuple of tuples of positions; a
    ValueError naming ``schedule`` and the accepted forms otherwise. None means "layerwise"."""
    if schedule is None:
        return Schedule("layerwise")
    if isinstance(schedule, (str, Schedule)):
        try:
            return parse_schedule(schedule)
        except ValueError as exc:
            raise ValueError(f"{exc}. Accepted on TensorFlow: {ACCEPTED}") from None
    if isinstance(schedule, (list, tuple)) and schedule and all(isinstance(g, (list, tuple)) for g in schedule):
        groups, seen = [], {}
        for gi, group in enumerate(schedule):
            if not group:
                raise ValueError(f"schedule: group {gi} is empty; every group needs at least one gradient position")
            positions = []
            for p in group:
                try:
                    pos = operator.index(p) if not isinstance(p, bool) else -1
                except TypeError:
                    pos = -1
                if pos < 0:
                    raise ValueError(f"schedule: group {gi} holds {p!r}; explicit groups hold gradient "
                                     "positions (ints >= 0, indices into the gradient list)")
                if pos in seen:
                    raise ValueError(f"schedule: gradient position {pos} is in groups {seen[pos]} and {gi}; "
                                     "each position may be in one group only")
                seen[pos] = gi
                positions.append(pos)
            groups.append(tuple(positions))
        return tuple(groups)
    raise ValueError(f"schedule: expected a schedule string or a list of groups of gradient positions; "
                     f"got {schedule!r}. Accepted: {ACCEPTED}")


def schedule_text(schedule: ScheduleArg) -> str:
    """The schedule's string ("layerwise", "size:64", "mgs:greedy", ...), or "explicit"."""
    return str(schedule) if isinstance(schedule, Schedule) else "explicit"


def needs_cost_model(schedule: ScheduleArg) -> bool:
    return isinstance(schedule, Schedule) and schedule.kind in COST_MODEL_SCHEDULES + ("auto",)


def check_cost_model(model) -> Optional[CostModel]:
    if model is not None and not isinstance(model, CostModel):
        raise ValueError("cost_model: expected an hvdcompress.schedule.costmodel.CostModel or None (then the cached "
                         f"one for this world size and host set is used); got {type(model).__name__}")
    return model


def check_plannable(schedule: ScheduleArg, model: CostModel, spec, alternatives: Sequence[str] = ()) -> None:
    """Plan one dummy tensor now, so a cost model that cannot serve the schedule (e.g. "mgs"
    without a compression-time fit for the spec) raises at construction, not at the first step."""
    if isinstance(schedule, Schedule):
        make_plan(schedule, [4.0], [0.0], model, spec, alternatives=alternatives)


def cached_cost_model(world_size: int, process_set=None, use_horovod: bool = True) -> CostModel:
    """``CostModel.cached(world_size, hosts)`` identically on every rank, else a ValueError on every
    rank saying how to get one. On one host (``hvd.cross_size() == 1``, or Horovod not running)
    the host set is this host and no collective runs; across hosts the host names and the cached
    models are allgathered (one symmetric collective, so every rank takes the same decision, before
    any gradient is exchanged)."""
    name = socket.gethostname()
    hosts: Tuple[str, ...] = (name,)
    model = found = None
    hvd = None
    if use_horovod:
        import horovod.tensorflow as hvd
        if not hvd.is_initialized() or hvd.cross_size() == 1:
            hvd = None
    if hvd is None:
        model = CostModel.cached(world_size, hosts)
        found = [model is not None]
    else:
        ps = process_set if process_set is not None else hvd.global_process_set
        with tf.init_scope():  # eager, even while a tf.function is traced
            hosts = tuple(hvd.allgather_object(name, name="hvc.schedule.hosts", process_set=ps))
            mine = CostModel.cached(world_size, hosts)
            dicts = hvd.allgather_object(None if mine is None else mine.to_dict(), name="hvc.schedule.model",
                                         process_set=ps)
        found = [d is not None for d in dicts]
        model = CostModel.from_dict(dicts[0]) if all(found) else None
    if model is None:
        missing = "" if len(found) == 1 else f" (missing on ranks {[r for r, f in enumerate(found) if not f]})"
        raise ValueError(
            f"cost_model: the schedule needs a cost model, none was given and none is cached for {world_size} "
            f"ranks on hosts {sorted(set(hosts))}{missing}: looked for {cache_path(world_size, hosts)}. "
            "Pass cost_model=hvdcompress.schedule.costmodel.CostModel.from_link(world_size, gbit_per_s=..., "
            "latency_s=...), or profile one on these hosts: horovodrun -np N python -m hvdcompress.bench.profile transport "
            "--compression <spec> (it caches the fit), or use 'layerwise', 'single' or 'size:<MB>'")
    return model


# --- groups -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group(MergedGroup):
    """Gradient positions exchanged as one flat tensor, in concatenation order; ``key`` is the
    position for a group of one, else ``<first>+<n-1>``. ``codec``: "fp16" or "none" when the plan
    sends the group so instead of with the compressor (``tf_ops.codec_choice``), else None."""

    codec: Optional[str] = None

    @property
    def positions(self) -> Tuple[int, ...]:
        return self.members

    @property
    def op_name(self) -> str:
        """``key`` as a TensorFlow op name may spell it."""
        return self.key.replace("+", "-")


def make_groups(schedule: ScheduleArg, grads: Sequence[Optional[tf.Tensor]], spec, world_size: int,
                cost_model: Optional[CostModel], alternatives: Sequence[str] = ()) -> Tuple[List[Group], Optional[Plan]]:
    """The groups one exchange of ``grads`` uses (module doc), and the planner's ``Plan`` (its
    groups index the present gradients in reverse list order; None for explicit groups).
    ``alternatives``: specs a group may be sent with instead (the plan picks, ``Plan.codecs``)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    order = present[::-1]  # backward order
    plan = None
    if isinstance(schedule, tuple):
        for group in schedule:
            for p in group:
                if p >= len(grads):
                    raise ValueError(f"schedule: explicit groups name gradient position {p}, but the exchange "
                                     f"got {len(grads)} gradients (positions 0..{len(grads) - 1})")
        named = {p for group in schedule for p in group}
        chosen = [sorted((p for p in group if grads[p] is not None), reverse=True) for group in schedule]
        chosen += [[p] for p in order if p not in named]
        positions = sorted((g for g in chosen if g), key=lambda g: -g[0])
    elif not order:
        positions = []
    else:
        sizes = [grads[i].shape.num_elements() * grads[i].dtype.size for i in order]
        itemsize = grads[order[0]].dtype.size
        plan = make_plan(schedule, sizes, [0.0] * len(order), cost_model, spec, world_size, itemsize=itemsize,
                         alternatives=alternatives)
        positions = [[order[j] for j in group] for group in plan.groups]
    own = str(spec)
    codecs = [None] * len(positions) if plan is None or plan.codecs is None else \
        [None if c == own else c for c in plan.codecs]
    groups = []
    for members, codec in zip(positions, codecs):
        for run in _dtype_runs(members, grads):
            groups.append(Group(tuple(run), tuple(tuple(grads[p].shape) for p in run), codec))
    return groups, plan


def _dtype_runs(members: Sequence[int], grads) -> List[List[int]]:
    runs: List[List[int]] = []
    for p in members:
        if runs and grads[runs[-1][-1]].dtype == grads[p].dtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def flatten(grads: Sequence[tf.Tensor]) -> tf.Tensor:
    """The group's flat gradient (members in concatenation order)."""
    if len(grads) == 1:
        return tf.reshape(grads[0], [-1])
    return tf.concat([tf.reshape(g, [-1]) for g in grads], 0)


def split(flat: tf.Tensor, group: Group) -> List[tf.Tensor]:
    """The group's flat result -> one tensor per member, in its own shape."""
    if len(group.positions) == 1:
        return [tf.reshape(flat, group.shapes[0])]
    parts = tf.split(flat, list(group.numels))
    return [tf.reshape(t, s) for t, s in zip(parts, group.shapes)]


# --- state ----------------------------------------------------------------------------------------
def member_slots(compressor, group: Group, own_shape: Tuple[int, ...]) -> Tuple[str, ...]:
    """State a member keeps: what it needs alone plus what its group needs (a 1-D gradient in a
    sparsified DGC group also keeps a v), so its slots serve either grouping."""
    names = list(compressor.state_slots(own_shape))
    names += [n for n in compressor.state_slots(group.shape) if n not in names]
    return tuple(names)


def join_state(group: Group, slots: Sequence[Dict[str, tf.Variable]], names: Sequence[str],
               scratch: Dict[str, tf.Variable]) -> Dict[str, tf.Variable]:
    """A merged group's state: each ``scratch`` variable (group-sized, per state name) is assigned
    the concatenation of its members' slots, and is what the compressor reads and assigns.
    The members' slots stay the checkpointed state, so checkpoints do not depend on the grouping.
    A member without that slot (a bias under PowerSGD has no residual, yet its group, sent with
    fp16 or dense, carries the other members' residuals) is joined as zeros."""
    for name in names:
        var = scratch[name]
        parts = [s[name].read_value() if name in s else tf.zeros([n], var.dtype) for s, n in zip(slots, group.numels)]
        var.assign(tf.concat(parts, 0))
    return {name: scratch[name] for name in names}


def split_state(group: Group, slots: Sequence[Dict[str, tf.Variable]], state: Dict[str, tf.Variable]) -> None:
    """After the exchange: assign each member's slice of the group's state back to its slots
    (a member without that slot keeps none: its slice is dropped, see ``join_state``)."""
    for name, var in state.items():
        parts = tf.split(var.read_value(), list(group.numels))
        for s, part in zip(slots, parts):
            if name in s:
                s[name].assign(part)
