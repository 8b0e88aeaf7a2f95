"""The per-group codec choice of the planner (the user's spec, fp16 or dense per group, decided
jointly with the merge plan): pure functions, no Horovod."""

import numpy as np
import pytest

from hvdcompress.schedule.costmodel import ComputeFit, CostModel
from hvdcompress.schedule.planner import MIB, Workload, make_plan
from hvdcompress.schedule.search import Option, brute_force_choice, optimal, optimal_choice, predict_choice
from hvdcompress.schedule.timeline import predict

OVERLAPS = ("shared", "parallel")


def _options(rng):
    """Three ways to send a group: a sparsifier (costly to encode, few bytes), a half-size cast
    (cheap, half the bytes) and dense (free, all bytes), with a closing term on one of them."""
    alpha, beta = rng.uniform(1e-5, 3e-3), rng.uniform(1e-10, 1e-8)
    sa, sb = rng.uniform(0, 4e-9), rng.uniform(0, 3e-4)

    def sparse_s(b):
        d = np.asarray(b, dtype=float) / 4
        return sa * d * np.log2(np.maximum(d, 1)) + sb

    def sparse_c(b):
        return 2 * alpha + beta * 8 * np.ceil(0.01 * np.asarray(b, dtype=float) / 4)

    def half_s(b):
        return 1e-10 * np.asarray(b, dtype=float) + 2e-5

    def half_c(b):
        return alpha + beta * np.asarray(b, dtype=float) / 2

    def dense_s(b):
        return np.full(np.shape(b), 1e-5)

    def dense_c(b):
        return alpha + beta * np.asarray(b, dtype=float)

    close = (lambda b: 0.3 * dense_c(b)) if rng.random() < 0.5 else None
    return [Option(sparse_s, sparse_c), Option(half_s, half_c), Option(dense_s, dense_c, close)]


def _instance(rng, n):
    sizes = np.floor(np.exp(rng.uniform(np.log(400), np.log(4e6), n)))
    t_b = rng.uniform(0, 2e-3, n) * (rng.random(n) > 0.2)
    return sizes, t_b


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_joint_search_equals_brute_force_over_partitions_and_choices(overlap):
    rng = np.random.default_rng(27)
    for trial in range(24):
        n = int(rng.integers(1, 6))
        sizes, t_b = _instance(rng, n)
        options = _options(rng)
        found = optimal_choice(sizes, t_b, options, overlap)
        brute = brute_force_choice(sizes, t_b, options, overlap)
        assert found.seconds == pytest.approx(brute.seconds, rel=1e-12, abs=1e-15), (trial, overlap)
        assert found.gap == 0.0
        # the reported time is the timeline of the reported groups and choices
        again = predict_choice(found.groups, found.choices, sizes, t_b, options, overlap).end
        assert again == pytest.approx(found.seconds, rel=1e-12, abs=1e-15)
        # never worse than the best uniform choice with its own optimal partition
        uniform = min(optimal(sizes, t_b, o.t_s, o.t_c, overlap, t_close=o.t_close).seconds for o in options)
        assert found.seconds <= uniform * (1 + 1e-12)


def test_fixed_partition_chooses_per_group_like_brute_force():
    rng = np.random.default_rng(3)
    for trial in range(20):
        sizes, t_b = _instance(rng, 5)
        options = _options(rng)
        cuts = [2, 3, 5]
        found = optimal_choice(sizes, t_b, options, "shared", cuts=cuts)
        assert found.groups == [[0, 1], [2], [3, 4]]
        best = min(predict_choice(found.groups, (a, b, c), sizes, t_b, options).end
                   for a in range(3) for b in range(3) for c in range(3))
        assert found.seconds == pytest.approx(best, rel=1e-12)


def test_one_option_is_the_plain_search():
    rng = np.random.default_rng(5)
    sizes, t_b = _instance(rng, 9)
    o = _options(rng)[0]
    found = optimal_choice(sizes, t_b, [o], "shared")
    assert found.choices == [0] * len(found.groups)
    plain = predict(found.groups, sizes, t_b, o.t_s, o.t_c, "shared").end
    assert found.seconds == pytest.approx(plain) == pytest.approx(optimal(sizes, t_b, o.t_s, o.t_c).seconds)


