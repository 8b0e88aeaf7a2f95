"""Argument checking and the exchange step shared by ``DistributedGradientTape`` and the Keras
``DistributedOptimizer``.

Every argument Horovod's wrappers take keeps its name and meaning; each is checked here, when the
wrapper is made, identically on every rank and before any collective, so bad input raises the
same ``ValueError`` (naming the argument) everywhere and no rank is left waiting.

    op=Average:  result = sum_r C(g_r / f) * (f / N)      f = gradient_predivide_factor
    op=Sum:      result = sum_r C(g_r)

``device_dense`` / ``device_sparse`` are accepted for compatibility and ignored (the collectives
run where Horovod places them). ``num_groups`` / ``groups`` (Horovod's explicit grouping) are
refused with a pointer to ``schedule=``: Horovod's groups negotiate separate tensors together
(any variables, each still its own tensor), while a merged group here is compressed as *one*
tensor (top-k of the group), so the same argument would not keep its meaning.

``schedule`` / ``cost_model`` (hvdcompress's own, see ``tf_ops.grouping``) are handed to the
``GradientCompression`` a wrapper builds from a spec; one given as ``compression=`` carries its
own, and a different one passed beside it is refused. A schedule that needs a cost model and was
given none finds the cached one when the wrapper is made, so a missing model raises there.
Sparse gradients (``tf.IndexedSlices``, e.g. from embeddings) are exchanged sparse, uncompressed,
as Horovod does (allgather of values and indices; ``tf_ops.sparse_grads``), and come back as
``IndexedSlices``; ``sparse_as_dense=True`` densifies them so they are compressed like the rest.
Delayed averaging and ``backward_passes_per_step`` > 1 keep dense state and densify them (with a
warning unless ``sparse_as_dense=True``).

``topology`` (``tf_ops.twolevel``: dense inside a node, the spec across nodes) goes to the
``GradientCompression`` built from a spec; one given as ``compression=`` carries its own (its state
is laid out for it), and a different one passed beside it is refused. It is checked against the
process set when the wrapper is made (``GradientCompression.prepare``).

``delay`` / ``sync_every`` (delayed averaging, ``tf_ops.delayed``) are checked first; None means
"the GradientCompression's own" (0 / 1 for a spec). They keep corrections between steps, so a tape
(one step long) needs them on a ``GradientCompression`` made once; the Keras optimizer builds its
own. A ``GradientCompression`` given as ``compression=`` carries its own values, and different
ones passed beside it are refused.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Dict, List, Optional

import tensorflow as tf

from hvdcompress.schedule.groups import process_set_size
from hvdcompress.spec import resolve

from .compression import GradientCompression
from .compressors import build_compressor
from .delayed import check_delay, check_sync_every
from .grouping import check_cost_model, check_schedule
from .model_check import check_same_model, signature
from .sparse_grads import exchange_sparse, split_sparse
from .twolevel import check_topology_form

_STATELESS_CACHE: Dict[str, GradientCompression] = {}


class Exchanger:
    """A configured exchange: the compression object plus how results are scaled and where."""

    def __init__(self, compression: GradientCompression, world_size: int, scale: float,
                 prescale: float, process_set, sparse_as_dense: bool, who: str, average: bool = True):
        self.compression = compression
        self.world_size, self.scale, self.prescale = world_size, scale, prescale
        self.average = average  # op=Average (else Sum): sparse gradients' values are divided by the size
        self.process_set = process_set
        self.sparse_as_dense = sparse_as_dense
        self.who = who
        self._warned = False
        self.variables = None  # Keras: the variables of the latest exchange, in order (for flush)
        self._checked = set()  # gradient signatures already checked to be the same on every rank

    def follow_world_size(self, world_size: int) -> None:
        """After a Horovod Elastic reset: average over the new number of ranks, and check each
        gradient signature again."""
        self.world_size = world_size
        self.scale = (1.0 / self.prescale) / world_size if self.average else 1.0
        self._checked = set()

    def densify(self, grads, reason: str = "backward_passes_per_step > 1 accumulates dense sums"
                ) -> List[Optional[tf.Tensor]]:
        """``grads`` with every ``tf.IndexedSlices`` converted to a dense tensor; a warning (once)
        saying ``reason`` unless ``sparse_as_dense=True`` asked for it."""
        out = []
        for g in grads:
            if isinstance(g, tf.IndexedSlices):
                if not (self.sparse_as_dense or self._warned):
                    warnings.warn(f"{self.who}: a gradient is a tf.IndexedSlices (sparse, e.g. from an "
                                  f"embedding); it is densified and compressed ({reason}), as with "
                                  "sparse_as_dense=True (pass that to silence this warning).")
                    self._warned = True
                g = tf.convert_to_tensor(g)
            out.append(g)
        return out

    @tf.autograph.experimental.do_not_convert
    def exchange(self, grads, variables=None) -> List[Optional[tf.Tensor]]:
        """The exchanged gradients, in order: dense ones compressed (``GradientCompression``),
        ``tf.IndexedSlices`` exchanged sparse and uncompressed (``tf_ops.sparse_grads``) unless
        ``sparse_as_dense`` or delayed averaging densifies them."""
        grads = list(grads)
        if self.sparse_as_dense:
            grads = self.densify(grads)
        elif not self.compression.policy.sparse_exchanges:
            grads = self.densify(grads, "delayed averaging keeps dense corrections")
        self.check_model(grads, variables)
        if os.environ.get("HOROVOD_ELASTIC", "0") == "1":
            grads = self._check_world_size(grads)
        dense, positions = split_sparse(grads)
        out = self.compression.exchange(dense, world_size=self.world_size, scale=self.scale,
                                        prescale=self.prescale, process_set=self.process_set)
        if positions:
            for i, result in zip(positions, self._exchange_sparse([grads[i] for i in positions], positions)):
                out[i] = result
        return out

    def _check_world_size(self, grads):
        """Under Horovod Elastic: the exchange is traced for ``world_size`` ranks (compressors
        use it in Python), so a traced step run after a reset changed the size must stop, not
        average wrongly: a runtime check on Horovod's size that the gradients depend on."""
        from horovod.tensorflow.mpi_ops import size_op

        now = size_op(process_set_id=self.process_set.process_set_id)
        check = tf.debugging.assert_equal(
            now, tf.constant(self.world_size, now.dtype),
            message=f"{self.who}: this exchange was traced for {self.world_size} ranks, but the job now has a "
                    "different number (a Horovod Elastic reset); trace the training step again after a reset: "
                    "build its tf.function inside the function hvc.elastic.run wraps (Keras' fit and "
                    "train_on_batch are traced again by hvc.elastic.KerasState)")
        with tf.control_dependencies([check]):
            return [g if g is None else
                    (tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape)
                     if isinstance(g, tf.IndexedSlices) else tf.identity(g)) for g in grads]

    def _exchange_sparse(self, grads, positions) -> List[tf.IndexedSlices]:
        """Horovod's exchange of sparse gradients (values and indices allgathered, averaged by
        dividing the values by the size), on the compression's session: its transport, its ``stats``."""
        names = [f"{self.compression.name}.sparse.{i}" for i in positions]
        return exchange_sparse(self.compression.session, grads, names, self.world_size, self.average,
                               self.process_set)

    def check_model(self, grads, variables=None) -> None:
        """Once per gradient signature: the same model on every rank (``tf_ops.model_check``)."""
        if self.world_size < 2 or os.environ.get("HOROVOD_ELASTIC", "0") == "1":
            return  # under elastic the state's sync checks the model (tf_ops.elastic)
        key = signature(grads)
        if key in self._checked:
            return
        names = [getattr(v, "name", f"gradient {i}") for i, v in enumerate(variables)] if variables is not None \
            else [f"gradient {i}" for i in range(len(grads))]
        check_same_model(grads, names, self.process_set, self.who,
                         f"{self.compression.name}.model_check.{len(self._checked)}")
        self._checked.add(key)


