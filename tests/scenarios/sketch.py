"""Code that runs inside real Horovod workers for the Sketched-SGD tests (tests/test_sketch_multiprocess.py).

One launch per backend and world size runs every scenario and returns plain Python data. Every
step's parameters are allgathered and compared across ranks bit for bit; the exchanges of the
first steps are recorded (input, state before, result) and replayed through the numpy oracle.
"""

from __future__ import annotations

import copy
import os
import tempfile

from scenarios import kit

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

# 640- and 1024-entry weights are sketched, the 128-entry weight and biases are sent dense
SPEC = "sketch:ratio=0.05,cols_ratio=0.05,min_sketch_numel=256,seed=3"
STEPS = 6
BAD = {"rows": "sketch:rows=0", "p2": "sketch:p2=0.5", "cols_ratio": "sketch:cols_ratio=2",
       "k": "sketch:k=-3", "unknown": "sketch:colums=4"}


def _recorder(cls, log):
    """Wrap ``cls.exchange`` to log (key, shape, scale, input, state before, result)."""
    orig = cls.exchange

    def exchange(self, x, ctx):
        before = {k: (v.clone() if hasattr(v, "clone") else v.numpy().copy()) for k, v in ctx.state.items()}
        xin = x.clone() if hasattr(x, "clone") else x
        result = yield from orig(self, x, ctx)
        # the result may be ctx.out, the engine's buffer that the next step reuses: keep a copy
        kept = result.clone() if hasattr(result, "clone") else result
        log.append((ctx.step, ctx.key, tuple(ctx.shape), ctx.scale, xin, before, kept))
        return result

    cls.exchange = exchange
    return orig


def _replay(log, gather, spec_text):
    """Every rank's logged exchanges through the oracle; (exact matches, max abs diff, support equal)."""
    import numpy as np
    from hvdcompress import parse_spec
    from hvdcompress.reference import simulate
    exact, worst, support = 0, 0.0, True
    for _, key, shape, scale, x, before, result in sorted(log, key=lambda e: (e[0], e[1])):
        xs = gather(np.asarray(x))
        states = [{k: np.ascontiguousarray(v) for k, v in st.items()} for st in gather_states(before, gather, len(xs))]
        want, _, _ = simulate(parse_spec(spec_text), xs, states, key=key, shape=shape, scale=scale)
        got = np.asarray(result)
        exact += int(np.array_equal(got, want))
        worst = max(worst, float(np.abs(got - want).max()))
        support &= bool(np.array_equal(np.flatnonzero(got), np.flatnonzero(want)))
    return {"n": len(log), "exact": exact, "max_diff": worst, "support": support}


def gather_states(before, gather, world):
    import numpy as np
    names = sorted(before)
    per_name = {n: gather(np.asarray(before[n])) for n in names}
    return [{n: per_name[n][r] for n in names} for r in range(world)]


# --- PyTorch --------------------------------------------------------------------------------------
def _torch_train(spec, schedule, first, last, model=None, opt=None, check=None):
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    import torch
    import torch.nn as nn
    if model is None:
        model = kit.torch_mlp()
        opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=spec,
                                       schedule=schedule)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(first, last):
        opt.zero_grad()
        x, y = kit.torch_batch(hvd.rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        if check is not None:
            check.append(kit.torch_identical(model, f"check.{schedule}.{step}.{len(check)}"))
    return model, opt


def torch_all(world_expected: int) -> dict:
    import horovod.torch as hvd
    import numpy as np
    import torch
    from torch_ops.compressors.sketch import SketchCompressor
    hvd.init()
    assert hvd.size() == world_expected
    out = {}

    def gather(a):
        rows = hvd.allgather(torch.from_numpy(np.ascontiguousarray(a)).reshape(1, -1), name=f"g{len(names)}")
        names.append(1)
        return [r.numpy() for r in rows]

    names = []

    def training():
        res = {}
        for schedule in ("layerwise", "single"):
            log, checks = [], []
            orig = _recorder(SketchCompressor, log)
            try:
                model, opt = _torch_train(SPEC, schedule, 0, 3, check=checks)
            finally:
                SketchCompressor.exchange = orig
            model, opt = _torch_train(SPEC, schedule, 3, STEPS, model, opt, check=checks)
            res[schedule] = {"identical_every_step": checks, "replay": _replay(log, gather, str(opt.compression)),
                             "moved": float((kit.torch_flat(model) - kit.torch_flat(kit.torch_mlp())).abs().max()),
                             "stats": opt.stats.as_dict(), "momentum": opt.param_groups[0]["momentum"]}
        sizes = [p.numel() for p in kit.torch_mlp().parameters()]
        from hvdcompress import parse_spec
        spec = parse_spec(SPEC)
        rounds = spec.info.rounds(spec.params, np.array(sizes, dtype=float))
        res["predicted_bytes"] = float(sum(r.nbytes.sum() for r in rounds))
        return res

    out["train"] = kit.guard(training)
    out["resume"] = kit.guard(_torch_resume)
    out["bad"] = kit.guard(_torch_bad)
    hvd.shutdown()
    return out


def _torch_resume() -> dict:
    import hvdcompress.torch as hvc
    import torch
    model, opt = _torch_train(SPEC, "layerwise", 0, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    has_state = all({"u", "v"} <= set(st) for st in saved_opt["hvdcompress"]["state"].values())
    model, opt = _torch_train(SPEC, "layerwise", 3, STEPS, model, opt)
    model2 = kit.torch_mlp()
    opt2 = hvc.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model2.named_parameters(), compression=SPEC,
                                    schedule="layerwise")
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    model2, opt2 = _torch_train(SPEC, "layerwise", 3, STEPS, model2, opt2)
    return {"has_state": has_state, "equal": bool(torch.equal(kit.torch_flat(model), kit.torch_flat(model2))),
            "max_diff": float((kit.torch_flat(model) - kit.torch_flat(model2)).abs().max()),
            "identical": kit.torch_identical(model2, "check.resume"), "momentum": opt2.param_groups[0]["momentum"]}


def _torch_bad() -> dict:
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    import torch
    model = kit.torch_mlp()
    errors = {}
    cases = {label: (text, {}) for label, text in BAD.items()}
    cases["nesterov"] = ("sketch", {"momentum": 0.9, "nesterov": True})
    for label, (text, kw) in cases.items():
        try:
            hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, **kw),
                                     named_parameters=model.named_parameters(), compression=text)
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    after = hvd.allreduce(torch.ones(1), name="check.after", op=hvd.Sum)
    return {"errors": errors, "after": float(after)}


