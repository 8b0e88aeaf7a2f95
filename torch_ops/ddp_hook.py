"""Our compressors inside ``torch.nn.parallel.DistributedDataParallel``, as a communication hook.

    state, hook = hvdcompress.ddp.comm_hook("dgc:ratio=0.001", model=ddp_model, optimizer=opt)
    ddp_model.register_comm_hook(state, hook)

DDP hands the hook one *bucket* at a time, in bucket order, as its gradients become ready during
backward: a flat buffer holding several parameters' gradients. A bucket is a merged group
(``torch_ops.grouping``): its members (name, shape, offset) come from ``bucket.parameters()``, so
per-member rules (DGC's dense 1-D tensors, quantizers' per-tensor scales) apply as in our
optimizer. A compressor declared ``LAYERWISE`` (PowerSGD) is never merged: the bucket is split
into one exchange per parameter, each with its own state, and the results are written back into
the bucket.

The hook translates DDP's buckets into calls on an exchange session (``torch_ops.session``), which
owns the compressor, the state, the clock and the exchanges in flight. Every exchange goes through a
``TorchDistCommunicator`` on DDP's process group, wrapped in the non-finite guard
(``torch_ops.nonfinite``: a non-finite gradient on any rank gives NaN on every rank and leaves no
NaN in the state). torch.distributed has no tensor fusion of its own (Horovod fuses concurrent
allreduces in its background thread), so the hook batches (``TorchDistCommunicator.batch``):

* the first rounds of a bucket's exchanges are launched by its hook call, so they overlap the
  rest of backward, one batch per *unit* (the bucket, or the saved groups it holds after a
  resume): a split bucket's first-round allreduces (PowerSGD's P's, its dense 1-D tensors, the
  non-finite flags) travel as one collective per dtype, not one or two per parameter;
* the hook call of the last bucket drives every exchange of the step to completion, round by
  round (``finish_all``: each pass's next rounds, of every bucket, go out as one batch: every Q of
  the step in one collective), in the model's parameter order, the same on every rank
  (torch.distributed matches collectives by issue order), and completes the futures DDP waits for.

With ``topology=`` naming more than one node of more than one rank (default: the launcher's
``LOCAL_WORLD_SIZE``), exchanges are two-level (``torch_ops.twolevel``: dense inside a node, the
compressor across nodes on each rank's part), through the same session. With ``routes="auto"``
(the default on the launcher's topology) each bucket goes flat or two-level, as the optimizer's
groups do (``torch_ops.twolevel.RouteChoice``), decided from what the hook has, with no scheduler:

1. the first step goes flat; at its end each hop and the flat link are fitted
   (``torch_ops.profiling.profile_hops``; the flat model the cached one, ``load_or_profile``, or
   the ``cost_model=`` given), collectives on every rank at the same point;
2. at the end of every step whose buckets are not the ones assigned (the first, and the first
   after DDP rebuilt its buckets), each bucket gets the route ``choose_routes`` predicts faster for
   the spec, and the measured trial starts again: the model's routes, all flat, all two-level, each
   a settling step and ``tune_steps`` measured steps (the time from the end of one step's last
   bucket to the next's); the times are gathered and every rank keeps the same routes
   (``tuning.select``).

A bucket that changes route keeps or folds its state as the optimizer's groups do (the
``RouteChoice`` doc). ``state.stats.routes`` names each bucket's route and spec; ``state_dict()``
carries the decision (``ddp_routes``): a resumed run keeps it and measures nothing.

A fused collective's layout depends only on the units and the parameter order, not on DDP's
current buckets, so a resumed run adds in the same order as the run it resumes, on any number of
ranks. The result is the average over the ranks (DDP's default hook averages too).

State (residuals, momenta, PowerSGD's Q) is kept per parameter name: DDP rebuilds its buckets
after the first iteration (from one bucket in registration order to buckets in the order the
gradients became ready), so state is joined into a bucket's layout when a bucket of new members
appears and split back per parameter for ``state_dict()``. ``state.state_dict()`` /
``load_state_dict()`` save and restore it (each rank its own: residuals differ per rank), in the
format of our ``DistributedOptimizer``'s ``state_dict()["hvdcompress"]``, with the units in use
(``ddp_groups``): a resumed DDP starts again from its initial buckets, and where those hold the
saved units the hook exchanges the saved units (a merged group gathered from the bucket, results
scattered back), so resuming is exact.

Compressors that keep the momentum in their memory (DGC, the count sketch, EF-signSGD, 1-bit SGD) take the optimizer's
momentum over as our optimizer does (``Compressor.adapt_optimizer``): pass ``optimizer=`` and the
hook sets its momentum to 0 (and moves SGD's weight decay into the compressor's recipe), adds the
taken-over weight-decay term before each ``optimizer.step()`` (a step pre-hook calling
``before_step``) and keeps the momentum off after ``optimizer.load_state_dict`` (``after_load``).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from hvdcompress.spec import LAYERWISE, resolve

from .arguments import check_devices, check_topology
from .compressors import TakesMomentum, compressor_class
from .grouping import Group
from .scheduling import DEFAULT_TUNE_STEPS, check_tune_steps
from .session import ExchangeSession, SessionFront, exchange_name
from .timing import HOST_TIMER, timer_for

State = Dict[str, torch.Tensor]
ROUTES = ("auto", "two-level")  # routes=: each bucket flat or two-level as measured; every bucket two-level


def check_routes(routes, cost_model, compressor) -> None:
    """``routes=`` (None, "auto", "two-level") and ``cost_model=`` (None or a ``TwoLevelCostModel``)
    of the hook: ValueError naming the argument and what it accepts, on every rank alike."""
    from hvdcompress.schedule.twolevel import TwoLevelCostModel
    if routes is not None and routes not in ROUTES:
        raise ValueError("routes: must be None (the default: 'auto' on the launcher's topology, else 'two-level'), "
                         "'auto' (each bucket flat or two-level, measured) or 'two-level' (every bucket); "
                         f"got {routes!r}")
    if routes == "auto" and compressor.returns_update:
        raise ValueError(f"routes='auto': '{compressor.spec.name}' exchanges the optimizer's update, whose variance is "
                         "no sum over ranks, so a bucket cannot change route; accepted: routes='two-level' or None")
    if cost_model is not None and not isinstance(cost_model, TwoLevelCostModel):
        raise ValueError("cost_model: expected None or a hvdcompress.schedule.twolevel.TwoLevelCostModel (the links "
                         f"the route choice predicts with); got {type(cost_model).__name__}")


def chooses_routes(routes, topology, resolved, tune_steps: int, compressor) -> bool:
    """Whether the buckets of a ``resolved`` topology choose flat or two-level each, for
    ``routes=`` and ``topology=`` as given (checked): a topology of more than one node of more
    than one rank, a compressor whose state is a sum over ranks, and ``routes="auto"``, or None
    with the launcher's topology (``topology`` None) and ``tune_steps`` > 0, as the optimizer's
    default path. Pure."""
    if resolved.flat or compressor.returns_update:
        return False
    if routes is None:
        return topology is None and tune_steps > 0
    return routes == "auto"


class CommHookState(SessionFront):
    """The hook's state: the exchange session (``torch_ops.session``: compressor, per-parameter
    compression state, step and epoch, exchanges in flight, stats), the transport, and the
    buckets of the current backward pass (module doc). Build it with ``comm_hook``; every
    argument is checked before any collective, on every rank."""

    def __init__(self, spec, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 process_group=None, topology=None, routes=None, tune_steps: int = DEFAULT_TUNE_STEPS,
                 cost_model=None):
        spec = resolve(spec)  # a bad spec: ValueError here, on every rank
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model: expected the DDP model (a torch.nn.Module); got {type(model).__name__}")
        check_devices("model", model.named_parameters())
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer: expected a torch.optim.Optimizer or None; got {type(optimizer).__name__}")
        cls = compressor_class(spec)
        if optimizer is not None:
            spec = cls.adapt_optimizer(spec, optimizer.param_groups)  # DGC / sketch take the momentum over
        elif cls.returns_update:
            raise ValueError(f"optimizer: compression '{spec.name}' applies the optimizer's update itself; pass "
                             "optimizer= (the AdamW stepping the model) to comm_hook")
        elif issubclass(cls, TakesMomentum) and float(spec["momentum"]) > 0.0:
            warnings.warn(f"hvdcompress.ddp: compression '{spec.name}' applies momentum={spec['momentum']} in its "
                          "memory; pass optimizer= to comm_hook so the optimizer's own momentum is taken over (set "
                          "to 0), or run the optimizer without momentum")
        self._names: Dict[int, str] = {}
        params: Dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                self._names[id(p)] = name
                params[name] = p
        # the transport is made at the first bucket: the hook may be built before init_process_group
        self.session = ExchangeSession(spec, params, who="hvdcompress.ddp", owner="state")
        self.layerwise = self.compressor.merge == LAYERWISE
        self._group = process_group if process_group is not None else getattr(model, "process_group", None)
        self._topology = topology  # resolved with the transport (now, when torch.distributed is up)
        self.tune_steps = check_tune_steps(tune_steps)
        check_routes(routes, cost_model, self.compressor)
        self._routes, self._cost_model = routes, cost_model
        self._decided = False  # the routes are settled (measured, or loaded as settled): nothing is measured
        self._saved_routes: Optional[dict] = None  # loaded before the transport was made
        self._clock: Optional[float] = None  # when the last step's route bookkeeping ended
        self._step_groups: List[Tuple[Tuple[str, ...], int]] = []  # this step's exchanges: members, bytes
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            self.transport  # noqa: B018 -- a bad topology: ValueError here, on every rank
        self._layout: Dict[str, Tuple[str, ...]] = {}  # parameter -> the unit it was last exchanged in
        self._order = {name: i for i, name in enumerate(params)}  # the model's parameter order
        self._buckets: List[Tuple[torch.futures.Future, torch.Tensor, List[Any]]] = []  # this backward pass
        self.optimizer = optimizer
        self._handles = []
        if optimizer is not None:
            comp = self.compressor
            self._handles = [
                optimizer.register_step_pre_hook(lambda opt, args, kwargs: comp.before_step(opt.param_groups, opt.state)),
                optimizer.register_load_state_dict_post_hook(lambda opt: comp.after_load(opt.param_groups)),
            ]


    @property
    def transport(self):
        """The ``TorchDistCommunicator`` on the process group (made on first use)."""
        if self.session.transport is None:
            from .dist_collectives import TorchDistCommunicator
            from .twolevel import two_level_transport
            comm = TorchDistCommunicator(self._group)
            layout = check_topology(self._topology, comm)
            chooses = chooses_routes(self._routes, self._topology, layout, self.tune_steps, self.compressor)
            given = self._cost_model if chooses else None
            if given is not None and given.topology != layout:
                raise ValueError(f"cost_model: a TwoLevelCostModel of topology {given.topology}, but the exchanges "
                                 f"run on {layout}")
            transport = two_level_transport(comm, layout, chooses)
            if chooses:
                transport.route_choice.given = given
            self.session.transport = transport
            if self._saved_routes is not None:
                self._load_routes(self._saved_routes)
        return self.session.transport

    @property
    def routes_settled(self) -> bool:
        """No route decision is pending: the buckets do not choose (``routes``), or their routes
        are fitted and measured (or loaded as settled)."""
        return self.route_choice is None or self._decided

    @property
    def route_choice(self):
        """The transport's ``torch_ops.twolevel.RouteChoice`` where buckets choose their route, else None."""
        return getattr(self.transport, "route_choice", None)

    @property
    def world(self) -> int:
        return self.transport.size()

    # -- epochs (warm-ups) ---------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Tell compressors with a warm-up (DGC) which epoch starts; call on every rank."""
        self.session.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.session.current_epoch()

    # -- the hook ------------------------------------------------------------------------------------
    def members(self, bucket) -> List[Tuple[str, Tuple[int, ...], int]]:
        """(name, shape, offset in the bucket's buffer) of each parameter of ``bucket``."""
        out, offset = [], 0
        for p in bucket.parameters():
            name = self._names.get(id(p))
            if name is None:
                raise ValueError("hvdcompress.ddp: a bucket holds a parameter that model.named_parameters() "
                                 f"does not list (shape {tuple(p.shape)}); pass the DDP model as model=")
            out.append((name, tuple(p.shape), offset))
            offset += p.numel()
        return out

    def _units_of(self, members) -> List[Tuple[str, ...]]:
        """The bucket's *units*, each exchanged as one batch: the units its parameters were last
        exchanged in when those partition the bucket (so a resumed run, whose DDP starts from its
        initial buckets, exchanges as the run it resumes did), else the bucket as one unit,
        remembered. A unit is one group (one exchange), or, for a layerwise compressor, one
        exchange per parameter, their first rounds launched in one batch."""
        names = tuple(n for n, _, _ in members)
        inside = set(names)
        known = [self._layout.get(n) for n in names]
        if all(g is not None and inside.issuperset(g) for g in known):
            return list(dict.fromkeys(known))
        for n in names:
            self._layout[n] = names
        return [names]

    def __call__(self, bucket) -> torch.futures.Future:
        buf = bucket.buffer()
        members = self.members(bucket)
        where = {n: (shape, offset) for n, shape, offset in members}
        session, transport = self.session, self.session.streams.transport(self.transport, buf.device)
        step, epoch = session.step, self.epoch
        choice = self.route_choice
        parts = []
        with torch.no_grad():
            for unit in self._units_of(members):
                # one batch per unit: a split unit's first rounds travel as one collective per dtype,
                # laid out by the unit alone (not by DDP's current buckets), so sums are reproduced
                # exactly after a resume
                with transport.batch():
                    for names in ([(n,) for n in unit] if self.layerwise else [unit]):
                        group = Group(names, tuple(where[n][0] for n in names))
                        spans = [(where[n][1], m) for n, m in zip(names, group.numels)]
                        if all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)):
                            x = buf[spans[0][0]:spans[0][0] + group.numel]  # a view: the result is built in place
                        else:
                            x = torch.cat([buf[o:o + m] for o, m in spans])
                        if choice is not None:
                            choice.sees(group.key, names)
                            self._step_groups.append((names, group.numel * x.element_size()))
                        ex = session.start(x, names, key=group.key, step=step, name=exchange_name(group.key),
                                           shape=group.shape, members=group.layout, epoch=epoch, out=x)
                        session.pending.add(self._order[names[0]], ex, step)
                        parts.append((ex, spans))
        fut: torch.futures.Future = torch.futures.Future()
        self._buckets.append((fut, buf, parts))
        if bucket.is_last():
            self._finish()
        return fut

    def _finish(self) -> None:
        """Complete every exchange of this backward pass and the futures DDP waits for."""
        with torch.no_grad():
            # later rounds in the model's parameter order: the fused layout is the same whatever
            # DDP's buckets are
            self.session.pending.finish(by_key=True)
            dense = 0
            exchanges = []
            for _, buf, parts in self._buckets:
                for ex, spans in parts:
                    result, pos = ex.result.reshape(-1), 0
                    for offset, n in spans:
                        target = buf[offset:offset + n]
                        if result.data_ptr() + pos * result.element_size() != target.data_ptr():
                            target.copy_(result[pos:pos + n])
                        pos += n
                    exchanges.append(ex)
                dense += buf.numel() * buf.element_size()
        buckets, self._buckets = self._buckets, []
        self.session.end_step(exchanges, dense)
        choice = self.route_choice
        if choice is not None:
            self._route_step(choice, buckets[0][1].device)
        for fut, buf, _ in buckets:
            fut.set_result(buf)

    # -- flat or two-level per bucket ----------------------------------------------------------------
    def _route_step(self, choice, device) -> None:
        """The route bookkeeping at the end of a step (module doc), at the same point on every rank:
        fit the links once, assign routes to new buckets and (re)start the measured trial, or count
        this step in the trial."""
        timer = HOST_TIMER if self._decided else timer_for(device)
        ended = timer.now()
        seconds = None if self._clock is None else ended - self._clock
        groups, self._step_groups = self._step_groups, []
        if not self._decided and choice.model is None:
            self._fit_routes(choice, device)
        if set(g for g, _ in groups) != set(choice.groups):
            choice.assign([g for g, _ in groups], [b for _, b in groups], [str(self.spec)] * len(groups))
            if choice.model is not None:
                choice.start_trial(self.tune_steps)
                self._decided = not choice.validating
        elif choice.validating:
            self._decided = choice.trial_step(seconds, self.transport)
        self._clock = None if self._decided else timer.now()

    def _fit_routes(self, choice, device) -> None:
        """Each hop's fit and the flat model (the given ``cost_model``'s, with fits for the spec,
        else the cached or profiled one): collectives on every rank."""
        from .profiling import load_or_profile, with_fits
        world = self.transport.world
        total = float(sum(p.numel() * p.element_size() for p in self.session.params.values()))
        if choice.given is not None:
            flat = with_fits(choice.given.flat, [self.spec], comm=world, device=device)
        else:
            flat = load_or_profile([self.spec], max_bytes=total, comm=world, device=device)
        choice.fit(flat, max_bytes=total, device=device)

    # -- state ---------------------------------------------------------------------------------------
    def param_state(self) -> Dict[str, State]:
        """Compression state per parameter name (copies)."""
        return self.session.param_state()

    def state_dict(self) -> Dict[str, Any]:
        """Step, epoch, compression state per parameter, compressor-wide state (each rank its own)."""
        if self._buckets:
            raise AssertionError("hvdcompress.ddp: state_dict() during backward; call it between steps")
        saved = self.session.pack()
        saved["ddp_groups"] = [list(g) for g in dict.fromkeys(self._layout.values())]
        choice = self.route_choice if self.session.transport is not None else None
        if choice is not None:  # the routes in use, and whether they are settled
            saved["ddp_routes"] = {"choice": choice.to_dict(), "decided": self._decided}
        return saved

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; checked first (same spec, known parameters, sizes,
        finite values: ValueError otherwise, with nothing changed)."""
        self.session.check(state_dict)
        groups = [tuple(g) for g in state_dict.get("ddp_groups") or ()]
        seen = [n for g in groups for n in g]
        if len(seen) != len(set(seen)) or not set(seen) <= set(self.session.params):
            raise ValueError("load_state_dict: the checkpoint's bucket groups name parameters this model does not "
                             "have, or one parameter twice (a checkpoint of a different model?)")
        if self._buckets:
            raise AssertionError("hvdcompress.ddp: load_state_dict() during backward; call it between steps")
        self.session.load(state_dict)
        self._layout = {n: g for g in groups for n in g}
        saved = state_dict.get("ddp_routes")
        if saved is not None and self.session.transport is None:
            self._saved_routes = saved  # applied when the transport is made
        elif saved is not None:
            self._load_routes(saved)

    def _load_routes(self, saved: dict) -> None:
        """A checkpoint's routes: settled ones are kept and nothing is measured; routes saved
        before the decision are used until it is made again (fit, trial)."""
        self._saved_routes = None
        choice = self.route_choice
        if choice is None:  # saved with the route choice, resumed without it: every bucket two-level
            return
        choice.load(saved["choice"])
        self._decided, self._clock, self._step_groups = bool(saved["decided"]), None, []

    def remove(self) -> None:
        """Detach the optimizer hooks this state installed (the DDP hook itself cannot be removed)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def hook(state, bucket):  # no annotations: DDP compares them with real types (postponed ones are strings)
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, hook)``; returns a
    ``torch.futures.Future[torch.Tensor]`` holding the bucket's averaged gradients."""
    return state(bucket)


