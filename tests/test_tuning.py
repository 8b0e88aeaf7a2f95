"""Measured validation of cost-model plans (hvdcompress.schedule.tuning) and the exchange-skew term of the
cost model: pure functions, no Horovod."""

import math

import numpy as np
import pytest

from hvdcompress.schedule import tuning
from hvdcompress.schedule.costmodel import ComputeFit, CostModel, skew_factor
from hvdcompress.schedule.planner import MIB, Workload, make_plan
from torch_ops.scheduling import Scheduler, StepClock

SIZES = [4e6, 4e6, 1e6, 1e6, 2e5, 2e5, 1e5, 1e5]  # bytes, backward order
T_B = [0.0, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01]
FIT = ComputeFit("linear", 2e-9, 1e-4)


def _model(latency=2e-3, skew=0.0):
    m = CostModel.from_link(2, gbit_per_s=1.0, latency_s=latency, compress={"topk:ratio=0.01": FIT})
    return m.with_skew(skew)


def _plan_fn(model, spec="topk:ratio=0.01"):
    work = Workload(tuple(f"p{i}" for i in range(len(SIZES))), tuple(SIZES), tuple(T_B), 0.05, 0.01)
    return lambda s: work.plan(s, model, spec, 2)


# --- check_tune_steps ---------------------------------------------------------------------------
@pytest.mark.parametrize("good", [0, 1, 3, 100])
def test_tune_steps_accepts_ints_in_range(good):
    assert tuning.check_tune_steps(good) == good


@pytest.mark.parametrize("bad", [-1, 101, 2.0, True, "3", None])
def test_tune_steps_errors_name_the_parameter_and_range(bad):
    with pytest.raises(ValueError, match=r"^tune_steps: must be an int in \[0, 100\]"):
        tuning.check_tune_steps(bad)


# --- propose ------------------------------------------------------------------------------------
def test_propose_puts_the_asked_plan_first_then_the_other_search_single_and_size_plans():
    plan_fn = _plan_fn(_model())
    cands = tuning.propose(plan_fn, "mgs", SIZES, max_candidates=10)
    labels = [c.label for c in cands]
    assert labels[0] == "mgs"
    assert [list(g) for g in cands[0].groups] == plan_fn("mgs").groups
    assert cands[0].predicted_seconds == pytest.approx(plan_fn("mgs").predicted_seconds)
    # duplicates (same groups) are dropped, whatever their label
    groups = [c.groups for c in cands]
    assert len(set(groups)) == len(groups)
    expected = ["mgs", "mgs:greedy", "single", tuning.size_label(sum(SIZES) / 4),
                tuning.size_label(sum(SIZES) / 16), "layerwise"]
    kept = []
    seen = set()
    for s in expected:
        p = plan_fn(s)
        g = tuple(tuple(x) for x in p.groups)
        if g in seen:
            continue
        if s == "layerwise":
            best = min(c.predicted_seconds for c in cands if c.label != "layerwise")
            if p.predicted_seconds > tuning.LAYERWISE_WITHIN * best:
                continue
        seen.add(g)
        kept.append(s)
    assert labels == kept
    for c in cands:  # every candidate partitions the tensors in order
        assert [i for g in c.groups for i in g] == list(range(len(SIZES)))


def test_propose_greedy_schedule_offers_the_exact_search_second():
    cands = tuning.propose(_plan_fn(_model()), "mgwfbp:greedy", SIZES, max_candidates=10)
    assert cands[0].label == "mgwfbp:greedy"
    exact = _plan_fn(_model())("mgwfbp").groups
    if exact != _plan_fn(_model())("mgwfbp:greedy").groups:
        assert cands[1].label == "mgwfbp"


def test_propose_caps_the_number_of_candidates():
    assert len(tuning.propose(_plan_fn(_model()), "mgs", SIZES, max_candidates=2)) == 2
    with pytest.raises(ValueError, match="max_candidates"):
        tuning.propose(_plan_fn(_model()), "mgs", SIZES, max_candidates=0)


def test_propose_leaves_layerwise_out_when_the_model_predicts_it_far_slower():
    slow_start = _model(latency=50e-3)  # 50 ms per collective: 16 exchanges of layerwise cost far more
    assert "layerwise" not in [c.label for c in tuning.propose(_plan_fn(slow_start), "mgs", SIZES, max_candidates=10)]
    cheap = _model(latency=1e-7)
    lw = _plan_fn(cheap)("layerwise").predicted_seconds
    best = min(c.predicted_seconds for c in tuning.propose(_plan_fn(cheap), "mgs", SIZES, max_candidates=10))
    assert lw <= tuning.LAYERWISE_WITHIN * best  # nearly free collectives: layerwise is worth trying
    labels_or_groups = tuning.propose(_plan_fn(cheap), "mgs", SIZES, max_candidates=10)
    assert any(len(c.groups) == len(SIZES) for c in labels_or_groups)


# --- with a per-group codec choice: the fixed choices beside it -----------------------------------
def _fixed(label, groups, codec):
    from types import SimpleNamespace
    return label, SimpleNamespace(groups=[list(g) for g in groups], predicted_seconds=0.5,
                                  codecs=[codec] * len(groups))


