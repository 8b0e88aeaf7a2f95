"""Flat or two-level per group: the decision (pure: ``choose_routes``, ``route_trials``,
``chooses_routes``, ``RouteChoice`` with a stand-in world) and real 4-process Gloo runs as
2 nodes x 2 (tests/scenarios/twolevel_route.py): state conserved across route switches, each
held route equal to the plain transport's exchange, the model's pick per spec, the measured
validation alike on every rank, replicas identical every step; the same for the DDP hook's
buckets (``routes="auto"``), every exchange of its runs equal to the oracle's replay of its route
(folds included), and its checkpoint resumed exactly."""

import numpy as np
import pytest

from hvdcompress.schedule.costmodel import ComputeFit
from hvdcompress.schedule.groups import split_layout
from hvdcompress.schedule.twolevel import FLAT, TWO_LEVEL, TwoLevelCostModel, choose_routes, route_trials
from hvdcompress.spec import resolve
from hvdcompress.topology import Topology

DGC = "dgc:ratio=0.001"
QSGD = "qsgd:levels=3,bucket=64"
FITS = {DGC: ComputeFit("linear", 5e-11, 9e-4), QSGD: ComputeFit("linear", 3e-11, 1e-4),
        "none": ComputeFit("linear", 0.0, 0.0)}


def _links(intra=10.0, inter=0.1, inter_lat=1e-6):
    return TwoLevelCostModel.from_links(2, 2, intra, inter, 2e-6, inter_lat, 1, FITS)


# -- the decision, pure ------------------------------------------------------------------------------
def test_choose_routes_follows_the_payload_across():
    """A tiny payload across (DGC at 0.1%) gains nothing from the node's reduce-scatter: flat; a
    quantizer's (qsgd) and dense's shrink with the node's sum: two-level, where the node's link is fast."""
    got = choose_routes(_links(), [4e5, 4e5, 4e5], [DGC, QSGD, "none"])
    assert [d.best.candidate.route.layout for d in got] == [FLAT, TWO_LEVEL, TWO_LEVEL]
    slow_inside = choose_routes(_links(intra=0.05), [4e5], [QSGD])[0]
    assert slow_inside.best.candidate.route.layout == FLAT  # the inside hop now costs more than it saves
    assert [c.candidate.route.layout for c in got[0].options] == [FLAT, TWO_LEVEL]
    with pytest.raises(ValueError, match="one spec per group"):
        choose_routes(_links(), [1.0, 2.0], [DGC])


def test_route_trials_model_first_and_no_duplicates():
    assert route_trials([FLAT, TWO_LEVEL]) == [("model", (FLAT, TWO_LEVEL)), ("all flat", (FLAT, FLAT)),
                                               ("all two-level", (TWO_LEVEL, TWO_LEVEL))]
    assert route_trials([FLAT, FLAT]) == [("model", (FLAT, FLAT)), ("all two-level", (TWO_LEVEL, TWO_LEVEL))]
    with pytest.raises(ValueError, match="route must be one of"):
        route_trials(["ring"])


class _Compressor:
    returns_update = False


class _Adam:
    returns_update = True


def test_chooses_routes_on_the_default_path_and_with_the_codec_choice():
    from torch_ops.codec_choice import chooses_routes
    two, flat = Topology(4, 2), Topology(4, 4)
    assert chooses_routes(None, two, (), "auto", 3, _Compressor())  # the launcher's topology, default schedule
    assert chooses_routes("2x2", two, ("fp16", "none"), "auto", 3, _Compressor())  # codec choice on
    assert not chooses_routes("2x2", two, (), "auto", 3, _Compressor())  # explicit, choice off: all two-level
    assert not chooses_routes(None, two, (), "single", 3, _Compressor())  # nothing is measured
    assert not chooses_routes(None, two, (), "auto", 0, _Compressor())
    assert not chooses_routes(None, flat, ("fp16",), "auto", 3, _Compressor())  # one node
    assert not chooses_routes(None, two, ("fp16",), "auto", 3, _Adam())  # a variance is no sum over ranks


