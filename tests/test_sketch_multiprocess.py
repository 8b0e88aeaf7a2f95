"""Sketched-SGD on real Horovod: Gloo workers (PyTorch on 2 and 3, TensorFlow/Keras on 2).

One launch per backend and world size (tests/scenarios/sketch.py): parameters identical on
every rank after every step (layerwise and one merged group), the first exchanges replayed through
the numpy oracle, bytes measured as the wire rule predicts, checkpoint/resume bit-identical, bad
parameters raising on every rank before any collective.
"""

import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios import sketch as sc  # noqa: E402
from scenarios import shared_tf_launch  # noqa: E402
from scenarios.launch import part  # noqa: E402
from scenarios.shared_launch import TORCH_2, TORCH_3  # noqa: E402



@pytest.fixture(scope="module", params=[2, 3], ids=["2workers", "3workers"])
def torch_run(request):
    out = part({2: TORCH_2, 3: TORCH_3}[request.param].results("test_sketch_multiprocess"), "all")
    assert len(out) == request.param
    return request.param, out


@pytest.fixture(scope="module")
def tf_run():
    out = shared_tf_launch.results("test_sketch_multiprocess")  # sc.tf_all(2) (tests/scenarios/shared_tf_launch.py)
    assert len(out) == 2
    return out


def _check_errors(r):
    for label in sc.BAD:
        assert r["errors"][label] is not None, label
    assert "sketch: parameter 'rows'" in r["errors"]["rows"]
    assert "sketch: parameter 'p2'" in r["errors"]["p2"]
    assert "sketch: parameter 'cols_ratio'" in r["errors"]["cols_ratio"]
    assert "sketch: parameter 'k'" in r["errors"]["k"]
    assert "unknown parameter 'colums'" in r["errors"]["unknown"]
    assert "Nesterov" in r["errors"]["nesterov"]


def test_torch_identical_on_every_rank_after_every_step(torch_run):
    world, out = torch_run
    for r in part(out, "train"):
        for schedule in ("layerwise", "single"):
            res = r[schedule]
            assert res["identical_every_step"] == [True] * sc.STEPS, schedule
            assert res["moved"] > 0 and res["momentum"] == 0.0  # momentum taken over by the sketch


def test_torch_exchanges_match_the_oracle(torch_run):
    world, out = torch_run
    for r in part(out, "train"):
        for schedule in ("layerwise", "single"):
            rep = r[schedule]["replay"]
            assert rep["n"] > 0 and rep["support"], (schedule, rep)
            if world == 2:  # a + b is exact in any order: bit for bit
                assert rep["exact"] == rep["n"], (schedule, rep)
            else:  # Gloo's ring may add 3 ranks in another order than the oracle
                assert rep["max_diff"] < 1e-5, (schedule, rep)


def test_torch_bytes_are_measured_as_the_wire_rule_predicts(torch_run):
    _, out = torch_run
    r = part(out, "train")[0]
    stats = r["layerwise"]["stats"]
    assert stats["bytes_per_step"] == r["predicted_bytes"]
    assert stats["bytes_per_step"] < stats["dense_bytes_per_step"]


def test_torch_checkpoint_resume_is_bit_identical(torch_run):
    world, out = torch_run
    for r in part(out, "resume"):
        assert r["has_state"] and r["identical"] and r["momentum"] == 0.0, r
        if world == 2:
            assert r["equal"], r
        else:  # 3 ranks: Horovod's fusion and Gloo's ring may add in another order from run to run
            assert r["max_diff"] < 1e-5, r


def test_torch_bad_parameters_raise_on_every_rank(torch_run):
    world, out = torch_run
    for r in part(out, "bad"):
        assert r["after"] == float(world)
        _check_errors(r)


def test_keras_identical_on_every_rank_after_every_step(tf_run):
    for r in part(tf_run, "keras"):
        for schedule in ("layerwise", "single"):
            res = r[schedule]
            assert res["identical_every_step"] == [True] * sc.STEPS, schedule
            assert res["moved"] > 0 and res["momentum"] == (0.9, 0.0)
            assert 0 < res["stats"]["bytes_per_step"] < res["stats"]["dense_bytes_per_step"]


def test_tf_tape_and_checkpoint_resume_is_bit_identical(tf_run):
    for r in part(tf_run, "tape"):
        assert r["identical_every_step"] == [True] * sc.STEPS
        assert r["equal"] and r["identical"] and r["state"] == ["u", "v"], r


def test_tf_bad_parameters_raise_on_every_rank(tf_run):
    for r in part(tf_run, "bad"):
        assert r["after"] == 2.0
        _check_errors(r)
        assert "sketch: parameter 'rows'" in r["errors"]["tape"]
