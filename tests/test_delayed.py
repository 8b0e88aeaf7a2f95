"""Delayed gradient averaging and temporal sparsity (torch_ops.delayed) on real Horovod: the
scenarios of tests/scenarios/delayed.py run in the session's shared PyTorch launches (2 workers;
the unrolled identity also on 3)."""

import numpy as np
import pytest

from scenarios import delayed as sc
from scenarios.launch import part
from scenarios.shared_launch import TORCH_2, TORCH_3


def _ok(name, world=2):
    """Scenario ``name``'s result on every rank, from the shared launch of ``world`` workers."""
    return part({2: TORCH_2, 3: TORCH_3}[world].results("test_delayed"), name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.extended)])  # 3: a repeat at one more rank
def test_unrolled_identity_for_plain_sgd(world):
    results = _ok("unrolled", world)
    lr, n = np.float32(0.1), 7
    c = {(j, t): sc._fixed(j, t) for j in range(world) for t in range(n)}
    mean = {t: np.mean([c[(j, t)] for j in range(world)], axis=0) for t in range(n)}
    for delay in (0, 1, 2, 3):
        for j, r in enumerate(results):
            want = -lr * (sum(mean[t] for t in range(n - delay)) + sum(c[(j, t)] for t in range(n - delay, n)))
            np.testing.assert_allclose(r[str(delay)] if str(delay) in r else r[delay], want, rtol=0, atol=2e-6)
            flushed = -lr * sum(mean[t] for t in range(n))
            np.testing.assert_allclose(r[f"{delay}.flushed"], flushed, rtol=0, atol=2e-6)
        assert all(r[f"{delay}.flushed"] == results[0][f"{delay}.flushed"] for r in results)
    assert results[0]["1"] != results[1]["1"] if "1" in results[0] else results[0][1] != results[1][1]


@pytest.mark.multiprocess
def test_unrolled_identity_with_the_momentum_in_the_compressor():
    """DGC (momentum taken over from SGD) at density 1: the local steps use the local velocity."""
    world, lr, m, n = 2, 0.1, 0.9, 7
    results = _ok("momentum")
    c = {(j, t): sc._fixed(j, t).astype(np.float64) for j in range(world) for t in range(n)}
    u = {}
    for j in range(world):
        acc = np.zeros(6)
        for t in range(n):
            acc = m * acc + c[(j, t)]
            u[(j, t)] = acc
    mean = {t: np.mean([u[(j, t)] for j in range(world)], axis=0) for t in range(n)}
    for si in range(len(sc.MOMENTUM_IDENTITY_SPECS)):
        for delay in (0, 1, 3):
            for j, r in enumerate(results):
                want = -lr * (sum(mean[t] for t in range(n - delay)) + sum(u[(j, t)] for t in range(n - delay, n)))
                np.testing.assert_allclose(r[f"{si}|{delay}"], want, rtol=0, atol=2e-5)
            flushed = [np.asarray(r[f"{si}|{delay}.flushed"]) for r in results]
            np.testing.assert_allclose(flushed[0], -lr * sum(mean[t] for t in range(n)), rtol=0, atol=2e-5)
            assert all(np.array_equal(f, flushed[0]) for f in flushed)
        assert results[0][f"{si}|3"] != results[1][f"{si}|3"]  # the local velocities do differ


@pytest.mark.multiprocess
def test_zero_delay_is_bit_identical_to_the_synchronous_optimizer():
    for r in _ok("zero"):
        assert all(r[s] for s in sc.FLUSH_SPECS), r


@pytest.mark.multiprocess
def test_flush_leaves_identical_parameters_for_every_compressor():
    for r in _ok("flush"):
        for key, (before, after, again) in r.items():
            assert after and again, key
        assert not all(v[0] for v in r.values())  # replicas did differ before the flushes


@pytest.mark.multiprocess
def test_resume_with_exchanges_in_flight_continues_exactly():
    for r in _ok("resume"):
        for spec, (equal, equal_after_flush, in_flight) in r.items():
            assert equal and equal_after_flush and in_flight >= 1, (spec, r[spec])


@pytest.mark.multiprocess
def test_nonfinite_gradients_with_exchanges_in_flight_are_seen_and_never_kept():
    d = sc.NONFINITE_DELAY
    for rank, r in enumerate(_ok("nonfinite")):
        assert "non-finite" in (r.pop("refused") or ""), "a NaN in the delayed velocity was loaded"
        for key, v in r.items():
            spec, bad, mode = key.split("|")
            # rank 1 at once (its local term), every rank when the exchange of step 2 arrives
            assert v["seen"][0] == (2 if rank == 1 else 2 + d) and 2 + d in v["seen"], (rank, key, v)
            if mode == "skip":
                assert v["state_finite"], (rank, key, v)  # (diverged plain runs: refused on load, below)
                assert v["seen"] == ([2, 2 + d] if rank == 1 else [2 + d]), (rank, key, v)
                assert v["params_finite"] and v["identical_after_flush"], (rank, key, v)
            else:
                assert not v["params_finite"], (rank, key, v)  # as with Horovod: the steps applied it


@pytest.mark.parametrize("kwargs, needle", [
    (dict(delay=-1), "delay: must be an int >= 0"),
    (dict(delay=1.5), "delay: must be an int >= 0"),
    (dict(delay=True), "delay: must be an int >= 0"),
    (dict(sync_every=0), "sync_every: must be an int >= 1"),
    (dict(sync_every="2"), "sync_every: must be an int >= 1"),
])
def test_bad_delay_arguments_raise_before_horovod(kwargs, needle):
    import torch
    import hvdcompress.torch as hvc
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError) as err:
        hvc.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)], **kwargs)
    assert needle in str(err.value)
