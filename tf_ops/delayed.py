"""Delayed gradient averaging and temporal sparsity (Zhu et al., "Delayed Gradient Averaging",
NeurIPS 2021) for TensorFlow: ``delay=D`` and ``sync_every=K`` of ``GradientCompression``,
``DistributedGradientTape`` and the Keras ``DistributedOptimizer``. The arithmetic is the one of
``torch_ops.delayed``; the gradient handed to the optimizer at step i on worker j is

    d_i,j = g_i,j * f - g_(i-D),j * f + R_(i-D)      (the last two terms once step i-D exchanged)

where g_t,j is the local term worker j put into the exchange of step t, R_t the exchanged (and
decompressed) result, and f the averaging factor that puts the local term in the result's units
(1 for ``op=Average``, N for ``Sum``; ``prescale * scale * N`` in general). Unrolled, plain SGD gives
``w_n,j = w_0 - lr*sum_(t<=n-D) R_t - lr*sum_(n-D<t<=n) g_t,j``. D = 0 and K = 1 do not come here
at all: they take the ``Synchronous`` policy (``tf_ops.policy``), the plain exchange, bit for bit.

With ``sync_every=K`` a worker exchanges once every K steps: on the other steps it applies its
local gradient (times f) and adds it to an accumulator; on every K-th step it exchanges the
accumulated sum A (this step included) and the correction ``R - A*f`` enters the gradient D steps
later (at once when D = 0). The decision is a ``tf.cond`` on a step counter, identical on every
rank, so every rank enters the collectives on the same step.

**TensorFlow differs from PyTorch in the latency, not the arithmetic.** Horovod's TensorFlow
collectives inside a ``tf.function`` complete within the step that issues them, so the exchange
of step i runs (and is waited for) in step i; only its *correction* ``R_i - local_i * f`` is kept
back, in per-gradient-position ring-buffer variables of D flat slots, and added to the gradient
of step i+D. The training trajectory is the paper's (and PyTorch's), but the link latency is not
overlapped with computation as PyTorch's async handles overlap it across steps; ``sync_every=K``
does save K-1 of every K exchanges.

How compressors compose (as on PyTorch, ``torch_ops.delayed``): the compressor exchanges the
local gradient exactly as it would synchronously (error feedback, DGC's momenta and the sketch's
memories see one exchange per K steps); R is its decompressed result. The local term is the
uncompressed gradient, except for compressors that keep the momentum in their memory (DGC, the
count sketch: ``Compressor.local_momentum``), whose R is a velocity: their local term is the local
velocity ``u <- m*u + g`` (Nesterov ``g + m*u``) of a per-position variable ``vel[i]``, so the
local steps move like local momentum SGD and the correction swaps them for the exchanged velocity
(with raw gradients as local terms, DGC 0.1% with D=4 lost about 49 pp on digits). A non-finite
gradient reaches this worker's step at once through its local term and every worker's D steps
later through the (guarded, NaN) correction; the velocity keeps no non-finite entry. Learning rate: a correction is part of the gradient of the step it is added to, so it
is applied with that step's learning rate (as in the paper).

State (all ``tf.Variable``s, tracked by ``tf.train.Checkpoint`` through the
``GradientCompression``, and by ``model.save_weights`` through the Keras optimizer):

    calls        steps taken (exchanging or not); picks the ring slot and the exchanging step
    config       [D, K], checked against the object's own before any collective
    ring[i]      [D, numel_i]: corrections of the last D steps of gradient position i (D > 0)
    acc[i]       [numel_i]: local gradients accumulated since the last exchange (K > 1)
    vel[i]       [numel_i]: the local velocity (compressors that keep the momentum)
    app[i]       [numel_i]: local terms applied since the last exchange (those, K > 1)

so a resumed run applies the same corrections at the same steps and continues bit for bit.

Flush: replicas differ by design in their last D local terms. ``flush_corrections`` exchanges
what temporal sparsity has only applied locally, and returns (and clears) every correction not yet
applied, summed per position; ``apply_and_average`` applies them as one more optimizer step and
then averages the variables and the optimizer's floating slot variables (momenta, Adam's moments)
over the ranks with ``hvd.allreduce`` (one each), so every rank holds identical values afterwards
(as ``torch_ops.delayed.average_over_ranks``). ``GradientCompression.flush(optimizer, variables)``
and the Keras optimizer's ``opt.flush()`` do both; ``DelayedAveragingFlushCallback`` calls
``opt.flush()`` before every evaluation (``on_test_begin``, so also before ``fit``'s validation)
and at the end of every epoch and of training.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from hvdcompress.delay import check_delay, check_sync_every

from .policy import PolicyHost, SyncPolicy
from .variables import state_variable


class DelayedAveraging(tf.Module, SyncPolicy):
    """The sync policy of delayed / temporally sparse exchanges (``tf_ops.policy``): its state and
    arithmetic (module doc). The ``GradientCompression`` owning it does the exchanges; this decides
    what is applied when."""

    active = True
    sparse_exchanges = False  # corrections are dense: sparse gradients are densified first

    def __init__(self, delay: int, sync_every: int, name: str = "delayed",
                 momentum: Optional[Tuple[float, bool]] = None):
        super().__init__(name=name)
        self.delay = check_delay(delay)
        self.every = check_sync_every(sync_every)
        self.momentum = momentum  # (m, nesterov): the local term is a local velocity (module doc)
        self.calls = state_variable(0, dtype=tf.int64, trainable=False, name="calls")
        self.config = state_variable([self.delay, self.every], dtype=tf.int64, trainable=False, name="config")
        self.ring: List[Optional[tf.Variable]] = []
        self.acc: List[Optional[tf.Variable]] = []
        self.vel: List[Optional[tf.Variable]] = []
        self.app: List[Optional[tf.Variable]] = []

    def _check_config(self) -> None:
        with tf.init_scope():
            saved = [int(v) for v in self.config.numpy()]
        if saved != [self.delay, self.every]:
            raise ValueError(f"delay/sync_every: the restored state was saved with delay={saved[0]}, "
                             f"sync_every={saved[1]}; this object uses delay={self.delay}, "
                             f"sync_every={self.every}")

    def _ensure(self, grads: Sequence[Optional[tf.Tensor]]) -> None:
        self._check_config()  # a checkpoint of another D/K raises before any variable or collective
        for i, g in enumerate(grads):
            if i == len(self.ring):
                for store in (self.ring, self.acc, self.vel, self.app):
                    store.append(None)
            if g is None:
                continue
            n = g.shape.num_elements()
            stores = ((self.ring, [self.delay, n], "ring", self.delay > 0), (self.acc, [n], "acc", self.every > 1),
                      (self.vel, [n], "vel", self.momentum is not None),
                      (self.app, [n], "app", self.momentum is not None and self.every > 1))
            for store, shape, label, needed in stores:
                if not needed:
                    continue
                var = store[i]
                if var is None:
                    store[i] = state_variable(lambda: tf.zeros(shape, g.dtype), trainable=False, name=f"{label}_{i}")
                elif var.shape.as_list() != shape or var.dtype != g.dtype:
                    raise ValueError(f"delayed averaging state: gradient {i} needs {label} {shape} of "
                                     f"{g.dtype.name}, it has {var.shape.as_list()} of {var.dtype.name}; one "
                                     "GradientCompression serves one list of variables")

    # Control flow here is explicit (tf.cond); not converting by autograph saves seconds of tracing,
    # and the exchange path below runs without autograph (every compressor is written for that).
    @tf.autograph.experimental.do_not_convert
    def step(self, host: PolicyHost, grads: Sequence[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        """One training step: returns ``g * f + correction due now`` per gradient (None stays
        None), f being ``host.factor``; ``host.exchange`` is the synchronous compressed exchange."""
        exchange, factor = host.exchange, host.factor
        grads = list(grads)
        self._ensure(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        flat = {i: tf.reshape(grads[i], [-1]) for i in present}
        calls = self.calls.read_value()

        def scaled(t):
            return t * tf.cast(factor, t.dtype) if factor != 1.0 else t

        part = dict(flat)  # this step's local term: the gradient, or the local velocity
        if self.momentum is not None:
            m, nesterov = self.momentum
            for i in present:
                u = self.vel[i].read_value() * tf.cast(m, flat[i].dtype) + flat[i]
                self.vel[i].assign(tf.where(tf.math.is_finite(u), u, tf.zeros_like(u)))  # applied, never kept
                part[i] = flat[i] + u * tf.cast(m, u.dtype) if nesterov else u

        def corrections_of(sent, applied):  # exchange the local gradients; R - applied * f per position
            full: List[Optional[tf.Tensor]] = [None] * len(grads)
            for i in present:
                full[i] = tf.reshape(sent[i], grads[i].shape)
            results = exchange(full)
            return [tf.reshape(results[i], [-1]) - scaled(applied[i]) for i in present]

        if self.every == 1:
            corr = corrections_of(flat, part)
        else:
            local = {i: flat[i] + self.acc[i].read_value() for i in present}
            applied = ({i: part[i] + self.app[i].read_value() for i in present}
                       if self.momentum is not None else local)
            exchanging = tf.equal((calls + 1) % self.every, 0)
            corr = tf.cond(exchanging, lambda: corrections_of(local, applied),
                           lambda: [tf.zeros_like(local[i]) for i in present])
            for i in present:  # the local gradients join the next exchange; an exchange empties the sums
                self.acc[i].assign(tf.where(exchanging, tf.zeros_like(local[i]), local[i]))
                if self.momentum is not None:
                    self.app[i].assign(tf.where(exchanging, tf.zeros_like(applied[i]), applied[i]))
        out: List[Optional[tf.Tensor]] = [None] * len(grads)
        slot = calls % self.delay if self.delay else None
        for i, c in zip(present, corr):
            if self.delay:
                due = tf.gather(self.ring[i], slot)  # written D steps ago (zeros before that)
                self.ring[i].scatter_update(tf.IndexedSlices(c[None], slot[None]))
            else:
                due = c
            out[i] = tf.reshape(scaled(part[i]) + due, grads[i].shape)
        self.calls.assign_add(1)
        return out

    @tf.autograph.experimental.do_not_convert
    def pending(self, host: PolicyHost) -> List[Optional[tf.Tensor]]:
        """Flush: exchange what temporal sparsity accumulated (if anything), and return every
        correction not yet applied, summed per position (None where no gradient was seen); the
        ring and the accumulators are cleared."""
        exchange, factor = host.exchange, host.factor
        n = max(len(self.ring), len(self.acc))
        present = [i for i in range(n) if (self.ring[i] is not None or self.acc[i] is not None)]
        out: List[Optional[tf.Tensor]] = [None] * n
        if not present:
            return out
        sums = {}
        for i in present:
            if self.delay:
                sums[i] = tf.reduce_sum(self.ring[i].read_value(), axis=0)
                self.ring[i].assign(tf.zeros_like(self.ring[i]))
        if self.every > 1:
            acc = {i: self.acc[i].read_value() for i in present}
            applied = {i: self.app[i].read_value() for i in present} if self.momentum is not None else acc

            def sync():
                full: List[Optional[tf.Tensor]] = [None] * n
                for i in present:
                    full[i] = acc[i]
                results = exchange(full)
                return [tf.reshape(results[i], [-1]) - (applied[i] * tf.cast(factor, applied[i].dtype)
                                                        if factor != 1.0 else applied[i]) for i in present]

            unsent = tf.not_equal(self.calls.read_value() % self.every, 0)
            corr = tf.cond(unsent, sync, lambda: [tf.zeros_like(acc[i]) for i in present])
            for i, c in zip(present, corr):
                sums[i] = sums[i] + c if i in sums else c
                self.acc[i].assign(tf.zeros_like(self.acc[i]))
                if self.momentum is not None:
                    self.app[i].assign(tf.zeros_like(self.app[i]))
        for i in present:
            out[i] = sums[i]
        return out

    def finish_flush(self, host, corrections, variables, optimizer, apply_gradients) -> None:
        """Apply the corrections as one more optimizer step, then average the variables and the
        optimizer's state over the ranks (``apply_and_average``)."""
        apply_and_average(corrections, variables, optimizer, apply_gradients, host.process_set, host.name)


