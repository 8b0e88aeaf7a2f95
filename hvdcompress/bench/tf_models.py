"""The benchmark's models in Keras (tf.keras 2), for ``hvdcompress bench --framework tf``.

Each mirrors the model of the same name in ``torch_models``: the same layers, so the same
parameter tensors with the same number of entries, in the same order (a Keras conv kernel is
3x3xCinxCout where torch's is CoutxCinx3x3: the same count). The dense gradient, and so every
compressor's payload, is therefore as large as with ``--framework torch``. Inputs are
channels-last (32x32x3), the layout TensorFlow's CPU convolutions take.

    vgg   6.4M parameters in 18 tensors
    mlp   12.6M parameters in 8 tensors
    deep  0.33M parameters in 100 tensors

Import ``tf_ops`` (or ``hvdcompress.keras``) before this module, so tf.keras is Keras 2.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import numpy as np
import tensorflow as tf

NUM_CLASSES = 10
INPUT_SHAPE: Tuple[int, ...] = (32, 32, 3)
layers = tf.keras.layers


def _vgg() -> tf.keras.Model:
    """6 conv layers (64-64-128-128-256-256, 3x3, ReLU, max-pool after each pair) and a
    4096-1024-1024-10 classifier."""
    stack = [layers.InputLayer(input_shape=INPUT_SHAPE)]
    for c_out in (64, 128, 256):
        stack += [layers.Conv2D(c_out, 3, padding="same", activation="relu"),
                  layers.Conv2D(c_out, 3, padding="same", activation="relu"), layers.MaxPool2D(2)]
    stack += [layers.Flatten(), layers.Dense(1024, activation="relu"), layers.Dense(1024, activation="relu"),
              layers.Dense(NUM_CLASSES)]
    return tf.keras.Sequential(stack)


def _mlp() -> tf.keras.Model:
    """3072-2048-2048-1024-10 on flattened inputs."""
    return tf.keras.Sequential([layers.InputLayer(input_shape=INPUT_SHAPE), layers.Flatten(),
                                layers.Dense(2048, activation="relu"), layers.Dense(2048, activation="relu"),
                                layers.Dense(1024, activation="relu"), layers.Dense(NUM_CLASSES)])


def _deep(width: int = 64, blocks: int = 16) -> tf.keras.Model:
    """16 residual blocks x + W2 relu(W1 LayerNorm(x)) of width 64 between an input and an
    output layer."""
    inputs = tf.keras.Input(shape=INPUT_SHAPE)
    x = layers.Dense(width)(layers.Flatten()(inputs))
    for _ in range(blocks):
        h = layers.LayerNormalization(epsilon=1e-5)(x)
        h = layers.Dense(width)(layers.Dense(width, activation="relu")(h))
        x = layers.Add()([x, h])
    return tf.keras.Model(inputs, layers.Dense(NUM_CLASSES)(x))


MODELS: Dict[str, Callable[[], tf.keras.Model]] = {"vgg": _vgg, "mlp": _mlp, "deep": _deep}


def build(name: str, seed: int = 0) -> tf.keras.Model:
    """The model called ``name`` (one of :data:`MODELS`), initialised from ``seed`` (the worker
    also broadcasts rank 0's variables, so the ranks start equal whatever the initialisers do)."""
    if name not in MODELS:
        raise ValueError(f"model: unknown model {name!r} for --framework tf; known models: "
                         f"{', '.join(sorted(MODELS))}")
    tf.keras.utils.set_random_seed(seed)
    return MODELS[name]()


def synthetic_batch(batch_size: int, seed: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """A fixed random batch: inputs of shape (batch_size, 32, 32, 3) and int labels in [0, 10)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch_size,) + INPUT_SHAPE).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, batch_size).astype(np.int64)
    return tf.constant(x), tf.constant(y)


def count_parameters(model: tf.keras.Model) -> Tuple[int, int]:
    """(number of parameters, number of parameter tensors)."""
    params = model.trainable_variables
    return int(sum(int(np.prod(v.shape)) for v in params)), len(params)
