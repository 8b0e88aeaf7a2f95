"""TensorFlow / Keras DiLoCo (``tf_ops.diloco``) against the numpy reference: in one process with
a one-rank transport, and with ``model.fit`` on two Horovod workers (the shared TF launch,
tests/scenarios/tf_diloco.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hvdcompress.reference.diloco import DiLoCoReference

from scenarios.tf_diloco import CONFIGS as KERAS_CONFIGS


class OneRankTransport:
    """A TF ``Communicator`` stand-in for a world of one."""

    process_set = None

    def run(self, requests, name):
        return tuple(r.tensor for r in requests)


def _replay(kw, init, locals_per_rank, after_per_rank, names=None):
    world = len(locals_per_rank)
    ref = DiLoCoReference(init, world=world, names=names, **kw)
    for t in range(len(locals_per_rank[0])):
        out = ref.step([locals_per_rank[r][t] for r in range(world)])
        for r in range(world):
            for i, (got, want) in enumerate(zip(after_per_rank[r][t], out[r])):
                np.testing.assert_array_equal(got, want, err_msg=f"t={t + 1} rank {r} v{i}")
    return ref


@pytest.mark.parametrize("name", sorted(KERAS_CONFIGS))
def test_tf_one_rank_matches_the_reference_and_checkpoints(name, tmp_path):
    import tensorflow as tf
    from tf_ops.diloco import DiLoCo

    kw = KERAS_CONFIGS[name]
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal(s).astype(np.float32)) for s in [(4, 3), (3,), (3, 2), (2,)]]
    init = [v.numpy().copy() for v in variables]
    d = DiLoCo(variables, transport=OneRankTransport(), **kw)
    d.start()
    seen, after = [], []
    for t in range(9):
        for v in variables:
            v.assign_add(rng.standard_normal(v.shape).astype(np.float32) * 0.1)
        seen.append([v.numpy().copy() for v in variables])
        d.step()
        after.append([v.numpy().copy() for v in variables])
        if t == 4:
            ckpt = tf.train.Checkpoint(diloco=d, vars=variables).write(str(tmp_path / "ckpt"))
            at5 = [v.numpy().copy() for v in variables]
    ref = _replay(kw, init, [seen], [after])
    assert int(d.bytes_sent.numpy()) == ref.bytes_sent[0]
    # stats, on the session as the other front ends': one record per fragment exchange (TF runs it at
    # its launch), its payload next to the fragment's dense bytes
    launched = [d.cfg.launched_at(t) for t in range(1, 10) if d.cfg.launched_at(t) is not None]
    s = d.stats
    assert s.steps == len(launched) > 0 and s.total_bytes == ref.bytes_sent[0]
    assert s.total_dense_bytes == sum(int(variables[i].shape.num_elements()) * 4
                                      for p in launched for i in d.fragments[p])
    # resume from step 5 (for the streaming config a fragment is in flight there) and replay the same inner updates
    variables2 = [tf.Variable(np.zeros_like(a)) for a in init]
    d2 = DiLoCo(variables2, transport=OneRankTransport(), **kw)
    tf.train.Checkpoint(diloco=d2, vars=variables2).read(ckpt).assert_consumed()
    for v, a in zip(variables2, at5):
        assert np.array_equal(v.numpy(), a)
    for t in range(5, 9):
        for v, s in zip(variables2, seen[t]):
            v.assign(s)
        d2.step()
        for v, a in zip(variables2, after[t]):
            assert np.array_equal(v.numpy(), a)


@pytest.fixture(scope="module")
def keras_runs():
    from scenarios import shared_tf_launch
    return shared_tf_launch.results("test_tf_diloco")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(KERAS_CONFIGS))
def test_keras_diloco_matches_the_reference_on_two_workers(keras_runs, name):
    runs = [r[name] for r in keras_runs]
    for r in range(2):
        for a, b in zip(runs[r]["init"], runs[0]["init"]):
            assert np.array_equal(a, b)
    assert len(runs[0]["locals"]) == len(runs[0]["after"]) == 9
    kw = KERAS_CONFIGS[name]
    ref = _replay(kw, runs[0]["init"], [runs[r]["locals"] for r in range(2)], [runs[r]["after"] for r in range(2)],
                  names=runs[0]["names"])
    flushed = ref.flush([runs[r]["after"][-1] for r in range(2)])
    for r in range(2):
        assert runs[r]["bytes"] == ref.bytes_sent[r]
        for i, got in enumerate(runs[r]["flushed"]):
            np.testing.assert_array_equal(got, flushed[r][i])
            np.testing.assert_array_equal(got, runs[0]["flushed"][i])  # identical replicas after flush
            np.testing.assert_array_equal(runs[r]["global"][i], ref.theta[i])


def test_tf_one_rank_seeded_quantizer_matches_the_reference():
    """A seeded quantizer draws from a stream keyed by (seed, step, name, rank): the context
    carries this rank's index, so the pseudo-gradient rounds as the reference's does."""
    import tensorflow as tf
    from tf_ops.diloco import DiLoCo

    kw = dict(sync_every=2, compression="qsgd:levels=3,bucket=8")
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal(s).astype(np.float32)) for s in [(4, 3), (3,)]]
    init = [v.numpy().copy() for v in variables]
    d = DiLoCo(variables, transport=OneRankTransport(), **kw)
    d.start()
    seen, after = [], []
    for _ in range(6):
        for v in variables:
            v.assign_add(rng.standard_normal(v.shape).astype(np.float32) * 0.1)
        seen.append([v.numpy().copy() for v in variables])
        d.step()
        after.append([v.numpy().copy() for v in variables])
    ref = _replay(kw, init, [seen], [after], names=d.names)
    assert int(d.bytes_sent.numpy()) == ref.bytes_sent[0]
