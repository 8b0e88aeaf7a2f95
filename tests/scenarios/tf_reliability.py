"""Worker code for tests/test_tf_reliability.py (TensorFlow/Keras on real Horovod): the fault
matrix (an inf and a NaN injected into one entry of one gradient on rank 1), Keras'
LossScaleOptimizer over our optimizer, a model that differs across ranks, and a checkpoint whose
compression state is not finite. TensorFlow is slow to import: one launch runs everything."""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from functools import partial

from scenarios import kit
from scenarios.launch import tf_graph_options

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

# The fault matrix under tf.function: one compressor per exchange kind and kind of state (each costs
# a trace per process): dense, gathered with a residual (top-k), summed sparse (random-k), DGC's
# momenta, signSGD's vote, PowerSGD's two rounds and factors, the sketch's tables. threshold,
# efsignsgd and qsgd (gathered, as top-k and signSGD) are in the PyTorch matrix
# (reliability.FAULT_SPECS).
FAULT_SPECS = ["none", "topk:ratio=0.05", "randomk:ratio=0.1,seed=2",
               "dgc:ratio=0.05,warmup_epochs=0,min_sparse_numel=64", "signsgd",
               "sketch:ratio=0.05,min_sketch_numel=64", "powersgd"]

INJECT = {2: float("inf"), 4: float("nan")}  # step -> the bad value rank 1 puts into one gradient entry
STEPS = 6
EAGER_SPECS = ("topk:ratio=0.05", "dgc:ratio=0.05,warmup_epochs=0,min_sparse_numel=64")
# The plain step and Keras' LossScaleOptimizer act on the exchanged gradients whatever made them:
# top-k (gathered, residual) and DGC (momentum taken over) in the default suite, signSGD's vote too
# in the extended tier (the fault matrix above runs it).
PLAIN_SPECS = ("topk:ratio=0.05",) + (("signsgd",) if kit.extended() else ())
LOSS_SCALE_SPECS = ("topk:ratio=0.05", "dgc:ratio=0.05,warmup_epochs=0,min_sparse_numel=64") + (
    ("signsgd",) if kit.extended() else ())


def _model(width=32, extra=False):
    """16 -> width (tanh) -> 4, with ``extra`` one more 4 -> 4 layer (a model that differs)."""
    return kit.keras_mlp((16, width, 4, 4) if extra else (16, width, 4), ("tanh", None))


_batch = partial(kit.np_batch, n=8, features=16, classes=4, stride=7)


def _poison(model):
    """A zero variable shaped as the first kernel; ``loss + sum(kernel * poison)`` adds it to that
    kernel's gradient, so setting one entry to inf/NaN injects a bad value before the exchange."""
    import tensorflow as tf
    return tf.Variable(tf.zeros_like(model.layers[0].kernel), trainable=False)


def _set_poison(poison, step):
    import horovod.tensorflow as hvd
    import numpy as np
    value = np.zeros(poison.shape, np.float32)
    if hvd.rank() == 1 and step in INJECT:
        value[2, 5] = INJECT[step]
    poison.assign(value)


def _identical_finite(variables, name):
    import numpy as np
    rows = kit.tf_gather_flat(variables, name)
    finite = bool(np.isfinite(rows).all())
    return finite, bool(finite and all(np.array_equal(rows[0], r) for r in rows))


def _state_finite(compression):
    import numpy as np
    return all(bool(np.isfinite(v.numpy()).all()) for slots in compression.slots for v in slots.values()
               if v.dtype.is_floating)


def tape_faults(spec, graph=True) -> dict:
    """The AMP-style skip with the tape: exchange, check that every gradient is finite, apply
    only then. Records, per injected step, whether every rank saw the bad value."""
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    model = _model()
    poison = _poison(model)
    opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(model.trainable_variables)  # its slots now: made in the step's first trace, they would trace it twice
    comp = hvc.GradientCompression(spec)
    loss_fn = kit.keras_loss()

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) + tf.reduce_sum(model.layers[0].kernel * poison)
        tape = hvc.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, model.trainable_variables)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])

        def apply():
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return tf.constant(True)
        return tf.cond(finite, apply, lambda: tf.constant(False))
    fn = tf.function(step_fn) if graph else step_fn
    seen, skipped, state_finite = [], 0, True
    for step in range(STEPS):
        _set_poison(poison, step)
        applied = bool(fn(*_batch(hvc.rank(), step)))
        skipped += not applied
        if step in INJECT:
            seen.append(not applied)
        state_finite = state_finite and _state_finite(comp)
    finite, identical = _identical_finite(model.trainable_variables, f"check.tape.{spec}.{graph}")
    return {"seen": seen, "skipped": skipped, "state_finite": state_finite, "params_finite": finite,
            "identical": identical}


