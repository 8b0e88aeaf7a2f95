"""The PyTorch exchange engine: groups, compression state, exchanges in flight, write-back.

``DistributedOptimizer`` (``torch_ops.optimizer``) is a thin Horovod-compatible wrapper around one
``Engine``; checkpoints, Horovod Elastic and ``flush()`` use the engine's public API below.

A step, as the engine runs it:

1. ``gradient_ready(p)`` (the parameter's post-accumulate-grad hook): after
   ``backward_passes_per_step`` passes the parameter is final; when it is the last of its group,
   ``launch(gi)`` flattens the group and has the session (``torch_ops.session``) compress it and
   start its exchange (a generator of collective rounds, ``hvdcompress.contract``) on the
   transport, while backward goes on;
2. ``synchronize()`` launches what did not come (zeros, as Horovod does, so every rank takes part),
   drives the exchanges due at this step to completion and lets the *sync policy* write the
   gradients back;
3. after the wrapped optimizer's update, ``end_of_step()`` records the step's timings and gives
   the scheduler its turn (it may regroup, at the same step on every rank).

The sync policy (``torch_ops.policy``) is chosen once, at construction: ``Synchronous`` writes
each exchanged average back; ``Delayed`` (``delay`` / ``sync_every``) applies local terms now and
corrections when their exchanges arrive, and knows how to flush. The engine never branches on
which one it has; a policy sees the engine through ``policy.PolicyHost``.

The ``ExchangeSession`` (``session``) owns the compressor, the compression state per parameter
name, the step and epoch clock, the exchanges in flight, the stats and the saved format; the
engine adds what is the optimizer's own: groups and their flat buffers, backward passes, the
scheduler and the policy. ``state_dict()`` / ``load_state_dict()`` carry the session's state, the
plan and the policy's state (``torch_ops.checkpoint`` defines and checks the format).
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional

import torch

from hvdcompress.contract import LAYERWISE
from hvdcompress.spec import CompressionSpec

from .arguments import check_same_model
from .collectives import PendingExchange, PendingQueue
from .delayed import DelayedAveraging, average_over_ranks
from .grouping import FlatBuffers, Group, make_groups, scatter
from .policy import SyncPolicy, Synchronous
from .scheduling import Scheduler, StepClock
from .session import ExchangeSession, SessionFront, exchange_name
from .sparse_grads import sparse_exchange, split_out


def make_policy(delay: int, sync_every: int, local_factor: float, momentum) -> SyncPolicy:
    """The sync policy for ``delay`` / ``sync_every`` (validated already): synchronous for 0 / 1."""
    if delay == 0 and sync_every == 1:
        return Synchronous()
    return DelayedAveraging(delay, sync_every, local_factor, momentum)


class Engine(SessionFront):
    """Exchanges the gradients of ``params`` (name -> tensor) among the transport's ranks.

    ``average``: op=Average (the sum is scaled by ``predivide / world``) or Sum; ``predivide``:
    Horovod's ``gradient_predivide_factor``; ``passes``: ``backward_passes_per_step``;
    ``compressor``: the one built from ``spec`` (built here when None).
    """

    def __init__(self, spec: CompressionSpec, by_name: Dict[str, torch.Tensor], transport, *, average: bool,
                 predivide: float, passes: int, sparse_as_dense: bool, schedule, cost_model, profile_steps: int,
                 tune_steps: int, delay: int, sync_every: int, check_model: bool, alternatives=(),
                 revalidate_every=None, compressor=None):
        self.session = ExchangeSession(spec, by_name, transport, compressor=compressor)
        self.by_name: Dict[str, torch.Tensor] = dict(by_name)
        self.params: List[torch.Tensor] = list(by_name.values())
        self.name_of: Dict[torch.Tensor, str] = {p: n for n, p in by_name.items()}
        self.transport = transport  # one transport for every collective: exchanges, scheduler, profiler
        # A rank outside the process set exchanges nothing (``synchronize``, ``flush``): as with
        # Horovod's optimizer, its steps are the wrapped optimizer's on its local gradients.
        self.included = transport.included()
        self.world = transport.size()
        if self.world > 1 and check_model and self.included:
            check_same_model(transport, self.by_name)
        self.average = average
        self.predivide = predivide
        self.prescale = 1.0 / predivide
        self.scale = predivide / self.world if average else 1.0
        self.passes = passes
        self.sparse_as_dense = sparse_as_dense
        self.scheduler = Scheduler(schedule, spec, cost_model, profile_steps,
                                   {n: float(p.numel() * p.element_size()) for n, p in self.by_name.items()},
                                   self.world, transport, tune_steps, alternatives, revalidate_every,
                                   device=self.params[0].device if self.params else None)
        # the local gradient in result units: x1 for Average, xN for Sum
        self.policy = make_policy(delay, sync_every, self.prescale * self.scale * self.world,
                                  self.compressor.local_momentum())
        self.groups: List[Group] = []
        self.flat = FlatBuffers()  # merged groups' flat gradients, memory kept from step to step
        self.sparse_names = set()  # parameters whose gradient came sparse: exchanged alone
        self.timings: Dict[str, Optional[float]] = {}
        self.clock = StepClock(None)
        self.synchronized = False  # synchronize() ran and step() has not yet (Horovod's flag)
        self._warned_sparse = False
        self._sparse_now = set()  # parameters whose gradient came sparse this step (given back sparse)
        self._passes_left: Dict[torch.Tensor, int] = {}
        self._waiting: List[int] = []
        self._group_of: Dict[torch.Tensor, int] = {}
        self.regroup([[n] for n in self.by_name])  # layerwise until the scheduler decides
        self._new_step()

    # -- what the optimizer asks -----------------------------------------------------------------
    @property
    def pending(self) -> PendingQueue:
        """Exchanges in flight, keyed by (step, group index)."""
        return self.session.pending

    @property
    def plan(self):
        return self.scheduler.plan

    def group_names(self) -> List[List[str]]:
        return [list(g.names) for g in self.groups]

    def launched_now(self) -> bool:
        """Exchanges of the current step were launched (backward ran) and not synchronized yet."""
        return any(s == self.step for s, _ in self.pending.keys())

    def set_epoch(self, epoch: int) -> None:
        self.session.set_epoch(epoch)

    def current_epoch(self) -> int:
        """The last ``set_epoch``, else (for a compressor with a warm-up) ``step // warmup_epoch_steps``."""
        return self.session.current_epoch()

    # -- a step ------------------------------------------------------------------------------------
    def gradient_ready(self, p: torch.Tensor) -> None:
        """The gradient hook: count the pass; launch the group when its last gradient is final."""
        entered = self.scheduler.timer().now()
        if self._passes_left[p] == 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                 "before call to step(). Increase backward_passes_per_step to "
                                 "accumulate gradients locally.")
        self._passes_left[p] -= 1
        if self._passes_left[p] == 0:
            gi = self._group_of[p]
            self._waiting[gi] -= 1
            if self._waiting[gi] == 0 and self.policy.exchanges_at(self.step):
                self.launch(gi)
            self.clock.hooks.append((self.name_of[p], entered, self.scheduler.timer().now()))

    def launch(self, gi: int) -> None:
        """Compress group ``gi`` and start its exchange (due when the policy says)."""
        group = self.groups[gi]
        step, policy = self.step, self.policy
        grads = []
        for name in group.names:
            p = self.by_name[name]
            if p.grad.is_sparse:
                self.sparse_names.add(name)
                if self.sparse_as_dense:
                    self._sparse_now.add(name)
                if len(group.names) == 1 and not self.sparse_as_dense and policy.sparse_exchanges:
                    self._launch_sparse(gi, p, group)  # exchanged as Horovod does (torch_ops.sparse_grads)
                    return
                if not (self.sparse_as_dense or self._warned_sparse):
                    warnings.warn("hvdcompress: a sparse gradient is exchanged densified (sparse_as_dense=True "
                                  "does this silently); it is exchanged sparse when its parameter is in a group "
                                  "of its own and delay=0.")
                    self._warned_sparse = True
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        with torch.no_grad():
            x, name = policy.exchange_input(self, gi, group, grads)
            self.pending.poll()  # earlier groups' next rounds go out as soon as they can
            codec = self.scheduler.codec_of(group.names)  # the plan may send this group dense / fp16
            if codec is None and len(group.names) > 1 and self.compressor.merge == LAYERWISE:
                raise AssertionError(f"hvdcompress: '{self.spec}' never merges, yet group {group.key} holds "
                                     f"{len(group.names)} tensors")
            ex = self.session.start(x, group.names, key=group.key, step=step, name=name, scale=self.scale,
                                    shape=group.shape, members=group.layout, out=x,  # x: scattered into anyway
                                    codec=codec)
            ex.apply = self._scatter_to(group)
            self.pending.add((step, gi), ex, step + policy.delay)

    def _launch_sparse(self, gi: int, p: torch.Tensor, group: Group) -> None:
        ex = PendingExchange(sparse_exchange(p.grad, self.prescale * self.scale), exchange_name(group.key, "sparse"),
                             self.transport)

        def apply(result, p=p):
            p.grad = result
        ex.apply = apply
        self.pending.add((self.step, gi), ex, self.step)

    def _scatter_to(self, group: Group) -> Callable[[torch.Tensor], None]:
        def apply(result):
            scatter(result, [self.by_name[n].grad for n in group.names])
        return apply

    def synchronize(self) -> None:
        """Finish the exchanges due at this step and write the gradients into ``p.grad``."""
        if not self.included:  # outside the process set: the local gradients stay
            self.synchronized = True
            return
        start = self.scheduler.timer().now()
        step = self.step
        exchanging = self.policy.exchanges_at(step)
        launched = {gi for s, gi in self.pending.keys() if s == step}
        for gi, group in enumerate(self.groups):
            for name in group.names:
                p = self.by_name[name]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if exchanging and gi not in launched:
                self.launch(gi)
        with torch.no_grad():
            pending = self.pending.finish(step)
            scattered = self.scheduler.timer().now()
            self.policy.write_back(self, step, pending, exchanging)
            for name in self._sparse_now:  # sparse_as_dense: the average is given back sparse, as Horovod does
                p = self.by_name[name]
                if not p.grad.is_sparse:
                    p.grad = p.grad.to_sparse()
        self.clock.finish = self.scheduler.timer().now() - scattered + sum(ex.compute_seconds - ex.first_seconds
                                                    for ex in pending.values())
        self.session.end_step(pending.values(), sum(p.numel() * p.element_size() for p in self.params))
        self._new_step()
        self.synchronized = True
        self.clock.sync = (start, self.scheduler.timer().now())

    def _new_step(self) -> None:
        self._passes_left = {p: self.passes for p in self.params}
        self._waiting = [len(g.names) for g in self.groups]
        self._sparse_now = set()

    def end_of_step(self) -> None:
        """The step's timings; the scheduler's turn (it may regroup, at the same step on all ranks)."""
        plan = self.scheduler.plan
        self.timings = self.clock.timings(self.step - 1, plan.predicted_seconds if plan else None)
        groups = self.scheduler.end_of_step(self.clock)
        if groups is not None:
            with torch.no_grad():
                self.policy.complete_in_flight(self)  # delayed exchanges finish under the groups they began in
            self.regroup(groups)
        self.clock = StepClock(self.scheduler.timer().now())

    def flush(self, optimizer, wrapped_step: Callable[[], None]) -> None:
        """Make the replicas identical (the policy's flush; nothing to do when synchronous, or on a
        rank outside the process set)."""
        if self.included:
            self.policy.flush(self, optimizer, wrapped_step)

    # -- the policies' view (torch_ops.policy.PolicyHost) ---------------------------------------------
    def flatten(self, group: Group, grads: List[torch.Tensor]) -> torch.Tensor:
        """The group's gradients, flat (a merged group's buffer is reused from step to step)."""
        return self.flat.flatten(group.key, grads)

    def finish_in_flight(self) -> Dict:
        """Complete every exchange in flight: {(step, group index): exchange}."""
        return self.pending.finish(None)

    def before_step(self, optimizer) -> None:
        """The compressor's turn before the wrapped optimizer's step (DGC's taken-over weight decay)."""
        self.compressor.before_step(optimizer.param_groups, optimizer.state)

    def average_over_ranks(self, optimizer_state, name: str) -> None:
        """Average the parameters and the optimizer's per-parameter state over the ranks."""
        average_over_ranks(self.transport, self.params, optimizer_state, name)

    # -- groups and state --------------------------------------------------------------------------
    def param_state(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """Compression state per parameter name (copies), whatever the grouping."""
        return self.session.param_state()

    def regroup(self, groups: List[List[str]]) -> None:
        """Exchange ``groups`` (names) from now on; state is carried over per parameter.

        The state is laid out for the new groups here, between steps (joined per group, split
        back from the groups it leaves: copies of every member's state), not at each group's first
        launch: a step's clock starts after the regroup, so neither a measured validation's step
        nor the backward pass pays for the switch. Before the first step there is no state yet."""
        if self.pending:
            raise AssertionError("hvdcompress: regrouping while exchanges are in flight")
        if not self.sparse_as_dense:  # parameters with sparse gradients are exchanged alone
            groups = split_out(groups, self.sparse_names)
        shapes = {n: tuple(p.shape) for n, p in self.by_name.items()}
        self.groups = make_groups(groups, shapes)
        self.flat.reset()
        self._group_of = {self.by_name[n]: gi for gi, g in enumerate(self.groups) for n in g.names}
        self._waiting = [len(g.names) for g in self.groups]
        if self.session.step > 0:
            for group in self.groups:
                self.session.state_for(group.names)

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What ``state_dict()["hvdcompress"]`` holds (``torch_ops.checkpoint``). Exchanges in
        flight of a delaying policy are completed first and saved as corrections due at their
        steps, so that resuming is exact."""
        if not self.launched_now():
            with torch.no_grad():
                self.policy.complete_in_flight(self)
        return self.session.pack(plan=self.scheduler.plan_dict(), policy=self.policy.state())

    def check_state_dict(self, saved: dict) -> None:
        """ValueError, before anything is loaded, if ``saved`` does not fit this engine."""
        self.session.check(saved)

    def load_state_dict(self, saved: Optional[dict], param_groups) -> None:
        """Restore ``saved`` (checked already) after the wrapped optimizer's own state."""
        if self.included:  # outside the process set the wrapped optimizer runs as it is
            self.compressor.after_load(param_groups)
        if saved is None:
            warnings.warn("load_state_dict: the state dict has no compression state (saved by a "
                          "plain optimizer?); residuals start from zero.")
            return
        self.session.load(saved)
        groups = self.scheduler.restore(saved.get("plan")) or self.group_names()  # same schedule: its plan
        self.policy.load(saved.get("delayed"), lambda n: self.by_name[n].device)
        self.regroup(groups)

    # -- Horovod Elastic -------------------------------------------------------------------------------
    def reset(self) -> None:
        """After Horovod was initialised again (an elastic reset), locally: drop the exchanges of
        the old Horovod, follow the new world size, start the scheduler over (layerwise until the
        new plan; state carried per parameter). Idempotent."""
        self.session.drop_in_flight()
        self.world = self.transport.size()
        self.scale = self.predivide / self.world if self.average else 1.0
        self.scheduler = self.scheduler.restarted(self.world)
        self.clock = StepClock(None)
        self.synchronized = False
        self.regroup([[n] for n in self.by_name])
        self._new_step()

    def sync_from_root(self) -> None:
        """After ``reset``, on every rank (new ones included): the same model everywhere, and rank
        0's step counter, epoch and compressor global state; each rank keeps its own compression
        state (it is that rank's unsent gradient)."""
        self.reset()
        if self.world > 1:
            check_same_model(self.transport, self.by_name)
        session = self.session
        shared = self.transport.broadcast_object({"step": session.step, "epoch": session.epoch,
                                                  "epoch_set": session.epoch_set,
                                                  "compressor": self.compressor.global_state()}, "hvc.elastic.sync")
        session.step, session.epoch, session.epoch_set = shared["step"], shared["epoch"], shared["epoch_set"]
        self.compressor.load_global_state(shared["compressor"])
