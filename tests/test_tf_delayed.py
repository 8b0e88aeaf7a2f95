"""Delayed gradient averaging and temporal sparsity on the TF backend (tf_ops.delayed).

Multi-process part: one launch of 2 Gloo workers runs every scenario of
tests/scenarios/tf_delayed.py (a module fixture). Single-process part: the arithmetic against
a numpy model with a fake two-rank transport, eagerly and in tf.function, checkpoint checks, and
every bad argument raising before Horovod is needed.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdcompress.tensorflow as hvc  # noqa: E402
from scenarios import tf_delayed as sc  # noqa: E402
from scenarios import shared_tf_launch  # noqa: E402
from scenarios.launch import part  # noqa: E402

WORLD = 2


def reference(world, delay, every, op, m=0.0):
    """Plain SGD on fixed gradients through delayed averaging, in numpy. With ``m`` > 0 the
    compressor keeps a momentum (DGC at density 1: it sends its velocity u = m*u + input) and
    the local terms are the local velocity (tf_ops.delayed)."""
    f = 1 if op == "avg" else world
    reduce = (lambda xs: np.mean(xs, axis=0)) if op == "avg" else (lambda xs: np.sum(xs, axis=0))
    lr = np.float32(sc.LR)
    zeros = [np.zeros(6) for _ in range(world)]
    w, acc, app, vel, mem = list(zeros), list(zeros), list(zeros), list(zeros), list(zeros)
    due = {}

    def exchange(inputs):
        if not m:
            return reduce(inputs)
        for j in range(world):
            mem[j] = m * mem[j] + inputs[j]
        return reduce(mem)

    for t in range(sc.IDENTITY_STEPS):
        g = [sc.fixed(j, t).astype(np.float64) for j in range(world)]
        vel = [m * vel[j] + g[j] for j in range(world)]
        part = vel if m else g
        local = [g[j] + acc[j] for j in range(world)]
        applied = [part[j] + app[j] for j in range(world)]
        if (t + 1) % every == 0:
            r = exchange(local)
            due[t + delay] = [r - f * applied[j] for j in range(world)]
            acc, app = list(zeros), list(zeros)
        else:
            acc, app = local, applied
        corr = due.pop(t, [0.0] * world)
        w = [w[j] - lr * (f * part[j] + corr[j]) for j in range(world)]
    pending = [sum(c[j] for c in due.values()) for j in range(world)]
    if any(np.any(a) for a in acc):
        r = exchange(acc)
        pending = [pending[j] + r - f * app[j] for j in range(world)]
    flushed = np.mean([w[j] - lr * pending[j] for j in range(world)], axis=0)
    return w, flushed


@pytest.fixture(scope="module")
def results():
    out = shared_tf_launch.results("test_tf_delayed")  # sc.everything() on 2 workers (tests/scenarios/shared_tf_launch.py)
    assert len(out) == WORLD
    print("scenario seconds per rank:", [r["seconds"] for r in out])
    return out


@pytest.mark.multiprocess
def test_unrolled_identity_for_plain_sgd(results):
    parts = part(results, "identity")
    for delay, every, op in sc.IDENTITY:
        key = f"{delay}|{every}|{op}"
        want, flushed = reference(WORLD, delay, every, op)
        for j, r in enumerate(parts):
            np.testing.assert_allclose(r[key], want[j], rtol=0, atol=3e-6, err_msg=key)
            np.testing.assert_allclose(r[key + "|flushed"], flushed, rtol=0, atol=3e-6, err_msg=key)
        assert all(r[key + "|flushed"] == parts[0][key + "|flushed"] for r in parts), key
    assert parts[0]["1|1|avg"] != parts[1]["1|1|avg"]  # replicas differ before the flush



@pytest.mark.multiprocess
def test_unrolled_identity_with_the_momentum_in_the_compressor(results):
    parts = part(results, "momentum")
    for delay, every, op in sc.IDENTITY_MOMENTUM:
        key = f"{delay}|{every}|{op}"
        want, flushed = reference(WORLD, delay, every, op, m=sc.MOMENTUM)
        for j, r in enumerate(parts):
            np.testing.assert_allclose(r[key], want[j], rtol=0, atol=2e-5, err_msg=key)
            np.testing.assert_allclose(r[key + "|flushed"], flushed, rtol=0, atol=2e-5, err_msg=key)
        assert all(r[key + "|flushed"] == parts[0][key + "|flushed"] for r in parts), key
    assert parts[0]["3|1|avg"] != parts[1]["3|1|avg"]


@pytest.mark.multiprocess
def test_nonfinite_values_with_corrections_pending_are_seen_and_never_kept(results):
    d = sc.NONFINITE_DELAY
    for rank, r in enumerate(part(results, "nonfinite")):
        assert len(r) == len(sc.NONFINITE_CASES), sorted(r)
        for key, v in r.items():
            assert v["seen"] == ([2, 2 + d] if rank == 1 else [2 + d]), (rank, key, v)
            assert v["state_finite"] and v["params_finite"] and v["identical"], (rank, key, v)


@pytest.mark.multiprocess
def test_zero_delay_is_bit_identical_to_the_synchronous_path(results):
    for r in part(results, "zero"):
        assert r and all(r.values()), r


@pytest.mark.multiprocess
def test_flush_leaves_identical_variables(results):
    for r in part(results, "flush"):
        assert len(r) == len(sc.FLUSH_CASES) + 1
        for key, (before, after, again) in r.items():
            assert after and again, key
        assert not all(v[0] for k, v in r.items() if k.startswith("tape"))  # replicas did differ


@pytest.mark.multiprocess
def test_resume_with_corrections_pending_continues_exactly(results):
    for r in part(results, "resume"):
        for label, (equal, equal_after_flush, pending, calls, identical) in r.items():
            assert equal and equal_after_flush and pending > 0 and calls == 9, (label, r[label])
            assert identical, label  # flush() (tape: compression.flush, Keras: opt.flush) on the resumed run


# -- single process -----------------------------------------------------------------------------
class TwoRankTransport:
    """A stand-in world of two ranks: the other rank contributes half of this one's tensor."""

    def run(self, requests, name):
        return tuple(r.tensor * 1.5 for r in requests)


