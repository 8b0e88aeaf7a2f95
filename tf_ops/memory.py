"""Error-feedback memories for TensorFlow (the 'memory' role of the compressor contract).

    a = g + r        compensate: add back what earlier steps did not send
    r = a - D(C(a))  update: keep what this step does not send

Nothing the worker computed is dropped, only delayed. The residual is a ``tf.Variable`` (flat, one
per tensor) in the exchange context's ``state``, owned by ``GradientCompression`` and saved with
``tf.train.Checkpoint``. It starts at -0.0, the exact additive identity of IEEE floats
(``-0.0 + -0.0 = -0.0``, while ``-0.0 + 0.0 = +0.0``), so the first step sends ``g`` bit for bit, as
the oracle (which has no residual yet) does.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import tensorflow as tf

from hvdcompress.spec import CompressionSpec


class Memory:
    """No memory: what is not sent is lost (the right choice for lossless or unbiased codecs)."""

    slots: Tuple[str, ...] = ()
    initial = 0.0  # value the slots start at

    def compensate(self, x: tf.Tensor, state: Dict[str, tf.Variable]) -> tf.Tensor:
        return x

    def update(self, unsent: Callable[[], tf.Tensor], state: Dict[str, tf.Variable]) -> None:
        """``unsent()`` computes a - D(C(a)); called only by memories that keep it (as in
        ``torch_ops.memory``: the same name and signature on both backends)."""
        return None


class ResidualMemory(Memory):
    """Error feedback with a residual per tensor."""

    slots = ("residual",)
    initial = -0.0

    def compensate(self, x, state):
        r = state["residual"]
        if r.shape != x.shape:
            raise ValueError(f"residual memory: stored residual has shape {tuple(r.shape)}, "
                             f"gradient has {tuple(x.shape)}")
        return x + r

    def update(self, unsent, state):
        state["residual"].assign(unsent())


def memory_for(spec: CompressionSpec) -> Memory:
    return ResidualMemory() if spec.params.get("residual", False) else Memory()
