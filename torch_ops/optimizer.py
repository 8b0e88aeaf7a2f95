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

The work is done by one ``torch_ops.engine.Engine`` (``opt.engine``): groups, compression state,
exchanges in flight and the sync policy; this class maps Horovod's optimizer API onto it.

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

from hvdcompress.contract import transport_argument
from hvdcompress.schedule.planner import Plan
from hvdcompress.spec import CompressionSpec, resolve

from . import checkpoint
from .arguments import check_arguments, check_devices, check_topology, parameter_names
from .codec_choice import chooses_routes, resolve_codec_choice
from .compressors import build_compressor, compressor_class
from .elastic import elastic_mode
from .engine import Engine
from .scheduling import DEFAULT_TUNE_STEPS, check_revalidate_every, check_tune_steps
from .transport import Average, make_transport
from .twolevel import two_level_transport


# Horovod needs it: ``broadcast_optimizer_state`` calls ``step()`` (an exchange, on the ranks without
# state only) unless the optimizer's class is from this module.
HOROVOD_OPTIMIZER_MODULE = "horovod.torch.optimizer"


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, spec: CompressionSpec, backward_passes_per_step: int,
                 op, gradient_predivide_factor: float, sparse_as_dense: bool, process_set, transport, source,
                 schedule, cost_model, profile_steps, delay=0, sync_every=1, tune_steps=0, alternatives=(),
                 revalidate_every=None, compressor=None):
        super(self.__class__, self).__init__(params)
        self.defaults = dict(source.defaults)
        self.state.update(source.state)
        names = parameter_names(self.param_groups, named_parameters)
        trained = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self.engine = Engine(spec, {names[p]: p for p in trained},
                             transport, average=op == Average, predivide=gradient_predivide_factor,
                             passes=backward_passes_per_step, sparse_as_dense=sparse_as_dense, schedule=schedule,
                             cost_model=cost_model, profile_steps=profile_steps, tune_steps=tune_steps,
                             delay=delay, sync_every=sync_every, alternatives=alternatives,
                             revalidate_every=revalidate_every, compressor=compressor,
                             check_model=not elastic_mode())  # elastic: checked at each sync (torch_ops.elastic)
        self._should_synchronize = True
        # Horovod's introspection attributes, with their meaning there
        self._parameter_names = dict(names)
        self._requires_update = set(trained)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = self.engine.transport.process_set
        # no hooks on a rank outside the process set (nothing is exchanged there), as in Horovod
        self._hvc_hooks = ([p.register_post_accumulate_grad_hook(self.engine.gradient_ready) for p in trained]
                           if self.engine.included else [])

    # -- public API (Horovod's) -----------------------------------------------------------------
    @property
    def compression(self) -> CompressionSpec:
        return self.engine.spec

    @property
    def schedule(self) -> str:
        """The schedule asked for ("auto", "mgs", "size:64", ..., or "explicit")."""
        return self.engine.scheduler.text

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in use (``hvdcompress.schedule.planner.Plan``: groups as indices in backward order,
        ``predicted_seconds``, ``notes``), or None until the scheduler has decided."""
        return self.engine.scheduler.plan

    @property
    def codec_choice(self) -> str:
        """The per-group codec choice in use: "auto" (the plan picks the compressor, fp16 or dense
        per group) or "off" (the compressor everywhere); what ``codec_choice=None`` resolved to."""
        return "auto" if self.engine.scheduler.alternatives else "off"

    @property
    def groups(self) -> List[List[str]]:
        """The parameter names of each group exchanged now, in launch order."""
        return self.engine.group_names()

    @property
    def workload(self):
        """The profiled ``hvdcompress.schedule.planner.Workload`` the plan was made from (or None)."""
        return self.engine.scheduler.workload

    @property
    def cost_model(self):
        """The ``CostModel`` the plan was made with (given, cached or profiled), or None."""
        return self.engine.scheduler.cost_model

    def decisions(self):
        """Per group of the plan in use, what it is sent with (the compressor, fp16 or dense) and
        the predicted seconds of each option, with the measured validation's candidates where it
        ran (``hvdcompress.schedule.explain.Decisions``; ``.lines()`` prints it). Local: no
        collective."""
        from hvdcompress.schedule.explain import calibrated, explain

        s = self.engine.scheduler
        order = s.order or list(s.sizes)
        return explain(s.plan, order, [s.sizes[n] for n in order], s.spec,
                       calibrated(s.cost_model, s.calibration), s.world, self.codec_choice)

    @property
    def stats(self):
        """``hvdcompress.stats.WireStats``: bytes this rank sent per step vs dense, compression time."""
        return self.engine.stats

    @property
    def timings(self) -> Dict[str, Optional[float]]:
        """What the last step measured (``torch_ops.scheduling.StepClock.timings``)."""
        return self.engine.timings

    @property
    def _synchronized(self) -> bool:  # Horovod's flag: synchronize() ran and step() has not yet
        return self.engine.synchronized

    def synchronize(self):
        """Finish the gradient exchanges due at this step and write the gradients into ``p.grad``
        (synchronous: the exchanged averages; ``delay``/``sync_every``: see ``torch_ops.delayed``)."""
        self.engine.synchronize()

    def set_epoch(self, epoch: int) -> None:
        """Tell compressors with a schedule (DGC's sparsity warm-up) which epoch is starting.
        Call it on every rank at the start of each epoch (0-based), like a sampler's set_epoch."""
        self.engine.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the compressors use now: the last ``set_epoch``, else (for a compressor with
        a warm-up) ``step // warmup_epoch_steps``."""
        return self.engine.current_epoch()

    @property
    def density(self) -> Optional[float]:
        """The fraction of entries a ratio-based compressor sends now (DGC: its warm-up density)."""
        return self.engine.compressor.density(self.engine.current_epoch())

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use when ``synchronize()`` was called by hand (e.g. to clip gradients) before ``step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        engine = self.engine
        if self._should_synchronize:
            if engine.synchronized and not engine.launched_now():
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(); the gradients were already exchanged, so "
                              "they are not exchanged (nor compressed) a second time.")
            else:
                engine.synchronize()
        engine.synchronized = False
        if not engine.included:  # outside the process set: the wrapped optimizer's update on the local gradients
            return super(self.__class__, self).step(closure)
        start = engine.scheduler.timer().now()
        engine.compressor.before_step(self.param_groups, self.state)  # e.g. DGC's taken-over weight decay
        loss = super(self.__class__, self).step(closure)
        engine.clock.update = (start, engine.scheduler.timer().now())
        engine.end_of_step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self.engine.launched_now():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it "
                                 "can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)

    def flush(self) -> None:
        """Delayed averaging: complete every exchange in flight, apply the corrections not yet
        applied, then average the parameters and the optimizer's per-parameter state over the
        ranks, so every rank holds identical parameters (``torch_ops.delayed``). Call it on every
        rank, between steps (before evaluating or comparing replicas). Nothing to do when training
        is synchronous (delay=0, sync_every=1)."""
        self.engine.flush(self, super(self.__class__, self).step)

    @property
    def delay(self) -> int:
        return self.engine.policy.delay

    @property
    def sync_every(self) -> int:
        return self.engine.policy.every

    def state_dict(self):
        """The wrapped optimizer's state, and ours under ``"hvdcompress"`` (``torch_ops.checkpoint``)."""
        sd = super(self.__class__, self).state_dict()
        sd[checkpoint.STATE_KEY] = self.engine.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop(checkpoint.STATE_KEY, None)
        if ours is not None:
            self.engine.check_state_dict(ours)  # before anything is loaded
        super(self.__class__, self).load_state_dict(state_dict)
        self.engine.load_state_dict(ours, self.param_groups)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step: int = 1, op=None,
                         gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                         process_set=None, transport=None, schedule="auto", cost_model=None,
                         profile_steps: int = 5, delay: int = 0, sync_every: int = 1,
                         tune_steps: int = DEFAULT_TUNE_STEPS, codec_choice=None, backend: str = "horovod",
                         revalidate_every=None, topology=None, driver=None):
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
        process_set: a Horovod process set (default: all ranks). On a rank outside it nothing is
            exchanged: as with Horovod's optimizer, ``step()`` is the wrapped optimizer's update
            on the local gradients.
        transport: the transport every collective goes through (``hvdcompress.contract.Transport``;
            default Horovod's ``torch_ops.collectives.Communicator(process_set)``, or with
            backend="torch" ``torch_ops.dist_collectives.TorchDistCommunicator(process_set)``); an
            extension point: one may change how rounds complete
            (``hvdcompress.bench.injected_latency.LatencyTransport`` delays them).
        driver: the former name of ``transport`` (deprecated: a DeprecationWarning; removed in
            the next release).
        backend: "horovod" (default; launched by horovodrun) or "torch": torch.distributed
            (launched by torchrun, any backend; Horovod is never imported), with ``process_set``
            a process group (``torch_ops.transport``, ``torch_ops.dist_collectives``).

    Layer merging (``torch_ops.scheduling`` has the details):
        schedule: how gradients are grouped into exchanges: "auto" (default: the cost-model
            schedule for the compressor, "mgs" for sparsifiers, "mgwfbp" for dense ones),
            "mgs", "mgwfbp" (":greedy" for the papers' greedy rule), "layerwise" (one exchange
            per tensor), "single" (one for all), "size:<MB>" (Horovod-fusion-like), or explicit
            groups: a list of lists of parameter names, consecutive in backward order.
        cost_model: an ``hvdcompress.schedule.costmodel.CostModel`` for the cost-model schedules (and for
            predicted step times with the others); default: the cached fit for this world and
            host set, else profiled on the live transport at first use (a few seconds).
        profile_steps: steps measured (after the first) before a cost-model plan is made; until
            then gradients are exchanged as one group (int in [1, 1000]).
        tune_steps: measured validation of a cost-model plan (int in [0, 100], default 3; 0: off):
            a few candidate plans (the model's first, "single", size plans, ...) each run one
            settling step and this many measured steps, and the fastest (median, slowest rank)
            is kept, on every rank from the same step. Ignored by the fixed schedules. With the
            codec choice on the candidates also hold the compressor, fp16 and dense, each on
            every group, so the plan kept is never measurably slower than the best of them.
        revalidate_every: after measured validation, watch the step time in windows of this
            many steps (int: 0 is off, else in [3, 1000000]; None, the default: 100 when the
            codec choice is on, else 0): the first window after a decision sets a reference,
            and a window whose median (slowest rank) differs from it by more than 25% runs the
            measured validation again, deciding at the same step on every rank. Needs
            tune_steps > 0.
        codec_choice: "auto": the plan also picks, per group, the compressor, "fp16" or dense,
            whichever the calibrated cost model predicts fastest (``torch_ops.codec_choice``;
            residuals go out with a group that turns dense); needs delay=0, sync_every=1 and a
            compressor with a dense form (ValueError otherwise). "off": the compressor
            everywhere. None (default): "auto" where it is measured to be safe, else "off",
            silently: a compressing spec (not none / fp16 / bf16), a cost-model schedule ("auto",
            "mgs", "mgwfbp"; ":greedy" too, but not for a compressor that never merges),
            tune_steps > 0, delay=0, sync_every=1, a compressor with a dense form, and not under
            Horovod Elastic. There the measured validation always runs the compressor on every
            group beside the choice, so the plan kept is never measurably slower than the
            compressor's own plan. ``opt.codec_choice`` says what was resolved.

    Nodes (``torch_ops.twolevel``, docs/two-level.md):
        topology: None (default): the launcher's (torchrun's ``LOCAL_WORLD_SIZE``, horovodrun's
            ``HOROVOD_LOCAL_SIZE``; on Horovod where its node process sets are at hand:
            ``hvdcompress.torch.init()`` registers them, else flat); "flat": one level; "NxL": N
            nodes of L ranks (ranks numbered node by node), or "L"; a
            ``hvdcompress.topology.Topology``. Where it has more than one node of more than one
            rank, exchanges are two-level: a dense reduce-scatter inside the node, the compressor
            across nodes on each rank's part, an allgather inside the node (on Horovod through
            process sets: an explicit one needs ``hvdcompress.torch.init()``'s sets or
            ``hvd.init(process_sets="dynamic")``, and the whole job as ``process_set``).

    Training across high-latency links (``torch_ops.delayed`` states the math):
        delay: steps between launching an exchange and applying its result (int >= 0; 0, the
            default, is synchronous). Each step applies its local term at once (the local
            gradient; for DGC and the sketch, which keep the momentum, a local velocity) and the
            correction ``R - L`` of the exchange launched ``delay`` steps earlier.
            ``opt.flush()`` completes what is in flight and makes the replicas identical.
        sync_every: exchange once every this many steps, local steps in between (int >= 1).

    Returns a ``torch.optim.Optimizer`` of the wrapped one's class with Horovod's extra methods
    (``synchronize``, ``skip_synchronize``) and ours (``flush``, ``set_epoch``, ``stats``,
    ``plan``, ``groups``, ``timings``, ``codec_choice``); its ``state_dict()`` carries the compression state.
    Raises ``ValueError`` naming the argument and its accepted range, here, before any
    collective, identically on every rank (a model that differs across ranks too). Guide:
    docs/pytorch.md.
    """
    transport = transport_argument(transport, driver, "DistributedOptimizer")
    spec = resolve(compression)
    op, factor = check_arguments(optimizer, backward_passes_per_step, op, gradient_predivide_factor, schedule,
                                 profile_steps, cost_model, delay, sync_every)
    check_devices("optimizer", ((f"param_groups[{i}][{j}]", p) for i, g in enumerate(optimizer.param_groups)
                                for j, p in enumerate(g["params"])))
    check_tune_steps(tune_steps)
    # e.g. DGC takes the momentum over (checked on every rank, before any collective), on copies of
    # the groups: they are written into the wrapped optimizer once nothing can fail any more
    groups = [dict(g) for g in optimizer.param_groups]
    spec = compressor_class(spec).adapt_optimizer(spec, groups)
    compressor = build_compressor(spec)  # the one compressor of this optimizer
    if compressor.returns_update and (delay != 0 or sync_every != 1):
        raise ValueError(f"delay / sync_every: {spec.name} exchanges the optimizer's update, which delayed "
                         f"averaging cannot split into local and delayed terms; accepted: delay=0 and sync_every=1 "
                         f"(got delay={delay}, sync_every={sync_every})")
    alternatives = resolve_codec_choice(codec_choice, spec, compressor, schedule, tune_steps, delay,
                                        sync_every, elastic=elastic_mode())
    check_revalidate_every(revalidate_every, bool(alternatives))
    transport = make_transport(backend, process_set, transport)  # Horovod (initialized) or torch.distributed
    layout = check_topology(topology, transport)
    transport = two_level_transport(transport, layout, chooses_routes(topology, layout, alternatives, schedule,
                                                                      tune_steps, compressor))  # flat: itself
    if transport.included():  # a rank outside the process set exchanges nothing: its optimizer stays as it is
        for group, adapted in zip(optimizer.param_groups, groups):
            group.update(adapted)

    namespace = dict(_DistributedOptimizer.__dict__)
    if backend == "horovod":
        namespace["__module__"] = HOROVOD_OPTIMIZER_MODULE
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), namespace)
    return cls(optimizer.param_groups, named_parameters, spec, backward_passes_per_step, op, factor,
               sparse_as_dense, process_set, transport, optimizer, schedule, cost_model, profile_steps,
               delay, sync_every, tune_steps, alternatives, revalidate_every, compressor)
