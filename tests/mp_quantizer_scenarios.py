"""Code that runs inside real Horovod workers for the quantizers and PowerSGD (launched by
tests/test_quantizers_multiprocess.py): one launch per backend, every scenario in it, plain data
back. Parameters are compared across ranks bit for bit (allgathered) after every step."""

from __future__ import annotations

import copy
import os
import tempfile
import time
import traceback

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

SPECS = ["signsgd", "efsignsgd", "onebit", "terngrad:bucket=100", "qsgd:levels=3,bucket=64", "powersgd:rank=2"]
BAD = {"levels": "qsgd:levels=0", "bucket": "terngrad:bucket=-1", "rank": "powersgd:rank=0"}
STEPS = 4
LR = 0.05


def expected_bytes(spec_text: str, shapes) -> int:
    """Bytes per step the declared layout says one rank sends for tensors of ``shapes``."""
    from hvdcompress import parse_spec
    from hvdcompress.reference.powersgd import is_compressed, matrix_shape
    from hvdcompress.reference.quantizers import payload_bytes
    spec = parse_spec(spec_text)
    total = 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= int(d)
        if spec.name == "powersgd":
            n, m = matrix_shape(tuple(shape))
            total += (n + m) * spec["rank"] * 4 if is_compressed(tuple(shape), spec["rank"]) else numel * 4
        else:
            total += payload_bytes(spec.name, spec.params, numel)
    return total


def _guard(fn, *args):
    start = time.perf_counter()
    try:
        out = fn(*args)
    except Exception:  # report, do not hang the test on a worker traceback
        out = {"error": traceback.format_exc()}
    out["seconds"] = time.perf_counter() - start
    return out


# -- PyTorch ------------------------------------------------------------------------------------------
def _torch_train(spec, model, opt, first, last):
    import torch.nn as nn
    from mp_scenarios import _batch, _identical_across_ranks
    import horovod.torch as hvd
    identical, sent = [], []
    for step in range(first, last):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        identical.append(_identical_across_ranks(model))
        sent.append(opt.stats.last_bytes)
    return identical, sent


def _torch_make(spec, schedule="layerwise"):
    import torch
    import hvdcompress.torch as hvc
    from mp_scenarios import _model
    model = _model()
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=spec,
                                   schedule=schedule)
    return model, opt


def _torch_one(spec, schedule="layerwise"):
    import horovod.torch as hvd
    from mp_scenarios import _flat, _model
    model, opt = _torch_make(spec, schedule)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = _flat(_model())
    identical, sent = _torch_train(spec, model, opt, 0, STEPS)
    return {"identical": identical, "sent": sent, "schedule": opt.schedule,
            "expected": expected_bytes(spec, [tuple(p.shape) for p in model.parameters()]),
            "moved": float((_flat(model) - start).abs().max())}


def _torch_resume(spec):
    """Save every rank's state after 2 steps; a fresh optimizer loaded from it continues exactly."""
    import torch
    from mp_scenarios import _flat
    model, opt = _torch_make(spec)
    _torch_train(spec, model, opt, 0, 2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _torch_train(spec, model, opt, 2, 4)
    model2, opt2 = _torch_make(spec)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    identical, _ = _torch_train(spec, model2, opt2, 2, 4)
    state = saved_opt["hvdcompress"]["state"]
    return {"equal": bool(torch.equal(_flat(model), _flat(model2))), "identical": identical,
            "state": sorted({k for st in state.values() for k in st})}


def torch_everything() -> dict:
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc
    torch.set_num_threads(1)
    hvd.init()
    out = {"world": hvd.size(), "train": {}, "auto": {}, "resume": {}, "bad": {}}
    for spec in SPECS:
        out["train"][spec] = _guard(_torch_one, spec)
    for spec in ("qsgd:levels=3,bucket=64", "powersgd:rank=2"):  # the default schedule
        out["auto"][spec] = _guard(_torch_one, spec, "auto")
    for spec in ("powersgd:rank=2", "efsignsgd"):
        out["resume"][spec] = _guard(_torch_resume, spec)
    from mp_scenarios import _model
    for label, text in BAD.items():
        try:
            hvc.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), compression=text)
            out["bad"][label] = None
        except ValueError as e:
            out["bad"][label] = str(e)
    out["after"] = float(hvd.allreduce(torch.ones(1), name="q.after", op=hvd.Sum))
    hvd.shutdown()
    return out


# -- TensorFlow / Keras -------------------------------------------------------------------------------
def _keras_one(spec):
    import hvdcompress.keras as hvc
    from mp_tf_scenarios import _batch, _flat, _identical, _keras, _model
    model, opt, _ = _keras(spec, momentum=0.9)
    start = _flat(_model()).numpy()
    identical, sent = [], []
    for step in range(STEPS):
        model.train_on_batch(*_batch(hvc.rank(), step))
        identical.append(_identical(model))
        sent.append(opt.stats.last_bytes)
    return {"identical": identical, "sent": sent,
            "expected": expected_bytes(spec, [tuple(v.shape) for v in model.trainable_variables]),
            "moved": float(abs(_flat(model).numpy() - start).max())}


def _tf_resume(kind, spec, tmp):
    import hvdcompress.tensorflow as hvc
    import numpy as np
    import tensorflow as tf
    from mp_tf_scenarios import _flat, _identical, _keras, _tape
    path = os.path.join(tmp, f"{kind}-{spec.split(':')[0]}-rank{hvc.rank()}")
    if kind == "keras":
        model, opt, run = _keras(spec, epoch_every=1)
        run(0, 2)
        model.save_weights(path)
        run(2, 4)
        straight = _flat(model).numpy()
        model2, opt2, run2 = _keras(spec, epoch_every=1)
        model2.load_weights(path)
        comp2 = opt2.gradient_compression
    else:
        comp = hvc.GradientCompression(spec)
        model, opt, run = _tape(comp, steps=2, epoch_every=1)
        saved = tf.train.Checkpoint(model=model, optimizer=opt, compression=comp).save(path)
        run(2, 4)
        straight = _flat(model).numpy()
        comp2 = hvc.GradientCompression(spec)
        model2, opt2, run2 = _tape(comp2, steps=0, epoch_every=1)
        tf.train.Checkpoint(model=model2, optimizer=opt2, compression=comp2).restore(saved)
    run2(2, 4)
    return {"equal": bool(np.array_equal(straight, _flat(model2).numpy())), "identical": [_identical(model2)],
            "state": sorted({k for s in comp2.slots for k in s})}


def tf_everything() -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    import hvdcompress.keras as hvc
    out = {"world": hvd.size(), "train": {}, "resume": {}, "bad": {}}
    for spec in SPECS:
        out["train"][spec] = _guard(_keras_one, spec)
    tmp = tempfile.mkdtemp()
    for kind, spec in (("keras", "powersgd:rank=2"), ("tape", "efsignsgd")):
        out["resume"][spec] = _guard(_tf_resume, kind, spec, tmp)
    for label, text in BAD.items():
        try:
            hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=text)
            out["bad"][label] = None
        except ValueError as e:
            out["bad"][label] = str(e)
    out["after"] = float(hvd.allreduce(tf.ones([1]), name="q_after", op=hvd.Sum).numpy()[0])
    hvd.shutdown()
    return out