def plain_step_applies_it(spec) -> dict:
    """Without a check (plain step), the bad value reaches the parameters on every rank, as with
    Horovod's dense allreduce."""
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    model = _model()
    poison = _poison(model)
    opt = tf.keras.optimizers.SGD(0.05)
    opt.build(model.trainable_variables)  # its slots now: made in the step's first trace, they would trace it twice
    comp = hvc.GradientCompression(spec)
    loss_fn = kit.keras_loss()

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) + tf.reduce_sum(model.layers[0].kernel * poison)
        tape = hvc.DistributedGradientTape(tape, compression=comp)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    for step in range(4):
        _set_poison(poison, step)
        step_fn(*_batch(hvc.rank(), step))
    finite, _ = _identical_finite(model.layers[0].trainable_variables, f"check.plain.{spec}")
    return {"params_finite": finite, "state_finite": _state_finite(comp)}


def loss_scale(spec) -> dict:
    """model.fit with tf.keras.mixed_precision.LossScaleOptimizer over our DistributedOptimizer:
    the injected steps are skipped on every rank (the loss scale halves), training goes on."""
    import hvdcompress.keras as hvc
    import numpy as np
    import tensorflow as tf
    model = _model()
    poison = _poison(model)
    model.add_loss(lambda: tf.reduce_sum(model.layers[0].kernel * poison))
    inner = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), compression=spec)
    opt = tf.keras.mixed_precision.LossScaleOptimizer(inner, initial_scale=2.0 ** 10)
    model.compile(optimizer=opt, loss=kit.keras_loss())
    scales, unchanged = [], []
    for step in range(STEPS):
        _set_poison(poison, step)
        before = kit.tf_flat(model.trainable_variables).numpy()
        model.train_on_batch(*_batch(hvc.rank(), step))
        scales.append(float(opt.loss_scale.numpy()))
        unchanged.append(bool(np.array_equal(before, kit.tf_flat(model.trainable_variables).numpy())))
    finite, identical = _identical_finite(model.trainable_variables, f"check.lso.{spec}")
    return {"scales": scales, "unchanged": unchanged, "state_finite": _state_finite(inner.gradient_compression),
            "params_finite": finite, "identical": identical}


def checkpoint_refused() -> dict:
    """Rank 1's saved residual holds a NaN: the first exchange after restoring fails on both ranks
    (naming the state), instead of one rank failing and the other waiting."""
    import horovod.tensorflow as hvd
    import hvdcompress.tensorflow as hvc
    import numpy as np
    import tensorflow as tf
    model = _model()
    comp = hvc.GradientCompression("topk:ratio=0.05")
    loss_fn = kit.keras_loss()

    def make_step(c):
        @tf.function
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            return hvc.DistributedGradientTape(tape, compression=c).gradient(loss, model.trainable_variables)
        return step_fn
    make_step(comp)(*_batch(hvd.rank(), 0))
    if hvd.rank() == 1:
        r = comp.slots[0]["residual"]
        r.assign(tf.tensor_scatter_nd_update(r, [[3]], [np.float32(np.nan)]))
    path = tf.train.Checkpoint(compression=comp).save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    fresh = hvc.GradientCompression("topk:ratio=0.05")
    tf.train.Checkpoint(compression=fresh).restore(path)
    try:
        make_step(fresh)(*_batch(hvd.rank(), 1))
        refused = None
    except tf.errors.InvalidArgumentError as e:
        refused = str(e)
    after = float(hvd.allreduce(tf.ones([1]), name="still.works").numpy()[0])
    return {"refused": bool(refused and "restored compression state" in refused and "residual" in refused),
            "after": after}


def different_models() -> dict:
    """Rank 1's model differs (a wider layer; an extra layer): a ValueError naming the variable on
    every rank, through the tape and through Keras fit, and collectives still work afterwards."""
    import horovod.tensorflow as hvd
    import hvdcompress.keras as hvk
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    out = {}
    loss_fn = kit.keras_loss()
    for label, kw in (("width", dict(width=32 if hvd.rank() == 0 else 33)), ("extra", dict(extra=hvd.rank() == 1))):
        model = _model(**kw)
        comp = hvc.GradientCompression("topk:ratio=0.05")

        @tf.function
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            return hvc.DistributedGradientTape(tape, compression=comp).gradient(loss, model.trainable_variables)
        try:
            step_fn(*_batch(hvd.rank(), 0))
            out[f"tape.{label}"] = None
        except ValueError as e:
            out[f"tape.{label}"] = str(e)
    model = _model(width=32 if hvd.rank() == 0 else 33)
    model.compile(optimizer=hvk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression="topk:ratio=0.05"),
                  loss=loss_fn)
    try:
        model.train_on_batch(*_batch(hvd.rank(), 0))
        out["keras.width"] = None
    except ValueError as e:
        out["keras.width"] = str(e)
    out["after"] = float(hvd.allreduce(tf.ones([1]), name="still.works.models").numpy()[0])
    return out


def everything() -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf_graph_options()
    hvd.init()
    out = {}
    start = time.time()
    for name, fn in [("faults", lambda: {s: tape_faults(s) for s in FAULT_SPECS}),
                     ("eager", lambda: {s: tape_faults(s, graph=False) for s in EAGER_SPECS}),
                     ("plain", lambda: {s: plain_step_applies_it(s) for s in PLAIN_SPECS}),
                     ("loss_scale", lambda: {s: loss_scale(s) for s in LOSS_SCALE_SPECS}),
                     ("checkpoint", checkpoint_refused), ("models", different_models)]:
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    out["seconds"] = time.time() - start
    return out
