"""Two-level exchanges: dense inside a node, the spec's exchange across nodes (PyTorch).

A node's ranks share fast links (NVLink, PCIe, shared memory), nodes share slow ones. Given a
``hvdcompress.topology.Topology`` of N nodes of L ranks, one exchange of a flat tensor x is

1. a dense reduce-scatter inside the node: x is cut into L parts (``schedule.groups.split_layout``), every
   rank sends part j to local rank j (one ``Alltoall`` on the node's group) and sums the L pieces it
   receives in local rank order, so local rank l holds its node's sum of part l;
2. the spec's own exchange generator, unchanged, on that part, over the ranks at local position l
   of every node (the cross group: N ranks, ``world_size`` N, ``rank`` the node), with the flat
   exchange's ``scale`` (so the result is the mean over all ranks where the flat one averages);
3. an allgather of the exchanged parts inside the node, which is the result on every rank.

``hvdcompress.reference.twolevel`` is the numpy oracle of the same steps, and says what the state
of the cross exchange means (the state of local rank l's part, on that rank only, kept in the flat
layout so checkpoints and merged groups are unchanged).

The cross exchanges of a node's L ranks work on different parts and may take different numbers of
rounds (a part may be empty, or fall under a compressor's dense rule). Every round therefore
carries a 4-byte local ``Flag``: 1 while this rank still had cross requests; the ranks go on, a
rank that is done sending only its flag, until a round where none had any, and then gather. So
every rank of the job runs the same rounds, which a transport that matches collectives by issue
order (torch.distributed) needs when several exchanges are in flight. It costs one flag round on
the node's links per exchange.

``TwoLevelTransport`` is the ``Transport`` the session sees: the world's transport for everything
untagged (the non-finite guard's flag, object collectives, profiling, barriers), the local and
cross groups' transports for ``Hop`` requests; ``compose`` makes the two-level exchange around a
compressor's exchange, which ``torch_ops.session.ExchangeSession.start`` calls when its transport
has it. Payload bytes are counted per hop (``take_hop_bytes``, read into ``stats.hops``).

With ``choose_routes`` the transport's ``RouteChoice`` sends each group flat (the spec's exchange
on the world's transport, as without a topology) or two-level, as the scheduler's cost model
with each hop fitted, then a measured validation, decided (docs/two-level.md).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hvdcompress.contract import Allgather, Alltoall, ExchangeContext, Flag, Hop, payload_requests
from hvdcompress.schedule import tuning
from hvdcompress.schedule.groups import MergedGroup, Part, split_layout
from hvdcompress.schedule.twolevel import (FLAT, TWO_LEVEL, Route, TwoLevelCostModel, choose_routes, label,
                                           route_trials)
from hvdcompress.topology import CROSS, LEVELS, LOCAL, WORLD, LevelTransports, Topology


def part_state(state: Dict[str, Any], part: Part, numel: int) -> Dict[str, Any]:
    """The cross exchange's state: entries as large as the whole tensor as views of the part (in-place
    updates reach the flat-layout state), others as they are."""
    return {k: (v.reshape(-1)[part.start:part.stop] if torch.is_tensor(v) and v.numel() == numel else v)
            for k, v in state.items()}


def store_state(state: Dict[str, Any], inner: Dict[str, Any], part: Part, numel: int) -> None:
    """Write the cross exchange's state back into the flat-layout ``state``: an entry as large as the
    part into its place of a whole-size tensor (zeros elsewhere when new), any other as it is."""
    for k, v in inner.items():
        if torch.is_tensor(v) and v.numel() == part.numel and part.numel != numel:
            whole = state.get(k)
            if not torch.is_tensor(whole) or whole.numel() != numel:
                whole = state[k] = v.new_zeros(numel)
            place = whole.reshape(-1)[part.start:part.stop]
            if place.data_ptr() != v.data_ptr() or place.numel() != v.numel():
                place.copy_(v.reshape(-1))
        else:
            state[k] = v


def node_sum(pieces: torch.Tensor, L: int, numel: int) -> torch.Tensor:
    """The ``L`` pieces an all-to-all brought (one per local rank, ``numel`` each) summed in local
    rank order, as the oracle adds."""
    pieces = pieces.reshape(L, numel)
    mine = pieces[0].clone()
    for i in range(1, L):
        mine.add_(pieces[i])
    return mine


def additive_entries(state: Dict[str, Any], numel: int) -> List[str]:
    """The state entries a fold moves: floating tensors as large as the whole tensor (residuals,
    momenta, velocities: sums over ranks), in sorted order (the same on every rank)."""
    return sorted(k for k, v in state.items()
                  if torch.is_tensor(v) and v.numel() == numel and v.is_floating_point())


def two_level_exchange(make: Callable[[torch.Tensor, ExchangeContext], Any], x: torch.Tensor,
                       ctx: ExchangeContext, topology: Topology, rank: int, fold: bool = False):
    """The two-level exchange of ``x`` on ``rank`` (module doc): ``make(part, ctx)`` is the spec's
    exchange generator; yields ``Hop`` requests, returns the dense result.

    ``fold``: the state may hold entries outside this rank's part (the group was last sent flat,
    or under another grouping): every additive entry (``additive_entries``) is reduce-scattered
    inside the node with the gradient, in the same round, so local rank l starts from its node's sum
    of part l and holds zeros elsewhere. What the ranks held back is then held by the node, once."""
    L = topology.local_size
    flat = x.reshape(-1)
    numel = flat.numel()
    parts = split_layout(numel, tuple(ctx.shape), ctx.member_list(numel), L)
    part = parts[topology.local_rank(rank)]
    splits = tuple(p.numel for p in parts)
    folded = additive_entries(ctx.state, numel) if fold else []
    got = yield (Hop(LOCAL, Alltoall(flat.contiguous(), splits)),) + tuple(
        Hop(LOCAL, Alltoall(ctx.state[k].reshape(-1).contiguous(), splits)) for k in folded)
    mine = node_sum(got[0], L, part.numel)
    for k, pieces in zip(folded, got[1:]):
        whole = ctx.state[k].reshape(-1)
        summed = node_sum(pieces, L, part.numel).to(whole.dtype)
        whole.zero_()
        whole[part.start:part.stop].copy_(summed)
    view = part_state(ctx.state, part, numel)
    inner = ExchangeContext(ctx.key, ctx.step, topology.nodes, ctx.scale, view, part.shape, ctx.epoch,
                            topology.node_of(rank), part.members, density=ctx.density)
    result, gen, requests = mine, None, None
    if part.numel:
        gen = make(mine, inner)
        try:
            requests = next(gen)
        except StopIteration as stop:
            result = stop.value
    while True:
        running = requests is not None
        flag = torch.tensor([1.0 if running else 0.0], dtype=torch.float32)
        got = yield tuple(Hop(CROSS, r) for r in (requests or ())) + (Hop(LOCAL, Flag(flag)),)
        if running:
            try:
                requests = gen.send(tuple(got[:-1]))
            except StopIteration as stop:
                requests, result = None, stop.value
        if float(got[-1][0]) == 0.0:
            break
    store_state(ctx.state, view, part, numel)
    (whole,) = yield (Hop(LOCAL, Allgather(result.reshape(-1).contiguous())),)
    return whole


class TwoLevelTransport(LevelTransports):
    """The PyTorch ``Transport`` over three (``hvdcompress.topology.LevelTransports``: the world's,
    the node's and the cross-node peers'; module doc)."""

    def __init__(self, world, local, cross, topology: Topology, choose_routes: bool = False):
        super().__init__(world, local, cross, topology)
        # per-group flat or two-level (``RouteChoice``); None: every group two-level
        self.route_choice = RouteChoice(self) if choose_routes else None
        self._hop_bytes = {LOCAL: 0, CROSS: 0}

    # -- the exchange ---------------------------------------------------------------------------
    def compose(self, make, x: torch.Tensor, ctx: ExchangeContext):
        """The exchange around ``make(x, ctx)`` (the spec's exchange) on this rank: two-level, or,
        where ``route_choice`` sends this group flat, ``make(x, ctx)`` itself on the world."""
        choice = self.route_choice
        if choice is None:
            return two_level_exchange(make, x, ctx, self.topology, self.rank())
        route, fold = choice.take(ctx.key)
        if route == FLAT:
            return make(x, ctx)
        return two_level_exchange(make, x, ctx, self.topology, self.rank(), fold=fold)

    def take_routes(self) -> Optional[Dict[str, str]]:
        """Per group exchanged since the last call, its route and spec (``RouteChoice.take_labels``);
        None without a route choice (every group two-level)."""
        return None if self.route_choice is None else self.route_choice.take_labels()

    def take_hop_bytes(self) -> Dict[str, int]:
        """Payload bytes handed to each hop since the last call."""
        out, self._hop_bytes = self._hop_bytes, {LOCAL: 0, CROSS: 0}
        return out

    # -- requests -------------------------------------------------------------------------------
    def launch(self, requests: Sequence[Any], name: str) -> List[Tuple[str, int, Any]]:
        """Each level's requests launched on its transport (world, local, cross: the same order on
        every rank); handles are (level, index in that level's round, the level's handles)."""
        by: Dict[str, List[Any]] = {level: [] for level in LEVELS}
        where = []
        for req in requests:
            level = req.level if isinstance(req, Hop) else WORLD
            inner = req.request if isinstance(req, Hop) else req
            if level not in self.by_level:
                raise ValueError(f"Hop: level must be one of {LEVELS[1:]}; got {level!r}")
            where.append((level, len(by[level])))
            by[level].append(inner)
            if level in self._hop_bytes and payload_requests((inner,)):
                self._hop_bytes[level] += inner.tensor.numel() * inner.tensor.element_size()
        handles = {level: self.by_level[level].launch(reqs, f"{name}.{level}")
                   for level, reqs in by.items() if reqs}
        return [(level, i, handles[level]) for level, i in where]

    def wait(self, handles: Sequence[Tuple[str, int, Any]]) -> Tuple[Any, ...]:
        for t in self.by_level.values():  # issue every level's deferred stages before blocking on one
            t.launch((), "flush")
        got: Dict[int, Tuple[Any, ...]] = {}
        for level, _, hs in handles:
            if id(hs) not in got:
                got[id(hs)] = self.by_level[level].wait(hs)
        return tuple(got[id(hs)][i] for _, i, hs in handles)

    def poll(self, handles) -> bool:
        return all(self.by_level[level].poll(hs) for level, _, hs in handles)

    @contextlib.contextmanager
    def batch(self):
        with contextlib.ExitStack() as stack:
            for t in self.by_level.values():
                stack.enter_context(t.batch())
            yield self



def two_level_transport(transport, topology: Topology, choose_routes: bool = False):
    """``transport`` itself when ``topology`` is flat, else a ``TwoLevelTransport`` over it and the
    node and cross-node groups, made here (every rank makes every group, in the same order): on
    torch.distributed process groups (``dist_collectives.new_subgroups``), on Horovod process sets
    (``collectives.process_sets``: the ones ``hvdcompress.torch.init`` registered, or added now
    where Horovod allows it), choosing flat or two-level per group with ``choose_routes``
    (``RouteChoice``; else every group two-level). ValueError otherwise, raised by every rank
    before any collective (``arguments.check_topology`` says which topologies run where)."""
    if topology.flat:
        return transport
    from .collectives import Communicator
    from .dist_collectives import TorchDistCommunicator, new_subgroups
    if not isinstance(transport, (TorchDistCommunicator, Communicator)):
        raise ValueError(f"topology={topology}: a two-level exchange runs on torch.distributed (backend='torch', "
                         f"or the DDP hook) or Horovod; this transport is {type(transport).__name__}. Accepted "
                         "here: topology='flat' (or None)")
    if topology.world != transport.size():
        raise ValueError(f"topology={topology}: a layout of {topology.world} ranks, but the process group has "
                         f"{transport.size()}")
    rank = transport.rank()
    layout = topology.local_groups() + topology.cross_groups()
    if isinstance(transport, Communicator):
        from .collectives import process_sets
        sets = process_sets(layout)
        local, cross = sets[topology.node_of(rank)], sets[topology.nodes + topology.local_rank(rank)]
        return TwoLevelTransport(transport, Communicator(local), Communicator(cross), topology, choose_routes)
    groups = new_subgroups(layout, transport.group)
    local = groups[topology.node_of(rank)]
    cross = groups[topology.nodes + topology.local_rank(rank)]
    return TwoLevelTransport(transport, TorchDistCommunicator(local), TorchDistCommunicator(cross), topology,
                             choose_routes)


class RouteChoice:
    """Flat or two-level, per group, for the groups of a ``TwoLevelTransport`` (its
    ``route_choice``), as decided from reduced numbers, so alike on every rank:

    1. until a cost model is fitted every group goes flat (the profiled steps time the flat
       exchange, which the scheduler's one-link model describes);
    2. ``fit``: the scheduler's calibrated flat model plus a fit of each hop timed here
       (``torch_ops.profiling.profile_hops``: the node's ranks, the cross-node peers; rank 0's
       fits, broadcast), or the hops of a ``TwoLevelCostModel`` the user gave;
    3. ``assign``: per group, the route ``hvdcompress.schedule.twolevel.choose_routes`` predicts
       faster for the spec the group is sent with;
    4. ``start_trial`` / ``trial_step``: the measured validation, once the scheduler has kept a
       plan: the model's routes, all flat, all two-level (``route_trials``), each for a settling
       step and ``tune_steps`` measured steps in a row; the step times gathered, every rank keeps
       the same one (``tuning.select``: the model's unless another is faster beyond the measured
       noise).

    The optimizer's scheduler drives these steps (``torch_ops.scheduling``); the DDP hook drives
    them from its buckets (``torch_ops.ddp_hook``: fit after the first step, ``assign`` whenever the
    buckets change, saying each bucket's members first with ``sees``).

    State per route: error-feedback state (residuals, momenta, velocities: every floating entry
    as large as the tensor) is a sum over ranks on both routes. Flat, each rank holds what it held
    back of the whole tensor; two-level, local rank l holds what its node held back of part l,
    zeros elsewhere. A group that switches to flat keeps its state as it is (the sum is the same);
    a group whose first exchange on the two-level route follows a flat one (or a regrouping)
    reduce-scatters that state inside the node with its gradient (``two_level_exchange(fold=True)``),
    so nothing held back is lost or counted twice. Entries of another size (PowerSGD's ``q``) are
    kept as they are."""

    def __init__(self, transport: "TwoLevelTransport"):
        self.transport = transport
        self.model: Optional[TwoLevelCostModel] = None
        self.given: Optional[TwoLevelCostModel] = None  # hops the user gave (cost_model=TwoLevelCostModel)
        self.routes: Dict[str, str] = {}  # group key -> route in use
        self.modelled: Dict[str, str] = {}  # group key -> the model's route
        self.specs: Dict[str, str] = {}  # group key -> the spec it is sent with
        self.record: Optional[dict] = None  # the last measured validation
        self._keys: Tuple[str, ...] = ()  # the groups in use, launch order
        self._members: Dict[str, Tuple[str, ...]] = {}  # group key -> its members, as assigned
        self._last: Dict[str, str] = {}  # group key -> route of its last exchange (this grouping)
        self._labels: Dict[str, str] = {}
        self._trial: Optional[dict] = None

    # -- the runtime ------------------------------------------------------------------------------
    def route_of(self, key: str) -> str:
        return self.routes.get(key, FLAT)

    def take(self, key: str) -> Tuple[str, bool]:
        """(route, fold) of the exchange of group ``key`` starting now (fold: its state must be
        reduce-scattered first: see the class doc)."""
        route = self.route_of(key)
        fold = route == TWO_LEVEL and self._last.get(key) != TWO_LEVEL
        self._last[key] = route
        spec = self.specs.get(key)
        self._labels[key] = route if spec is None else label(Route(route), spec)
        return route, fold

    def sees(self, key: str, members: Sequence[str]) -> None:
        """Group ``key`` starts with these members. A key names its first member and their count,
        so a front end whose groups change between steps without a new ``assign`` (DDP's
        buckets, rebuilt after the first step) says who is in it: where the key was assigned with
        other members, the group goes flat until the next ``assign`` (``groups`` still names the
        assigned members, so the caller sees the change) and its layout is forgotten (its first
        two-level exchange folds)."""
        members = tuple(members)
        if self._members.get(key, members) != members:
            self.routes.pop(key, None)
            self._last.pop(key, None)

    @property
    def groups(self) -> Tuple[Tuple[str, ...], ...]:
        """The members of each group assigned (``assign``), launch order."""
        return tuple(self._members[k] for k in self._keys)

    def take_labels(self) -> Dict[str, str]:
        out, self._labels = self._labels, {}
        return out

    # -- the decision -----------------------------------------------------------------------------
    @property
    def validating(self) -> bool:
        return self._trial is not None

    def fit(self, flat_model, max_bytes: Optional[float] = None, device=None) -> TwoLevelCostModel:
        """The two-level cost model: ``flat_model`` (the scheduler's, world-sized) and each hop's
        fit (given, else timed now on ``device``, the gradients': a collective on every rank, at the
        same step)."""
        t = self.transport
        if self.given is not None:
            intra, inter, nics = self.given.intra, self.given.inter, self.given.nics_per_node
        else:
            from .profiling import profile_hops
            hops = profile_hops(t.local, t.cross, t.topology, max_bytes, world=t.world, device=device)
            intra, inter, nics = hops["intra"], hops["inter"], t.topology.local_size  # timed all at once
        self.model = TwoLevelCostModel(t.topology, flat_model, intra, inter, nics)
        return self.model

    def assign(self, groups: Sequence[Sequence[str]], sizes_bytes: Sequence[float], specs: Sequence[str]) -> None:
        """The groups in use from the next step on (names, bytes, the spec each is sent with):
        the model's route for each; without a fitted model, the route a group already has (as
        after a resume), else flat."""
        groups = tuple(tuple(g) for g in groups)
        keys = tuple(MergedGroup(g, ((1,),) * len(g)).key for g in groups)
        members = dict(zip(keys, groups))
        if set(keys) != set(self._keys):  # a regrouping: the groups that stayed keep their layout
            self._last = {k: r for k, r in self._last.items() if k in keys}
        # a key now naming other members (the same first member and count) is another group
        self._last = {k: r for k, r in self._last.items() if self._members.get(k, members.get(k)) == members.get(k)}
        self._keys, self._members = keys, members
        self.specs = dict(zip(keys, map(str, specs)))
        if self.model is None:
            self.routes = {k: self.routes.get(k, FLAT) for k in keys}
            return
        picked = choose_routes(self.model, sizes_bytes, specs)
        self.modelled = {k: d.best.candidate.route.layout for k, d in zip(keys, picked)}
        self.routes = dict(self.modelled)

    def start_trial(self, tune_steps: int) -> None:
        """The measured validation of the routes of the groups in use (class doc); nothing when
        there is nothing to choose between or no step to measure."""
        trials = route_trials([self.routes[k] for k in self._keys]) if self._keys else []
        if tune_steps < 1 or len(trials) < 2:
            return
        self._trial = {"trials": trials, "index": 0, "step": 0, "tune_steps": int(tune_steps),
                       "times": [[] for _ in trials], "keys": list(self._keys)}
        self._apply(trials[0][1])

    def trial_step(self, step_seconds: float, comm) -> bool:
        """One step of the measured validation; True when it decided (the same step on every rank)."""
        t = self._trial
        if t["step"] > 0:  # the first step of each trial settles it (a fold, caches), uncounted
            t["times"][t["index"]].append(float(step_seconds))
        t["step"] += 1
        if t["step"] <= t["tune_steps"]:
            return False
        t["index"], t["step"] = t["index"] + 1, 0
        if t["index"] < len(t["trials"]):
            self._apply(t["trials"][t["index"]][1])
            return False
        per_rank = comm.allgather_object(t["times"], "hvc.routes.times")
        times = tuning.step_times(per_rank)
        kept, medians = tuning.select(times, noise_z=tuning.NOISE_Z)
        self._apply(t["trials"][kept][1])
        self.record = {"trials": [{"label": name, "routes": dict(zip(t["keys"], r))} for name, r in t["trials"]],
                       "medians_seconds": medians, "kept": kept, "kept_label": t["trials"][kept][0],
                       "step_noise": tuning.step_noise(times)}
        self._trial = None
        return True

    def _apply(self, routes: Sequence[str]) -> None:
        self.routes = dict(zip(self._keys, routes))

    def summary(self) -> str:
        """One line: how many groups go each way, and what the validation kept."""
        counts: Dict[str, int] = {}
        for k in self._keys:
            counts[self.route_of(k)] = counts.get(self.route_of(k), 0) + 1
        text = "routes: " + ", ".join(f"{n} {r}" for r, n in sorted(counts.items()))
        if self.record is not None:
            text += f" (measured: kept {self.record['kept_label']})"
        return text

    # -- checkpoints -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The routes in use and the model's, and the last validation (a validation in progress
        is not saved: a resumed run keeps the routes in use when it was saved)."""
        return {"routes": dict(self.routes), "modelled": dict(self.modelled), "record": self.record}

    def load(self, saved: Optional[dict]) -> None:
        if not saved:
            return
        self.routes, self.modelled = dict(saved["routes"]), dict(saved.get("modelled", {}))
        self.record, self._trial, self._last = saved.get("record"), None, {}
        self._keys, self._members = (), {}  # the groups are assigned again