def optimizer_slot_variables(optimizer) -> List[tf.Variable]:
    """The optimizer's floating state variables (momenta, Adam's moments): Keras 2.11+ optimizers
    list them in ``variables`` (beside the int ``iterations``), legacy ones in ``variables()``."""
    found = getattr(optimizer, "variables", None)
    if callable(found):
        found = found()
    return [v for v in (found or []) if v.dtype.is_floating]


def average_over_ranks(variables: Sequence[tf.Variable], optimizer, process_set, name: str) -> None:
    """Average ``variables`` and the optimizer's floating slot variables over the process set's
    ranks, in place (one ``hvd.allreduce`` each): every rank holds identical values afterwards."""
    import horovod.tensorflow as hvd

    ps = hvd.global_process_set if process_set is None else process_set
    slots = optimizer_slot_variables(optimizer) if optimizer is not None else []
    for label, group in (("p", list(variables)), ("s", slots)):
        for k, v in enumerate(group):
            v.assign(hvd.allreduce(tf.convert_to_tensor(v), op=hvd.Average, name=f"{name}.{label}{k}",
                                   process_set=ps))


def apply_and_average(corrections: Sequence[Optional[tf.Tensor]], variables: Sequence[tf.Variable], optimizer,
                      apply_gradients, process_set, name: str) -> None:
    """Apply the flushed ``corrections`` (per position of ``variables``; None: a zero gradient) as one
    more optimizer step through ``apply_gradients`` (a list of (gradient, variable) pairs), then
    average the variables and the optimizer's state over the ranks (module doc)."""
    variables = list(variables)
    corrections = list(corrections) + [None] * (len(variables) - len(corrections))
    if len(corrections) != len(variables):
        raise ValueError(f"flush: the exchanges had {len(corrections)} gradients, {len(variables)} variables "
                         "were given; pass the variables in the order their gradients were exchanged")
    pairs = []
    for i, (c, v) in enumerate(zip(corrections, variables)):
        if c is not None and c.shape.num_elements() != v.shape.num_elements():
            raise ValueError(f"flush: variable {i} has shape {tuple(v.shape)}, its pending correction "
                             f"{c.shape.num_elements()} elements; pass the variables in exchange order")
        pairs.append((tf.zeros_like(v) if c is None else tf.reshape(tf.cast(c, v.dtype), v.shape), v))
    apply_gradients(pairs)
    average_over_ranks(variables, optimizer, process_set, name)


__all__ = ["DelayedAveraging", "apply_and_average", "average_over_ranks", "check_delay", "check_sync_every",
           "optimizer_slot_variables"]
