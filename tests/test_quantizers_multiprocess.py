"""Quantizers and PowerSGD on real Horovod: 2 and 3 Gloo workers, PyTorch and TF/Keras (one launch
per backend and world size; TF on 2 workers runs in the session's shared TF launch,
tests/scenarios/shared_tf_launch.py). TF on 3 workers trains one compressor per exchange kind
(``sc.TF3_SPECS``: a Keras trace per compressor and process is what these runs cost) and is in the
extended tier (tests/conftest.py); every compressor runs on 3 workers in PyTorch and on 2 in both.

For every new compressor (TernGrad's shared scale included): parameters identical on every rank
after every step, the bytes per step ``opt.stats`` measured equal to the declared packed layout,
training moves the parameters; resume bit-identical (every new compressor on 2 workers, the
stateful ones on 3); bad parameters raise on every rank before any collective, and a collective
still works afterwards; signSGD's majority vote with an even (2: ties give 0) and an odd (3)
number of workers. On 2 workers, our specs inside Horovod's own optimizers
(``horovod.torch.DistributedOptimizer``, ``horovod.tensorflow.keras.DistributedOptimizer``):
none/fp16/bf16 (TF: fp16, none and bf16 too in the extended tier) keep ranks identical and give our
optimizer's parameters; other specs raise.
"""

import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios import kit  # noqa: E402
from scenarios import quantizers as sc  # noqa: E402
from scenarios import shared_tf_launch  # noqa: E402
from scenarios.launch import part  # noqa: E402
from scenarios.shared_launch import TORCH_2, TORCH_3  # noqa: E402

NEEDLES = {"levels": "qsgd: parameter 'levels' must be int in [1, 127]",
           "bucket": "terngrad: parameter 'bucket' must be int in [0, 2147483647]",
           "rank": "powersgd: parameter 'rank' must be int in [1, 65536]"}
# efsignsgd and onebit keep the momentum they took over from the SGD (momentum 0.9) in u
STATE = {"powersgd": ["q", "residual"], "efsignsgd": ["residual", "u"], "onebit": ["residual", "u"],
         "terngrad": ["residual"],
         "signsgd": [], "qsgd": []}


@pytest.fixture(scope="module", params=[("torch", 2), ("tf", 2), ("torch", 3),
                                        pytest.param(("tf", 3), marks=pytest.mark.extended)],
                ids=["torch-2", "tf-2", "torch-3", "tf-3"])  # TF on 3 workers: extended tier (conftest)
def launched(request):
    backend, world = request.param
    if (backend, world) == ("tf", 2):  # tf_everything() in the session's shared TF launch
        return backend, world, shared_tf_launch.results("test_quantizers_multiprocess")
    if backend == "torch":  # torch_everything() in the session's shared PyTorch launch
        return backend, world, part({2: TORCH_2, 3: TORCH_3}[world].results("test_quantizers_multiprocess"),
                                    "everything")
    from scenarios.launch import run_workers
    return backend, world, run_workers(sc.tf_everything, world)


def _ok(r):
    assert "error" not in r, r.get("error")
    return r


def test_identical_parameters_after_every_step_and_declared_bytes(launched):
    backend, world, results = launched
    assert [r["world"] for r in results] == [world] * world
    specs = sc.tf_specs(world) if backend == "tf" else sc.SPECS
    for r in results:
        assert sorted(r["train"]) == sorted(specs), (backend, world, sorted(r["train"]))
    for spec in specs:
        per_rank = [_ok(r["train"][spec]) for r in results]
        for r in per_rank:
            assert r["identical"] == [True] * sc.STEPS, (backend, spec, r["identical"])
            assert r["moved"] > 0, (backend, spec)
            assert r["sent"] == [r["expected"]] * sc.STEPS, (backend, spec, r["sent"], r["expected"])


def test_default_schedule_keeps_ranks_identical(launched):
    backend, world, results = launched
    if backend != "torch" or world != 2:
        pytest.skip("TF's default schedule is layerwise, covered above; torch's auto runs on 2 workers")
    for spec in ("qsgd:levels=3,bucket=64", "powersgd:rank=2"):
        for r in results:
            got = _ok(r["auto"][spec])
            assert got["identical"] == [True] * sc.STEPS, (spec, got)
    assert results[0]["auto"]["powersgd:rank=2"]["schedule"] in ("layerwise", "auto")


