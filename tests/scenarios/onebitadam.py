"""1-bit Adam on real Horovod workers (tests/test_onebitadam.py reads these).

PyTorch (2 workers, the shared launch): ``DistributedOptimizer(AdamW, compression="onebitadam")``
trains the standard MLP; every step the parameters are identical on every rank, and rank 0
replays the step with the numpy oracle from every rank's local gradients (gathered), starting
from the same parameters, and compares; a checkpoint taken after the warm-up resumes exactly; the
bad combinations raise on every rank before any collective. ``torch_topkadam``: the same for
``topkadam`` (its own launch entry), a bad ``ratio`` refused; in the same entry ``qsgdadam`` (its warm-up
sent as bf16: ``warmup_codec``; a bad ``levels`` refused) and ``topkadam`` with an fp16 warm-up.
Keras (2 workers, the shared TF launch): the same training with Keras SGD (momentum 0, decoupled
weight decay: AdamW's update on the exchanged direction), identical on every rank, resumed from a
checkpoint exactly; ``tf_topkadam`` the same for ``topkadam``.
"""

from __future__ import annotations

import copy

import numpy as np

from scenarios import kit
from scenarios.kit import guard

SPEC = "onebitadam:warmup_steps=3"
TOPKADAM_SPEC = "topkadam:warmup_steps=3,ratio=0.1"
# qsgdadam with its warm-up sent as bf16; topkadam with its warm-up sent as fp16 (warmup_codec)
QSGDADAM_SPEC = "qsgdadam:warmup_steps=3,levels=7,bucket=16,warmup_codec=bf16"
FP16_WARMUP_SPEC = "topkadam:warmup_steps=3,ratio=0.1,warmup_codec=fp16"
STEPS = 7
LR, WD = 0.01, 0.05


# -- PyTorch ------------------------------------------------------------------------------------------
def _torch_make(spec=SPEC):
    import torch
    import hvdcompress.torch as hvc
    from scenarios.kit import torch_mlp
    model = torch_mlp()
    opt = hvc.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.95)),
                                   named_parameters=model.named_parameters(), compression=spec, schedule="layerwise")
    return model, opt


def _torch_train(model, opt, first, last, record=None):
    import torch.nn as nn
    import horovod.torch as hvd
    from scenarios.kit import torch_batch, torch_identical
    identical, sent = [], []
    params = list(model.parameters())
    local = {}
    hooks = [p.register_hook(lambda g, i=i: local.__setitem__(i, g.detach().clone().numpy()))
             for i, p in enumerate(params)] if record is not None else []  # before any exchange writes back
    for step in range(first, last):
        opt.zero_grad()
        x, y = torch_batch(hvd.rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        if record is not None:
            record.append([local[i] for i in range(len(params))])
        opt.step()
        identical.append(torch_identical(model))
        sent.append(opt.stats.last_bytes)
    for h in hooks:
        h.remove()
    return identical, sent


def _torch_training(spec=SPEC):
    import horovod.torch as hvd
    from hvdcompress.reference import simulate
    from hvdcompress.reference.onebitadam import adamw_step
    model, opt = _torch_make(spec)
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach().clone().numpy() for p in model.parameters()]
    grads = []
    identical, sent = _torch_train(model, opt, 0, STEPS, record=grads)
    everyone = hvd.allgather_object(grads)
    diff = None
    if hvd.rank() == 0:  # replay with the oracle: every rank's gradients, the spec as taken over
        spec = opt.compression  # the spec with AdamW's betas and eps taken over
        states = {n: [{} for _ in everyone] for n in names}
        for step in range(STEPS):
            for i, n in enumerate(names):
                d, states[n], _ = simulate(spec, [r[step][i] for r in everyone], states[n], key=n, step=step,
                                           shape=params[i].shape)
                params[i] = adamw_step(params[i], d.reshape(params[i].shape), LR, WD)
        diff = max(float(np.abs(p.detach().numpy() - q).max()) for p, q in zip(model.parameters(), params))
    return {"identical": identical, "sent": sent, "oracle_diff": diff, "spec": str(opt.compression),
            "adam_state": len(opt.state_dict()["state"])}


def _torch_resume(spec=SPEC):
    import torch
    from scenarios.kit import torch_flat
    model, opt = _torch_make(spec)
    _torch_train(model, opt, 0, 4)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _torch_train(model, opt, 4, 7)
    model2, opt2 = _torch_make(spec)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    identical, _ = _torch_train(model2, opt2, 4, 7)
    state = saved_opt["hvdcompress"]["state"]
    return {"equal": bool(torch.equal(torch_flat(model), torch_flat(model2))), "identical": identical,
            "state": sorted({k for st in state.values() for k in st})}


