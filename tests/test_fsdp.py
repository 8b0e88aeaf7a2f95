"""FSDP2 (``fully_shard``) with our compressing reduce-scatter (``hvdcompress.fsdp``) on 2 and 3 real
gloo processes (tests/scenarios/fsdp.py: one spawn per world size, Horovod's import blocked).

Every reduce-scatter of every supported kind of spec and residual mode equals the numpy oracle
(``hvdcompress.reference.fsdp.reduce_scatter``, replayed here on all ranks' recorded inputs with
its own state) bit for bit; every rank's gathered parameters are identical after every step; a
checkpoint resumes exactly; a non-finite gradient gives NaN everywhere and leaves finite state;
bad specs and options are refused on every rank before any collective. Single-process tests cover
the oracle's own rules and the state table of docs/fsdp.md.
"""

from __future__ import annotations

import os
import numpy as np
import pytest

from hvdcompress.reference.fsdp import int8_decode, int8_encode, reduce_scatter, refusal, shard_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def two():
    from scenarios.fsdp import launch
    return launch(2, ["every_spec", "nonfinite", "checkpoint", "refusals", "mixed_precision", "example",
                      "torch_only"])


@pytest.fixture(scope="module")
def three():
    from scenarios.fsdp import launch
    return launch(3, ["every_spec", "refusals"])


def part(results, name):
    for r in results:
        assert not (isinstance(r[name], dict) and "error" in r[name]), r[name]["error"]
    return [r[name] for r in results]


def replay(per_rank_logs, spec, residual, world):
    """The oracle on the recorded inputs, call by call; asserts each rank's output equals it."""
    calls = list(zip(*per_rank_logs))
    states = [{} for _ in range(world)]
    for call in calls:
        prefix, step, op = call[0]["prefix"], call[0]["step"], call[0]["op"]
        assert all((c["prefix"], c["step"], c["op"]) == (prefix, step, op) for c in call)
        scale = 1.0 / world if "AVG" in op else 1.0
        shape, members, _ = call[0]["layout"]
        outs, states, _ = reduce_scatter(spec, [c["input"] for c in call], states, names=shard_names(prefix, world),
                                         step=step, scale=scale, residual=residual, shape=shape, members=members)
        for j, c in enumerate(call):
            np.testing.assert_array_equal(c["output"], outs[j], err_msg=f"{spec} {residual} {prefix} step {step} "
                                                                        f"rank {j}")
    return len(calls)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_spec_equals_the_oracle(world_size, two, three):
    from scenarios.fsdp import CONFIGS, STEPS
    results = part({2: two, 3: three}[world_size], "every_spec")
    for spec, residual in CONFIGS:
        runs = [r[f"{spec}|{residual}"] for r in results]
        n = replay([run["log"] for run in runs], spec, residual, world_size)
        assert n == 2 * STEPS  # two sharded layers, one reduce-scatter each per step
        for step in range(STEPS):  # every rank's gathered parameters identical
            for name, value in runs[0]["full"][step].items():
                for run in runs[1:]:
                    np.testing.assert_array_equal(run["full"][step][name], value, err_msg=f"{spec} {name}")


@pytest.mark.multiprocess
def test_torch_ops_branch_equals_the_oracle(two):
    """The compressors' torch-ops branch (the one CUDA tensors take) through the reduce-scatter."""
    from scenarios.fsdp import TORCH_ONLY
    results = part(two, "torch_only")
    for spec, residual in TORCH_ONLY:
        runs = [r[f"{spec}|{residual}"] for r in results]
        assert replay([run["log"] for run in runs], spec, residual, 2) == 6


@pytest.mark.multiprocess
def test_nonfinite_is_never_hidden(two):
    runs = part(two, "nonfinite")
    replay([run["log"] for run in runs], "topk:ratio=0.2", "full", 2)
    for run in runs:
        assert run["finite"] == [(False, True)]  # NaN gradient shards on every rank, finite state
        assert all(np.isfinite(v).all() for v in run["full"][-1].values())  # the steps after train on


@pytest.mark.multiprocess
def test_lower_precision_reduce_dtype(two):
    """fp16 (pre-divided, SUM) and bf16 (AVG) reduce dtypes: replicas identical and finite."""
    runs = part(two, "mixed_precision")
    for dtype, op in (("torch.float16", "SUM"), ("torch.bfloat16", "AVG")):
        assert op in runs[0][dtype]["ops"][0]
        for step, full in enumerate(runs[0][dtype]["full"]):
            for name, value in full.items():
                assert np.isfinite(value).all()
                np.testing.assert_array_equal(runs[1][dtype]["full"][step][name], value)


@pytest.mark.multiprocess
def test_example_runs(two):
    """examples/fsdp_charlm.py: 3 steps; 4-bit codes send under a quarter of plain FSDP2's bytes."""
    got = part(two, "example")[0]
    assert np.isfinite(got["held_out_loss"])
    assert 0 < got["bytes_per_step"] < got["plain_bytes_per_step"] / 4


