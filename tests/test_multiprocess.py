"""Real Horovod: 2 and 3 worker processes on the Gloo CPU backend (horovod.runner.run).

Every scenario of tests/scenarios/torch_core.py on 2 workers and the training scenario on 3, in the
session's shared PyTorch launches (a module fixture; each test checks one part of what came back)."""

import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios.launch import part  # noqa: E402
from scenarios.shared_launch import TORCH_2, TORCH_3  # noqa: E402
from scenarios.torch_core import TRAIN_SPECS  # noqa: E402


@pytest.fixture(scope="module")
def launches():
    """The session's shared PyTorch launch of each world size (scenarios/shared_launch.py): on 2
    workers every scenario of scenarios/torch_core.py, on 3 the training."""
    def get(world):
        out = {2: TORCH_2, 3: TORCH_3}[world].results("test_multiprocess")
        assert len(out) == world
        return out
    return get


@pytest.fixture(scope="module", params=[2, 3], ids=["2workers", "3workers"])
def trained(request, launches):
    return request.param, part(launches(request.param), "training")


def test_every_compressor_leaves_identical_parameters_on_all_ranks(trained):
    world, results = trained
    assert len(results) == world
    for r in results:
        assert all(r["identical"].values()), r["identical"]
        for spec in TRAIN_SPECS:
            assert r["moved"][spec] > 0, f"{spec} did not train"


def test_bytes_are_measured_and_smaller_than_dense(trained):
    _, results = trained
    b = results[0]["bytes"]
    dense = b["none"]["dense_bytes_per_step"]
    assert b["none"]["bytes_per_step"] == dense
    assert b["fp16"]["bytes_per_step"] == dense / 2
    assert b["bf16"]["bytes_per_step"] == dense / 2
    assert b["topk:ratio=0.05"]["ratio"] > 8  # 5% of entries, 8 bytes each instead of 4
    assert b["randomk:ratio=0.1,seed=1"]["ratio"] > 8


def test_topk_at_ratio_one_equals_dense(trained):
    world, results = trained
    for r in results:
        if world == 2:  # a+b is exact whatever the order; with 3 ranks the sum order may differ
            assert r["ratio1_max_diff"] == 0.0
        else:
            assert r["ratio1_max_diff"] < 1e-6


def test_backward_passes_per_step_exchanges_the_accumulated_gradient(trained):
    _, results = trained
    for r in results:
        assert r["bpps_max_diff"] < 1e-6


def test_empty_selection_on_one_rank_does_not_hang(launches):
    results = part(launches(2), "empty")
    assert all(r["identical"] for r in results)
    assert results[1]["sent"] == [0, 0, 0]  # rank 1 had nothing above the threshold
    for r in results:  # the default schedule measures with one group before it plans (after 6 steps)
        assert r["schedule"] == "auto" and r["plan"] is None and len(r["groups"]) == 1
    assert all(b > 0 for b in results[0]["sent"])


def test_bad_arguments_raise_on_every_rank_before_any_collective(launches):
    results = part(launches(2), "bad")
    expected = {
        "ratio": "parameter 'ratio' must be float in (0.0, 1.0]",
        "unknown": "unknown compressor 'zip'",
        "bpps": "backward_passes_per_step: must be an int >= 1",
        "predivide": "gradient_predivide_factor: must be a finite float > 0",
        "adasum": "op: Adasum is not supported",
        "names": "parameter names must be unique",
        "state_dict": "saved with compression 'topk:ratio=0.05,residual=true'",
        "warmup": "dgc: warmup_schedule must decrease strictly",
        "momentum": "dgc: parameter 'momentum' must be float in [0.0, 1.0)",
    }
    for r in results:
        assert r["after"] == 2.0
        for label, needle in expected.items():
            assert r["errors"][label] is not None and needle in r["errors"][label], (label, r["errors"][label])


def test_checkpoint_resume_continues_bit_identically(launches):
    results = part(launches(2), "resume")
    for r in results:
        for spec, res in r.items():
            assert "error" not in res, res.get("error")
            assert res["has_residual"] and res["equal"] and res["identical"], spec
            assert res["epoch"] == 5


def test_horovod_broadcast_optimizer_state_treats_ours_as_horovods(launches):
    """hvd.broadcast_optimizer_state: no exchange for a fresh state, rank 0's loaded state reaches a
    rank without state (no hang), and parameters and state equal Horovod's own optimizer's."""
    import torch
    results = part(launches(2), "broadcast_state")
    for rank, r in enumerate(results):
        assert "error" not in r, r.get("error")
        ours, theirs = r["hvdcompress"], r["horovod"]
        assert ours["fresh_steps"] == 0  # the state was filled by the wrapped optimizer, not by an exchange
        for key in ("fresh", "restored"):
            assert len(ours[key]) == len(theirs[key]) > 1, (rank, key)
            assert all(torch.equal(a, b) for a, b in zip(ours[key], theirs[key])), (rank, key)
        assert ours["identical"] and theirs["identical"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["hvdcompress"]["restored"],
                                                results[1]["hvdcompress"]["restored"]))
