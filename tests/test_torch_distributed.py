"""hvdcompress on torch.distributed without Horovod: the transport, the DDP communication hook
(``hvdcompress.ddp``), ``DistributedOptimizer(backend="torch")`` and ``DiLoCo(backend="torch")``, on 2 and 3
real Gloo processes (tests/scenarios/ddp.py: one spawn per world size, Horovod's import blocked in every
process).

Every registered compressor, through the hook and through the optimizer: identical parameters on
every rank after every step, a checkpoint resumed exactly, and every exchange equal to the numpy
oracle (``hvdcompress.reference.oracle.simulate``) on the same inputs and state: bit for bit on 2
ranks; on 3, Gloo's allreduce may add in another order than the oracle's rank order, so summed
payloads are compared within float rounding and gathered ones exactly.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from scenarios.ddp import FUSED_SPEC, FUSED_STEPS, SAVE_AT, SPECS, STEPS, launch
from scenarios.diloco import TORCH_CONFIGS, assert_matches_reference
from hvdcompress import parse_spec
from hvdcompress.reference import simulate

pytestmark = pytest.mark.multiprocess  # real gloo process groups

TWO = ["communicator", "every_compressor", "fused", "bad_specs", "nonfinite", "auto_schedule", "default_choice",
       "delayed", "diloco", "example"]
THREE = ["communicator", "every_compressor", "fused", "bad_specs"]


@pytest.fixture(scope="module")
def two():
    return launch(2, TWO)


@pytest.fixture(scope="module")
def three():
    return launch(3, THREE)


def part(results, name):
    for r in results:
        assert not (isinstance(r[name], dict) and "error" in r[name]), r[name]["error"]
    return [r[name] for r in results]


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def world(request, two, three):
    return {2: two, 3: three}[request.param]


def test_no_horovod_anywhere(world):
    assert all(r["horovod_imported"] == [] for r in world)


def test_communicator(world):
    n = len(world)
    for r, got in enumerate(part(world, "communicator")):
        assert (got["rank"], got["size"], got["backend"]) == (r, n, "gloo")
        assert got["gather_int"] == [i for k in range(n) for i in range(k + 1)]  # uneven sizes, rank order
        assert got["sum"] == [float(n * (n + 1) // 2)] * 3 and got["flag"] == [float(n)]
        assert got["empty"] == [0]
        assert got["gather_2d"] == [[float(k)] * 3 for k in range(n) for _ in range(2)]
        # alltoall: rank r receives, from every rank k in order, that rank's piece number r
        splits = [tuple((k + d) % 2 + 1 for d in range(n)) for k in range(n)]
        want = []
        for k in range(n):
            start = sum(splits[k][:r])
            want += [100.0 * k + start + i for i in range(splits[k][r])]
        assert got["alltoall"] == want
        assert got["objs"] == [{"rank": k, "pad": "x" * (7 * k)} for k in range(n)]
        assert got["root"] == ("from", n - 1)
        assert got["mean"] == [sum(range(n)) / n]
        assert got["int16"] == [[i - 300 for k in range(n) for i in range(k)], "torch.int16",
                                [sum(k + 7 for k in range(n))] * 2, "torch.int16"]
        assert got["poll"] is False  # never lets a caller launch in a timing-dependent order
        assert got["versions"]["torch.distributed"] == "gloo"


def test_same_shape_gathers_are_summed_at_two_ranks_and_skip_the_sizes_at_more(world):
    n = len(world)
    for got in part(world, "communicator"):
        same = got["same"]
        assert same["values"] == [[[float(k)] * 3 for k in range(n) for _ in range(2)],
                                  [k + 250 for k in range(n) for _ in range(5)],
                                  [i - 300 * k for k in range(n) for i in range(3)], []]
        assert same["dtypes"] == ["torch.float32", "torch.uint8", "torch.int16", "torch.float32"]
        if n == 2:  # the three non-empty gathers' words in one fused allreduce, no gather
            assert same["counts"] == {"all_reduce": 1, "all_gather": 0, "all_to_all": 0, "barrier": 0}
        else:  # one data collective per non-empty gather, no row-count collective
            assert same["counts"] == {"all_reduce": 0, "all_gather": 3, "all_to_all": 0, "barrier": 0}


def test_communicator_batch_fuses_allreduces(world):
    """Inside ``batch()``: the small allreduces of one dtype share one collective, a large one goes
    alone, the gathers share their row-count collective; nothing is issued before the batch ends
    or one of its requests is waited for; results are the per-request sums, in place."""
    n = len(world)
    s = n * (n - 1) // 2  # sum of the ranks
    for got in part(world, "communicator"):
        f = got["fused"]
        assert f["inside"] == {"all_reduce": 0, "all_gather": 0, "all_to_all": 0, "barrier": 0}
        # f1..f3 at f3's wait: float32 (4 + 1 + 3 + 2 entries), float64, the large one; one row-count
        # gather and the two gathers' data; f4 at the batch's end: float32, float64
        assert f["counts"] == {"all_reduce": 5, "all_gather": 3, "all_to_all": 0, "barrier": 0}
        assert f["f1"] == [[float(s)] * 4, [float(n)], [k for k in range(n) for _ in range(k)]]
        assert f["f2"] == [[n * n / 2] * 2, [float(s)] * 3, 2 ** 18 + 1, [0.0, n * (n + 1) / 2, float(n * (n + 1))],
                           [[float(k)] * 2 for k in range(n)]]
        assert f["f3"] == [2.0 ** -30 * n * (n + 1) / 2] * 2
        assert f["f4"] == [[float(n)] * 5, [3.0 * n]]
        assert f["in_place"]


def test_split_bucket_takes_one_collective_per_round(world):
    """PowerSGD through the hook: a bucket is split into one exchange per parameter, and the
    exchanges' rounds are fused. One bucket for the model: 2 allreduces per step (every P, dense
    1-D tensor and non-finite flag; then every Q), where one per request would be 15. Tiny buckets
    (several once DDP rebuilt them): one allreduce per bucket (its first rounds, launched during
    backward) and one for every bucket's second round. Nothing is gathered; parameters stay identical on every rank."""
    for got in part(world, "fused"):
        for step in got["one_bucket"]:
            assert step["buckets"] == 1 and step["identical"], step
            assert step["collectives"] == {"all_reduce": 2, "all_gather": 0, "all_to_all": 0, "barrier": 0}, step
        assert len(got["tiny_buckets"]) == FUSED_STEPS
        assert max(step["buckets"] for step in got["tiny_buckets"]) > 1  # after DDP's rebuild
        for step in got["tiny_buckets"]:
            assert step["identical"], step
            assert step["collectives"] == {"all_reduce": step["buckets"] + 1, "all_gather": 0, "all_to_all": 0,
                                           "barrier": 0}, step