@pytest.mark.multiprocess
def test_checkpoint_resumes_exactly(two):
    from scenarios.fsdp import TOTAL
    for got in part(two, "checkpoint"):
        assert "saved with residual='int8', this reduce-scatter keeps residual='full'" in got.pop("mode_mismatch")
        for key, run in got.items():
            assert run["step"] == TOTAL, key
            for name, value in run["whole"].items():
                np.testing.assert_array_equal(run["resumed"][name], value, err_msg=f"{key} {name}")
    keys = part(two, "checkpoint")[0]["qsgd:levels=3,bucket=16|int8"]["keys"]
    assert keys == sorted(n for p in ("0", "2") for n in shard_names(p, 2))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_refused_on_every_rank_before_any_collective(world_size, two, three):
    for got in part({2: two, 3: three}[world_size], "refusals"):
        assert got["after"] == float(world_size)  # no rank was left in a collective
        assert "'powersgd' cannot be a reduce-scatter" in got["powersgd:rank=2|None"]
        assert "'sketch' cannot be a reduce-scatter" in got["sketch|None"]
        assert "share_scale=false" in got["terngrad:share_scale=true|None"]
        assert "momentum_correction=true" in got["dgc:momentum_correction=false|None"]
        assert "residual must be one of" in got["qsgd|bogus"]
        assert "keeps no residual" in got["signsgd|int8"]
        assert "keeps its accumulator" in got["dgc|none"]
        assert "levels" in got["qsgd:levels=999|None"]
        assert "no module of the model is sharded" in got["unsharded"]
        assert "only a 1-D device mesh" in got["hsdp"]
        assert "only parameters sharded on dim 0" in got["dim1"] and "'0.weight'" in got["dim1"]


# -- single process: the oracle's own rules -------------------------------------------------------
def test_oracle_none_is_a_plain_reduce_scatter():
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(12).astype(np.float32) for _ in range(3)]
    outs, _, sent = reduce_scatter("none", inputs, names=shard_names("m", 3))
    for j in range(3):
        want = inputs[0][4 * j:4 * j + 4] + inputs[1][4 * j:4 * j + 4] + inputs[2][4 * j:4 * j + 4]
        np.testing.assert_array_equal(outs[j], want)
    assert sent == [2 * 4 * 4] * 3  # two chunks of 4 float32 leave each rank


def test_oracle_nonfinite_rule():
    inputs = [np.ones(4, np.float32), np.array([1, np.nan, 1, 1], np.float32)]
    outs, states, _ = reduce_scatter("topk:ratio=0.5", inputs, names=shard_names("m", 2))
    assert all(np.isnan(o).all() for o in outs)
    assert all(np.isfinite(t).all() for st in states for per in st.values() for t in per.values())


def test_refusal_names_the_spec():
    assert refusal("qsgd") is None and refusal("topk") is None and refusal("dgc") is None
    assert "'powersgd'" in refusal("powersgd")
    import toy_algorithm.reference_toy  # noqa: F401  (declares "toysign": two rounds, named by no rule)
    assert "'toysign' cannot be a reduce-scatter: it exchanges in 2 rounds" in refusal("toysign")
    with pytest.raises(ValueError, match="'powersgd' cannot be a reduce-scatter"):
        reduce_scatter("powersgd", [np.ones(4, np.float32)] * 2, names=shard_names("m", 2))


def test_int8_codes_bound_the_error():
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    codes, scales = int8_encode(x)
    assert codes.dtype == np.int8 and scales.size == 4
    assert np.abs(int8_decode(codes, scales) - x).max() <= scales.max() / 2 + 1e-7


def test_int8_matches_torch():
    torch = pytest.importorskip("torch")
    from torch_ops.fsdp import int8_decode as t_decode, int8_encode as t_encode
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32) * 1e-3
    x[300:600] = 0
    codes, scales = int8_encode(x)
    tc, ts = t_encode(torch.from_numpy(x))
    np.testing.assert_array_equal(tc.numpy(), codes)
    np.testing.assert_array_equal(ts.numpy(), scales)
    np.testing.assert_array_equal(t_decode(tc, ts).numpy(), int8_decode(codes, scales))


def test_state_table_in_docs():
    """docs/fsdp.md's table of compression state per parameter is the oracle's (``state_table``)."""
    from hvdcompress.reference.fsdp import state_table
    with open(os.path.join(ROOT, "docs", "fsdp.md")) as f:
        doc = f.read()
    assert state_table() in doc, state_table()


def test_chunk_layout_follows_fsdp_padding():
    from hvdcompress.reference.fsdp import chunk_layout
    shape, members, numel = chunk_layout([("w", (11, 7)), ("b", (11,))], 3)  # 11 rows -> 4 per rank
    assert [(m.name, m.shape, m.offset) for m in members] == [("w", (4, 7), 0), ("b", (4,), 28)]
    assert (shape, numel) == ((1, 32), 32)
    assert chunk_layout([("b", (5,)), ("c", (3,))], 2)[0] == (5,)  # all 1-D: one 1-D chunk
    assert chunk_layout([("w", (4, 3))], 2)[0] == (2, 3)  # one member: its piece's shape
