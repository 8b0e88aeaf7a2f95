"""The cost model with two link classes (intra-node, inter-node), the per-group route choice and
the two-level projection: pure functions on made-up costs, no Horovod, no processes."""

import math

import numpy as np
import pytest

from hvdcompress.schedule import scaling
from hvdcompress.schedule.costmodel import ComputeFit, CostModel
from hvdcompress.schedule.planner import Workload, make_plan
from hvdcompress.schedule.twolevel import (FLAT, GTOPK, HIERARCHICAL, TWO_LEVEL, Candidate, Route, RouteCostModel,
                                           TwoLevelCostModel, candidates, choose, gtopk_rounds, gtopk_wire_bytes,
                                           hop_fit, plan_routes, ring_wire_bytes, step_bytes)
from hvdcompress.spec import resolve
from hvdcompress.topology import Topology
from scenarios.kit import load_benchmark

DGC = "dgc:ratio=0.001"
FITS = {DGC: ComputeFit("linear", 5e-11, 9e-4), "fp16": ComputeFit("linear", 5e-12, 2e-5),
        "qsgd": ComputeFit("linear", 3e-11, 1e-4), "powersgd:rank=4": ComputeFit("linear", 2e-11, 7e-4),
        "topk:ratio=0.01": ComputeFit("dlogd", 1e-10, 1e-4)}


def model(nodes=16, local=8, intra=2400.0, inter=1.0, nics=1, intra_lat=2e-6, inter_lat=50e-6):
    return TwoLevelCostModel.from_links(nodes, local, intra, inter, intra_lat, inter_lat, nics, FITS)


def test_gtopk_rounds_grow_as_log_of_the_world():
    assert [gtopk_rounds(p) for p in (1, 2, 3, 4, 5, 6, 8, 16, 1024)] == [0, 1, 3, 2, 4, 4, 3, 4, 10]
    k8 = 8e3  # k = 1000 indices and values
    assert gtopk_wire_bytes(k8, 1024) == 10 * k8 < ring_wire_bytes("allgather", k8, 1024) / 100
    # not a power of two: the fold into a partner (received) or the result handed back (sent), once
    assert [gtopk_wire_bytes(k8, p) / k8 for p in (1, 2, 3, 6, 8)] == [0, 1, 2, 3, 3]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="world must be an integer >= 1"):
            gtopk_rounds(bad)


def test_flat_route_is_todays_one_link_model_bit_for_bit():
    m = model()
    today = CostModel.from_link(128, 1.0, 50e-6, FITS)
    assert m.flat.to_dict() == today.to_dict() and m.for_route(Route()) is m.flat
    sizes = np.array([4e3, 4e5, 4e7])
    for spec in ("none", "fp16", DGC, "qsgd", "powersgd:rank=4"):
        h = m.hops(Route(), spec, sizes)
        assert np.array_equal(h.inter, today.comm_seconds(spec, sizes)), spec
        assert np.array_equal(h.cpu, today.group_cpu_seconds(spec, sizes)) and not h.intra.any()
    w = Workload(("a", "b", "c"), (4e5, 4e6, 4e7), (1e-3, 2e-3, 4e-3), 1e-3, 0.0)
    for spec in ("none", DGC):
        assert w.plan("auto", m.for_route(Route()), spec).predicted_seconds == \
            w.plan("auto", today, spec).predicted_seconds
    # a flat topology (one node, one rank per node) has only flat routes, with today's figures
    one = TwoLevelCostModel.from_links(1, 8, 2400.0, 1.0, compress=FITS)
    assert [c.route.layout for c in candidates(DGC, one.topology)] == [FLAT, FLAT]
    assert np.array_equal(one.hops(Route(TWO_LEVEL), DGC, sizes).inter,
                          CostModel.from_link(8, 1.0, 50e-6, FITS).comm_seconds(DGC, sizes))