def _refusals(cases) -> dict:
    """label -> the ValueError's message (None: accepted) of wrapping each case's optimizer with its spec."""
    import hvdcompress.torch as hvc
    from scenarios.kit import torch_mlp
    out = {}
    for label, (make, spec) in cases.items():
        try:
            hvc.DistributedOptimizer(make(torch_mlp().parameters()), compression=spec)
            out[label] = None
        except ValueError as e:
            out[label] = str(e)
    return out


def _torch_refused():
    import torch
    cases = {
        "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), SPEC),
        "amsgrad": (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), SPEC),
        "adam_l2": (lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.1), SPEC),
        "rmsprop": (lambda ps: torch.optim.RMSprop(ps, lr=0.1), SPEC),
        "dgc_adamw": (lambda ps: torch.optim.AdamW(ps, lr=0.1), "dgc:ratio=0.01"),
    }
    return _refusals(cases)


def torch_all() -> dict:
    import horovod.torch as hvd
    import torch
    torch.set_num_threads(1)
    hvd.init()
    out = {"training": guard(_torch_training), "resume": guard(_torch_resume), "refused": guard(_torch_refused)}
    out["after"] = float(hvd.allreduce(torch.ones(1), name="onebitadam.after", op=hvd.Sum))
    return out


def _topkadam_refused():
    import torch
    cases = {"ratio_zero": (lambda ps: torch.optim.AdamW(ps, lr=0.1), "topkadam:ratio=0"),
             "ratio_above_one": (lambda ps: torch.optim.AdamW(ps, lr=0.1), "topkadam:ratio=1.5"),
             "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), TOPKADAM_SPEC)}
    return _refusals(cases)


def _qsgdadam_refused():
    import torch
    cases = {"levels_zero": (lambda ps: torch.optim.AdamW(ps, lr=0.1), "qsgdadam:levels=0"),
             "warmup_codec": (lambda ps: torch.optim.AdamW(ps, lr=0.1), "qsgdadam:warmup_codec=int8"),
             "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), QSGDADAM_SPEC)}
    return _refusals(cases)


def _qsgdadam_payload(spec) -> int:
    """qsgd's payload of the MLP's float32 moments, tensor by tensor: what a step after the warm-up sends."""
    from hvdcompress import parse_spec
    from hvdcompress.registry import info_for
    from scenarios.kit import torch_mlp
    spec = parse_spec(spec)
    return int(sum(r.nbytes for p in torch_mlp().parameters() for r in info_for("qsgdadam").rounds(spec.params, p.numel())))


def torch_topkadam() -> dict:
    """topkadam (1-bit Adam's framework with top-k) through the same checks: AdamW taken over,
    identical every step and equal to the oracle's replay, the warm-up's dense bytes then topk's
    payload (``compressed``: the bytes each step after the warm-up should send), exact resume,
    a bad ratio and momentum SGD refused on every rank."""
    import horovod.torch as hvd
    import torch
    from hvdcompress import parse_spec
    from hvdcompress.spec import num_selected
    from scenarios.kit import torch_mlp
    torch.set_num_threads(1)
    hvd.init()
    ratio = parse_spec(TOPKADAM_SPEC)["ratio"]
    out = {"training": guard(_torch_training, TOPKADAM_SPEC), "resume": guard(_torch_resume, TOPKADAM_SPEC),
           "refused": guard(_topkadam_refused),
           "compressed": sum(num_selected(ratio, p.numel()) * 8 for p in torch_mlp().parameters()),
           "dense": sum(p.numel() * 4 for p in torch_mlp().parameters())}
    out["qsgdadam"] = {"training": guard(_torch_training, QSGDADAM_SPEC), "resume": guard(_torch_resume, QSGDADAM_SPEC),
                       "refused": guard(_qsgdadam_refused), "compressed": _qsgdadam_payload(QSGDADAM_SPEC)}
    out["fp16_warmup"] = {"training": guard(_torch_training, FP16_WARMUP_SPEC),
                          "resume": guard(_torch_resume, FP16_WARMUP_SPEC)}
    out["after"] = float(hvd.allreduce(torch.ones(1), name="topkadam.after", op=hvd.Sum))
    return out


# -- Keras --------------------------------------------------------------------------------------------
def _keras_make(spec=SPEC):
    import hvdcompress.keras as hvc
    import tensorflow as tf
    model = kit.keras_mlp()
    opt = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(LR, momentum=0.0, weight_decay=WD), compression=spec)
    model.compile(optimizer=opt, loss=kit.keras_loss())
    return model, opt


def _keras_training(tmp, text=SPEC):
    import os
    import hvdcompress.keras as hvc
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from hvdcompress import parse_spec
    from hvdcompress.reference import simulate
    model, opt = _keras_make(text)
    loss_fn = kit.keras_loss()
    params = [v.numpy().copy() for v in model.trainable_variables]
    path = os.path.join(tmp, f"{parse_spec(text).name}-rank{hvc.rank()}")
    identical, sent, grads = [], [], []
    for step in range(STEPS):
        if step == 4:
            model.save_weights(path)
        x, y = kit.np_batch(hvc.rank(), step)
        with tf.GradientTape() as tape:  # the local gradients, for the oracle's replay
            loss = loss_fn(y, model(x, training=True))
        grads.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
        model.train_on_batch(x, y)
        identical.append(kit.tf_identical(model))
        sent.append(opt.stats.last_bytes)
    straight = kit.tf_flat(model).numpy()
    everyone = hvd.allgather_object(grads)
    diff = None
    if hvc.rank() == 0:  # Keras SGD's decoupled decay, then the direction: AdamW's step
        spec, F = parse_spec(text), np.float32
        names = [v.name for v in model.trainable_variables]
        states = {n: [{} for _ in everyone] for n in names}
        for step in range(STEPS):
            for i, n in enumerate(names):
                d, states[n], _ = simulate(spec, [r[step][i] for r in everyone], states[n], key=str(i), step=step,
                                           shape=params[i].shape)  # key: the gradient's position, as Keras's
                p = params[i] - params[i] * F(WD) * F(LR)
                params[i] = (p - d.reshape(p.shape) * F(LR)).astype(F)
        diff = max(float(np.abs(v.numpy() - q).max()) for v, q in zip(model.trainable_variables, params))
    model2, opt2 = _keras_make(text)
    model2.load_weights(path)
    for step in range(4, STEPS):
        model2.train_on_batch(*kit.np_batch(hvc.rank(), step))
    resumed = kit.tf_flat(model2).numpy()
    return {"identical": identical, "sent": sent, "oracle_diff": diff,
            "resume": {"equal": bool(np.array_equal(straight, resumed)), "identical": kit.tf_identical(model2),
                       "state": sorted({k for s in opt2.gradient_compression.slots for k in s})}}


def _keras_refused():
    import hvdcompress.keras as hvc
    import tensorflow as tf
    out = {}
    cases = {"adam": (lambda: tf.keras.optimizers.Adam(0.1), SPEC),
             "sgd_momentum": (lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9), SPEC),
             "dgc_adam": (lambda: tf.keras.optimizers.Adam(0.1), "dgc:ratio=0.01")}
    for label, (make, spec) in cases.items():
        try:
            hvc.DistributedOptimizer(make(), compression=spec)
            out[label] = None
        except ValueError as e:
            out[label] = str(e)
    return out


