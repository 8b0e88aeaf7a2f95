"""The cost model's transport terms, pure (no Horovod): the transfer-bound slope of a collective's
fit, the fp16 allreduce's own fit, one round for a tensor PowerSGD sends dense."""

import numpy as np
import pytest

from hvdcompress.schedule.costmodel import (CostModel, LinearFit, fit_cost_model, fit_linear, fit_transfer,
                                            payload, rounds, sums_half)
from hvdcompress.schedule.planner import make_plan

SIZES = np.array([4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20], dtype=float)


def _tbf_like(alpha=5e-3, beta=130e-9, burst=100 << 10):
    """A rate limiter: bytes within its burst pass at line rate (nearly free), the rest at beta."""
    return alpha + beta * np.maximum(0.0, SIZES - burst) + 1e-9 * SIZES


def test_fit_transfer_takes_the_slope_from_the_transfer_bound_sizes():
    t = _tbf_like()
    rel = fit_linear(SIZES, t)
    fit = fit_transfer(SIZES, t)
    assert fit.beta == pytest.approx(131e-9, rel=0.03)  # the large messages' rate
    assert rel.beta < 0.95 * fit.beta  # the relative fit bends toward the small ones
    assert abs(fit(SIZES[-1]) - t[-1]) / t[-1] < 0.02
    assert fit.alpha >= 0 and fit.samples == len(SIZES)


def test_fit_transfer_is_the_relative_fit_with_one_large_size():
    x, t = np.array([1.0, 2.0, 1e6]), np.array([1e-3, 1.1e-3, 2e-3])
    assert fit_transfer(x, t, span=2.0) == fit_linear(x, t)
    flat = np.array([5e-3, 5e-3, 5e-3, 6e-3, 5.5e-3, 5.2e-3])  # loopback noise: the large sizes fall
    assert fit_transfer(SIZES, flat) == fit_linear(SIZES, flat)
    with pytest.raises(ValueError, match="at least 2"):
        fit_transfer([1.0], [1.0])


def test_fit_cost_model_fits_collectives_by_their_transfer_bound_slope():
    t = _tbf_like()
    model = fit_cost_model(4, list(zip(SIZES, t)), list(zip(SIZES / 4, t)))
    assert model.allreduce.beta == pytest.approx(fit_transfer(SIZES, t).beta)
    assert model.allreduce_half is None
    half = fit_cost_model(4, list(zip(SIZES, t)), list(zip(SIZES / 4, t)),
                          allreduce_half_samples=list(zip(SIZES, 3 * t)))
    assert half.allreduce_half.beta == pytest.approx(3 * fit_transfer(SIZES, t).beta)


def _model(**kw):
    return CostModel(4, LinearFit(5e-3, 10e-9), LinearFit(3e-3, 5e-9), **kw)


def test_an_fp16_allreduce_has_its_own_fit():
    assert sums_half("fp16") and not sums_half("none") and not sums_half("bf16")
    assert rounds("fp16", np.array([1000.0]))[0].half
    b = np.array([4e6])
    plain = _model()
    assert plain.comm_seconds("fp16", b)[0] == pytest.approx(5e-3 + 10e-9 * 2e6)  # fp32 fit, half the bytes
    half = _model(allreduce_half=LinearFit(6e-3, 30e-9))  # the CPU sum of halves: slower per byte
    assert half.comm_seconds("fp16", b)[0] == pytest.approx(6e-3 + 30e-9 * 2e6)
    assert half.comm_seconds("none", b)[0] == plain.comm_seconds("none", b)[0]
    assert half.collective_seconds("allreduce", 1e6, half=True) == pytest.approx(6e-3 + 30e-9 * 1e6)
    assert half.collective_seconds("allreduce", 1e6) == pytest.approx(5e-3 + 10e-9 * 1e6)


def test_new_terms_survive_serialisation_calibration_and_other_world_sizes():
    m = _model(allreduce_half=LinearFit(6e-3, 30e-9))
    back = CostModel.from_dict(m.to_dict())
    assert back.allreduce_half == LinearFit(6e-3, 30e-9)
    for other in (m.scaled(2.0, 3.0), m.with_skew(0.5)):
        assert other.allreduce_half == m.allreduce_half
    eight = m.for_world_size(8)
    assert eight.allreduce_half.beta > eight.allreduce.beta  # the sums' extra cost is carried
    assert eight.allreduce_half.beta - eight.allreduce.beta == pytest.approx(20e-9 / 0.75 * 0.875)
    assert m.for_world_size(8, gbit_per_s=1.0).allreduce_half.beta > 16e-9  # another link: the sums stay
    old = {k: v for k, v in _model().to_dict().items() if k != "allreduce_half"}
    assert CostModel.from_dict(old).allreduce_half is None  # a model saved before the term


