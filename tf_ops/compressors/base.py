"""The compressor contract, in TensorFlow (the same three roles as ``torch_ops``).

* **Compressor** -- pure functions of (tensor, state): encode a flat tensor into a payload, say how
  the payload travels, turn what comes back into a dense tensor. Never touches Horovod.
* **Memory** (``tf_ops.memory``) -- what must survive between steps (the error-feedback residual,
  DGC's momenta): flat ``tf.Variable`` s in ``ExchangeContext.state``. A compressor names the
  variables it needs (``state_slots``); ``GradientCompression`` creates them, zero, outside any
  ``tf.function`` and tracks them for checkpoints.
* **Communicator** (``tf_ops.collectives``) -- carries out the requests an exchange yields.

An *exchange* is a generator::

    def exchange(self, x, ctx):             # x: flat gradient
        ...                                 # compress, update memory
        results = yield (Allgather(values), Allgather(indices))   # one round
        ...                                 # may yield again (multi-round compressors)
        return dense_sum * ctx.scale        # every rank returns the same tensor

Under ``tf.function`` it runs once, while tracing: the code between yields builds graph ops, and
data-dependent choices are TF ops (``tf.cond`` / ``tf.while_loop``), never Python branches on
tensor values. The ``step`` and ``density`` of the context may therefore be tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import numpy as np
import tensorflow as tf

from hvdcompress.contract import ELEMENTWISE, ExchangeContext, Member, Registered
from hvdcompress.spec import CompressionSpec, info_for, num_selected

from ..collectives import Allgather, Allreduce, Exchange
from ..memory import Memory, memory_for
from ..variables import state_variable

Scalar = Union[int, float, tf.Tensor]


COMPRESSORS: Dict[str, Type["Compressor"]] = {}


def selected_count(density: Scalar, numel: int) -> Scalar:
    """k = ceil(density * numel), as ``hvdcompress.spec.num_selected`` computes it, for a Python
    density (a Python int) or a float64 tensor (an int32 tensor, the same value: the same IEEE
    double operations in the same order)."""
    if not tf.is_tensor(density):
        return num_selected(float(density), numel)
    if numel <= 0:
        return tf.constant(0, tf.int32)
    x = tf.cast(density, tf.float64) * float(numel)
    k = tf.math.ceil(x - 1e-9 * x)
    return tf.cast(tf.clip_by_value(k, 1.0, float(numel)), tf.int32)


class Compressor(Registered, ABC):
    """Base of every compressor: holds the validated spec; subclasses define ``exchange``.

    As in ``torch_ops``: a subclass names the registered algorithm it implements (``name =
    "topk"``) and is registered by doing so; the optimizers call the hooks below generically.
    TF-only members, forced by graph mode and by Keras: ``uses_step`` / ``stateful`` (whether a
    step counter and variables must exist before tracing), ``has_schedule`` / ``scheduled_density``
    (the density is a variable the warm-up callback moves), ``state_slots`` / ``make_slot`` (state
    is flat variables created outside ``tf.function``).
    """

    registry = COMPRESSORS
    summed: bool = True
    horovod_codec: Any = None  # the codec Horovod's own optimizers use, for a spec declared horovod_codec=True
    uses_step: bool = False  # True: the result depends on ctx.step (seeded selections)
    has_schedule: bool = False  # True: the spec sets the density per epoch (warm-up)
    shared_slots: Tuple[str, ...] = ()  # state slots every rank holds identically (Horovod Elastic syncs them from rank 0)

    @classmethod
    def _check_name(cls, name: str) -> None:
        info_for(name)  # the algorithm must be declared (ValueError otherwise)

    def __init__(self, spec: CompressionSpec):
        self.spec = spec

    @property
    def merge(self) -> str:
        """How its tensors may be merged (``hvdcompress.spec`` ELEMENTWISE / PER_MEMBER / LAYERWISE)."""
        return self.spec.info.merge

    @property
    def elementwise_state(self) -> bool:
        """Every state variable has one entry per element, so merged groups join the members'
        state and split it back (``tf_ops.grouping``)."""
        return self.merge == ELEMENTWISE

    @property
    def warmup_epoch_steps(self) -> Optional[int]:
        """For compressors whose density follows the epoch (a warm-up in the spec): the epoch
        length, in steps, used when ``set_epoch`` is never called; None: no warm-up."""
        return self.spec.params.get("warmup_epoch_steps") if self.has_schedule else None

    def local_momentum(self) -> Optional[Tuple[float, bool]]:
        """(momentum, nesterov) when the compressor keeps the training's momentum in its memory:
        delayed averaging (``tf_ops.delayed``) gives the local steps the same momentum. Default None."""
        return None

    @classmethod
    def adapt_optimizer(cls, spec: CompressionSpec, config: Dict[str, Any]) -> Tuple[CompressionSpec, Dict[str, Any]]:
        """Called once when a Keras optimizer is wrapped, with its ``get_config()``: may take
        settings over (DGC takes SGD's momentum) and returns (spec, config to rebuild it from).
        Raises ValueError for what cannot be honoured. Default: nothing to adapt."""
        return spec, config

    @property
    def has_density(self) -> bool:
        """Ratio-based: the density can change during training (warm-up)."""
        return "ratio" in self.spec.params

    def scheduled_density(self, epoch: int) -> float:
        """The density the spec asks for during ``epoch`` (0-based)."""
        return self.spec["ratio"]

    def density(self, ctx: ExchangeContext) -> Scalar:
        return ctx.density if ctx.density is not None else self.scheduled_density(ctx.epoch)

    def state_slots(self, shape: Tuple[int, ...]) -> Tuple[str, ...]:
        """Names of the flat variables (as large as the tensor) this compressor keeps."""
        return ()

    def initial_value(self, slot: str) -> float:
        """The value every entry of state variable ``slot`` starts at."""
        return 0.0

    def slot_numel(self, slot: str, shape: Tuple[int, ...]) -> int:
        """Entries of flat state variable ``slot`` for a tensor of ``shape``: the tensor's size for
        elementwise state (residuals, momenta); a compressor with other state (a low-rank factor,
        a sketch table) says its size here (and declares merge=PER_MEMBER or LAYERWISE)."""
        numel = 1
        for d in shape:
            numel *= int(d)
        return numel

    def make_slot(self, slot: str, numel: int, dtype: Any, name: Optional[str] = None) -> tf.Variable:
        """One zero-initialised (see ``initial_value``) flat state variable, created eagerly."""
        # the fill value goes through numpy: TF's eager cache of scalar constants keys them by
        # value, and -0.0 == 0.0, so tf.constant(-0.0) can return an earlier +0.0 (order-dependent)
        dtype = tf.as_dtype(dtype)
        def initial():
            return tf.fill([numel], tf.constant(np.asarray(self.initial_value(slot), dtype=dtype.as_numpy_dtype)))
        return state_variable(initial, trainable=False, name=name or slot)

    @property
    def stateful(self) -> bool:
        """Needs state that outlives one step (variables, or the step counter)."""
        return self.uses_step

    def new_state(self, shape: Tuple[int, ...], dtype: Any) -> Dict[str, tf.Variable]:
        """Zero variables for a tensor of ``shape`` (created eagerly, outside any tf.function)."""
        return {name: self.make_slot(name, self.slot_numel(name, tuple(shape)), dtype)
                for name in self.state_slots(tuple(shape))}

    @abstractmethod
    def exchange(self, x: tf.Tensor, ctx: ExchangeContext) -> Exchange:
        """Generator: yields rounds of requests, returns the dense result (see module doc)."""

    # -- a group the planner sends dense or in fp16 instead (tf_ops.codec_choice) ---------------
    @property
    def can_send_dense(self) -> bool:
        """Whether ``dense_send`` is defined for this spec (as in ``torch_ops``)."""
        return True

    def dense_send(self, x: tf.Tensor, ctx: ExchangeContext) -> Tuple[tf.Tensor, Optional[str]]:
        """(the dense tensor to allreduce instead of this compressor's payload, the state slot that
        carries what a lossy cast leaves out, or None): error feedback sends ``g + r`` and zeroes
        the residual (``hvdcompress.reference.fallback``)."""
        r = ctx.state.get("residual")
        if r is None:
            return x, None
        a = x + r.read_value()
        r.assign(tf.zeros_like(a))
        return a, "residual"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"


class TakesMomentum:
    """Mixin for compressors that keep the momentum in their memory (DGC, the count sketch,
    efsignsgd and onebit): a
    Keras SGD config's momentum moves into the spec (``hvdcompress.momentum``) and the optimizer
    is rebuilt with momentum 0. Keras's decoupled ``weight_decay`` stays with the optimizer (it
    never goes through the momentum, in dense training either); Keras's gradient clipping, which
    would clip the exchanged velocity, is refused (``check_keras_config``)."""

    def local_momentum(self) -> Optional[Tuple[float, bool]]:
        from hvdcompress.momentum import momentum_of

        m = momentum_of(self.spec)
        return (m, bool(self.spec.params.get("nesterov", False))) if m > 0.0 else None

    def dense_send(self, x, ctx):
        """The momentum stays local: ``u = m*u + g``, send ``u`` (Nesterov: ``g + m*u``) plus the
        velocity ``v`` not sent yet, ``v`` zeroed (``hvdcompress.reference.fallback``)."""
        m, nesterov = self.local_momentum() or (0.0, False)
        m = tf.cast(m, x.dtype)
        u = ctx.state["u"]
        u_new = u * m + x
        u.assign(u_new)
        send = x + u_new * m if nesterov else u_new
        v = ctx.state.get("v")
        if v is None:
            return send, None
        send = send + v.read_value()
        v.assign(tf.zeros_like(send))
        return send, "v"

    @classmethod
    def adapt_optimizer(cls, spec, config):
        from hvdcompress.momentum import check_keras_config, take_over_momentum

        momentum = config.get("momentum", 0.0)
        if not isinstance(momentum, (int, float)) or momentum == 0:
            check_keras_config(spec, config)
            return spec, config
        new = take_over_momentum(spec, [(momentum, config.get("nesterov", False))])
        check_keras_config(new, config)
        config = dict(config, momentum=0.0)
        if "nesterov" in config:
            config["nesterov"] = False
        return new, config


def scaled(total: tf.Tensor, scale: float) -> tf.Tensor:
    """total * scale, the scale rounded to the tensor's dtype first (as torch and numpy do)."""
    return total if scale == 1.0 else total * tf.cast(scale, total.dtype)


