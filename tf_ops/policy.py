"""Sync policies of the TensorFlow exchange: what a step hands the optimizer, and how to flush.

``GradientCompression`` (``tf_ops.compression``) runs the groups and the exchange on its session;
its policy, chosen once at construction, answers the questions that differ between modes, and the
owner never branches on which policy it has:

    step(host, grads)                  the gradients of this step
    pending(host)                      the corrections not yet applied (flush), per position
    finish_flush(host, ...)            apply those and make the replicas identical

A policy sees the exchange only through ``PolicyHost``, the few things it may use (as on PyTorch,
``torch_ops.policy.PolicyHost``; TF's host is one call's exchange, since TF collectives complete
within the step that issues them).

plus ``delay`` / ``every`` (the mode's parameters), ``active`` (replicas may differ between
flushes, so there is state to flush and the mode cannot follow an elastic reset) and
``sparse_exchanges`` (a ``tf.IndexedSlices`` may be exchanged sparse; otherwise it is densified).

``Synchronous`` (here) hands over the exchanged average; ``DelayedAveraging`` (``tf_ops.delayed``:
delayed averaging and temporal sparsity) is the other implementation, as on PyTorch
(``torch_ops.policy``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, List, Optional, Protocol, Sequence

import tensorflow as tf

Exchange = Callable[[List[Optional[tf.Tensor]]], List[Optional[tf.Tensor]]]


class PolicyHost(Protocol):
    """What a sync policy may use of the exchange that runs it."""

    factor: float  # puts a local gradient in the result's units (prescale * scale * world size)
    process_set: Any  # the Horovod process set the replicas are averaged over (None: the global one)
    name: str  # prefix of the flush's collectives

    def exchange(self, grads: List[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        """The synchronous compressed exchange of a list of gradients (None stays None)."""


class SyncPolicy(ABC):
    """The interface (module doc)."""

    delay = 0
    every = 1
    active = False
    sparse_exchanges = True

    @abstractmethod
    def step(self, host: PolicyHost, grads: Sequence[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        """This step's gradients (None stays None), exchanged through ``host``."""

    @abstractmethod
    def pending(self, host: PolicyHost) -> List[Optional[tf.Tensor]]:
        """The corrections not yet applied, summed per gradient position (None where none), and
        forgotten; [] when there are none by construction."""

    @abstractmethod
    def finish_flush(self, host: PolicyHost, corrections: Sequence[Optional[tf.Tensor]], variables, optimizer,
                     apply_gradients) -> None:
        """Apply ``pending``'s corrections and make every rank's variables identical."""


class Synchronous(SyncPolicy):
    """Every step exchanges every gradient, and the exchanged averages are the step's gradients:
    replicas are identical after every step, so there is nothing to flush."""

    def step(self, host, grads):
        return host.exchange(list(grads))

    def pending(self, host):
        return []

    def finish_flush(self, host, corrections, variables, optimizer, apply_gradients) -> None:
        """Nothing to apply: replicas are identical after every step."""


__all__ = ["Exchange", "PolicyHost", "SyncPolicy", "Synchronous"]
