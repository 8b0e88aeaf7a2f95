"""Worker code for tests/test_tf_delayed.py: delayed gradient averaging and temporal sparsity on
the TF backend (``tf_ops.delayed``), on real Horovod. TensorFlow takes seconds to import, so one
launch runs every scenario and returns plain Python data; the pytest side asserts on it.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from functools import partial

from scenarios import kit

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

DGC = "dgc:ratio=0.1,warmup_epochs=0,min_sparse_numel=16"
FLUSH_SPECS = ["none", "topk:ratio=0.1", DGC]
# Zero delay on real workers with DGC (residual, momenta, the momentum taken over); top-k too in the
# extended tier (its delay=0 object is the synchronous one as DGC's is; more specs: the single-process
# test_zero_delay_gives_the_synchronous_results_bit_for_bit). Eager steps, one exchange object each.
ZERO_SPECS = (["topk:ratio=0.1"] if kit.extended() else []) + [DGC]
ZERO_STEPS = 2  # eager steps: the second already reads the state (residual, momenta) the first left
# (spec, delay, sync_every): every spec and both delays once in the default suite; all six
# combinations in the extended tier. The tape flushed with sync_every=2 (local steps pending) runs
# in the extended tier: the default suite flushes it in the unrolled identities (sync_every 2 and 3,
# against the numpy simulation) and through Keras fit (dgc|1|2).
FLUSH_CASES = ([(spec, d, 1) for spec in FLUSH_SPECS for d in (1, 2)] + [("topk:ratio=0.1", 1, 2)] if kit.extended()
               else [("none", 1, 1), ("topk:ratio=0.1", 2, 1), (DGC, 1, 1)])
IDENTITY = [(1, 1, "avg"), (2, 1, "sum"), (3, 1, "avg"), (1, 2, "avg")]
IDENTITY_STEPS = 7
# DGC keeps the momentum (spec default 0.9; density 1, a 6-entry variable: sent dense as its velocity)
MOMENTUM_SPEC = "dgc:ratio=1.0,warmup_epochs=0"
MOMENTUM = 0.9
IDENTITY_MOMENTUM = [(1, 1, "avg"), (3, 1, "avg"), (2, 2, "avg"), (1, 3, "sum")]
LR = 0.1

_model = partial(kit.keras_mlp, (10, 16, 4), ("tanh",))
_batch = partial(kit.np_batch, n=8, features=10, classes=4, stride=97)


def fixed(rank, step):
    import numpy as np
    return np.random.default_rng(1000 * rank + step).standard_normal(6).astype(np.float32)


def _tape_trainer(model, opt, comp, graph=False, **tape_kw):
    """A custom-loop step (eager, or one tf.function) through DistributedGradientTape."""
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    loss_fn = kit.keras_loss()
    opt.build(model.trainable_variables)  # its slots now: made in the step's first trace, they would trace it twice

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvc.DistributedGradientTape(tape, compression=comp, **tape_kw)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    fn = tf.function(step) if graph else step

    def run(first, last):
        for s in range(first, last):
            fn(*_batch(hvc.rank(), s))
    return run


def unrolled_identity() -> dict:
    """Plain SGD on one variable whose gradient is a fixed vector per rank and step (loss w.c), so
    the whole trajectory is known; the pytest side checks it against a numpy simulation."""
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    out = {}
    for n, (delay, every, op) in enumerate(IDENTITY):
        w = tf.Variable(tf.zeros(6))
        opt = tf.keras.optimizers.SGD(LR)
        opt.build([w])  # its slots now: made in the step's first trace, they would trace it twice
        comp = hvc.GradientCompression("none", delay=delay, sync_every=every)

        def step(c):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * c)
            tape = hvc.DistributedGradientTape(tape, compression=comp, op=hvc.Sum if op == "sum" else hvc.Average)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))

        fn = tf.function(step) if n % 2 else step  # eagerly and inside tf.function
        for t in range(IDENTITY_STEPS):
            fn(tf.constant(fixed(hvc.rank(), t)))
        key = f"{delay}|{every}|{op}"
        out[key] = w.numpy().tolist()
        comp.flush(opt, [w])
        out[key + "|flushed"] = w.numpy().tolist()
    return out


def unrolled_identity_with_momentum() -> dict:
    """As ``unrolled_identity``, with DGC keeping the momentum: the local terms are the local
    velocity (tf_ops.delayed); the pytest side simulates it in numpy."""
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    out = {}
    for n, (delay, every, op) in enumerate(IDENTITY_MOMENTUM):
        w = tf.Variable(tf.zeros(6))
        opt = tf.keras.optimizers.SGD(LR)
        opt.build([w])  # its slots now: made in the step's first trace, they would trace it twice
        comp = hvc.GradientCompression(MOMENTUM_SPEC, delay=delay, sync_every=every)

        def step(c):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * c)
            tape = hvc.DistributedGradientTape(tape, compression=comp, op=hvc.Sum if op == "sum" else hvc.Average)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))

        fn = tf.function(step) if n % 2 else step
        for t in range(IDENTITY_STEPS):
            fn(tf.constant(fixed(hvc.rank(), t)))
        key = f"{delay}|{every}|{op}"
        out[key] = w.numpy().tolist()
        comp.flush(opt, [w])
        out[key + "|flushed"] = w.numpy().tolist()
    return out


def zero_delay_is_the_synchronous_path() -> dict:
    import hvdcompress.tensorflow as hvc
    import numpy as np
    import tensorflow as tf
    out = {}
    for spec in ZERO_SPECS:  # more compressors: tests/test_tf_delayed.py, single process
        flats = []
        for kw in ({}, dict(delay=0, sync_every=1)):
            model = _model()
            comp = hvc.GradientCompression(spec, **kw)
            _tape_trainer(model, tf.keras.optimizers.SGD(0.05, momentum=0.9), comp, **kw)(0, ZERO_STEPS)
            flats.append(kit.tf_flat(model).numpy())
        out[spec] = bool(np.array_equal(flats[0], flats[1]))
    return out


def flush_makes_replicas_identical() -> dict:
    """Tape (eager steps; momentum SGD: slot variables are averaged too) for every case, then the
    Keras optimizer in fit with the callback and validation (opt.flush() by hand: the resume
    scenario)."""
    import hvdcompress.keras as hvc
    import tensorflow as tf
    out = {}
    for spec, delay, every in FLUSH_CASES:
        model = _model()
        opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
        comp = hvc.GradientCompression(spec, delay=delay, sync_every=every)
        run = _tape_trainer(model, opt, comp)
        run(0, 4)
        key = f"{spec}|{delay}|{every}"
        before = kit.tf_identical(model, "before." + key)
        comp.flush(opt, model.trainable_variables)
        after = kit.tf_identical(model, "after." + key)
        run(4, 6)  # training goes on after a flush
        comp.flush(opt, model.trainable_variables)
        out["tape " + key] = (before, after, kit.tf_identical(model, "again." + key))
    model = _model()
    opt = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), compression=DGC, delay=1, sync_every=2)
    model.compile(optimizer=opt, loss=kit.keras_loss())
    x, y = _batch(hvc.rank(), 0)
    cb = hvc.DelayedAveragingFlushCallback()
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, validation_data=_batch(hvc.rank(), 1), callbacks=[cb])
    # flushed before each validation; nothing new after
    out["keras fit dgc|1|2"] = (False, kit.tf_identical(model, "fit.after"), cb.flushes == 2)
    return out


def resume_with_corrections_pending(tmp: str) -> dict:
    """Every rank saves its own checkpoint with corrections in flight; fresh objects restored from
    it continue exactly as the uninterrupted run (and flush to the same values)."""
    import hvdcompress.keras as hvc
    import numpy as np
    import tensorflow as tf
    out = {}
    rank = hvc.rank()
    for kind, spec, delay, every in (("tape", DGC, 2, 2), ("keras", "topk:ratio=0.1", 2, 1)):
        path = os.path.join(tmp, f"{kind}-{delay}-{every}-rank{rank}")
        label = f"{kind} {spec} {delay} {every}"
        if kind == "keras":  # model.save_weights carries the optimizer and its delayed state
            def make():
                model = _model()
                opt = hvc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9), compression=spec,
                                               delay=delay, sync_every=every)
                model.compile(optimizer=opt, loss=kit.keras_loss())

                def run(first, last):
                    for s in range(first, last):
                        model.train_on_batch(*_batch(rank, s))
                return model, opt, opt.gradient_compression, run, opt.flush
            model, opt, comp, run, flush = make()
            run(0, 5)
            model.save_weights(path)
        else:
            def make():
                model = _model()
                opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
                comp = hvc.GradientCompression(spec, delay=delay, sync_every=every)
                return (model, opt, comp, _tape_trainer(model, opt, comp, graph=True),
                        lambda: comp.flush(opt, model.trainable_variables))
            model, opt, comp, run, flush = make()
            run(0, 5)
            saved = tf.train.Checkpoint(model=model, optimizer=opt, compression=comp).save(path)
        pending = sum(float(np.abs(v.numpy()).sum()) for v in comp.delayed.ring + comp.delayed.acc if v is not None)
        run(5, 9)
        straight = kit.tf_flat(model).numpy()
        model2, opt2, comp2, run2, flush2 = make()
        if kind == "keras":
            model2.load_weights(path)
        else:
            tf.train.Checkpoint(model=model2, optimizer=opt2, compression=comp2).restore(saved)
        run2(5, 9)
        equal = bool(np.array_equal(straight, kit.tf_flat(model2).numpy()))
        flush()
        flush2()
        out[label] = (equal, bool(np.array_equal(kit.tf_flat(model).numpy(), kit.tf_flat(model2).numpy())), pending,
                      int(comp2.delayed.calls.numpy()), kit.tf_identical(model2, "resumed." + label))
    return out


NONFINITE_DELAY = 2
# (spec, bad value): each spec and each bad value once in the default suite (a trace per case and
# process is the cost); all four in the extended tier.
NONFINITE_CASES = ([(spec, bad) for spec in (DGC, "topk:ratio=0.1") for bad in ("nan", "inf")] if kit.extended() else
                   [(DGC, "nan"), ("topk:ratio=0.1", "inf")])


def nonfinite_with_corrections_pending() -> dict:
    """A NaN (then an inf) in one gradient entry on rank 1 at step 2, delay 2, DGC (local
    velocity) and top-k, under tf.function: rank 1 sees it at step 2, every rank at step 4 (the
    guarded exchange's correction); skipping those steps keeps training finite, a flush makes the
    replicas identical, and no non-finite value stays in the delayed state."""
    import hvdcompress.tensorflow as hvc
    import numpy as np
    import tensorflow as tf
    out = {}
    loss_fn = kit.keras_loss()
    for spec, text in NONFINITE_CASES:
        bad = float(text)
        model = _model()
        opt = tf.keras.optimizers.SGD(0.05)
        comp = hvc.GradientCompression(spec, delay=NONFINITE_DELAY)

        @tf.function
        def grads_of(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = hvc.DistributedGradientTape(tape, compression=comp)
            gs = tape.gradient(loss, model.trainable_variables)
            return gs

        # the bad value enters through rank 1's input: its gradients of that step are non-finite
        seen = []
        for step in range(8):
            x, y = _batch(hvc.rank(), step)
            if step == 2 and hvc.rank() == 1:
                x = x.copy()
                x[0, 0] = bad
            gs = grads_of(tf.constant(x), tf.constant(y))
            if not all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in gs):
                seen.append(step)
                continue  # the skip pattern
            opt.apply_gradients(zip(gs, model.trainable_variables))
        state = [v for v in comp.delayed.ring + comp.delayed.vel if v is not None]
        finite_state = all(bool(np.all(np.isfinite(v.numpy()))) for v in state)
        finite = bool(np.all(np.isfinite(kit.tf_flat(model).numpy())))
        comp.flush(opt, model.trainable_variables)
        out[f"{spec}|{bad}"] = {"seen": seen, "state_finite": finite_state, "params_finite": finite,
                                "identical": kit.tf_identical(model, f"nonfinite.{spec}.{bad}")}
    return out


def everything() -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    out = {"seconds": {}}
    tmp = tempfile.mkdtemp()
    for name, fn, args in (("identity", unrolled_identity, ()), ("momentum", unrolled_identity_with_momentum, ()),
                           ("zero", zero_delay_is_the_synchronous_path, ()),
                           ("nonfinite", nonfinite_with_corrections_pending, ()),
                           ("flush", flush_makes_replicas_identical, ()),
                           ("resume", resume_with_corrections_pending, (tmp,))):
        start = time.perf_counter()
        try:
            out[name] = fn(*args)
        except Exception:  # report, do not hang the test on a worker traceback
            out[name] = {"error": traceback.format_exc()}
        out["seconds"][name] = time.perf_counter() - start
    hvd.shutdown()
    return out
