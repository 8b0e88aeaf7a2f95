"""Horovod Elastic with compressed exchanges (TensorFlow 2 / Keras).

Use ``hvc.elastic.KerasState`` (``import hvdcompress.keras as hvc``) or
``hvc.elastic.TensorFlowKerasState`` (``import hvdcompress.tensorflow as hvc``) where Horovod's
recipe has ``hvd.elastic.KerasState`` / ``hvd.elastic.TensorFlowKerasState``; they are subclasses
of those, and the rest of the recipe stays::

    opt = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), compression="topk:ratio=0.01")
    model.compile(optimizer=opt, loss=...)
    state = hvc.elastic.KerasState(model, batch=0)          # the optimizer: model.optimizer

    @hvc.elastic.run
    def train(state):
        ...                       # model.fit / train_on_batch; state.commit() now and then
    train(state)

With a tape, pass the ``GradientCompression`` the tape uses (made once) as ``compression=``, and
build the ``tf.function`` of the step *inside* the function ``run`` wraps, so that it is traced
again after every reset (the world size is part of a traced exchange; see below)::

    compression = hvc.GradientCompression("topk:ratio=0.01")
    state = hvc.elastic.TensorFlowKerasState(model, opt, compression=compression, step=0)

    @hvc.elastic.run
    def train(state):
        step_fn = tf.function(one_step)          # one_step uses hvc.DistributedGradientTape(..., compression=compression)
        ...

What a reset (a worker added or removed; ``run`` shuts Horovod down and initialises it again on
the new set of ranks) does to the compression state (``GradientCompression``: the Keras
optimizer's ``gradient_compression`` and any given as ``compression=``):

* **Commit** (``state.commit()``, and when the state is made or synced) snapshots, in host memory,
  this rank's compression variables: step counter, epoch, density, and every residual/momentum
  slot. **After a failure** (``HorovodInternalError``) they are restored from it together with the
  model and the optimizer (slots created after the snapshot go back to their initial value);
  after a host update (``HostsUpdatedInterrupt``) nothing rolls back, as in Horovod.
* **World size**: the Keras optimizer's averaging factor follows the new set of ranks, and the
  model's cached Keras train/test/predict functions are dropped so the next ``fit`` /
  ``train_on_batch`` traces the exchange for the new world size. A tape's exchange is traced
  inside the user's ``tf.function``, which only the user can trace again: a step traced for
  another world size stops with ``InvalidArgumentError`` saying so (a runtime check on Horovod's
  size, under elastic only), never a silently wrong average.
* **Sync** (every rank, new ones included): the model and the wrapped optimizer's variables come
  from rank 0 as in Horovod (a rank that has none yet builds them first, without a step); so do
  the exchange counter, epoch and density (they seed random-k's indices and DGC's sampling and set
  the warm-up's density, which must agree across ranks) and state that is the same on every rank
  by construction (PowerSGD's warm-started ``q``). Each rank keeps its **own** residuals and
  momenta: they are that rank's unsent gradient. A joining rank starts with none (its slots are
  created, zero, at its first exchange). The model check (same variables, shapes and dtypes on
  every rank) runs at each sync instead of when an exchange is first traced, since a joining rank
  traces while the others do not.
* **A rank that leaves takes its residuals with it: they are lost**, not flushed: a flush would
  need a collective among the old ranks when the change happens, which a failed worker cannot
  join and which Horovod's removal does not wait for. What is lost is that rank's delayed part of
  its past gradients (what error feedback had postponed, at most a bounded amount), like losing
  part of some of its mini-batches; the survivors' state is untouched.

Refused (``ValueError`` when the state is made, on every rank): delayed averaging
(``delay``/``sync_every``: corrections of exchanges among the old ranks),
``backward_passes_per_step`` > 1 (local sums and a pass counter that would disagree after a
reset), and schedules planned with a cost model (``mgs``/``mgwfbp``/``auto``: the plan is made for
one world size; use ``layerwise``, ``single`` or ``size:<MB>``).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from hvdcompress.schedule.groups import process_set_size

from .compression import GradientCompression
from .grouping import needs_cost_model
from .model_check import check_same_model


def elastic_mode() -> bool:
    """Running under ``horovodrun`` elastic (Horovod sets HOROVOD_ELASTIC=1 in its workers)."""
    return os.environ.get("HOROVOD_ELASTIC", "0") == "1"


def _legacy(optimizer) -> bool:
    legacy = getattr(getattr(tf.keras.optimizers, "legacy", None), "Optimizer", None)
    return legacy is not None and isinstance(optimizer, legacy)


def _compressions(optimizer, compression) -> List[GradientCompression]:
    found = []
    if optimizer is not None and isinstance(getattr(optimizer, "gradient_compression", None), GradientCompression):
        found.append(optimizer.gradient_compression)
    given = [] if compression is None else (list(compression) if isinstance(compression, (list, tuple))
                                            else [compression])
    for c in given:
        if not isinstance(c, GradientCompression):
            raise ValueError(f"compression: expected an hvc.GradientCompression (or a list of them), the object "
                             f"the tape uses; got {type(c).__name__}")
        if all(c is not f for f in found):
            found.append(c)
    return found


def check_elastic(optimizer, compressions: List[GradientCompression]) -> None:
    """What cannot follow a reset raises here (module doc), on every rank, before any collective."""
    for c in compressions:
        if c.policy.active:
            raise ValueError("delay: delayed averaging (delay/sync_every) keeps corrections of exchanges "
                             "among the current ranks and cannot follow an elastic reset; use delay=0, "
                             "sync_every=1 with elastic training")
        if needs_cost_model(c.parsed_schedule):
            raise ValueError(f"schedule: '{c.schedule}' is planned with a cost model for one world size and cannot "
                             "follow an elastic reset; use 'layerwise', 'single' or 'size:<MB>' with elastic training")
    if optimizer is not None and getattr(optimizer, "_hvc_accumulator", None) is not None:
        raise ValueError("backward_passes_per_step: local gradient accumulation (> 1) keeps per-rank sums and a "
                         "pass counter that cannot follow an elastic reset; use backward_passes_per_step=1 with "
                         "elastic training")


def _variables(c: GradientCompression) -> Dict[str, tf.Variable]:
    """Every variable of ``c`` that a commit snapshots, by a name stable within this process."""
    out = {"step": c.step, "epoch": c.epoch, "epoch_set": c.epoch_set}
    for i, slots in enumerate(c.slots):
        for name, var in slots.items():
            out[f"slot.{i}.{name}"] = var
    return out


class CompressionSnapshot:
    """This rank's compression state in host memory (``save``/``restore``)."""

    def __init__(self, compressions: List[GradientCompression]):
        self.compressions = compressions
        self._saved: List[Dict[str, np.ndarray]] = [{} for _ in compressions]
        self._densities: List[Optional[float]] = [None for _ in compressions]

    def save(self) -> None:
        self._saved = [{k: v.numpy().copy() for k, v in _variables(c).items()} for c in self.compressions]
        self._densities = [c.density for c in self.compressions]

    def restore(self) -> None:
        for c, saved, density in zip(self.compressions, self._saved, self._densities):
            if density is not None:
                c.density = density
            for key, var in _variables(c).items():
                if key in saved:
                    var.assign(saved[key])
                else:  # created after the snapshot: back to the value it was created with
                    name = key.rsplit(".", 1)[1]
                    var.assign(tf.fill(var.shape, tf.constant(np.asarray(c.compressor.initial_value(name),
                                                                         var.dtype.as_numpy_dtype))))


