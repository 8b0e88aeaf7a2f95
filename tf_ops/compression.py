"""``GradientCompression``: the compressed exchange of a list of gradients, and its state.

One object per model (per list of variables), created once, outside the training step::

    compression = hvc.GradientCompression("topk:ratio=0.01")
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, compression=compression)

It is a ``tf.Module``; what it tracks is what a checkpoint saves and restores:

    step        exchanges so far (seeds random-k's indices and DGC's sampling offset)
    epoch       the epoch last given to ``set_epoch``
    density     fraction of entries ratio-based compressors send now (the warm-up moves it)
    spec_text   the compression spec as text, checked against this object's before each exchange
    slots[i]    the flat state variables of the i-th gradient (residual; DGC's u and v)

Gradients are identified by their position in the list, so the same model code restores the same
state whatever its variables are called. State variables are created, zero, the first time a
gradient is seen (lifted out of any ``tf.function`` with ``tf.init_scope``, as Keras creates optimizer
slots); a checkpoint restored before that is applied when they are created.

``exchange`` builds, for every gradient, the compressor's exchange generator and drives them all
(``tf_ops.collectives.run_exchanges``). Called eagerly, it runs the exchange as a ``tf.function``
(traced once per gradient signature) so the collectives are issued together, as Horovod does.
The bytes handed to the collectives and the dense size are counted per step (``stats``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from hvdcompress.spec import CompressionSpec, resolve
from hvdcompress.stats import WireStats

from .collectives import HorovodDriver, run_exchanges
from .compressors import ExchangeContext, build_compressor


class _Local:
    """Per-process things a checkpoint must not hold (plain object: not tracked)."""

    def __init__(self):
        self.functions: Dict[tuple, tf.types.experimental.GenericFunction] = {}
        self.drivers: Dict[int, object] = {}
        with tf.init_scope():
            def counter(name):
                return tf.Variable(0, dtype=tf.int64, trainable=False, name=name)

            self.steps = counter("stats_steps")
            self.last_bytes, self.total_bytes = counter("stats_last_bytes"), counter("stats_total_bytes")
            self.last_dense, self.total_dense = counter("stats_last_dense"), counter("stats_total_dense")


class GradientCompression(tf.Module):
    """Compression spec + compressor + the state it keeps between steps (see module doc).

    Args:
        compression: a spec string (``"topk:ratio=0.01"``), ``hvdcompress.Compression.<name>(...)``,
            or Horovod's ``Compression.none`` / ``Compression.fp16``. Default: no compression.
        name: prefix of the collectives' names (Horovod matches ops across ranks by name); give
            two objects used in the same step different names.
        driver: the communicator carrying out collective requests (default: Horovod's, on the
            process set the wrapper passes).
    """

    def __init__(self, compression=None, name: str = "hvc", driver=None):
        spec = resolve(compression)
        super().__init__(name=name)
        self._spec = spec
        self._compressor = build_compressor(spec)
        self._driver = driver
        self._local = _Local()
        with tf.init_scope():
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            self.spec_text = tf.Variable(str(spec), dtype=tf.string, trainable=False, name="spec")
            self._density = (tf.Variable(self._compressor.scheduled_density(0), dtype=tf.float64,
                                         trainable=False, name="density")
                             if self._compressor.has_density else None)
        self.slots: List[Dict[str, tf.Variable]] = []

    # -- what users read and set -------------------------------------------------------------
    @property
    def compression(self) -> CompressionSpec:
        return self._spec

    @property
    def compressor(self):
        return self._compressor

    @property
    def stateful(self) -> bool:
        """True when the exchange keeps state between steps (then one object must serve every step)."""
        return self._compressor.stateful

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
        if not tf.executing_eagerly():
            return self._exchange(grads, world_size, scale, prescale, process_set)
        key = (world_size, float(scale), float(prescale), id(process_set))
        fn = self._local.functions.get(key)
        if fn is None:
            def traced(gs):
                return self._exchange(gs, world_size, scale, prescale, process_set)
            fn = self._local.functions[key] = tf.function(traced)
        return fn(grads)

    def _driver_for(self, process_set):
        if self._driver is not None:
            return self._driver
        drv = self._local.drivers.get(id(process_set))
        if drv is None:
            drv = self._local.drivers[id(process_set)] = HorovodDriver(process_set)
        return drv

    def _ensure_slots(self, grads) -> None:
        for i, g in enumerate(grads):
            if i == len(self.slots):
                self.slots.append({})
            if g is None:
                continue
            shape = tuple(g.shape)
            if not g.shape.is_fully_defined():
                raise ValueError(f"gradient {i} has shape {shape}, not fully known when traced; "
                                 "compressed exchange needs static shapes")
            numel = g.shape.num_elements()
            slots = self.slots[i]
            for name in self._compressor.state_slots(shape):
                var = slots.get(name)
                if var is None:
                    slots[name] = self._compressor.make_slot(name, numel, g.dtype, f"{self.name}_{i}_{name}")
                elif tuple(var.shape) != (numel,) or var.dtype != g.dtype:
                    raise ValueError(
                        f"compression state: gradient {i} has {numel} elements of {g.dtype.name}, its "
                        f"state '{name}' has {var.shape.num_elements()} of {var.dtype.name}; one "
                        "GradientCompression serves one list of variables (a checkpoint of another model?)")

    def _exchange(self, grads, world_size, scale, prescale, process_set):
        self._ensure_slots(grads)
        check = tf.debugging.assert_equal(
            self.spec_text, str(self._spec),
            message=f"compression state was saved with another compression spec; this object uses "
                    f"'{self._spec}' (restore a checkpoint made with the same spec)")
        step = self.step.read_value()
        density = None if self._density is None else self._density.read_value()
        gens, names, present = [], [], []
        dense_bytes = 0
        for i, g in enumerate(grads):
            if g is None:
                continue
            with tf.control_dependencies([check]):
                x = tf.reshape(g, [-1])
            if prescale != 1.0:
                x = x * tf.cast(prescale, x.dtype)
            ctx = ExchangeContext(str(i), step, world_size, scale, self.slots[i], tuple(g.shape),
                                  0, density)
            gens.append(self._compressor.exchange(x, ctx))
            names.append(f"{self.name}.{i}")
            present.append(i)
            dense_bytes += g.shape.num_elements() * g.dtype.size
        results, sent = run_exchanges(gens, names, self._driver_for(process_set))
        out: List[Optional[tf.Tensor]] = [None] * len(grads)
        for i, r in zip(present, results):
            out[i] = tf.reshape(tf.cast(r, grads[i].dtype), tf.shape(grads[i]))
        self.step.assign_add(1)
        loc = self._local
        loc.steps.assign_add(1)
        loc.last_bytes.assign(sent)
        loc.total_bytes.assign_add(sent)
        loc.last_dense.assign(dense_bytes)
        loc.total_dense.assign_add(dense_bytes)
        return out

    def __repr__(self) -> str:
        return f"GradientCompression('{self._spec}', name={self.name!r})"

