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

It is the TF optimizer path's adapter over an ``ExchangeSession`` (``tf_ops.session``: the
compressor, starting and running exchanges, the slots, the clock, stats): it adds the groups
(``tf_ops.grouping``) and the sync policy (``tf_ops.policy``, which sees it as a ``PolicyHost``).
``exchange`` starts, for every group, the compressor's exchange on the session and drives them
all (``tf_ops.collectives.run_exchanges``). Called eagerly, it runs the exchange as a ``tf.function``
(traced once per gradient signature) so the collectives are issued together, as Horovod does.
The bytes handed to the collectives and the dense size are counted per step (``stats``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from hvdcompress.contract import LAYERWISE, transport_argument
from hvdcompress.schedule.groups import check_mergeable
from hvdcompress.schedule.planner import Schedule
from hvdcompress.spec import CompressionSpec, resolve
from hvdcompress.stats import WireStats

from .codec_choice import check_codec_choice
from .compressors import build_compressor
from .delayed import DelayedAveraging, check_delay, check_sync_every
from .policy import Synchronous
from .grouping import (Group, cached_cost_model, check_cost_model, check_plannable, check_schedule, flatten, make_groups,
                       needs_cost_model, schedule_text, split)
from .session import ExchangeSession, Untracked, exchange_name, rank_in
from .twolevel import check_topology, check_topology_form


class _Local:
    """Per-process things a checkpoint must not hold (plain object: not tracked)."""

    def __init__(self):
        self.functions: Dict[tuple, tf.types.experimental.GenericFunction] = {}
        self.plans: Dict[tuple, tuple] = {}  # gradient signature -> (groups, planner Plan or None)
        self.last: Optional[tuple] = None  # (groups, plan) of the latest traced exchange
        self.last_args: Optional[tuple] = None  # the latest exchange's (world, scale, prescale, process set)
        self.topologies: Dict[int, object] = {}  # id(process set) -> the Topology its exchanges run on


class _Host:
    """What a sync policy may use of one call's exchange (``tf_ops.policy.PolicyHost``)."""

    def __init__(self, owner: "GradientCompression", world_size: int, scale: float, prescale: float, process_set):
        self._owner = owner
        self._args = (world_size, scale, prescale, process_set)
        self.factor = prescale * scale * world_size
        self.process_set = process_set
        self.name = f"{owner.name}.flush"

    def exchange(self, grads):
        return self._owner.exchange_now(grads, *self._args)


class GradientCompression(tf.Module):
    """Compression spec + compressor + the state it keeps between steps (see module doc).

    Args:
        compression: a spec string (``"topk:ratio=0.01"``), ``hvdcompress.Compression.<name>(...)``,
            or Horovod's ``Compression.none`` / ``Compression.fp16``. Default: no compression.
        name: prefix of the collectives' names (Horovod matches ops across ranks by name); give
            two objects used in the same step different names.
        transport: the transport carrying out collective requests (``hvdcompress.contract.Transport``;
            default: Horovod's ``tf_ops.collectives.Communicator``, on the process set the wrapper
            passes). ``driver=``, its former name, is deprecated (a DeprecationWarning; removed in
            the next release).
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
        topology: where the ranks sit (``tf_ops.twolevel``, docs/two-level.md): None (default) the
            launcher's (``HOROVOD_LOCAL_SIZE``), two-level where it has several nodes of several
            ranks and ``hvdcompress.tensorflow.init()`` registered their process sets (flat on one
            node, under Elastic, on uneven nodes, on a process set smaller than the job, on a
            transport given here); "flat": one level; "NxL" / "L" / a ``Topology``: that layout
            (every group two-level: dense inside a node, the spec across nodes). Checked against
            the process set when the wrapper is made (``prepare``), before any collective.

    Delayed averaging (``tf_ops.delayed``; the arithmetic of PyTorch's, the link latency not
    overlapped: TF collectives complete within the step):
        delay: steps between an exchange and applying its correction ``R - L`` (L: the local term; int >= 0;
            0 = synchronous, the same code path bit for bit). Each step applies the local gradient.
        sync_every: exchange once every this many steps, local steps in between (int >= 1).
        ``flush(optimizer, variables)`` applies what is pending and makes the replicas identical.

    A bad schedule, cost model, delay or sync_every raises ValueError here, before any collective.
    """

    def __init__(self, compression=None, name: str = "hvc", transport=None, schedule="layerwise", cost_model=None,
                 delay: int = 0, sync_every: int = 1, codec_choice=None, driver=None, topology=None):
        transport = transport_argument(transport, driver, "GradientCompression")
        check_topology_form(topology)
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
        self._session = Untracked(ExchangeSession(spec, compressor=compressor, transport=transport, prefix=name))
        self._spec = spec
        self._compressor = compressor
        self._schedule = sched
        self._cost_model = model
        self._alternatives = alternatives  # specs a group may be sent with instead (tf_ops.codec_choice)
        self._transport = transport
        self._topology = topology
        self._local = _Local()
        session = self.session
        session.make_clock()
        # tracked here, under the names the saved format has always used (tf_ops.session)
        self.step, self.epoch, self.spec_text = session.step, session.epoch, session.spec_text
        self.epoch_set, self._density = session.epoch_set, session.density
        self.slots: List[Dict[str, tf.Variable]] = []  # the session creates and reads them
        self._restored = session.restored
        # the sync policy (tf_ops.policy), chosen once: the plain exchange, or delayed averaging with
        # its state (tf_ops.delayed; tracked, so checkpoints hold it)
        self.policy = (DelayedAveraging(delay, sync_every, momentum=self._compressor.local_momentum())
                       if delay > 0 or sync_every > 1 else Synchronous())

    # -- what users read and set -------------------------------------------------------------
    @property
    def session(self) -> ExchangeSession:
        """The exchange session (``tf_ops.session``) this object is the adapter of."""
        return self._session.value

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
    def topology(self):
        """The ``topology=`` argument as given (None: the launcher's)."""
        return self._topology

    def topology_for(self, process_set=None):
        """The ``hvdcompress.topology.Topology`` the exchanges on ``process_set`` run on (resolved
        once per set, ``tf_ops.twolevel.check_topology``; a two-level one makes the session's
        transport for the set two-level). ValueError for a topology that cannot run there."""
        found = self._local.topologies.get(id(process_set))
        if found is None:
            found = check_topology(self._topology, process_set, self._transport)
            if not found.flat:
                self.session.use_topology(found, process_set)
            self._local.topologies[id(process_set)] = found
        return found

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
        set, else a ValueError on every rank (``grouping.cached_cost_model``); and the topology on
        ``process_set`` (``topology_for``: a bad one raises here). Returns the model."""
        self.topology_for(process_set)
        if self._cost_model is None and (needs_cost_model(self._schedule) or self._alternatives):
            model = cached_cost_model(world_size, process_set, use_horovod=self._transport is None)
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
        process_set = args[3]

        def pending():
            return self.policy.pending(_Host(self, *args))
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
        self.policy.finish_flush(_Host(self, *self._local.last_args), corrections, variables, optimizer,
                                 apply_gradients if apply_gradients is not None else optimizer.apply_gradients)

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
        self.session.set_epoch(epoch)

    @property
    def stats(self) -> WireStats:
        """Bytes this rank handed to the collectives, per step and in total, next to dense."""
        return self.session.stats

    def reset_stats(self) -> None:
        self.session.reset_stats()

    def add_sent(self, sent, dense_bytes) -> None:
        """Count exchanges run beside this object's (the sparse gradients' allgathers) in ``stats``:
        ``sent`` bytes handed to the collectives, ``dense_bytes`` uncompressed, added to the step's."""
        self.session.add(sent, dense_bytes)

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
        Horovod; a caller that runs the collectives itself (a lockstep test world) may drive them."""
        grads = list(grads)
        for i, g in enumerate(grads):
            if g is not None and not g.shape.is_fully_defined():
                raise ValueError(f"gradient {i} has shape {tuple(g.shape)}, not fully known when traced; "
                                 "compressed exchange needs static shapes")
        session = self.session
        self.topology_for(process_set)
        groups = self._groups(grads, world_size, process_set)
        session.ensure_slots(self.slots, grads, groups)
        check = session.check_spec()
        restored = session.restored.pending.read_value()
        step = session.step.read_value()
        density = session.step_density(step)
        rank = rank_in(process_set)
        gens, names, states = [], [], []
        for group in groups:
            with tf.control_dependencies(check):
                x = flatten([grads[i] for i in group.positions])
            if prescale != 1.0:
                x = x * tf.cast(prescale, x.dtype)
            state = session.group_state(self.slots, group)
            where = f"gradient {group.positions[0]}" if len(group.positions) == 1 else \
                f"gradients {', '.join(map(str, group.positions))}"
            if group.codec is None and len(group.positions) > 1 and self._compressor.merge == LAYERWISE:
                raise AssertionError(f"hvdcompress: '{self._spec}' never merges, yet group {group.key} holds "
                                     f"{len(group.positions)} gradients")
            gens.append(session.start(x, key=group.key, step=step, world_size=world_size, scale=scale, state=state,
                                      shape=group.shape, rank=rank, members=group.layout, density=density,
                                      codec=group.codec, restored=restored, where=where,  # codec: the plan's
                                      process_set=process_set))
            names.append(exchange_name(self.name, group.op_name))
            states.append(state)
        return PendingExchange(self.slots, session, grads, groups, states, gens, names)

    def _exchange(self, grads, world_size, scale, prescale, process_set):
        return self.policy.step(_Host(self, world_size, scale, prescale, process_set), grads)

    def exchange_now(self, grads, world_size, scale, prescale, process_set) -> List[Optional[tf.Tensor]]:
        """The synchronous compressed exchange of ``grads`` (what a sync policy's host exchanges with):
        started, run on the session's transport and finished."""
        pending = self.start_exchange(grads, world_size=world_size, scale=scale, prescale=prescale,
                                      process_set=process_set)
        results, sent = self.session.run(pending.generators, pending.names, process_set)
        return pending.finish(results, sent)

    def __repr__(self) -> str:
        return f"GradientCompression('{self._spec}', name={self.name!r}, schedule={self.schedule!r})"


class PendingExchange:
    """What ``GradientCompression.start_exchange`` returns (see there)."""

    def __init__(self, slots, session: ExchangeSession, grads, groups, states, generators, names):
        self._slots, self._session = slots, session
        self.grads, self.groups, self.states = grads, groups, states
        self.generators, self.names = generators, names

    def finish(self, results: Sequence[tf.Tensor], sent) -> List[Optional[tf.Tensor]]:
        """``results``: each generator's return value, in order; ``sent``: bytes this rank handed
        to the collectives (int or int64 tensor). Returns the gradients (None stays None): the
        groups' results split back per position, merged groups' state saved into the slots, the
        exchange counted on the session's clock and stats."""
        grads, session = self.grads, self._session
        out: List[Optional[tf.Tensor]] = [None] * len(grads)
        dense_bytes = 0
        for group, state, r in zip(self.groups, self.states, results):
            for i, t in zip(group.positions, split(r, group)):
                out[i] = tf.cast(t, grads[i].dtype)
                dense_bytes += grads[i].shape.num_elements() * grads[i].dtype.size
            session.save_group_state(self._slots, group, state)
        session.restored.done([r for r in results if r is not None])
        session.step.assign_add(1)
        session.count(sent, dense_bytes)
        return out