class IdenticalTwoRanks:
    """A world of two identical ranks, for any compressor: sums double, gathers repeat."""

    def run(self, requests, name):
        from tf_ops.collectives import Allreduce
        return tuple(r.tensor + r.tensor if isinstance(r, Allreduce) else tf.concat([r.tensor, r.tensor], 0)
                     for r in requests)


def _grads(t):
    rng = np.random.default_rng(t)
    return [tf.constant(rng.standard_normal((3, 2)).astype(np.float32)), None,
            tf.constant(rng.standard_normal(4).astype(np.float32))]


@pytest.mark.parametrize("delay, every", [(1, 1), (2, 1), (0, 2), (2, 3)])
@pytest.mark.parametrize("graph", [False, True])
def test_gradients_follow_the_delayed_formula(delay, every, graph):
    comp = hvc.GradientCompression("none", transport=TwoRankTransport(), delay=delay, sync_every=every)
    fn = lambda gs: comp.exchange(gs, world_size=2, scale=0.5)  # noqa: E731
    fn = tf.function(fn) if graph else fn
    acc, due = {0: 0.0, 2: 0.0}, {}
    for t in range(7):
        got = fn(_grads(t))
        g = {i: _grads(t)[i].numpy() for i in (0, 2)}
        assert got[1] is None
        local = {i: g[i] + acc[i] for i in (0, 2)}
        if (t + 1) % every == 0:
            due[t + delay] = {i: 0.75 * local[i] - local[i] for i in (0, 2)}  # R = (1 + 0.5) / 2 * local
            acc = {0: 0.0, 2: 0.0}
        else:
            acc = local
        corr = due.pop(t, {0: 0.0, 2: 0.0})
        for i in (0, 2):
            np.testing.assert_allclose(got[i].numpy(), g[i] + corr[i], rtol=0, atol=1e-6)
    pending = comp.flush_corrections()
    for i in (0, 2):
        want = sum(c[i] for c in due.values()) + (0.75 * acc[i] - acc[i])
        np.testing.assert_allclose(pending[i].numpy().reshape(np.shape(_grads(0)[i])), want, rtol=0, atol=1e-6)
    assert pending[1] is None
    assert all(not np.any(v.numpy()) for v in comp.delayed.ring + comp.delayed.acc if v is not None)


