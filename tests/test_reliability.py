"""Reliability on real Horovod: sparse gradients exchanged sparse (SparseAdam works, as with
Horovod's own optimizer), and a model that differs across ranks is a clear error on every rank.

One 2-worker launch runs the scenarios in sequence (a module fixture); the dying-worker tests
launch their own (the job ends with them)."""

import pytest
import torch

from scenarios import reliability as sc
from scenarios.launch import part, run_workers
from scenarios.shared_launch import TORCH_2


@pytest.fixture(scope="module")
def results():
    return TORCH_2.results("test_reliability")  # its four scenarios in the shared PyTorch launch


@pytest.mark.multiprocess
def test_sparse_gradients_are_exchanged_sparse_like_horovod(results):
    for r in part(results, "sparse"):
        assert "error" not in r, r.get("error")
        assert r["identical"] and r["dense_identical"]
        assert r["groups"] == [["emb.weight"]]
        assert r["horovod_attributes"] == (["emb.weight"], 1, True, 2)  # Horovod's introspection names
        assert r["bytes"] < 50 * 8 * 4  # indices + values of the touched rows, not the dense table
        assert r["max_diff_vs_horovod_emb"] < 1e-6
        assert r["as_dense_max_diff_vs_horovod"] < 1e-6  # SparseAdam with sparse_as_dense=True works, as in Horovod


@pytest.mark.multiprocess
def test_a_model_that_differs_across_ranks_is_refused_on_every_rank(results):
    for r in part(results, "models"):
        assert "error" not in r, r.get("error")
        assert r["raised"] and "0.weight" in r["raised"] and "(16, 4)" in r["raised"] and "(17, 4)" in r["raised"]
        assert r["after"] == 1.0  # a collective still works afterwards (average of ones)


@pytest.mark.multiprocess
def test_non_finite_gradients_are_never_hidden_and_never_kept(results):
    for r in part(results, "faults"):
        assert "error" not in r, r.get("error")
        for key, v in r.items():
            spec, bad, mode = key.split("|")
            assert v["seen"], f"{key}: the bad value was hidden from rank's exchanged gradient"
            assert v["state_finite"], f"{key}: non-finite value kept in compression state"
            if mode == "skip":
                assert v["skipped"] == 1 and v["params_finite"] and v["identical"], (key, v)
            else:
                assert not v["params_finite"], (key, v)  # as with Horovod: the step applied it


@pytest.mark.multiprocess
def test_a_parameter_with_a_gradient_on_some_ranks_only_neither_hangs_nor_diverges(results):
    for r in part(results, "partial"):
        assert "error" not in r, r.get("error")
        assert all(r.pop("horovod_identical"))
        for key, v in r.items():
            assert all(v["identical"]), (key, v)  # after every step
            assert v["aux_moved"] > 0, key  # rank 0's gradient of the branch arrived
            if key.startswith("none"):
                assert v["max_diff_vs_horovod"] < 1e-6, (key, v)  # zeros from the rank without one, as Horovod


@pytest.mark.multiprocess
# Horovod's own optimizer is the reference the behaviour of ours is compared with: extended tier
@pytest.mark.parametrize("kind", ["ours", pytest.param("horovod", marks=pytest.mark.extended)])
def test_a_worker_that_dies_mid_step_ends_the_others_within_the_timeout(kind, tmp_path):
    import json
    import time
    start = time.time()
    with pytest.raises(Exception, match="exited with non-zero status"):  # the launcher reports rank 1's exit
        run_workers(sc.dying_worker, 2, kind, str(tmp_path))
    survivor = json.loads((tmp_path / f"{kind}.0.json").read_text())
    print(kind, survivor, "launch wall seconds:", time.time() - start)
    assert survivor["outcome"] in ("raised", "terminated by the launcher"), survivor
    if survivor["outcome"] == "raised":
        assert survivor["error"].startswith("HorovodInternalError"), survivor
    assert survivor["seconds"] < 30, survivor  # far inside Horovod's Gloo timeout (30 s): no hang
    assert not (tmp_path / f"{kind}.1.json").exists()  # rank 1 really died


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_non_finite_count_is_exact_also_when_a_finite_sum_overflows(dtype):
    from torch_ops.nonfinite import count_nonfinite
    big = torch.finfo(dtype).max
    cases = {(): 0, (1.0, 2.0): 0, (big, big, -1.0): 0, (big, -big): 0, (float("nan"),): 1,
             (1.0, float("inf"), float("-inf")): 2, (big, big, float("nan"), 3.0): 1}
    for values, bad in cases.items():
        assert count_nonfinite(torch.tensor(values, dtype=dtype)) == bad, (values, dtype)
    x = torch.randn(1000, dtype=torch.float32).to(dtype)
    x[17] = float("nan")
    assert count_nonfinite(x) == 1