def _check_factor(value, op_is_average: bool) -> float:
    try:
        factor = float(value)
    except (TypeError, ValueError):
        factor = float("nan")
    if isinstance(value, bool) or not factor > 0 or math.isinf(factor):
        raise ValueError(f"gradient_predivide_factor: must be a finite float > 0; got {value!r}")
    if factor != 1.0 and not op_is_average:
        raise ValueError("gradient_predivide_factor: values other than 1.0 require op=hvd.Average")
    return factor


def _check_carried(compression: GradientCompression, sched, cost_model, topology=None) -> None:
    """A GradientCompression carries its schedule, cost model and topology; refuse different ones beside it."""
    if sched is not None and sched != compression.parsed_schedule:
        raise ValueError(f"schedule: the GradientCompression given as compression= has schedule "
                         f"'{compression.schedule}'; it carries its own: pass schedule= to "
                         "hvc.GradientCompression(spec, schedule=...) and leave it out here")
    if cost_model is not None and cost_model is not compression.cost_model:
        raise ValueError("cost_model: the GradientCompression given as compression= carries its own; pass "
                         "cost_model= to hvc.GradientCompression(spec, schedule=..., cost_model=...)")
    if topology is not None and topology != compression.topology:
        raise ValueError(f"topology={topology!r}: the GradientCompression given as compression= has topology="
                         f"{compression.topology!r}; it carries its own (its state belongs to it): pass topology= "
                         "to hvc.GradientCompression(spec, topology=...) and leave it out here")


