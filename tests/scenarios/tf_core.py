"""Code that runs inside real Horovod worker processes for the TF backend (launched by
tests/test_tf_multiprocess.py). TensorFlow takes seconds to import, so one launch runs every
scenario and returns plain Python data; the pytest side asserts on it. Parameters are compared
across ranks bit for bit by allgathering them.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
import warnings

from scenarios import kit

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

TAPE_SPECS = ["none", "fp16", "bf16", "topk:ratio=0.05", "randomk:ratio=0.1,seed=1",
              "dgc:ratio=0.05,nesterov=true,clip_norm=1.0,fp16_values=true,min_sparse_numel=256"]
STATELESS = ("none", "fp16", "bf16")  # may be given to a tape as a plain spec
USED = {}  # id(model) -> the GradientCompression its tape used
STEPS = {}  # id(model) -> its tape's training step (a tf.function: how often it was traced)
RESUME = [("keras", "topk:ratio=0.05"), ("tape", "dgc:ratio=0.05,warmup_epochs=3,min_sparse_numel=256")]
# Keras' save_weights/load_weights carrying a residual is resumed in the default suite by
# test_quantizers_multiprocess (PowerSGD, QSGD: the same _keras runs) and test_tf_delayed (top-k with
# corrections in flight); top-k's plain Keras resume repeats it: extended tier (four traces per process).
RESUME_EXTENDED_ONLY = (("keras", "topk:ratio=0.05"),)
# Keras' legacy optimizer runs in the default suite in test_tf_delayed (resume) and test_tf_sparse
# (Adagrad), random-k on the tape here: their pairing repeats both (extended tier).
KERAS_EXTENDED_ONLY = ("legacy+randomk",)


def _keras(spec, legacy=False, bpps=1, steps=6, epoch_every=2, momentum=0.9, **kw):
    import hvdcompress.keras as hvc
    import tensorflow as tf
    model = kit.keras_mlp()
    sgd = tf.keras.optimizers.legacy.SGD if legacy else tf.keras.optimizers.SGD
    opt = hvc.DistributedOptimizer(sgd(0.1, momentum=momentum), compression=spec, backward_passes_per_step=bpps, **kw)
    model.compile(optimizer=opt, loss=kit.keras_loss())
    return model, opt, lambda first, last: _fit_steps(model, opt, first, last, epoch_every)


def _fit_steps(model, opt, first, last, epoch_every):
    import hvdcompress.keras as hvc
    for step in range(first, last):
        opt.gradient_compression.set_epoch(step // epoch_every)
        model.train_on_batch(*kit.np_batch(hvc.rank(), step))


def _tape(compression, steps=6, momentum=0.0, epoch_every=2):
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    model = kit.keras_mlp()
    opt = tf.keras.optimizers.SGD(0.1, momentum=momentum)
    opt.build(model.trainable_variables)  # its slots now: made in the step's first trace, they would trace it twice
    loss_fn = kit.keras_loss()

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvc.DistributedGradientTape(tape, compression=compression)
        USED[id(model)] = tape.compression  # (when traced) the object that does the exchange
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    STEPS[id(model)] = step_fn

    def run(first, last):
        for step in range(first, last):
            if isinstance(compression, hvc.GradientCompression):
                compression.set_epoch(step // epoch_every)
            step_fn(*kit.np_batch(hvc.rank(), step))
    run(0, steps)
    return model, opt, run


def keras_paths() -> dict:
    """The Keras optimizer's own features; every compressor is covered on the (cheaper) tape path."""
    import hvdcompress.keras as hvc
    out = {"identical": {}, "moved": {}, "traces": {}}
    start = kit.tf_flat(kit.keras_mlp()).numpy()
    for label, kwargs in (("topk", dict(spec="topk:ratio=0.05")),
                          ("legacy+randomk", dict(spec="randomk:ratio=0.1,seed=1", legacy=True)),
                          ("bpps2", dict(spec="topk:ratio=0.05", bpps=2, average_aggregated_gradients=True))):
        if label in KERAS_EXTENDED_ONLY and not kit.extended():
            continue
        model, opt, run = _keras(**kwargs)
        run(0, 6)
        out["identical"][label] = kit.tf_identical(model)
        out["moved"][label] = float(abs(kit.tf_flat(model).numpy() - start).max())
        out["traces"][label] = model.train_function.experimental_get_tracing_count()
    out["bpps2_iterations_exchanges"] = (int(opt.iterations.numpy()), opt.stats.steps)
    model, opt, run = _keras("dgc:ratio=0.05,min_sparse_numel=256", momentum=0.8)
    out["dgc_momentum_taken_over"] = (opt.compression["momentum"], float(opt.get_config()["momentum"]))
    # DGC through model.fit with the callbacks, Horovod's included
    model, opt, _ = _keras("dgc:ratio=0.05,warmup_epochs=2,min_sparse_numel=256")
    x, y = kit.np_batch(hvc.rank(), 0)
    hist = model.fit(x, y, batch_size=4, epochs=3, verbose=0,
                     callbacks=[hvc.BroadcastGlobalVariablesCallback(0), hvc.MetricAverageCallback(),
                                hvc.SparsityWarmupCallback(), hvc.CompressionStatsCallback()])
    out["fit_density"] = hist.history["density"]
    out["fit_wire"] = hist.history["wire_bytes_per_step"]
    out["identical"]["fit+callbacks"] = kit.tf_identical(model)
    out["traces"]["fit+callbacks"] = model.train_function.experimental_get_tracing_count()
    return out


