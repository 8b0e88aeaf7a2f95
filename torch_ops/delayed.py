"""Delayed gradient averaging and temporal sparsity (Zhu et al., "Delayed Gradient Averaging",
NeurIPS 2021), for the PyTorch ``DistributedOptimizer`` (``delay=``, ``sync_every=``).

With ``delay=D`` the exchange a worker launches at step i is completed at step i+D, so a link's
latency is hidden behind D steps of computation. The gradient the wrapped optimizer sees on
worker j at step i is

    d_i,j = L_i,j - L_(i-D),j + R_(i-D)        (the last two terms only once step i-D exchanged)

where L_t,j is worker j's local term of step t (its local gradient g_t,j, the gradient it put
into the exchange of step t; for compressors that keep the momentum, below, its local velocity)
and R_t the exchanged average. Unrolled, plain SGD gives
``w_n,j = w_0 - lr*sum_(t<=n-D) R_t - lr*sum_(n-D<t<=n) g_t,j``: the global average of every
step that has arrived, plus this worker's own last D steps. D = 0 is the synchronous optimizer
(the same code path, bit for bit).

With ``sync_every=K`` (temporal sparsity) a worker exchanges once every K steps: on the other
steps it applies its local gradient alone and adds it to an accumulator; on the K-th step it
exchanges the accumulated sum A (this step included) and the correction ``R - A_j`` enters the
gradient D steps later. K = 1 exchanges every step.

How compressors compose: the exchange is the compressor's exchange of the local gradient (so
error feedback, DGC's momenta and the sketch's memories see exactly what they see synchronously,
one exchange per K steps), and ``R`` is its decompressed averaged result. The local term L (what
the worker applies on its own, and what the correction takes back out) is in the result's units
(the local gradient times 1 for ``op=Average``, N for ``Sum``):

* compressors whose result is a gradient (none, fp16, top-k, the quantizers, PowerSGD, ...):
  L_i,j = g_i,j, and the wrapped optimizer applies its own momentum to d as it would to a gradient;
* compressors that keep the training's momentum in their memory (DGC with momentum correction,
  the count sketch; ``Compressor.local_momentum``): their result R is a velocity, so the local term
  is a velocity too, from a local momentum buffer of this worker's gradients,
  ``u_j <- m*u_j + g_i,j; L_i,j = u_j`` (Nesterov: ``L_i,j = g_i,j + m*u_j``), saved with the
  checkpoint. The local steps then move like local momentum SGD, and the correction swaps them for
  the exchanged velocity D steps later (with L = g the local steps would have no momentum while
  the delayed result has all of it, and training degrades badly). The compressor's own memories
  (u, v, masking) are untouched.

With temporal sparsity, the exchange input is the sum of the K raw local gradients, and the local
term the sum of the K local terms applied. Over a run, the sum of every step's ``d`` equals the
sum of the exchanged results plus the local terms still in flight, so after a flush training has
applied exactly the synchronous sequence of exchanged results, whatever L is.

Non-finite gradients (``torch_ops.nonfinite``): a NaN or inf in worker j's gradient at step s is
in its own ``d_s,j`` at once (its local term), and, the guarded exchange of step s being NaN on
every rank, in every worker's ``d_(s+D)`` when the correction arrives: every rank sees it, worker
j at once and the others D steps later (nobody can know sooner without a round trip, which is
what the delay hides). Compression state and the local velocity keep no non-finite entry (they
are set to 0); a checkpoint with non-finite delayed state (a correction, an accumulator, the
velocity) is refused on load. A step skipped by the AMP pattern drops that step's ``d`` (its
local term and the correction due): replicas then differ by more than their last D local terms
until the next ``flush()``, which makes them identical again.

Learning rate: as in the paper, a correction is part of the gradient of the step it arrives in,
so it is applied with that step's learning rate (not the rate of the step that computed it).

Replicas differ by design in their last D local terms. ``flush()`` completes every exchange in
flight, applies the pending corrections as one more step of the wrapped optimizer, and then
averages the parameters and the optimizer's per-parameter state tensors over the ranks (one
allreduce each), so that every rank holds identical parameters (stateful optimizers such as
momentum SGD keep local terms in their buffers, which no correction alone can remove).

Checkpoints: ``state_dict()`` completes the exchanges in flight (without applying them) and saves
their corrections, per parameter and with the step each is due at, plus the temporal-sparsity
accumulators and the local momentum; ``load_state_dict()`` restores them, so a resumed run applies the same corrections
at the same steps and continues bit for bit.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from hvdcompress.delay import check_delay, check_sync_every

from .grouping import Group, flatten
from .nonfinite import count_nonfinite
from .policy import PolicyHost, SyncPolicy
from .session import exchange_name


class DelayedAveraging(SyncPolicy):
    """The sync policy of delayed and temporally sparse exchanges (module doc): the engine owns
    the exchanges, this owns what each sends and what is applied when."""

    def __init__(self, delay: int, sync_every: int, local_factor: float,
                 momentum: Optional[Tuple[float, bool]] = None):
        self.delay = check_delay(delay)
        self.every = check_sync_every(sync_every)
        self.local_factor = float(local_factor)
        self.momentum = momentum  # (m, nesterov): the local term is a local velocity (module doc)
        self.local: Dict[Tuple[int, int], tuple] = {}  # (step, gi) -> (names, numels, L_j)
        self.corrections: Dict[int, Dict[str, torch.Tensor]] = {}  # due step -> name -> R - L_j
        self.accumulated: Dict[str, torch.Tensor] = {}  # temporal sparsity: local gradients since the last exchange
        self.applied: Dict[str, torch.Tensor] = {}  # ... and, with momentum, the local terms applied since
        self.velocity: Dict[str, torch.Tensor] = {}  # with momentum: u_j per parameter (flat)
        self.parts: Dict[str, torch.Tensor] = {}  # with momentum: this step's local term per parameter
        self.flushing = False  # flush() exchanges accumulated gradients: no new local term

    @property
    def active(self) -> bool:
        return self.delay > 0 or self.every > 1

    # -- the policy interface (torch_ops.policy) ---------------------------------------------------
    def exchange_input(self, host: PolicyHost, gi: int, group: Group,
                       grads: List[torch.Tensor]) -> Tuple[torch.Tensor, str]:
        """The exchange gets its own copy (the local gradient stays in ``.grad``): the step's
        gradient plus what temporal sparsity accumulated; its local term is remembered for the
        correction. Named by step slot, unique among the exchanges in flight."""
        local = self.local_term(group, flatten(grads))
        self.remember(host.step, gi, group, self.applied_term(group, grads, local))
        x = local * host.prescale if host.prescale != 1.0 else local.clone()
        return x, exchange_name(group.key, f"s{host.step % self.slots()}")

    def write_back(self, host: PolicyHost, step: int, pending: Dict, exchanging: bool) -> None:
        for key, ex in pending.items():
            self.completed(key, ex.result)
        if not exchanging:  # temporal sparsity: a local step; its gradient joins the next exchange
            for name, p in host.by_name.items():
                self.accumulate(name, p.grad)
        self.apply(step, host.by_name)

    def complete_in_flight(self, host: PolicyHost) -> None:
        """Wait for every exchange in flight; their corrections stay due at their steps
        (checkpoints and regrouping need no exchange in flight)."""
        for key, ex in host.finish_in_flight().items():
            self.completed(key, ex.result)

    def flush(self, host: PolicyHost, optimizer, wrapped_step) -> None:
        """Make the replicas identical, on every rank between steps:

        1. wait for every exchange in flight (their corrections ``R - L`` become due);
        2. temporal sparsity: exchange the accumulated local gradients (zero gradients, so the
           launch's local term is what was accumulated) and wait for that too;
        3. apply all the due corrections as one step of the wrapped optimizer (the compressor's
           ``before_step`` first, as in any step);
        4. average the parameters and the optimizer's per-parameter state over the ranks
           (``average_over_ranks``): what the corrections cannot make equal (the optimizer's own
           nonlinear state, rounding) is equal afterwards, bit for bit.
        """
        if not self.active:
            return
        if host.launched_now():
            raise AssertionError("optimizer.flush() was called between backward() and step(); call it between steps")
        by_name = host.by_name
        with torch.no_grad():
            self.complete_in_flight(host)
            if self.accumulated:
                self.flushing = True
                for gi, group in enumerate(host.groups):
                    for name in group.names:
                        if by_name[name].grad is None:
                            by_name[name].grad = torch.zeros_like(by_name[name])
                        by_name[name].grad.zero_()
                    host.launch(gi)
                self.flushing = False
                for (s, gi), ex in host.finish_in_flight().items():
                    self.completed((s, gi), ex.result, due_step=s)
            corrections = self.pending_corrections()
            for name, p in by_name.items():
                c = corrections.get(name)
                p.grad = c.view_as(p).clone() if c is not None else torch.zeros_like(p)
            host.before_step(optimizer)
        wrapped_step()
        host.average_over_ranks(optimizer.state, "hvc.flush")
        for p in by_name.values():
            p.grad = None

    def exchanges_at(self, step: int) -> bool:
        """Whether step ``step`` launches exchanges (every K-th step)."""
        return (step + 1) % self.every == 0

    def slots(self) -> int:
        """Distinct Horovod name slots needed: exchanges launched within D steps are in flight together."""
        return self.delay + 1

    def part(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """With momentum: this step's local term of ``name`` (flat), ``u <- m*u + g`` taken once
        per step however often it is asked for (at launch and when applied)."""
        out = self.parts.get(name)
        if out is None:
            g = grad.detach().reshape(-1)
            if self.flushing:
                return torch.zeros_like(g)
            m, nesterov = self.momentum
            u = self.velocity.get(name)
            if u is None:
                u = self.velocity[name] = torch.zeros_like(g)
            u.mul_(m).add_(g)
            out = self.parts[name] = g + u * m if nesterov else u.clone()
            if count_nonfinite(out):  # applied now (not hidden), never kept in the state
                u.masked_fill_(~torch.isfinite(u), 0.0)
        return out

    @staticmethod
    def _with(store: Dict[str, torch.Tensor], group: Group, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (a new tensor) plus what ``store`` accumulated for the group's members (popped)."""
        offset = 0
        for n, numel in zip(group.names, group.numels):
            acc = store.pop(n, None)
            if acc is not None:
                flat[offset:offset + numel].add_(acc.reshape(-1))
            offset += numel
        return flat

    def local_term(self, group: Group, x: torch.Tensor) -> torch.Tensor:
        """The exchange's input for ``group`` (flat): the step's gradient plus what temporal
        sparsity accumulated; a new tensor."""
        return self._with(self.accumulated, group, x.clone())

    def applied_term(self, group: Group, grads: List[torch.Tensor], exchanged: torch.Tensor) -> torch.Tensor:
        """L_j for ``group``: what this worker applied locally since its last exchange, this step
        included (``exchanged``, the exchange's input, when the local term is the gradient)."""
        if self.momentum is None:
            return exchanged
        flat = torch.cat([self.part(n, g) for n, g in zip(group.names, grads)]) if len(grads) > 1 \
            else self.part(group.names[0], grads[0]).clone()
        return self._with(self.applied, group, flat)

    def remember(self, step: int, gi: int, group: Group, local: torch.Tensor) -> None:
        self.local[(step, gi)] = (group.names, group.numels,
                                  local * self.local_factor if self.local_factor != 1.0 else local)

    def completed(self, key: Tuple[int, int], result: torch.Tensor, due_step: Optional[int] = None) -> None:
        """The exchange launched at ``key`` = (step, group) finished with ``result``: its correction
        R - L_j becomes due ``delay`` steps after launch (or at ``due_step``), per parameter."""
        names, numels, local = self.local.pop(key)
        correction = result - local
        due = self.corrections.setdefault(key[0] + self.delay if due_step is None else due_step, {})
        offset = 0
        for name, n in zip(names, numels):
            part = correction[offset:offset + n]
            due[name] = due[name] + part if name in due else part.clone()
            offset += n

    def accumulate(self, name: str, grad: torch.Tensor) -> None:
        """A local step's gradient, kept for the next exchange (temporal sparsity), and with
        momentum the local term it applies."""
        acc = self.accumulated.get(name)
        self.accumulated[name] = grad.detach().reshape(-1).clone() if acc is None else acc.add_(grad.reshape(-1))
        if self.momentum is not None:
            part = self.part(name, grad)
            acc = self.applied.get(name)
            self.applied[name] = part.clone() if acc is None else acc.add_(part)

    def apply(self, step: int, params: Dict[str, torch.Tensor]) -> None:
        """Write step ``step`` 's gradients: the local term (times the averaging factor) plus
        every correction due now."""
        due = self.corrections.pop(step, {})
        for name, p in params.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.momentum is not None:
                p.grad.copy_(self.part(name, p.grad).view_as(p.grad))
            if self.local_factor != 1.0:
                p.grad.mul_(self.local_factor)
            c = due.get(name)
            if c is not None:
                p.grad.add_(c.view_as(p.grad))
        self.parts = {}

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
        def copy(d):
            return {n: t.detach().clone() for n, t in d.items()}
        return {"delay": self.delay, "sync_every": self.every,
                "corrections": {int(d): copy(cs) for d, cs in self.corrections.items()},
                "accumulated": copy(self.accumulated), "applied": copy(self.applied),
                "velocity": copy(self.velocity)}

    def load(self, saved: Optional[dict], device_of) -> None:
        def copy(d):
            return {n: t.clone().to(device_of(n)) for n, t in (d or {}).items()}
        self.local, self.parts = {}, {}
        if saved is None:
            self.corrections, self.accumulated, self.applied, self.velocity = {}, {}, {}, {}
            return
        if (saved["delay"], saved["sync_every"]) != (self.delay, self.every):
            raise ValueError(f"load_state_dict: the checkpoint was saved with delay={saved['delay']}, "
                             f"sync_every={saved['sync_every']}; this optimizer uses delay={self.delay}, "
                             f"sync_every={self.every}")
        self.corrections = {int(d): copy(cs) for d, cs in saved["corrections"].items()}
        self.accumulated = copy(saved["accumulated"])
        self.applied = copy(saved.get("applied"))
        self.velocity = copy(saved.get("velocity"))


def average_over_ranks(transport, params: List[torch.Tensor], optimizer_state, name: str) -> None:
    """Average the parameters and the optimizer's per-parameter floating state tensors of the
    same shape (momentum buffers, Adam's moments) over the transport's ranks, in place, so
    every rank holds identical values afterwards (one allreduce per tensor)."""
    with torch.no_grad():
        for i, p in enumerate(params):
            transport.allreduce_(p.data, f"{name}.p{i}", average=True)
            st = optimizer_state.get(p, {})
            for k in sorted(st):
                t = st[k]
                if torch.is_tensor(t) and t.is_floating_point() and t.shape == p.shape:
                    transport.allreduce_(t, f"{name}.p{i}.{k}", average=True)


__all__ = ["DelayedAveraging", "average_over_ranks", "check_delay", "check_sync_every"]