def test_with_fixed_choices_puts_the_choice_first_then_every_fixed_choice_then_fills_up():
    choice = tuning.Candidate("mgs", ((0, 1), (2,)), 0.1, ("topk", "none"))
    others = [tuning.Candidate("mgs:greedy", ((0,), (1, 2)), 0.2, ("topk", "topk")),
              tuning.Candidate("single", ((0, 1, 2),), 0.3, ("none",)),
              tuning.Candidate("size:1", ((0,), (1,), (2,)), 0.4, ("topk", "none", "none"))]
    fixed = [_fixed("mgs (all topk)", [[0, 1], [2]], "topk"), _fixed("mgwfbp (all fp16)", [[0, 1, 2]], "fp16"),
             _fixed("mgwfbp (all dense)", [[0, 1, 2]], "none")]
    out = tuning.with_fixed_choices([choice] + others, fixed)
    # "single" is the same plan as "all dense" (same groups, same specs): dropped; at most 5
    assert [c.label for c in out] == ["mgs", "mgs (all topk)", "mgwfbp (all fp16)", "mgwfbp (all dense)",
                                      "mgs:greedy"]
    assert out[0] == choice and out[3].codecs == ("none",) and out[1].groups == ((0, 1), (2,))
    # the fixed choices are never dropped, whatever the cap; the choice stays first
    assert [c.label for c in tuning.with_fixed_choices([choice] + others, fixed, max_candidates=1)] == \
        ["mgs", "mgs (all topk)", "mgwfbp (all fp16)", "mgwfbp (all dense)"]
    # a fixed choice that is the choice itself is not measured twice: the choice keeps its place
    same = tuning.Candidate("mgs", ((0, 1), (2,)), 0.1, ("topk", "topk"))
    assert [c.label for c in tuning.with_fixed_choices([same], fixed)] == ["mgs", "mgwfbp (all fp16)",
                                                                          "mgwfbp (all dense)"]
    with pytest.raises(ValueError, match="max_candidates"):
        tuning.with_fixed_choices([choice], fixed, max_candidates=0)
    with pytest.raises(ValueError, match="no candidates"):
        tuning.with_fixed_choices([], fixed)


def _choice_model(gbps):
    from dataclasses import replace
    from hvdcompress.spec import resolve
    fit = ComputeFit("linear", 2e-9, 1e-4)
    model = CostModel.from_link(2, gbit_per_s=gbps, latency_s=2e-3,
                                compress={"topk:ratio=0.01,residual=true": fit, "fp16:residual=false": fit})
    return replace(model, decompress={str(resolve(s)): fit for s in ("topk:ratio=0.01", "fp16", "none")})


def _choosing_scheduler(schedule, gbps, tune_steps=1, **kw):
    sizes = {f"p{i}": float(s) for i, s in enumerate(SIZES)}
    sched = Scheduler(schedule, _spec(), _choice_model(gbps), 1, sizes, 2, _OneRank(), tune_steps=tune_steps,
                      alternatives=("fp16", "none"), **kw)
    sched.end_of_step(_first_clock(list(sizes)))
    sched.end_of_step(_clock(0.0, list(sizes), 0.2))
    return sched


@pytest.mark.parametrize("gbps", [0.01, 1.0, 100.0])
def test_codec_choice_measures_the_compressor_fp16_and_dense_each_on_its_own_plan(gbps):
    from hvdcompress.spec import resolve
    sched = _choosing_scheduler("auto", gbps)
    cands = sched._tuner.candidates
    assert cands[0].label == "mgs" and list(cands[0].codecs) == sched.plan.codecs  # the choice, first
    assert len(cands) <= tuning.MAX_CHOICE_CANDIDATES
    model = sched._calibrated  # what the plans were made with
    for spec, schedule, name in (("topk:ratio=0.01", "mgs", "topk"), ("fp16", "mgwfbp", "fp16"),
                                 ("none", "mgwfbp", "dense")):
        alone = sched.workload.plan("auto", model, resolve(spec), 2)  # the planner's plan for that spec alone
        assert alone.schedule == schedule
        want = (tuple(tuple(g) for g in alone.groups), (str(resolve(spec)),) * len(alone.groups))
        found = [c for c in cands if (c.groups, c.codecs) == want]
        assert found, (spec, [c.label for c in cands])
        # labelled as that fixed choice, unless it is the choice itself (measured once, first)
        assert found[0].label == f"{schedule} (all {name})" or found[0] is cands[0]
    assert len({(c.groups, c.codecs) for c in cands}) == len(cands)


