"""Non-finite gradients are never hidden, on TensorFlow (the rule of ``torch_ops.nonfinite``).

A sparsifier never selects NaN, a quantizer's sign of NaN is a bit like any other, random-k may
not sample it: any compressor can turn a non-finite gradient into a finite exchanged result and
keep the bad value in its state forever. Keras' ``LossScaleOptimizer`` (mixed precision) and the
usual "skip the step if a gradient is not finite" check rely on every non-finite value reaching
the exchanged gradient, as it does with Horovod's dense allreduce. So ``GradientCompression``
wraps every group's exchange (``guard``): its first round carries a flag (two floats, 8 bytes),
the first 1 if this rank's gradient of the group has a non-finite entry (summed by allreduce; Horovod fuses it with
the round's other collectives), and when any rank flagged one,

- the exchanged result of the group is NaN everywhere on every rank, and
- every non-finite entry of the group's compression state (residuals, momenta, sketch errors,
  PowerSGD's factors) is set to 0 on every rank; the finite rest of that step's compensation
  stays, as after any step. Nothing non-finite is ever kept.

Both happen in one branch of a ``tf.cond`` on the summed flag, and the flag itself is one
``tf.cond``, so a finite step reads nothing more than the gradient (its sum; the elementwise
``is_finite`` checks only when the sum is not finite or a restore is pending), and a traced step
pays for two conditionals per exchange (each traces two branch functions). Under
``tf.function`` the guard's state assignments follow the compressor's own (automatic control
dependencies order ops on the same variable).

A checkpoint whose compression state holds NaN/inf is refused: restoring one marks the state
(``RestoreMarker``, saved with the ``GradientCompression``), and the first exchange after the
restore reads every slot it uses and sends whether one is non-finite in the same flag (two
floats per group), so the exchange fails on *every* rank (residuals differ per rank: a check of
the local state alone would fail one rank and leave the others waiting in a collective), with
``tf.errors.InvalidArgumentError`` naming the state and the gradient positions. Restore happens
slot by slot, possibly before the slots exist, so the check waits for the exchange that uses
them.
"""

from __future__ import annotations

from typing import Dict

import tensorflow as tf
from tensorflow.python.trackable import base as trackable

from .collectives import Flag
from .variables import state_variable


def _zero_non_finite(state: Dict[str, tf.Variable]) -> tf.Tensor:
    ops = []
    for v in state.values():
        if v.dtype.is_floating:
            value = v.read_value()
            ops.append(v.assign(tf.where(tf.math.is_finite(value), value, tf.zeros_like(value))).op)
    with tf.control_dependencies(ops):
        return tf.constant(True)


def _flags(x: tf.Tensor, state: Dict[str, tf.Variable], restored) -> tf.Tensor:
    """[1.0 if ``x`` has a non-finite entry, 1.0 if a restore is pending (``restored``) and the state
    has a non-finite entry] (float32, shape (2,)), else 0.0 in each place.

    One ``tf.cond``: a finite sum of ``x`` (one read) proves every entry finite, so a step with a
    finite sum and no restore pending reads nothing else; only a non-finite sum (a bad entry, or an
    overflowing sum) or a pending restore pays for the elementwise checks (of ``x`` and of the
    state)."""
    floats = [v for v in state.values() if v.dtype.is_floating] if restored is not None else []
    checked = x.dtype.is_floating
    if not checked and not floats:
        return tf.zeros([2], tf.float32)

    def exact():
        bad_x = tf.logical_not(tf.reduce_all(tf.math.is_finite(x))) if checked else tf.constant(False)
        bad_state = (tf.logical_and(restored, tf.logical_not(tf.reduce_all(
            [tf.reduce_all(tf.math.is_finite(v)) for v in floats]))) if floats else tf.constant(False))
        return tf.cast(tf.stack([bad_x, bad_state]), tf.float32)
    clean = tf.math.is_finite(tf.reduce_sum(x)) if checked else tf.constant(True)
    if floats:
        clean = tf.logical_and(clean, tf.logical_not(restored))
    return tf.cond(clean, lambda: tf.zeros([2], tf.float32), exact)


def _flag(x: tf.Tensor) -> tf.Tensor:
    """[1.0] if ``x`` has a non-finite entry, else [0.0] (float32, shape (1,)): ``_flags`` without state."""
    return _flags(x, {}, None)[:1]


def guard(gen, x: tf.Tensor, state: Dict[str, tf.Variable], restored=None, where: str = "a gradient"):
    """Wrap an exchange generator (see the module doc); the same results when every rank is finite.
    ``restored``: a bool tensor, True on the first exchange after a checkpoint restore (then the
    state's finiteness travels in the flag too, and a non-finite state fails the exchange on every
    rank, naming ``where`` and the state)."""
    try:
        first = next(gen)
    except StopIteration as stop:  # an exchange without collectives: nothing to guard
        return stop.value
    results = yield tuple(first) + (Flag(_flags(x, state, restored)),)
    flags = results[-1]
    flagged = flags[0] > 0
    names = ", ".join(f"'{n}'" for n, v in state.items() if v.dtype.is_floating)
    refused = tf.debugging.Assert(tf.equal(flags[1], 0), [
        f"hvdcompress: restored compression state ({names}) of {where} holds non-finite values (NaN or inf) "
        "on some rank; refusing to resume from it (a checkpoint saved after a diverged step?)"])
    results = tuple(results[:-1])
    while True:
        try:
            requests = gen.send(results)
        except StopIteration as stop:
            out = stop.value
            break
        results = yield requests
    with tf.control_dependencies([refused]):
        out = tf.identity(out)

    def poisoned():  # a rank flagged a non-finite value: the state's bad entries zeroed, the result NaN
        zeroed = [_zero_non_finite(state)] if state else []
        with tf.control_dependencies(zeroed):
            return tf.fill(tf.shape(out), tf.constant(float("nan"), out.dtype))
    return tf.cond(flagged, poisoned, lambda: out)


class RestoreMarker(trackable.Trackable):
    """Saved with a ``GradientCompression``; restoring it sets ``pending`` (not itself saved), so
    the next exchange checks that the restored state is finite (``check_restored``)."""

    def __init__(self):
        self._holder = [state_variable(False, trainable=False, name="restored_state_unchecked")]

    @property
    def pending(self) -> tf.Variable:
        return self._holder[0]

    def _serialize_to_tensors(self):
        return {"restored": tf.constant(True)}

    def _restore_from_tensors(self, restored_tensors):
        return self.pending.assign(True)

    def done(self, after) -> None:
        """The exchange that checked the restored state finished (``after``: its results)."""
        with tf.control_dependencies(list(after)):
            self.pending.assign(False)
