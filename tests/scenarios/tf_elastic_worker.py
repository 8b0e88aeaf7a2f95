"""A training script for tests/test_tf_elastic.py, run by ``horovodrun --gloo`` elastic on localhost
(TensorFlow/Keras; the PyTorch one is tests/scenarios/elastic_worker.py).

MODE "keras": a Keras model compiled with our DistributedOptimizer, ``train_on_batch`` steps,
``hvc.elastic.KerasState``. MODE "tape": our DistributedGradientTape with a GradientCompression
made once, the step's tf.function built inside the function ``run`` wraps,
``hvc.elastic.TensorFlowKerasState(..., compression=...)``.

Rank 0 edits the host file the discovery script prints: after a few steps it adds a host
(127.0.0.1, one slot: a third worker joins), a few steps after the third worker took part it
removes it again. Every process appends JSON lines to OUTDIR/<pid>.jsonl: one after each sync
(world size, this rank's residual norm, the exchange counter) and one per step (world size,
whether every rank holds identical parameters and optimizer variables, every rank's exchange
counter, this rank's residual norm)."""

import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import hvdcompress.keras as hvck  # noqa: E402
import hvdcompress.tensorflow as hvct  # noqa: E402
from scenarios import kit  # noqa: E402

OUT, MODE = sys.argv[1], sys.argv[2]
SPEC = sys.argv[3] if len(sys.argv) > 3 else "topk:ratio=0.1"

hvd.init()
model = kit.keras_mlp((16, 32, 4), ("tanh",))
loss_fn = tf.keras.losses.MeanSquaredError()
if MODE == "keras":
    opt = hvck.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), compression=SPEC,
                                    schedule="layerwise")
    model.compile(optimizer=opt, loss=loss_fn)
    compression = opt.gradient_compression
    state = hvck.elastic.KerasState(model, step=0, phase="two", at_three=0, after=0)
    run = hvck.elastic.run
else:
    opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    compression = hvct.GradientCompression(SPEC)
    state = hvct.elastic.TensorFlowKerasState(model, opt, compression=compression, step=0, phase="two",
                                              at_three=0, after=0)
    run = hvct.elastic.run
log = open(os.path.join(OUT, f"{os.getpid()}.jsonl"), "a")


def residual_norm():
    return float(sum(np.linalg.norm(s["residual"].numpy()) for s in compression.slots if "residual" in s))


def batch(step):
    rng = np.random.default_rng(1000 * hvd.rank() + step)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    return x, np.tanh(x[:, :4])


def one_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvct.DistributedGradientTape(tape, compression=compression)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))


@run
def train(state):
    log.write(json.dumps({"sync": True, "rank": hvd.rank(), "size": hvd.size(), "step": state.step,
                          "residual_norm": residual_norm(), "counter": int(compression.step.numpy())}) + "\n")
    step_fn = tf.function(one_step)  # traced again after every reset
    while not kit.elastic_finished(state):
        x, y = batch(state.step)
        if MODE == "keras":
            model.train_on_batch(x, y)
        else:
            step_fn(x, y)
        size = hvd.size()
        variables = model.variables + [v for v in opt.variables()]
        flat = tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in variables], 0)
        rows = hvd.allgather(flat[None], name=f"check.{state.step}").numpy()
        counters = hvd.allgather(tf.reshape(compression.step, [1]), name=f"counters.{state.step}").numpy()
        log.write(json.dumps({"step": state.step, "rank": hvd.rank(), "size": size, "phase": state.phase,
                              "identical": bool(all(np.array_equal(rows[0], r) for r in rows)),
                              "counters": counters.tolist(), "residual_norm": residual_norm(),
                              "scale": opt._hvc.scale if MODE == "keras" else None}) + "\n")
        log.flush()
        state.step += 1
        kit.elastic_advance(state, size, hvd.rank(), OUT)
        state.commit()


train(state)
log.write(json.dumps({"done": True, "rank": hvd.rank(), "step": state.step, "phase": state.phase}) + "\n")
log.close()
