"""1-bit Adam (Tang et al., arXiv 2102.02888) for TensorFlow; the math, the warm-up and what stands
in for the paper's server are in the oracle, ``hvdcompress.reference.onebitadam``.

The exchange returns Adam's direction ``d = m_hat / (sqrt(v_hat) + eps)``; ``m``, ``v`` and this
rank's ``residual`` are flat state variables. Under ``tf.function`` the step is a tensor, so the
two phases cannot yield different collectives: every step is ONE allgather of a uint8 buffer,
the float32 gradient's bytes during the warm-up (an exact average: the rows summed in rank order,
as an allreduce of two ranks) and ``onebit``'s packed payload after it (its compressor's ops,
error feedback on; the moment divided by the frozen denominator, recomputed from ``v``, unless
``space=moment``); a ``tf.cond`` picks what is sent and how it is read, so only one is computed.
With ``warmup_codec`` the warm-up's buffer holds the gradient's fp16 or bf16 codes (2 bytes an
entry): fp16 rows are summed in half in rank order (the ``fp16`` spec's allreduce), bf16 rows
decoded and summed in float32 (the ``bf16`` spec's gather).

Keras: the optimizer must apply the direction as it is, which Keras SGD with momentum 0 does, its
``weight_decay`` decoupled as AdamW's (``hvdcompress.momentum.take_over_keras_adam``); a Keras
Adam would apply Adam a second time, and is refused with what to pass instead.
"""

from __future__ import annotations

from abc import abstractmethod

import tensorflow as tf

from hvdcompress.momentum import take_over_keras_adam
from hvdcompress.reference.onebitadam import adam_constants, bias_corrections, inner_spec

from ..collectives import Allgather
from .base import Compressor
from .quantizers import OneBitCompressor

SLOTS = ("m", "v", "residual")


