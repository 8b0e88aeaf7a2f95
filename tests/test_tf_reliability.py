"""Reliability on real Horovod, TensorFlow/Keras (2 Gloo workers; the TF rows of the fault matrix
of tests/test_reliability.py): non-finite gradients are never hidden and never kept, Keras'
LossScaleOptimizer skips the bad steps on every rank, a checkpoint with non-finite compression
state is refused on every rank, a model that differs across ranks is a clear error."""

import pytest

from scenarios import tf_reliability as sc
from scenarios.launch import NO_GRAPH_OPTIMIZER, part, run_workers


@pytest.fixture(scope="module")
def results():
    out = run_workers(sc.everything, 2, start_timeout=120,
                      env={"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", NO_GRAPH_OPTIMIZER: "1"})
    print("seconds per rank:", [r["seconds"] for r in out])
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", ["faults", "eager"])
def test_non_finite_gradients_are_seen_on_every_rank_and_never_kept(results, scenario):
    for r in part(results, scenario):
        assert set(r) == set(sc.FAULT_SPECS if scenario == "faults" else sc.EAGER_SPECS), sorted(r)
        for spec, v in r.items():
            assert v["seen"] == [True, True], (spec, v)  # inf at step 2, NaN at step 4: every rank skips
            assert v["skipped"] == 2 and v["state_finite"], (spec, v)
            assert v["params_finite"] and v["identical"], (spec, v)


@pytest.mark.multiprocess
def test_a_plain_step_applies_the_bad_value_as_horovod_does(results):
    for r in part(results, "plain"):
        assert set(r) == set(sc.PLAIN_SPECS), sorted(r)
        for spec, v in r.items():
            assert not v["params_finite"] and v["state_finite"], (spec, v)


@pytest.mark.multiprocess
def test_keras_loss_scale_optimizer_skips_the_bad_steps_on_every_rank(results):
    for r in part(results, "loss_scale"):
        assert set(r) == set(sc.LOSS_SCALE_SPECS), sorted(r)
        for spec, v in r.items():
            assert [v["unchanged"][s] for s in sc.INJECT] == [True, True], (spec, v)
            assert not any(v["unchanged"][s] for s in range(sc.STEPS) if s not in sc.INJECT), (spec, v)
            assert v["scales"][2] == v["scales"][1] / 2 and v["scales"][4] == v["scales"][3] / 2, (spec, v)
            assert v["params_finite"] and v["identical"] and v["state_finite"], (spec, v)


@pytest.mark.multiprocess
def test_a_checkpoint_with_non_finite_state_is_refused_on_every_rank(results):
    for r in part(results, "checkpoint"):
        assert r["refused"], r
        assert r["after"] == 1.0  # a collective still works afterwards (average of ones)


@pytest.mark.multiprocess
def test_a_model_that_differs_across_ranks_is_refused_on_every_rank(results):
    for r in part(results, "models"):
        assert "/kernel:0' (gradient 0)" in r["tape.width"] and "(16, 32)" in r["tape.width"] and "(16, 33)" in r["tape.width"]
        assert "rank 0 has 4 gradients, rank 1 has 6" in r["tape.extra"], r["tape.extra"]
        assert "kernel" in r["keras.width"] and "(16, 33)" in r["keras.width"], r["keras.width"]
        assert r["after"] == 1.0  # a collective still works afterwards (average of ones)


def test_the_non_finite_flag_is_exact_also_when_a_finite_sum_overflows():
    import tensorflow as tf
    from tf_ops.nonfinite import _flag
    for dtype in (tf.float16, tf.bfloat16, tf.float32, tf.float64):
        big = float(dtype.max)
        cases = {(): 0.0, (1.0, 2.0): 0.0, (big, big, -1.0): 0.0, (big, -big): 0.0, (float("nan"),): 1.0,
                 (1.0, float("inf")): 1.0, (big, big, float("nan")): 1.0}
        for values, flag in cases.items():
            x = tf.constant(values, dtype=tf.float64 if dtype == tf.float64 else tf.float32, shape=[len(values)])
            x = tf.cast(x, dtype) if dtype != tf.float64 else x
            assert float(_flag(x)[0]) == flag, (values, dtype)
            assert float(tf.function(_flag)(x)[0]) == flag, (values, dtype)
