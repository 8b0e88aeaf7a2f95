"""Train a 1-D CNN on MNIST-1D (generated offline by the ``mnist1d`` package, no download) with a
custom TensorFlow 2 loop, ``hvc.DistributedGradientTape`` and compressed gradients.

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow2_mnist1d.py --compression topk:ratio=0.01

The compression state (residuals, DGC momenta, step and epoch counters) lives in one
``hvc.GradientCompression``, made once and checkpointed with the model and optimizer
(``--checkpoint-dir``: every rank saves its own, since residuals differ per rank; a rerun with the
same directory resumes). The train step is a ``tf.function``: the exchange is traced into it. At
the end rank 0 prints the test accuracy and the bytes each rank put on the wire per step next to
dense, and every rank checks that all ranks hold identical parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdcompress.tensorflow as hvc  # noqa: E402
from hvdcompress.datasets import load_mnist1d  # noqa: E402


def build_model(seed: int) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)  # the same initial weights on every rank
    layers = tf.keras.layers
    return tf.keras.Sequential([
        layers.Conv1D(32, 5, padding="same", activation="relu", input_shape=(40, 1)),
        layers.Conv1D(32, 3, padding="same", activation="relu"),
        layers.MaxPooling1D(2),
        layers.Conv1D(64, 3, padding="same", activation="relu"),
        layers.MaxPooling1D(2),
        layers.Flatten(),
        layers.Dense(128, activation="relu"),
        layers.Dense(10),
    ])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", default="none", help="spec, e.g. none, fp16, topk:ratio=0.01, dgc:ratio=0.001")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (with DGC: applied in its memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", help="save every epoch (one checkpoint per rank); resume from it")
    p.add_argument("--json", help="write the final figures to this file (rank 0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = hvc.parse_spec(args.compression)  # bad specs fail here, on every rank, before any collective
    if spec.name == "dgc":  # DGC applies the momentum in its memory; the optimizer runs without
        spec = hvc.CompressionSpec("dgc", dict(spec.params, momentum=args.momentum))
    hvc.init()
    rank, size = hvc.rank(), hvc.size()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:  # every rank on its own GPU, before TensorFlow touches one
        tf.config.experimental.set_memory_growth(gpus[hvc.local_rank()], True)
        tf.config.set_visible_devices(gpus[hvc.local_rank()], "GPU")

    data = load_mnist1d()
    x_tr, y_tr = data.x_train.transpose(0, 2, 1)[rank::size], data.y_train[rank::size]
    x_te, y_te = data.x_test.transpose(0, 2, 1), data.y_test
    steps_per_epoch = len(data.x_train) // size // args.batch_size  # the same on every rank

    model = build_model(args.seed)
    opt = tf.keras.optimizers.SGD(args.lr, momentum=0.0 if spec.name == "dgc" else args.momentum)
    compression = hvc.GradientCompression(spec)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvc.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, compression=compression,
                               epoch=tf.Variable(0, dtype=tf.int64))
    manager = (tf.train.CheckpointManager(ckpt, os.path.join(args.checkpoint_dir, f"rank{rank}"), max_to_keep=1)
               if args.checkpoint_dir else None)
    if manager and manager.latest_checkpoint:
        ckpt.restore(manager.latest_checkpoint)
    first_epoch = int(ckpt.epoch.numpy())

    start = time.perf_counter()
    epoch_start = compression.stats
    for epoch in range(first_epoch, args.epochs):
        epoch_start = compression.stats
        compression.set_epoch(epoch)
        perm = np.random.default_rng([args.seed, rank, epoch]).permutation(len(x_tr))  # resumable
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            loss = train_step(tf.constant(x_tr[idx]), tf.constant(y_tr[idx]))
            if epoch == first_epoch and i == 0 and first_epoch == 0:  # after the optimizer built its slots
                hvc.broadcast_variables(model.variables + opt.variables, root_rank=0)
        ckpt.epoch.assign(epoch + 1)
        if manager:
            manager.save()
        if rank == 0:
            print(f"epoch {epoch + 1:3d}  loss {float(loss):.4f}  density {compression.density}  "
                  f"bytes/step {compression.stats.last_bytes}")
    elapsed = time.perf_counter() - start

    flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    rows = hvc.allgather(flat[None], name="final_params").numpy()
    identical = bool(all(np.array_equal(rows[0], r) for r in rows))
    logits = model(tf.constant(x_te), training=False)
    accuracy = float(np.mean(np.argmax(logits.numpy(), 1) == y_te))
    stats = compression.stats.as_dict()
    now = compression.stats
    last_epoch = (now.total_bytes - epoch_start.total_bytes) / max(1, now.steps - epoch_start.steps)
    result = {"compression": str(spec), "world_size": size, "epochs": args.epochs, "test_accuracy": accuracy,
              "bytes_per_step": stats["bytes_per_step"], "dense_bytes_per_step": stats["dense_bytes_per_step"],
              "compression_ratio": stats["ratio"], "steps": stats["steps"],
              "bytes_per_step_last_epoch": last_epoch,
              "parameters_identical_across_ranks": identical, "seconds": elapsed}
    if rank == 0:
        print(f"compression           {result['compression']}")
        print(f"test accuracy         {accuracy:.4f}")
        print(f"bytes/step per rank   {result['bytes_per_step']:.0f} (dense {result['dense_bytes_per_step']:.0f}, "
              f"{result['compression_ratio']:.1f}x smaller)")
        print(f"last epoch            {last_epoch:.0f} bytes/step "
              f"({result['dense_bytes_per_step'] / max(last_epoch, 1):.1f}x smaller)")
        print(f"identical parameters  {identical}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    hvc.shutdown()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
