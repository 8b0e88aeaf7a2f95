"""Sync policies: when the engine exchanges, what a group sends, what is written back, how to flush.

The engine (``torch_ops.engine``) asks its policy a few questions and never branches on which
policy it has:

    exchanges_at(step)            does this step launch exchanges?
    exchange_input(engine, ...)   the flat tensor a group sends this step, and the exchange's name
    write_back(engine, ...)       write the step's gradients into ``p.grad`` from the completed exchanges
    complete_in_flight(engine)    finish exchanges that span steps (before a checkpoint or a regroup)
    flush(engine, ...)            make the replicas identical
    state() / load(saved)         what the policy keeps between steps, in the checkpoint

``Synchronous`` (here) exchanges every step and writes each exchanged average back; ``Delayed``
(``torch_ops.delayed``: delayed averaging and temporal sparsity) is the other implementation.
An outer-optimizer mode is a third one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Dict, Optional, Tuple

import torch


class SyncPolicy(ABC):
    """The interface (see the module doc); ``delay`` is how many steps after its launch an
    exchange is due, ``active`` whether replicas may differ between flushes,
    ``sparse_exchanges`` whether a sparse gradient may be exchanged sparse (its result written
    back as it comes) rather than densified."""

    delay = 0
    every = 1
    active = False
    sparse_exchanges = False

    @abstractmethod
    def exchanges_at(self, step: int) -> bool:
        """Whether step ``step`` launches exchanges."""

    @abstractmethod
    def exchange_input(self, engine, gi: int, group, grads) -> Tuple[torch.Tensor, str]:
        """The flat tensor group ``gi`` sends this step, and the exchange's name."""

    @abstractmethod
    def write_back(self, engine, step: int, pending: Dict, exchanging: bool) -> None:
        """Write the step's gradients into ``p.grad`` from the completed exchanges."""

    @abstractmethod
    def complete_in_flight(self, engine) -> None:
        """Finish exchanges that span steps (before a checkpoint or a regroup)."""

    @abstractmethod
    def flush(self, engine, optimizer, wrapped_step: Callable[[], None]) -> None:
        """Make the replicas identical."""

    @abstractmethod
    def state(self) -> Optional[dict]:
        """What the policy keeps between steps, for the checkpoint (None: nothing)."""

    @abstractmethod
    def load(self, saved: Optional[dict], device_of) -> None:
        """Restore ``state()`` (ValueError if it was saved by another policy)."""


class Synchronous(SyncPolicy):
    """Every step exchanges every group, and the exchanged averages are the step's gradients."""

    sparse_exchanges = True

    def exchanges_at(self, step: int) -> bool:
        return True

    def exchange_input(self, engine, gi: int, group, grads) -> Tuple[torch.Tensor, str]:
        """The group's gradients, flat (a merged group's buffer is the engine's, reused from step
        to step; a lone gradient is the parameter's own ``.grad``, scaled into a new tensor)."""
        x = engine.flat.flatten(group.key, grads)
        if engine.prescale != 1.0:
            x = x.mul_(engine.prescale) if len(grads) > 1 else x * engine.prescale
        return x, f"hvc.{group.key}"

    def write_back(self, engine, step: int, pending: Dict, exchanging: bool) -> None:
        for ex in pending.values():
            ex.apply(ex.result)  # the exchange knows where its result goes (dense groups, sparse gradients)

    def complete_in_flight(self, engine) -> None:
        """Nothing spans steps."""

    def flush(self, engine, optimizer, wrapped_step) -> None:
        """Replicas are identical after every step: nothing to do."""

    def state(self) -> Optional[dict]:
        return None

    def load(self, saved: Optional[dict], device_of) -> None:
        if saved is not None:
            raise ValueError(f"load_state_dict: the checkpoint was saved with delay={saved['delay']}, "
                             f"sync_every={saved['sync_every']}; this optimizer uses delay=0, sync_every=1")
