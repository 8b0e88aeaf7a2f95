"""1-bit Adam on real Horovod workers (tests/scenarios/onebitadam.py): PyTorch and Keras on 2 Gloo
workers in the session's shared launches. Keras (SGD, momentum 0, decoupled weight decay: AdamW's
step on the direction): identical every step, the oracle's replay within float32 rounding, exact
resume, Adam / momentum SGD / DGC under Adam refused. PyTorch: AdamW taken over: parameters identical on every rank after every
step and equal to the numpy oracle's replay of the same local gradients; the warm-up's dense
bytes, then the 1-bit payload; a checkpoint after the warm-up resumes bit for bit with the frozen
variance, the moment and the residual in it; bad combinations raise on every rank before any
collective (a collective still works afterwards)."""

import pytest

pytestmark = pytest.mark.multiprocess  # launches Horovod workers (conftest.py)

from scenarios import onebitadam as sc  # noqa: E402
from scenarios import shared_tf_launch  # noqa: E402
from scenarios.launch import part  # noqa: E402
from scenarios.shared_launch import TORCH_2  # noqa: E402


@pytest.fixture(scope="module")
def torch_results():
    return part(TORCH_2.results("test_onebitadam_multiprocess"), "all")


def _ok(r):
    assert not (isinstance(r, dict) and "error" in r), r.get("error")
    return r


def test_torch_adamw_taken_over_identical_and_equal_to_the_oracle(torch_results):
    for r in torch_results:
        t = _ok(r["training"])
        assert all(t["identical"]), t["identical"]
        assert t["oracle_diff"] is None or t["oracle_diff"] == 0.0, t["oracle_diff"]
        assert "beta2=0.95" in t["spec"] and "eps=1e-08" in t["spec"], t["spec"]
        assert t["adam_state"] == 0  # the wrapped AdamW keeps no moments of its own
        warm, compressed = t["sent"][:3], t["sent"][3:]
        assert len(set(warm)) == 1 and len(set(compressed)) == 1, t["sent"]
        assert warm[0] >= 16 * compressed[0], t["sent"]  # dense float32 warm-up, then about 1 bit an entry
    assert torch_results[0]["training"]["oracle_diff"] == 0.0


def test_torch_resume_is_exact_with_the_frozen_variance_moment_and_residual(torch_results):
    for r in torch_results:
        res = _ok(r["resume"])
        assert res["equal"] and all(res["identical"]), res
        assert res["state"] == ["m", "residual", "v"]


@pytest.mark.parametrize("label, needle", [
    ("sgd_momentum", "momentum=0.9 (parameter group 0) would apply a second momentum"),
    ("amsgrad", "amsgrad=True (parameter group 0) cannot be honoured"),
    ("adam_l2", "use torch.optim.AdamW"),
    ("rmsprop", "is neither Adam/AdamW nor SGD"),
    ("dgc_adamw", "use 'onebitadam'"),
])
def test_torch_bad_combinations_raise_on_every_rank(torch_results, label, needle):
    for r in torch_results:
        msg = _ok(r["refused"])[label]
        assert msg is not None and needle in msg, msg
        assert r["after"] == 2.0  # a collective after the refusals: no rank was left in one


@pytest.fixture(scope="module")
def tf_results():
    return shared_tf_launch.results("test_onebitadam_multiprocess")


def test_keras_sgd_applies_the_direction_identical_near_the_oracle_and_resumes(tf_results):
    for r in tf_results:
        t = _ok(r["training"])
        assert all(t["identical"]), t["identical"]
        warm, compressed = t["sent"][:3], t["sent"][3:]
        assert len(set(warm)) == 1 and len(set(compressed)) == 1 and warm[0] >= 16 * compressed[0], t["sent"]
        assert t["resume"]["equal"] and t["resume"]["identical"], t["resume"]
        assert t["resume"]["state"] == ["m", "residual", "v"]
    # the exchange is the oracle's bit for bit (tests/test_onebitadam.py); Keras applies the decay
    # and the step in its own order of float32 operations
    assert tf_results[0]["training"]["oracle_diff"] < 1e-5, tf_results[0]["training"]["oracle_diff"]


@pytest.mark.parametrize("label, needle", [
    ("adam", "wrap tf.keras.optimizers.SGD(learning_rate, momentum=0.0"),
    ("sgd_momentum", "momentum=0.9 would apply a second momentum"),
    ("dgc_adam", "use 'onebitadam'"),
])
def test_keras_bad_combinations_raise_on_every_rank(tf_results, label, needle):
    for r in tf_results:
        msg = _ok(r["refused"])[label]
        assert msg is not None and needle in msg, msg
        assert r["after"] == 2.0