def test_with_fixed_choices_measures_every_candidate_of_the_spec_alone_then_fills_up():
    choice = tuning.Candidate("mgs", ((0, 1), (2,)), 0.1, ("topk", "none"))
    others = [tuning.Candidate("single", ((0, 1, 2),), 0.3, ("none",)),
              tuning.Candidate("size:1", ((0,), (1,), (2,)), 0.4, ("topk", "none", "none"))]
    fixed = [_fixed("mgs (all topk)", [[0, 1], [2]], "topk"), _fixed("mgwfbp (all fp16)", [[0, 1, 2]], "fp16"),
             _fixed("mgwfbp (all dense)", [[0, 1, 2]], "none")]
    alone = [tuning.everywhere(tuning.Candidate(label, groups, 0.2), "topk", "topk")
             for label, groups in (("mgs", ((0, 1), (2,))), ("single", ((0, 1, 2),)),
                                   ("size:1", ((0,), (1,), (2,))), ("layerwise", ((0,), (1,), (2,))))]
    assert alone[1] == tuning.Candidate("single (all topk)", ((0, 1, 2),), 0.2, ("topk",))
    out = tuning.with_fixed_choices([choice] + others, fixed, spec_alone=alone)
    # the spec alone on its model plan is its fixed choice (measured once); "layerwise" has the
    # groups of "size:1": dropped; the choice's other partitions have no room left (5 already)
    assert [c.label for c in out] == ["mgs", "mgs (all topk)", "mgwfbp (all fp16)", "mgwfbp (all dense)",
                                      "single (all topk)", "size:1 (all topk)"]
    keys = [(c.groups, c.codecs) for c in out]
    assert len(set(keys)) == len(keys) and all((c.groups, c.codecs) in keys for c in alone)
    # never dropped, whatever the cap; with room, the choice's other partitions follow ("single"
    # sends everything dense: the same plan as "mgwfbp (all dense)")
    assert [c.label for c in tuning.with_fixed_choices([choice] + others, fixed, 1, alone)] == \
        [c.label for c in out]
    assert [c.label for c in tuning.with_fixed_choices([choice] + others, fixed, 8, alone)][6:] == ["size:1"]


def _choice_off_and_on(schedule, gbps, sizes_bytes):
    """The candidates of the measured validation for the same workload and cost model, without
    and with the codec choice."""
    sizes = {f"p{i}": float(s) for i, s in enumerate(sizes_bytes)}
    out = []
    for alt in ((), ("fp16", "none")):
        sched = Scheduler(schedule, _spec(), _choice_model(gbps), 1, sizes, 2, _OneRank(), tune_steps=1,
                          alternatives=alt)
        sched.end_of_step(_first_clock(list(sizes)))
        sched.end_of_step(_clock(0.0, list(sizes), 0.2))
        out.append(sched)
    return out


VGG_LIKE = [4.1e6, 1.6e4, 6.7e7, 1.6e4, 4.1e8, 1.6e4] + [9.4e6, 2e3] * 6 + [1.5e5, 2.6e2]  # the FC layers first


@pytest.mark.parametrize("sizes_bytes", [SIZES, VGG_LIKE])
@pytest.mark.parametrize("schedule", ["auto", "mgs:greedy", "mgwfbp"])
@pytest.mark.parametrize("gbps", [0.01, 0.1, 1.0, 100.0])
def test_codec_choice_measures_every_candidate_the_spec_alone_would(schedule, gbps, sizes_bytes):
    off, on = _choice_off_and_on(schedule, gbps, sizes_bytes)
    spec = str(_spec())
    keys = [(c.groups, c.codecs) for c in on._tuner.candidates]
    assert len(set(keys)) == len(keys) <= tuning.MAX_CHOICE_CANDIDATES  # deduplicated, bounded
    assert on._tuner.candidates[0].codecs == tuple(on.plan.codecs)  # the choice, first
    wanted = off._tuner.candidates if off._tuner else [tuning.candidate(off.plan.schedule, off.plan)]
    for c in wanted:  # the spec alone on each of its own partitions, with its spec on every group
        assert c.codecs is None and (c.groups, (spec,) * len(c.groups)) in keys, (c.label, keys)
    # a checkpoint taken while they run restores the same candidates
    again = Scheduler(schedule, _spec(), _choice_model(gbps), 1, {f"p{i}": float(s) for i, s in
                      enumerate(sizes_bytes)}, 2, _OneRank(), tune_steps=1, alternatives=("fp16", "none"))
    assert again.restore(on.plan_dict()) is not None and again._tuner.candidates == on._tuner.candidates


def test_codec_choice_on_a_fixed_partition_measures_the_same_groups_with_each_spec():
    sched = _choosing_scheduler("size:1", 100.0)
    cands = sched._tuner.candidates
    assert all(c.groups == cands[0].groups for c in cands) and cands[0].label == "size:1"
    fixed = {c.label: set(c.codecs) for c in cands[1:]}
    assert fixed.get("size:1 (all fp16)") == {"fp16:residual=false"} and fixed.get("size:1 (all dense)") == {"none"}


def test_candidate_round_trips_through_a_dict():
    c = tuning.Candidate("size:1", ((0, 1), (2,)), 0.25)
    assert tuning.Candidate.from_dict(c.to_dict()) == c
    assert tuning.Candidate.from_dict(tuning.Candidate("single", ((0,),), None).to_dict()).predicted_seconds is None


