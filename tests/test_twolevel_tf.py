"""Two-level exchanges on TensorFlow (``tf_ops.twolevel``): the tape with a ``GradientCompression``
and the Keras ``DistributedOptimizer`` on 4 Horovod/Gloo workers as 2 nodes x 2 ranks, through
Horovod process sets (tests/scenarios/twolevel_tf.py, one launch): every exchange equal to the
numpy oracle's replay (``simulate_two_level``), its bytes per hop as the oracle counts them,
replicas identical after every step, a checkpoint resumed exactly, the launcher's default, the
flat opt-out and the refusals before any collective; and the pure parts on one process.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hvdcompress import parse_spec
from hvdcompress.reference.twolevel import simulate_two_level
from hvdcompress.topology import Topology


# -- one process ----------------------------------------------------------------------------------

def test_state_that_the_flat_layout_cannot_hold_goes_flat():
    """``fits``: a part's state is a slice of a whole-sized slot or a slot of its own size; a
    compressor wanting anything else for some part sends the group flat (decided from all parts)."""
    import tensorflow as tf

    from hvdcompress.schedule.groups import split_layout
    from tf_ops.compressors import build_compressor
    from tf_ops.twolevel import fits
    powersgd = build_compressor(parse_spec("powersgd:rank=2"))
    parts = split_layout(12 * 24, (12, 24), (), 2)
    state = powersgd.new_state((12, 24), tf.float32)
    assert sorted(state) == ["q", "residual"] and fits(powersgd, state, parts, 12 * 24, None) is None
    del state["q"]
    assert "'q'" in fits(powersgd, state, parts, 12 * 24, None)
    assert fits(powersgd, state, parts, 12 * 24, "fp16") is None  # a codec sends the residual only


def test_tf_topology_argument_checked_before_any_collective():
    import hvdcompress.tensorflow as hvc
    from tf_ops.twolevel import check_topology
    with pytest.raises(ValueError, match="topology=4.5: accepted"):
        hvc.GradientCompression("none", topology=4.5)
    assert check_topology(None).flat and check_topology("flat").flat  # Horovod not initialized: flat


# -- 4 Horovod workers as 2 nodes x 2 -------------------------------------------------------------

from scenarios import twolevel_tf as sc  # noqa: E402

NAMES = ["every_spec", "keras", "opt_out"]


@pytest.fixture(scope="module")
def tf_two_by_two():
    return sc.launch(NAMES)


def part(results, name):
    for r in results:
        assert not (isinstance(r[name], dict) and "error" in r[name]), r[name]["error"]
    return [r[name] for r in results]


def _same(got, want, spec) -> bool:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if spec.name != "powersgd":
        return np.array_equal(got, want, equal_nan=True)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    return np.allclose(got, want, rtol=1e-4, atol=1e-4 * scale)  # TF's and numpy's matmuls, Gram-Schmidt


def _replay(results, topo):
    """Every logged exchange replayed through the oracle: the tags seen, the mismatches (a rank's
    result or state off the oracle or off rank 0's), and the oracle's bytes per hop per (tag, rank)."""
    logs = [{(e["tag"], e["key"], e["step"]): e for e in r["log"]} for r in results]
    assert logs[0] and all(set(log) == set(logs[0]) for log in logs)
    seen, bad, hops = set(), [], {}
    for where in sorted(logs[0], key=repr):
        entries = [log[where] for log in logs]
        e0 = entries[0]
        spec = parse_spec(e0["spec"])
        states = [copy.deepcopy(e["before"]) for e in entries]
        want, after, sent = simulate_two_level(spec, [e["x"] for e in entries], topo, states, key=e0["key"],
                                               step=e0["step"], scale=e0["scale"], shape=e0["shape"],
                                               epoch=e0["epoch"], members=e0["members"])
        for r, e in enumerate(entries):
            if not (np.array_equal(e["result"], e0["result"], equal_nan=True) and _same(e["result"], want, spec)):
                bad.append(where + (r,))
            if sorted(e["after"]) != sorted(after[r]) or not all(_same(e["after"][k], v, spec)
                                                                 for k, v in after[r].items()):
                bad.append(where + (r, "state"))
            for level in ("local", "cross"):
                key = tuple(e0["tag"]) + (r, level)
                hops[key] = hops.get(key, 0) + sent[level][r]
        seen.add(e0["tag"])
    return seen, bad, hops


@pytest.mark.multiprocess
def test_tf_every_exchange_and_its_bytes_per_hop_equal_the_two_level_oracle(tf_two_by_two):
    seen, bad, hops = _replay(tf_two_by_two, Topology(4, 2))
    assert not bad, bad[:5]  # (tag, key, step, rank[, "state"]): result or state off the oracle or rank 0
    assert seen == ({("tape", s) for s in sc.SPECS} | {("tape-resumed", s) for s in sc.RESUMED}
                    | {("keras", sc.KERAS_SPEC)})
    for rank, r in enumerate(tf_two_by_two):
        runs = dict(r["every_spec"], keras=r["keras"])
        for name, run in runs.items():
            tag = ("keras", sc.KERAS_SPEC) if name == "keras" else ("tape", name)
            assert run["hops"] == {level: hops[tag + (rank, level)] for level in ("local", "cross")}, (tag, rank)


@pytest.mark.multiprocess
def test_tf_replicas_identical_resumed_exactly_on_process_sets(tf_two_by_two):
    topo = Topology(4, 2)
    for rank, got in enumerate(part(tf_two_by_two, "every_spec")):
        assert set(got) == set(sc.SPECS)
        for spec, run in got.items():
            assert all(run["identical"]) and run["moved"] > 0, spec
            if spec in sc.RESUMED:
                assert all(run["resumed_identical"]) and run["resumed_equal"], spec
            assert run["transports"] == ["TwoLevelTransport", "Communicator", "Communicator"], spec
            assert run["sets"] == [list(topo.local_group(rank)), list(topo.cross_group(rank))]
            assert run["bytes"] == run["hops"]["local"] + run["hops"]["cross"], spec
            if spec != "none":
                assert run["hops"]["cross"] * 4 < run["hops"]["local"], spec  # compressed across, dense inside


@pytest.mark.multiprocess
def test_keras_optimizer_two_level(tf_two_by_two):
    for got in part(tf_two_by_two, "keras"):
        assert all(got["identical"]) and got["moved"] > 0
        assert got["transports"][0] == "TwoLevelTransport"
        assert got["bytes"] == got["hops"]["local"] + got["hops"]["cross"]


@pytest.mark.multiprocess
def test_tf_launcher_default_flat_opt_out_and_refusals(tf_two_by_two):
    for got in part(tf_two_by_two, "opt_out"):
        assert got["None"] == "TwoLevelTransport" and got["flat"] == "Communicator"
        assert got["carried"].startswith("topology='flat': the GradientCompression given as compression="), got
        assert got["subset"].startswith("topology='2x2'") and "'flat'" in got["subset"], got["subset"]
        assert got["after"] == 4.0  # the next collective still lines up
