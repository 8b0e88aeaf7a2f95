"""The wire cost of a tensor of known shape (PowerSGD's P and Q follow the matrix's n and m) in
the cost model, the planner's prediction and advise's workloads. Pure: no Horovod."""

import numpy as np
import pytest

from hvdcompress.bench import advise
from hvdcompress.schedule.costmodel import CostModel, LinearFit, rounds
from hvdcompress.schedule.planner import Workload, make_plan
from hvdcompress.spec import resolve

PSGD = resolve("powersgd:rank=4")


def model(**kw):
    return CostModel(4, LinearFit(1e-3, 1e-8), LinearFit(2e-3, 1e-8), **kw)


def test_powersgd_rounds_of_a_shape_send_p_then_q():
    rs = PSGD.info.shape_rounds(PSGD.params, (16, 512, 3, 3), 4)
    assert [(r.collectives, r.nbytes) for r in rs] == [(1, 16 * 4 * 4), (1, 512 * 9 * 4 * 4)]


def test_powersgd_rounds_of_a_vector_or_a_small_matrix_are_one_dense_allreduce():
    for shape in ((512,), (4, 4)):
        rs = PSGD.info.shape_rounds(PSGD.params, shape, 4)
        assert [(r.collectives, r.nbytes) for r in rs] == [(1, 4 * int(np.prod(shape)))]


def test_a_spec_without_a_shaped_rule_is_charged_by_its_element_count():
    spec = resolve("topk:ratio=0.01")
    by_shape = spec.info.shape_rounds(spec.params, (64, 32), 4)
    by_count = rounds(spec, 64 * 32)
    assert [(r.kind, r.collectives, float(r.nbytes)) for r in by_shape] == \
        [(r.kind, r.collectives, float(r.nbytes)) for r in by_count]


def test_tensor_comm_seconds_sums_the_rounds_of_the_shape():
    m = model()
    t = m.tensor_comm_seconds(PSGD, (16, 4608))
    assert t == pytest.approx(2 * 1e-3 + 1e-8 * (16 + 4608) * 4 * 4)
    assert m.tensor_comm_seconds(PSGD, (16, 4608), start_up=5e-3) == pytest.approx(2 * 5e-3 + 1e-8 * 4624 * 16)
    assert m.tensor_comm_seconds(PSGD, (100,)) == pytest.approx(1e-3 + 1e-8 * 400)


def workload(shapes=None):
    shp = ((16, 4608), (64,), (8, 2048), (32,))
    sizes = tuple(4.0 * np.prod(s) for s in shp)
    return Workload(("a", "b", "c", "d"), sizes, (1e-3, 2e-3, 1e-3, 2e-3), 0.01, 0.001, shapes)


def test_workload_shapes_round_trip_and_are_checked():
    w = workload(((16, 4608), (64,), (8, 2048), (32,)))
    assert Workload.from_dict(w.to_dict()) == w
    assert "shapes" not in workload().to_dict()
    with pytest.raises(ValueError, match="shapes"):
        workload(((1, 2),))


def test_layerwise_prediction_charges_each_tensor_its_shape():
    shp = ((16, 4608), (64,), (8, 2048), (32,))
    m = model()
    with_shapes = workload(shp).plan("auto", m, PSGD)
    assert with_shapes.schedule == "layerwise"
    tl = with_shapes.timeline
    expected = [m.tensor_comm_seconds(PSGD, s) for s in shp]
    assert list(tl.comm_end - tl.comm_start) == pytest.approx(expected)
    square = workload().plan("auto", m, PSGD)  # by element count: square matrices assumed
    assert square.predicted_seconds < with_shapes.predicted_seconds


def test_layerwise_prediction_with_shapes_uses_the_step_start_ups():
    shp = ((16, 4608), (64,), (8, 2048), (32,))
    m = model(alone_alpha=4e-3, queued_alpha=3e-3)
    tl = workload(shp).plan("auto", m, PSGD).timeline
    costs = tl.comm_end - tl.comm_start
    for s, c in zip(shp, costs):
        assert c in (pytest.approx(m.tensor_comm_seconds(PSGD, s, start_up=4e-3)),
                     pytest.approx(m.tensor_comm_seconds(PSGD, s, start_up=3e-3)))


def test_choice_prediction_charges_powersgd_groups_their_shape():
    from hvdcompress.schedule.costmodel import ComputeFit
    shp = ((16, 4608), (64,), (8, 2048), (32,))
    fits = {s: ComputeFit("linear", 1e-9, 1e-5) for s in ("powersgd:rank=4", "fp16")}
    m = model(compress=fits)
    plan = make_plan("auto", workload(shp).sizes_bytes, workload(shp).t_b, m, PSGD,
                     alternatives=("fp16", "none"), shapes=shp)
    tl = plan.timeline
    for g, codec, start, end in zip(plan.groups, plan.codecs, tl.comm_start, tl.comm_end):
        if resolve(codec).name == "powersgd":
            assert end - start == pytest.approx(m.tensor_comm_seconds(PSGD, shp[g[0]]))


def test_profile_workload_carries_the_scaled_shapes():
    w = advise.workload_from_profile("vgg16-v100", scale=32)
    assert w.shapes is not None and len(w.shapes) == len(w.names)
    assert all(4.0 * np.prod(s) == b for s, b in zip(w.shapes, w.sizes_bytes))
    bare = Workload(w.names, w.sizes_bytes, w.t_b, w.forward_seconds, w.update_seconds)
    assert advise.profile_shapes(bare, "vgg16-v100", 32).shapes == w.shapes
    renamed = Workload(tuple("layers." + n.replace(".", "__", n.count(".") - 1) for n in w.names),
                       w.sizes_bytes, w.t_b, w.forward_seconds, w.update_seconds)
    assert advise.profile_shapes(renamed, "vgg16-v100", 32).shapes == w.shapes
    unknown = Workload(("nope",), (4.0,), (0.0,))
    assert advise.profile_shapes(unknown, "vgg16-v100", 32) is None
