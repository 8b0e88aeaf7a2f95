"""Single-process tests of the TF backend's state, callbacks and argument checks.

``GradientCompression`` runs here with a one-rank transport (no Horovod): checkpoint/resume,
spec and shape checks, byte counts, density and epoch. The wrappers' argument checks run
without ``hvd.init()``: every bad argument must raise before Horovod is even needed.
"""

import numpy as np
import pytest
import tensorflow as tf

import horovod.tensorflow as hvd
import hvdcompress.tensorflow as hvc
from tf_ops.callbacks import CompressionStatsCallback, SparsityWarmupCallback


class OneRankTransport:
    """A world of one: allreduce and allgather return the tensor itself."""

    def run(self, requests, name):
        return tuple(r.tensor for r in requests)


SHAPES = [(40, 30), (30,), (30, 10)]


def _grads(step, seed=0):
    rng = np.random.default_rng(1000 * seed + step)
    return [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in SHAPES]


def _compression(spec):
    return hvc.GradientCompression(spec, transport=OneRankTransport())


def _run(comp, steps, graph):
    fn = tf.function(lambda gs: comp.exchange(gs, world_size=1, scale=1.0)) if graph else \
        (lambda gs: comp.exchange(gs, world_size=1, scale=1.0))
    return [np.concatenate([r.numpy().ravel() for r in fn(_grads(s))]) for s in steps]


@pytest.mark.parametrize("spec, kw", [("topk:ratio=0.05", {}), ("dgc:ratio=0.05,min_sparse_numel=64", {"schedule": "single"}),
                                      ("none", {"delay": 1, "sync_every": 2})])
def test_an_exchange_in_a_tf_function_is_traced_once(spec, kw):
    # the state made in the first trace (slots, a merged group's working state, the clock, delayed
    # averaging's corrections) is created eagerly and must not make TensorFlow trace again
    comp = hvc.GradientCompression(spec, transport=OneRankTransport(), **kw)
    fn = tf.function(lambda gs: comp.exchange(gs, world_size=1, scale=1.0))
    for step in range(3):
        fn(_grads(step))
    assert fn.experimental_get_tracing_count() == 1
    assert int(comp.step.numpy()) > 0  # the traced exchange ran (sync_every=2: every second step)


@pytest.mark.parametrize("spec, graph", [("topk:ratio=0.05", False), ("randomk:ratio=0.1,seed=4", True),
                                         ("dgc:ratio=0.02,warmup_epochs=2,min_sparse_numel=256", True)])
def test_checkpoint_restores_state_and_the_run_continues_identically(tmp_path, spec, graph):
    comp = _compression(spec)
    comp.set_epoch(1)
    _run(comp, range(3), graph)
    path = tf.train.Checkpoint(compression=comp).save(str(tmp_path / "ckpt"))
    straight = _run(comp, range(3, 6), graph)

    fresh = _compression(spec)  # restored before its state variables exist: applied when they are made
    status = tf.train.Checkpoint(compression=fresh).restore(path)
    resumed = _run(fresh, range(3, 6), graph)
    status.assert_consumed()
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)
    assert int(fresh.step.numpy()) == 6 and int(fresh.epoch.numpy()) == 1
    names = {name for slot in fresh.slots for name in slot}
    assert names == ({"u", "v"} if spec.startswith("dgc") else {"residual"})


def test_a_checkpoint_of_another_spec_is_refused_before_any_collective(tmp_path):
    comp = _compression("topk:ratio=0.05")
    _run(comp, [0], False)
    path = tf.train.Checkpoint(compression=comp).save(str(tmp_path / "ckpt"))
    other = _compression("threshold:threshold=0.5")
    tf.train.Checkpoint(compression=other).restore(path)
    with pytest.raises(tf.errors.InvalidArgumentError, match="saved with another compression spec"):
        _run(other, [1], False)


def test_state_of_another_variable_list_is_refused():
    comp = _compression("topk:ratio=0.05")
    _run(comp, [0], False)
    with pytest.raises(ValueError, match="one GradientCompression serves one list of variables"):
        comp.exchange([tf.zeros([7, 7])], world_size=1, scale=1.0)


