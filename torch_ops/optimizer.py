"""``DistributedOptimizer``: Horovod's PyTorch optimizer wrapper, with gradient compression.

Drop-in for ``horovod.torch.DistributedOptimizer``: the same arguments keep their names and
meaning (named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
sparse_as_dense, process_set), and ``synchronize()`` / ``skip_synchronize()`` / ``step()`` /
``zero_grad()`` behave as there. The returned object is an instance of a subclass of the wrapped
optimizer's class, so schedulers and ``isinstance`` checks keep working.

How a step runs:

1. backward: parameters are exchanged in *groups* (``schedule``; ``torch_ops.scheduling`` says
   how groups are chosen, ``torch_ops.grouping`` how they are laid out). When a parameter's
   gradient is final (``register_post_accumulate_grad_hook``, after ``backward_passes_per_step``
   passes) and it is the last of its group to be, the hook flattens the group into one buffer,
   compresses it and launches its exchange (``Compressor.exchange``, a generator of collective
   rounds) as Horovod async ops, while the rest of backward still runs;
2. ``synchronize()`` launches the groups that are not complete (gradients that never came are
   zeros, as in Horovod, so every rank takes part), drives all exchanges to completion,
   round-robin, and scatters each result into the parameters' ``.grad``;
3. the wrapped optimizer's own ``step()`` then runs on the exchanged gradients; after it, the
   step's clock readings go to the scheduler, which may change the groups for the next step.

``opt.plan`` is the plan in use (groups, predicted step time), ``opt.groups`` its parameter
names, ``opt.timings`` what the last step measured (``torch_ops.scheduling.StepClock``).

Compressor state (residuals) is optimizer state: ``state_dict()`` holds it under the key
``"hvdcompress"``, per parameter whatever the grouping, with the plan in use, and
``load_state_dict()`` restores both (the plan only if the schedule is the same). Residuals differ
per rank, so to resume exactly every rank saves and loads its own ``state_dict()``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Dict, List, Optional

import torch

from hvdcompress.spec import CompressionSpec, resolve
from hvdcompress.stats import WireStats
from hvdcompress.warmup import auto_epoch

from hvdcompress.planner import Plan

from .collectives import Communicator, PendingExchange, PendingQueue
from . import checkpoint
from .arguments import check_arguments, check_same_model, parameter_names
from .delayed import DelayedAveraging
from .flush import flush
from .nonfinite import guard
from .elastic import elastic_mode
from .sparse_grads import sparse_exchange, split_out
from .compressors import ExchangeContext, build_compressor, compressor_class
from .grouping import FlatBuffers, Group, flatten, join_state, make_groups, scatter, split_state
from .scheduling import DEFAULT_TUNE_STEPS, Scheduler, StepClock, check_tune_steps, now
from .transport import Average, make_communicator



class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, spec: CompressionSpec, backward_passes_per_step: int,
                 op, gradient_predivide_factor: float, sparse_as_dense: bool, process_set, driver, source,
                 schedule, cost_model, profile_steps, delay=0, sync_every=1, tune_steps=0):
        super(self.__class__, self).__init__(params)
        self.defaults = dict(source.defaults)
        self.state.update(source.state)

        self._hvc_spec = spec
        self._hvc_compressor = build_compressor(spec)
        self._hvc_names: Dict[torch.Tensor, str] = parameter_names(self.param_groups, named_parameters)
        self._hvc_params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]
                                                if p.requires_grad]
        self._hvc_by_name: Dict[str, torch.Tensor] = {self._hvc_names[p]: p for p in self._hvc_params}

        # one communicator for every collective: exchanges, scheduler, profiler (the user's process set)
        self._hvc_driver = driver if driver is not None else Communicator(process_set)
        self._hvc_world = self._hvc_driver.size()
        if self._hvc_world > 1 and not elastic_mode():  # elastic: checked at each sync (torch_ops.elastic)
            check_same_model(self._hvc_driver, self._hvc_by_name)
        self._hvc_scheduler = Scheduler(
            schedule, spec, cost_model, profile_steps,
            {n: float(p.numel() * p.element_size()) for n, p in self._hvc_by_name.items()},
            self._hvc_world, self._hvc_driver, tune_steps)
        average = op == Average
        self._hvc_prescale = 1.0 / gradient_predivide_factor
        self._hvc_scale = gradient_predivide_factor / self._hvc_world if average else 1.0
        self._hvc_passes = backward_passes_per_step
        self._hvc_passes_left: Dict[torch.Tensor, int] = {p: backward_passes_per_step for p in self._hvc_params}
        self._hvc_pending = PendingQueue()  # exchanges in flight, keyed by (step, group index)
        # delay / sync_every (torch_ops.delayed); the local gradient in result units: x1 for Average, xN for Sum
        self._hvc_delayed = DelayedAveraging(delay, sync_every, self._hvc_prescale * self._hvc_scale * self._hvc_world,
                                             self._hvc_compressor.local_momentum())
        self._hvc_state: Dict[str, Dict[str, torch.Tensor]] = {n: {} for n in self._hvc_by_name}
        self._hvc_sparse_as_dense = sparse_as_dense
        self._hvc_warned_sparse = False
        self._hvc_sparse_names = set()  # parameters whose gradient came sparse: exchanged alone, sparse
        self._hvc_sparse_keys = set()  # (step, group) of the sparse exchanges in flight
        self._hvc_groups: List[Group] = []
        self._hvc_flat = FlatBuffers()  # merged groups' flat gradients, memory kept from step to step
        self._hvc_regroup([[n] for n in self._hvc_by_name])  # layerwise until the scheduler decides
        self._hvc_step = 0
        self._hvc_epoch = 0
        self._hvc_epoch_set = False  # set_epoch() called: warm-ups follow it, else count steps
        self._hvc_warned_epoch = False
        self._synchronized = False
        self._should_synchronize = True
        # Horovod's introspection attributes, with their meaning there
        self._parameter_names = dict(self._hvc_names)
        self._requires_update = set(self._hvc_params)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = self._hvc_driver.process_set
        self.stats = WireStats()
        self.timings: Dict[str, Optional[float]] = {}
        self._hvc_clock = StepClock(None)
        self._hvc_hooks = [p.register_post_accumulate_grad_hook(self._hvc_hook) for p in self._hvc_params]

    # -- public API (Horovod's) -----------------------------------------------------------------
    @property
    def compression(self) -> CompressionSpec:
        return self._hvc_spec

    @property
    def schedule(self) -> str:
        """The schedule asked for ("auto", "mgs", "size:64", ..., or "explicit")."""
        return self._hvc_scheduler.text

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in use (``hvdcompress.planner.Plan``: groups as indices in backward order,
        ``predicted_seconds``, ``notes``), or None until the scheduler has decided."""
        return self._hvc_scheduler.plan

    @property
    def groups(self) -> List[List[str]]:
        """The parameter names of each group exchanged now, in launch order."""
        return [list(g.names) for g in self._hvc_groups]

    @property
    def workload(self):
        """The profiled ``hvdcompress.planner.Workload`` the plan was made from (or None)."""
        return self._hvc_scheduler.workload

    @property
    def cost_model(self):
        """The ``CostModel`` the plan was made with (given, cached or profiled), or None."""
        return self._hvc_scheduler.cost_model

    def synchronize(self):
        """Finish the gradient exchanges due at this step and write the gradients into ``p.grad``
        (synchronous: the exchanged averages; ``delay``/``sync_every``: see ``torch_ops.delayed``)."""
        start = now()
        step, delayed = self._hvc_step, self._hvc_delayed
        exchanging = delayed.exchanges_at(step)
        launched = {gi for s, gi in self._hvc_pending.keys() if s == step}
        for gi, group in enumerate(self._hvc_groups):
            for name in group.names:
                p = self._hvc_by_name[name]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if exchanging and gi not in launched:
                self._hvc_launch(gi)
        with torch.no_grad():
            pending = self._hvc_pending.finish(step)
            scattered = now()
            if not delayed.active:
                for key, ex in pending.items():
                    names = self._hvc_groups[key[1]].names
                    if key in self._hvc_sparse_keys:
                        self._hvc_sparse_keys.discard(key)
                        self._hvc_by_name[names[0]].grad = ex.result
                    else:
                        scatter(ex.result, [self._hvc_by_name[n].grad for n in names])
            else:
                for key, ex in pending.items():
                    delayed.completed(key, ex.result)
                if not exchanging:  # temporal sparsity: a local step; its gradient joins the next exchange
                    for name, p in self._hvc_by_name.items():
                        delayed.accumulate(name, p.grad)
                delayed.apply(step, self._hvc_by_name)
        self._hvc_clock.finish = now() - scattered + sum(ex.compute_seconds - ex.first_seconds
                                                         for ex in pending.values())
        dense = sum(p.numel() * p.element_size() for p in self._hvc_params)
        self.stats.record(sum(ex.bytes_sent for ex in pending.values()), dense,
                          sum(ex.compute_seconds for ex in pending.values()), self.density)
        self._hvc_passes_left = {p: self._hvc_passes for p in self._hvc_params}
        self._hvc_waiting = [len(g.names) for g in self._hvc_groups]
        self._hvc_step += 1
        self._synchronized = True
        self._hvc_clock.sync = (start, now())

    def set_epoch(self, epoch: int) -> None:
        """Tell compressors with a schedule (DGC's sparsity warm-up) which epoch is starting.
        Call it on every rank at the start of each epoch (0-based), like a sampler's set_epoch."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch: epoch must be an int >= 0; got {epoch!r}")
        self._hvc_epoch = epoch
        self._hvc_epoch_set = True

    @property
    def epoch(self) -> int:
        """The epoch the compressors use now: the last ``set_epoch``, else (for a compressor with
        a warm-up) ``step // warmup_epoch_steps``."""
        return self._hvc_current_epoch()

    @property
    def density(self) -> Optional[float]:
        """The fraction of entries a ratio-based compressor sends now (DGC: its warm-up density)."""
        return self._hvc_compressor.density(self._hvc_current_epoch())

    def _hvc_current_epoch(self) -> int:
        steps = self._hvc_compressor.warmup_epoch_steps
        if self._hvc_epoch_set or steps is None:
            return self._hvc_epoch
        if not self._hvc_warned_epoch:
            self._hvc_warned_epoch = True
            warnings.warn(f"hvdcompress: compression '{self._hvc_spec.name}' warms its density up over epochs, and "
                          f"set_epoch() was not called: counting epochs of {steps} steps (the spec's "
                          "warmup_epoch_steps). Call optimizer.set_epoch(epoch) at the start of every epoch to "
                          "follow your epochs instead.")
        return auto_epoch(self._hvc_step, steps)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use when ``synchronize()`` was called by hand (e.g. to clip gradients) before ``step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized and not self._hvc_launched_now():
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(); the gradients were already exchanged, so "
                              "they are not exchanged (nor compressed) a second time.")
            else:
                self.synchronize()
        self._synchronized = False
        start = now()
        self._hvc_compressor.before_step(self.param_groups, self.state)  # e.g. DGC's taken-over weight decay
        loss = super(self.__class__, self).step(closure)
        self._hvc_clock.update = (start, now())
        self._hvc_end_of_step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._hvc_launched_now():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it "
                                 "can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)

    def flush(self) -> None:
        """Delayed averaging: complete every exchange in flight, apply the corrections not yet
        applied, then average the parameters and the optimizer's per-parameter state over the
        ranks, so every rank holds identical parameters (``torch_ops.flush``). Call it on every
        rank, between steps (before evaluating or comparing replicas). Nothing to do when training
        is synchronous (delay=0, sync_every=1)."""
        flush(self, super(self.__class__, self).step)

    @property
    def delay(self) -> int:
        return self._hvc_delayed.delay

    @property
    def sync_every(self) -> int:
        return self._hvc_delayed.every

    def _hvc_launched_now(self) -> bool:
        """Exchanges of the current step were launched (backward ran) and not synchronized yet."""
        return any(s == self._hvc_step for s, _ in self._hvc_pending.keys())

    def _hvc_complete_in_flight(self) -> None:
        """Delayed averaging: wait for every exchange in flight; their corrections stay due at
        their steps (checkpoints and regrouping need no exchange in flight)."""
        for key, ex in self._hvc_pending.finish(None).items():
            self._hvc_delayed.completed(key, ex.result)

    def state_dict(self):
        """The wrapped optimizer's state and ours under ``"hvdcompress"`` (``torch_ops.checkpoint``)."""
        return checkpoint.save(self, super(self.__class__, self).state_dict())

    def load_state_dict(self, state_dict):
        state_dict, ours = checkpoint.split(self, state_dict)  # checked before anything is loaded
        super(self.__class__, self).load_state_dict(state_dict)
        checkpoint.load(self, ours)

    # -- internals -------------------------------------------------------------------------------
    def _hvc_hook(self, p: torch.Tensor) -> None:
        entered = now()
        if self._hvc_passes_left[p] == 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                 "before call to step(). Increase backward_passes_per_step to "
                                 "accumulate gradients locally.")
        self._hvc_passes_left[p] -= 1
        if self._hvc_passes_left[p] == 0:
            gi = self._hvc_group_of[p]
            self._hvc_waiting[gi] -= 1
            if self._hvc_waiting[gi] == 0 and self._hvc_delayed.exchanges_at(self._hvc_step):
                self._hvc_launch(gi)
            self._hvc_clock.hooks.append((self._hvc_names[p], entered, now()))

    def _hvc_launch(self, gi: int) -> None:
        group = self._hvc_groups[gi]
        step, delayed = self._hvc_step, self._hvc_delayed
        grads = []
        for name in group.names:
            p = self._hvc_by_name[name]
            if p.grad.is_sparse:
                if len(group.names) == 1 and not (self._hvc_sparse_as_dense or delayed.active):
                    self._hvc_sparse_names.add(name)  # exchanged as Horovod does (torch_ops.sparse_grads)
                    self._hvc_sparse_keys.add((step, gi))
                    self._hvc_pending.add((step, gi), PendingExchange(
                        sparse_exchange(p.grad, self._hvc_prescale * self._hvc_scale), f"hvc.{group.key}.sparse",
                        self._hvc_driver), step)
                    self._synchronized = False
                    return
                if not (self._hvc_sparse_as_dense or self._hvc_warned_sparse):
                    warnings.warn("hvdcompress: a sparse gradient is exchanged densified (sparse_as_dense=True "
                                  "does this silently); it is exchanged sparse when its parameter is in a group "
                                  "of its own and delay=0.")
                    self._hvc_warned_sparse = True
                self._hvc_sparse_names.add(name)
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        with torch.no_grad():
            x = flatten(grads) if delayed.active else self._hvc_flat.flatten(group.key, grads)
            name = f"hvc.{group.key}"
            if delayed.active:  # the local gradient stays in .grad; the exchange gets its own copy
                local = delayed.local_term(group, x)
                delayed.remember(step, gi, group, delayed.applied_term(group, grads, local))
                x = local * self._hvc_prescale if self._hvc_prescale != 1.0 else local.clone()
                name = f"{name}.s{step % delayed.slots()}"  # unique among the exchanges in flight
            elif self._hvc_prescale != 1.0:  # a merged group's buffer is ours; a lone gradient is not
                x = x.mul_(self._hvc_prescale) if len(grads) > 1 else x * self._hvc_prescale
            ctx = ExchangeContext(group.key, step, self._hvc_world, self._hvc_scale,
                                  self._hvc_state[group.key], group.shape, self._hvc_current_epoch(),
                                  self._hvc_driver.rank(), group.layout, out=x)  # x: scattered into anyway
            self._hvc_pending.poll()  # earlier groups' next rounds go out as soon as they can
            exchange = guard(self._hvc_compressor.exchange(x, ctx), x, ctx.state)  # non-finite never hidden
            self._hvc_pending.add((step, gi), PendingExchange(exchange, name, self._hvc_driver), step + delayed.delay)
        self._synchronized = False

    def _hvc_end_of_step(self) -> None:
        """The step's timings; the scheduler's turn (it may regroup, at the same step on all ranks)."""
        plan = self._hvc_scheduler.plan
        self.timings = self._hvc_clock.timings(self._hvc_step - 1, plan.predicted_seconds if plan else None)
        groups = self._hvc_scheduler.end_of_step(self._hvc_clock)
        if groups is not None:
            with torch.no_grad():
                self._hvc_complete_in_flight()  # delayed exchanges finish under the groups they began in
            self._hvc_regroup(groups)
        self._hvc_clock = StepClock(now())

    def _hvc_param_state(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """Compression state per parameter name (copies), whatever the grouping."""
        out = {}
        for g in self._hvc_groups:
            out.update(zip(g.names, split_state(self._hvc_state[g.key], g.numels)))
        return out

    def _hvc_regroup(self, groups: List[List[str]], per_param=None) -> None:
        """Exchange ``groups`` (names) from now on; state is carried over per parameter."""
        if self._hvc_pending:
            raise AssertionError("hvdcompress: regrouping while exchanges are in flight")
        per = per_param if per_param is not None else self._hvc_param_state()
        if not self._hvc_sparse_as_dense:  # parameters with sparse gradients are exchanged alone
            groups = split_out(groups, self._hvc_sparse_names)
        shapes = {n: tuple(p.shape) for n, p in self._hvc_by_name.items()}
        self._hvc_groups = make_groups(groups, shapes)
        self._hvc_flat.reset()
        self._hvc_state = {g.key: join_state([per.get(n, {}) for n in g.names], g.numels)
                           for g in self._hvc_groups}
        self._hvc_group_of = {self._hvc_by_name[n]: gi for gi, g in enumerate(self._hvc_groups)
                              for n in g.names}
        self._hvc_waiting = [len(g.names) for g in self._hvc_groups]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step: int = 1, op=None,
                         gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                         process_set=None, driver=None, schedule="auto", cost_model=None,
                         profile_steps: int = 5, delay: int = 0, sync_every: int = 1,
                         tune_steps: int = DEFAULT_TUNE_STEPS, backend: str = "horovod"):
    """Wrap ``optimizer`` so gradients are compressed, exchanged among Horovod ranks and averaged.

    Args mirror ``horovod.torch.DistributedOptimizer``:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``; names key the collectives and the saved
            compression state (without it, names are generated from positions).
        compression: a spec string (``"topk:ratio=0.01"``), ``hvdcompress.Compression.topk(...)``,
            or Horovod's ``Compression.none`` / ``Compression.fp16``. Default: no compression.
        backward_passes_per_step: backward passes accumulated locally before each exchange (>= 1).
        op: ``hvd.Average`` (default) or ``hvd.Sum``. Adasum does not compose with compression.
        gradient_predivide_factor: with Average, gradients are divided by this factor before
            compression and the sum by size/factor after (> 0).
        sparse_as_dense: False (default): sparse gradients (``nn.Embedding(sparse=True)``) are
            exchanged sparse, uncompressed, as Horovod does (``torch_ops.sparse_grads``), so
            ``SparseAdam`` works; their parameters are never merged into groups. True: densified
            and compressed like the others.
        process_set: a Horovod process set (default: all ranks).
        driver: the ``torch_ops.collectives.Communicator`` every collective goes through (default
            ``Communicator(process_set)``); an extension point: a subclass may change how rounds
            complete (``hvdcompress.bench.injected_latency.LatencyDriver`` delays them).
        backend: "horovod" (default; launched by horovodrun) or "torch": torch.distributed
            (launched by torchrun, any backend; Horovod is never imported), with ``process_set``
            a process group (``torch_ops.transport``, ``torch_ops.dist_collectives``).

    Layer merging (``torch_ops.scheduling`` has the details):
        schedule: how gradients are grouped into exchanges: "auto" (default: the cost-model
            schedule for the compressor, "mgs" for sparsifiers, "mgwfbp" for dense ones),
            "mgs", "mgwfbp" (":greedy" for the papers' greedy rule), "layerwise" (one exchange
            per tensor), "single" (one for all), "size:<MB>" (Horovod-fusion-like), or explicit
            groups: a list of lists of parameter names, consecutive in backward order.
        cost_model: an ``hvdcompress.costmodel.CostModel`` for the cost-model schedules (and for
            predicted step times with the others); default: the cached fit for this world and
            host set, else profiled on the live transport at first use (a few seconds).
        profile_steps: steps measured (after the first) before a cost-model plan is made; until
            then gradients are exchanged as one group (int in [1, 1000]).
        tune_steps: measured validation of a cost-model plan (int in [0, 100], default 3; 0: off):
            a few candidate plans (the model's first, "single", size plans, ...) each run one
            settling step and this many measured steps, and the fastest (median, slowest rank)
            is kept, on every rank from the same step. Ignored by the fixed schedules.

    Training across high-latency links (``torch_ops.delayed`` states the math):
        delay: steps between launching an exchange and applying its result (int >= 0; 0, the
            default, is synchronous). Each step applies its local term at once (the local
            gradient; for DGC and the sketch, which keep the momentum, a local velocity) and the
            correction ``R - L`` of the exchange launched ``delay`` steps earlier.
            ``opt.flush()`` completes what is in flight and makes the replicas identical.
        sync_every: exchange once every this many steps, local steps in between (int >= 1).

    Every argument is validated here, before any collective, identically on every rank.
    """
    spec = resolve(compression)
    op, factor = check_arguments(optimizer, backward_passes_per_step, op, gradient_predivide_factor, schedule,
                                 profile_steps, cost_model, delay, sync_every)
    check_tune_steps(tune_steps)
    spec = compressor_class(spec).adapt_optimizer(spec, optimizer.param_groups)  # e.g. DGC takes momentum over
    driver = make_communicator(backend, process_set, driver)  # Horovod (initialized) or torch.distributed

    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, spec, backward_passes_per_step, op, factor,
               sparse_as_dense, process_set, driver, optimizer, schedule, cost_model, profile_steps,
               delay, sync_every, tune_steps)