# --- step_times and select ----------------------------------------------------------------------
def test_step_times_take_the_slowest_rank_per_step():
    per_rank = [[[1.0, 2.0], [3.0]], [[1.5, 1.0], [2.0]]]
    assert tuning.step_times(per_rank) == [[1.5, 2.0], [3.0]]
    with pytest.raises(ValueError, match="same steps"):
        tuning.step_times([[[1.0, 2.0]], [[1.0]]])


def test_select_keeps_the_smallest_median():
    kept, medians = tuning.select([[0.50, 0.52, 0.90], [0.40, 0.41, 0.60], [0.45, 0.30, 0.46]])
    assert medians == pytest.approx([0.52, 0.41, 0.45])
    assert kept == 1


def test_select_breaks_ties_within_tolerance_towards_the_earliest():
    times = [[1.015, 1.015, 1.015], [1.0, 1.0, 1.0]]
    assert tuning.select(times, tolerance=0.02)[0] == 0  # 1.5% slower: a tie, the model's plan kept
    assert tuning.select(times, tolerance=0.01)[0] == 1
    assert tuning.select(times, tolerance=0.0)[0] == 1


def test_select_ignores_candidates_without_a_measurement():
    kept, medians = tuning.select([[float("nan")], [0.7, None, 0.9], []])
    assert kept == 1 and math.isinf(medians[0]) and medians[1] == pytest.approx(0.8)
    assert tuning.select([[], [float("nan")]])[0] == 0
    with pytest.raises(ValueError, match="tolerance"):
        tuning.select([[1.0]], tolerance=1.0)
    with pytest.raises(ValueError, match="no candidates"):
        tuning.select([])


def test_step_noise_pools_each_candidates_pairwise_differences_relative_to_its_median():
    assert tuning.step_noise([[1.0, 1.0, 1.0], [2.0, 2.0]]) == 0.0
    assert tuning.step_noise([[1.0], [2.0], [], [float("nan"), 3.0]]) == 0.0  # one step each: nothing to tell
    pair_median = math.sqrt(2) * 0.6744897501960817  # of |X - Y|, X and Y normal of unit deviation
    # pairs 0.1, 0.2, 0.1 of a 1.0 median: their median 0.1
    assert tuning.step_noise([[0.9, 1.0, 1.1]]) == pytest.approx(0.1 / pair_median)
    # relative: a candidate ten times slower with the same spread is the same noise; the
    # candidates' differences are not noise (each is compared with itself only)
    assert tuning.step_noise([[0.9, 1.0, 1.1], [9.0, 10.0, 11.0, None]]) == pytest.approx(0.1 / pair_median)
    # robust: a step 5x too slow moves two of its candidate's three pairs (the third, 0.2 / 1.1,
    # is the pooled median), not the estimate's scale
    assert tuning.step_noise([[0.9, 1.0, 1.1], [1.0, 1.1, 0.9], [0.9, 1.1, 5.0]]) == pytest.approx(
        0.2 / 1.1 / pair_median)


def test_noisy_equal_candidates_do_not_move_the_choice_off_the_model_pick():
    # the model's pick first, then two other partitions, every step within +-8% of the same time:
    # the 2% rule alone keeps whichever measured luckiest; within the noise the model's pick stays
    times = [[1.00, 0.93, 1.08], [0.97, 1.06, 0.91], [1.10, 1.02, 0.95]]
    assert tuning.select(times)[0] == 1
    kept, medians = tuning.select(times, noise_z=tuning.NOISE_Z)
    assert kept == 0 and medians == pytest.approx([1.0, 0.97, 1.02])
    # a gain far beyond the noise is kept; among the others, the earliest within 2% as before
    clear = [[1.00, 1.01, 0.99], [0.80, 0.81, 0.79], [0.81, 0.80, 0.80]]
    assert tuning.select(clear, noise_z=tuning.NOISE_Z)[0] == 1
    # no noise measured: the tolerance alone, as without noise_z
    quiet = [[1.015] * 3, [1.0] * 3]
    assert tuning.select(quiet, noise_z=1.0)[0] == 0 and tuning.select(quiet, tolerance=0.01, noise_z=1.0)[0] == 1
    assert tuning.select([[1.1], [1.0]], noise_z=1.0)[0] == 1  # one step each: no noise to tell
    # the model's pick without a measurement is never kept
    assert tuning.select([[float("nan")], [1.0, 1.1], [1.2, 1.0]], noise_z=1.0)[0] == 1
    with pytest.raises(ValueError, match="noise_z"):
        tuning.select(times, noise_z=-1)


@pytest.mark.parametrize("truth, keeps_best_old, keeps_best_new", [
    ([0.96] + [1.0] * 7, (0.0, 0.65), (0.75, 1.0)),  # the model's pick 4% faster than seven other partitions
    ([1.0] * 5 + [0.75] + [1.0] * 2, (0.98, 1.0), (0.98, 1.0)),  # another 25% faster: found by both
])
def test_noise_rule_keeps_the_better_plan_more_often_over_noisy_trials(truth, keeps_best_old, keeps_best_new):
    """8 candidates (the codec choice's longest list), 3 measured steps each, every step with a
    6% relative noise: how often each rule keeps the truly fastest candidate over 400 seeded trials."""
    rng = np.random.default_rng(39)
    best, trials = int(np.argmin(truth)), 400
    old = new = 0
    regret_old = regret_new = 0.0
    for _ in range(trials):
        times = [list(t * (1 + 0.06 * rng.standard_normal(3))) for t in truth]
        a, b = tuning.select(times)[0], tuning.select(times, noise_z=tuning.NOISE_Z)[0]
        old, new = old + (a == best), new + (b == best)
        regret_old, regret_new = regret_old + truth[a] / truth[best] - 1, regret_new + truth[b] / truth[best] - 1
    assert keeps_best_old[0] <= old / trials <= keeps_best_old[1]
    assert keeps_best_new[0] <= new / trials <= keeps_best_new[1]
    assert regret_new <= regret_old + 1e-12