def test_bytes_are_counted_from_the_payloads():
    comp = _compression("topk:ratio=0.05")
    _run(comp, range(2), False)
    st = comp.stats
    k = [int(np.ceil(0.05 * np.prod(s))) for s in SHAPES]
    assert st.steps == 2 and st.last_bytes == 8 * sum(k)
    assert st.last_dense_bytes == 4 * sum(int(np.prod(s)) for s in SHAPES)
    assert st.total_bytes == 2 * st.last_bytes
    comp.reset_stats()
    assert comp.stats.steps == 0


def test_none_gradients_stay_none_and_are_not_counted():
    comp = _compression("topk:ratio=0.5")
    out = comp.exchange([None, tf.ones([4])], world_size=1, scale=1.0)
    assert out[0] is None and out[1].shape == (4,)
    assert comp.stats.last_dense_bytes == 16


def test_density_and_epoch():
    comp = _compression("topk:ratio=0.05")
    assert comp.density == 0.05
    comp.density = 0.5
    comp.set_epoch(3)  # top-k has no warm-up of its own: the density stays
    assert comp.density == 0.5
    for bad in (0.0, 1.5, "x", True):
        with pytest.raises(ValueError, match="density: must be a float in"):
            comp.density = bad
    with pytest.raises(ValueError, match="has no density"):
        _compression("fp16").density = 0.5
    with pytest.raises(ValueError, match="set_epoch: epoch must be an int >= 0"):
        comp.set_epoch(-1)
    dgc = _compression("dgc:ratio=0.001,warmup_epochs=4")
    assert [round(d, 4) for d in _densities(dgc, range(6))] == [0.2512, 0.0631, 0.0158, 0.004, 0.001, 0.001]


def _densities(comp, epochs):
    out = []
    for e in epochs:
        comp.set_epoch(e)
        out.append(comp.density)
    return out


def test_indexed_slices_are_refused_by_the_state_object():
    comp = _compression("topk:ratio=0.5")
    sparse = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 2]), tf.constant([4, 3]))
    with pytest.raises(ValueError, match="tf.IndexedSlices"):
        comp.exchange([sparse], world_size=1, scale=1.0)


def test_warmup_callback_sets_the_density_per_epoch():
    comp = _compression("topk:ratio=0.01")
    cb = SparsityWarmupCallback(warmup_schedule=(0.3, 0.1), compression=comp)
    cb.on_train_begin()
    got = []
    for e in range(4):
        cb.on_epoch_begin(e)
        got.append(comp.density)
    assert got == [0.3, 0.1, 0.01, 0.01]
    own = _compression("dgc:ratio=0.01,warmup_epochs=1")
    cb = SparsityWarmupCallback(compression=own)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    assert own.density == pytest.approx(0.1)
    with pytest.raises(ValueError, match="has no warm-up of its own"):
        SparsityWarmupCallback(compression=comp).on_train_begin()
    with pytest.raises(ValueError, match="must be above the target ratio"):
        SparsityWarmupCallback(warmup_schedule=(0.3, 0.005), compression=comp).on_train_begin()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(warmup_schedule=(0.3, 0.4)), "warmup_schedule must decrease strictly"),
    (dict(warmup_schedule=(1.5,)), "warmup_schedule[0] must be in (0, 1]"),
    (dict(warmup_epochs=-1), "warmup_epochs: must be an int >= 0"),
    (dict(warmup_epochs=3, warmup_schedule=(0.3, 0.1)), "lists 2 epochs but warmup_epochs is 3"),
    (dict(compression="topk"), "compression: expected a GradientCompression"),
])
def test_warmup_callback_refuses_bad_settings_when_made(kwargs, needle):
    with pytest.raises(ValueError) as err:
        SparsityWarmupCallback(**kwargs)
    assert needle in str(err.value)


def test_stats_callback_writes_the_epoch_figures_into_the_logs():
    comp = _compression("topk:ratio=0.05")
    cb = CompressionStatsCallback(compression=comp)
    cb.on_epoch_begin(0)
    _run(comp, range(3), False)
    logs = {}
    cb.on_epoch_end(0, logs)
    k = sum(int(np.ceil(0.05 * np.prod(s))) for s in SHAPES)
    assert logs["wire_bytes_per_step"] == 8 * k
    assert logs["dense_bytes_per_step"] == 4 * sum(int(np.prod(s)) for s in SHAPES)
    assert logs["compression_ratio"] == logs["dense_bytes_per_step"] / logs["wire_bytes_per_step"]
    assert logs["density"] == 0.05
    # per group, what was sent: the spec everywhere (TF's codec choice is off by default)
    n = len(comp.groups)
    assert (logs["groups_spec"], logs["groups_fp16"], logs["groups_dense"]) == (n, 0, 0)
    d = cb.decisions()
    assert d.codec_choice == "off" and [r.kind for r in d.groups] == ["spec"] * n
    assert "codec choice off" in d.lines()[0]


