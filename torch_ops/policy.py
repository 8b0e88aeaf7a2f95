"""Sync policies: when the engine exchanges, what a group sends, what is written back, how to flush.

The engine (``torch_ops.engine``) asks its policy a few questions and never branches on which
policy it has:

    exchanges_at(step)            does this step launch exchanges?
    exchange_input(host, ...)     the flat tensor a group sends this step, and the exchange's name
    write_back(host, ...)         write the step's gradients into ``p.grad`` from the completed exchanges
    complete_in_flight(host)      finish exchanges that span steps (before a checkpoint or a regroup)
    flush(host, ...)              make the replicas identical
    state() / load(saved)         what the policy keeps between steps, in the checkpoint

A policy sees the engine only through ``PolicyHost``, the few things it may read and ask for.
``Synchronous`` (here) exchanges every step and writes each exchanged average back;
``DelayedAveraging`` (``torch_ops.delayed``: delayed averaging and temporal sparsity) is the other
implementation. DiLoCo (``torch_ops.diloco``) is not a policy: it exchanges parameters, not
gradients, around a whole inner optimizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch

from .session import exchange_name


class PolicyHost(Protocol):
    """What a sync policy may use of the engine that runs it."""

    step: int  # the step being run (exchanges launched now carry it)
    prescale: float  # what a gradient is multiplied by before it is sent (1 / predivide)
    by_name: Dict[str, torch.Tensor]  # the parameters, by name
    groups: list  # the groups exchanged now (``torch_ops.grouping.Group``), in launch order

    def flatten(self, group, grads: List[torch.Tensor]) -> torch.Tensor:
        """The group's gradients, flat."""

    def launched_now(self) -> bool:
        """Exchanges of the current step were launched and not synchronized yet."""

    def launch(self, gi: int) -> None:
        """Start group ``gi`` 's exchange from its gradients now."""

    def finish_in_flight(self) -> Dict:
        """Complete every exchange in flight: {(launch step, group index): exchange}."""

    def before_step(self, optimizer) -> None:
        """The compressor's turn right before the wrapped optimizer's step."""

    def average_over_ranks(self, optimizer_state, name: str) -> None:
        """Average the parameters and the optimizer's per-parameter state over the ranks."""


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
    def exchange_input(self, host: PolicyHost, gi: int, group, grads) -> Tuple[torch.Tensor, str]:
        """The flat tensor group ``gi`` sends this step, and the exchange's name."""

    @abstractmethod
    def write_back(self, host: PolicyHost, step: int, pending: Dict, exchanging: bool) -> None:
        """Write the step's gradients into ``p.grad`` from the completed exchanges."""

    @abstractmethod
    def complete_in_flight(self, host: PolicyHost) -> None:
        """Finish exchanges that span steps (before a checkpoint or a regroup)."""

    @abstractmethod
    def flush(self, host: PolicyHost, optimizer, wrapped_step: Callable[[], None]) -> None:
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

    def exchange_input(self, host: PolicyHost, gi: int, group, grads) -> Tuple[torch.Tensor, str]:
        """The group's gradients, flat (a merged group's buffer is the engine's, reused from step
        to step; a lone gradient is the parameter's own ``.grad``, scaled into a new tensor)."""
        x = host.flatten(group, grads)
        if host.prescale != 1.0:
            x = x.mul_(host.prescale) if len(grads) > 1 else x * host.prescale
        return x, exchange_name(group.key)

    def write_back(self, host: PolicyHost, step: int, pending: Dict, exchanging: bool) -> None:
        for ex in pending.values():
            ex.apply(ex.result)  # the exchange knows where its result goes (dense groups, sparse gradients)

    def complete_in_flight(self, host: PolicyHost) -> None:
        """Nothing spans steps."""

    def flush(self, host: PolicyHost, optimizer, wrapped_step) -> None:
        """Replicas are identical after every step: nothing to do."""

    def state(self) -> Optional[dict]:
        return None

    def load(self, saved: Optional[dict], device_of) -> None:
        if saved is not None:
            raise ValueError(f"load_state_dict: the checkpoint was saved with delay={saved['delay']}, "
                             f"sync_every={saved['sync_every']}; this optimizer uses delay=0, sync_every=1")
