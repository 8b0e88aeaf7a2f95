"""The exchange session: what every TensorFlow front end shares, owned once.

A front end (``GradientCompression``, which the tape and the Keras optimizer wrap, and ``DiLoCo``)
translates its framework's events (``apply_gradients``, an outer step) into calls on one
``ExchangeSession``, which owns

* the compressor, built once from the spec;
* starting an exchange (``start``): its context, the compressor's exchange (or a per-group
  codec's, ``tf_ops.codec_choice``), the non-finite guard (``tf_ops.nonfinite``), named by
  ``exchange_name`` (Horovod matches collectives by name, so names are the same on every rank);
  ``run`` drives the started exchanges on the transport (``tf_ops.collectives.run_exchanges``);
* compression state: positional slot variables (``tf_ops.slots``; ``ensure_slots`` /
  ``group_state`` / ``save_group_state``) or one state per tensor (``new_state``), created here;
* the clock: ``make_clock`` creates the exchange counter, epoch, density and spec variables a
  ``GradientCompression`` checkpoints (``set_epoch``, ``step_density``, ``check_spec``);
  ``counter`` makes the others (DiLoCo's inner steps and rounds);
* the wire statistics (``count`` once per step, ``add`` for exchanges beside it; ``stats``);
* the checkpoint helpers: the restore marker (a restored state is checked finite by the next
  exchange) and the spec check.

TensorFlow tracks what a checkpoint saves by the attribute path from the saved object, so the
session is a plain object (not tracked) and a front end keeps the variables it saves under its
own attribute names (``self.step = session.step``): the saved format is the front end's.

The transport is the one given, or a Horovod ``Communicator`` per process set, or, for a set a
front end made two-level (``use_topology``), a ``tf_ops.twolevel.TwoLevelTransport``: ``start``
then composes the two-level exchange around the compressor's (dense inside a node, the spec
across nodes), and the stats count the payload per hop (``stats.last_hop_bytes`` /
``total_hop_bytes``).
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from hvdcompress.spec import CompressionSpec
from hvdcompress.stats import WireStats

from .codec_choice import fallback_exchange
from .collectives import Communicator, run_exchanges
from .compressors import ExchangeContext, build_compressor
from .nonfinite import RestoreMarker, guard
from .slots import ensure_slots, group_state, step_density
from .grouping import Group, split_state
from .variables import state_variable

State = Dict[str, tf.Variable]


def exchange_name(*parts) -> str:
    """The name of an exchange: ``<part>.<part>...`` (the transport appends round and request)."""
    return ".".join(map(str, parts))


def rank_in(process_set) -> int:
    """This process's index in ``process_set`` (0 without Horovod: lockstep tests set no set)."""
    try:
        import horovod.tensorflow as hvd
        if not hvd.is_initialized():
            return 0
        return int((process_set if process_set is not None else hvd.global_process_set).rank())
    except (ImportError, ValueError):
        return 0


def _counter(name: str, value=0) -> tf.Variable:
    return state_variable(value, dtype=tf.int64, trainable=False, name=name)