def tape_paths() -> dict:
    import hvdcompress.tensorflow as hvc
    out = {"identical": {}, "bytes": {}, "moved": {}, "traces": {}}
    start = kit.tf_flat(kit.keras_mlp()).numpy()
    flats = {}
    for spec in TAPE_SPECS:
        comp = spec if spec in STATELESS else hvc.GradientCompression(spec)
        model, _, _ = _tape(comp)
        flats[spec] = kit.tf_flat(model).numpy()
        out["identical"][spec] = kit.tf_identical(model)
        out["moved"][spec] = float(abs(flats[spec] - start).max())
        out["bytes"][spec] = USED[id(model)].stats.as_dict()
        out["traces"][spec] = STEPS[id(model)].experimental_get_tracing_count()
    # top-k at ratio 1 against the dense run above (same model, batches and steps: one trace fewer)
    dense = flats["none"]
    full = kit.tf_flat(_tape(hvc.GradientCompression("topk:ratio=1.0"))[0]).numpy()
    out["ratio1_max_diff"] = float(abs(dense - full).max())
    return out


def checkpoint_resume(tmp: str) -> dict:
    """Every rank saves its own checkpoint mid-run; fresh objects restored from it must continue
    bit-identically to never stopping (residuals, DGC momenta, step and epoch are state)."""
    import hvdcompress.tensorflow as hvc
    import numpy as np
    import tensorflow as tf
    out = {}
    rank = hvc.rank()
    for kind, spec in RESUME:
        if (kind, spec) in RESUME_EXTENDED_ONLY and not kit.extended():
            continue
        path = os.path.join(tmp, f"{kind}-rank{rank}")
        if kind == "keras":  # model.save_weights (TF format) carries the optimizer and its compression state
            model, opt, run = _keras(spec, epoch_every=1)
            run(0, 3)
            model.save_weights(path)
            run(3, 6)
            straight = kit.tf_flat(model).numpy()
            model2, opt2, run2 = _keras(spec, epoch_every=1)
            model2.load_weights(path)
            comp2 = opt2.gradient_compression
        else:  # custom loop: tf.train.Checkpoint(model, optimizer, compression)
            comp = hvc.GradientCompression(spec)
            model, opt, run = _tape(comp, steps=3, epoch_every=1)
            saved = tf.train.Checkpoint(model=model, optimizer=opt, compression=comp).save(path)
            run(3, 6)
            straight = kit.tf_flat(model).numpy()
            comp2 = hvc.GradientCompression(spec)
            model2, opt2, run2 = _tape(comp2, steps=0, epoch_every=1)
            tf.train.Checkpoint(model=model2, optimizer=opt2, compression=comp2).restore(saved)
        run2(3, 6)
        out[f"{kind} {spec}"] = {"equal": bool(np.array_equal(straight, kit.tf_flat(model2).numpy())),
                                 "identical": kit.tf_identical(model2), "step": int(comp2.step.numpy()),
                                 "state": sorted({k for s in comp2.slots for k in s})}
    return out