# --- TensorFlow / Keras ---------------------------------------------------------------------------
def _keras_paths() -> dict:
    import hvdcompress.keras as hvc
    import tensorflow as tf
    out = {}
    for schedule in ("layerwise", "single"):
        model = kit.keras_mlp()
        opt = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), compression=SPEC,
                                       schedule=schedule)
        model.compile(optimizer=opt, loss=kit.keras_loss())
        checks = []
        for step in range(STEPS):
            model.train_on_batch(*kit.np_batch(hvc.rank(), step))
            checks.append(kit.tf_identical(model, f"check_keras_{schedule}_{step}"))
        out[schedule] = {"identical_every_step": checks, "momentum": (opt.compression["momentum"],
                                                                      float(opt.get_config()["momentum"])),
                         "moved": float(abs(kit.tf_flat(model).numpy() - kit.tf_flat(kit.keras_mlp()).numpy()).max()),
                         "stats": opt.stats.as_dict()}
    return out


def _tape(comp, first, last, model=None, opt=None, checks=None):
    import hvdcompress.tensorflow as hvc
    import tensorflow as tf
    if model is None:
        model, opt = kit.keras_mlp(), tf.keras.optimizers.SGD(0.1)
    opt.build(model.trainable_variables)  # its slots now: made in the step's first trace, they would trace it twice
    loss_fn = kit.keras_loss()

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvc.DistributedGradientTape(tape, compression=comp)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for step in range(first, last):
        step_fn(*kit.np_batch(hvc.rank(), step))
        if checks is not None:
            checks.append(kit.tf_identical(model, f"check_tape_{step}_{len(checks)}"))
    return model, opt


def _tape_and_resume(tmp) -> dict:
    import hvdcompress.tensorflow as hvc
    import numpy as np
    import tensorflow as tf
    comp, checks = hvc.GradientCompression(SPEC), []
    model, opt = _tape(comp, 0, 3, checks=checks)
    path = tf.train.Checkpoint(model=model, optimizer=opt, compression=comp).save(
        os.path.join(tmp, f"sk-rank{hvc.rank()}"))
    model, opt = _tape(comp, 3, STEPS, model, opt, checks=checks)
    comp2 = hvc.GradientCompression(SPEC)
    model2, opt2 = kit.keras_mlp(), tf.keras.optimizers.SGD(0.1)
    _tape(comp2, 0, 0, model2, opt2)
    tf.train.Checkpoint(model=model2, optimizer=opt2, compression=comp2).restore(path)
    model2, _ = _tape(comp2, 3, STEPS, model2, opt2)
    return {"identical_every_step": checks,
            "equal": bool(np.array_equal(kit.tf_flat(model).numpy(), kit.tf_flat(model2).numpy())),
            "identical": kit.tf_identical(model2, "check_resumed"), "stats": comp.stats.as_dict(),
            "state": sorted({k for s in comp2.slots for k in s})}


def _tf_bad() -> dict:
    import horovod.tensorflow as hvd
    import hvdcompress.keras as hvc
    import tensorflow as tf
    errors = {}
    cases = {label: (lambda text=text: hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=text))
             for label, text in BAD.items()}
    cases["nesterov"] = lambda: hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
                                                         compression="sketch")
    cases["tape"] = lambda: __import__("hvdcompress.tensorflow", fromlist=["x"]).GradientCompression("sketch:rows=40")
    for label, make in cases.items():
        try:
            make()
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    after = hvd.allreduce(tf.ones([1]), name="check_after", op=hvd.Sum)
    return {"errors": errors, "after": float(after.numpy()[0])}


def tf_all(world_expected: int) -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    assert hvd.size() == world_expected
    out = {"keras": kit.guard(_keras_paths), "tape": kit.guard(_tape_and_resume, tempfile.mkdtemp()),
           "bad": kit.guard(_tf_bad)}
    hvd.shutdown()
    return out