class ExchangeSession:
    """Compressor, state, clock, exchanges, stats and checkpoint helpers of one TF front end.

    ``spec``: the resolved spec; ``compressor``: the one built from it when the caller already
    has it (built here otherwise); ``transport``: carries the requests (None: Horovod's
    ``Communicator`` on the process set of each call); ``prefix``: the front end's name, which
    prefixes its exchanges' and its slot variables' names.
    """

    def __init__(self, spec: CompressionSpec, *, compressor=None, transport=None, prefix: str = "hvc"):
        self.spec = spec
        self.compressor = compressor if compressor is not None else build_compressor(spec)
        self.prefix = prefix
        self._transport = transport
        self._transports: Dict[int, object] = {}
        self.restored = RestoreMarker()  # a restore makes the next exchange check the state is finite
        self.step: Optional[tf.Variable] = None
        self.epoch: Optional[tf.Variable] = None
        self.epoch_set: Optional[tf.Variable] = None
        self.spec_text: Optional[tf.Variable] = None
        self.density: Optional[tf.Variable] = None
        self._warned_epoch = False
        self.scratch: Dict[tuple, tf.Variable] = {}  # merged groups' working state (not checkpointed)
        self._steps = _counter("stats_steps")
        self._last_bytes, self._total_bytes = _counter("stats_last_bytes"), _counter("stats_total_bytes")
        self._last_dense, self._total_dense = _counter("stats_last_dense"), _counter("stats_total_dense")
        self._hop_counters: Optional[Dict[str, Tuple[tf.Variable, tf.Variable]]] = None  # level -> (last, total)
        self._hops: Optional[Dict[str, tf.Tensor]] = None  # the hop bytes of the exchanges run, until counted

    # -- the transport -------------------------------------------------------------------------------
    def transport(self, process_set=None):
        """The transport given, else Horovod's ``Communicator`` on ``process_set`` (one per set)."""
        if self._transport is not None:
            return self._transport
        found = self._transports.get(id(process_set))
        if found is None:
            found = self._transports[id(process_set)] = Communicator(process_set)
        return found

    def use_topology(self, topology, process_set=None):
        """Exchanges on ``process_set`` go two-level on ``topology`` (a two-level
        ``hvdcompress.topology.Topology`` that ``tf_ops.twolevel.check_topology`` accepted): the
        set's transport becomes a ``TwoLevelTransport`` over its node and cross-node process sets
        (made here, on every rank in the same order). Returns that transport."""
        from .twolevel import two_level_transport
        found = self._transports.get(id(process_set))
        if found is None or getattr(found, "topology", None) != topology:
            found = self._transports[id(process_set)] = two_level_transport(process_set, topology, self.compressor)
        if self._hop_counters is None:
            self._hop_counters = {level: (_counter(f"stats_last_{level}"), _counter(f"stats_total_{level}"))
                                  for level in ("local", "cross")}
        return found

    # -- the clock -----------------------------------------------------------------------------------
    def make_clock(self) -> None:
        """Create the exchange counter ``step``, ``epoch``, ``epoch_set`` (set_epoch was called:
        the warm-up follows it, else it counts epochs of warmup_epoch_steps), ``spec_text`` and,
        for a ratio-based compressor, ``density``."""
        self.step = state_variable(0, dtype=tf.int64, trainable=False, name="step")
        self.epoch = state_variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self.spec_text = state_variable(str(self.spec), dtype=tf.string, trainable=False, name="spec")
        self.epoch_set = state_variable(False, trainable=False, name="epoch_set")
        self.density = (state_variable(self.compressor.scheduled_density(0), dtype=tf.float64,
                                       trainable=False, name="density")
                        if self.compressor.has_density else None)

    @staticmethod
    def counter(name: str, value=0) -> tf.Variable:
        """An int64 variable of the clock (created outside any tf.function)."""
        return _counter(name, value)

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch: epoch must be an int >= 0; got {epoch!r}")
        self.epoch.assign(epoch)
        self.epoch_set.assign(True)
        if self.density is not None and self.compressor.has_schedule:
            self.density.assign(self.compressor.scheduled_density(epoch))

    def step_density(self, step):
        """The density of the exchange at ``step`` (``slots.step_density``); None without a ratio."""
        if self.density is None:
            return None
        self._warned_epoch, density = step_density(self.compressor, self.spec, self.density, self.epoch_set, step,
                                                   self._warned_epoch)
        return density

    def check_spec(self) -> List[tf.Operation]:
        """An assertion that the restored state was saved with this spec (run before an exchange)."""
        return [tf.debugging.assert_equal(
            self.spec_text, str(self.spec),
            message=f"compression state was saved with another compression spec; this object uses "
                    f"'{self.spec}' (restore a checkpoint made with the same spec)")]

    # -- compression state -----------------------------------------------------------------------
    def ensure_slots(self, slots: List[State], grads, groups: Sequence[Group]) -> None:
        """Create the positional slots ``groups`` need (``tf_ops.slots.ensure_slots``)."""
        ensure_slots(self.compressor, slots, grads, groups, self.prefix)

    def group_state(self, slots: List[State], group: Group) -> State:
        """The state the group's exchange works on (``tf_ops.slots.group_state``)."""
        return group_state(self.compressor, slots, self.scratch, group, self.prefix)

    @staticmethod
    def save_group_state(slots: List[State], group: Group, state: State) -> None:
        """After a merged group's exchange: its working state split back into the members' slots."""
        if len(group.positions) > 1:
            split_state(group, [slots[i] for i in group.positions], state)

    def new_state(self, shape: Tuple[int, ...], dtype) -> State:
        """Zero state for one tensor of ``shape`` (created outside any tf.function)."""
        return self.compressor.new_state(tuple(shape), dtype)

    # -- exchanges ---------------------------------------------------------------------------------
    def start(self, x: tf.Tensor, *, key: str, step, world_size: int, scale: float, state: State,
              shape: Tuple[int, ...], rank: int, members=(), density=None, codec: Optional[str] = None,
              restored=None, where: str = "a gradient", process_set=None):
        """The guarded exchange of the flat ``x``: its context, the compressor's exchange (or,
        with ``codec``, the group sent "none" / "fp16" by it), two-level where the transport of
        ``process_set`` is (``use_topology``), wrapped in the non-finite guard (a non-finite value
        on any rank makes the result NaN on every rank, never hidden)."""
        ctx = ExchangeContext(key, step, world_size, scale, state, shape, 0, rank, members, density=density)
        make = (self.compressor.exchange if codec is None else
                functools.partial(fallback_exchange, self.compressor, codec))
        compose = getattr(self._transports.get(id(process_set)), "compose", None) if self._transport is None else None
        exchange = make(x, ctx) if compose is None else compose(make, x, ctx, codec)
        return guard(exchange, x, state, restored, where)

    def run(self, gens, names: Sequence[str], process_set=None):
        """Drive the started exchanges on the transport: (results in order, bytes sent, int64). A
        two-level transport's bytes per hop wait for the next ``count``."""
        transport = self.transport(process_set)
        results, sent = run_exchanges(gens, names, transport)
        hops = getattr(transport, "take_hop_bytes", None)
        if hops is not None:
            self._hops = hops()
        return results, sent

    # -- stats -------------------------------------------------------------------------------------
    def count(self, sent, dense_bytes) -> None:
        """A step's exchanges are done: ``sent`` bytes handed to the collectives, ``dense_bytes``
        uncompressed."""
        self._steps.assign_add(1)
        self._last_bytes.assign(sent)
        self._total_bytes.assign_add(sent)
        self._last_dense.assign(dense_bytes)
        self._total_dense.assign_add(dense_bytes)
        if self._hop_counters is not None:
            hops, self._hops = self._hops or {}, None
            for level, (last, total) in self._hop_counters.items():
                value = hops.get(level, 0)
                last.assign(value)
                total.assign_add(value)

    def add(self, sent, dense_bytes) -> None:
        """Bytes of exchanges run beside the step's (sparse gradients), added to this step's."""
        self._hops = None  # they ran on the world's transport: no hop to count
        self._last_bytes.assign_add(sent)
        self._total_bytes.assign_add(sent)
        self._last_dense.assign_add(dense_bytes)
        self._total_dense.assign_add(dense_bytes)

    @property
    def stats(self) -> WireStats:
        return WireStats(steps=int(self._steps.numpy()), last_bytes=int(self._last_bytes.numpy()),
                         last_dense_bytes=int(self._last_dense.numpy()),
                         total_bytes=int(self._total_bytes.numpy()),
                         total_dense_bytes=int(self._total_dense.numpy()),
                         last_hop_bytes={k: int(last.numpy()) for k, (last, _) in (self._hop_counters or {}).items()},
                         total_hop_bytes={k: int(total.numpy()) for k, (_, total) in (self._hop_counters or {}).items()})

    def reset_stats(self) -> None:
        hops = [v for pair in (self._hop_counters or {}).values() for v in pair]
        for v in [self._steps, self._last_bytes, self._total_bytes, self._last_dense, self._total_dense] + hops:
            v.assign(0)


class Untracked:
    """Holds a value on a ``tf.Module`` without TensorFlow tracking it (a front end keeps its
    session this way and tracks the variables it saves under its own names)."""

    def __init__(self, value):
        self.value = value


__all__ = ["ExchangeSession", "Untracked", "exchange_name", "rank_in"]
