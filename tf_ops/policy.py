"""Sync policies of the TensorFlow exchange: what a step hands the optimizer, and how to flush.

``GradientCompression`` (``tf_ops.compression``) owns the compressor, the groups and the exchange;
its policy, chosen once at construction, answers the questions that differ between modes, and the
owner never branches on which policy it has:

    step(grads, exchange, factor)      the gradients of this step, given the synchronous exchange
    pending(exchange, factor)          the corrections not yet applied (flush), per position
    finish_flush(...)                  apply those and make the replicas identical

plus ``delay`` / ``every`` (the mode's parameters), ``active`` (replicas may differ between
flushes, so there is state to flush and the mode cannot follow an elastic reset) and
``sparse_exchanges`` (a ``tf.IndexedSlices`` may be exchanged sparse; otherwise it is densified).

``Synchronous`` (here) hands over the exchanged average; ``DelayedAveraging`` (``tf_ops.delayed``:
delayed averaging and temporal sparsity) is the other implementation, as on PyTorch
(``torch_ops.policy``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, List, Optional, Sequence

import tensorflow as tf

Exchange = Callable[[List[Optional[tf.Tensor]]], List[Optional[tf.Tensor]]]


class SyncPolicy(ABC):
    """The interface (module doc)."""

    delay = 0
    every = 1
    active = False
    sparse_exchanges = True

    @abstractmethod
    def step(self, grads: Sequence[Optional[tf.Tensor]], exchange: Exchange, factor: float
             ) -> List[Optional[tf.Tensor]]:
        """This step's gradients (None stays None). ``exchange`` is the synchronous compressed
        exchange of a list of gradients; ``factor`` puts a local gradient in the result's units."""

    @abstractmethod
    def pending(self, exchange: Exchange, factor: float) -> List[Optional[tf.Tensor]]:
        """The corrections not yet applied, summed per gradient position (None where none), and
        forgotten; [] when there are none by construction."""

    @abstractmethod
    def finish_flush(self, corrections: Sequence[Optional[tf.Tensor]], variables, optimizer,
                     apply_gradients, process_set, name: str) -> None:
        """Apply ``pending``'s corrections and make every rank's variables identical."""


class Synchronous(SyncPolicy):
    """Every step exchanges every gradient, and the exchanged averages are the step's gradients:
    replicas are identical after every step, so there is nothing to flush."""

    def step(self, grads, exchange, factor):
        return exchange(list(grads))

    def pending(self, exchange, factor):
        return []

    def finish_flush(self, corrections, variables, optimizer, apply_gradients, process_set, name) -> None:
        """Nothing to apply: replicas are identical after every step."""


__all__ = ["Exchange", "SyncPolicy", "Synchronous"]
