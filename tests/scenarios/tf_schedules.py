"""Merged-group schedules in real Horovod worker processes, TF backend (launched by
tests/test_tf_schedules_multiprocess.py). One launch runs every scenario and returns plain Python
data; parameters are compared across ranks bit for bit by allgathering them (``tf_core``).
"""

from __future__ import annotations

import os
import time
import traceback

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from scenarios.kit import (
    np_batch as _batch,
    tf_flat as _flat,
    tf_identical as _identical,
    keras_loss as _loss,
    keras_mlp as _model,
)  # noqa: E402

STEPS = 4
DGC = "dgc:ratio=0.05,min_sparse_numel=256,warmup_epochs=0"


def _keras_fit(spec, steps=STEPS, bpps=1, **kw):
    """``model.fit`` over ``steps`` batches of this rank's data (one epoch, batch 16)."""
    import hvdcompress.keras as hvc
    import numpy as np
    import tensorflow as tf
    model = _model()
    opt = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), compression=spec,
                                   backward_passes_per_step=bpps, **kw)
    model.compile(optimizer=opt, loss=_loss())
    xs, ys = zip(*(_batch(hvc.rank(), s) for s in range(steps)))
    model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=16, epochs=1, shuffle=False, verbose=0)
    return model, opt


def _tape_loop(compression, steps=STEPS, **kw):
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    model = _model()
    opt = tf.keras.optimizers.SGD(0.1)
    opt.build(model.trainable_variables)  # its slots now: made in the step's first trace, they would trace it twice
    loss_fn = _loss()
    used = []

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvc.DistributedGradientTape(tape, compression=compression, **kw)
        used.append(tape.compression)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for step in range(steps):
        step_fn(*_batch(hvc.rank(), step))
    return model, used[0]


def dense_merged_equals_layerwise() -> dict:
    """``none`` with merged schedules leaves the parameters layerwise leaves, on every rank."""
    import numpy as np
    from hvdcompress.schedule.costmodel import CostModel
    out = {"identical": {}, "equal": {}, "groups": {}}
    base_fit = _flat(_keras_fit("none")[0]).numpy()
    base_tape = _flat(_tape_loop("none")[0]).numpy()
    link = CostModel.from_link(2, gbit_per_s=10.0, latency_s=5e-3)
    for label, run in (
            ("fit single", lambda: _keras_fit("none", schedule="single")),
            ("fit mgwfbp", lambda: _keras_fit("none", schedule="mgwfbp", cost_model=link)),
            ("tape size", lambda: _tape_loop("none", schedule="size:0.005")),
            ("tape explicit", lambda: _tape_loop("none", schedule=[[0, 1], [4, 5]]))):
        model, used = run()
        comp = used.gradient_compression if hasattr(used, "gradient_compression") else used
        out["identical"][label] = _identical(model)
        out["equal"][label] = bool(np.array_equal(_flat(model).numpy(), base_tape if "tape" in label else base_fit))
        out["groups"][label] = comp.groups
    return out


def sparse_merged_stays_identical() -> dict:
    """DGC and top-k with merged groups: every rank applies the same update."""
    import hvdcompress.tensorflow as hvc
    out = {"identical": {}, "groups": {}, "state": {}}
    comp = hvc.GradientCompression(DGC, schedule="size:0.005")
    model, _ = _tape_loop(comp)
    out["identical"]["tape dgc size"] = _identical(model)
    out["groups"]["tape dgc size"] = comp.groups
    out["state"]["tape dgc size"] = [sorted(s) for s in comp.slots]
    for label, kwargs in (("fit dgc single", dict(spec=DGC, schedule="single")),
                          ("fit topk single bpps2", dict(spec="topk:ratio=0.05", schedule="single", bpps=2))):
        model, opt = _keras_fit(**kwargs)
        out["identical"][label] = _identical(model)
        out["groups"][label] = opt.gradient_compression.groups
    return out


