"""The plan explained per group (``hvdcompress.schedule.explain``): pure functions, no Horovod."""

import numpy as np
import pytest

from hvdcompress.schedule.costmodel import ComputeFit, CostModel
from hvdcompress.schedule.explain import calibrated, explain, group_seconds, kind_of, measured_rows
from hvdcompress.schedule.planner import MIB, Plan, make_plan
from hvdcompress.spec import resolve

SPEC = "topk:ratio=0.01"


def _model(gbit=1.0, with_fp16=True):
    fits = {str(resolve(SPEC)): ComputeFit("dlogd", 2e-10, 3e-5)}
    if with_fp16:
        fits[str(resolve("fp16"))] = ComputeFit("linear", 5e-11, 1e-5)
    return CostModel.from_link(2, gbit, 50e-6, fits)


def test_kind_of_names_the_spec_fp16_and_dense():
    assert kind_of(str(resolve(SPEC)), SPEC) == "spec"
    assert kind_of("fp16", SPEC) == "fp16"
    assert kind_of("none", SPEC) == "dense"
    assert kind_of("none", "none") == "spec"  # dense asked for is the spec itself
    assert kind_of("fp16", "fp16") == "spec"


def test_rows_follow_the_plan_codecs_and_predict_every_option():
    sizes = [4 * MIB, 64 * 1024, 2 * MIB, 512.0]
    names = ["fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias"]
    model = _model()
    plan = make_plan("mgs", sizes, [1e-3] * 4, model, SPEC, 2, alternatives=("fp16", "none"))
    d = explain(plan, names, sizes, SPEC, model, codec_choice="auto")
    assert [list(r.names) for r in d.groups] == [[names[i] for i in g] for g in plan.groups]
    assert [r.sent for r in d.groups] == [str(resolve(c)) for c in plan.codecs]
    assert sum(d.counts().values()) == len(plan.groups)
    assert d.basis == "predicted" and d.measured == ()
    for r in d.groups:
        assert [k for k, _ in r.predicted] == ["spec", "fp16", "dense"]
        assert all(s is not None and s > 0 for _, s in r.predicted)
        assert r.nbytes == sum(sizes[names.index(n)] for n in r.names)
    assert d.groups[-1].closing and not any(r.closing for r in d.groups[:-1])
    text = "\n".join(d.lines())
    assert "codec choice auto (predicted)" in text and "ms alone" in text


def test_a_slow_link_favours_the_spec_and_a_fast_one_dense_for_a_large_group():
    nbytes = 16 * MIB
    slow, fast = _model(gbit=0.1), _model(gbit=100.0)
    by_kind = {}
    for name, m in (("slow", slow), ("fast", fast)):
        by_kind[name] = {k: group_seconds(m, s, nbytes, 2) for k, s in (("spec", SPEC), ("dense", "none"))}
    assert by_kind["slow"]["spec"] < by_kind["slow"]["dense"]
    assert by_kind["fast"]["dense"] < by_kind["fast"]["spec"]


def test_off_still_predicts_the_alternatives_and_marks_missing_fits():
    sizes, names = [MIB, MIB], ["a", "b"]
    model = _model(with_fp16=False)
    plan = make_plan("layerwise", sizes, [1e-3, 1e-3], model, SPEC, 2)
    d = explain(plan, names, sizes, SPEC, model)
    assert d.codec_choice == "off" and d.counts() == {"spec": 2, "fp16": 0, "dense": 0}
    for r in d.groups:
        pred = dict(r.predicted)
        assert pred["fp16"] is None and pred["dense"] is not None and pred["spec"] is not None
    assert any(" - " in line or line.rstrip().endswith("-") or "     -" in line for line in d.lines())


def test_without_a_model_nothing_is_predicted():
    plan = Plan("layerwise", [[0], [1]], None, None, "shared")
    d = explain(plan, ["a", "b"], [10.0, 20.0], SPEC)
    assert d.basis == "fixed"
    assert all(s is None for r in d.groups for _, s in r.predicted)
    assert explain(None, [], [], SPEC).groups == ()


def test_measured_rows_mark_the_kept_candidate():
    spec = str(resolve(SPEC))
    record = {"candidates": [
        {"label": "mgs", "groups": [[0, 1]], "predicted_seconds": 0.010, "codecs": ["none"]},
        {"label": "mgs (all topk)", "groups": [[0], [1]], "predicted_seconds": 0.012, "codecs": [spec, spec]},
    ], "medians_seconds": [0.011, 0.009], "kept": 1}
    rows = measured_rows(record, SPEC)
    assert [r.kept for r in rows] == [False, True]
    assert dict(rows[0].kinds) == {"spec": 0, "fp16": 0, "dense": 1}
    assert dict(rows[1].kinds) == {"spec": 2, "fp16": 0, "dense": 0}
    assert rows[1].measured_seconds == 0.009 and rows[1].predicted_seconds == 0.012
    assert measured_rows({"in_progress": {}}, SPEC) == ()
    plan = Plan("mgs", [[0], [1]], 0.012, None, "shared", tuning=record, codecs=[spec, spec])
    d = explain(plan, ["a", "b"], [MIB, MIB], SPEC, _model(), codec_choice="auto")
    assert d.basis == "measured"
    assert d.as_dict()["measured"][1]["kept"] is True
    assert any(line.lstrip().startswith("* mgs (all topk)") for line in d.lines())


def test_calibrated_applies_the_schedulers_factors():
    model = _model()
    cal = calibrated(model, {"compress": 2.0, "decompress": 1.0, "skew": 0.5})
    assert cal.exchange_skew == 0.5
    assert np.isclose(cal.compress_seconds(SPEC, [MIB])[0], 2 * model.compress_seconds(SPEC, [MIB])[0])
    assert calibrated(model, None) is model


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="codec_choice"):
        explain(None, [], [], SPEC, codec_choice="on")
    with pytest.raises(ValueError, match="names"):
        explain(None, ["a"], [], SPEC)


def test_groups_given_directly_default_to_the_spec():
    from hvdcompress.schedule.explain import explain_groups
    d = explain_groups([["w"], ["b", "c"]], [MIB, 2048.0], [None, "none"], SPEC, _model())
    assert [r.kind for r in d.groups] == ["spec", "dense"] and d.basis == "fixed"
    with pytest.raises(ValueError, match="one per group"):
        explain_groups([["w"]], [MIB, 1.0], [None], SPEC)