class _World:
    """Every rank's object is this one's (the ranks agree), as a stand-in world."""

    def __init__(self, ranks=4):
        self.ranks = ranks

    def allgather_object(self, obj, name):
        return [obj] * self.ranks


class _Transport:
    topology = Topology(4, 2)


def test_route_choice_assign_fold_trial_and_saved_form():
    from torch_ops.twolevel import RouteChoice
    choice = RouteChoice(_Transport())
    choice.assign([("a",), ("b", "c")], [4e5, 4e5], [DGC, QSGD])
    assert choice.routes == {"a": FLAT, "b+1": FLAT}  # no model yet: flat, as the profiled steps run
    choice.model = _links()
    choice.assign([("a",), ("b", "c")], [4e5, 4e5], [DGC, QSGD])
    assert choice.routes == choice.modelled == {"a": FLAT, "b+1": TWO_LEVEL}
    assert choice.take("b+1") == (TWO_LEVEL, True)  # first two-level exchange of the group: fold
    assert choice.take("b+1") == (TWO_LEVEL, False)
    assert choice.take("a") == (FLAT, False)
    assert choice.take_labels() == {"b+1": "two-level qsgd:levels=3,bucket=64 (dense inside)",
                                    "a": "flat dgc:ratio=0.001"}
    choice.assign([("a", "b", "c")], [8e5], [QSGD])  # a regrouping: the new group folds first
    assert choice.take("a+2") == (TWO_LEVEL, True)
    choice.assign([("a",), ("b", "c")], [4e5, 4e5], [DGC, QSGD])
    assert choice.take("b+1") == (TWO_LEVEL, True)  # its state was regrouped meanwhile

    choice.start_trial(2)
    assert choice.validating
    seen, world = [], _World()
    slow = {("flat", "two-level"): 3.0, ("flat", "flat"): 1.0, ("two-level", "two-level"): 2.0}
    while choice.validating:
        seen.append(tuple(choice.routes[k] for k in ("a", "b+1")))
        choice.trial_step(slow[seen[-1]], world)
    assert seen == [(FLAT, TWO_LEVEL)] * 3 + [(FLAT, FLAT)] * 3 + [(TWO_LEVEL, TWO_LEVEL)] * 3  # settle + 2 each
    assert choice.record["kept_label"] == "all flat" and choice.routes == {"a": FLAT, "b+1": FLAT}
    assert choice.record["medians_seconds"] == [3.0, 1.0, 2.0]
    assert "kept all flat" in choice.summary()
    again = RouteChoice(_Transport())
    again.load(choice.to_dict())
    again.assign([("a",), ("b", "c")], [4e5, 4e5], [DGC, QSGD])  # resumed: no model, the routes kept
    assert again.routes == {"a": FLAT, "b+1": FLAT} and again.record == choice.record
    none = RouteChoice(_Transport())
    none.assign([("a",)], [4.0], [DGC])
    none.start_trial(0)
    assert not none.validating


def test_scheduler_takes_a_two_level_cost_model():
    from torch_ops.scheduling import check_cost_model
    m = _links()
    assert check_cost_model(m) is m.flat
    with pytest.raises(ValueError, match="cost_model: expected .*TwoLevelCostModel; got str"):
        check_cost_model("fast")


def test_route_choice_sees_a_key_naming_other_members():
    """DDP's rebuilt buckets may reuse a key (first member, count) for other members: that group
    goes flat, unfolded state forgotten, until it is assigned; ``groups`` still names the assigned
    members, so the hook sees the change."""
    from torch_ops.twolevel import RouteChoice
    choice = RouteChoice(_Transport())
    choice.model = _links()
    choice.assign([("a", "b")], [4e5], [QSGD])
    assert choice.take("a+1") == (TWO_LEVEL, True) and choice.take("a+1") == (TWO_LEVEL, False)
    choice.sees("a+1", ("a", "b"))  # the same members: nothing changes
    assert choice.take("a+1") == (TWO_LEVEL, False)
    choice.sees("a+1", ("a", "c"))
    assert choice.take("a+1") == (FLAT, False) and choice.groups == (("a", "b"),)
    choice.assign([("a", "c")], [4e5], [QSGD])
    assert choice.groups == (("a", "c"),) and choice.take("a+1") == (TWO_LEVEL, True)


