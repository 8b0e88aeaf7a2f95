"""The per-gradient state of ``GradientCompression``: its slot variables, the working state of
merged groups, and the density of each exchange (DGC's warm-up).

``slots[i]`` is a dict of flat variables for the i-th gradient of the list (the residual; DGC's
``u`` and ``v``), created zero the first time the gradient is seen and checkpointed with the
object. A merged group works on group-sized scratch variables joined from its members' slots
(``grouping.join_state``; split back after the exchange), kept per process, not checkpointed.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Sequence, Tuple

import tensorflow as tf

from .grouping import Group, join_state, member_slots


def ensure_slots(compressor, slots: List[Dict[str, tf.Variable]], grads, groups: Sequence[Group],
                 prefix: str) -> None:
    """Create the slots every member of ``groups`` needs (appending a dict per new position);
    a ValueError if an existing slot has another size or dtype (state of another model)."""
    for _ in range(len(slots), len(grads)):
        slots.append({})
    for group in groups:
        for i in group.positions:
            g = grads[i]
            shape = tuple(g.shape)
            mine = slots[i]
            for name in member_slots(compressor, group, shape):
                var = mine.get(name)
                numel = compressor.slot_numel(name, shape)
                if var is None:
                    mine[name] = compressor.make_slot(name, numel, g.dtype, f"{prefix}_{i}_{name}")
                elif tuple(var.shape) != (numel,) or var.dtype != g.dtype:
                    raise ValueError(
                        f"compression state: gradient {i} needs {numel} elements of {g.dtype.name}, its "
                        f"state '{name}' has {var.shape.num_elements()} of {var.dtype.name}; one "
                        "GradientCompression serves one list of variables (a checkpoint of another model?)")


def group_state(compressor, slots: List[Dict[str, tf.Variable]], scratch: Dict[tuple, tf.Variable],
                group: Group, prefix: str) -> Dict[str, tf.Variable]:
    """The state the compressor works on: the member's slots for a group of one; for a merged
    group, group-sized working variables (kept in ``scratch``) joined from the members' slots."""
    if len(group.positions) == 1:
        return slots[group.positions[0]]
    names = group_slot_names(compressor, slots, group)
    dtype = next((slots[i][names[0]].dtype for i in group.positions if names[0] in slots[i]), None) if names else None
    work = {}
    for name in names:
        key = (group.key, name, group.numel, dtype)
        if key not in scratch:
            scratch[key] = compressor.make_slot(name, group.numel, dtype, f"{prefix}_group_{group.op_name}_{name}")
        work[name] = scratch[key]
    return join_state(group, [slots[i] for i in group.positions], names, work)


def group_slot_names(compressor, slots: List[Dict[str, tf.Variable]], group: Group) -> Tuple[str, ...]:
    """The state names a merged group works on: what the compressor keeps for the group's shape
    and, when the plan sends the group with fp16 or dense (``group.codec``), every elementwise
    entry (one per element of its member) a member keeps, so the fallback's ``dense_send`` sends
    and zeroes it. A compressor that never merges (PowerSGD) keeps nothing for a merged shape: its
    members' residuals go with the group, while their ``q`` (shaped by the tensor) stays in its
    slot, untouched, for when the member is sent alone again."""
    names = list(compressor.state_slots(group.shape))
    if group.codec is not None:
        for i, shape, numel in zip(group.positions, group.shapes, group.numels):
            names += [k for k in slots[i] if k not in names and compressor.slot_numel(k, shape) == numel]
    return tuple(names)


def step_density(compressor, spec, density: tf.Variable, epoch_set: tf.Variable, step,
                 warned: bool) -> Tuple[bool, tf.Tensor]:
    """(warned, the density of this exchange): the variable set_epoch / the warm-up callback
    move, or, when set_epoch was never called and the compressor warms up, the warm-up's density
    for epoch ``step // warmup_epoch_steps`` (also written to the variable, so ``density`` and the
    stats callback report what is used). Warns once (``warned`` says it did) that epochs are
    then counted in steps."""
    steps = compressor.warmup_epoch_steps
    if steps is None:
        return warned, density.read_value()
    warm = int(spec["warmup_epochs"])
    if not warned and not bool(epoch_set.numpy() if tf.executing_eagerly() else False):
        warned = True
        warnings.warn(f"hvdcompress: compression '{spec.name}' warms its density up over epochs; "
                      f"unless set_epoch() is called (SparsityWarmupCallback does it for fit), epochs of "
                      f"{steps} steps are counted (the spec's warmup_epoch_steps)")
    table = tf.constant([compressor.scheduled_density(e) for e in range(warm + 1)], tf.float64)
    auto = tf.gather(table, tf.minimum(step // steps, warm))
    value = tf.where(epoch_set.read_value(), density.read_value(), auto)
    with tf.control_dependencies([density.assign(value)]):
        return warned, tf.identity(value)