def test_every_compressor_identical_and_resumed_exactly(world):
    ranks = part(world, "every_compressor")
    for key, got in ranks[0].items():
        assert got["identical"] == [True] * (2 * STEPS - SAVE_AT), key
        assert got["resumed_equal"], key
        assert got["moved"] > 0, key
    assert sorted({spec for _, spec in ranks[0]}) == sorted(SPECS)
    assert {path for path, _ in ranks[0]} == {"hook", "opt"}
    for spec in SPECS:  # something was compressed, through both paths
        if spec.split(":")[0] not in ("none", "sketch"):
            assert ranks[0][("hook", spec)]["ratio"] > 1.0 and ranks[0][("opt", spec)]["ratio"] > 1.0, spec


# algorithms with an allreduce round (DGC: its dense tensors' velocities); the others only gather
SUMMING = {"none", "fp16", "randomk", "sketch", "powersgd", "dgc"}


def _tolerance(spec, world):
    """(rtol, atol relative to the largest magnitude): the project's tolerances (tests/test_properties.py)."""
    if spec.name == "powersgd":
        return 1e-4, 1e-4  # Gram-Schmidt amplifies last-bit differences of torch's and numpy's matmuls
    if world > 2 and spec.name in SUMMING:  # Gloo's ring adds 3 ranks in another order than rank order
        return (2e-3, 1e-3) if spec.name == "fp16" else (1e-5, 1e-6)
    return 0.0, 0.0


def _same(got, want, tol) -> bool:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if tol == (0.0, 0.0):
        return np.array_equal(got, want, equal_nan=True)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    return np.allclose(got, want, rtol=tol[0], atol=tol[1] * scale, equal_nan=True)