def test_hook_chooses_routes_where_the_optimizer_would():
    from torch_ops.ddp_hook import chooses_routes
    two, flat = Topology(4, 2), Topology(4, 4)
    assert chooses_routes(None, None, two, 3, _Compressor())  # the launcher's topology
    assert not chooses_routes(None, None, two, 0, _Compressor())  # nothing measured: every bucket two-level
    assert not chooses_routes(None, "2x2", two, 3, _Compressor())  # explicit topology: two-level
    assert chooses_routes("auto", "2x2", two, 0, _Compressor())  # asked for: the model's routes
    assert not chooses_routes("two-level", None, two, 3, _Compressor())
    assert not chooses_routes("auto", None, flat, 3, _Compressor())  # one node
    assert not chooses_routes(None, None, two, 3, _Adam())


# -- real processes ----------------------------------------------------------------------------------
from scenarios.twolevel_route import HOOK_SCENARIOS, HOOK_SPEC, PICKS, ROUTES  # noqa: E402
from scenarios.twolevel_route import launch  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    return launch(["switching", "picks", "validated", *HOOK_SCENARIOS])


def _part(runs, name):
    for r in runs:
        assert not (isinstance(r[name], dict) and "error" in r[name]), r[name]["error"]
    return [r[name] for r in runs]


def _exchanges(results, kind):
    """Per exchange: every rank's log entry."""
    return list(zip(*(r["log"][kind] for r in results)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["switching", "fixed-two-level", "fixed-flat", "flat"])
def test_nothing_held_back_is_lost_or_counted_twice(runs, kind):
    """Every exchange: the ranks' inputs and residuals before = residuals after + P x the mean
    sent (the result); the same result on every rank; after a two-level exchange a rank holds
    residual only in its own part."""
    results = _part(runs, "switching")
    topo = Topology(4, 2)
    for ranks in _exchanges(results, kind):
        res = [e["result"] for e in ranks]
        assert all(np.array_equal(res[0], r) for r in res), (kind, ranks[0]["step"], ranks[0]["key"])
        before = sum(e["x"] + e["before"].get("residual", 0.0) for e in ranks)
        after = sum(e["after"]["residual"] for e in ranks) + len(ranks) * res[0]
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5, err_msg=f"{kind} {ranks[0]['step']}")
        if kind == "fixed-two-level" or (kind == "switching" and ranks[0]["route"] == TWO_LEVEL):
            for node in range(topo.nodes):  # a node's ranks hold residual of their own parts only
                held = [ranks[r]["after"]["residual"] != 0 for r in range(node * 2, node * 2 + 2)]
                assert not np.logical_and(*held).any(), (kind, ranks[0]["step"], node)


@pytest.mark.multiprocess
def test_a_held_route_is_the_plain_exchange(runs):
    """Held flat, the route-choosing transport is the world's exchange bit for bit; held two-level,
    the plain two-level transport's (oracle-checked in test_twolevel.py) until a regrouping, where
    only the route-choosing one folds the regrouped state into place."""
    results = _part(runs, "switching")
    for a, b in zip(_exchanges(results, "fixed-flat"), _exchanges(results, "flat")):
        for ea, eb in zip(a, b):
            assert np.array_equal(ea["result"], eb["result"])
            assert all(np.array_equal(ea["after"][k], eb["after"][k]) for k in eb["after"])
    for a, b in zip(_exchanges(results, "fixed-two-level"), _exchanges(results, "two-level")):
        if a[0]["step"] >= 4:
            break
        for ea, eb in zip(a, b):
            assert np.array_equal(ea["result"], eb["result"]), a[0]["step"]
            assert all(np.array_equal(ea["after"][k], eb["after"][k]) for k in eb["after"])


