"""Sparse gradients on TensorFlow/Keras, real Horovod (2 Gloo workers, one launch): an Embedding's
``tf.IndexedSlices`` gradient is exchanged sparse and uncompressed by default, as Horovod's own
tape and Keras optimizer do (same values and indices; same parameters after training with SGD,
Adam and legacy Adagrad), densified and compressed with ``sparse_as_dense=True``, identical on
every rank after every step; a NaN in it is seen everywhere; a bad ``sparse_as_dense`` is refused
on every rank."""

import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios import tf_sparse as sc  # noqa: E402
from scenarios import shared_tf_launch  # noqa: E402
from scenarios.launch import part  # noqa: E402

SPECS = ("none", "topk:ratio=0.1")


@pytest.fixture(scope="module")
def results():
    out = shared_tf_launch.results("test_tf_sparse")  # sc.everything() on 2 workers (tests/scenarios/shared_tf_launch.py)
    print("seconds per rank:", [r["seconds"] for r in out])
    print("max |ours - Horovod's| after training:",
          {k: r.get("max_diff_vs_horovod") for k, r in out[0].items() if k.startswith("keras:")})
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_tape_exchanges_indexed_slices_sparse_as_horovod_does(results, spec):
    for r in part(results, f"tape:{spec}:False"):
        assert r["kinds"] == ["IndexedSlices", "dense", "dense"], r["kinds"]
        assert r["embedding_same_as_horovod"], r        # the same values and indices, bit for bit
        assert r["embedding_slots"] == [], r            # uncompressed: no residual for it
        assert all(r["identical"]) and len(r["identical"]) == sc.STEPS, r
        assert r["untouched_rows_unchanged"], r         # a sparse SGD update touches only gathered rows
        if spec == "none":
            assert r["dense_close_to_horovod"], r
            dense = (3 * sc.DIM + 3) * 4                 # the Dense layer, allreduced
            # plus this rank's own rows: values (float32) and indices (int32)
            assert r["last_bytes"] == dense + r["rows"] * sc.DIM * 4 + r["rows"] * 4, r


@pytest.mark.parametrize("spec", SPECS)
def test_sparse_as_dense_densifies_and_compresses(results, spec):
    for r in part(results, f"tape:{spec}:True"):
        assert r["kinds"] == ["dense", "dense", "dense"], r["kinds"]
        assert all(r["identical"]), r
        if spec == "none":
            assert r["embedding_same_as_horovod"] or r["dense_close_to_horovod"], r
        else:
            assert r["embedding_slots"] == ["residual"], r  # compressed with error feedback


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adam", marks=pytest.mark.extended), "legacy_adagrad"])
def test_keras_optimizer_matches_horovods_own_on_an_embedding(results, optimizer):
    for r in part(results, f"keras:{optimizer}:none"):
        assert all(r["identical"]) and len(r["identical"]) == sc.STEPS, r
        assert r["max_diff_vs_horovod"] <= 1e-6, r
        assert r["embedding_slots"] == [], r


def test_keras_optimizer_with_topk_keeps_the_embedding_sparse(results):
    for r in part(results, "keras:sgd:topk"):
        assert all(r["identical"]), r
        assert r["embedding_slots"] == [], r             # the embedding: sparse, no residual
        assert r["last_bytes"] < r["last_dense_bytes"], r
        assert not r["warned"], r  # exchanged sparse by default: TF's dense-conversion warning never shows


def test_a_nan_in_a_sparse_gradient_reaches_every_rank(results):
    for r in part(results, "nonfinite"):
        assert r == {"kind": "IndexedSlices", "nan_seen": True}, r


def test_a_bad_sparse_as_dense_is_refused_on_every_rank(results):
    for r in part(results, "bad_arguments"):
        assert r["keras"].startswith("sparse_as_dense:") and "'yes'" in r["keras"], r
        assert r["tape"].startswith("sparse_as_dense:"), r
        assert r["after"] == 1.0, r


def test_elastic_state_refuses_what_cannot_follow_a_reset_on_every_rank(results):
    for r in part(results, "elastic_bad_arguments"):
        for arg in ("delay", "backward_passes_per_step", "schedule"):
            assert r[arg].startswith(f"{arg}:"), (arg, r[arg])
        assert "delayed averaging" in r["delay"] and "'mgwfbp'" in r["schedule"], r
        assert r["compression"].startswith("compression:") and "GradientCompression" in r["compression"], r
        assert r["after"] == 1.0, r
