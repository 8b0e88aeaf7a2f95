"""Top-k Adam on real Horovod workers (tests/scenarios/onebitadam.py, ``torch_topkadam``): PyTorch
on 2 Gloo workers in the session's shared launch. AdamW taken over: parameters identical on every
rank after every step and equal to the numpy oracle's replay of the same local gradients; the
warm-up's dense bytes, then topk's payload of the moment; a checkpoint after the warm-up resumes
bit for bit with the frozen variance, the moment and the residual in it; a ratio outside (0, 1]
and momentum SGD raise on every rank before any collective (a collective still works afterwards)."""

import pytest

pytestmark = pytest.mark.multiprocess  # launches Horovod workers (conftest.py)

from scenarios.launch import part  # noqa: E402
from scenarios.shared_launch import TORCH_2  # noqa: E402


@pytest.fixture(scope="module")
def results():
    return part(TORCH_2.results("test_topkadam_multiprocess"), "all")


def _ok(r):
    assert not (isinstance(r, dict) and "error" in r), r.get("error")
    return r


def test_adamw_taken_over_identical_and_equal_to_the_oracle(results):
    for r in results:
        t = _ok(r["training"])
        assert all(t["identical"]), t["identical"]
        assert t["oracle_diff"] is None or t["oracle_diff"] == 0.0, t["oracle_diff"]
        assert "ratio=0.1" in t["spec"] and "beta2=0.95" in t["spec"] and "eps=1e-08" in t["spec"], t["spec"]
        assert t["adam_state"] == 0  # the wrapped AdamW keeps no moments of its own
        warm, compressed = t["sent"][:3], t["sent"][3:]
        assert len(set(warm)) == 1 and set(compressed) == {r["compressed"]}, (t["sent"], r["compressed"])
        assert warm[0] >= 4 * compressed[0], t["sent"]  # dense float32, then 10% of the entries as 8-byte pairs
    assert results[0]["training"]["oracle_diff"] == 0.0


def test_resume_is_exact_with_the_frozen_variance_moment_and_residual(results):
    for r in results:
        res = _ok(r["resume"])
        assert res["equal"] and all(res["identical"]), res
        assert res["state"] == ["m", "residual", "v"]


@pytest.mark.parametrize("label, needle", [
    ("ratio_zero", "topkadam: parameter 'ratio' must be float in (0.0, 1.0]; got 0.0"),
    ("ratio_above_one", "topkadam: parameter 'ratio' must be float in (0.0, 1.0]; got 1.5"),
    ("sgd_momentum", "momentum=0.9 (parameter group 0) would apply a second momentum"),
])
def test_bad_combinations_raise_on_every_rank(results, label, needle):
    for r in results:
        msg = _ok(r["refused"])[label]
        assert msg is not None and needle in msg, msg
        assert r["after"] == 2.0  # a collective after the refusals: no rank was left in one
