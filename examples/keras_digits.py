"""Train a small CNN with Keras ``model.fit`` on scikit-learn's bundled digits (no download),
with compressed gradients.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_digits.py --compression topk:ratio=0.01
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_digits.py --compression dgc:ratio=0.001

Each rank trains on its own shard of the training set. The optimizer is wrapped by
``hvc.DistributedOptimizer``; Horovod's ``BroadcastGlobalVariablesCallback`` and
``MetricAverageCallback`` run next to hvdcompress's ``SparsityWarmupCallback`` (DGC: density from
the spec's warm-up schedule, one step down per epoch) and ``CompressionStatsCallback`` (measured
bytes per step in the Keras logs; add ``--tensorboard DIR`` to see them in TensorBoard). At the end
rank 0 prints the test accuracy and the bytes each rank put on the wire per step next to dense,
per group what was sent (``CompressionStatsCallback.decisions()``), and every rank checks that all
ranks hold identical parameters.

``--checkpoint-dir DIR`` gives every rank its own ``ModelCheckpoint`` (``DIR/rank<r>/``, weights in
TF format, so with the optimizer's variables and the compression state: residuals differ per
rank, and a checkpoint of rank 0's alone would hand them to every rank); a rerun with the same
directory resumes from the last epoch saved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Horovod's Keras layer needs Keras 2

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdcompress.keras as hvc  # noqa: E402
from hvdcompress.datasets import load_digits  # noqa: E402


def build_model(seed: int) -> tf.keras.Model:
    """Two 3x3 convolutions and two dense layers on 8x8 images (the PyTorch example's CNN)."""
    tf.keras.utils.set_random_seed(seed)  # the same initial weights on every rank
    layers = tf.keras.layers
    return tf.keras.Sequential([
        layers.Conv2D(16, 3, padding="same", activation="relu", input_shape=(8, 8, 1)),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dense(64, activation="relu"),
        layers.Dense(10),
    ])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", default="none", help="spec, e.g. none, fp16, topk:ratio=0.01, dgc:ratio=0.001")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (DGC takes it over)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensorboard", help="write TensorBoard logs (rank 0) to this directory")
    p.add_argument("--checkpoint-dir", help="save every epoch, one checkpoint per rank (DIR/rank<r>/); a rerun "
                   "with the same directory resumes from it")
    p.add_argument("--json", help="write the final figures to this file (rank 0)")
    p.add_argument("--verbose", type=int, default=2, help="Keras fit verbosity on rank 0")
    return p.parse_args(argv)


def train(args) -> dict:
    """Train on the digits with the given arguments; returns the figures (every rank)."""
    compression = hvc.parse_spec(args.compression)  # bad specs fail here, on every rank, before any collective
    hvc.init()
    rank, size = hvc.rank(), hvc.size()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:  # every rank on its own GPU, before TensorFlow touches one
        tf.config.experimental.set_memory_growth(gpus[hvc.local_rank()], True)
        tf.config.set_visible_devices(gpus[hvc.local_rank()], "GPU")
    data = load_digits(args.seed)
    to_nhwc = (0, 2, 3, 1)
    x_tr, y_tr = data.x_train.transpose(to_nhwc)[rank::size], data.y_train[rank::size]
    x_te, y_te = data.x_test.transpose(to_nhwc), data.y_test
    steps_per_epoch = len(data.x_train) // size // args.batch_size  # the same on every rank
    train_ds = (tf.data.Dataset.from_tensor_slices((x_tr, y_tr))
                .shuffle(len(x_tr), seed=args.seed * 1000 + rank).repeat().batch(args.batch_size))

    model = build_model(args.seed)
    opt = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(args.lr, momentum=args.momentum),
                                   compression=compression)
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stats_callback = hvc.CompressionStatsCallback()
    initial_epoch, callbacks = 0, [hvc.MetricAverageCallback(), stats_callback]
    if args.checkpoint_dir:
        own = os.path.join(args.checkpoint_dir, f"rank{rank}")
        epoch_file = os.path.join(own, "epoch.json")
        if os.path.exists(epoch_file):  # resume: every rank its own weights, optimizer and compression state
            model.load_weights(os.path.join(own, "weights"))
            with open(epoch_file) as f:
                initial_epoch = json.load(f)["epochs_done"]
        callbacks += [tf.keras.callbacks.ModelCheckpoint(os.path.join(own, "weights"), save_weights_only=True),
                      tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: _write_json(
                          epoch_file, {"epochs_done": epoch + 1}))]
    if initial_epoch == 0:  # a resumed rank keeps its own state: broadcasting would overwrite its residuals
        callbacks.insert(0, hvc.BroadcastGlobalVariablesCallback(0))
    if opt.gradient_compression.compressor.has_schedule:
        callbacks.append(hvc.SparsityWarmupCallback())
    if args.tensorboard and rank == 0:
        callbacks.append(tf.keras.callbacks.TensorBoard(args.tensorboard))
    start = time.perf_counter()
    history = model.fit(train_ds, epochs=args.epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks,
                        verbose=args.verbose if rank == 0 else 0, initial_epoch=initial_epoch)
    elapsed = time.perf_counter() - start

    flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    rows = hvc.allgather(flat[None], name="final_params")
    identical = bool(all(np.array_equal(rows[0], r) for r in rows.numpy()))
    _, accuracy = model.evaluate(x_te, y_te, verbose=0)
    stats = opt.stats.as_dict()
    return {
        "compression": str(opt.compression), "world_size": size, "epochs": args.epochs,
        "test_accuracy": float(accuracy), "bytes_per_step": stats["bytes_per_step"],
        "dense_bytes_per_step": stats["dense_bytes_per_step"], "compression_ratio": stats["ratio"],
        "steps": stats["steps"], "parameters_identical_across_ranks": identical, "seconds": elapsed,
        "density_per_epoch": history.history.get("density"),
        "bytes_per_step_last_epoch": history.history["wire_bytes_per_step"][-1],
        "decisions": stats_callback.decisions().as_dict(), "decision_lines": stats_callback.decisions().lines(),
    }


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = train(args)
    if hvc.rank() == 0:
        print(f"compression           {result['compression']}")
        print(f"test accuracy         {result['test_accuracy']:.4f}")
        print(f"bytes/step per rank   {result['bytes_per_step']:.0f} (dense {result['dense_bytes_per_step']:.0f}, "
              f"{result['compression_ratio']:.1f}x smaller)")
        print(f"last epoch            {result['bytes_per_step_last_epoch']:.0f} bytes/step "
              f"({result['dense_bytes_per_step'] / result['bytes_per_step_last_epoch']:.1f}x smaller)")
        print(f"identical parameters  {result['parameters_identical_across_ranks']}")
        print("sent per group:")
        print("\n".join("  " + line for line in result["decision_lines"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    identical = result["parameters_identical_across_ranks"]
    hvc.shutdown()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