def test_resume_is_bit_identical(launched):
    backend, world, results = launched
    specs = sc.RESUME[world] if backend == "torch" else [spec for _, spec in sc.tf_resume(world)]
    if world == 2 and (backend == "torch" or kit.extended()):  # every new compressor
        assert {s.split(":")[0] for s in specs} == {s.split(":")[0] for s in sc.SPECS}
    for spec in specs:
        for r in results:
            got = _ok(r["resume"][spec])
            if world > 2 and spec.startswith("powersgd"):
                # Summed float rounds over 3 ranks differed in the last bits between the straight and
                # the resumed run in the full suite (never alone); likely cause: Horovod's fused
                # allreduce sums in an order set by how that cycle packed its fusion buffer, and with
                # 3 addends the order matters (with 2 it does not: the 2-rank resume stays exact).
                assert got["max_diff"] <= 1e-6, (backend, spec, got["max_diff"])
            else:
                assert got["equal"], (backend, spec)
            assert all(got["identical"]), (backend, spec)
            assert got["state"] == STATE[spec.split(":")[0]], (backend, spec, got["state"])


def test_efsignsgd_takes_the_momentum_over_and_matches_the_oracle_through_the_optimizer(launched):
    """``sc._torch_momentum_inside``: every step's exchanged gradient equals the oracle's
    efsignsgd with the momentum applied before compression, ranks identical, the wrapped SGD at
    momentum 0, the velocity u (equal to the oracle's) saved with the residual."""
    backend, world, results = launched
    if (backend, world) != ("torch", 2):
        pytest.skip("one scenario, PyTorch on 2 workers (TF's momentum take-over: test_quantizers.py)")
    for r in results:
        got = _ok(r["momentum_inside"])
        assert got["exact"] == [True] * sc.STEPS and got["identical"] == [True] * sc.STEPS, got
        assert got["group_momentum"] == 0.0 and got["state"] == ["residual", "u"] and got["u_equal"], got


def test_signsgd_majority_vote_on_real_workers(launched):
    """Plain SGD, lr 1, on a parameter whose gradient is rank r's row of ``sc.TIE``: the update is
    minus the sign of the vote; with 2 workers the split entries (0 and 4) tie and stay 0, and a
    zero gradient votes +1 (entry 3)."""
    backend, world, results = launched
    for r in results:
        assert _ok(r["tie"])["update"] == sc.VOTE[world], (backend, world, r["tie"])


def test_bad_parameters_raise_on_every_rank(launched):
    _, _, results = launched
    for r in results:
        assert r["after"] == float(len(results))
        for label, needle in NEEDLES.items():
            assert r["bad"][label] is not None and needle in r["bad"][label], (label, r["bad"][label])


def test_our_specs_inside_horovods_own_optimizer(launched):
    """hvc.Compression.none/fp16/bf16 in horovod.torch.DistributedOptimizer and
    horovod.tensorflow.keras.DistributedOptimizer: ranks identical after every step, parameters equal
    to our optimizer's with the same spec -- bit for bit, except torch's fp16 with op=Average,
    where Horovod scales the half sum by 1/2 in half precision and we in float32 (equal with
    op=Sum; the rounding itself is shown on two fp16 subnormals); payloads fp16 for fp16 and float32
    for bf16 (Horovod 0.28.1 has no bfloat16); a gathered spec raises on every rank."""
    backend, world, results = launched
    if world != 2:
        pytest.skip("Horovod's own optimizers are tested on 2 workers")
    payload = {"none": "float32", "fp16": "float16", "bf16": "float32", "fp16 op=Sum": "float16"}
    for r in results:
        for name, got in r["interop"].items():
            _ok(got)
            assert got["identical"] == [True] * sc.STEPS, (backend, name, got)
            assert got["moved"] > 0 and got["payload"].endswith(payload[name]), (backend, name, got)
            if backend == "torch" and name == "fp16":
                assert got["max_diff"] < 1e-7, got  # the half-precision scaling of tiny sums
            else:
                assert got["equal_to_ours"], (backend, name, got["max_diff"])
        assert set(r["interop"]) >= set(sc.INTEROP if backend == "torch" else sc.tf_interop())
        refused = _ok(r["refused"])["raised"]
        assert refused and "cannot run inside Horovod's own DistributedOptimizer" in refused, refused
        if backend == "torch":
            assert _ok(r["fp16_average_rounding"]) == {"horovod": 2.0 ** -23, "ours": 1.5 * 2.0 ** -24, "seconds":
                                                      r["fp16_average_rounding"]["seconds"]}