def test_hierarchical_dense_is_reduce_scatter_cross_allreduce_allgather():
    n, L, m_bytes = 4, 8, 8e7
    beta_i, beta_x, lat_i, lat_x = 8 / 2400e9, 8 / 10e9, 2e-6, 50e-6
    for nics in (1, 2, 8, 16):
        m = model(n, L, 2400.0, 10.0, nics)
        share = max(1.0, L / nics)
        h = m.hops(HIERARCHICAL, "none", np.array([m_bytes]))
        intra = 2 * (L - 1) * lat_i + 2 * (L - 1) / L * m_bytes * beta_i
        inter = 2 * (n - 1) * lat_x + 2 * (n - 1) / n * (m_bytes / L) * beta_x * share
        assert h.intra[0] == pytest.approx(intra, rel=1e-12) and h.inter[0] == pytest.approx(inter, rel=1e-12)
        assert h.inter_bytes[0] == pytest.approx(2 * (n - 1) / n * m_bytes / L)
        assert h.intra_bytes[0] == pytest.approx(2 * (L - 1) / L * m_bytes)
    # fp16 inside halves the bytes of both intra-node collectives and adds the cast
    h16 = model(n, L).hops(Route(TWO_LEVEL, "fp16"), "none", np.array([m_bytes]))
    assert h16.intra_bytes[0] == pytest.approx(2 * (L - 1) / L * m_bytes / 2)
    assert h16.cpu[0] == pytest.approx(FITS["fp16"](m_bytes / 4))


def test_the_spec_runs_on_one_slice_per_local_rank_across_the_nodes():
    n, L, m_bytes = 16, 8, 4e7
    m = model(n, L)
    h = m.hops(Route(TWO_LEVEL), DGC, np.array([m_bytes]))
    k = math.ceil(0.001 * m_bytes / 4 / L)  # top-k of the node's sum of slice l
    cross = CostModel.from_link(n, 1.0 / L, 50e-6)  # one NIC shared by the node's 8 cross exchanges
    assert h.inter[0] == pytest.approx(float(cross.comm_seconds(DGC, m_bytes / L)), rel=1e-12)
    assert h.inter_bytes[0] == pytest.approx((n - 1) * 8 * k)
    assert h.cpu[0] == pytest.approx(FITS[DGC](m_bytes / 4 / L))  # encode 1/L of the tensor
    # a node's NICs send about L times less than in the flat allgather of all P ranks
    flat, two = (step_bytes(m, [[0]], [m_bytes], [Candidate(r, resolve(DGC))]) for r in (Route(), Route(TWO_LEVEL)))
    assert flat["inter_per_node"] == pytest.approx((n * L - 1) * 8 * k * L, rel=1e-3)
    assert flat["inter_per_node"] / two["inter_per_node"] == pytest.approx((n * L - 1) / (n - 1), rel=1e-3)


def test_gtopk_across_costs_log_rounds_of_one_selection():
    m = model(16, 8)
    b = 4e7
    h = m.hops(Route(TWO_LEVEL, aggregate=GTOPK), DGC, np.array([b]))
    k8 = 8 * math.ceil(0.001 * b / 4 / 8)
    hop = hop_fit(m.cross)
    assert hop.alpha == pytest.approx(50e-6) and hop.beta == pytest.approx(8 * 8 / 1e9)
    assert h.inter[0] == pytest.approx(4 * (2 * hop.alpha + hop.beta * k8)) and h.inter_bytes[0] == 4 * k8
    assert gtopk_rounds(16) == 4
    with pytest.raises(ValueError, match="aggregate='gtopk' applies to topk, dgc"):
        m.hops(Route(aggregate=GTOPK), "qsgd", np.array([b]))
    assert [c.label for c in candidates(DGC, m.topology, gtopk=True)][-3:] == [
        "flat dgc:ratio=0.001, gtopk", "two-level dgc:ratio=0.001 (dense inside), gtopk",
        "two-level dgc:ratio=0.001 (fp16 inside), gtopk"]