def bad_arguments() -> dict:
    """Bad input raises on every rank before any collective; a collective still works after."""
    import horovod.tensorflow as hvd
    import hvdcompress.keras as hvc
    import tensorflow as tf
    errors = {}
    sgd = tf.keras.optimizers.SGD
    cases = {
        "ratio": lambda: hvc.DistributedOptimizer(sgd(0.1), compression="topk:ratio=2"),
        "unknown": lambda: hvc.DistributedOptimizer(sgd(0.1), compression="zip"),
        "bpps": lambda: hvc.DistributedOptimizer(sgd(0.1), backward_passes_per_step=0),
        "predivide": lambda: hvc.DistributedOptimizer(sgd(0.1), gradient_predivide_factor=0.0),
        "adasum": lambda: hvc.DistributedOptimizer(sgd(0.1), op=hvd.Adasum),
        "groups": lambda: hvc.DistributedOptimizer(sgd(0.1), num_groups=2),
        "warmup": lambda: hvc.DistributedOptimizer(sgd(0.1), compression="dgc:warmup_schedule=0.25/0.3"),
        "tape_state": lambda: hvc.DistributedGradientTape(tf.GradientTape(), compression="topk:ratio=0.01"),
    }
    for label, make in cases.items():
        try:
            make()
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    # a checkpoint of another compressor is refused at the next step, before its collectives
    tmp = tempfile.mkdtemp()
    comp = hvc.GradientCompression("topk:ratio=0.05")
    _tape(comp, steps=1)
    path = tf.train.Checkpoint(compression=comp).save(os.path.join(tmp, "ck"))
    other = hvc.GradientCompression("threshold:threshold=0.05")
    tf.train.Checkpoint(compression=other).restore(path)
    try:
        _tape(other, steps=1)
        errors["checkpoint"] = None
    except tf.errors.InvalidArgumentError as e:
        errors["checkpoint"] = e.message
    after = hvd.allreduce(tf.ones([1]), name="check_after", op=hvd.Sum)
    return {"errors": errors, "after": float(after.numpy()[0])}


def special_gradients() -> dict:
    """An empty selection on one rank, and sparse (IndexedSlices) gradients from an embedding."""
    import hvdcompress.tensorflow as hvc
    import numpy as np
    import tensorflow as tf
    out = {}
    comp = hvc.GradientCompression("threshold:threshold=1e-4")
    model = kit.keras_mlp()
    opt = tf.keras.optimizers.SGD(0.1)
    sent = []
    for step in range(3):
        x, y = kit.np_batch(hvc.rank(), step)
        with tf.GradientTape() as tape:
            loss = kit.keras_loss()(y, model(x)) * (0.0 if hvc.rank() == 1 else 1.0)
        grads = hvc.DistributedGradientTape(tape, compression=comp).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        sent.append(comp.stats.last_bytes)
    out["empty"] = {"identical": kit.tf_identical(model), "sent": sent}
    if not kit.extended():  # Keras on an embedding with top-k: tf_sparse.keras in the default suite
        return out

    tf.keras.utils.set_random_seed(0)
    emb = tf.keras.Sequential([tf.keras.layers.Embedding(50, 8, input_length=5), tf.keras.layers.Flatten(),
                               tf.keras.layers.Dense(4)])
    emb.compile(optimizer=hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression="topk:ratio=0.2"),
                loss=kit.keras_loss())
    ids = np.random.default_rng(hvc.rank()).integers(0, 50, (16, 5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emb.train_on_batch(ids, ids[:, 0] % 4)
        emb.train_on_batch(ids, ids[:, 1] % 4)
    out["sparse"] = {"identical": kit.tf_identical(emb),
                     "warned": any("tf.IndexedSlices" in str(w.message) for w in caught)}
    return out


def dgc_converges_on_digits(epochs: int) -> dict:
    """The Keras example, dense and DGC 0.1% with the warm-up callback, same seed and epochs
    (nothing with 0 epochs: the default test tier skips it)."""
    if epochs == 0:
        return {}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "examples"))
    import keras_digits
    out = {}
    for spec in ("none", "dgc:ratio=0.001"):
        args = keras_digits.parse_args(["--compression", spec, "--epochs", str(epochs), "--verbose", "0"])
        out[spec] = keras_digits.train(args)
    return out


def everything(world_expected: int, digits_epochs: int) -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    assert hvd.size() == world_expected
    out = {}
    tmp = tempfile.mkdtemp()
    for name, fn, args in (("keras", keras_paths, ()), ("tape", tape_paths, ()),
                           ("resume", checkpoint_resume, (tmp,)), ("bad", bad_arguments, ()),
                           ("special", special_gradients, ()), ("digits", dgc_converges_on_digits, (digits_epochs,))):
        start = time.perf_counter(), time.process_time()
        try:
            out[name] = fn(*args)
        except Exception:  # report, do not hang the test on a worker traceback
            out[name] = {"error": traceback.format_exc()}
        out.setdefault("seconds", {})[name] = (time.perf_counter() - start[0], time.process_time() - start[1])
    hvd.shutdown()
    return out