def make_exchanger(who: str, compression, device_dense, device_sparse, sparse_as_dense, op,
                   gradient_predivide_factor, num_groups, groups, process_set, persistent_only: bool,
                   name: str = "hvc", schedule=None, cost_model=None, delay=None, sync_every=None,
                   topology=None) -> Exchanger:
    """Check the Horovod-style arguments and build the exchanger (see module doc).

    ``persistent_only``: the wrapper lives for one step (a tape), so a compressor that keeps state
    between steps must come as a ``GradientCompression`` made once by the caller.
    """
    import horovod.tensorflow as hvd

    delay = None if delay is None else check_delay(delay)  # bad values raise here, on every rank
    sync_every = None if sync_every is None else check_sync_every(sync_every)
    sched = None if schedule is None else check_schedule(schedule)
    check_cost_model(cost_model)
    check_topology_form(topology)
    spec = None
    if not isinstance(compression, GradientCompression):
        spec = resolve(compression)  # a bad spec raises here, naming the parameter
        delay, sync_every = delay or 0, sync_every or 1
        if persistent_only and (delay > 0 or sync_every > 1):
            raise ValueError(
                f"delay/sync_every: delayed averaging keeps corrections between steps, and a {who} lives "
                f"for one step; create the state once, outside the training step, as "
                f"hvc.GradientCompression('{spec}', delay={delay}, sync_every={sync_every}), pass that "
                "object as compression= every step, and checkpoint it with the model")
        if persistent_only and build_compressor(spec).stateful:
            extra = "" if schedule is None else f", schedule={schedule!r}"
            raise ValueError(
                f"compression: '{spec}' keeps state between steps (residuals, momenta or the step "
                f"counter), and a {who} lives for one step; create it once, outside the training "
                f"step, as hvc.GradientCompression('{spec}'{extra}), pass that object as compression= "
                "every step, and checkpoint it with the model")
    else:
        _check_carried(compression, sched, cost_model, topology)
        for arg, value, own in (("delay", delay, compression.delay), ("sync_every", sync_every, compression.sync_every)):
            if value is not None and value != own:
                raise ValueError(f"{arg}: the GradientCompression given as compression= has {arg}={own}; it "
                                 f"carries its own: pass {arg}= to hvc.GradientCompression(spec, {arg}=...) "
                                 "and leave it out here")
    for arg, value in (("device_dense", device_dense), ("device_sparse", device_sparse)):
        if not isinstance(value, str):
            raise ValueError(f"{arg}: expected a device string (accepted and ignored); got {value!r}")
    if not isinstance(sparse_as_dense, bool):
        raise ValueError(f"sparse_as_dense: must be True or False; got {sparse_as_dense!r}")
    op = hvd.Average if op is None else op
    if op == hvd.Adasum:
        raise ValueError("op: Adasum is not supported with compression; accepted: hvd.Average, hvd.Sum")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op: accepted values are hvd.Average and hvd.Sum; got {op!r}")
    factor = _check_factor(gradient_predivide_factor, op == hvd.Average)
    if num_groups != 0 or groups is not None:
        raise ValueError("num_groups/groups: explicit grouping is not supported with compression (Horovod's "
                         "groups negotiate separate tensors together; a compressed group is one merged "
                         "tensor). Leave num_groups=0 and groups=None and ask for merged groups with "
                         "schedule=: 'single', 'size:<MB>', 'mgs'/'mgwfbp' (with a cost model) or explicit "
                         "groups of gradient positions such as [[0, 1], [2, 3]].")
    process_set = hvd.global_process_set if process_set is None else process_set
    if not isinstance(process_set, hvd.ProcessSet):
        raise ValueError(f"process_set: expected a horovod ProcessSet; got {process_set!r}")
    if not hvd.is_initialized():
        raise ValueError(f"horovod is not initialized: call hvd.init() before {who}")
    if spec is not None and persistent_only:  # stateless: one shared object per spec, no new variables per step
        key = f"{name}:{spec}:{sched!r}:{id(cost_model)}:{topology!r}"  # the cached object keeps cost_model alive
        if key not in _STATELESS_CACHE:
            _STATELESS_CACHE[key] = GradientCompression(spec, name=name, schedule=sched, cost_model=cost_model,
                                                        topology=topology)
        compression = _STATELESS_CACHE[key]
    elif spec is not None:
        compression = GradientCompression(spec, name=name, schedule=sched, cost_model=cost_model, delay=delay,
                                          sync_every=sync_every, topology=topology)
    world = process_set_size(process_set)
    compression.prepare(world, process_set)  # a missing cost model raises now, on every rank
    scale = factor / world if op == hvd.Average else 1.0
    return Exchanger(compression, world, scale, 1.0 / factor, process_set, sparse_as_dense, who,
                     average=op == hvd.Average)