def bad_schedules() -> dict:
    """A bad schedule, or a cost-model schedule with no model cached, raises on every rank before
    any collective; a collective still works after."""
    import horovod.tensorflow as hvd
    import hvdcompress.keras as hvc
    import tensorflow as tf
    errors = {}
    cases = {
        "unknown": lambda: hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), schedule="fastest"),
        "explicit": lambda: hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), schedule=[[0], [0, 1]]),
        "no_model": lambda: hvc.DistributedGradientTape(tf.GradientTape(), compression="fp16", schedule="mgs"),
        "no_model_gc": lambda: _tape_loop(hvc.GradientCompression("topk:ratio=0.1", schedule="auto"), steps=1),
    }
    for label, make in cases.items():
        try:
            make()
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    after = hvd.allreduce(tf.ones([1]), name="check_after_schedules", op=hvd.Sum)
    return {"errors": errors, "after": float(after.numpy()[0])}


# --- per-group codec choice: a group switching between top-k and dense ---------------------------
CODEC_SPEC = "topk:ratio=0.05"
CODEC_LR = 0.1


def _choice_models(world):
    """Hand-built cost models in which ``codec_choice="auto"`` sends every group with top-k (a
    1 Mbit/s link, top-k nearly free to compute) or dense (a 100 Gbit/s link, top-k and fp16 50 ms
    per group)."""
    from hvdcompress.schedule.costmodel import ComputeFit, CostModel
    cheap, dear = ComputeFit("linear", 1e-12, 1e-7), ComputeFit("linear", 1e-9, 5e-2)
    return {"compressed": CostModel.from_link(world, 0.001, 5e-3, {CODEC_SPEC: cheap, "fp16": dear}),
            "dense": CostModel.from_link(world, 100.0, 5e-6, {CODEC_SPEC: dear, "fp16": dear})}


def _residual(compression) -> float:
    return float(sum(abs(s["residual"].numpy()).sum() for s in compression.slots if "residual" in s))


def _codec_phase(model, opt, compression, steps, given=None):
    """Plain SGD steps through ``DistributedGradientTape`` with ``compression``; per step: identical
    across ranks, the parameters, the residual left; ``given`` (numpy, float64) gains the mean over
    ranks of each step's local gradient."""
    import horovod.tensorflow as hvd
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    loss_fn = _loss()
    opt.build(model.trainable_variables)  # its slots now: made in the step's first trace, they would trace it twice

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as plain:
            loss = loss_fn(y, model(x, training=True))
        local = plain.gradient(loss, model.trainable_variables)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvc.DistributedGradientTape(tape, compression=compression)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return tf.concat([tf.reshape(g, [-1]) for g in local], 0)

    log = []
    for step in steps:
        local = step_fn(*_batch(hvc.rank(), step))
        if given is not None:
            given += hvd.allreduce(local, name=f"check_codec_given_{step}").numpy().astype("float64")
        log.append({"identical": _identical(model), "params": _flat(model).numpy().copy(),
                    "residual": _residual(compression)})
    return log


def _carry(model, opt, compression, path, nxt):
    """``nxt`` (a new ``GradientCompression``) restoring the state of ``compression``, saved under
    ``path`` with the model and the optimizer: the way a group's spec changes in TF (the plan is
    made once per object)."""
    import tensorflow as tf
    saved = tf.train.Checkpoint(model=model, optimizer=opt, compression=compression).save(path)
    tf.train.Checkpoint(model=model, optimizer=opt, compression=nxt).restore(saved)
    return nxt


def _switch(model, opt, compression, path, world, kind):
    """``_carry`` to a new object planned with the ``kind`` cost model."""
    import hvdcompress.tensorflow as hvc
    return _carry(model, opt, compression, path,
                  hvc.GradientCompression(CODEC_SPEC, schedule="mgs", cost_model=_choice_models(world)[kind],
                                          codec_choice="auto"))