def comm_hook(spec, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
              process_group=None, topology=None, routes=None, tune_steps: int = DEFAULT_TUNE_STEPS,
              cost_model=None):
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    spec: a compression spec (``"topk:ratio=0.01"``, ``hvdcompress.Compression.dgc(...)``); a bad
        one raises ValueError here, on every rank, before any collective.
    model: the DDP model (its named parameters name the state and seed the selections).
    optimizer: the optimizer stepping the model; needed by compressors that keep the momentum
        (DGC, sketch): its momentum (and SGD's weight decay) is taken over, as in
        ``DistributedOptimizer``.
    process_group: default the DDP model's (``ddp_model.process_group``), else the default group
        (``model`` may then be the unwrapped module, and torch.distributed may be initialized
        after this call, before the first backward: as Lightning's ``DDPStrategy`` needs).
    topology: None (default): the launcher's (torchrun's ``LOCAL_WORLD_SIZE``), flat on a
        process group smaller than the job; "flat"; "NxL" (N nodes of L ranks) or "L"; a
        ``hvdcompress.topology.Topology``. More than one node of more than one rank: exchanges
        are two-level (``torch_ops.twolevel``: dense inside a node, the compressor across
        nodes), per bucket or all of them as ``routes`` says. A bad value raises ValueError here
        when torch.distributed is initialized, else at the first bucket, on every rank.
    routes: on a two-level topology, "auto": each bucket flat or two-level, as predicted from
        each hop's fit and then measured (module doc); "two-level": every bucket two-level. None
        (default): "auto" on the launcher's topology (``topology`` None) with ``tune_steps`` > 0,
        else "two-level" (as the optimizer, where an explicit topology without the codec choice
        sends every group two-level). Not for a compressor that exchanges the optimizer's update
        (1-bit Adam, top-k Adam): "auto" is a ValueError there, None "two-level".
    tune_steps: measured steps per trial of the route choice (int in [0, 100], default 3; 0: the
        model's routes, unmeasured), as the optimizer's measured validation.
    cost_model: a ``hvdcompress.schedule.twolevel.TwoLevelCostModel`` of the topology: the route
        choice predicts with its links instead of timing them (default: each hop timed, the flat
        model cached or profiled, at the end of the first step).
    """
    state = CommHookState(spec, model, optimizer, process_group, topology, routes, tune_steps, cost_model)
    return state, hook
