"""Every tensor a collective or an exchange's result receives is on the gradients' device.

NCCL moves CUDA tensors only, so one tensor the library makes on the default (CPU) device beside
CUDA gradients fails the step (the first GPU run: every spec, every front end, at world size 1), and
a compressor that mixes devices fails on any backend. On this CPU machine every tensor is on the
CPU, so the check follows where tensors come from (tests/scenarios/placement.py): on 2 real Gloo
processes, every spec of benchmarks/gpu_e2e.py through the DDP hook, ``DistributedOptimizer(
backend="torch")`` and DiLoCo, on the branch CUDA tensors take; a tensor made without ``device=`` in
the library (or anything computed from it) must reach neither a collective nor a result.
"""

from __future__ import annotations

import os
import sys

import pytest

from scenarios import placement

sys.path.insert(0, os.path.join(placement.ROOT, "benchmarks"))
import gpu_e2e  # noqa: E402

pytestmark = pytest.mark.multiprocess  # real gloo process groups


@pytest.fixture(scope="module")
def two():
    return placement.launch(2, gpu_e2e.SPECS)


@pytest.mark.parametrize("front", gpu_e2e.FRONT_ENDS)
@pytest.mark.parametrize("spec", gpu_e2e.SPECS)
def test_no_default_device_tensor_reaches_a_collective_or_a_result(two, front, spec):
    for rank, got in enumerate(two):
        run = got[f"{front} {spec}"]
        assert "error" not in run, run.get("error")
        assert run["found"] == [], f"rank {rank}: " + "\n".join(run["found"])
        assert all(run["identical"]), run["identical"]


def test_the_tracer_sees_a_tensor_made_without_a_device():
    """The tracer itself: a factory call without ``device=`` from watched code is traced, so is what
    is computed from it; ``device=`` or a move to a named device is not."""
    import torch
    tracer = placement.make_tracer()
    code = compile("made = torch.zeros(3)\nnamed = torch.zeros(3, device='cpu')\nscalar = torch.tensor(2.0)",
                   os.path.join(placement.ROOT, "torch_ops", "example.py"), "exec")
    scope = {"torch": torch}
    with tracer:
        exec(code, scope)
        derived = scope["made"] * 2
        clean = scope["named"] * scope["scalar"]
        moved = scope["made"].to("cpu")
        joined = torch.stack([scope["scalar"], scope["scalar"]])
        mine = torch.zeros(3)  # made here, in the test: not watched
    assert tracer.offenders([scope["made"], derived, joined]) and len(tracer.offenders([derived])) == 1
    assert "torch_ops/example.py:1" in tracer.offenders([derived])[0]
    assert tracer.offenders([scope["named"], clean, moved, mine]) == []