def sync_compression(c: GradientCompression, bcast_object) -> None:
    """Rank 0's counters and shared slots on every rank (one object broadcast); own slots stay."""
    shared = {"step": int(c.step.numpy()), "epoch": int(c.epoch.numpy()),
              "epoch_set": bool(c.epoch_set.numpy()),
              "density": c.density,
              "slots": {(i, name): var.numpy() for i, slots in enumerate(c.slots) for name, var in slots.items()
                        if name in c.compressor.shared_slots}}
    shared = bcast_object(shared)
    c.step.assign(shared["step"])
    c.epoch.assign(shared["epoch"])
    c.epoch_set.assign(shared["epoch_set"])
    if shared["density"] is not None:
        c.density = shared["density"]
    for (i, name), value in shared["slots"].items():
        while len(c.slots) <= i:
            c.slots.append({})
        var = c.slots[i].get(name)
        if var is None:  # a joining rank: create it as the first exchange would
            var = c.slots[i][name] = c.compressor.make_slot(name, int(value.size), tf.as_dtype(value.dtype),
                                                            f"{c.name}_{i}_{name}")
        var.assign(value)


def build_optimizer_variables(optimizer, variables) -> None:
    """Create the optimizer's slot variables for ``variables`` without a step (no exchange), named
    as ``apply_gradients`` names them, so Horovod's broadcast of ``optimizer.variables()`` pairs
    them across ranks. Nothing changes for an optimizer that has them already."""
    if optimizer is None:
        return
    with tf.init_scope():
        if _legacy(optimizer):
            with tf.name_scope(optimizer._name):
                optimizer._create_all_weights(variables)
        elif hasattr(optimizer, "build"):
            with tf.name_scope(optimizer.name):
                optimizer.build(variables)