@pytest.mark.multiprocess
def test_switching_follows_the_routes_and_the_stats_say_which(runs):
    results = _part(runs, "switching")
    assert [e["route"] for e in results[0]["log"]["switching"] if e["key"] == "w"] == \
        [r for i, r in enumerate(ROUTES) if i != 4]
    for r in results:
        assert r["labels"] == {"w": "flat topk:ratio=0.1", "b": "flat topk:ratio=0.1"} if ROUTES[-1] == FLAT else \
            {"w": "two-level topk:ratio=0.1 (dense inside)", "b": "two-level topk:ratio=0.1 (dense inside)"}


@pytest.mark.multiprocess
def test_the_model_picks_flat_for_a_tiny_payload_and_two_level_for_a_quantizer(runs):
    """With the inter-node link 100x slower than the node's, tune_steps=0 keeps the model's pick."""
    results = _part(runs, "picks")
    want = {PICKS[0]: TWO_LEVEL, PICKS[1]: FLAT}
    for spec in PICKS:
        got = [r[spec] for r in results]
        assert all(g["routes"] == got[0]["routes"] and g["modelled"] == got[0]["modelled"] for g in got)
        sent = [c or spec for c in (got[0]["codecs"] or [None] * len(got[0]["routes"]))]
        for (key, route), codec in zip(got[0]["routes"].items(), sent):
            if resolve(codec).name == resolve(spec).name:  # a group sent with the spec itself
                assert route == want[spec], (spec, key, got[0])
        for g in got:
            assert all(s["identical"] for s in g["steps"]), spec
        for key, route in got[0]["routes"].items():  # the stats name every group's route and spec
            assert got[0]["labels"][key].startswith("flat " if route == FLAT else "two-level "), got[0]["labels"]


@pytest.mark.multiprocess
def test_the_default_path_validates_its_routes_alike_on_every_rank(runs):
    results = _part(runs, "validated")
    first = results[0]
    assert first["codec_choice"] == "auto"
    assert first["record"] is not None and len(first["record"]["trials"]) >= 2
    for r in results:
        assert r["record"] == first["record"] and r["routes"] == first["routes"]
        assert all(s["identical"] for s in r["steps"])
        assert any(n.startswith("routes:") for n in r["notes"])
    kept = first["record"]["trials"][first["record"]["kept"]]["routes"]
    assert first["routes"] == kept
    assert first["saved_routes"]["routes"] == kept  # state_dict() carries the decision with the plan


# -- the DDP hook's buckets -------------------------------------------------------------------------
def _fold(states, topo, e):
    """The oracle of ``two_level_exchange(fold=True)``'s first step: every additive state entry
    (floating, as large as the tensor) reduce-scattered inside each node (local rank order), so
    local rank l holds its node's sum of part l and zeros elsewhere."""
    from hvdcompress.contract import Member
    numel = e["x"].size
    members = tuple(e["members"]) or (Member(e["key"], e["shape"], 0),)
    parts = split_layout(numel, tuple(e["shape"]), members, topo.local_size)
    keys = sorted(k for k, v in states[0].items() if v.size == numel and np.issubdtype(v.dtype, np.floating))
    for k in keys:
        folded = {}
        for node in range(topo.nodes):
            ranks = topo.local_group(node * topo.local_size)
            for lr, part in enumerate(parts):
                total = states[ranks[0]][k].reshape(-1)[part.start:part.stop].copy()
                for q in ranks[1:]:
                    total = (total + states[q][k].reshape(-1)[part.start:part.stop]).astype(total.dtype)
                mine = np.zeros(numel, dtype=states[ranks[lr]][k].dtype)
                mine[part.start:part.stop] = total
                folded[ranks[lr]] = mine
        for r, v in folded.items():
            states[r][k] = v