def test_the_codec_choice_keeps_its_model_pick_within_the_measured_noise():
    """The scheduler's rule: with the codec choice, the noise rule (the step noise in the record);
    without it, the 2% rule."""
    names = [f"p{i}" for i in range(len(SIZES))]
    sched = _choosing_scheduler("auto", 1.0, tune_steps=3)
    n = len(sched._tuner.candidates)
    assert n >= 3
    # every candidate within +-8% of the same step; candidate 1 measures 3% faster by luck
    wobble = [[1.00, 0.93, 1.08], [0.97, 1.06, 0.91]] + [[1.10, 1.02, 0.95]] * (n - 2)
    for rnd in range(1 + sched.tune_steps):
        for ci in range(n):
            sched.end_of_step(_clock(0.0, names, 0.1 if rnd == 0 else 0.1 * wobble[ci][rnd - 1]))
    record = sched.plan.tuning
    assert record["kept"] == 0 and record["noise_z"] == tuning.NOISE_Z
    assert record["step_noise"] == pytest.approx(tuning.step_noise([[0.1 * x for x in w] for w in wobble]))
    assert record["medians_seconds"][1] < record["medians_seconds"][0] / 1.02  # beyond the 2% tolerance
    sizes = {n_: float(s) for n_, s in zip(names, SIZES)}
    plain = Scheduler("mgs", _spec(), _model(), 1, sizes, 1, _OneRank(), tune_steps=3)
    plain.end_of_step(_first_clock(names))
    plain.end_of_step(_clock(0.0, names, 0.2))
    m = len(plain._tuner.candidates)
    wobble = [[1.00, 0.93, 1.08], [0.97, 1.06, 0.91]] + [[1.10, 1.02, 0.95]] * (m - 2)
    for rnd in range(1 + plain.tune_steps):
        for ci in range(m):
            plain.end_of_step(_clock(0.0, names, 0.1 if rnd == 0 else 0.1 * wobble[ci][rnd - 1]))
    assert plain.plan.tuning["kept"] == 1 and plain.plan.tuning["noise_z"] == 0.0


def test_summary_names_every_candidate_and_the_kept_one():
    cands = [tuning.Candidate("mgs", ((0, 1),), 0.3), tuning.Candidate("single", ((0,), (1,)), 0.4)]
    line = tuning.summary(cands, [0.5, 0.25], 1)
    assert "mgs (1 groups) 500.0 ms" in line and "single (2 groups) 250.0 ms" in line and line.endswith("kept single")


# --- the exchange-skew term ---------------------------------------------------------------------
def test_skew_factor_charges_the_unexplained_time_to_compression_plus_transfer():
    assert skew_factor(0.05, 0.01, 0.03) == pytest.approx(1.0)  # 40 ms unexplained over 40 ms of work
    assert skew_factor(0.005, 0.01, 0.03) == 0.0  # faster than modelled: no negative skew
    assert skew_factor(10.0, 0.01, 0.0) == 20.0  # capped
    assert skew_factor(0.5, 0.0, 0.0) == 0.0  # nothing to scale
    with pytest.raises(ValueError):
        skew_factor(float("nan"), 0.0, 0.0)


def test_skew_is_charged_to_the_closing_exchange_only_and_round_trips():
    m0, m1 = _model(), _model(skew=0.5)
    b = np.array([1e5, 4e6])
    t_c = m0.comm_seconds("topk:ratio=0.01", b)
    cpu = m0.group_cpu_seconds("topk:ratio=0.01", b)
    assert np.allclose(m0.exchange_seconds("topk:ratio=0.01", b), t_c)
    assert np.allclose(m0.closing_seconds("topk:ratio=0.01", b), 0.0)
    assert np.allclose(m1.exchange_seconds("topk:ratio=0.01", b), t_c)  # exchanges during backward
    assert np.allclose(m1.closing_seconds("topk:ratio=0.01", b), 0.5 * (t_c + cpu))
    assert np.allclose(m1.exchange_seconds("topk:ratio=0.01", b) + m1.closing_seconds("topk:ratio=0.01", b),
                       t_c + 0.5 * (t_c + cpu))
    assert CostModel.from_dict(m1.to_dict()).exchange_skew == 0.5
    assert m1.scaled(2.0, 1.0).exchange_skew == 0.5 and m1.for_world_size(4).exchange_skew == 0.5
    with pytest.raises(ValueError, match="exchange_skew"):
        _model(skew=-1.0)


