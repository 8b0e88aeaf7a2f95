"""Merged-group schedules with real Horovod, TF backend: tests/scenarios/tf_schedules.py runs in the
session's shared 2-worker TF launch (scenarios/shared_tf_launch.py); each test checks one part of
what it returned. The scenario gets an empty HVDCOMPRESS_CACHE, so no cost model is cached for it.
"""


import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios import shared_tf_launch  # noqa: E402
from scenarios.launch import part as _part  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def results():
    out = shared_tf_launch.results("test_tf_schedules_multiprocess")
    assert len(out) == WORLD
    return out


def test_dense_merged_schedules_leave_the_parameters_layerwise_leaves(results):
    for r in _part(results, "dense"):
        assert all(r["identical"].values()), r["identical"]
        assert all(r["equal"].values()), r["equal"]
        assert r["groups"] == {"fit single": [[5, 4, 3, 2, 1, 0]], "fit mgwfbp": [[5, 4, 3, 2, 1, 0]],
                               "tape size": [[5, 4, 3, 2, 1], [0]], "tape explicit": [[5, 4], [3], [2], [1, 0]]}


def test_dgc_and_topk_with_merged_groups_stay_identical_across_ranks(results):
    for r in _part(results, "sparse"):
        assert all(r["identical"].values()), r["identical"]
        assert r["groups"]["tape dgc size"] == [[5, 4, 3, 2, 1], [0]]
        assert r["groups"]["fit dgc single"] == [[5, 4, 3, 2, 1, 0]]
        assert r["state"]["tape dgc size"] == [["u", "v"]] * 6  # biases in a sparsified group keep a v too


def test_bad_schedules_raise_on_every_rank_before_any_collective(results):
    expected = {
        "unknown": "schedule: unknown schedule 'fastest'",
        "explicit": "schedule: gradient position 0 is in groups 0 and 1",
        "no_model": "cost_model: the schedule needs a cost model",
        "no_model_gc": "CostModel.from_link",
    }
    for r in _part(results, "bad"):
        assert r["after"] == 2.0
        for label, needle in expected.items():
            assert r["errors"][label] is not None and needle in r["errors"][label], (label, r["errors"][label])


def test_a_group_switching_between_topk_and_dense_loses_nothing_and_resumes_exactly(results):
    ranks = _part(results, "codec")
    for r in ranks:
        codecs = r["codecs"]  # the plan of each object: top-k everywhere, dense everywhere, top-k again
        assert codecs["compressed"] and all(c.startswith("topk") for c in codecs["compressed"]), codecs
        assert codecs["dense"] and set(codecs["dense"]) == {"none"}, codecs
        assert codecs["again"] == codecs["compressed"]
        assert r["identical"]
        res = r["residuals"]  # per step, this rank's residual left (sum of |r|)
        assert r["held_before_dense"] > 0 and all(x > 0 for x in res[:3])
        assert res[3:6] == [0.0, 0.0, 0.0]  # the first dense step sent what top-k held back
        assert all(x > 0 for x in res[6:])  # top-k again holds some back
        assert r["lost"] <= 1e-4 * max(1.0, r["scale"]), r  # error feedback: nothing lost across the switches
        assert all(r["resumed_equal"]) and all(r["resumed_residuals_equal"]) and len(r["resumed_equal"]) == 5
    assert ranks[0]["codecs"] == ranks[1]["codecs"]


def test_powersgd_is_chosen_per_gradient_beside_merged_fp16_groups_losing_nothing(results):
    """PowerSGD (state shaped by the tensor) with codec_choice="auto": its groups hold one
    gradient, the others merge into fp16 groups; the merged kernel's residual goes out with its
    group and its q survives for when it is sent with PowerSGD again."""
    ranks = _part(results, "lowrank")
    for r in ranks:
        assert r["groups"] == [[5, 4, 3], [2], [1], [0]], r["groups"]
        assert r["codecs"][0].startswith("fp16") and r["codecs"][2].startswith("fp16"), r["codecs"]
        assert r["codecs"][1] == r["codecs"][3] and r["codecs"][1].startswith("powersgd"), r["codecs"]
        assert r["slots"] == [["q", "residual"], [], ["q", "residual"], [], ["q", "residual"], []]  # as layerwise
        assert r["identical"]
        assert r["q_kept"] == {4: True, 0: False, 2: False}, r["q_kept"]  # only kernel 4 was merged
        assert all(r["q_used_again"].values()), r["q_used_again"]
        assert r["residual_sent"] < 1e-2, r  # what is left is the fp16 cast's rounding
        assert r["lost"] <= 1e-3 * max(1.0, r["scale"]), r  # the biases' fp16 rounding only
        assert r["resumed_equal"] == [True], r["resumed_equal"]
        assert r["resumed_state_equal"] == {"q": {0: True, 2: True, 4: True},
                                            "residual": {0: True, 2: True, 4: True}}, r["resumed_state_equal"]
    assert ranks[0]["groups"] == ranks[1]["groups"] and ranks[0]["codecs"] == ranks[1]["codecs"]
