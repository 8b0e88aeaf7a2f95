"""The layer-merging planner, its timeline model and the cost model: pure functions, no Horovod."""

import json
import math

import numpy as np
import pytest

from hvdcompress.schedule.costmodel import (ComputeFit, CostModel, LinearFit, cache_path, describe, fit_compute,
                                   fit_cost_model, fit_linear, payload)
from hvdcompress.schedule.planner import MIB, Schedule, make_plan, parse_schedule
from hvdcompress.schedule.search import brute_force, by_size, greedy, layerwise, optimal, single
from hvdcompress.schedule.timeline import predict
from hvdcompress.spec import parse_spec

OVERLAPS = ("shared", "parallel")


def _instance(rng, n):
    """A random model: sizes over 4 decades, backward times, and t_s/t_c of the fitted forms."""
    sizes = np.floor(np.exp(rng.uniform(np.log(400), np.log(4e6), n)))
    if rng.random() < 0.2:
        sizes[rng.integers(n)] = 0.0  # an empty tensor
    t_b = rng.uniform(0, 2e-3, n) * (rng.random(n) > 0.2)  # some hooks fire together (t_b = 0)
    sa, sb = rng.uniform(0, 2e-9), rng.uniform(0, 3e-4)
    alpha, beta, ratio = rng.uniform(1e-5, 3e-3), rng.uniform(1e-10, 1e-8), rng.choice([1.0, 0.1, 0.01])

    def t_s(b):
        d = np.asarray(b) / 4
        return sa * d * np.log2(np.maximum(d, 1)) + sb

    def t_c(b):
        return 2 * alpha + beta * 8 * np.ceil(ratio * np.asarray(b) / 4)

    return sizes, t_b, t_s, t_c


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_dp_equals_brute_force_on_random_instances(overlap):
    rng = np.random.default_rng(6)
    for trial in range(100):
        sizes, t_b, t_s, t_c = _instance(rng, int(rng.integers(1, 10)))
        groups, best, gap = optimal(sizes, t_b, t_s, t_c, overlap)
        _, brute, _ = brute_force(sizes, t_b, t_s, t_c, overlap)
        assert best == pytest.approx(brute, rel=1e-12, abs=1e-15), (trial, overlap)
        assert gap == 0.0
        # the DP's value is the timeline of the partition it returns
        assert predict(groups, sizes, t_b, t_s, t_c, overlap).end == pytest.approx(best, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_dp_equals_brute_force_with_a_closing_exchange_term(overlap):
    # t_close lengthens the last group's exchange only: the DP stays exact (same optimum as every
    # partition timed), and the thinned shared search still certifies its gap
    rng = np.random.default_rng(16)
    for trial in range(80):
        sizes, t_b, t_s, t_c = _instance(rng, int(rng.integers(1, 10)))
        k = rng.uniform(0.5, 8.0)

        def t_close(b, k=k, t_s=t_s, t_c=t_c):
            return k * (t_s(b) + t_c(b))

        found = optimal(sizes, t_b, t_s, t_c, overlap, t_close=t_close)
        brute = brute_force(sizes, t_b, t_s, t_c, overlap, t_close=t_close)
        assert found.seconds == pytest.approx(brute.seconds, rel=1e-12, abs=1e-15), (trial, overlap)
        assert predict(found.groups, sizes, t_b, t_s, t_c, overlap, t_close=t_close).end == \
            pytest.approx(found.seconds, rel=1e-12, abs=1e-15)
        if overlap == "shared" and len(sizes) >= 6:
            thin = optimal(sizes, t_b, t_s, t_c, overlap, max_front=2, t_close=t_close)
            assert brute.seconds * (1 - 1e-12) <= thin.seconds <= brute.seconds + thin.gap + 1e-12 * brute.seconds


def test_closing_term_lengthens_only_the_last_exchange():
    sizes, t_b = [1e6, 2e6, 3e6], [0.01, 0.01, 0.01]
    t_s, t_c = (lambda b: 1e-9 * np.asarray(b)), (lambda b: 1e-3 + 1e-9 * np.asarray(b))
    groups = [[0], [1], [2]]
    plain = predict(groups, sizes, t_b, t_s, t_c)
    closed = predict(groups, sizes, t_b, t_s, t_c, t_close=lambda b: 0.5 + 0 * np.asarray(b))
    assert np.array_equal(plain.comm_end[:-1], closed.comm_end[:-1])
    assert closed.comm_end[-1] == pytest.approx(plain.comm_end[-1] + 0.5)
    assert closed.end - plain.end == pytest.approx(0.5)


def test_greedy_is_never_better_than_dp_and_its_gap_is_reported():
    rng = np.random.default_rng(7)
    for overlap in OVERLAPS:
        gaps = []
        for _ in range(120):
            sizes, t_b, t_s, t_c = _instance(rng, int(rng.integers(2, 11)))
            best = optimal(sizes, t_b, t_s, t_c, overlap).seconds
            g = greedy(sizes, t_b, t_s, t_c, overlap).seconds
            assert g >= best * (1 - 1e-12)
            gaps.append(g / best - 1)
        gaps = np.array(gaps)
        print(f"\ngreedy vs DP ({overlap}, {len(gaps)} instances, 2-10 tensors): optimal in {np.mean(gaps < 1e-9):.0%}, "
              f"mean gap {gaps.mean():.2%}, 95th pct {np.quantile(gaps, 0.95):.2%}, max {gaps.max():.2%}")


def test_thinned_fronts_certify_their_gap():
    # max_front=2 forces thinning: the result stays within the returned gap of the brute-force optimum
    rng = np.random.default_rng(9)
    thinned = 0
    for _ in range(25):
        sizes, t_b, t_s, t_c = _instance(rng, int(rng.integers(6, 10)))
        found = optimal(sizes, t_b, t_s, t_c, "shared", max_front=2)
        brute = brute_force(sizes, t_b, t_s, t_c, "shared").seconds
        assert brute * (1 - 1e-12) <= found.seconds <= brute + found.gap + 1e-12 * brute
        assert predict(found.groups, sizes, t_b, t_s, t_c, "shared").end == pytest.approx(found.seconds)
        thinned += found.gap > 0
    assert thinned > 0


def test_dp_scales_to_thousands_of_tensors():
    sizes, t_b, t_s, t_c = _instance(np.random.default_rng(0), 1000)
    for overlap in OVERLAPS:
        groups, best, gap = optimal(sizes, t_b, t_s, t_c, overlap)
        assert sum(len(g) for g in groups) == 1000 and gap < 1e-3 * best
        assert predict(groups, sizes, t_b, t_s, t_c, overlap).end == pytest.approx(best, rel=1e-9)
        for other in (layerwise(1000), single(1000), greedy(sizes, t_b, t_s, t_c, overlap).groups):
            assert predict(other, sizes, t_b, t_s, t_c, overlap).end >= (best - gap) * (1 - 1e-12)


def test_fixed_partitions():
    assert layerwise(3) == [[0], [1], [2]]
    assert single(3) == [[0, 1, 2]]
    assert single(0) == [] and layerwise(0) == []
    sizes = [30, 30, 50, 120, 10, 10, 10]
    assert by_size(sizes, 100) == [[0, 1], [2], [3], [4, 5, 6]]
    assert by_size(sizes, 0) == layerwise(7)
    assert by_size(sizes, 1e9) == single(7)
    plan = make_plan("size:0.0001", [40, 40, 40, 200])  # 104.9 bytes
    assert plan.groups == [[0, 1], [2], [3]] and plan.predicted_seconds is None
    assert make_plan("layerwise", [1, 2]).groups == [[0], [1]]
    assert make_plan("single", [1, 2]).groups == [[0, 1]]


def _hand():
    sizes, t_b = [100, 200, 300], [1.0, 2.0, 3.0]
    return sizes, t_b, (lambda b: b / 100), (lambda b: 1 + b / 100)


def test_timeline_by_hand_shared():
    sizes, t_b, t_s, t_c = _hand()
    tl = predict([[0], [1], [2]], sizes, t_b, t_s, t_c, "shared")
    # compute stream: b0 [0,1] s0 [1,2] b1 [2,4] s1 [4,6] b2 [6,9] s2 [9,12]; wire: [2,4] [6,9] [12,16]
    assert tl.ready.tolist() == [1, 4, 9] and tl.compress_end.tolist() == [2, 6, 12]
    assert tl.comm_start.tolist() == [2, 6, 12] and tl.comm_end.tolist() == [4, 9, 16]
    assert tl.end == 16 and tl.backward_end == 12 and tl.exposed_comm == 4
    assert predict([[0, 1, 2]], sizes, t_b, t_s, t_c, "shared").end == 6 + 6 + 7
    assert predict([[0, 1], [2]], sizes, t_b, t_s, t_c, "shared").end == 16  # [3,6]->[6,10]; [9,12]->[12,16]


def test_timeline_by_hand_parallel_and_design_formula():
    sizes, t_b, t_s, t_c = _hand()
    tl = predict([[0], [1], [2]], sizes, t_b, t_s, t_c, "parallel")
    assert tl.comm_start.tolist() == [2, 5, 9] and tl.end == 13
    # docs/design.md, layers l = L..1 in backward order: tau_b[L] = 0, tau_b[l] = tau_b[l+1] + t_b[l+1],
    # tau_s[l] = tau_b[l] + t_b[l]; tau_c[L] = tau_s[L] + t_s[L];
    # tau_c[l] = max(tau_c[l+1] + t_c[l+1], tau_s[l] + t_s[l]); end = tau_c[1] + t_c[1]
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = 7
        size, tb = rng.permutation(500)[:n] + 1.0, rng.uniform(0, 3, n)  # distinct integers: exact sums
        ts, tc = rng.uniform(0, 2, n), rng.uniform(0, 2, n)
        by_size_ts = dict(zip(size, ts))
        by_size_tc = dict(zip(size, tc))
        layer = {n - i: i for i in range(n)}  # layer l is backward index n - l
        tau_b, tau_s, tau_c = {n: 0.0}, {}, {}
        for lyr in range(n, 0, -1):
            if lyr < n:
                tau_b[lyr] = tau_b[lyr + 1] + tb[layer[lyr + 1]]
            tau_s[lyr] = tau_b[lyr] + tb[layer[lyr]]
            own = tau_s[lyr] + ts[layer[lyr]]
            tau_c[lyr] = own if lyr == n else max(tau_c[lyr + 1] + tc[layer[lyr + 1]], own)
        end = tau_c[1] + tc[layer[1]]
        got = predict(layerwise(n), size, tb, lambda b: np.vectorize(by_size_ts.get)(b),
                      lambda b: np.vectorize(by_size_tc.get)(b), "parallel").end
        assert got == pytest.approx(end, rel=1e-12)


def test_dense_model_both_overlaps_agree_and_merging_saves_start_up():
    # MG-WFBP's situation: no compression, latency-bound tiny tensors -> merge everything
    sizes, t_b = [4.0] * 6, [1e-4] * 6
    for overlap in OVERLAPS:
        groups, best, _ = optimal(sizes, t_b, lambda b: 0 * b, lambda b: 1e-3 + 0 * b, overlap)
        assert groups == single(6) and best == pytest.approx(6e-4 + 1e-3)
    # bandwidth-bound: a long backward per tensor hides each exchange -> layerwise
    groups = optimal([4e6] * 4, [1.0] * 4, lambda b: 0 * b, lambda b: 1e-6 + 1e-9 * b).groups
    assert groups == layerwise(4)


def test_fit_recovers_known_alpha_beta():
    x = np.geomspace(1024, 64 * MIB, 15)
    exact = fit_linear(x, 3e-4 + 8e-9 * x)
    assert exact.alpha == pytest.approx(3e-4, rel=1e-9) and exact.beta == pytest.approx(8e-9, rel=1e-9)
    assert exact.rel_rmse < 1e-12
    rng = np.random.default_rng(0)
    noisy = fit_linear(np.repeat(x, 5), (3e-4 + 8e-9 * np.repeat(x, 5)) * rng.lognormal(0, 0.03, 75))
    assert noisy.alpha == pytest.approx(3e-4, rel=0.05) and noisy.beta == pytest.approx(8e-9, rel=0.05)
    assert 0.01 < noisy.rel_rmse < 0.06
    assert fit_linear([1, 2, 3], [5, 5, 5]) == LinearFit(5.0, 0.0, 0.0, 3)  # no slope, not a negative one
    with pytest.raises(ValueError, match="at least 2"):
        fit_linear([1], [1])


def test_model_fit_from_samples_per_worker_count_and_compression_form():
    world = 4
    m = np.geomspace(1024, 16 * MIB, 10)
    model = fit_cost_model(world, zip(m, 1e-4 + 2e-9 * m), zip(m, 5e-5 + 1e-9 * world * m),
                           {"topk:ratio=0.01": zip(m / 4, 2e-9 * (m / 4) * np.log2(m / 4) + 1e-5),
                            "randomk": zip(m / 4, 4e-9 * (m / 4) + 3e-5)})
    assert model.allgather.alpha == pytest.approx(5e-5) and model.allgather.beta == pytest.approx(1e-9)
    assert model.allreduce.beta == pytest.approx(2e-9)
    topk = model.compress["topk:ratio=0.01,residual=true"]
    assert topk.form == "dlogd" and topk.a == pytest.approx(2e-9) and topk.errors["linear"] > 0.01
    rk = model.compress[str(parse_spec("randomk:ratio=0.01"))]
    assert rk.form == "linear" and rk.b == pytest.approx(3e-5)
    # top-k of 1e6 floats: 2 allgathers of k = 1e4 int32 indices and float32 values (DESIGN: 2(a + b*4*N*k))
    assert model.comm_seconds("topk:ratio=0.01", 4e6) == pytest.approx(2 * (5e-5 + 1e-9 * 4 * world * 1e4))
    assert model.comm_seconds("none", 4e6) == pytest.approx(1e-4 + 2e-9 * 4e6)
    assert model.comm_seconds("fp16", 4e6) == pytest.approx(1e-4 + 2e-9 * 2e6)
    assert payload("threshold", 1000.0, density=0.1)[2] == 800
    assert "dlogd" in describe(model)


def test_cost_model_json_cache_and_world_scaling(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDCOMPRESS_CACHE", str(tmp_path))
    model = CostModel.from_link(4, gbit_per_s=1.0, latency_s=50e-6,
                                compress={"topk:ratio=0.01": ComputeFit("dlogd", 1e-9, 1e-5)})
    assert model.allreduce.alpha == pytest.approx(2 * 3 * 50e-6) and model.allreduce.beta == pytest.approx(2 * 0.75 * 8e-9)
    path = model.save()
    assert path == cache_path(4) and path.startswith(str(tmp_path))
    assert CostModel.load(path) == model == CostModel.cached(4)
    assert CostModel.cached(4, hosts=["node1", "node2"]) is None
    assert json.load(open(path))["key"] == model.key
    same = model.for_world_size(4)
    assert same.allreduce.alpha == pytest.approx(model.allreduce.alpha)
    assert same.allgather.beta == pytest.approx(model.allgather.beta)
    big = model.for_world_size(64, gbit_per_s=10.0)
    assert big.allreduce.alpha == pytest.approx(2 * 63 * 50e-6) and big.allgather.beta == pytest.approx(63 / 64 * 0.8e-9)
    with pytest.raises(ValueError, match="no compression-time fit for 'topk:ratio=0.1"):
        model.compress_seconds("topk:ratio=0.1", 100.0)


@pytest.mark.parametrize("text,expected", [
    ("layerwise", "layerwise"), ("single", "single"), (" Size:64 ", "size:64"), ("size:0.5", "size:0.5"),
    ("mgs", "mgs"), ("mgwfbp:greedy", "mgwfbp:greedy"), ("mgs:dp", "mgs"), (None, "auto"), ("auto", "auto")])
def test_schedule_strings(text, expected):
    assert str(parse_schedule(text)) == expected
    assert parse_schedule(parse_schedule(text)) == parse_schedule(text)


@pytest.mark.parametrize("text", ["", "fusion", "size", "size:", "size:-1", "size:inf", "size:x", "mgs:fast",
                                  "layerwise:3", 64])
def test_bad_schedule_strings_name_the_accepted_forms(text):
    with pytest.raises(ValueError, match="schedule") as err:
        parse_schedule(text)
    if not str(text).startswith("size:"):
        assert "'layerwise', 'single', 'size:<MB>'" in str(err.value) and "'mgs', 'mgwfbp'" in str(err.value)


def test_make_plan_defaults_and_predictions():
    rng = np.random.default_rng(5)
    sizes = rng.integers(100, 400_000, 40) * 4.0
    t_b = rng.uniform(1e-5, 1e-3, 40)
    model = CostModel.from_link(4, 1.0, 100e-6, {"topk:ratio=0.01": ComputeFit("dlogd", 2e-9, 2e-5)})
    sparse = make_plan(None, sizes, t_b, model, "topk:ratio=0.01", 4, forward_seconds=0.01, update_seconds=0.002)
    dense = make_plan("auto", sizes, t_b, model, "none", 4)
    assert sparse.schedule == "mgs" and dense.schedule == "mgwfbp"
    assert sparse.predicted_seconds == pytest.approx(0.012 + sparse.timeline.end)
    for sched in ("layerwise", "single", "size:1", "mgs:greedy"):
        other = make_plan(sched, sizes, t_b, model, "topk:ratio=0.01", 4, forward_seconds=0.01,
                          update_seconds=0.002)
        assert other.predicted_seconds >= sparse.predicted_seconds * (1 - 1e-12), sched
    # mgwfbp searches without compression time but predicts with it
    mgw = make_plan("mgwfbp", sizes, t_b, model, "topk:ratio=0.01", 4)
    assert mgw.predicted_seconds >= sparse.predicted_seconds - 0.012 - 1e-12
    # a plan for 64 workers uses the extrapolated model
    far = make_plan("mgs", sizes, t_b, model, "topk:ratio=0.01", 64)
    assert far.predicted_seconds > sparse.predicted_seconds - 0.012
    assert json.loads(json.dumps(sparse.as_dict()))["groups"] == sparse.groups
    # schedules that need a model say so; mgs needs the compressor's compression-time fit
    with pytest.raises(ValueError, match="needs a cost model"):
        make_plan("mgs", sizes, None, model, "topk")
    with pytest.raises(ValueError, match="no fit for it"):
        make_plan("mgs", sizes, t_b, model, "randomk")
    assert make_plan("mgwfbp", sizes, t_b, model, "randomk").notes
    assert make_plan("layerwise", [], [], model).groups == []
    with pytest.raises(ValueError, match="equal length"):
        make_plan("mgs", sizes, t_b[:3], model, "topk:ratio=0.01")
    with pytest.raises(ValueError, match="overlap"):
        make_plan("single", sizes, t_b, model, overlap="gpu")


def test_plain_scalar_cost_functions_are_accepted():
    sizes, t_b = [400.0, 4000.0, 40.0], [1e-3, 1e-3, 1e-3]
    best = optimal(sizes, t_b, lambda b: 1e-6 * math.log2(b + 1), lambda b: 1e-3 + 1e-8 * b).seconds
    brute = brute_force(sizes, t_b, lambda b: 1e-6 * math.log2(b + 1), lambda b: 1e-3 + 1e-8 * b).seconds
    assert best == pytest.approx(brute)
    assert isinstance(Schedule("mgs"), Schedule)


def test_carrying_a_model_to_more_workers_keeps_the_fixed_start_up():
    fitted = CostModel(2, LinearFit(1e-3, 2e-9), LinearFit(8e-4, 1e-9))
    far = fitted.for_world_size(64, gbit_per_s=1.0, latency_s=50e-6)
    assert far.allreduce.alpha == pytest.approx(1e-3 - 2 * 50e-6 + 2 * 63 * 50e-6)
    assert far.allgather.alpha == pytest.approx(8e-4 - 50e-6 + 63 * 50e-6)
    assert far.allreduce.beta == pytest.approx(2 * 63 / 64 * 8e-9)
    assert fitted.for_world_size(64).allreduce.alpha == pytest.approx(63e-3)  # all of it per hop


def test_simulation_predicts_efficiency_and_compares_with_measurements(tmp_path, capsys):
    from hvdcompress.schedule import scaling

    work = scaling.synthetic_workload(60, 40.0, 80.0, 40.0)
    assert len(work.names) == 60 and sum(work.sizes_bytes) == pytest.approx(40 * MIB, rel=0.01)
    assert sum(work.t_b) == pytest.approx(0.08)
    model = CostModel.from_link(4, 10.0, 20e-6, {"topk:ratio=0.01": ComputeFit("dlogd", 1e-9, 5e-5)})
    rows = scaling.sweep(work, model, ["none", "topk:ratio=0.01"], ["layerwise", "single", "auto"],
                          [16, 256], [1.0, 10.0])
    assert len(rows) == 2 * 2 * 3 * 2
    for r in rows:
        assert 0 < r["efficiency"] <= 1 and r["speedup"] == pytest.approx(r["workers"] * r["efficiency"])
    pick = {(r["gbps"], r["compression"], r["schedule"], r["workers"]): r["efficiency"] for r in rows}
    for key in [(g, c, n) for g in (1.0, 10.0) for c in ("none", "topk:ratio=0.01,residual=true") for n in (16, 256)]:
        g, c, n = key
        assert pick[(g, c, "auto", n)] >= max(pick[(g, c, "layerwise", n)], pick[(g, c, "single", n)]) - 1e-12
    assert pick[(1.0, "none", "auto", 16)] < pick[(10.0, "none", "auto", 16)]  # slower links hurt dense
    measured = [{"workers": 4, "compression": "none", "schedule": "single", "seconds": 0.2}]
    (row,) = scaling.compare(measured, work, model)
    assert row["rel_error"] == pytest.approx(row["step_seconds"] / 0.2 - 1)

    out = tmp_path / "sim.json"
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    assert scaling.main(["--link", "1,50", "--synthetic", "30,10,50,20", "--workers", "16,64",
                          "--gbps", "1,10", "--schedule", "single", "--schedule", "mgwfbp",
                          "--measured", str(tmp_path / "measured.json"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["note"].startswith("PREDICTIONS") and len(result["rows"]) == 2 * 1 * 2 * 2
    assert len(result["measured"]) == 1 and (tmp_path / "sim.png").stat().st_size > 0
    assert "PREDICTIONS" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown schedule"):
        scaling.main(["--link", "1,50", "--synthetic", "3,1,1,1", "--schedule", "fast", "--out", str(out)])


def test_decompression_runs_after_backward_in_group_order():
    # two groups of 10 bytes; backward 1 + 1 s; t_s 0; t_c 1 s each; t_d 0.5 s each
    tl = predict([[0], [1]], [10, 10], [1.0, 1.0], lambda b: 0 * b, lambda b: 0 * b + 1.0, "shared",
                 lambda b: 0 * b + 0.5)
    # exchanges end at 2 and 3; backward ends at 2; finish = max(2, 2) + .5 = 2.5, max(2.5, 3) + .5 = 3.5
    assert tl.comm_end.tolist() == [2.0, 3.0] and tl.finish_end == 3.5 and tl.end == 3.5


def test_cost_model_decompression_and_launch_terms_round_trip():
    fit = ComputeFit("linear", 1e-9, 1e-5)
    model = CostModel.from_link(2, 1.0, 50e-6)
    model = CostModel(2, model.allreduce, model.allgather, {"topk:ratio=0.01": fit}, (), {},
                      {"topk:ratio=0.01": fit}, 2e-5)
    again = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model and "launch: 20.0 us" in describe(again)
    # top-k hands two collectives to Horovod per group: compression + 2 launches
    assert again.group_cpu_seconds("topk:ratio=0.01", 4000.0) == pytest.approx(1e-5 + 1e-9 * 1000 + 4e-5)
    assert again.decompress_seconds("topk:ratio=0.01", 4000.0) == pytest.approx(1e-5 + 1e-6)
    assert again.decompress_seconds("none", 4000.0) == 0.0
    plan = make_plan("single", [4000.0], [0.001], again, "topk:ratio=0.01", 2)
    assert plan.timeline.finish_end is not None and plan.predicted_seconds == pytest.approx(plan.timeline.finish_end)
    with pytest.raises(ValueError, match="launch_seconds"):
        CostModel(2, model.allreduce, model.allgather, launch_seconds=-1.0)