def test_choice_slow_inter_link_two_level_equal_links_flat_tiny_tensors_dense():
    big = 1e8
    slow = choose(model(inter=1.0), DGC, big)
    assert slow.best.candidate.route.layout == TWO_LEVEL and slow.best.candidate.spec.name == "dgc"
    flat_dgc = next(c for c in slow.options if c.candidate.label == "flat dgc:ratio=0.001")
    assert slow.best.seconds * 5 < flat_dgc.seconds
    # equal links (both 10 Gbit/s, 50 us) and one NIC: the flat ring pays the slow hop once
    equal = choose(model(intra=10.0, inter=10.0, intra_lat=50e-6), "qsgd", big)
    assert equal.best.candidate.route.layout == FLAT
    tiny = choose(model(inter=1.0), DGC, 256.0)
    assert tiny.best.candidate.spec.name == "none"
    # a NIC per GPU: the dense hierarchical allreduce is L times cheaper across than with one NIC
    one, eight = (choose(model(inter=100.0, nics=k), "none", big) for k in (1, 8))
    assert eight.best.candidate.route == HIERARCHICAL
    assert eight.options[1].hops.inter == pytest.approx(
        (one.options[1].hops.inter - 30 * 50e-6) / 8 + 30 * 50e-6, rel=1e-9)
    with pytest.raises(ValueError, match="at least one candidate"):
        choose(model(), DGC, big, options=[])


def test_plan_routes_is_never_slower_than_any_one_route():
    rng = np.random.default_rng(3)
    sizes = np.exp(rng.uniform(np.log(4e2), np.log(4e7), 9))
    t_b = rng.uniform(1e-4, 3e-3, 9)
    for inter in (0.1, 1.0, 100.0):
        m = model(inter=inter)
        opts = candidates(DGC, m.topology)
        chosen = plan_routes(sizes, t_b, m, DGC, forward_seconds=1e-3)
        assert len(chosen.choices) == len(chosen.groups) and chosen.gap is not None
        for c in opts:
            alone = plan_routes(sizes, t_b, m, DGC, options=[c], forward_seconds=1e-3)
            assert chosen.predicted_seconds <= alone.predicted_seconds * (1 + 1e-9), (inter, c.label)
            # the fixed route through the planner agrees with the one-option search
            planned = make_plan("mgs", sizes, t_b, m.for_route(c.route), c.spec, forward_seconds=1e-3)
            assert planned.predicted_seconds == pytest.approx(alone.predicted_seconds, rel=1e-9)
    slow = plan_routes(sizes, t_b, model(inter=0.1), DGC)
    assert any(c.route.layout == TWO_LEVEL and c.spec.name == "dgc" for c in slow.choices)
    assert sum(slow.counts().values()) == len(slow.groups) and slow.as_dict()["choices"][0]["label"]
    # a spec that never merges gets groups of one tensor; dense groups merge
    p = plan_routes(sizes, t_b, model(inter=0.1), "powersgd:rank=4")
    assert all(len(g) == 1 for g, c in zip(p.groups, p.choices) if c.spec.name == "powersgd")
    with pytest.raises(ValueError, match="no compression-time fit for signsgd"):
        plan_routes(sizes, t_b, model(), "signsgd")


def test_bad_inputs_name_the_parameter():
    with pytest.raises(ValueError, match="layout must be one of flat, two-level"):
        Route("tree")
    with pytest.raises(ValueError, match="inside='fp16' needs layout='two-level'"):
        Route(FLAT, "fp16")
    with pytest.raises(ValueError, match="inside must be one of none, fp16"):
        Route(TWO_LEVEL, "int8")
    with pytest.raises(ValueError, match="aggregate must be one of gather, gtopk"):
        Route(aggregate="tree")
    with pytest.raises(ValueError, match="nics_per_node must be an integer >= 1"):
        model(nics=0)
    with pytest.raises(ValueError, match="local_size must be an integer >= 1"):
        TwoLevelCostModel.from_links(2, 0, 100.0, 1.0)
    m = model(4, 2)
    with pytest.raises(ValueError, match="inter must be a CostModel of world_size 4"):
        TwoLevelCostModel(m.topology, m.flat, m.intra, CostModel.from_link(3, 1.0, 0.0))
    with pytest.raises(ValueError, match="planned for world_size 8"):
        RouteCostModel(m, HIERARCHICAL).exchange_seconds("none", 4e6, 16)


