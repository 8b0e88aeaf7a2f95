"""``GradientCompression``: the compressed exchange of a list of gradients, and its state.

One object per model (per list of variables), created once, outside the training step::

    compression = hvc.GradientCompression("topk:ratio=0.01")
    compression = hvc.GradientCompression("topk:ratio=0.01", schedule="size:4")   # merged groups
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, compression=compression)

It is a ``tf.Module``; what it tracks is what a checkpoint saves and restores:

    step        exchanges so far (seeds random-k's indices and DGC's sampling offset)
    epoch       the epoch last given to ``set_epoch``
    density     fraction of entries ratio-based compressors send now (the warm-up moves it)
    spec_text   the compression spec as text, checked against this object's before each exchange
    slots[i]    the flat state variables of the i-th gradient (residual; DGC's u and v)
    delayed     with delay= / sync_every=: corrections in flight and local sums (``tf_ops.delayed``)

Gradients are identified by their position in the list, so the same model code restores the same
state whatever its variables are called. State variables are created, zero, the first time a
gradient is seen (lifted out of any ``tf.function`` with ``tf.init_scope``, as Keras creates optimizer
slots); a checkpoint restored before that is applied when they are created.

``schedule`` says which gradients are compressed and exchanged together (``tf_ops.grouping``:
"layerwise", the default, "single", "size:<MB>", "mgs"/"mgwfbp" planned with a cost model, or
explicit groups of positions). The groups are chosen once per gradient signature, when the
exchange is traced. A merged group is one flat tensor (the members concatenated in reverse list
order); its state is joined from the members' slots into group-sized working variables before
the exchange and assigned back slice by slice after it, so the checkpointed state stays per
position and a checkpoint restores under any schedule. (A member keeps the slots it needs alone
and those its group needs: a 1-D gradient merged into a DGC group that is sparsified also keeps a
``v``, unused should it later be exchanged alone.) A compressor that never merges
(``merge=LAYERWISE``: PowerSGD, whose ``q`` is shaped by the tensor) is exchanged one gradient at
a time; with ``codec_choice="auto"`` under "auto", "mgs" or "mgwfbp" (the exact searches; the
greedy rule's partition knows no such limit) the plan sends it on groups of one gradient only and
merges the groups it sends with fp16 or dense, whose working state carries the members'
residuals (``slots.group_slot_names``) while each ``q`` stays in its slot.

``exchange`` builds, for every group, the compressor's exchange generator and drives them all
(``tf_ops.collectives.run_exchanges``). Called eagerly, it runs the exchange as a ``tf.function``
(traced once per gradient signature) so the collectives are issued together, as Horovod does.
The bytes handed to the collectives and the dense size are counted per step (``stats``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from hvdcompress.contract import LAYERWISE
from hvdcompress.schedule.groups import check_mergeable
from hvdcompress.schedule.planner import Schedule
from hvdcompress.spec import CompressionSpec, resolve
from hvdcompress.stats import WireStats

from .collectives import Communicator, run_exchanges
from .codec_choice import check_codec_choice, fallback_exchange
from .compressors import ExchangeContext, build_compressor
from .nonfinite import RestoreMarker, guard
from .slots import ensure_slots, group_state, step_density
from .delayed import DelayedAveraging, check_delay, check_sync_every
from .policy import Synchronous
from .grouping import (Group, cached_cost_model, check_cost_model, check_plannable, check_schedule, flatten, make_groups,
                       needs_cost_model, schedule_text, split, split_state)


class _Local:
    """Per-process things a checkpoint must not hold (plain object: not tracked)."""

    def __init__(self):
        self.functions: Dict[tuple, tf.types.experimental.GenericFunction] = {}
        self.drivers: Dict[int, object] = {}
        self.plans: Dict[tuple, tuple] = {}  # gradient signature -> (groups, planner Plan or None)
        self.scratch: Dict[tuple, tf.Variable] = {}  # merged groups' working state (not checkpointed)
        self.last: Optional[tuple] = None  # (groups, plan) of the latest traced exchange
        self.last_args: Optional[tuple] = None  # the latest exchange's (world, scale, prescale, process set)
        self.warned_epoch = False
        with tf.init_scope():
            def counter(name):
                return tf.Variable(0, dtype=tf.int64, trainable=False, name=name)

            self.steps = counter("stats_steps")
            self.last_bytes, self.total_bytes = counter("stats_last_bytes"), counter("stats_total_bytes")
            self.last_dense, self.total_dense = counter("stats_last_dense"), counter("stats_total_dense")


def _rank_in(process_set) -> int:
    """This process's index in ``process_set`` (0 without Horovod: lockstep tests set no set)."""
    try:
        import horovod.tensorflow as hvd
        if not hvd.is_initialized():
            return 0
        return int((process_set if process_set is not None else hvd.global_process_set).rank())
    except (ImportError, ValueError):
        return 0


