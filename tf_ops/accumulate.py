"""Local gradient accumulation for ``backward_passes_per_step`` > 1 (Keras optimizer).

With P passes per step, every pass adds its gradient to a local sum s; the P-th pass exchanges s
(divided by P when ``average_aggregated_gradients``), clears the sums, and the optimizer applies
the result; the other passes apply nothing (the iteration counter still advances, as in Horovod):

    s_i += g_i;   c += 1;   if c == P:  out = exchange(s / P or s);  s = 0;  c = 0

The decision is a ``tf.cond`` on the counter, identical on every rank, so every rank enters the
collectives on the same pass. The sums and the counter are tracked variables (checkpointed).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import tensorflow as tf

from .variables import state_variable


class LocalAccumulator(tf.Module):
    def __init__(self, passes: int, average: bool, name: str = "hvc_accumulate"):
        super().__init__(name=name)
        self.passes = passes
        self.average = average
        self.counter = state_variable(0, dtype=tf.int64, trainable=False, name="counter")
        self.sums: List[Optional[tf.Variable]] = []

    def _ensure(self, grads) -> None:
        for i, g in enumerate(grads):
            if i == len(self.sums):
                self.sums.append(None)
            if g is not None and self.sums[i] is None:
                self.sums[i] = state_variable(lambda: tf.zeros(g.shape, g.dtype), trainable=False, name=f"{self.name}_{i}")

    def accumulate(self, grads: List[Optional[tf.Tensor]],
                   exchange: Callable[[List[tf.Tensor]], List[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        """Add ``grads`` to the sums; on the P-th pass return ``exchange(sums)``, else the sums."""
        self._ensure(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        for i in present:
            self.sums[i].assign_add(grads[i])
        count = self.counter.assign_add(1)

        def sync():
            totals = [self.sums[i].read_value() for i in present]
            if self.average:
                totals = [t / tf.cast(self.passes, t.dtype) for t in totals]
            out = exchange(totals)
            for i in present:
                self.sums[i].assign(tf.zeros_like(self.sums[i]))
            self.counter.assign(0)
            return out

        def local():
            return [self.sums[i].read_value() for i in present]

        result = tf.cond(tf.equal(count, self.passes), sync, local)
        out: List[Optional[tf.Tensor]] = [None] * len(grads)
        for i, r in zip(present, result):
            out[i] = r
        return out

    def synced(self) -> tf.Tensor:
        """True right after the pass that exchanged (the optimizer applies then)."""
        return tf.equal(self.counter, 0)