def codec_switch(world) -> dict:
    """``GradientCompression(codec_choice="auto")`` on 2 workers, with the plan sending every group
    with top-k (steps 0-2), then dense (3-5), then top-k again (6-8): a TF plan is made once per
    object, so each switch is a new object restoring the last one's checkpoint. The residual top-k
    left is sent with the first dense step and zeroed; parameters are identical across ranks every
    step; error feedback loses nothing ((p_0 - p_T) / lr + the mean residual = the sum of the mean
    gradients); a checkpoint taken between the dense steps resumes bit for bit, switch included."""
    import tempfile
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf
    import hvdcompress.tensorflow as hvc
    where = tempfile.mkdtemp(prefix="hvdc-tf-codec-")
    model, opt = _model(), tf.keras.optimizers.SGD(CODEC_LR)
    start = _flat(model).numpy().astype("float64")
    given = np.zeros_like(start)
    first = hvc.GradientCompression(CODEC_SPEC, schedule="mgs", cost_model=_choice_models(world)["compressed"],
                                    codec_choice="auto")
    log = _codec_phase(model, opt, first, range(0, 3), given)
    codecs = {"compressed": first.plan.codecs}
    held_before_dense = log[-1]["residual"]
    dense = _switch(model, opt, first, f"{where}/a", world, "dense")
    log += _codec_phase(model, opt, dense, range(3, 4), given)
    mid = tf.train.Checkpoint(model=model, optimizer=opt, compression=dense).save(f"{where}/mid")
    log += _codec_phase(model, opt, dense, range(4, 6), given)
    codecs["dense"] = dense.plan.codecs
    again = _switch(model, opt, dense, f"{where}/b", world, "compressed")
    log += _codec_phase(model, opt, again, range(6, 9), given)
    codecs["again"] = again.plan.codecs
    held = hvd.allreduce(tf.concat([tf.reshape(s["residual"], [-1]) for s in again.slots], 0),  # by position
                         name="check_codec_held").numpy().astype("float64")
    moved = (start - _flat(model).numpy().astype("float64")) / CODEC_LR
    # resumed from the checkpoint taken between the dense steps, by new objects: the same steps
    model2, opt2 = _model(seed=1), tf.keras.optimizers.SGD(CODEC_LR)
    dense2 = hvc.GradientCompression(CODEC_SPEC, schedule="mgs", cost_model=_choice_models(world)["dense"],
                                     codec_choice="auto")
    tf.train.Checkpoint(model=model2, optimizer=opt2, compression=dense2).restore(mid)
    log2 = _codec_phase(model2, opt2, dense2, range(4, 6))
    again2 = _switch(model2, opt2, dense2, f"{where}/c", world, "compressed")
    log2 += _codec_phase(model2, opt2, again2, range(6, 9))
    return {"codecs": codecs, "identical": all(r["identical"] for r in log + log2),
            "residuals": [r["residual"] for r in log], "held_before_dense": held_before_dense,
            "lost": float(np.abs(moved + held - given).max()), "scale": float(np.abs(given).max()),
            "resumed_equal": [bool(np.array_equal(a["params"], b["params"])) for a, b in zip(log2, log[4:])],
            "resumed_residuals_equal": [a["residual"] == b["residual"] for a, b in zip(log2, log[4:])]}


# --- per-group codec choice for a compressor that never merges (PowerSGD) -------------------------
LOWRANK = "powersgd:rank=2"


def _lowrank_choice(world):
    """PowerSGD with ``codec_choice="auto"`` under a hand-built cost model (0.1 Mbit/s, 5 ms per
    hop, cheap compression): PowerSGD on the two large kernels, alone; the last kernel and the
    biases merged into fp16 groups."""
    import hvdcompress.tensorflow as hvc
    from hvdcompress.schedule.costmodel import ComputeFit, CostModel
    fit = ComputeFit("linear", 1e-10, 1e-6)
    model = CostModel.from_link(world, gbit_per_s=1e-4, latency_s=5e-3,
                                compress={LOWRANK: fit, "fp16": fit, "none": ComputeFit("linear", 1e-12, 1e-7)})
    return hvc.GradientCompression(LOWRANK, schedule="auto", cost_model=model, codec_choice="auto")


def _state(compression, slot):
    return {i: s[slot].numpy().copy() for i, s in enumerate(compression.slots) if slot in s}