class GradientCompression(tf.Module):
    """Compression spec + compressor + the state it keeps between steps (see module doc).

    Args:
        compression: a spec string (``"topk:ratio=0.01"``), ``hvdcompress.Compression.<name>(...)``,
            or Horovod's ``Compression.none`` / ``Compression.fp16``. Default: no compression.
        name: prefix of the collectives' names (Horovod matches ops across ranks by name); give
            two objects used in the same step different names.
        driver: the communicator carrying out collective requests (default: Horovod's, on the
            process set the wrapper passes).
        schedule: which gradients are exchanged together (``tf_ops.grouping``): "layerwise"
            (default; None means the same), "single", "size:<MB>", "mgs", "mgwfbp" (":greedy"),
            "auto", or explicit groups of gradient positions ``[[0, 1], [2, 3]]``.
        cost_model: an ``hvdcompress.schedule.costmodel.CostModel`` for "mgs"/"mgwfbp"/"auto" (None: the
            cached one for the world size and host set, found at the first exchange or by
            ``prepare``; a ValueError if there is none). With a fixed schedule it only gives
            ``plan.predicted_seconds``.
        codec_choice: "auto": the plan also picks, per group, the compressor, "fp16" or dense,
            whichever the cost model predicts fastest (``tf_ops.codec_choice``; residuals go out
            with a group that turns dense); needs a schedule string and a cost model with
            compression-time fits for the spec and fp16. A compressor that never merges
            (PowerSGD) is then chosen for single gradients only, beside merged fp16 / dense
            groups (without the choice "auto" is "layerwise" for it). None or "off" (default):
            the compressor everywhere. Unlike PyTorch's optimizer, None never turns it on: a TF
            plan is made from the cost model alone, with no measured validation to check it.

    Delayed averaging (``tf_ops.delayed``; the arithmetic of PyTorch's, the link latency not
    overlapped: TF collectives complete within the step):
        delay: steps between an exchange and applying its correction ``R - L`` (L: the local term; int >= 0;
            0 = synchronous, the same code path bit for bit). Each step applies the local gradient.
        sync_every: exchange once every this many steps, local steps in between (int >= 1).
        ``flush(optimizer, variables)`` applies what is pending and makes the replicas identical.

    A bad schedule, cost model, delay or sync_every raises ValueError here, before any collective.
    """

    def __init__(self, compression=None, name: str = "hvc", driver=None, schedule="layerwise", cost_model=None,
                 delay: int = 0, sync_every: int = 1, codec_choice=None):
        check_delay(delay)
        check_sync_every(sync_every)
        spec = resolve(compression)
        sched = check_schedule(schedule)
        model = check_cost_model(cost_model)
        compressor = build_compressor(spec)
        alternatives = check_codec_choice(codec_choice, compressor, delay, sync_every)
        if not check_mergeable(schedule_text(sched), spec, bool(alternatives)):  # cannot merge: auto -> layerwise
            sched = check_schedule("layerwise")
        if alternatives and not isinstance(sched, Schedule):
            raise ValueError("codec_choice: 'auto' plans the groups' specs, so it needs a schedule string "
                             "(explicit groups are not planned)")
        if model is not None:
            check_plannable(sched, model, spec, alternatives)
        super().__init__(name=name)
        self._spec = spec
        self._compressor = compressor
        self._schedule = sched
        self._cost_model = model
        self._alternatives = alternatives  # specs a group may be sent with instead (tf_ops.codec_choice)
        self._driver = driver
        self._local = _Local()
        with tf.init_scope():
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            self.spec_text = tf.Variable(str(spec), dtype=tf.string, trainable=False, name="spec")
            # set_epoch() called: the warm-up follows it; else it counts epochs of warmup_epoch_steps
            self.epoch_set = tf.Variable(False, trainable=False, name="epoch_set")
            self._density = (tf.Variable(self._compressor.scheduled_density(0), dtype=tf.float64,
                                         trainable=False, name="density")
                             if self._compressor.has_density else None)
        self.slots: List[Dict[str, tf.Variable]] = []
        self._restored = RestoreMarker()  # a restore makes the next exchange check the state is finite
        # the sync policy (tf_ops.policy), chosen once: the plain exchange, or delayed averaging with
        # its state (tf_ops.delayed; tracked, so checkpoints hold it)
        self.policy = (DelayedAveraging(delay, sync_every, momentum=self._compressor.local_momentum())
                       if delay > 0 or sync_every > 1 else Synchronous())

    # -- what users read and set -------------------------------------------------------------
    @property
    def compression(self) -> CompressionSpec:
        return self._spec

    @property
    def compressor(self):
        return self._compressor

    @property
    def schedule(self) -> str:
        """The schedule asked for ("layerwise", "size:64", "mgs", ..., or "explicit")."""
        return schedule_text(self._schedule)

    @property
    def parsed_schedule(self):
        """The schedule as ``grouping.check_schedule`` parsed it (a planner ``Schedule`` or a tuple
        of tuples of positions)."""
        return self._schedule

    @property
    def cost_model(self):
        """The cost model planning uses (given, or found by ``prepare``), or None."""
        return self._cost_model

    @property
    def groups(self) -> Optional[List[List[int]]]:
        """The groups of gradient positions (each in concatenation order) of the latest traced
        exchange, in the order they are exchanged; None before the first exchange."""
        return None if self._local.last is None else [list(g.positions) for g in self._local.last[0]]

    @property
    def plan(self):
        """The ``hvdcompress.schedule.planner.Plan`` of the latest traced exchange (its groups index the
        present gradients in reverse list order; ``predicted_seconds`` is compression plus exchange
        time when there is a cost model); None for explicit groups or before the first exchange."""
        return None if self._local.last is None else self._local.last[1]

    def prepare(self, world_size: int, process_set=None):
        """Find the cost model now (the wrappers call this when they are made): for a schedule
        that needs one and was given none, the cached one for ``world_size`` ranks and this host
        set, else a ValueError on every rank (``grouping.cached_cost_model``). Returns the model."""
        if self._cost_model is None and (needs_cost_model(self._schedule) or self._alternatives):
            model = cached_cost_model(world_size, process_set, use_horovod=self._driver is None)
            check_plannable(self._schedule, model, self._spec, self._alternatives)
            self._cost_model = model
        return self._cost_model

    @property
    def stateful(self) -> bool:
        """True when the exchange keeps state between steps (then one object must serve every step)."""
        return self._compressor.stateful or self.policy.active

    @property
    def delayed(self) -> Optional[DelayedAveraging]:
        """The delayed-averaging policy with its state (``tf_ops.delayed``), or None when synchronous."""
        return self.policy if isinstance(self.policy, DelayedAveraging) else None

    @property
    def delay(self) -> int:
        return self.policy.delay

    @property
    def sync_every(self) -> int:
        return self.policy.every

    def flush_corrections(self) -> List[Optional[tf.Tensor]]:
        """Delayed averaging: exchange what ``sync_every`` only applied locally, and return (and
        forget) every correction not yet applied, summed per gradient position (None where none);
        [] when synchronous or before the first exchange. Call on every rank, between steps."""
        args = self._local.last_args
        if not self.policy.active or args is None:
            return []
        world_size, scale, prescale, process_set = args

        def pending():
            return self.policy.pending(lambda gs: self._exchange_now(gs, *args), prescale * scale * world_size)
        if not tf.executing_eagerly():
            return pending()
        fn = self._local.functions.get(("flush",) + args[:3] + (id(process_set),))
        if fn is None:
            fn = self._local.functions[("flush",) + args[:3] + (id(process_set),)] = tf.function(pending, autograph=False)
        return fn()

    def flush(self, optimizer, variables, apply_gradients=None) -> None:
        """Delayed averaging: apply every pending correction as one more step of ``optimizer``
        (``optimizer.apply_gradients``, or ``apply_gradients(pairs)`` if given) on ``variables`` (the
        list whose gradients were exchanged, in that order), then average the variables and the
        optimizer's slot variables over the ranks, so every rank holds identical values. Call it on
        every rank between steps (before evaluating or comparing replicas). Nothing to do when
        synchronous (delay=0, sync_every=1) or before the first exchange."""
        if self._local.last_args is None:
            return
        corrections = self.flush_corrections()
        self.policy.finish_flush(corrections, variables, optimizer,
                                 apply_gradients if apply_gradients is not None else optimizer.apply_gradients,
                                 self._local.last_args[3], f"{self.name}.flush")

    @property
    def density(self) -> Optional[float]:
        """Fraction of entries sent now (ratio-based compressors), else None."""
        return None if self._density is None else float(self._density.numpy())

    @density.setter
    def density(self, value: float) -> None:
        if self._density is None:
            raise ValueError(f"density: compression '{self._spec}' has no density (no 'ratio' parameter)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
            raise ValueError(f"density: must be a float in (0, 1]; got {value!r}")
        self._density.assign(float(value))

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch that starts; compressors with a warm-up in their spec (DGC) take their
        density from it. Call it on every rank at the start of each epoch (0-based)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch: epoch must be an int >= 0; got {epoch!r}")
        self.epoch.assign(epoch)
        self.epoch_set.assign(True)
        if self._density is not None and self._compressor.has_schedule:
            self._density.assign(self._compressor.scheduled_density(epoch))

    @property
    def stats(self) -> WireStats:
        """Bytes this rank handed to the collectives, per step and in total, next to dense."""
        loc = self._local
        return WireStats(steps=int(loc.steps.numpy()), last_bytes=int(loc.last_bytes.numpy()),
                         last_dense_bytes=int(loc.last_dense.numpy()),
                         total_bytes=int(loc.total_bytes.numpy()),
                         total_dense_bytes=int(loc.total_dense.numpy()))

    def reset_stats(self) -> None:
        for v in (self._local.steps, self._local.last_bytes, self._local.total_bytes,
                  self._local.last_dense, self._local.total_dense):
            v.assign(0)

    # -- the exchange ----------------------------------------------------------------------------
    # Not converted by autograph (its control flow is explicit): autograph would wrap every Python call
    # below it, the planner's included, which multiplies the tracing time (docs/design.md 2.1).
    @tf.autograph.experimental.do_not_convert
    def exchange(self, grads: Sequence[Optional[tf.Tensor]], *, world_size: int, scale: float,
                 prescale: float = 1.0, process_set=None) -> List[Optional[tf.Tensor]]:
        """Compress, exchange and aggregate every gradient of the list (None stays None).

        ``scale`` multiplies the summed result (1/world_size averages), ``prescale`` the local
        gradient before compression (Horovod's gradient_predivide_factor). Dense tensors only.
        """
        grads = list(grads)
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                raise ValueError(f"gradient {i} is a tf.IndexedSlices; densify it first "
                                 "(the Horovod wrappers do, see sparse_as_dense)")
        self._local.last_args = (world_size, scale, prescale, process_set)  # what a flush exchanges with
        if not tf.executing_eagerly():
            return self._exchange(grads, world_size, scale, prescale, process_set)
        key = (world_size, float(scale), float(prescale), id(process_set))
        fn = self._local.functions.get(key)
        if fn is None:
            def traced(gs):
                return self._exchange(gs, world_size, scale, prescale, process_set)
            fn = self._local.functions[key] = tf.function(traced, autograph=False)
        return fn(grads)

    def _driver_for(self, process_set):
        if self._driver is not None:
            return self._driver
        drv = self._local.drivers.get(id(process_set))
        if drv is None:
            drv = self._local.drivers[id(process_set)] = Communicator(process_set)
        return drv

    def _groups(self, grads, world_size: int, process_set) -> List[Group]:
        signature = (world_size, tuple(None if g is None else (tuple(g.shape), g.dtype.name) for g in grads))
        found = self._local.plans.get(signature)
        if found is None:
            planned = needs_cost_model(self._schedule) or self._alternatives
            model = self.prepare(world_size, process_set) if planned else self._cost_model
            # plain Python and numpy: kept out of autograph, which would convert the planner's searches
            plan_groups = tf.autograph.experimental.do_not_convert(make_groups)
            found = self._local.plans[signature] = plan_groups(self._schedule, grads, self._spec, world_size, model,
                                                               self._alternatives)
        self._local.last = found
        return found[0]

    def start_exchange(self, grads: Sequence[Optional[tf.Tensor]], *, world_size: int, scale: float,
                       prescale: float = 1.0, process_set=None) -> "PendingExchange":
        """One step's exchanges, not yet run: a generator and an op name per group, and
        ``finish(results, sent)`` that splits the groups' results back into gradients, saves the
        groups' state into the per-position slots and counts the step. ``exchange`` runs them with
        Horovod; a driver that runs the collectives itself (a lockstep test world) may drive them."""
        grads = list(grads)
        for i, g in enumerate(grads):
            if g is not None and not g.shape.is_fully_defined():
                raise ValueError(f"gradient {i} has shape {tuple(g.shape)}, not fully known when traced; "
                                 "compressed exchange needs static shapes")
        groups = self._groups(grads, world_size, process_set)
        ensure_slots(self._compressor, self.slots, grads, groups, self.name)
        check = [tf.debugging.assert_equal(
            self.spec_text, str(self._spec),
            message=f"compression state was saved with another compression spec; this object uses "
                    f"'{self._spec}' (restore a checkpoint made with the same spec)")]
        restored = self._restored.pending.read_value()
        step = self.step.read_value()
        density = self._step_density(step)
        rank = _rank_in(process_set)
        gens, names, states = [], [], []
        for group in groups:
            with tf.control_dependencies(check):
                x = flatten([grads[i] for i in group.positions])
            if prescale != 1.0:
                x = x * tf.cast(prescale, x.dtype)
            state = group_state(self._compressor, self.slots, self._local.scratch, group, self.name)
            ctx = ExchangeContext(group.key, step, world_size, scale, state, group.shape, 0, rank, group.layout,
                                  density=density)
            where = f"gradient {group.positions[0]}" if len(group.positions) == 1 else \
                f"gradients {', '.join(map(str, group.positions))}"
            if group.codec is None and len(group.positions) > 1 and self._compressor.merge == LAYERWISE:
                raise AssertionError(f"hvdcompress: '{self._spec}' never merges, yet group {group.key} holds "
                                     f"{len(group.positions)} gradients")
            exchange = (self._compressor.exchange(x, ctx) if group.codec is None else
                        fallback_exchange(self._compressor, group.codec, x, ctx))  # the plan's choice
            gens.append(guard(exchange, x, state, restored, where))  # non-finite never hidden
            names.append(f"{self.name}.{group.op_name}")
            states.append(state)
        return PendingExchange(self, grads, groups, states, gens, names)

    def _step_density(self, step):
        """The density of this exchange (``slots.step_density``); None without a ratio."""
        if self._density is None:
            return None
        warned, density = step_density(self._compressor, self._spec, self._density, self.epoch_set, step,
                                       self._local.warned_epoch)
        self._local.warned_epoch = warned
        return density

    def _exchange(self, grads, world_size, scale, prescale, process_set):
        return self.policy.step(grads, lambda gs: self._exchange_now(gs, world_size, scale, prescale, process_set),
                                prescale * scale * world_size)

    def _exchange_now(self, grads, world_size, scale, prescale, process_set):
        pending = self.start_exchange(grads, world_size=world_size, scale=scale, prescale=prescale,
                                      process_set=process_set)
        results, sent = run_exchanges(pending.generators, pending.names, self._driver_for(process_set))
        return pending.finish(results, sent)

    def _finish(self, pending: "PendingExchange", results, sent) -> List[Optional[tf.Tensor]]:
        grads = pending.grads
        out: List[Optional[tf.Tensor]] = [None] * len(grads)
        dense_bytes = 0
        for group, state, r in zip(pending.groups, pending.states, results):
            for i, t in zip(group.positions, split(r, group)):
                out[i] = tf.cast(t, grads[i].dtype)
                dense_bytes += grads[i].shape.num_elements() * grads[i].dtype.size
            if len(group.positions) > 1:
                split_state(group, [self.slots[i] for i in group.positions], state)
        self._restored.done([r for r in results if r is not None])
        self.step.assign_add(1)
        loc = self._local
        loc.steps.assign_add(1)
        loc.last_bytes.assign(sent)
        loc.total_bytes.assign_add(sent)
        loc.last_dense.assign(dense_bytes)
        loc.total_dense.assign_add(dense_bytes)
        return out

    def __repr__(self) -> str:
        return f"GradientCompression('{self._spec}', name={self.name!r}, schedule={self.schedule!r})"


class PendingExchange:
    """What ``GradientCompression.start_exchange`` returns (see there)."""

    def __init__(self, owner: GradientCompression, grads, groups, states, generators, names):
        self._owner = owner
        self.grads, self.groups, self.states = grads, groups, states
        self.generators, self.names = generators, names

    def finish(self, results: Sequence[tf.Tensor], sent) -> List[Optional[tf.Tensor]]:
        """``results``: each generator's return value, in order; ``sent``: bytes this rank handed
        to the collectives (int or int64 tensor). Returns the gradients (None stays None)."""
        return self._owner._finish(self, results, sent)