def test_skew_makes_the_planner_split_a_large_group_whose_exchange_waits():
    # the plan with no skew sends one group; with a large measured skew, exchanging a big group
    # after backward costs more than several that overlap backward
    sizes, t_b = [8e6, 8e6, 8e6, 8e6], [0.0, 0.02, 0.02, 0.02]
    fit = {"topk:ratio=0.01": ComputeFit("linear", 5e-9, 0.005)}  # 5 ms per group: merging saves it
    base = CostModel.from_link(2, gbit_per_s=10.0, latency_s=5e-3, compress=fit)
    no_skew = make_plan("mgs", sizes, t_b, base, "topk:ratio=0.01", 2)
    skewed = make_plan("mgs", sizes, t_b, base.with_skew(3.0), "topk:ratio=0.01", 2)
    assert len(no_skew.groups) == 1 and len(skewed.groups) > 1
    assert skewed.predicted_seconds > no_skew.predicted_seconds
    # the skew lengthens the closing exchange only: the groups before it keep their exchange time
    tl, spec = skewed.timeline, "topk:ratio=0.01"
    nbytes = np.array([sum(sizes[i] for i in g) for g in skewed.groups])
    took = tl.comm_end - tl.comm_start
    assert np.allclose(took[:-1], base.comm_seconds(spec, nbytes[:-1], 2))
    skewed_model = base.with_skew(3.0)
    assert took[-1] == pytest.approx(float((skewed_model.exchange_seconds(spec, nbytes[-1:], 2)
                                            + skewed_model.closing_seconds(spec, nbytes[-1:], 2))[0]))


# --- the scheduler's measured validation, driven without Horovod ----------------------------------
class _OneRank:
    """A Communicator of one rank: collectives return what this rank gives."""

    def rank(self):
        return 0

    def size(self):
        return 1

    def broadcast_object(self, obj, name):
        return obj

    def allgather_object(self, obj, name):
        return [obj]


def _clock(prev_end, names, step_seconds, hook=1e-4):
    c = StepClock(prev_end)
    t = prev_end + 0.01
    for n in names:
        c.hooks.append((n, t, t + hook))
        t += 0.002
    c.sync = (t, t + 0.001)
    c.update = (t + 0.001, prev_end + step_seconds)
    return c


def test_scheduler_measures_each_candidate_and_keeps_the_fastest_and_resumes_mid_way():
    sizes = {f"p{i}": float(s) for i, s in enumerate(SIZES)}
    names = list(sizes)
    sched = Scheduler("mgs", _spec(), _model(), 1, sizes, 1, _OneRank(), tune_steps=2)
    t = 0.0
    groups = sched.end_of_step(_first_clock(names))
    assert groups == [names]  # profiling with one group
    groups = sched.end_of_step(_clock(t, names, 0.2))
    assert sched.tuning and sched.plan is not None and sched.plan.schedule == "mgs"
    cands = sched._tuner.candidates
    assert [[names[i] for i in g] for g in cands[0].groups] == groups
    # the candidate labelled "single" is the fastest; they take turns: a settling round, 2 measured
    fast = next(i for i, c in enumerate(cands) if c.label == "single")
    n, saved = len(cands), None
    for rnd in range(3):
        for ci in range(n):
            if rnd == 1 and ci == 1:
                saved = sched.plan_dict()  # mid-way: round 1, candidate 1 next
            out = sched.end_of_step(_clock(t, names, 0.05 if ci == fast else 0.3 + 0.01 * ci))
            if (rnd, ci) != (2, n - 1):  # every step but the last switches to the next candidate
                assert out == [[names[i] for i in g] for g in cands[(ci + 1) % n].groups]
    assert not sched.tuning and sched.done
    assert sched.plan.tuning["kept_label"] == "single" and sched.plan.groups == [list(range(len(names)))]
    assert sched.plan.tuning["medians_seconds"][fast] == pytest.approx(0.05)
    assert len(sched.plan.tuning["candidates"]) == n and sched.plan.tuning["tune_steps"] == 2
    assert any("kept single" in note for note in sched.plan.notes)
    # a checkpoint saved mid-way goes on where it was: the candidate's groups, then the rest
    progress = saved["tuning"]["in_progress"]
    assert progress["index"] == 1 and progress["round"] == 1 and progress["times"][0] and not progress["times"][1]
    again = Scheduler("mgs", _spec(), _model(), 1, sizes, 1, _OneRank(), tune_steps=2)
    in_use = again.restore(saved)
    assert in_use == [[names[i] for i in g] for g in cands[1].groups] and again.tuning
    assert again._tuner.times == progress["times"] and again.plan.groups == sched.plan.tuning["candidates"][0]["groups"]
    # a checkpoint saved afterwards holds the kept plan: no tuning again
    done = Scheduler("mgs", _spec(), _model(), 1, sizes, 1, _OneRank(), tune_steps=2)
    assert done.restore(sched.plan_dict()) == [names] and done.done
    assert done.plan.tuning["kept_label"] == "single"