def test_from_model_carries_a_fitted_model_to_both_levels():
    base = CostModel.from_link(2, 1.0, 50e-6, FITS)
    topo = Topology(64, 8)
    m = TwoLevelCostModel.from_model(base, topo, 2400.0, 2e-6, gbps=10.0, latency_s=50e-6)
    want = CostModel.from_link(64, 10.0, 50e-6, FITS)
    assert m.flat.allreduce.alpha == pytest.approx(want.allreduce.alpha)
    assert m.flat.allreduce.beta == pytest.approx(want.allreduce.beta)
    assert m.inter.world_size == 8 and m.intra.world_size == 8 and m.share == 8.0


def test_two_level_projection_rows_and_command(tmp_path):
    w = scaling.synthetic_workload(12, 100.0, 60.0, 30.0)
    base = CostModel.from_link(2, 1.0, 50e-6, FITS)
    rows = scaling.two_level_sweep(w, base, [DGC], local_size=8, workers=(16, 128, 1024),
                                   gbps=(1.0, 100.0), intra_gbps=2400.0, intra_latency_s=2e-6, gtopk=True)
    by = {(r["workers"], r["gbps"], r["label"]): r for r in rows}
    assert {r["layout"] for r in rows} == {"flat dense", "hierarchical dense", "flat spec", "two-level spec",
                                           "flat spec, gtopk", "two-level spec, gtopk", "choice"}
    r = by[(128, 1.0, "two-level dgc:ratio=0.001 (dense inside)")]
    f = by[(128, 1.0, "flat dgc:ratio=0.001")]
    assert r["nodes"] == 16 and r["step_seconds"] < f["step_seconds"]
    assert r["bytes_per_worker"]["inter"] < f["bytes_per_worker"]["inter"] / 5
    # received bytes of the flat sparse gather grow with P; gTop-k's as log P
    g = [by[(p, 1.0, "flat dgc:ratio=0.001, gtopk")]["bytes_per_worker"]["inter"] for p in (16, 128, 1024)]
    a = [by[(p, 1.0, "flat dgc:ratio=0.001")]["bytes_per_worker"]["inter"] for p in (16, 128, 1024)]
    assert a[2] / a[0] > 50 and g[2] / g[0] < 3
    for p, gb in ((16, 1.0), (1024, 100.0)):
        choice = by[(p, gb, f"choice {DGC}")]
        fixed = [x["step_seconds"] for k, x in by.items() if k[:2] == (p, gb) and DGC in k[2] and x is not choice
                 and x["layout"] != "choice"] + [by[(p, gb, "flat dense")]["step_seconds"]]
        assert choice["step_seconds"] <= min(fixed) * (1 + 1e-9)
    with pytest.raises(ValueError, match="multiple of --gpus-per-node"):
        scaling.two_level_sweep(w, base, [DGC], local_size=8, workers=(12,), gbps=(1.0,), intra_gbps=100.0,
                                intra_latency_s=2e-6)
    out = tmp_path / "two.json"
    assert scaling.main(["--link", "1,50", "--synthetic", "6,100,60,30", "--compression", "qsgd",
                         "--gpus-per-node", "8", "--intra-gbps", "2400", "--workers", "16,128", "--gbps", "1,10",
                         "--codec-fit", "qsgd=linear,3e-11,1e-4", "--out", str(out)]) == 0
    import json
    result = json.loads(out.read_text())
    assert result["two_level"]["local_size"] == 8 and len(result["rows"]) == 2 * 2 * 5
    assert "ASSUMED" in result["note"] or "PREDICTION" in result["note"]


def test_projection_script_renders_the_stored_tables(tmp_path):
    """benchmarks/two_level_projection.py: the stored JSON holds its command and inputs, and its
    tables render again from it (what docs/scaling.md shows)."""
    import json
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mod = load_benchmark("two_level_projection.py")
    stored = os.path.join(root, "benchmarks", "results", "scaling", "two-level-resnet50.json")
    result = json.load(open(stored))
    assert result["command"].startswith("python benchmarks/two_level_projection.py") and result["assumed"]
    assert os.path.getsize(stored) < 50_000
    rows = mod.rows_of(result)
    assert {r["workers"] for r in rows} >= {16, 128, 1024} and all(r["step_seconds"] > 0 for r in rows)
    md = tmp_path / "t.md"
    assert mod.main(["--render", stored, "--md", str(md)]) == 0
    text = md.read_text()
    assert "| 1 Gbit/s | two-level dgc:ratio=0.001 (dense inside) |" in text and "1024 GPUs" in text
    with open(os.path.join(root, "docs", "scaling.md")) as f:
        page = f.read()
    assert mod.markdown(result, 128).split("\n", 2)[2].strip() in page  # the page shows the stored table