def tf_all() -> dict:
    import tempfile
    import horovod.tensorflow as hvd
    import tensorflow as tf
    try:  # one thread, unless an earlier scenario of the shared launch already started TensorFlow
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    except RuntimeError:
        pass
    hvd.init()
    out = {"training": guard(_keras_training, tempfile.mkdtemp()), "refused": guard(_keras_refused)}
    out["after"] = float(hvd.allreduce(tf.ones([1]), name="onebitadam_after", op=hvd.Sum).numpy()[0])
    return out


def tf_topkadam() -> dict:
    """topkadam through the Keras checks of ``tf_all``: identical every step, the oracle's replay
    within float32 rounding, exact resume; a bad ratio refused on every rank. The same training
    for ``qsgdadam`` (bf16 warm-up) and ``topkadam`` with an fp16 warm-up."""
    import tempfile
    import horovod.tensorflow as hvd
    import hvdcompress.keras as hvc
    import tensorflow as tf
    try:
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    except RuntimeError:
        pass
    hvd.init()

    def refused():
        try:
            hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression="topkadam:ratio=0")
            return None
        except ValueError as e:
            return str(e)

    out = {"training": guard(_keras_training, tempfile.mkdtemp(), TOPKADAM_SPEC), "refused": refused(),
           "qsgdadam": guard(_keras_training, tempfile.mkdtemp(), QSGDADAM_SPEC)}
    if kit.extended():  # topkadam's Keras run above with the fp16 codec's exchange: both paths are the default suite's
        out["fp16_warmup"] = guard(_keras_training, tempfile.mkdtemp(), FP16_WARMUP_SPEC)
    out["after"] = float(hvd.allreduce(tf.ones([1]), name="topkadam_after", op=hvd.Sum).numpy()[0])
    return out
