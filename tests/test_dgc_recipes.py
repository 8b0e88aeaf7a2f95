"""DGC on real training recipes, on real Horovod: 2 Gloo workers per backend, one launch each
(tests/scenarios/dgc_recipes.py runs the scenarios).

Weight decay: DGC with everything sent, no warm-up and masking off must give the parameters of
dense momentum SGD with the same weight decay, up to float rounding (TOLERANCE). Weight decay that
bypassed DGC's momentum would differ by orders of magnitude more, so the check tells them apart.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios import shared_tf_launch  # noqa: E402
from scenarios.launch import part  # noqa: E402
from scenarios.shared_launch import TORCH_2  # noqa: E402

WORLD = 2
TOLERANCE = 1e-5  # max |dense - dgc| over the parameters after 40 steps, lr 0.05; rounding alone: ~1e-7


@pytest.fixture(scope="module")
def torch_results():
    out = part(TORCH_2.results("test_dgc_recipes"), "all")  # torch_all() in the shared PyTorch launch
    _show(out)
    return out


@pytest.fixture(scope="module")
def tf_results():
    out = shared_tf_launch.results("test_dgc_recipes")  # tf_all() on 2 workers (tests/scenarios/shared_tf_launch.py)
    _show(out)
    return out


def _show(out):
    wd = out[0].get("weight_decay", {})
    print("max |dense - dgc| per case:", {k: v.get("max_abs_diff") for k, v in wd.items()} if "error" not in wd else wd)


def _weight_decay(results):
    for r in part(results, "weight_decay"):
        for case, c in r.items():
            assert c["identical"], case
            assert c["moved"] > 100 * TOLERANCE, (case, c)  # the runs trained: the check can fail
            assert c["max_abs_diff"] <= TOLERANCE, (case, c)


def test_torch_dgc_with_weight_decay_trains_like_dense_momentum_sgd(torch_results):
    _weight_decay(torch_results)
    r = part(torch_results, "weight_decay")[0]["nesterov=False,wd=0.005"]
    assert r["groups"] == [[0.0, 0.005, 0.0], [0.0, 0.0025, 0.0]]  # taken over per group


def test_keras_dgc_with_weight_decay_trains_like_dense_momentum_sgd(tf_results):
    _weight_decay(tf_results)
    r = part(tf_results, "weight_decay")[0]["nesterov=False,wd=0.005"]
    assert r["config"] == [0.005, 0.0]  # Keras's decoupled decay stays with the optimizer


def test_torch_clipping_does_not_depend_on_the_merge_schedule(torch_results):
    for r in part(torch_results, "clipping"):
        for scope in ("tensor", "global"):
            c = r[scope]
            assert c["identical"]
            assert all(c["equal"].values()), (scope, c["max_abs_diff"])
            assert c["groups"]["layerwise"] == 4 and c["groups"]["single"] == 1 and 1 < c["groups"]["size:0.003"] < 4
        unclipped, tensor, whole = (np.array(x) for x in (r["unclipped"], r["tensor"]["flat"], r["global"]["flat"]))
        assert np.abs(tensor - unclipped).max() > 1e-3 and np.abs(whole - unclipped).max() > 1e-3  # clipping acts
        assert np.abs(tensor - whole).max() > 1e-4  # and the scopes differ


def test_keras_tensor_clipping_does_not_depend_on_the_merge_schedule(tf_results):
    for r in part(tf_results, "clipping"):
        assert r["identical"] and r["equal"], r
        assert r["clipping_acts"] > 1e-3


def test_torch_global_norm_and_weight_decay_momentum_are_checkpointed(torch_results):
    for r in part(torch_results, "resume"):
        assert r["equal"] and r["wd_momentum_saved"] and r["saved_norm"] > 0


def test_what_cannot_be_honoured_is_refused_on_every_rank(torch_results, tf_results):
    for r in part(torch_results, "refusals"):
        assert "dampening=0.1" in r["dampening"] and "dampening must be 0" in r["dampening"]
        assert "maximize=True" in r["maximize"]
        assert "dampening=0.5" in r["sketch_dampening"]
    for r in part(tf_results, "refusals"):
        for key in ("clipnorm", "clipvalue", "global_clipnorm"):
            assert f"{key}=1.0 cannot be honoured" in r[key], r[key]
        assert "clip_scope" in r["global"] and "PyTorch only" in r["global"]
