"""Delayed gradient averaging and temporal sparsity (Zhu et al., "Delayed Gradient Averaging",
NeurIPS 2021), for the PyTorch ``DistributedOptimizer`` (``delay=``, ``sync_every=``).

With ``delay=D`` the exchange a worker launches at step i is completed at step i+D, so a link's
latency is hidden behind D steps of computation. The gradient the wrapped optimizer sees on
worker j at step i is

    d_i,j = g_i,j - g_(i-D),j + R_(i-D)        (the last two terms only once step i-D exchanged)

where g_t,j is what worker j put into the exchange of step t (its local gradient) and R_t the
exchanged average. Unrolled, plain SGD gives
``w_n,j = w_0 - lr*sum_(t<=n-D) R_t - lr*sum_(n-D<t<=n) g_t,j``: the global average of every
step that has arrived, plus this worker's own last D steps. D = 0 is the synchronous optimizer
(the same code path, bit for bit).

With ``sync_every=K`` (temporal sparsity) a worker exchanges once every K steps: on the other
steps it applies its local gradient alone and adds it to an accumulator; on the K-th step it
exchanges the accumulated sum A (this step included) and the correction ``R - A_j`` enters the
gradient D steps later. K = 1 exchanges every step.

How compressors compose: the exchange is the compressor's exchange of the local term (so error
feedback, DGC's momenta and the sketch's memories see exactly what they see synchronously, one
exchange per K steps); ``R`` is its decompressed averaged result, and the local term is the
uncompressed local gradient (times the averaging factor: 1 for ``op=Average``, N for ``Sum``).
Over a run, the sum of every step's ``d`` equals the sum of the exchanged results plus the local
terms still in flight, so after a flush training has applied exactly the synchronous sequence of
exchanged results. For DGC, R carries DGC's momentum (momentum correction), the local terms are
raw gradients: between launch and arrival a worker moves along its own gradient without momentum.

Learning rate: as in the paper, a correction is part of the gradient of the step it arrives in,
so it is applied with that step's learning rate (not the rate of the step that computed it).

Replicas differ by design in their last D local terms. ``flush()`` completes every exchange in
flight, applies the pending corrections as one more step of the wrapped optimizer, and then
averages the parameters and the optimizer's per-parameter state tensors over the ranks (one
allreduce each), so that every rank holds identical parameters (stateful optimizers such as
momentum SGD keep local terms in their buffers, which no correction alone can remove).

Checkpoints: ``state_dict()`` completes the exchanges in flight (without applying them) and saves
their corrections, per parameter and with the step each is due at, plus the temporal-sparsity
accumulator; ``load_state_dict()`` restores them, so a resumed run applies the same corrections
at the same steps and continues bit for bit.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from hvdcompress.delay import check_delay, check_sync_every

from .grouping import Group, scatter


class DelayedAveraging:
    """The bookkeeping of delayed and temporally sparse exchanges (module doc); the optimizer
    owns the exchanges, this owns what is applied when."""

    def __init__(self, delay: int, sync_every: int, local_factor: float):
        self.delay = check_delay(delay)
        self.every = check_sync_every(sync_every)
        self.local_factor = float(local_factor)
        self.local: Dict[Tuple[int, int], tuple] = {}  # (step, gi) -> (names, numels, A_j)
        self.corrections: Dict[int, Dict[str, torch.Tensor]] = {}  # due step -> name -> R - A_j
        self.accumulated: Dict[str, torch.Tensor] = {}  # temporal sparsity: local gradients since the last exchange

    @property
    def active(self) -> bool:
        return self.delay > 0 or self.every > 1

    def exchanges_at(self, step: int) -> bool:
        """Whether step ``step`` launches exchanges (every K-th step)."""
        return (step + 1) % self.every == 0

    def slots(self) -> int:
        """Distinct Horovod name slots needed: exchanges launched within D steps are in flight together."""
        return self.delay + 1

    def local_term(self, group: Group, x: torch.Tensor) -> torch.Tensor:
        """This worker's contribution to the exchange of ``group`` (flat): the step's gradient plus
        what temporal sparsity accumulated, in the result's units; a new tensor."""
        parts = [self.accumulated.pop(n, None) for n in group.names]
        local = x.clone()
        if any(p is not None for p in parts):
            offset = 0
            for p, n in zip(parts, group.numels):
                if p is not None:
                    local[offset:offset + n].add_(p.reshape(-1))
                offset += n
        return local

    def remember(self, step: int, gi: int, group: Group, local: torch.Tensor) -> None:
        self.local[(step, gi)] = (group.names, group.numels,
                                  local * self.local_factor if self.local_factor != 1.0 else local)

    def completed(self, key: Tuple[int, int], result: torch.Tensor, due_step: Optional[int] = None) -> None:
        """The exchange launched at ``key`` = (step, group) finished with ``result``: its correction
        R - A_j becomes due ``delay`` steps after launch (or at ``due_step``), per parameter."""
        names, numels, local = self.local.pop(key)
        correction = result - local
        due = self.corrections.setdefault(key[0] + self.delay if due_step is None else due_step, {})
        offset = 0
        for name, n in zip(names, numels):
            part = correction[offset:offset + n]
            due[name] = due[name] + part if name in due else part.clone()
            offset += n

    def accumulate(self, name: str, grad: torch.Tensor) -> None:
        """A local step's gradient, kept for the next exchange (temporal sparsity)."""
        acc = self.accumulated.get(name)
        self.accumulated[name] = grad.detach().reshape(-1).clone() if acc is None else acc.add_(grad.reshape(-1))

    def apply(self, step: int, params: Dict[str, torch.Tensor]) -> None:
        """Write step ``step`` 's gradients: the local gradient (times the averaging factor) plus
        every correction due now."""
        due = self.corrections.pop(step, {})
        for name, p in params.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.local_factor != 1.0:
                p.grad.mul_(self.local_factor)
            c = due.get(name)
            if c is not None:
                p.grad.add_(c.view_as(p.grad))

    def pending_corrections(self) -> Dict[str, torch.Tensor]:
        """Every correction not yet applied, summed per parameter (and forgotten)."""
        out: Dict[str, torch.Tensor] = {}
        for due in sorted(self.corrections):
            for name, c in self.corrections[due].items():
                out[name] = out[name] + c if name in out else c.clone()
        self.corrections = {}
        return out

    # -- checkpoints --------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"delay": self.delay, "sync_every": self.every,
                "corrections": {int(d): {n: c.detach().clone() for n, c in cs.items()}
                                for d, cs in self.corrections.items()},
                "accumulated": {n: t.detach().clone() for n, t in self.accumulated.items()}}

    def load(self, saved: Optional[dict], device_of) -> None:
        if saved is None:
            self.corrections, self.accumulated = {}, {}
            return
        if (saved["delay"], saved["sync_every"]) != (self.delay, self.every):
            raise ValueError(f"load_state_dict: the checkpoint was saved with delay={saved['delay']}, "
                             f"sync_every={saved['sync_every']}; this optimizer uses delay={self.delay}, "
                             f"sync_every={self.every}")
        self.corrections = {int(d): {n: c.clone().to(device_of(n)) for n, c in cs.items()}
                            for d, cs in saved["corrections"].items()}
        self.accumulated = {n: t.clone().to(device_of(n)) for n, t in saved["accumulated"].items()}
        self.local = {}


def average_over_ranks(comm, params: List[torch.Tensor], optimizer_state, name: str) -> None:
    """Average the parameters and the optimizer's per-parameter floating state tensors of the
    same shape (momentum buffers, Adam's moments) over the communicator's ranks, in place, so
    every rank holds identical values afterwards (one allreduce per tensor)."""
    with torch.no_grad():
        for i, p in enumerate(params):
            comm.allreduce_(p.data, f"{name}.p{i}", average=True)
            st = optimizer_state.get(p, {})
            for k in sorted(st):
                t = st[k]
                if torch.is_tensor(t) and t.is_floating_point() and t.shape == p.shape:
                    comm.allreduce_(t, f"{name}.p{i}.{k}", average=True)


__all__ = ["DelayedAveraging", "average_over_ranks", "check_delay", "check_sync_every", "scatter"]
