"""Worker code for tests/test_twolevel_tf.py: two-level exchanges of the TensorFlow front ends
(``DistributedGradientTape`` with a ``GradientCompression``, the Keras ``DistributedOptimizer``)
through Horovod process sets, on 4 Horovod/Gloo workers as 2 nodes x 2 ranks.

``launch(names)`` starts the 4 workers once and runs the named scenarios in each. One machine's
launcher states one node, so the worker stands in for a two-node launcher in ``init``:
``hvdcompress.tensorflow.init()`` registers the node sets as it does for a launcher of 2 nodes of 2
(``launcher_groups`` answered so), and the cross-node sets are added when the first two-level
exchange is made ready (the workers run with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``): both ways a set
is made are used. Every two-level exchange is logged at its outer level (``Recorder``: the flat
input, the state before, the result and the state after, read when the traced step runs) for the
pytest side's replay through the numpy oracle ``simulate_two_level``.
"""

from __future__ import annotations

import os
import tempfile
import time
from unittest import mock

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from scenarios import kit  # noqa: E402

TOPOLOGY = "2x2"
# dense, a quantizer, a data-dependent sparsifier with error feedback, low rank (state of another size)
SPECS = ("none", "qsgd:levels=3,bucket=64", "topk:ratio=0.1", "powersgd:rank=2")
RESUMED = ("topk:ratio=0.1",)  # error feedback's residual, part l at its place: resumed from a checkpoint
KERAS_SPEC = "topk:ratio=0.1"
STEPS, SAVE_AT = 2, 2  # a resumed spec runs SAVE_AT + 1 steps, then 1 more from the checkpoint
MLP = (12, 24, 24, 4)
NODE_SETS = [(0, 1), (2, 3)]
# Horovod's background cycle in these workers: each cycle negotiates every process set a worker is in
# (here three: the job, its node, its cross-node peers), so an idle worker's thread costs about three
# times a flat launch's per cycle; a step's few rounds wait a cycle each, a few tens of ms in all.
CYCLE_MS = "10"


class Recorder:
    """Wraps ``TwoLevelTransport``'s two-level exchange to log each one when the traced step runs
    (``tf.py_function`` on the input and the state read before it, then on the result and the
    state read after it: automatic control dependencies order the reads around the exchange's
    writes). ``tag`` is read when the step is traced (each run traces its own)."""

    def __init__(self):
        from tf_ops.twolevel import TwoLevelTransport
        self.log, self.tag = [], None
        self._cls, self._orig = TwoLevelTransport, TwoLevelTransport._two_level
        rec, orig = self, self._orig

        def two_level(transport, make, x, ctx, parts, numel):
            import tensorflow as tf
            tag = rec.tag
            if tag is None:
                return (yield from orig(transport, make, x, ctx, parts, numel))
            names = sorted(ctx.state)
            entry = {}

            def start(xv, step, *before):
                entry.clear()
                entry.update({"tag": tag, "spec": str(make.__self__.spec), "key": ctx.key, "step": int(step),
                              "shape": tuple(ctx.shape), "members": tuple(ctx.members), "scale": ctx.scale,
                              "epoch": 0, "x": xv.numpy().copy(),
                              "before": {k: v.numpy().copy() for k, v in zip(names, before)}})
                return 0

            def end(started, result, *after):
                entry.update({"result": result.numpy().copy(),
                              "after": {k: v.numpy().copy() for k, v in zip(names, after)}})
                rec.log.append(dict(entry))
                return []

            step = tf.cast(ctx.step, tf.int64)
            started = tf.py_function(start, [tf.reshape(x, [-1]), step] + [ctx.state[k].read_value() for k in names],
                                     tf.int64)
            result = yield from orig(transport, make, x, ctx, parts, numel)
            tf.py_function(end, [started, result] + [ctx.state[k].read_value() for k in names], [])
            return tf.identity(result)

        TwoLevelTransport._two_level = two_level

    def restore(self):
        self._cls._two_level = self._orig


def _model():
    return kit.keras_mlp(MLP)


def _batch(rank, step):
    return kit.np_batch(rank, step, n=8, features=12)


def _tape_run(spec, topology, steps, first=0, saved=None, rec=None, tag=None):
    """``steps`` tape steps from step ``first`` (after restoring the checkpoint ``saved``), each
    logged under ``tag``; identical replicas after each; a checkpoint after SAVE_AT steps of a
    fresh run. Returns (model, compression, identical, checkpoint prefix)."""
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    model = _model()
    opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(model.trainable_variables)
    compression = hvc.GradientCompression(spec, schedule="single" if not spec.startswith("powersgd") else None,
                                          topology=topology)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, compression=compression)
    if saved is not None:
        ckpt.read(saved)
    loss_fn = kit.keras_loss()

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvc.DistributedGradientTape(tape, compression=compression)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    rec.tag = tag
    identical, prefix = [], None
    for step in range(first, first + steps):
        step_fn(*_batch(hvc.rank(), step))
        identical.append(kit.tf_identical(model, name=f"check.{tag[0]}.{SPECS.index(tag[1])}.{step}"))
        if step + 1 == SAVE_AT and saved is None:
            prefix = ckpt.write(os.path.join(tempfile.mkdtemp(prefix="hvc-tf2l-"), "ckpt"))
    rec.tag = None
    return model, compression, identical, prefix