def _replay(entries, topo):
    """The oracle's result and states after for one exchange logged on every rank: the flat
    exchange (``simulate``) or, after a fold where one was made, the two-level one."""
    from hvdcompress.reference import simulate
    from hvdcompress.reference.twolevel import simulate_two_level
    e0 = entries[0]
    states = [{k: np.array(v) for k, v in e["before"].items()} for e in entries]
    args = dict(key=e0["key"], step=e0["step"], scale=e0["scale"], shape=e0["shape"], epoch=e0["epoch"],
                members=e0["members"])
    if e0["route"] == FLAT:
        want, after, _ = simulate(e0["spec"], [e["x"] for e in entries], states, **args)
        return want, after
    if e0["fold"]:
        _fold(states, topo, e0)
    want, after, _ = simulate_two_level(e0["spec"], [e["x"] for e in entries], topo, states, **args)
    return want, after


def _tolerance(spec, route):
    name = resolve(spec).name
    if route == FLAT and name in ("dgc", "none"):  # Gloo's ring adds 4 ranks in its own order
        return 1e-5, 1e-6
    return 0.0, 0.0


def _same(got, want, tol):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if tol == (0.0, 0.0):
        return np.array_equal(got, want, equal_nan=True)
    return np.allclose(got, want, rtol=tol[0], atol=tol[1] * max(1.0, float(np.abs(want).max(initial=0.0))))


@pytest.mark.multiprocess
def test_hook_every_exchange_equals_the_oracle_for_its_route(runs):
    """Every exchange of the hook's runs (trial, kept routes, resumed run, picks) on every rank:
    the same result, equal to the oracle's replay of the route it took (the fold of a first
    two-level exchange included), and the state after as the oracle's."""
    topo = Topology(4, 2)
    logs = [r["log"] for r in runs]
    assert len({len(log) for log in logs}) == 1 and logs[0]
    seen = set()
    for entries in zip(*logs):
        e0 = entries[0]
        assert all((e["tag"], e["key"], e["route"], e["fold"]) == (e0["tag"], e0["key"], e0["route"], e0["fold"])
                   for e in entries)
        want, after = _replay(entries, topo)
        tol = _tolerance(e0["spec"], e0["route"])
        for r, e in enumerate(entries):
            where = (e0["tag"], e0["key"], e0["route"], e0["fold"], r)
            assert np.array_equal(e["result"], e0["result"]), where
            assert _same(e["result"], want, tol), where
            assert sorted(e["after"]) == sorted(after[r]), where
            for k, v in after[r].items():
                assert _same(e["after"][k], v, tol), (where, k)
        seen.add((e0["tag"][0], e0["route"], e0["fold"]))
    hook = {(route, fold) for tag, route, fold in seen if tag == "hook"}
    assert {(FLAT, False), (TWO_LEVEL, True), (TWO_LEVEL, False)} <= hook  # both routes, and a fold


@pytest.mark.multiprocess
def test_hook_measures_its_buckets_routes_and_keeps_them_alike(runs):
    """routes="auto": the trial starts again when DDP rebuilds its buckets after the first step,
    decides alike on every rank, and the routes kept are the trial's; replicas identical every
    step; the stats name each bucket's route."""
    results = _part(runs, "hook_validated")
    first = results[0]
    steps = first["steps"]
    assert first["fitted"] and first["record"] is not None and first["decided_at"] < 30
    assert steps[0]["groups"] != steps[-1]["groups"] and len(steps[-1]["groups"]) > 1  # DDP rebuilt its buckets
    kept = first["record"]["trials"][first["record"]["kept"]]["routes"]
    assert first["routes"] == kept and set(kept) == {("+".join([g[0], str(len(g) - 1)]) if len(g) > 1 else g[0])
                                                     for g in steps[-1]["groups"]}
    assert len(first["record"]["trials"]) >= 2 and len(first["record"]["medians_seconds"]) == len(
        first["record"]["trials"])
    for r in results:
        assert r["record"] == first["record"] and r["routes"] == first["routes"]
        assert all(s["identical"] for s in r["steps"] + r["resumed"])
        assert [s["routes"] for s in r["steps"]] == [s["routes"] for s in steps]
    last = steps[-1]
    for key, route in last["routes"].items():
        want = f"flat {HOOK_SPEC}" if route == FLAT else f"two-level {HOOK_SPEC} (dense inside)"
        assert last["labels"][key] == want


