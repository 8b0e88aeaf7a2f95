"""Keras callbacks: sparsity warm-up and compression statistics.

``SparsityWarmupCallback`` sets the density at the start of every epoch from the warm-up schedule
of ``hvdcompress.warmup`` (exponential decay to the target over the first epochs):

    density(e) = target ** ((e + 1) / (W + 1))  for e < W,   target  for e >= W

or an explicit list of warm-up densities. For DGC the schedule is the spec's own (warmup_epochs,
warmup_schedule); for top-k / random-k give ``warmup_epochs`` (or ``warmup_schedule``) here, and
the target is the spec's ratio. Every rank runs the callback, so every rank changes the density
at the same step.

``CompressionStatsCallback`` adds the measured figures of each epoch to the Keras logs (so
``History``, ``TensorBoard`` and ``CSVLogger`` placed after it record them):

    wire_bytes_per_step    bytes this rank handed to the collectives per step (mean over the epoch)
    dense_bytes_per_step   what dense allreduce would have sent
    compression_ratio      dense / wire
    density                the density in effect (ratio-based compressors)
    groups_spec, groups_fp16, groups_dense
                           how many groups the latest exchange sent with the spec, fp16, dense

and ``decisions()`` says per group what was sent and the cost model's predicted times
(``hvdcompress.schedule.explain``). TensorFlow's per-group codec choice is off by default (it is
not checked by measurement there): every group is sent with the spec unless ``codec_choice="auto"``.

``DelayedAveragingFlushCallback`` (delayed averaging, ``tf_ops.delayed``) calls the optimizer's
``flush()`` before every evaluation (``on_test_begin``: ``evaluate`` and ``fit``'s validation), at the
end of every epoch and at the end of training, so replicas are identical whenever they are
evaluated or saved between epochs; with no training step since the last flush it does nothing.
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from hvdcompress.spec import names_with_param
from hvdcompress.warmup import density_at, warmup_densities

from .compression import GradientCompression

_ANY_TARGET = 5e-324  # the smallest positive float: lets the core check a schedule before the target is known


def _compression_of(callback, given: Optional[GradientCompression]) -> GradientCompression:
    if given is not None:
        return given
    found = getattr(getattr(callback.model, "optimizer", None), "gradient_compression", None)
    if not isinstance(found, GradientCompression):
        raise ValueError(f"{type(callback).__name__}: the model's optimizer is not an hvdcompress "
                         "DistributedOptimizer; wrap it, or pass compression=<GradientCompression>")
    return found


class SparsityWarmupCallback(tf.keras.callbacks.Callback):
    """Density warm-up per epoch (see module doc).

    Args:
        warmup_epochs: epochs of falling density (>= 0); None: the spec's own warm-up (DGC).
        warmup_schedule: explicit warm-up densities, one per epoch, decreasing, above the target.
        compression: the ``GradientCompression`` to drive (default: the model optimizer's).
        verbose: 1 prints the density at each epoch start (rank 0 prints if all ranks do).
    """

    def __init__(self, warmup_epochs: Optional[int] = None, warmup_schedule: Optional[Sequence[float]] = None,
                 compression: Optional[GradientCompression] = None, verbose: int = 0):
        super().__init__()
        if warmup_epochs is not None and (isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int)
                                          or warmup_epochs < 0):
            raise ValueError(f"warmup_epochs: must be an int >= 0 or None; got {warmup_epochs!r}")
        if warmup_schedule is not None:
            warmup_schedule = tuple(warmup_schedule)
            # the schedule's own rules (in (0, 1], decreasing, one per epoch), whatever the target
            warmup_densities(_ANY_TARGET, warmup_epochs or 0, warmup_schedule)
        if compression is not None and not isinstance(compression, GradientCompression):
            raise ValueError(f"compression: expected a GradientCompression; got {compression!r}")
        self.warmup_epochs = warmup_epochs
        self.warmup_schedule = warmup_schedule
        self._given = compression
        self.verbose = verbose

    def _own_schedule(self) -> bool:
        return self.warmup_epochs is not None or self.warmup_schedule is not None

    def on_train_begin(self, logs=None):
        comp = _compression_of(self, self._given)
        if comp.density is None:
            raise ValueError(f"SparsityWarmupCallback: compression '{comp.compression}' has no density "
                             f"to warm up (use one with a 'ratio': {', '.join(names_with_param('ratio'))})")
        if self._own_schedule():  # checked against the target before the first step
            warmup_densities(comp.compression["ratio"], self.warmup_epochs or 0, self.warmup_schedule)
        elif not comp.compressor.has_schedule:
            raise ValueError(f"SparsityWarmupCallback: compression '{comp.compression}' has no warm-up of "
                             "its own; give warmup_epochs (or warmup_schedule)")

    def density_for(self, epoch: int, comp: GradientCompression) -> float:
        if self._own_schedule():
            return density_at(epoch, comp.compression["ratio"], self.warmup_epochs or 0, self.warmup_schedule)
        return comp.compressor.scheduled_density(epoch)

    def on_epoch_begin(self, epoch, logs=None):
        comp = _compression_of(self, self._given)
        comp.set_epoch(epoch)
        comp.density = self.density_for(epoch, comp)
        if self.verbose:
            print(f"\nEpoch {epoch + 1}: gradient density {comp.density:.6g}")


class CompressionStatsCallback(tf.keras.callbacks.Callback):
    """Adds wire_bytes_per_step, dense_bytes_per_step, compression_ratio, density to epoch logs."""

    def __init__(self, compression: Optional[GradientCompression] = None, prefix: str = ""):
        super().__init__()
        if compression is not None and not isinstance(compression, GradientCompression):
            raise ValueError(f"compression: expected a GradientCompression; got {compression!r}")
        self._given = compression
        self.prefix = prefix
        self._start = None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = _compression_of(self, self._given).stats

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        comp = _compression_of(self, self._given)
        now = comp.stats
        start = self._start
        steps = now.steps - (start.steps if start else 0)
        wire = now.total_bytes - (start.total_bytes if start else 0)
        dense = now.total_dense_bytes - (start.total_dense_bytes if start else 0)
        p = self.prefix
        logs[p + "wire_bytes_per_step"] = wire / steps if steps else 0.0
        logs[p + "dense_bytes_per_step"] = dense / steps if steps else 0.0
        logs[p + "compression_ratio"] = dense / wire if wire else float("inf")
        if comp.density is not None:
            logs[p + "density"] = comp.density
        for kind, n in self.decisions().counts().items():
            logs[p + "groups_" + kind] = n

    def decisions(self):
        """Per group of the latest traced exchange, what it was sent with and the predicted seconds
        of each option (``hvdcompress.schedule.explain.Decisions``; ``.lines()`` prints it). Group
        members are named by the model's trainable variables where the positions match them."""
        from hvdcompress.schedule.explain import explain_groups

        comp = _compression_of(self, self._given)
        groups, plan = comp.groups or [], comp.plan
        variables = list(getattr(self.model, "trainable_variables", None) or [])
        codec_of = {}
        if plan is not None and plan.codecs is not None:  # plan groups index present gradients, reversed
            order = sorted({q for g in groups for q in g}, reverse=True)
            for pg, codec in zip(plan.groups, plan.codecs):
                for i in pg:
                    if i < len(order):
                        codec_of[order[i]] = codec

        def name(q):
            return variables[q].name if q < len(variables) else f"gradient {q}"

        def nbytes(q):
            if q >= len(variables) or variables[q].shape.num_elements() is None:
                return 0.0
            return float(variables[q].shape.num_elements() * variables[q].dtype.size)

        return explain_groups([[name(q) for q in g] for g in groups], [sum(nbytes(q) for q in g) for g in groups],
                              [codec_of.get(g[0]) if g else None for g in groups], comp.compression,
                              comp.cost_model, None, "auto" if codec_of else "off",
                              predicted_seconds=None if plan is None else plan.predicted_seconds)


class DelayedAveragingFlushCallback(tf.keras.callbacks.Callback):
    """Flushes delayed averaging (``optimizer.flush()``) before evaluations and at epoch ends (see
    module doc). Every rank must run it (it averages the variables over the ranks).

    Args:
        at_epoch_end: also flush at the end of every epoch (default True); False flushes only
            before evaluations and at the end of training.
    """

    def __init__(self, at_epoch_end: bool = True):
        super().__init__()
        if not isinstance(at_epoch_end, bool):
            raise ValueError(f"at_epoch_end: must be True or False; got {at_epoch_end!r}")
        self.at_epoch_end = at_epoch_end
        self._dirty = False  # a training step ran since the last flush
        self.flushes = 0

    def _optimizer(self):
        opt = getattr(self.model, "optimizer", None)
        if not callable(getattr(opt, "flush", None)) or not isinstance(
                getattr(opt, "gradient_compression", None), GradientCompression):
            raise ValueError("DelayedAveragingFlushCallback: the model's optimizer is not an hvdcompress "
                             "DistributedOptimizer")
        return opt

    def _flush(self):
        if self._dirty:
            self._optimizer().flush()
            self.flushes += 1
            self._dirty = False

    def on_train_begin(self, logs=None):
        self._optimizer()

    def on_train_batch_end(self, batch, logs=None):
        self._dirty = True

    def on_test_begin(self, logs=None):
        self._flush()

    def on_epoch_end(self, epoch, logs=None):
        if self.at_epoch_end:
            self._flush()

    def on_train_end(self, logs=None):
        self._flush()
