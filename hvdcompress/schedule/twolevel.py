"""Two link classes: an exchange's cost, hop by hop, on nodes of L ranks joined by slower links.

A cluster of N nodes of L ranks (``hvdcompress.topology.Topology``) has fast links inside a node
(NVLink, PCIe, shared memory) and slow ones between nodes (Ethernet). A group of m bytes (d
elements) can travel two ways (``Route``):

``flat``
    today's exchange: every rank runs the spec's exchange with all P = N*L ranks. A ring over P
    ranks numbered node by node crosses each node boundary once per direction, so each of its
    steps waits for the slow link: the one-link ``CostModel`` of P ranks at the inter-node rate.
    This is exactly what the planner and ``advise`` predict today for P workers on that link.
``two-level``
    1. inside the node, a reduce-scatter of the dense gradient (``inside="none"``) or of its fp16
       cast (``inside="fp16"``) over the intra link: local rank l holds the node's sum of slice l
       (1/L of the gradient);
    2. local rank l runs the spec's exchange on its slice with the ranks at position l on the
       other nodes (N ranks, inter link): encode and decode on d/L elements;
    3. inside the node, an allgather of the exchanged slices.
    With spec ``none`` this is Horovod's hierarchical allreduce (NCCL reduce-scatter, cross-node
    allreduce of each local rank's chunk, NCCL allgather).

Costs per group (``TwoLevelCostModel.hops``)::

    flat        cpu = t_s(d)       comm = the flat model's t_c(d) at P ranks
    two-level   cpu = t_s(d/L) [+ t_s of the fp16 cast of d] + 2 launches
                intra = ring reduce-scatter + ring allgather of m' at L ranks (the intra model's
                        allreduce fit: a ring allreduce is exactly the two; m' = m or m/2 for fp16)
                inter = t_c(d/L) of the spec at N ranks on the *shared* inter link (below)

ASSUMED, where no measurement says otherwise: the L cross-node exchanges of a node run at the
same time and share the node's NICs fairly, so each sees ``share = max(1, L / nics_per_node)``
times the inter link's seconds per byte (a rank never drives more than one NIC); the latency per
hop is unchanged. The inter model is the link as one rank alone sees it; a model timed with all
L cross groups running at once already holds the sharing: give it with ``nics_per_node=L``.

Sparse aggregation (``aggregate="gtopk"``, for top-k and DGC): in place of the allgather of every
rank's (indices, values), a global top-k by recursive doubling (gTop-k, Shi et al., ICDCS 2019,
arXiv:1901.04359): ``gtopk_rounds(W)`` pairwise rounds in each of which a rank sends or receives
one selection of k indices and k values, merges and keeps the top k; the busiest rank sends
``gtopk_wire_bytes``, O(k log W) instead of the allgather's O(k W). A round is charged one hop of the model's ring
(``hop_fit``); the merge and re-selection of 2k entries is not charged.

Bytes (``Hops.intra_bytes`` / ``inter_bytes``): what one worker sends per exchange over each link
class, averaged over the L workers of a node (ring algorithms send what they receive): a ring
allreduce of b bytes on W ranks sends 2(W-1)/W b per rank, a ring allgather (W-1) b, gTop-k
``gtopk_rounds(W)`` b. In a flat ring one of a node's L workers sends across the node boundary,
the others inside it. A node's NICs send L x ``inter_bytes``.

``RouteCostModel`` is a route seen as a ``CostModel`` (the methods the planner calls), so
``make_plan`` plans a fixed route unchanged; ``plan_routes`` chooses a route and spec per group
jointly with the partition (``search.optimal_choice``); ``choose`` does it for one group alone,
and ``choose_routes`` (flat or two-level for each group of a kept plan) with ``route_trials``
(what its measured validation runs) are what the runtime uses (``torch_ops.twolevel.RouteChoice``).
Everything here is a PREDICTION of the cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..contract import LAYERWISE
from ..spec import GATHERED, resolve
from ..topology import Topology
from .costmodel import CostModel, LinearFit, rounds
from .search import Option, optimal_choice, predict_choice
from .timeline import Timeline, check_inputs, check_overlap

FLAT, TWO_LEVEL = "flat", "two-level"
LAYOUTS = (FLAT, TWO_LEVEL)
INSIDE = ("none", "fp16")
GATHER, GTOPK = "gather", "gtopk"
AGGREGATES = (GATHER, GTOPK)
GTOPK_SPECS = ("topk", "dgc")  # specs whose gathered rounds are k indices + k values


# --- sparse aggregation: a global top-k by recursive doubling --------------------------------------
def gtopk_rounds(world: int) -> int:
    """Pairwise rounds the busiest rank of a recursive-doubling global top-k takes on ``world``
    ranks: log2 of the largest power of two p <= world, plus 2 when world is not a power of two
    (each rank beyond p first hands its selection to a partner below p and gets the result back)."""
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ValueError(f"gtopk_rounds: world must be an integer >= 1; got {world!r}")
    world = int(world)
    if world == 1:
        return 0
    p = world.bit_length() - 1
    return p + (0 if world == 1 << p else 2)


def gtopk_wire_bytes(payload_bytes, world: int):
    """The most bytes one worker sends (or receives) in a gTop-k exchange whose selection is
    ``payload_bytes`` (k indices + k values; array ok) on ``world`` ranks: one selection per
    pairwise round, log2 p of them, plus the fold (received) or unfold (sent) where world is not a
    power of two: O(k log P)."""
    rounds_taken = gtopk_rounds(world)
    return (rounds_taken - 1 if rounds_taken and world & (world - 1) else rounds_taken) * \
        np.asarray(payload_bytes, dtype=float)


def hop_fit(model: CostModel) -> LinearFit:
    """One hop of the model's ring: seconds to send m bytes to one neighbour. The ring
    allgather's fit a + b*W*m is W-1 such hops, so a hop is a/(W-1) + b*W/(W-1) * m."""
    w = model.world_size
    if w < 2:
        return LinearFit(0.0, 0.0)
    return LinearFit(model.allgather.alpha / (w - 1), model.allgather.beta * w / (w - 1))