@pytest.mark.multiprocess
def test_hook_checkpoint_after_the_decision_resumes_exactly(runs):
    for r in _part(runs, "hook_validated"):
        assert r["resumed_equal"] and not r["resumed_fitted"]  # nothing measured again
        assert r["saved_routes"]["decided"] and r["saved_routes"]["choice"]["routes"] == r["routes"]
        assert all(s["routes"] == r["routes"] and not s["validating"] for s in r["resumed"])


@pytest.mark.multiprocess
def test_hook_takes_the_models_route_per_bucket(runs):
    """A given cost model (intra fast, inter slow) and tune_steps=0: every bucket's route is
    ``choose_routes``' for the hook's spec, qsgd two-level and DGC at 0.1% flat, alike on every rank."""
    from scenarios.twolevel_route import LINKS
    results = _part(runs, "hook_picks")
    want = {PICKS[0]: TWO_LEVEL, PICKS[1]: FLAT}
    for spec in PICKS:
        got = [r[spec] for r in results]
        g0 = got[0]
        assert all(g["routes"] == g0["routes"] and g["groups"] == g0["groups"] for g in got)
        assert g0["routes"] == g0["modelled"] and g0["record"] is None  # nothing measured
        assert set(g0["routes"].values()) == {want[spec]}, (spec, g0)
        fits = {s: ComputeFit("linear", 2e-10, 1e-4) for s in (g0["spec"], "fp16", "none")}
        model = TwoLevelCostModel.from_links(**LINKS, compress=fits, decompress=dict(fits))
        sizes = [4.0 * sum(_numel(n) for n in grp) for grp in g0["groups"]]
        picked = [d.best.candidate.route.layout for d in choose_routes(model, sizes, [g0["spec"]] * len(sizes))]
        assert list(g0["routes"].values()) == picked
        for g in got:
            assert all(s["identical"] for s in g["steps"])


def _numel(name):
    """Elements of the DDP model's parameter ``name`` ("module.<the MLP's name>")."""
    from scenarios.kit import torch_mlp
    from scenarios.twolevel_route import MLP
    return dict((f"module.{n}", p.numel()) for n, p in torch_mlp(MLP).named_parameters())[name]


@pytest.mark.multiprocess
def test_hook_arguments_resolve_as_the_optimizers_and_bad_ones_are_refused(runs):
    for got in _part(runs, "hook_arguments"):
        assert got["after"] == 4.0  # the next collective still lines up
        assert got["launcher"] == ("TwoLevelTransport", True)  # the default path chooses
        assert got["launcher two-level"] == ("TwoLevelTransport", False)
        assert got["launcher tune_steps=0"] == ("TwoLevelTransport", False)
        assert got["explicit"] == ("TwoLevelTransport", False) and got["explicit auto"] == ("TwoLevelTransport", True)
        assert got["flat auto"] == ("TorchDistCommunicator", False)
        assert got["routes"].startswith("routes: must be None") and "'auto'" in got["routes"]
        assert got["tune_steps"].startswith("tune_steps: must be an int in [0, 100]")
        assert got["cost_model"].startswith("cost_model: expected None or a")
        assert "TwoLevelCostModel" in got["cost_model"]
        assert got["cost_model topology"].startswith("cost_model: a TwoLevelCostModel of topology")
        assert got["adam"].startswith("routes='auto'") and "routes='two-level'" in got["adam"]
