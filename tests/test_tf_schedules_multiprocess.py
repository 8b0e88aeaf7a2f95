"""Merged-group schedules with real Horovod, TF backend: 2 Gloo worker processes (horovod.runner.run)
run tests/scenarios/tf_schedules.py once; each test checks one part of what it returned. The
workers get an empty HVDCOMPRESS_CACHE, so no cost model is cached for them.
"""


import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios import tf_schedules  # noqa: E402
from scenarios.launch import part as _part, run_workers  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = run_workers(tf_schedules.everything, WORLD, WORLD, start_timeout=120,
                      env={"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
                           "HVDCOMPRESS_CACHE": str(tmp_path_factory.mktemp("hvc-cache"))})
    assert len(out) == WORLD
    print("scenario seconds per rank:", [r["seconds"] for r in out])
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