class FrozenVarianceAdam(Compressor):
    """The frozen-variance Adam of ``hvdcompress.reference.onebitadam`` with the first moment's
    codec given by a subclass: ``moment`` (a one-round compressor with error feedback on),
    ``packed`` (the codec's payload as one uint8 buffer, the residual updated) and ``decoded_sum``
    (every rank's gathered buffer -> the sum over ranks of the decoded moments)."""

    summed = False
    uses_step = True  # the warm-up and the bias correction follow the step
    shared_slots = ("m", "v")  # the averaged moment and the frozen variance: the same on every rank

    def __init__(self, spec, moment: Compressor):
        super().__init__(spec)
        self.moment = moment

    @abstractmethod
    def packed(self, local, ctx):
        """This rank's payload for the moment ``local`` as one flat uint8 tensor; the residual in
        ``ctx.state`` updated (error feedback)."""

    @abstractmethod
    def decoded_sum(self, gathered, local, ctx):
        """The gathered uint8 buffers (rank order) -> the sum over ranks of the decoded moments."""

    @classmethod
    def adapt_optimizer(cls, spec, config):
        return take_over_keras_adam(spec, config), config

    @property
    def can_send_dense(self) -> bool:
        return False  # the result is Adam's direction, not an average a dense group could send

    @property
    def stateful(self) -> bool:
        return True

    def state_slots(self, shape):
        return SLOTS

    def make_slot(self, slot, numel, dtype, name=None):
        """float32 whatever the gradient's dtype: the oracle's moments and residual are float32."""
        return super().make_slot(slot, numel, tf.float32, name)

    def exchange(self, x, ctx):
        c = adam_constants(self.spec)
        f32 = lambda value: tf.constant(value, tf.float32)  # noqa: E731 (rounded once, as np.float32)
        b1, b2, eps = f32(c["beta1"]), f32(c["beta2"]), f32(c["eps"])
        one_b1, one_b2 = f32(1.0 - c["beta1"]), f32(1.0 - c["beta2"])
        g = tf.cast(tf.reshape(x, [-1]), tf.float32)
        numel = int(g.shape[0])
        m, v = ctx.state["m"], ctx.state["v"]
        step = tf.cast(ctx.step, tf.int64)
        warm = step < self.spec["warmup_steps"]
        f1, f2 = self._factors(step)
        direction = self.spec["space"] == "direction"
        local = m * b1 + g * one_b1
        frozen = self._denominator(v.read_value(), f2, eps)  # den, used after the warm-up, when v no longer moves

        codec = self.spec["warmup_codec"]
        half = {"fp16": tf.float16, "bf16": tf.bfloat16}.get(codec)

        def dense_bytes():  # float32, or the 16-bit codes of warmup_codec (fp16 and bf16 round to nearest even)
            return tf.reshape(tf.bitcast(g if half is None else tf.cast(g, half), tf.uint8), [-1])

        def sent():
            return self.packed(local / frozen if direction else local, ctx)

        (gathered,) = yield (Allgather(tf.cond(warm, dense_bytes, sent)),)

        def warm_moments():
            if half is None:
                rows = tf.bitcast(tf.reshape(gathered, [ctx.world_size, numel, 4]), tf.float32)
            else:
                rows = tf.bitcast(tf.reshape(gathered, [ctx.world_size, numel, 2]), half)
                if codec == "bf16":  # bf16's exchange: decoded, then summed in float32
                    rows = tf.cast(rows, tf.float32)
            total = rows[0]
            for r in range(1, ctx.world_size):  # rank order (fp16: summed in half, as fp16's allreduce)
                total = total + rows[r]
            mean = tf.cast(total, tf.float32) * f32(ctx.scale)
            return m * b1 + mean * one_b1, v * b2 + (mean * mean) * one_b2

        def compressed_moments():
            mean = self.decoded_sum(gathered, local, ctx) * f32(ctx.scale)
            return (mean * frozen if direction else mean), v.read_value()

        m_new, v_new = tf.cond(warm, warm_moments, compressed_moments)
        m.assign(m_new)
        v.assign(v_new)
        d = (m_new * f1) / self._denominator(v_new, f2, eps)
        return tf.cast(tf.reshape(d, tf.shape(x)), x.dtype)

    @staticmethod
    def _denominator(v, f2, eps):
        """sqrt(v) * f2 + eps in float32, as the oracle's ``denominator``."""
        root = tf.cast(tf.sqrt(tf.cast(v, tf.float64)), tf.float32)  # correctly rounded, as the oracle's
        return root * f2 + eps

    def _factors(self, step):
        """The bias corrections' factors at ``step`` (``bias_corrections``, float64 rounded once to
        float32), read from tables made once in Python: f1 until it rounds to 1, f2 until the
        variance freezes (a traced step cannot call Python's pow, and TF's may round differently)."""
        if not hasattr(self, "_tables"):
            import numpy as np
            f1, s = [], 0
            while len(f1) < 2 ** 20:
                value = np.float32(bias_corrections(self.spec, s)[0])
                f1.append(value)
                if value == 1.0:
                    break
                s += 1
            f2 = [np.float32(bias_corrections(self.spec, s)[1]) for s in range(int(self.spec["warmup_steps"]))]
            self._tables = (np.asarray(f1, np.float32), np.asarray(f2, np.float32))
        f1, f2 = self._tables
        at = lambda table: tf.gather(tf.constant(table), tf.minimum(step, len(table) - 1))  # noqa: E731
        return at(f1), at(f2)


class PackedMomentAdam(FrozenVarianceAdam):
    """A frozen-variance Adam whose moment codec is a packed quantizer (one uint8 payload a rank:
    ``onebit`` here, ``qsgd`` in ``qsgdadam``)."""

    def packed(self, local, ctx):
        a = self.moment.memory.compensate(local, ctx.state)
        sel = self.moment.select(a, ctx)
        (payload,) = self.moment.compress(a, sel, ctx)
        self.moment.memory.update(lambda: self.moment.unsent((payload,), a, sel, ctx), ctx.state)
        return payload

    def decoded_sum(self, gathered, local, ctx):
        return self.moment.aggregate((gathered,), local, None, ctx)


class OneBitAdamCompressor(PackedMomentAdam):
    name = "onebitadam"

    def __init__(self, spec):
        super().__init__(spec, OneBitCompressor(inner_spec(spec)))
