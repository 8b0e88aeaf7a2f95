"""Top-k Adam on real Horovod workers (tests/scenarios/onebitadam.py, ``torch_topkadam`` and
``tf_topkadam``): PyTorch and Keras on 2 Gloo workers in the session's shared launches. Keras (SGD,
momentum 0, decoupled weight decay: AdamW's step on the direction): identical every step, the
oracle's replay within float32 rounding, exact resume, a bad ratio refused. PyTorch: AdamW taken
over: parameters identical on every rank after every step and equal to the numpy oracle's replay
of the same local gradients; the warm-up's dense bytes, then topk's payload of the moment; a
checkpoint after the warm-up resumes bit for bit with the frozen variance, the moment and the
residual in it; a ratio outside (0, 1] and momentum SGD raise on every rank before any collective
(a collective still works afterwards)."""

import pytest

pytestmark = pytest.mark.multiprocess  # launches Horovod workers (conftest.py)

from scenarios import shared_tf_launch  # noqa: E402
from scenarios.launch import part  # noqa: E402
from scenarios.shared_launch import TORCH_2  # noqa: E402


@pytest.fixture(scope="module")
def torch_results():
    return part(TORCH_2.results("test_topkadam_multiprocess"), "all")


def _ok(r):
    assert not (isinstance(r, dict) and "error" in r), r.get("error")
    return r


def test_torch_adamw_taken_over_identical_and_equal_to_the_oracle(torch_results):
    for r in torch_results:
        t = _ok(r["training"])
        assert all(t["identical"]), t["identical"]
        assert t["oracle_diff"] is None or t["oracle_diff"] == 0.0, t["oracle_diff"]
        assert "ratio=0.1" in t["spec"] and "beta2=0.95" in t["spec"] and "eps=1e-08" in t["spec"], t["spec"]
        assert t["adam_state"] == 0  # the wrapped AdamW keeps no moments of its own
        warm, compressed = t["sent"][:3], t["sent"][3:]
        assert len(set(warm)) == 1 and set(compressed) == {r["compressed"]}, (t["sent"], r["compressed"])
        assert warm[0] >= 4 * compressed[0], t["sent"]  # dense float32, then 10% of the entries as 8-byte pairs
    assert torch_results[0]["training"]["oracle_diff"] == 0.0


def test_torch_resume_is_exact_with_the_frozen_variance_moment_and_residual(torch_results):
    for r in torch_results:
        res = _ok(r["resume"])
        assert res["equal"] and all(res["identical"]), res
        assert res["state"] == ["m", "residual", "v"]


@pytest.mark.parametrize("label, needle", [
    ("ratio_zero", "topkadam: parameter 'ratio' must be float in (0.0, 1.0]; got 0.0"),
    ("ratio_above_one", "topkadam: parameter 'ratio' must be float in (0.0, 1.0]; got 1.5"),
    ("sgd_momentum", "momentum=0.9 (parameter group 0) would apply a second momentum"),
])
def test_torch_bad_combinations_raise_on_every_rank(torch_results, label, needle):
    for r in torch_results:
        msg = _ok(r["refused"])[label]
        assert msg is not None and needle in msg, msg
        assert r["after"] == 2.0  # a collective after the refusals: no rank was left in one


@pytest.fixture(scope="module")
def tf_results():
    return shared_tf_launch.results("test_topkadam_multiprocess")


def test_keras_sgd_applies_the_direction_identical_near_the_oracle_and_resumes(tf_results):
    for r in tf_results:
        t = _ok(r["training"])
        assert all(t["identical"]), t["identical"]
        warm, compressed = t["sent"][:3], t["sent"][3:]
        assert len(set(warm)) == 1 and len(set(compressed)) == 1 and warm[0] >= 4 * compressed[0], t["sent"]
        assert t["resume"]["equal"] and t["resume"]["identical"], t["resume"]
        assert t["resume"]["state"] == ["m", "residual", "v"]
        assert "topkadam: parameter 'ratio' must be float in (0.0, 1.0]" in (r["refused"] or ""), r["refused"]
        assert r["after"] == 2.0
    # Keras applies the decay and the step in its own order of float32 operations
    assert tf_results[0]["training"]["oracle_diff"] < 1e-5, tf_results[0]["training"]["oracle_diff"]


# -- qsgdadam and the 16-bit warm-up (warmup_codec), in the same launches -----------------------------
@pytest.mark.parametrize("entry", ["qsgdadam", "fp16_warmup"])
def test_torch_qsgdadam_and_a_16_bit_warm_up_follow_the_oracle_and_resume(torch_results, entry):
    for r in torch_results:
        t = _ok(r[entry]["training"])
        assert all(t["identical"]), t["identical"]
        assert t["oracle_diff"] is None or t["oracle_diff"] == 0.0, t["oracle_diff"]
        assert "beta2=0.95" in t["spec"] and t["adam_state"] == 0, t
        warm, compressed = t["sent"][:3], t["sent"][3:]
        assert set(warm) == {r["dense"] // 2}, (warm, r["dense"])  # 2 bytes an entry: fp16 or bf16 codes
        want = r[entry].get("compressed", r["compressed"])  # qsgd's payload, or topk's
        assert set(compressed) == {want}, (compressed, want)
        res = _ok(r[entry]["resume"])
        assert res["equal"] and all(res["identical"]) and res["state"] == ["m", "residual", "v"], res
        assert r["after"] == 2.0
    assert all(torch_results[0][e]["training"]["oracle_diff"] == 0.0 for e in ("qsgdadam", "fp16_warmup"))


@pytest.mark.parametrize("label, needle", [
    ("levels_zero", "qsgdadam: parameter 'levels' must be int in [1, 127]; got 0"),
    ("warmup_codec", "qsgdadam: parameter 'warmup_codec' must be one of"),
    ("sgd_momentum", "momentum=0.9 (parameter group 0) would apply a second momentum"),
])
def test_torch_qsgdadam_bad_combinations_raise_on_every_rank(torch_results, label, needle):
    for r in torch_results:
        msg = _ok(r["qsgdadam"]["refused"])[label]
        assert msg is not None and needle in msg, msg


# topkadam's fp16 warm-up on Keras: topkadam's Keras run above and the fp16 codec's exchange
# (test_tf_multiprocess's tape) in the default suite, its arithmetic in test_properties: extended tier
@pytest.mark.parametrize("entry", ["qsgdadam", pytest.param("fp16_warmup", marks=pytest.mark.extended)])
def test_keras_qsgdadam_and_a_16_bit_warm_up_follow_the_oracle_and_resume(tf_results, entry):
    for r in tf_results:
        t, base = _ok(r[entry]), r["training"]
        assert all(t["identical"]), t["identical"]
        assert set(t["sent"][:3]) == {base["sent"][0] // 2}, (t["sent"], base["sent"])  # half of float32's warm-up
        assert len(set(t["sent"][3:])) == 1, t["sent"]
        if entry == "fp16_warmup":
            assert t["sent"][3:] == base["sent"][3:]  # the same topk payload after the warm-up
        assert t["resume"]["equal"] and t["resume"]["identical"], t["resume"]
        assert t["resume"]["state"] == ["m", "residual", "v"]
    assert tf_results[0][entry]["oracle_diff"] < 1e-5, tf_results[0][entry]["oracle_diff"]