def after_reset(model, optimizer) -> None:
    """Local part of a reset (no collective): the Keras optimizer's averaging factor follows the new
    world size; the model's cached Keras functions are dropped so they are traced again."""
    exchanger = getattr(optimizer, "_hvc", None) if optimizer is not None else None
    if exchanger is not None:
        exchanger.follow_world_size(process_set_size(exchanger.process_set))
    for attr in ("train_function", "test_function", "predict_function"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)


def _make_states():
    from horovod.tensorflow import broadcast_object
    from horovod.tensorflow.elastic import TensorFlowKerasState as HvdTensorFlowKerasState
    from horovod.tensorflow.keras.elastic import KerasState as HvdKerasState

    def mixin(base):
        class State(base):
            __doc__ = (base.__doc__ or "") + """
        compression: (hvdcompress) the ``hvc.GradientCompression`` a tape uses, or a list of them;
            the Keras ``DistributedOptimizer``'s own is found on the optimizer. See ``tf_ops.elastic``.
"""

            def __init__(self, model, optimizer=None, compression=None, **kwargs):
                opt = optimizer if optimizer is not None else getattr(model, "optimizer", None)
                self._hvc_compressions = _compressions(opt, compression)
                check_elastic(opt, self._hvc_compressions)
                self._hvc_snapshot = CompressionSnapshot(self._hvc_compressions)
                build_optimizer_variables(opt, model.trainable_variables)
                super().__init__(model, optimizer=optimizer, **kwargs)
                self._hvc_snapshot.save()
                self.register_reset_callbacks([lambda: after_reset(self.model, self.optimizer)])

            def save(self):
                super().save()
                self._hvc_snapshot.save()

            def restore(self):
                super().restore()
                self._hvc_snapshot.restore()

            def sync(self):
                import horovod.tensorflow as hvd
                variables = self.model.trainable_variables
                if hvd.size() > 1:
                    check_same_model(variables, [v.name for v in variables], hvd.global_process_set,
                                     "elastic sync", "hvc.elastic.model_check")
                build_optimizer_variables(self.optimizer, variables)
                for i, c in enumerate(self._hvc_compressions):
                    sync_compression(c, lambda obj: broadcast_object(obj, root_rank=0, name=f"hvc.elastic.{i}"))
                super().sync()
                self._hvc_snapshot.save()

        State.__name__ = State.__qualname__ = base.__name__
        return State

    return mixin(HvdTensorFlowKerasState), mixin(HvdKerasState)


TensorFlowKerasState, KerasState = _make_states()
