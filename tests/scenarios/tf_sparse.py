"""Worker code for tests/test_tf_sparse.py: sparse gradients (``tf.IndexedSlices`` from a Keras
Embedding) through our ``DistributedGradientTape`` and Keras ``DistributedOptimizer`` on real
Horovod, next to Horovod's own wrappers on the same inputs. TensorFlow is slow to import: one
launch runs everything (``everything``)."""

from __future__ import annotations

import os
import time
import traceback
import warnings

from scenarios import kit

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

VOCAB, DIM, SEQ, BATCH, STEPS = 40, 6, 5, 4, 6
# The wrapped Keras optimizers our DistributedOptimizer hands an embedding's IndexedSlices to: a new
# one (SGD with momentum) and a legacy one (Adagrad). Adam takes the new optimizers' path SGD takes
# (two Keras traces per process): extended tier.
KERAS_OPTIMIZERS = ("sgd", "legacy_adagrad") + (("adam",) if kit.extended() else ())


def _model():
    import tensorflow as tf
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.layers.Embedding(VOCAB, DIM, input_length=SEQ),
                                tf.keras.layers.GlobalAveragePooling1D(),
                                tf.keras.layers.Dense(3)])


def _batch(rank, step):
    """Rank-dependent ids (rows 0..VOCAB-9 only: the last 8 rows are never touched) and labels."""
    import numpy as np
    rng = np.random.default_rng(100 * rank + step)
    return (rng.integers(0, VOCAB - 8, size=(BATCH, SEQ)).astype(np.int32),
            rng.integers(0, 3, size=(BATCH,)).astype(np.int32))


def _np(g):
    import tensorflow as tf
    if isinstance(g, tf.IndexedSlices):
        return {"values": g.values.numpy(), "indices": g.indices.numpy()}
    return g.numpy()


def _same(a, b, tol=0.0):
    import numpy as np
    if isinstance(a, dict) != isinstance(b, dict):
        return False
    if isinstance(a, dict):
        return bool(np.array_equal(a["indices"], b["indices"]) and _same(a["values"], b["values"], tol))
    return bool(a.shape == b.shape and (np.array_equal(a, b) if tol == 0 else np.abs(a - b).max() <= tol))


def tape(spec: str, sparse_as_dense: bool) -> dict:
    """One step's gradients from our tape and Horovod's on the same parameters and batch, then
    STEPS steps of our tape in a tf.function with identical parameters checked after each."""
    import horovod.tensorflow as hvd
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    model = _model()
    loss_fn = kit.keras_loss()
    compression = hvc.GradientCompression(spec, name=f"t{spec[:4]}{int(sparse_as_dense)}")
    x, y = _batch(hvd.rank(), 0)

    def grads(ours):
        with tf.GradientTape() as t:
            loss = loss_fn(y, model(x, training=True))
        t = (hvc.DistributedGradientTape(t, compression=compression, sparse_as_dense=sparse_as_dense) if ours
             else hvd.DistributedGradientTape(t, sparse_as_dense=sparse_as_dense))
        return t.gradient(loss, model.trainable_variables)

    hvd_g = [_np(g) for g in grads(False)]
    our_raw = grads(True)
    ours = [_np(g) for g in our_raw]
    out = {"kinds": ["IndexedSlices" if isinstance(g, tf.IndexedSlices) else "dense" for g in our_raw],
           "embedding_same_as_horovod": _same(ours[0], hvd_g[0]),
           "dense_close_to_horovod": all(_same(a, b, 1e-6) for a, b in zip(ours[1:], hvd_g[1:])),
           "embedding_slots": sorted(compression.slots[0]) if compression.slots else [],
           "last_bytes": compression.stats.last_bytes,
           "rows": int(x.size)}
    opt = tf.keras.optimizers.SGD(0.5)
    opt.build(model.trainable_variables)  # its slots now: made in the step's first trace, they would trace it twice

    @tf.function
    def step(x, y):
        with tf.GradientTape() as t:
            loss = loss_fn(y, model(x, training=True))
        t = hvc.DistributedGradientTape(t, compression=compression, sparse_as_dense=sparse_as_dense)
        gs = t.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gs, model.trainable_variables))

    untouched = model.layers[0].embeddings[VOCAB - 8:].numpy().copy()
    same = []
    for s in range(STEPS):
        step(*_batch(hvd.rank(), s + 1))
        same.append(kit.tf_identical(model, f"tape.{spec}.{sparse_as_dense}.{s}", finite=True))
    import numpy as np
    out["identical"] = same
    out["untouched_rows_unchanged"] = bool(np.array_equal(untouched, model.layers[0].embeddings[VOCAB - 8:].numpy()))
    return out