def test_powersgd_sends_a_tensor_it_keeps_dense_in_one_round():
    _, small, _ = payload("powersgd:rank=4", np.array([64.0]))  # 2*sqrt(d)*r >= d: sent dense
    _, large, _ = payload("powersgd:rank=4", np.array([1 << 16]))
    assert int(small[0]) == 1 and int(large[0]) == 2
    m = _model()
    assert m.comm_seconds("powersgd:rank=4", np.array([256.0]))[0] == pytest.approx(5e-3 + 10e-9 * 256)


def test_the_codec_choice_plans_fp16_at_its_measured_cost():
    """Where summing halves costs more than the wire saves, the choice sends dense."""
    from hvdcompress.schedule.costmodel import ComputeFit
    fits = {"fp16": ComputeFit("linear", 0.0, 0.0), "topk:ratio=0.5": ComputeFit("linear", 1e-6, 0.0)}
    sizes, t_b = [4e6] * 4, [0.001] * 4
    cheap = _model(compress=fits)
    slow = _model(compress=fits, allreduce_half=LinearFit(5e-3, 40e-9))
    a = make_plan("auto", sizes, t_b, cheap, "topk:ratio=0.5", alternatives=("fp16", "none"))
    b = make_plan("auto", sizes, t_b, slow, "topk:ratio=0.5", alternatives=("fp16", "none"))
    assert "fp16:residual=false" in a.codecs and set(b.codecs) == {"none"}


def test_start_ups_of_a_step_survive_serialisation_and_are_checked():
    m = _model(alone_alpha=12e-3, queued_alpha=1e-3)
    assert m.start_ups == (12e-3, 1e-3) and _model().start_ups is None
    assert _model(alone_alpha=12e-3).start_ups is None  # both or neither
    back = CostModel.from_dict(m.to_dict())
    assert back.start_ups == m.start_ups and m.scaled(2.0).start_ups == m.start_ups
    assert m.for_world_size(8).queued_alpha == pytest.approx(1e-3 * 7 / 3)
    assert m.comm_seconds("none", np.array([1000.0]), start_up=2e-3)[0] == pytest.approx(2e-3 + 10e-9 * 1000)
    with pytest.raises(ValueError, match="queued_alpha"):
        _model(queued_alpha=-1.0)


def test_a_group_ready_before_the_previous_exchange_started_pays_the_queued_time():
    from hvdcompress.schedule.timeline import predict_costs
    tc = [0.005] * 3
    step = ([0.010] * 3, [0.002] * 3)  # alone in its cycle, queued with others
    # all ready at once (t_b = 0): the second and third were queued behind the first
    assert predict_costs([[0], [1], [2]], [0.0] * 3, [0.0] * 3, tc, step=step).end == pytest.approx(0.014)
    # the third was ready (10 ms) when the second started (10 ms): queued
    assert predict_costs([[0], [1], [2]], [0.0, 0.005, 0.005], [0.0] * 3, tc, step=step).end == pytest.approx(0.022)
    # each ready after the previous one started: alone
    assert predict_costs([[0], [1], [2]], [0.0, 0.012, 0.012], [0.0] * 3, tc, step=step).end == pytest.approx(0.034)
    assert predict_costs([[0], [1], [2]], [0.0] * 3, [0.0] * 3, tc).end == pytest.approx(0.015)  # without: t_c
    with pytest.raises(ValueError, match="step"):
        predict_costs([[0], [1], [2]], [0.0] * 3, [0.0] * 3, tc, step=([0.0], [0.0]))


def test_the_planner_predicts_with_the_start_ups_of_a_step_and_plans_as_before():
    from hvdcompress.schedule.costmodel import ComputeFit
    sizes, t_b = [1024.0] * 20, [0.0] * 20
    plain, step = _model(), _model(alone_alpha=12e-3, queued_alpha=1e-3)
    per = 10e-9 * 1024
    assert make_plan("layerwise", sizes, t_b, plain, "none").predicted_seconds == pytest.approx(20 * (5e-3 + per))
    assert make_plan("layerwise", sizes, t_b, step, "none").predicted_seconds == pytest.approx(12e-3 + 19e-3 + 20 * per)
    assert make_plan("mgwfbp", sizes, t_b, step, "none").groups == make_plan("mgwfbp", sizes, t_b, plain, "none").groups
    fits = {"fp16": ComputeFit("linear", 0.0, 0.0)}
    chosen = make_plan("layerwise", sizes, t_b, _model(compress=fits, alone_alpha=12e-3, queued_alpha=1e-3), "none",
                       alternatives=("fp16",))
    assert chosen.predicted_seconds == pytest.approx(12e-3 + 19e-3 + 20 * per, rel=0.05)
