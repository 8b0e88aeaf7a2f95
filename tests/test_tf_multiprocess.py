"""Real Horovod, TensorFlow backend: 2 worker processes on the Gloo CPU backend (horovod.runner.run).

TensorFlow takes seconds to import in every worker, so one launch runs all scenarios of
tests/scenarios/tf_core.py (the session's shared TF launch: tests/scenarios/shared_tf_launch.py); each test
below checks one part of what it returned.
"""

import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios import shared_tf_launch  # noqa: E402
from scenarios.launch import part as _part  # noqa: E402
from scenarios.tf_core import TAPE_SPECS  # noqa: E402

WORLD = 2
# training to an accuracy (the Keras digits example, dense and DGC): extended tier (conftest)
DIGITS_EPOCHS = shared_tf_launch.digits_epochs()


@pytest.fixture(scope="module")
def results():
    out = shared_tf_launch.results("test_tf_multiprocess")  # tf_core.everything(WORLD, DIGITS_EPOCHS)
    assert len(out) == WORLD
    print("scenario seconds (wall, cpu) per rank:", [r["seconds"] for r in out])
    if DIGITS_EPOCHS:
        print("digits:", {k: (v["test_accuracy"], v["bytes_per_step_last_epoch"]) for k, v in out[0]["digits"].items()}
              if "error" not in out[0]["digits"] else out[0]["digits"])
    return out


def test_keras_fit_leaves_identical_parameters_on_all_ranks(results):
    for r in _part(results, "keras"):
        assert r["identical"] and all(r["identical"].values()), r["identical"]
        assert all(m > 0 for m in r["moved"].values()), r["moved"]
        assert r["bpps2_iterations_exchanges"] == (6, 3)  # every pass counts, every 2nd exchanges
        assert r["dgc_momentum_taken_over"] == (0.8, 0.0)


def test_warmup_callback_moves_the_density_during_fit(results):
    from hvdcompress.warmup import density_at
    for r in _part(results, "keras"):
        assert r["fit_density"] == pytest.approx([density_at(e, 0.05, 2) for e in range(3)])
        assert r["fit_wire"][0] > r["fit_wire"][2] > 0


def test_bytes_are_measured_and_smaller_than_dense(results):
    b = _part(results, "tape")[0]["bytes"]
    dense = b["none"]["dense_bytes_per_step"]
    assert b["none"]["bytes_per_step"] == dense
    assert b["fp16"]["bytes_per_step"] == dense / 2
    assert b["bf16"]["bytes_per_step"] == dense / 2
    assert b["topk:ratio=0.05"]["ratio"] > 8  # 5% of entries, 8 bytes each instead of 4
    assert b["randomk:ratio=0.1,seed=1"]["ratio"] > 8


def test_gradient_tape_leaves_identical_parameters_and_topk_1_equals_dense(results):
    for r in _part(results, "tape"):
        assert all(r["identical"][s] for s in TAPE_SPECS), r["identical"]
        assert all(r["moved"][s] > 0 for s in TAPE_SPECS), r["moved"]
        assert r["ratio1_max_diff"] == 0.0  # a+b is exact whatever the order with 2 ranks


def test_a_training_step_is_traced_once(results):
    # the state the exchange creates in the step's first trace (residuals, the clock, a stateless
    # spec's cached object) and the wrapped Keras optimizer's slots must not make TensorFlow trace
    # the step a second time (tf_ops.variables); the tape's own optimizer is built beforehand
    for r in _part(results, "tape"):
        assert r["traces"] == {s: 1 for s in TAPE_SPECS}, r["traces"]
    for r in _part(results, "keras"):
        assert r["traces"] and all(n == 1 for n in r["traces"].values()), r["traces"]


def test_checkpoint_resume_continues_bit_identically(results):
    for r in _part(results, "resume"):
        for label, res in r.items():
            assert res["equal"] and res["identical"], label
            assert res["step"] == 6, label
            assert res["state"] == (["u", "v"] if "dgc" in label else ["residual"]), label


def test_bad_arguments_raise_on_every_rank_before_any_collective(results):
    expected = {
        "ratio": "parameter 'ratio' must be float in (0.0, 1.0]",
        "unknown": "unknown compressor 'zip'",
        "bpps": "backward_passes_per_step: must be an int >= 1",
        "predivide": "gradient_predivide_factor: must be a finite float > 0",
        "adasum": "op: Adasum is not supported",
        "groups": "explicit grouping is not supported",
        "warmup": "dgc: warmup_schedule must decrease strictly",
        "tape_state": "create it once, outside the training step",
        "checkpoint": "saved with another compression spec",
    }
    for r in _part(results, "bad"):
        assert r["after"] == 2.0
        for label, needle in expected.items():
            assert r["errors"][label] is not None and needle in r["errors"][label], (label, r["errors"][label])


def test_empty_selection(results):
    parts = _part(results, "special")
    for r in parts:
        assert r["empty"]["identical"]
    assert parts[1]["empty"]["sent"] == [0, 0, 0]  # rank 1 had nothing above the threshold
    assert all(b > 0 for b in parts[0]["empty"]["sent"])


@pytest.mark.extended  # Keras with top-k on an embedding, no warning: test_tf_sparse.py's keras:sgd:topk
def test_sparse_gradients(results):
    for r in _part(results, "special"):
        assert r["sparse"]["identical"]
        assert not r["sparse"]["warned"]  # exchanged sparse by default now (tests/test_tf_sparse.py), no warning


@pytest.mark.extended
def test_dgc_with_warmup_converges_on_digits_within_2pp_of_dense(results):
    r = _part(results, "digits")[0]
    dense, dgc = r["none"], r["dgc:ratio=0.001"]
    assert dense["parameters_identical_across_ranks"] and dgc["parameters_identical_across_ranks"]
    assert dgc["test_accuracy"] >= dense["test_accuracy"] - 0.02, (dense["test_accuracy"], dgc["test_accuracy"])
    assert dgc["bytes_per_step_last_epoch"] * 20 < dense["dense_bytes_per_step"]
