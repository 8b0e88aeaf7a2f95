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

Both are ``tf.cond`` on the summed flag, so a finite step reads nothing more than the gradient
(its sum; the elementwise ``is_finite`` check only when the sum is not finite). Under
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


def _flag(x: tf.Tensor) -> tf.Tensor:
    """[1.0] if ``x`` has a non-finite entry, else [0.0] (float32, shape (1,))."""
    if not x.dtype.is_floating:
        return tf.zeros([1], tf.float32)
    # a NaN/inf entry makes the sum non-finite: a finite sum (one read) proves there is none, and
    # only a non-finite one (a bad entry, or an overflowing sum) pays for the elementwise check
    def exact():
        return tf.reshape(tf.cast(tf.logical_not(tf.reduce_all(tf.math.is_finite(x))), tf.float32), [1])
    return tf.cond(tf.math.is_finite(tf.reduce_sum(x)), lambda: tf.zeros([1], tf.float32), exact)


def _zero_non_finite(state: Dict[str, tf.Variable]) -> tf.Tensor:
    ops = []
    for v in state.values():
        if v.dtype.is_floating:
            value = v.read_value()
            ops.append(v.assign(tf.where(tf.math.is_finite(value), value, tf.zeros_like(value))).op)
    with tf.control_dependencies(ops):
        return tf.constant(True)


def _state_flag(state: Dict[str, tf.Variable], restored) -> tf.Tensor:
    """[1.0] if a restore is pending (``restored``) and the state has a non-finite entry, else [0.0];
    the state is read only when a restore is pending."""
    floats = [v for v in state.values() if v.dtype.is_floating]
    if restored is None or not floats:
        return tf.zeros([1], tf.float32)

    def read():
        bad = tf.logical_not(tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in floats]))
        return tf.reshape(tf.cast(bad, tf.float32), [1])
    return tf.cond(restored, read, lambda: tf.zeros([1], tf.float32))


def guard(gen, x: tf.Tensor, state: Dict[str, tf.Variable], restored=None, where: str = "a gradient"):
    """Wrap an exchange generator (see the module doc); the same results when every rank is finite.
    ``restored``: a bool tensor, True on the first exchange after a checkpoint restore (then the
    state's finiteness travels in the flag too, and a non-finite state fails the exchange on every
    rank, naming ``where`` and the state)."""
    try:
        first = next(gen)
    except StopIteration as stop:  # an exchange without collectives: nothing to guard
        return stop.value
    results = yield tuple(first) + (Flag(tf.concat([_flag(x), _state_flag(state, restored)], 0)),)
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
    deps = [refused]
    if state:
        deps.append(tf.cond(flagged, lambda: _zero_non_finite(state), lambda: tf.constant(False)))
    with tf.control_dependencies(deps):
        out = tf.identity(out)
    return tf.cond(flagged, lambda: tf.fill(tf.shape(out), tf.constant(float("nan"), out.dtype)), lambda: out)


class RestoreMarker(trackable.Trackable):
    """Saved with a ``GradientCompression``; restoring it sets ``pending`` (not itself saved), so
    the next exchange checks that the restored state is finite (``check_restored``)."""

    def __init__(self):
        with tf.init_scope():
            self._holder = [tf.Variable(False, trainable=False, name="restored_state_unchecked")]

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