def test_bad_choices_and_options_are_refused():
    sizes, t_b = np.array([4.0, 8.0]), np.array([1e-3, 1e-3])
    o = _options(np.random.default_rng(0))
    with pytest.raises(ValueError, match="choices: one option index"):
        predict_choice([[0], [1]], [0, 3], sizes, t_b, o)
    with pytest.raises(ValueError, match="options: at least one"):
        optimal_choice(sizes, t_b, [])
    with pytest.raises(ValueError, match="cuts: must end with the number of tensors"):
        optimal_choice(sizes, t_b, o, cuts=[1])


def _workload():
    """A VGG-like shape: many small convolution tensors, then three large dense layers (backward order)."""
    sizes = [16e6, 64e3, 64e6, 16e3, 400e6, 16e3] + [2.4e6, 1e3] * 8
    t_b = [2e-3, 1e-4, 4e-3, 1e-4, 6e-3, 1e-4] + [3e-3, 1e-4] * 8
    return Workload(tuple(f"p{i}" for i in range(len(sizes))), tuple(sizes), tuple(t_b), 0.02, 0.01)


def _model(gbps):
    fits = {"topk:ratio=0.001": ComputeFit("dlogd", 2e-10, 3e-5), "fp16": ComputeFit("linear", 5e-11, 1e-5)}
    return CostModel.from_link(4, gbps, 50e-6, fits)


@pytest.mark.parametrize("gbps", [0.01, 0.1, 1.0, 10.0, 100.0])
def test_choice_is_never_slower_than_the_best_uniform_spec(gbps):
    w, model = _workload(), _model(gbps)
    plan = w.plan("mgs", model, "topk:ratio=0.001", alternatives=("fp16", "none"))
    assert len(plan.codecs) == len(plan.groups) and plan.gap == 0.0
    uniform = {s: w.plan("mgs", model, s).predicted_seconds for s in ("topk:ratio=0.001", "fp16", "none")}
    assert plan.predicted_seconds <= min(uniform.values()) * (1 + 1e-9)
    if gbps <= 0.01:  # a slow link: the big tensors are sparsified
        assert plan.codecs[plan.groups.index(next(g for g in plan.groups if 4 in g))] == "topk:ratio=0.001,residual=true"
    if gbps >= 100.0:  # a fast link: nothing pays to sparsify
        assert "topk:ratio=0.001,residual=true" not in plan.codecs


def test_fixed_schedules_choose_over_their_own_partition():
    w, model = _workload(), _model(1.0)
    plan = w.plan("size:64", model, "topk:ratio=0.001", alternatives=("fp16", "none"))
    fixed = w.plan("size:64", model, "topk:ratio=0.001")
    assert plan.groups == fixed.groups and len(plan.codecs) == len(plan.groups)
    assert plan.predicted_seconds <= fixed.predicted_seconds * (1 + 1e-9)
    assert make_plan("layerwise", w.sizes_bytes, w.t_b, model, "topk:ratio=0.001",
                     alternatives=("none",)).groups == [[i] for i in range(len(w.sizes_bytes))]