# -- argument checks of the wrappers (no hvd.init(): each must raise before Horovod is needed) ------
def _tape():
    with tf.GradientTape() as tape:
        pass
    return tape


@pytest.mark.parametrize("kwargs, needle", [
    (dict(compression="topk:ratio=2"), "parameter 'ratio' must be float in (0.0, 1.0]"),
    (dict(compression="zip"), "unknown compressor 'zip'"),
    (dict(compression="topk:ratio=0.01"), "create it once, outside the training step"),
    (dict(compression="randomk:residual=false"), "hvc.GradientCompression('randomk"),
    (dict(op=hvd.Adasum), "op: Adasum is not supported"),
    (dict(gradient_predivide_factor=0.0), "gradient_predivide_factor: must be a finite float > 0"),
    (dict(gradient_predivide_factor=2.0, op=hvc.Sum), "require op=hvd.Average"),
    (dict(num_groups=2), "num_groups/groups: explicit grouping is not supported"),
    (dict(groups=[[]]), "num_groups/groups: explicit grouping is not supported"),
    (dict(sparse_as_dense="yes"), "sparse_as_dense: must be True or False"),
    (dict(device_dense=None), "device_dense: expected a device string"),
    (dict(process_set=3), "process_set: expected a horovod ProcessSet"),
    (dict(compression="fp16"), "horovod is not initialized"),
])
def test_tape_arguments_are_checked(kwargs, needle):
    with pytest.raises(ValueError) as err:
        hvc.DistributedGradientTape(_tape(), **kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize("make, kwargs, needle", [
    (lambda: tf.keras.optimizers.SGD(0.1), dict(backward_passes_per_step=0),
     "backward_passes_per_step: must be an int >= 1"),
    (lambda: tf.keras.optimizers.SGD(0.1), dict(average_aggregated_gradients=1),
     "average_aggregated_gradients: must be True or False"),
    (lambda: tf.keras.optimizers.SGD(0.1), dict(name="has space"), "name: must be a Python identifier"),
    (lambda: object(), {}, "optimizer: expected a tf.keras optimizer"),
    (lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
     dict(compression=hvc.GradientCompression("dgc:ratio=0.01")), "DGC applies the momentum in its memory"),
    (lambda: tf.keras.optimizers.SGD(0.1), dict(compression="dgc:warmup_schedule=0.25/0.3"),
     "dgc: warmup_schedule must decrease strictly"),
    (lambda: tf.keras.optimizers.legacy.SGD(0.1), dict(compression="topk:ratio=0.01"),
     "horovod is not initialized"),
])
def test_keras_optimizer_arguments_are_checked(make, kwargs, needle):
    with pytest.raises(ValueError) as err:
        hvc.DistributedOptimizer(make(), **kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize("graph", [False, True])
def test_dgc_warmup_reaches_its_ratio_without_set_epoch(graph):
    """The default DGC spec must not stay in warm-up forever when nobody calls set_epoch: epochs
    of warmup_epoch_steps exchanges are counted (with a warning), and density reports it."""
    spec = "dgc:ratio=0.01,warmup_epochs=2,warmup_epoch_steps=2,min_sparse_numel=256"
    comp = _compression(spec)
    fn = tf.function(lambda gs: comp.exchange(gs, world_size=1, scale=1.0)) if graph else \
        (lambda gs: comp.exchange(gs, world_size=1, scale=1.0))
    densities, sent = [], []
    with pytest.warns(UserWarning, match="epochs of 2 steps are counted"):
        for step in range(6):
            fn(_grads(step))
            densities.append(comp.density)
            sent.append(comp.stats.last_bytes)
    want = [comp.compressor.scheduled_density(e) for e in (0, 0, 1, 1, 2, 2)]
    assert densities == pytest.approx(want) and want[-1] == 0.01
    assert sent[0] > sent[2] > sent[4]
    comp.set_epoch(0)  # an explicit epoch takes over again
    fn(_grads(6))
    assert comp.density == pytest.approx(comp.compressor.scheduled_density(0))