def test_scheduler_without_tuning_keeps_the_model_plan():
    sizes = {f"p{i}": float(s) for i, s in enumerate(SIZES)}
    names = list(sizes)
    sched = Scheduler("mgs", _spec(), _model(), 1, sizes, 1, _OneRank(), tune_steps=0)
    sched.end_of_step(_first_clock(names))
    sched.end_of_step(_clock(0.0, names, 0.2))
    assert sched.done and not sched.tuning and sched.plan.tuning is None
    assert set(sched.calibration) == {"compress", "decompress", "skew"} and sched.calibration["skew"] >= 0


# --- re-validation on drift ---------------------------------------------------------------------
@pytest.mark.parametrize("good", [0, tuning.MIN_REVALIDATE_EVERY, 100, tuning.MAX_REVALIDATE_EVERY])
def test_revalidate_every_accepts_zero_or_ints_in_range(good):
    assert tuning.check_revalidate_every(good) == good


def test_revalidate_every_defaults_to_on_with_the_codec_choice_only():
    assert tuning.check_revalidate_every(None, choosing=True) == tuning.DEFAULT_REVALIDATE_EVERY
    assert tuning.check_revalidate_every(None) == 0


@pytest.mark.parametrize("bad", [-1, 1, 2, tuning.MAX_REVALIDATE_EVERY + 1, 10.0, True, "100"])
def test_revalidate_every_errors_name_the_parameter_and_range(bad):
    with pytest.raises(ValueError, match=r"^revalidate_every: must be None .* or an int in \[3, 1000000\]"):
        tuning.check_revalidate_every(bad)


def test_window_median_takes_the_slowest_rank_per_step_and_skips_unknown_steps():
    assert tuning.window_median([[0.1, 0.3, 0.2], [0.2, 0.1, float("nan")]]) == pytest.approx(0.25)
    assert tuning.window_median([[0.1, 0.4, 0.2]]) == pytest.approx(0.2)
    assert math.isnan(tuning.window_median([[float("nan")], [0.1]]))
    with pytest.raises(ValueError, match="same steps"):
        tuning.window_median([[0.1, 0.2], [0.1]])


def test_drift_rule_fires_beyond_the_threshold_either_way():
    ref = 0.2
    assert tuning.DRIFT_THRESHOLD == 0.25
    assert not tuning.drifted(0.24, ref) and not tuning.drifted(0.16, ref)  # within 25%: kept
    assert tuning.drifted(0.26, ref) and tuning.drifted(0.14, ref)  # slower or faster by more: re-validate
    assert tuning.drifted(0.23, ref, threshold=0.1) and not tuning.drifted(0.23, ref, threshold=0.2)
    for unknown in ((0.3, None), (float("nan"), ref), (0.3, 0.0), (0.3, float("inf"))):
        assert not tuning.drifted(*unknown)
    with pytest.raises(ValueError, match="threshold"):
        tuning.drifted(0.3, ref, threshold=0)


def _validate(sched, names, t_fast=0.05, t_slow=0.3):
    """Drives one measured validation; the candidate labelled with dense everywhere is the fastest."""
    n = len(sched._tuner.candidates)
    fast = next(i for i, c in enumerate(sched._tuner.candidates) if "dense" in c.label)
    out = None
    for _ in range(1 + sched.tune_steps):
        for ci in range(n):
            out = sched.end_of_step(_clock(0.0, names, t_fast if ci == fast else t_slow))
    assert not sched.tuning
    return fast, out


def test_drift_watch_sets_a_reference_then_revalidates_when_the_step_time_moves():
    names = [f"p{i}" for i in range(len(SIZES))]
    every = 4
    sched = _choosing_scheduler("auto", 1.0, revalidate_every=every)
    assert sched.tuning and not sched.watching
    fast, _ = _validate(sched, names)
    assert sched.watching and sched.plan.tuning["revalidations"] == 0 and sched.plan.tuning["drift"] is None
    kept = sched.plan.tuning["kept"]
    assert kept == fast != 0  # the choice (top-k here) was not kept
    # first window: the reference (no regrouping); the next, within 25% of it: nothing happens
    for t in [0.10] * every + [0.11, 0.12, 0.09, 0.11]:
        assert sched.end_of_step(_clock(0.0, names, t)) is None and sched.watching and not sched.tuning
    saved = sched.plan_dict()
    assert saved["watch"] == {"reference_seconds": pytest.approx(0.10), "times": []}
    # two steps into a window, then a checkpoint: the watch goes on where it was
    for t in (0.2, 0.2):
        assert sched.end_of_step(_clock(0.0, names, t)) is None
    mid = sched.plan_dict()
    assert mid["watch"]["times"] == pytest.approx([0.2, 0.2])
    again = Scheduler("auto", _spec(), _choice_model(1.0), 1, {n: float(s) for n, s in zip(names, SIZES)}, 2,
                      _OneRank(), tune_steps=1, alternatives=("fp16", "none"), revalidate_every=every)
    assert again.restore(mid) is not None and again.watching and again.plan_dict()["watch"] == mid["watch"]
    # a window 2x slower: the same candidates run again, the choice first, on both
    for s in (sched, again):
        assert s.end_of_step(_clock(0.0, names, 0.2)) is None
        out = s.end_of_step(_clock(0.0, names, 0.2))
        first = s.plan_dict()["tuning"]["in_progress"]
        assert s.tuning and not s.watching
        assert [c["label"] for c in first["candidates"]] == [c["label"] for c in saved["tuning"]["candidates"]]
        assert out == [[names[i] for i in g] for g in first["candidates"][0]["groups"]]
        assert first["drift"] == {"reference_seconds": pytest.approx(0.10), "window_seconds": pytest.approx(0.2),
                                  "count": 1}
        # now the choice is the fastest: kept, the count and the trigger recorded
        for _ in range(1 + s.tune_steps):
            for ci in range(len(first["candidates"])):
                s.end_of_step(_clock(0.0, names, 0.05 if ci == 0 else 0.3))
        assert s.plan.tuning["kept"] == 0 and s.plan.tuning["revalidations"] == 1
        assert s.plan.tuning["drift"]["window_seconds"] == pytest.approx(0.2)
        assert s.plan.codecs == list(first["candidates"][0]["codecs"]) and s.watching
        assert s.plan_dict()["watch"] == {"reference_seconds": None, "times": []}  # a new reference next
    assert sched.plan_dict() == again.plan_dict()