def ring_wire_bytes(kind: str, nbytes, world: int):
    """Bytes one rank sends in a ring collective on ``world`` ranks contributing ``nbytes``."""
    nbytes = np.asarray(nbytes, dtype=float)
    if kind == GATHERED:
        return (world - 1) * nbytes
    return 2.0 * (world - 1) / world * nbytes


# --- routes --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """How a group travels: ``layout`` flat or two-level, the dense codec ``inside`` a node
    (two-level only: "none" or "fp16") and the sparse ``aggregate`` across ("gather": the spec's
    own exchange; "gtopk": a global top-k, top-k and DGC only)."""

    layout: str = FLAT
    inside: str = "none"
    aggregate: str = GATHER

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"route: layout must be one of {', '.join(LAYOUTS)}; got {self.layout!r}")
        if self.inside not in INSIDE:
            raise ValueError(f"route: inside must be one of {', '.join(INSIDE)}; got {self.inside!r}")
        if self.layout == FLAT and self.inside != "none":
            raise ValueError(f"route: inside={self.inside!r} needs layout='two-level' (a flat exchange has no "
                             "hop inside a node)")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"route: aggregate must be one of {', '.join(AGGREGATES)}; got {self.aggregate!r}")

    def check(self, spec) -> None:
        """ValueError where ``spec`` cannot take this route (gTop-k is for top-k and DGC)."""
        spec = resolve(spec)
        if self.aggregate == GTOPK and spec.name not in GTOPK_SPECS:
            raise ValueError(f"route: aggregate='gtopk' applies to {', '.join(GTOPK_SPECS)}; got spec '{spec}'")

    def as_dict(self) -> dict:
        return {"layout": self.layout, "inside": self.inside, "aggregate": self.aggregate}


HIERARCHICAL = Route(TWO_LEVEL)


def label(route: Route, spec) -> str:
    """A route and spec as a person reads them: "flat dense", "hierarchical dense",
    "flat dgc:ratio=0.001", "two-level qsgd (fp16 inside)", "... gtopk"."""
    spec = resolve(spec)
    if spec.name == "none":
        text = "flat dense" if route.layout == FLAT else "hierarchical dense" + (
            "" if route.inside == "none" else f" ({route.inside} inside)")
    else:
        text = f"{route.layout} {spec_label(spec)}"
        if route.layout == TWO_LEVEL:
            text += f" ({'dense' if route.inside == 'none' else route.inside} inside)"
    return text + (", gtopk" if route.aggregate == GTOPK else "")


def spec_label(spec) -> str:
    """A spec as a person writes it: its name, its main knob (ratio, rank, levels) and the
    parameters that differ from the defaults."""
    spec = resolve(spec)
    defaults = {p.name: p.default for p in spec.info.params}
    changed = [f"{k}={v}".lower() for k, v in spec.params.items()
               if k in defaults and (v != defaults[k] or k in ("ratio", "rank", "levels"))]
    return spec.name + (":" + ",".join(changed) if changed else "")


class Candidate(NamedTuple):
    """One way to send a group: a route and the spec it carries across."""

    route: Route
    spec: object

    @property
    def label(self) -> str:
        return label(self.route, self.spec)


def candidates(spec, topology: Topology, inside: Sequence[str] = INSIDE, gtopk: bool = False) -> List[Candidate]:
    """The ways to send a group with ``spec`` (or dense), dense and flat first: flat dense,
    hierarchical dense, flat spec, two-level spec with each dense codec ``inside``, and with
    ``gtopk`` (top-k, DGC) the same with the global top-k across. A flat topology (one node, or
    one rank per node) has the flat ones only."""
    spec = resolve(spec)
    none = resolve("none")
    two = not topology.flat
    out = [Candidate(Route(), none)] + ([Candidate(HIERARCHICAL, none)] if two else [])
    if spec.name == "none":
        return out
    aggregates = [GATHER] + ([GTOPK] if gtopk and spec.name in GTOPK_SPECS else [])
    for agg in aggregates:
        out.append(Candidate(Route(FLAT, aggregate=agg), spec))
        if two:
            out += [Candidate(Route(TWO_LEVEL, c, agg), spec) for c in inside]
    return out


# --- the model -------------------------------------------------------------------------------------
class Hops(NamedTuple):
    """Per group (arrays over group sizes): seconds on the compute stream before the exchange
    (encode, launches), on the intra-node and inter-node hops, to decode after it; bytes one
    worker sends over each link class (averaged over a node's workers)."""

    cpu: np.ndarray
    intra: np.ndarray
    inter: np.ndarray
    decompress: np.ndarray
    intra_bytes: np.ndarray
    inter_bytes: np.ndarray

    @property
    def comm(self) -> np.ndarray:
        return self.intra + self.inter

    @property
    def seconds(self) -> np.ndarray:
        """The group sent alone: encode, both hops, decode."""
        return self.cpu + self.intra + self.inter + self.decompress


def _shared(model: CostModel, share: float) -> CostModel:
    """``model`` with every per-byte term ``share`` times larger (a link shared by that many)."""
    if share == 1.0:
        return model

    def slower(fit: Optional[LinearFit]) -> Optional[LinearFit]:
        return None if fit is None else LinearFit(fit.alpha, fit.beta * share, fit.rel_rmse, fit.samples)
    return replace(model, allreduce=slower(model.allreduce), allgather=slower(model.allgather),
                   allreduce_half=slower(model.allreduce_half), meta=dict(model.meta, nic_share=share))


@dataclass(frozen=True)
class TwoLevelCostModel:
    """Costs on ``topology``: ``flat`` (all P ranks: today's one-link model, whose compression
    fits, launch cost and exchange skew every route uses), ``intra`` (the L ranks of a node) and
    ``inter`` (N ranks, one per node, one rank alone on its NIC); ``nics_per_node`` for the
    sharing (module doc). World sizes must match the topology."""

    topology: Topology
    flat: CostModel
    intra: CostModel
    inter: CostModel
    nics_per_node: int = 1
    cross: CostModel = field(init=False, repr=False, compare=False)  # inter as L ranks share it

    def __post_init__(self):
        if not isinstance(self.topology, Topology):
            raise ValueError(f"two-level cost model: topology must be a hvdcompress.topology.Topology; "
                             f"got {self.topology!r}")
        t = self.topology
        for name, want in (("flat", t.world), ("intra", t.local_size), ("inter", t.nodes)):
            got = getattr(self, name).world_size
            if got != want:
                raise ValueError(f"two-level cost model: {name} must be a CostModel of world_size {want} on "
                                 f"topology {t} ({t.nodes} nodes x {t.local_size} ranks); got world_size {got}")
        n = self.nics_per_node
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"two-level cost model: nics_per_node must be an integer >= 1; got {n!r}")
        object.__setattr__(self, "cross", _shared(self.inter, self.share))

    @property
    def share(self) -> float:
        """How many of a node's cross-node exchanges share one NIC: max(1, L / nics_per_node)."""
        return max(1.0, self.topology.local_size / self.nics_per_node)

    @property
    def world_size(self) -> int:
        return self.topology.world

    @classmethod
    def from_links(cls, nodes: int, local_size: int, intra_gbps: float, inter_gbps: float,
                   intra_latency_s: float = 2e-6, inter_latency_s: float = 50e-6, nics_per_node: int = 1,
                   compress=None, decompress=None) -> "TwoLevelCostModel":
        """Ideal rings (``CostModel.from_link``) on both link classes; the flat model is the ring
        of all ranks at the inter-node rate and latency, the one ``advise --gbps`` builds."""
        for name, v in (("nodes", nodes), ("local_size", local_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"two-level cost model: {name} must be an integer >= 1; got {v!r}")
        topo = Topology(int(nodes) * int(local_size), int(local_size))
        flat = CostModel.from_link(topo.world, inter_gbps, inter_latency_s, compress)
        if decompress:
            flat = replace(flat, decompress=decompress)
        return cls(topo, flat, CostModel.from_link(topo.local_size, intra_gbps, intra_latency_s),
                   CostModel.from_link(topo.nodes, inter_gbps, inter_latency_s), nics_per_node)

    @classmethod
    def from_model(cls, model: CostModel, topology: Topology, intra_gbps: float, intra_latency_s: float,
                   gbps: Optional[float] = None, latency_s: Optional[float] = None,
                   nics_per_node: int = 1) -> "TwoLevelCostModel":
        """A fitted (or hand-built) one-link ``model`` carried by ring scaling to the flat world
        and to the cross groups (``CostModel.for_world_size``, optionally at ``gbps`` /
        ``latency_s``); the intra link an ideal ring of ``intra_gbps`` and ``intra_latency_s``."""
        def carried(world):
            if world == model.world_size and gbps is None and latency_s is None:
                return model
            return model.for_world_size(world, gbps, latency_s)
        intra = CostModel.from_link(topology.local_size, intra_gbps, intra_latency_s)
        return cls(topology, carried(topology.world), intra, carried(topology.nodes), nics_per_node)

    # -- per group ------------------------------------------------------------------------------
    def _resolved(self, route: Route, spec):
        """(route, spec) checked; a two-level route on a flat topology is the flat one."""
        spec = resolve(spec)
        route.check(spec)
        if route.layout == TWO_LEVEL and self.topology.flat:  # one node, or one rank per node
            route = Route(FLAT, aggregate=route.aggregate)
        return route, spec

    def comm(self, route: Route, spec, dense_bytes, itemsize: int = 4, density: Optional[float] = None):
        """(intra seconds, inter seconds, intra bytes, inter bytes) of a group's exchange (module doc)."""
        route, spec = self._resolved(route, spec)
        m = np.asarray(dense_bytes, dtype=float)
        L = self.topology.local_size
        if route.layout == FLAT:
            seconds, sent = self._across(route, spec, m, itemsize, density, self.flat)
            return np.zeros_like(m), seconds, sent * (L - 1) / L, sent / L  # one of a node's L workers sends across
        inner = m / 2 if route.inside == "fp16" else m
        intra = self.intra.summed_fit(route.inside == "fp16")(inner)
        seconds, sent = self._across(route, spec, np.ceil(m / itemsize / L) * itemsize, itemsize, density, self.cross)
        return intra, seconds, ring_wire_bytes("allreduce", inner, L), sent

    def cpu(self, route: Route, spec, dense_bytes, itemsize: int = 4):
        """Seconds on the compute stream before the exchange: encode (of the slice, two-level; and
        the fp16 cast of the whole with fp16 inside) and the launch of every collective."""
        route, spec = self._resolved(route, spec)
        m = np.asarray(dense_bytes, dtype=float)
        flat = self.flat
        if route.layout == FLAT:
            return flat.group_cpu_seconds(spec, m, itemsize)
        part = np.ceil(m / itemsize / self.topology.local_size) * itemsize
        out = flat.group_cpu_seconds(spec, part, itemsize) + 2 * flat.launch_seconds  # reduce-scatter, allgather
        if route.inside == "fp16" and flat.has_compress_fit("fp16"):
            out = out + flat.compress_seconds("fp16", m, itemsize)
        return out

    def decompress(self, route: Route, spec, dense_bytes, itemsize: int = 4):
        """Seconds to decode the exchange's results (of the slice, two-level); 0 without a fit."""
        route, spec = self._resolved(route, spec)
        m = np.asarray(dense_bytes, dtype=float)
        if route.layout == TWO_LEVEL:
            m = np.ceil(m / itemsize / self.topology.local_size) * itemsize
        return self.flat.decompress_seconds(spec, m, itemsize)

    def hops(self, route: Route, spec, dense_bytes, itemsize: int = 4, density: Optional[float] = None) -> Hops:
        """The group's costs per hop (module doc) for ``dense_bytes`` (array ok)."""
        intra, inter, intra_bytes, inter_bytes = self.comm(route, spec, dense_bytes, itemsize, density)
        return Hops(self.cpu(route, spec, dense_bytes, itemsize), intra, inter,
                    self.decompress(route, spec, dense_bytes, itemsize), intra_bytes, inter_bytes)

    def _across(self, route: Route, spec, nbytes, itemsize: int, density, model: CostModel):
        """(seconds, bytes one rank sends) of the spec's exchange of ``nbytes`` on ``model``'s ranks."""
        w = model.world_size
        if w < 2:
            z = np.zeros_like(nbytes)
            return z, z
        rs = rounds(spec, nbytes / itemsize, itemsize, density, w)
        if route.aggregate == GATHER:
            sent = sum((ring_wire_bytes(r.kind, r.nbytes, w) for r in rs), np.zeros_like(nbytes))
            return model.comm_seconds(spec, nbytes, None, itemsize, density), sent
        seconds, sent = np.zeros_like(nbytes), np.zeros_like(nbytes)
        steps, hop = gtopk_rounds(w), hop_fit(model)
        for r in rs:
            if r.kind == GATHERED:  # per pairwise round: k indices and k values to the partner
                seconds = seconds + steps * (r.collectives * hop.alpha + hop.beta * r.nbytes)
                sent = sent + gtopk_wire_bytes(r.nbytes, w)
            else:
                fit = model.summed_fit(getattr(r, "half", False))
                seconds = seconds + r.collectives * fit.alpha + fit.beta * r.nbytes
                sent = sent + ring_wire_bytes(r.kind, r.nbytes, w)
        return seconds, sent

    def seconds(self, route: Route, spec, dense_bytes, itemsize: int = 4) -> np.ndarray:
        """A group sent alone by ``route``: encode, both hops, decode."""
        return self.hops(route, spec, dense_bytes, itemsize).seconds

    def for_route(self, route: Route):
        """The planner's view of one route: the flat model itself for the flat gathered route
        (every figure as today), else a ``RouteCostModel``."""
        if route == Route() or (self.topology.flat and route.aggregate == GATHER):
            return self.flat
        return RouteCostModel(self, route)


@dataclass(frozen=True)
class RouteCostModel:
    """A route of a ``TwoLevelCostModel`` with the methods the planner calls on a ``CostModel``
    (``make_plan``, ``timeline``): t_c is the route's two hops, t_s its encode and launches, t_d
    its decode. Every collective pays its fitted start-up (no separate step start-ups)."""

    model: TwoLevelCostModel
    route: Route
    start_ups = None

    @property
    def world_size(self) -> int:
        return self.model.world_size

    @property
    def exchange_skew(self) -> float:
        return self.model.flat.exchange_skew

    def _check_world(self, world_size: Optional[int]) -> None:
        if world_size not in (None, self.world_size):
            raise ValueError(f"route cost model: planned for world_size {self.world_size} (topology "
                             f"{self.model.topology}); got world_size {world_size}")

    def has_compress_fit(self, spec) -> bool:
        return self.model.flat.has_compress_fit(spec)

    def has_decompress_fit(self, spec) -> bool:
        return self.model.flat.has_decompress_fit(spec)

    def exchange_seconds(self, spec, dense_bytes, world_size: Optional[int] = None, itemsize: int = 4,
                         density: Optional[float] = None):
        self._check_world(world_size)
        intra, inter, _, _ = self.model.comm(self.route, spec, dense_bytes, itemsize, density)
        return intra + inter

    def comm_seconds(self, spec, dense_bytes, world_size: Optional[int] = None, itemsize: int = 4,
                     density: Optional[float] = None, start_up: Optional[float] = None):
        return self.exchange_seconds(spec, dense_bytes, world_size, itemsize, density)

    def tensor_comm_seconds(self, spec, shape, world_size: Optional[int] = None, itemsize: int = 4,
                            start_up: Optional[float] = None) -> float:
        """A tensor's exchange by its element count (the two-level exchange sends flat slices)."""
        return float(self.exchange_seconds(spec, float(math.prod(shape)) * itemsize, world_size, itemsize))

    def group_cpu_seconds(self, spec, dense_bytes, itemsize: int = 4):
        return self.model.cpu(self.route, spec, dense_bytes, itemsize)

    def decompress_seconds(self, spec, dense_bytes, itemsize: int = 4):
        return self.model.decompress(self.route, spec, dense_bytes, itemsize)

    def closing_seconds(self, spec, dense_bytes, world_size: Optional[int] = None, itemsize: int = 4,
                        density: Optional[float] = None):
        """``exchange_skew`` x (the route's encode + its two hops), as ``CostModel.closing_seconds``."""
        t_c = self.exchange_seconds(spec, dense_bytes, world_size, itemsize, density)
        if not self.exchange_skew:
            return np.zeros_like(t_c)
        return self.exchange_skew * (t_c + self.group_cpu_seconds(spec, dense_bytes, itemsize))


# --- decisions ---------------------------------------------------------------------------------------
class Choice(NamedTuple):
    candidate: Candidate
    seconds: float
    hops: Hops


class Decision(NamedTuple):
    """The fastest way to send one group alone (``best``), and every candidate's time."""

    best: Choice
    options: Tuple[Choice, ...]


def choose(model: TwoLevelCostModel, spec, dense_bytes: float, options: Optional[Sequence[Candidate]] = None,
           itemsize: int = 4, within: float = 0.0) -> Decision:
    """Per group: the candidate (``candidates(spec, topology)`` unless given) that sends a group of
    ``dense_bytes`` alone fastest (encode, both hops, decode); among those within ``within`` of the
    fastest, the first in the candidates' order (dense and flat first: the simplest as fast)."""
    opts = list(options) if options is not None else candidates(spec, model.topology)
    if not opts:
        raise ValueError("choose: at least one candidate is needed")
    scored = []
    for c in opts:
        h = model.hops(c.route, c.spec, np.array([float(dense_bytes)]), itemsize)
        scored.append(Choice(c, float(h.seconds[0]), Hops(*(np.asarray(x)[0] for x in h))))
    best = min(s.seconds for s in scored)
    return Decision(next(s for s in scored if s.seconds <= best * (1 + within)), tuple(scored))


@dataclass(frozen=True)
class RoutePlan:
    """A partition of the tensors (backward order) with a route and spec per group, and its
    modelled timeline (``plan_routes``)."""

    groups: List[List[int]]
    choices: List[Candidate]
    predicted_seconds: float
    timeline: Timeline
    gap: Optional[float]

    def counts(self) -> dict:
        out = {}
        for c in self.choices:
            out[c.label] = out.get(c.label, 0) + 1
        return out

    def as_dict(self) -> dict:
        return {"groups": self.groups, "predicted_seconds": self.predicted_seconds, "gap": self.gap,
                "choices": [{"label": c.label, "spec": str(c.spec), **c.route.as_dict()} for c in self.choices]}


def plan_routes(sizes_bytes: Sequence[float], t_b: Sequence[float], model: TwoLevelCostModel, spec,
                options: Optional[Sequence[Candidate]] = None, overlap: str = "shared",
                forward_seconds: float = 0.0, update_seconds: float = 0.0, itemsize: int = 4,
                cuts: Optional[Sequence[int]] = None) -> RoutePlan:
    """The partition and, per group, the candidate (route and spec; ``candidates(spec, topology)``
    unless given) of least modelled step, chosen jointly by ``search.optimal_choice`` as the
    planner's per-group codec choice is. A spec that never merges (``merge=LAYERWISE``) is given
    groups of one tensor only. Every candidate's spec needs a compression-time fit (none excepted)."""
    check_overlap(overlap)
    sizes, t_b = check_inputs(sizes_bytes, t_b)
    opts = list(options) if options is not None else candidates(spec, model.topology)
    if not opts:
        raise ValueError("plan_routes: at least one candidate is needed")
    missing = sorted({str(c.spec) for c in opts if not model.flat.has_compress_fit(c.spec)})
    if missing:
        raise ValueError(f"plan_routes: no compression-time fit for {', '.join(missing)} (profile it, or add a "
                         "ComputeFit to the flat model)")
    built, t_d = [], []
    for c in opts:
        c.route.check(c.spec)
        view = model.for_route(c.route)
        s = resolve(c.spec)

        def t_s(b, view=view, s=s):
            return view.group_cpu_seconds(s, b, itemsize)

        def t_c(b, view=view, s=s):
            return view.exchange_seconds(s, b, None, itemsize)

        t_close = None
        if view.exchange_skew:
            def t_close(b, view=view, s=s):
                return view.closing_seconds(s, b, None, itemsize)
        built.append(Option(t_s, t_c, t_close, s.info.merge != LAYERWISE))
        t_d.append((lambda b, view=view, s=s: view.decompress_seconds(s, b, itemsize))
                   if view.has_decompress_fit(s) else None)
    found = optimal_choice(sizes, t_b, built, overlap, cuts=cuts)
    timeline = predict_choice(found.groups, found.choices, sizes, t_b, built, overlap, t_d)
    return RoutePlan([list(g) for g in found.groups], [opts[i] for i in found.choices],
                     float(forward_seconds) + timeline.end + float(update_seconds), timeline,
                     found.gap if cuts is None else None)


def choose_routes(model: TwoLevelCostModel, sizes_bytes: Sequence[float], specs: Sequence,
                  itemsize: int = 4) -> List[Decision]:
    """Per group of ``sizes_bytes[i]`` bytes sent with ``specs[i]``: flat or two-level (dense
    inside), whichever sends it alone faster under ``model`` (``choose``; flat on a tie). The
    runtime's per-group route choice (``torch_ops.twolevel.RouteChoice``) starts from these."""
    if len(sizes_bytes) != len(specs):
        raise ValueError(f"choose_routes: one spec per group; got {len(sizes_bytes)} groups and {len(specs)} specs")
    out = []
    for b, s in zip(sizes_bytes, specs):
        s = resolve(s)
        out.append(choose(model, s, float(b), [Candidate(Route(), s), Candidate(HIERARCHICAL, s)], itemsize))
    return out


def route_trials(modelled: Sequence[str]) -> List[Tuple[str, Tuple[str, ...]]]:
    """The per-group route assignments a measured validation runs, as (label, layout per group):
    the model's (``modelled``, first), every group flat, every group two-level; duplicates dropped."""
    for r in modelled:
        if r not in LAYOUTS:
            raise ValueError(f"route_trials: a route must be one of {', '.join(LAYOUTS)}; got {r!r}")
    out: List[Tuple[str, Tuple[str, ...]]] = []
    for name, routes in (("model", tuple(modelled)), ("all " + FLAT, (FLAT,) * len(modelled)),
                         ("all " + TWO_LEVEL, (TWO_LEVEL,) * len(modelled))):
        if routes not in [r for _, r in out]:
            out.append((name, routes))
    return out


def step_bytes(model: TwoLevelCostModel, groups: Sequence[Sequence[int]], sizes_bytes: Sequence[float],
               choices: Sequence[Candidate], itemsize: int = 4) -> dict:
    """Bytes one worker sends per step over each link class (averaged over a node's workers), and
    a node's NICs across: ``{"intra": ..., "inter": ..., "inter_per_node": ...}``."""
    intra = inter = 0.0
    for g, c in zip(groups, choices):
        b = float(sum(sizes_bytes[i] for i in g))
        _, _, intra_b, inter_b = model.comm(c.route, c.spec, np.array([b]), itemsize)
        intra += float(intra_b[0])
        inter += float(inter_b[0])
    return {"intra": intra, "inter": inter, "inter_per_node": inter * model.topology.local_size}


__all__ = ["AGGREGATES", "Candidate", "Choice", "Decision", "FLAT", "GATHER", "GTOPK", "HIERARCHICAL", "Hops",
           "INSIDE", "LAYOUTS", "Route", "RouteCostModel", "RoutePlan", "TWO_LEVEL", "TwoLevelCostModel",
           "candidates", "choose", "choose_routes", "route_trials", "spec_label", "gtopk_rounds", "gtopk_wire_bytes", "hop_fit", "label", "plan_routes",
           "ring_wire_bytes", "step_bytes"]
