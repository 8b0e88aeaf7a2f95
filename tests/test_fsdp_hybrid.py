"""The two-level layout of FSDP2 with compressed gradients (``hvdcompress.fsdp.compress(...,
topology="2x2")``: shard inside a node, our compressor across nodes) on 4 real gloo processes as 2
"nodes" x 2 (tests/scenarios/fsdp_hybrid.py: one spawn, Horovod's import blocked), and the
reduce-scatter called with ``async_op=True``.

Every reduction of every configuration equals the numpy oracle
(``hvdcompress.reference.fsdp.hybrid_reduce_scatter``, replayed on all four ranks' recorded inputs
with its own state) bit for bit, inside the node and across; all four ranks' gathered parameters are
identical after every step; a checkpoint resumes exactly; a NaN on one rank gives NaN on all four;
bad layouts are refused on every rank before any collective. Single-process tests cover the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

from hvdcompress.reference.fsdp import across_units, chunk_layout, hybrid_reduce_scatter, reduce_scatter, shard_names
from hvdcompress.topology import Topology

TOPO = Topology(4, 2)


@pytest.fixture(scope="module")
def four():
    from scenarios.fsdp_hybrid import launch
    return launch(["every_spec", "nonfinite", "checkpoint", "refusals", "async_op", "mixed_precision", "example"])


def part(results, name):
    for r in results:
        assert not (isinstance(r[name], dict) and "error" in r[name]), r[name]["error"]
    return [r[name] for r in results]


def replay(runs, spec, residual, inside):
    """The oracle on the recorded inputs, module by module and step by step; asserts each rank's
    shard after the hop inside and after the hop across equal it (PowerSGD's orthogonalization and
    products round differently in torch: within 1e-6, as in tests/test_paths.py). Returns the
    reductions replayed."""
    tol = 1e-6 if spec.startswith("powersgd") else 0.0
    calls = list(zip(*[run["ar"] for run in runs]))
    scatters = list(zip(*[run["rs"] for run in runs]))
    assert len(calls) == len(scatters)
    states, inside_states = [{} for _ in range(4)], [{} for _ in range(4)]
    for call, scatter in zip(calls, scatters):
        prefix, step = call[0]["prefix"], call[0]["step"]
        assert all((c["prefix"], c["step"]) == (prefix, step) for c in call)
        scale = 0.5 if "AVG" in scatter[0]["op"] else 1.0
        shape, members, _ = call[0]["layout"]
        outs, shards, states, inside_states, _ = hybrid_reduce_scatter(
            spec, [s["input"] for s in scatter], TOPO, states, inside_states, prefix=prefix, step=step,
            inside=inside, inside_scale=scale, residual=residual, shape=shape, members=members)
        for r in range(4):
            where = f"{spec} {residual} {inside} {prefix} step {step} rank {r}"
            np.testing.assert_array_equal(scatter[r]["output"], shards[r], err_msg="inside: " + where)
            np.testing.assert_array_equal(call[r]["input"], shards[r], err_msg="hook input: " + where)
            if tol:
                np.testing.assert_allclose(call[r]["output"], outs[r], rtol=tol, atol=tol, err_msg="across: " + where)
            else:
                np.testing.assert_array_equal(call[r]["output"], outs[r], err_msg="across: " + where)
    return len(calls)


def identical(runs, label):
    for step, full in enumerate(runs[0]["full"]):
        for name, value in full.items():
            for r, run in enumerate(runs[1:], 1):
                np.testing.assert_array_equal(run["full"][step][name], value, err_msg=f"{label} {name} rank {r}")


@pytest.mark.multiprocess
def test_every_config_equals_the_oracle(four):
    from scenarios.fsdp_hybrid import CONFIGS, STEPS
    results = part(four, "every_spec")
    for spec, residual, inside in CONFIGS:
        runs = [r[f"{spec}|{residual}|{inside}"] for r in results]
        assert replay(runs, spec, residual, inside) == 2 * STEPS  # two sharded layers per step
        identical(runs, spec)  # all four ranks: both nodes' replicas too
        assert all(run["bytes"] > 0 for run in runs)


@pytest.mark.multiprocess
def test_nonfinite_is_never_hidden(four):
    runs = part(four, "nonfinite")
    replay(runs, "topk:ratio=0.2", "full", None)
    for run in runs:  # rank 1's NaN: every rank's gradient shard NaN (the other node's too), state finite
        assert run["finite"] == [(False, True)]
        assert all(np.isfinite(v).all() for v in run["full"][-1].values())


@pytest.mark.multiprocess
def test_checkpoint_resumes_exactly(four):
    from scenarios.fsdp_hybrid import TOTAL
    got = part(four, "checkpoint")
    for r, run in enumerate(got):
        assert run["step"] == TOTAL
        for name, value in run["whole"].items():
            np.testing.assert_array_equal(run["resumed"][name], value, err_msg=f"rank {r} {name}")
        assert "saved with topology='2x2', this front end has topology=None" in run["flat"]
        assert "hop inside the node is compressed, this front end's is dense" in run["dense_inside"]
        position = r % 2  # across: this rank's shard only; inside: every chunk it sends
        assert run["keys"] == sorted(f"{p}#shard{position}" for p in ("0", "2"))
        assert run["inside_keys"] == sorted(n for p in ("0", "2") for n in shard_names(p, 2))


@pytest.mark.multiprocess
def test_bad_layouts_refused_on_every_rank_before_any_collective(four):
    for got in part(four, "refusals"):
        assert got["after"] == 4.0  # no rank was left in a collective
        assert "3 nodes x 1 ranks is 3 ranks, but the world has 4" in got["nodes"]
        assert "topology=1x4 is one node: nothing crosses nodes" in got["one_node"]
        assert "topology=2x2 shards inside each node" in got["world_mesh"] and "(0, 1, 2, 3)" in got["world_mesh"]
        assert "topology=2x2 shards inside each node" in got["replicate_mesh"]
        assert "inside: compression 'powersgd' cannot be a reduce-scatter" in got["inside_powersgd"]
        assert "it needs topology=" in got["inside_flat"]
        assert "applies the optimizer's update itself" in got["onebitadam"]
        assert "levels" in got["bad_spec"]
        assert "only a 1-D device mesh" in got["native_hsdp"] and "topology=" in got["native_hsdp"]


@pytest.mark.multiprocess
def test_async_op_returns_a_work_that_completes_the_exchange(four):
    results = part(four, "async_op")
    for spec in ("qsgd:levels=7,bucket=16", "topk:ratio=0.2"):
        runs = [r[spec] for r in results]
        states = [{} for _ in range(4)]
        for i, prefix in enumerate(("0", "2")):
            calls = [run["calls"][i] for run in runs]
            shape, members, _ = calls[0]["layout"]
            outs, states, _ = reduce_scatter(spec, [c["input"] for c in calls], states, names=shard_names(prefix, 4),
                                             step=0, scale=0.25, shape=shape, members=members)
            for r in range(4):
                np.testing.assert_array_equal(calls[r]["output"], outs[r], err_msg=f"{spec} {prefix} rank {r}")
        for run in runs:
            assert run["pending"] == [False, False] and run["done"] == [True, True]
            assert run["step"] == 1  # both modules reduced: one step


@pytest.mark.multiprocess
def test_lower_precision_reduce_dtype(four):
    """fp16 (pre-divided, SUM inside) and bf16 (AVG) reduce dtypes: all four replicas identical, finite."""
    runs = part(four, "mixed_precision")
    for key, fulls in runs[0].items():
        for step, full in enumerate(fulls):
            for name, value in full.items():
                assert np.isfinite(value).all(), key
                for run in runs[1:]:
                    np.testing.assert_array_equal(run[key][step][name], value, err_msg=f"{key} {name}")


@pytest.mark.multiprocess
def test_example_runs(four):
    """examples/fsdp_charlm.py --topology 2x2 --inside fp16: 4-bit codes across nodes send under a
    quarter of native HSDP's all-reduce."""
    got = part(four, "example")[0]
    assert np.isfinite(got["held_out_loss"])
    assert 0 < got["bytes_per_step"] < got["plain_bytes_per_step"] / 4