def test_exchanges_equal_the_oracle(world):
    """Every logged exchange replayed through the oracle with every rank's input and state."""
    n = len(world)
    logs = [r["log"] for r in world]
    assert len({len(log) for log in logs}) == 1 and logs[0]
    seen, exact = set(), {}
    for entries in zip(*logs):
        e0 = entries[0]
        assert all((e["tag"], e["key"], e["step"]) == (e0["tag"], e0["key"], e0["step"]) for e in entries)
        spec = parse_spec(e0["spec"])
        states = [copy.deepcopy(e["before"]) for e in entries]
        want, after, _ = simulate(spec, [e["x"] for e in entries], states, key=e0["key"], step=e0["step"],
                                  scale=e0["scale"], shape=e0["shape"], epoch=e0["epoch"], members=e0["members"])
        tol = _tolerance(spec, n)
        for r, e in enumerate(entries):
            where = (e0["tag"], e0["key"], e0["step"], r)
            assert np.array_equal(e["result"], e0["result"], equal_nan=True), where  # the same on every rank
            assert _same(e["result"], want, tol), where
            assert sorted(e["after"]) == sorted(after[r]), where
            for k, v in after[r].items():
                assert _same(e["after"][k], v, tol), (where, k)
            exact[e0["tag"][1]] = exact.get(e0["tag"][1], True) and np.array_equal(e["result"], want)
        seen.add(e0["tag"])
    assert seen == {(path, spec) for spec in SPECS for path in ("hook", "opt")} | {("hook-one-bucket", FUSED_SPEC)}
    inexact = {s.split(":")[0] for s, ok in exact.items() if not ok}
    assert inexact <= ({"powersgd"} if n == 2 else SUMMING), inexact  # else bit for bit


def test_bad_specs_raise_on_every_rank(world):
    for got in part(world, "bad_specs"):
        assert got["met_again"]
        for path in ("hook", "opt"):
            assert "ratio" in got[f"{path}.ratio"] and "colums" in got[f"{path}.unknown"], got
            assert "nosuch" in got[f"{path}.name"], got
        assert "backend" in got["opt.backend"] and "'torch'" in got["opt.backend"]
        assert "backend='torch'" in got["opt.horovod_missing"]
        assert "optimizer" in got["hook.optimizer"]


def test_nonfinite_gradient_is_not_hidden(two):
    for got in part(two, "nonfinite"):
        assert got["params_finite"] == [True, False] and got["any_param_nan"]
        assert got["state_finite"] and got["state_keys"]


def test_cost_model_schedule_on_torch_distributed(two):
    for got in part(two, "auto_schedule"):
        assert got["identical"] == [True] * 5
        assert got["plan"] is not None and got["world"] == 2
        assert got["meta"] == {"torch.distributed": "gloo"}


def test_codec_choice_is_the_default_on_torch_distributed(two):
    got = part(two, "default_choice")
    for r in got:
        assert r["codec_choice"] == "auto" and not r["tuning_now"]
        assert r["identical"] == [True] * r["steps"]
        # the choice first (fp16 / dense groups: top-k is dear in the given model), then the fixed choices
        assert any(not c.startswith("topk") for c in r["candidates"][0]), r["candidates"]
        assert any(all(c.startswith("topk") for c in codecs) for codecs in r["candidates"]), r["candidates"]
    assert got[0]["candidates"] == got[1]["candidates"] and got[0]["kept"] == got[1]["kept"]


def test_delayed_averaging_on_torch_distributed(two):
    for got in part(two, "delayed"):
        assert False in got["identical_before_flush"]  # replicas differ by their local steps
        assert got["identical_after_flush"]


@pytest.mark.parametrize("name", sorted(TORCH_CONFIGS))
def test_diloco_under_torchrun_matches_the_reference(two, name):
    """DiLoCo with ``backend="torch"`` (what torchrun launches), against the numpy reference."""
    assert_matches_reference([got["reference"][name] for got in part(two, "diloco")], TORCH_CONFIGS[name])


def test_diloco_under_torchrun_resumes_a_fragment_in_flight_exactly(two):
    for got in part(two, "diloco"):
        assert got["checkpoint"]["in_flight"]
        for a, b in zip(got["checkpoint"]["straight"], got["checkpoint"]["resumed"]):
            assert np.array_equal(a, b)


def test_ddp_digits_example_two_steps(two):
    for got in part(two, "example"):
        assert got["steps"] == 2 and got["world_size"] == 2
        assert got["parameters_identical_across_ranks"]
        assert got["compression_ratio"] > 1.0 and np.isfinite(got["loss"])