class OneRoundCompressor(Compressor):
    """A compressor whose exchange is one round of one kind of collective.

    Subclasses define ``select`` (what to send, e.g. indices; None for dense codecs), ``compress``
    (flat tensor -> payload tuple), ``decompress`` (own payload -> dense), ``unsent`` (optional:
    a - D(C(a)), the residual) and ``aggregate`` (collective results -> dense sum over ranks).
    Error feedback, when the spec asks for it, is wrapped around them here, once for all, with
    the memory interface of ``torch_ops`` (``compensate``, ``update(unsent)``).

    The one difference from ``torch_ops.compressors.OneRoundCompressor``, forced by graph mode: the
    selection is an explicit value ``sel`` passed to every method, where the PyTorch methods may
    recompute or cache it (under ``tf.function`` the methods run once, at trace time, and a
    cached Python value would freeze the first step's selection into the graph).
    """

    def __init__(self, spec: CompressionSpec):
        super().__init__(spec)
        self.memory: Memory = memory_for(spec)

    def state_slots(self, shape):
        return self.memory.slots

    def initial_value(self, slot):
        return self.memory.initial

    @property
    def stateful(self) -> bool:
        return self.uses_step or bool(self.memory.slots)

    def select(self, a: tf.Tensor, ctx: ExchangeContext) -> Any:
        return None

    @abstractmethod
    def compress(self, a: tf.Tensor, sel: Any, ctx: ExchangeContext) -> Tuple[tf.Tensor, ...]:
        """Flat tensor -> the payload tensors this rank puts on the wire."""

    @abstractmethod
    def decompress(self, payload: Tuple[tf.Tensor, ...], like: tf.Tensor, sel: Any,
                   ctx: ExchangeContext) -> tf.Tensor:
        """This rank's own payload -> the dense tensor it stands for (shape and dtype of like)."""

    def unsent(self, payload: Tuple[tf.Tensor, ...], a: tf.Tensor, sel: Any, ctx: ExchangeContext) -> tf.Tensor:
        """What this rank's payload leaves out of ``a``: a - D(C(a)), the error-feedback residual
        (the same hook as torch_ops'; a compressor may compute it more cheaply)."""
        return a - self.decompress(payload, a, sel, ctx)

    @abstractmethod
    def aggregate(self, results: Tuple[tf.Tensor, ...], like: tf.Tensor, sel: Any,
                  ctx: ExchangeContext) -> tf.Tensor:
        """Collective results -> the dense sum over ranks."""

    def exchange(self, x, ctx):
        a = self.memory.compensate(x, ctx.state)
        sel = self.select(a, ctx)
        payload = self.compress(a, sel, ctx)
        self.memory.update(lambda: self.unsent(payload, a, sel, ctx), ctx.state)
        same = self.spec.info.same_shape
        results = yield tuple(Allreduce(t) if self.summed else Allgather(t, same) for t in payload)
        return scaled(self.aggregate(results, a, sel, ctx), ctx.scale)