# -- single process: the oracle's own rules -------------------------------------------------------
def test_oracle_dense_both_hops_is_the_average():
    rng = np.random.default_rng(4)
    shape, members, numel = chunk_layout([("w", (5, 3)), ("b", (5,))], 2)
    inputs = [rng.standard_normal(2 * numel).astype(np.float32) for _ in range(4)]
    outs, shards, _, _, sent = hybrid_reduce_scatter("none", inputs, TOPO, prefix="m", shape=shape, members=members)
    mean = (inputs[0] + inputs[1] + inputs[2] + inputs[3]) / 4
    for r in range(4):
        np.testing.assert_allclose(outs[r], mean[(r % 2) * numel:(r % 2 + 1) * numel], rtol=1e-6)
        node = inputs[r - r % 2] + inputs[r - r % 2 + 1]
        np.testing.assert_array_equal(shards[r], node[(r % 2) * numel:(r % 2 + 1) * numel] * np.float32(0.5))
    assert sent == [numel * 4] * 4  # one shard of float32 across, per rank


def test_oracle_nan_on_one_rank_reaches_every_rank():
    inputs = [np.ones(8, np.float32) for _ in range(4)]
    inputs[3][0] = np.nan  # node 1; with dense inside, only rank 2's chunk holds it after the sum
    outs, _, states, _, _ = hybrid_reduce_scatter("topk:ratio=0.5", inputs, TOPO, prefix="m", residual="full")
    assert all(np.isnan(o).all() for o in outs)
    assert all(np.isfinite(t).all() for st in states for per in st.values() for t in per.values())


def test_across_units_split_a_shard_for_a_layerwise_compressor():
    shape, members, numel = chunk_layout([("w", (5, 3)), ("b", (5,))], 2)
    assert across_units("m", 1, shape, members, False) == [("m#shard1", 0, numel, shape, members)]
    units = across_units("m", 1, shape, members, True)
    assert [(u[0], u[1], u[2], u[3]) for u in units] == [("w#shard1", 0, 9, (3, 3)), ("b#shard1", 9, 12, (3,))]