def _summary(model, compression, identical):
    import numpy as np
    t = compression.session.transport(_global_set())
    stats = compression.stats
    return {"identical": identical, "flat": kit.tf_flat(model).numpy(),
            "moved": float(np.abs(kit.tf_flat(model).numpy() - kit.tf_flat(_model()).numpy()).max()),
            "hops": dict(stats.total_hop_bytes), "bytes": stats.total_bytes,
            "transports": [type(t).__name__, type(t.local).__name__, type(t.cross).__name__],
            "sets": [list(t.local.process_set.ranks), list(t.cross.process_set.ranks)]}


def _global_set():
    import horovod.tensorflow as hvd
    return hvd.global_process_set


def every_spec(rec) -> dict:
    """Each spec two-level through the tape: identical parameters every step, every exchange logged
    for the oracle, the bytes per hop; the specs with state resumed from a checkpoint saved after
    SAVE_AT steps, ending where the uninterrupted run ends."""
    import numpy as np
    out = {}
    for spec in SPECS:
        steps = SAVE_AT + 1 if spec in RESUMED else STEPS
        model, compression, identical, prefix = _tape_run(spec, TOPOLOGY, steps, rec=rec, tag=("tape", spec))
        out[spec] = _summary(model, compression, identical)
        if spec in RESUMED:
            resumed, comp2, ident2, _ = _tape_run(spec, TOPOLOGY, steps - SAVE_AT, first=SAVE_AT, saved=prefix,
                                                  rec=rec, tag=("tape-resumed", spec))
            out[spec]["resumed_identical"] = ident2
            out[spec]["resumed_equal"] = bool(np.array_equal(kit.tf_flat(model).numpy(), kit.tf_flat(resumed).numpy()))
    return out


def keras(rec) -> dict:
    """One spec through ``hvdcompress.keras.DistributedOptimizer`` (``train_on_batch``), two-level:
    identical parameters every step, every exchange logged for the oracle."""
    import hvdcompress.keras as hvc
    import tensorflow as tf
    model = _model()
    opt = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=KERAS_SPEC, schedule="single",
                                   topology=TOPOLOGY)
    model.compile(optimizer=opt, loss=kit.keras_loss())
    rec.tag = ("keras", KERAS_SPEC)
    identical = []
    for step in range(STEPS):
        model.train_on_batch(*_batch(hvc.rank(), step))
        identical.append(kit.tf_identical(model, name=f"check.keras.{step}"))
    rec.tag = None
    return _summary(model, opt.gradient_compression, identical)


def opt_out(rec) -> dict:
    """topology=None follows the launcher's layout (HOROVOD_LOCAL_SIZE, read when the wrapper is
    made), "flat" opts out, a tape given a GradientCompression keeps its topology, and an explicit
    two-level topology on a process set smaller than the job is refused on every rank before any
    collective (the next collective still lines up)."""
    import horovod.tensorflow as hvd
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    from tf_ops.collectives import process_sets
    out = {}
    launcher = {"HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_SIZE": "2"}  # a launcher of 2 nodes of 2
    with mock.patch.dict(os.environ, launcher):  # restored after
        for arg in (None, "flat"):
            compression = hvc.GradientCompression("topk:ratio=0.1", topology=arg)
            compression.prepare(hvd.size(), hvd.global_process_set)
            out[str(arg)] = type(compression.session.transport(hvd.global_process_set)).__name__
    try:
        hvc.DistributedGradientTape(tf.GradientTape(), compression=hvc.GradientCompression("topk:ratio=0.1"),
                                    topology="flat")
        out["carried"] = "accepted"
    except ValueError as e:
        out["carried"] = str(e)
    node = process_sets(NODE_SETS)[hvd.rank() // 2]
    try:
        hvc.DistributedGradientTape(tf.GradientTape(), compression="none", topology=TOPOLOGY, process_set=node)
        out["subset"] = "accepted"
    except ValueError as e:
        out["subset"] = str(e)
    out["after"] = float(hvd.allreduce(tf.ones([1]), name="after.refusal", op=hvd.Sum).numpy()[0])
    return out


def _worker(names):
    """One worker: ``hvdcompress.tensorflow.init()`` registering the node sets (a two-node
    launcher's, module doc), then the scenarios, each logged by one ``Recorder``."""
    import horovod.tensorflow as hvd
    import hvdcompress.tensorflow as hvc
    import hvdcompress.topology as topology
    from scenarios.launch import tf_graph_options
    tf_graph_options()
    launcher = topology.launcher_groups
    topology.launcher_groups = lambda env=None: list(NODE_SETS)
    try:
        hvc.init()
    finally:
        topology.launcher_groups = launcher
    rec = Recorder()
    cpu = {}

    def call(name):  # each scenario's CPU seconds in this worker (its threads, Horovod's included)
        start = time.process_time()
        try:
            return globals()[name](rec)
        finally:
            cpu[name] = round(time.process_time() - start, 2)
    out = kit.run_scenarios(names, call)
    out["cpu"] = cpu
    rec.restore()
    out["log"] = rec.log
    hvd.shutdown()
    return out


def launch(names) -> list:
    """One launch of 4 Horovod/Gloo workers running ``names``; every rank's results."""
    from scenarios.launch import NO_GRAPH_OPTIMIZER, run_workers
    env = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1", NO_GRAPH_OPTIMIZER: "1", "HOROVOD_CYCLE_TIME": CYCLE_MS}
    return run_workers(_worker, 4, list(names), env=env, start_timeout=120)