def keras(optimizer: str, spec: str) -> dict:
    """STEPS ``train_on_batch`` steps with our DistributedOptimizer (spec) and, from the same
    start, with Horovod's own; identical parameters across ranks after each step of ours."""
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvdk
    import hvdcompress.keras as hvc
    import numpy as np
    import tensorflow as tf

    def make():
        return {"sgd": lambda: tf.keras.optimizers.SGD(0.5, momentum=0.9),
                "adam": lambda: tf.keras.optimizers.Adam(0.05),
                "legacy_adagrad": lambda: tf.keras.optimizers.legacy.Adagrad(0.5)}[optimizer]()

    finals, same = {}, []
    for who in ("horovod", "ours"):
        model = _model()
        opt = (hvc.DistributedOptimizer(make(), compression=spec, name=f"k_{optimizer}") if who == "ours"
               else hvdk.DistributedOptimizer(make()))
        model.compile(optimizer=opt, loss=kit.keras_loss())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(STEPS):
                model.train_on_batch(*_batch(hvd.rank(), s))
                if who == "ours":
                    same.append(kit.tf_identical(model, f"keras.{optimizer}.{spec}.{s}", finite=True))
        if who == "ours":  # exchanged sparse: no "converting sparse IndexedSlices" warning from TF
            warned = any("tf.IndexedSlices" in str(w.message) for w in caught)
        finals[who] = [v.numpy() for v in model.trainable_variables]
        if who == "ours":
            comp = opt.gradient_compression
            slots = sorted(comp.slots[0]) if comp.slots else []
            stats = comp.stats
    diff = max(float(np.abs(a - b).max()) for a, b in zip(finals["ours"], finals["horovod"]))
    return {"identical": same, "max_diff_vs_horovod": diff, "embedding_slots": slots,
            "last_bytes": stats.last_bytes, "last_dense_bytes": stats.last_dense_bytes, "warned": warned}


def nonfinite() -> dict:
    """A NaN in one value of rank 1's embedding gradient reaches every rank's exchanged gradient."""
    import horovod.tensorflow as hvd
    import hvdcompress.tensorflow as hvc
    import numpy as np
    import tensorflow as tf
    model = _model()
    x, _ = _batch(hvd.rank(), 0)
    poison = np.zeros((BATCH, SEQ, DIM), np.float32)
    if hvd.rank() == 1:
        poison[1, 2, 3] = np.nan
    compression = hvc.GradientCompression("topk:ratio=0.1", name="nan")
    with tf.GradientTape() as t:
        loss = tf.reduce_sum(model.layers[0](x) * poison)
    t = hvc.DistributedGradientTape(t, compression=compression)
    g = t.gradient(loss, model.layers[0].trainable_variables)[0]
    return {"kind": type(g).__name__, "nan_seen": bool(np.isnan(g.values.numpy()).any())}


def bad_arguments() -> dict:
    """A bad sparse_as_dense raises ValueError naming it, on every rank, before any collective."""
    import horovod.tensorflow as hvd
    import hvdcompress.keras as hvc
    import tensorflow as tf
    out = {}
    try:
        hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression="topk:ratio=0.1", sparse_as_dense="yes")
    except ValueError as exc:
        out["keras"] = str(exc)
    try:
        with tf.GradientTape() as t:
            pass
        hvc.DistributedGradientTape(t, compression="none", sparse_as_dense=1)
    except ValueError as exc:
        out["tape"] = str(exc)
    out["after"] = float(hvd.allreduce(tf.ones([2]), name="sparse.after").numpy()[0])
    return out


def elastic_bad_arguments() -> dict:
    """(Run here to share the launch with the sparse scenarios.) What cannot follow an elastic
    reset is refused when ``hvc.elastic.KerasState`` is made: ValueError naming the argument,
    on every rank, before any collective."""
    import horovod.tensorflow as hvd
    import hvdcompress.keras as hvc
    import tensorflow as tf
    from hvdcompress.schedule.costmodel import CostModel
    out = {}
    cases = {"delay": dict(compression="topk:ratio=0.1", delay=1),
             "backward_passes_per_step": dict(compression="topk:ratio=0.1", backward_passes_per_step=2),
             "schedule": dict(compression="none", schedule="mgwfbp",
                              cost_model=CostModel.from_link(hvd.size(), gbit_per_s=1.0, latency_s=1e-4))}
    for name, kwargs in cases.items():
        model = _model()
        opt = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), name=f"el_{name}", **kwargs)
        try:
            hvc.elastic.KerasState(model, opt, batch=0)
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    try:
        hvc.elastic.KerasState(_model(), tf.keras.optimizers.SGD(0.1), compression="topk:ratio=0.1")
    except ValueError as exc:
        out["compression"] = str(exc)
    out["after"] = float(hvd.allreduce(tf.ones([2]), name="elastic.after").numpy()[0])
    return out


def everything() -> dict:
    import horovod.tensorflow as hvd
    hvd.init()
    start = time.time()
    res = {}
    jobs = {"bad_arguments": bad_arguments, "nonfinite": nonfinite, "elastic_bad_arguments": elastic_bad_arguments}
    for spec in ("none", "topk:ratio=0.1"):
        for dense in (False, True):
            jobs[f"tape:{spec}:{dense}"] = (lambda s=spec, d=dense: tape(s, d))
    for opt in KERAS_OPTIMIZERS:
        jobs[f"keras:{opt}:none"] = (lambda o=opt: keras(o, "none"))
    jobs["keras:sgd:topk"] = lambda: keras("sgd", "topk:ratio=0.1")
    for name, fn in jobs.items():
        try:
            res[name] = fn()
        except Exception:  # noqa: BLE001 - reported to the test
            res[name] = {"error": traceback.format_exc()}
    res["seconds"] = time.time() - start
    return res