def test_choice_needs_a_model_and_every_fit():
    w = _workload()
    with pytest.raises(ValueError, match="alternatives: choosing a spec per group needs a cost model"):
        make_plan("single", w.sizes_bytes, w.t_b, None, "topk:ratio=0.001", alternatives=("none",))
    bare = CostModel.from_link(4, 1.0, 50e-6, {"topk:ratio=0.001": ComputeFit("dlogd", 2e-10, 3e-5)})
    with pytest.raises(ValueError, match=r"no fit for fp16"):
        w.plan("mgs", bare, "topk:ratio=0.001", alternatives=("fp16", "none"))
    # no alternative other than the spec itself: the plain plan
    plain = w.plan("mgs", _model(1.0), "none", alternatives=("none",))
    assert plain.codecs is None and plain.groups == w.plan("mgs", _model(1.0), "none").groups
    assert MIB == 1 << 20


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_an_option_that_does_not_merge_gets_groups_of_one_only(overlap):
    """A layerwise compressor (merges=False) beside mergeable fp16 / dense: the joint search equals
    the brute force over the partitions that respect it, and never gives it a merged group."""
    rng = np.random.default_rng(41)
    for trial in range(24):
        n = int(rng.integers(1, 6))
        sizes, t_b = _instance(rng, n)
        options = _options(rng)
        options[0] = options[0]._replace(merges=False)
        found = optimal_choice(sizes, t_b, options, overlap)
        brute = brute_force_choice(sizes, t_b, options, overlap)
        assert found.seconds == pytest.approx(brute.seconds, rel=1e-12, abs=1e-15), (trial, overlap)
        assert all(len(g) == 1 for g, c in zip(found.groups, found.choices) if c == 0)
        again = predict_choice(found.groups, found.choices, sizes, t_b, options, overlap).end
        assert again == pytest.approx(found.seconds, rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="merges=False"):
        predict_choice([[0, 1]], [0], np.array([4.0, 8.0]), np.array([1e-3, 1e-3]), options)
    with pytest.raises(ValueError, match="cuts: a group of several tensors needs an option that merges"):
        optimal_choice(np.array([4.0, 8.0]), np.array([1e-3, 1e-3]), [options[0]], cuts=[2])


def _lowrank_model(gbps):
    fits = {"powersgd:rank=4": ComputeFit("linear", 2e-9, 2e-4), "fp16": ComputeFit("linear", 5e-11, 1e-5)}
    return CostModel.from_link(4, gbps, 50e-6, fits)


@pytest.mark.parametrize("gbps", [0.01, 1.0, 100.0])
def test_a_layerwise_compressor_is_chosen_per_tensor_and_the_rest_merges(gbps):
    """PowerSGD (merge=LAYERWISE) with the codec choice under "auto": its groups are single
    tensors, fp16 / dense groups merge; never slower than any spec everywhere on its own plan
    (PowerSGD's own: layerwise; fp16 and dense: merged by their search)."""
    w, model = _workload(), _lowrank_model(gbps)
    spec = "powersgd:rank=4"
    plan = w.plan("auto", model, spec, alternatives=("fp16", "none"))
    own = [c for c in plan.codecs if c.startswith("powersgd")]
    assert all(len(g) == 1 for g, c in zip(plan.groups, plan.codecs) if c.startswith("powersgd"))
    alone = w.plan("auto", model, spec)
    assert alone.groups == [[i] for i in range(len(w.sizes_bytes))]  # layerwise on its own
    uniform = [alone.predicted_seconds] + [w.plan("auto", model, s).predicted_seconds for s in ("fp16", "none")]
    assert plan.predicted_seconds <= min(uniform) * (1 + 1e-9)
    if gbps >= 100.0:  # nothing pays to compress: one or a few merged groups, not one per tensor
        assert not own and len(plan.groups) < len(w.sizes_bytes)
    if gbps <= 0.01:  # a slow link: the 400 MB tensor goes low-rank
        assert plan.codecs[plan.groups.index([4])].startswith("powersgd")


def test_a_layerwise_compressor_keeps_a_searched_schedule_only_with_the_choice():
    from hvdcompress.schedule.groups import check_mergeable
    from hvdcompress.spec import resolve
    spec = resolve("powersgd:rank=4")
    for text in ("auto", "mgs", "mgwfbp"):  # the joint search gives it groups of one
        assert check_mergeable(text, spec, choosing=True)
    assert not check_mergeable("auto", spec)  # without the choice "auto" is layerwise
    for text, choosing in (("mgs", False), ("mgs:greedy", True), ("single", True)):
        with pytest.raises(ValueError, match="cannot be merged"):
            check_mergeable(text, spec, choosing=choosing)
    w, model = _workload(), _lowrank_model(0.01)
    assert w.plan("mgs", model, "powersgd:rank=4").groups == [[i] for i in range(len(w.sizes_bytes))]