def test_drift_watch_is_off_with_revalidate_every_zero_or_without_the_codec_choice():
    names = [f"p{i}" for i in range(len(SIZES))]
    sched = _choosing_scheduler("auto", 1.0, revalidate_every=0)
    _validate(sched, names)
    assert not sched.watching and "watch" not in sched.plan_dict()
    for _ in range(10):
        assert sched.end_of_step(_clock(0.0, names, 0.1 * (1 + _))) is None
    sizes = {n: float(s) for n, s in zip(names, SIZES)}
    plain = Scheduler("mgs", _spec(), _model(), 1, sizes, 1, _OneRank(), tune_steps=1)
    assert plain.revalidate_every == 0
    on = Scheduler("mgs", _spec(), _model(), 1, sizes, 1, _OneRank(), tune_steps=1, revalidate_every=5)
    assert on.revalidate_every == 5  # an int asks for the watch without the codec choice too
    with pytest.raises(ValueError, match="^revalidate_every: "):
        Scheduler("mgs", _spec(), _model(), 1, sizes, 1, _OneRank(), tune_steps=1, revalidate_every=-3)


def _first_clock(names):
    return _clock(-1.0, names, 0.5)


def _spec():
    from hvdcompress.spec import resolve
    return resolve("topk:ratio=0.01")


# --- the benchmark's '+tune' schedules and their table ---------------------------------------------
def test_bench_tuned_schedule_entries_parse():
    from hvdcompress.bench import schedules
    assert schedules.split("mgs+tune") == ("mgs", True)
    assert schedules.split("mgs:greedy") == ("mgs:greedy", False)
    assert schedules.split("auto+tune") == ("auto", True)
    assert schedules.split("auto+tune+choice") == ("auto", True) and schedules.chooses("auto+tune+choice")
    assert schedules.split("size:4+choice") == ("size:4", False) and not schedules.chooses("auto+tune")
    # without '+choice' the spec is timed on every group, whatever the optimizer's default
    assert schedules.codec_choice("auto+tune+choice") == "auto" == schedules.codec_choice("size:4+choice")
    assert [schedules.codec_choice(e) for e in ("auto+tune", "auto", "mgs+tune", "layerwise")] == ["off"] * 4
    for bad in ("single+tune", "size:2+tune", "mgs+tune+tune"):
        with pytest.raises(ValueError):
            schedules.split(bad)


def test_bench_tuning_summary_compares_the_kept_plan_with_the_fixed_ones():
    from hvdcompress.bench.report import tuning_summary

    def row(schedule, t, plan=None, **kw):
        return dict({"workers": 2, "bandwidth": "1gbit", "compression": "topk:ratio=0.001", "status": "ok",
                     "schedule": schedule, "step_time_s": t, "plan": plan or {"groups": 1}}, **kw)

    tuned_plan = {"groups": 5, "calibration": {"skew": 1.5},
                  "tuning": {"kept_label": "size:2", "kept": 1, "tune_steps": 3,
                             "candidates": [{"label": "mgs", "groups": 1, "predicted_seconds": 0.4},
                                            {"label": "size:2", "groups": 5, "predicted_seconds": 0.45}],
                             "medians_seconds": [0.6, 0.46]}}
    report = {"results": [row("layerwise", 0.57), row("single", 0.66), row("size:2", 0.46), row("mgs", 0.61),
                          row("mgs+tune", 0.45, tuned_plan, predicted_step_time_s=0.45, prediction_error=0.0)]}
    table = tuning_summary(report)
    assert "| 570.0 (layerwise) | 460.0 (size:2) | 610.0 (1) | size:2 (5) | 450.0 | +21% | -2% |" in table
    assert "450.0 (+0%) | 1.50 | mgs (1) 600.0; size:2 (5) 460.0 |" in table
    assert tuning_summary({"results": [row("mgs", 0.61)]}) == ""