def test_a_route_plans_with_the_codec_choice_and_the_closing_skew():
    """A ``RouteCostModel`` goes where a ``CostModel`` goes: ``make_plan`` with alternatives
    chooses the spec across per group on that route; the flat model's exchange skew lengthens
    the closing exchange by skew x (encode + both hops)."""
    sizes, t_b = [4e3, 4e6, 4e7], [1e-3, 2e-3, 4e-3]
    m = model(inter=1.0)
    view = m.for_route(Route(TWO_LEVEL))
    plan = make_plan("auto", sizes, t_b, view, DGC, alternatives=("fp16", "none"))
    assert len(plan.codecs) == len(plan.groups) and plan.predicted_seconds > 0
    alone = make_plan("auto", sizes, t_b, view, DGC)
    assert plan.predicted_seconds <= alone.predicted_seconds * (1 + 1e-9)
    skewed = TwoLevelCostModel(m.topology, m.flat.with_skew(0.5), m.intra, m.inter)
    v = skewed.for_route(Route(TWO_LEVEL))
    b = np.array([4e7])
    assert v.closing_seconds(DGC, b) == pytest.approx(0.5 * (v.exchange_seconds(DGC, b) + v.group_cpu_seconds(DGC, b)))
    assert not view.closing_seconds(DGC, b).any()
    assert v.tensor_comm_seconds(DGC, (1000, 10000)) == pytest.approx(float(v.exchange_seconds(DGC, 4e7)))


def test_measured_two_level_steps_are_compared_with_their_prediction(tmp_path, capsys):
    import json
    w = scaling.synthetic_workload(6, 20.0, 40.0, 20.0)
    base = CostModel.from_link(2, 1.0, 50e-6, FITS)
    kw = dict(local_size=2, intra_gbps=1e4, intra_latency_s=5e-6)
    want = scaling.predict_route(w, TwoLevelCostModel.from_model(base, Topology(4, 2), 1e4, 5e-6, 0.1),
                                 DGC, Route(TWO_LEVEL))["step_seconds"]
    rows = scaling.compare_two_level([{"workers": 4, "layout": "two-level spec", "compression": DGC,
                                       "seconds": want * 1.1, "gbps": 0.1},
                                      {"workers": 4, "layout": "hierarchical dense", "seconds": 1.0}], w, base, **kw)
    assert rows[0]["rel_error"] == pytest.approx(1 / 1.1 - 1) and rows[0]["nodes"] == 2
    assert rows[1]["label"] == "hierarchical dense"
    for record, msg in (({"workers": 4, "layout": "tree", "seconds": 1.0}, "layout must be one of"),
                        ({"workers": 4, "layout": "flat spec", "seconds": 1.0}, "needs its compression"),
                        ({"workers": 4, "seconds": 1.0}, "lacks layout")):
        with pytest.raises(ValueError, match=msg):
            scaling.compare_two_level([record], w, base, **kw)
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"workers": 4, "layout": "two-level spec", "compression": DGC, "seconds": want,
                                 "gbps": 0.1}]))
    assert scaling.main(["--link", "1,50", "--synthetic", "6,20,40,20", "--compression", DGC, "--gpus-per-node", "2",
                         "--intra-gbps", "1e4", "--intra-latency-us", "5", "--workers", "4", "--no-choice",
                         "--codec-fit", f"{DGC}=linear,5e-11,9e-4", "--measured", str(path),
                         "--out", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out
    assert "measured 4 workers (2x2) two-level dgc:ratio=0.001 (dense inside)" in out and "within 15%" in out
    assert "(+0.0%)" in out
