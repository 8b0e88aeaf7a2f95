"""Worker code for tests/test_tf_diloco.py: Keras ``model.fit`` with ``DiLoCoCallback`` on real
Horovod workers. Returns, per training batch, the trainable variables after the inner step
(a callback placed before DiLoCo's) and after the outer loop (one placed after it), so the test
replays the outer loop with the numpy reference on the same local variables."""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

BATCHES = 9
CONFIGS = {
    "diloco": dict(sync_every=3),
    "streaming_sparseloco": dict(sync_every=4, fragments=2, overlap_steps=1, mix=0.5,
                                 compression="sparseloco:ratio=0.2,bits=2,beta=0.9"),
}


def _model():
    import tensorflow as tf
    tf.keras.utils.set_random_seed(0)  # the same initial weights on every rank
    model = tf.keras.Sequential([tf.keras.layers.Dense(5, activation="tanh", input_shape=(6,)),
                                 tf.keras.layers.Dense(3)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    return model


def _data(rank):
    import numpy as np
    rng = np.random.default_rng(31 * rank + 1)
    return rng.standard_normal((8 * BATCHES, 6)).astype(np.float32), rng.standard_normal((8 * BATCHES, 3)).astype(np.float32)


def _recorder(model, into):
    import tensorflow as tf

    class Record(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            into.append([v.numpy().copy() for v in model.trainable_variables])
    return Record()


def everything(configs=None):
    import horovod.tensorflow as hvd
    import tensorflow as tf
    import hvdcompress.keras as hvc

    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    out = {}
    for name, kw in (configs or CONFIGS).items():
        model = _model()
        init = [v.numpy().copy() for v in model.trainable_variables]
        seen, after = [], []
        cb = hvc.DiLoCoCallback(flush_at_end=False, **kw)
        x, y = _data(hvd.rank())
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[_recorder(model, seen), cb, _recorder(model, after)])
        cb.diloco.flush()
        out[name] = {"init": init, "locals": seen, "after": after, "bytes": int(cb.diloco.bytes_sent.numpy()),
                     "names": list(cb.diloco.names),
                     "flushed": [v.numpy().copy() for v in model.trainable_variables],
                     "global": [g.numpy() for g in cb.diloco.global_parameters()]}
    return out