@pytest.mark.parametrize("spec", ["none", "fp16", "randomk:ratio=0.2,seed=3", "qsgd", "powersgd"])
def test_zero_delay_gives_the_synchronous_results_bit_for_bit(spec):
    outs = []
    for kw in ({}, dict(delay=0, sync_every=1)):
        comp = hvc.GradientCompression(spec, transport=IdenticalTwoRanks(), **kw)
        outs.append([comp.exchange(_grads(t), world_size=2, scale=0.5) for t in range(3)])
    for a, b in zip(*outs):
        assert a[1] is None and b[1] is None
        for i in (0, 2):
            np.testing.assert_array_equal(a[i].numpy(), b[i].numpy())


def test_checkpoint_of_another_delay_is_refused(tmp_path):
    comp = hvc.GradientCompression("none", transport=TwoRankTransport(), delay=2)
    comp.exchange(_grads(0), world_size=2, scale=0.5)
    path = tf.train.Checkpoint(compression=comp).save(str(tmp_path / "ck"))
    other = hvc.GradientCompression("none", transport=TwoRankTransport(), delay=1)
    tf.train.Checkpoint(compression=other).restore(path)
    with pytest.raises(ValueError, match="saved with delay=2, sync_every=1; this object uses delay=1"):
        other.exchange(_grads(1), world_size=2, scale=0.5)


def test_synchronous_objects_hold_no_delayed_state():
    comp = hvc.GradientCompression("topk:ratio=0.1", delay=0, sync_every=1)
    assert comp.delayed is None and comp.delay == 0 and comp.sync_every == 1 and comp.flush_corrections() == []


def _tape():
    with tf.GradientTape() as tape:
        pass
    return tape


@pytest.mark.parametrize("make, needle", [
    (lambda: hvc.GradientCompression("none", delay=-1), "delay: must be an int >= 0"),
    (lambda: hvc.GradientCompression("none", delay=1.5), "delay: must be an int >= 0"),
    (lambda: hvc.GradientCompression("none", delay=True), "delay: must be an int >= 0"),
    (lambda: hvc.GradientCompression("none", sync_every=0), "sync_every: must be an int >= 1"),
    (lambda: hvc.GradientCompression("none", sync_every="2"), "sync_every: must be an int >= 1"),
    (lambda: hvc.DistributedGradientTape(_tape(), compression="none", delay=-2), "delay: must be an int >= 0"),
    (lambda: hvc.DistributedGradientTape(_tape(), compression="fp16", delay=2),
     "delay=2, sync_every=1), pass that object as compression= every step"),
    (lambda: hvc.DistributedGradientTape(_tape(), compression=hvc.GradientCompression("none", delay=1), delay=2),
     "delay: the GradientCompression given as compression= has delay=1"),
    (lambda: hvc.DistributedGradientTape(_tape(), compression=hvc.GradientCompression("none"), sync_every=2),
     "sync_every: the GradientCompression given as compression= has sync_every=1"),
    (lambda: hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), sync_every=0), "sync_every: must be an int >= 1"),
    (lambda: hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), delay="1"), "delay: must be an int >= 0"),
    (lambda: hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), delay=2), "horovod is not initialized"),
    (lambda: hvc.DelayedAveragingFlushCallback(at_epoch_end=1), "at_epoch_end: must be True or False"),
])
def test_bad_arguments_raise_before_horovod(make, needle):
    with pytest.raises(ValueError) as err:
        make()
    assert needle in str(err.value)