def lowrank_switch(world) -> dict:
    """PowerSGD layerwise (steps 0-1: every kernel's q warm, residuals held), then with the codec
    choice (2-3: kernel 4 and the biases in a merged fp16 group, kernels 0 and 2 alone), then
    layerwise again (4-5), each switch a new object restoring the last one's checkpoint. Kernel 4's
    residual goes out with its merged group, its q stays as it was and serves it when it is alone
    again; parameters are identical across ranks every step; error feedback loses nothing but the
    biases' fp16 rounding; a checkpoint taken between the merged steps resumes bit for bit (the
    parameters, every residual and q)."""
    import tempfile
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf
    import hvdcompress.tensorflow as hvc
    where = tempfile.mkdtemp(prefix="hvdc-tf-lowrank-")
    model, opt = _model(), tf.keras.optimizers.SGD(CODEC_LR)
    start = _flat(model).numpy().astype("float64")
    given = np.zeros_like(start)
    plain = hvc.GradientCompression(LOWRANK)
    log = _codec_phase(model, opt, plain, range(0, 2), given)
    q0, r0 = _state(plain, "q"), _state(plain, "residual")
    chosen = _carry(model, opt, plain, f"{where}/a", _lowrank_choice(world))
    log += _codec_phase(model, opt, chosen, range(2, 3), given)
    r1 = _state(chosen, "residual")
    mid = tf.train.Checkpoint(model=model, optimizer=opt, compression=chosen).save(f"{where}/mid")
    log += _codec_phase(model, opt, chosen, range(3, 4), given)
    q1, r3 = _state(chosen, "q"), _state(chosen, "residual")
    back = _carry(model, opt, chosen, f"{where}/b", hvc.GradientCompression(LOWRANK))
    log += _codec_phase(model, opt, back, range(4, 6), given)
    q2 = _state(back, "q")
    held = hvd.allreduce(tf.concat([tf.reshape(s["residual"], [-1]) if "residual" in s else
                                    tf.zeros([v.shape.num_elements()]) for s, v in
                                    zip(back.slots, model.trainable_variables)], 0),  # by position
                         name="check_lowrank_held").numpy().astype("float64")
    moved = (start - _flat(model).numpy().astype("float64")) / CODEC_LR
    # resumed from the checkpoint taken between the merged steps, by new objects: the same step
    model2, opt2, chosen2 = _model(seed=1), tf.keras.optimizers.SGD(CODEC_LR), _lowrank_choice(world)
    tf.train.Checkpoint(model=model2, optimizer=opt2, compression=chosen2).restore(mid)
    log2 = _codec_phase(model2, opt2, chosen2, range(3, 4))
    again = {"q": _state(chosen2, "q"), "residual": _state(chosen2, "residual")}
    return {"groups": chosen.groups, "codecs": chosen.plan.codecs, "slots": [sorted(s) for s in chosen.slots],
            "identical": all(r["identical"] for r in log + log2),
            "q_kept": {i: bool(np.array_equal(q1[i], q0[i])) for i in q0},
            "q_used_again": {i: not np.array_equal(q2[i], q1[i]) for i in q1},
            "residual_sent": float(np.abs(r1[4]).max() / np.abs(r0[4]).max()),
            "lost": float(np.abs(moved + held - given).max()), "scale": float(np.abs(given).max()),
            "resumed_equal": [bool(np.array_equal(a["params"], b["params"])) for a, b in zip(log2, log[3:])],
            "resumed_state_equal": {slot: {i: bool(np.array_equal(again[slot][i], want[i])) for i in want}
                                    for slot, want in (("q", q1), ("residual", r3))}}


def everything(world_expected: int, cache_dir: str = None) -> dict:
    """Every scenario; with ``cache_dir``, an empty cost-model cache of their own (nothing cached)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    if cache_dir is not None:
        os.environ["HVDCOMPRESS_CACHE"] = cache_dir
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    assert hvd.size() == world_expected
    out = {}
    for name, fn in (("dense", dense_merged_equals_layerwise), ("sparse", sparse_merged_stays_identical),
                     ("bad", bad_schedules), ("codec", lambda: codec_switch(world_expected)),
                     ("lowrank", lambda: lowrank_switch(world_expected))):
        start = time.perf_counter()
        try:
            out[name] = fn()
        except Exception:  # report, do not hang the test on a worker traceback
            out[name] = {"error": traceback.format_exc()}
        out.setdefault("seconds", {})[name] = time.perf_counter() - start
    hvd.shutdown()
    return out
