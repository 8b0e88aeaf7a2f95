"""Code that runs inside real Horovod workers for the quantizers and PowerSGD (launched by
tests/test_quantizers_multiprocess.py): one launch per backend, every scenario in it, plain data
back. Parameters are compared across ranks bit for bit (allgathered) after every step."""

from __future__ import annotations

import copy
import os
import tempfile
import time
import traceback

from scenarios import kit

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

SPECS = ["signsgd", "efsignsgd", "onebit", "terngrad:bucket=100", "qsgd:levels=3,bucket=64", "powersgd:rank=2",
         "terngrad:share_scale=true,bucket=100,residual=true"]
# TF on 3 workers (each compressor costs a Keras trace per process, 3 processes on the CI's 2
# cores): one per exchange kind -- signSGD's vote (gathered, odd world), QSGD (gathered, stochastic
# rounding), PowerSGD (summed, two rounds, state Q), TernGrad with its shared scale (a max round,
# then gathered; residual). efsignsgd, onebit and terngrad:bucket=100 run on 3 workers in PyTorch
# and on 2 in TF.
TF3_SPECS = ["signsgd", "qsgd:levels=3,bucket=64", "powersgd:rank=2",
             "terngrad:share_scale=true,bucket=100,residual=true"]
# resume bit-identical: every new compressor on 2 workers (state: residuals, PowerSGD's Q, and the
# step counter that seeds the stochastic rounding), the stateful ones on 3
RESUME = {2: ["powersgd:rank=2", "efsignsgd", "onebit", "signsgd", "qsgd:levels=3,bucket=64",
              "terngrad:share_scale=true,bucket=100,residual=true"],
          3: ["powersgd:rank=2", "terngrad:share_scale=true,bucket=100,residual=true"]}
# TF: the Keras resumes ride on the training runs (``_keras_one``); the tape path, which traces two
# functions of its own, takes the cheaper-to-trace signSGD and TernGrad (residual, shared scale).
TF_RESUME = {2: [("keras", "powersgd:rank=2"), ("keras", "efsignsgd"), ("keras", "onebit"), ("tape", "signsgd"),
                 ("keras", "qsgd:levels=3,bucket=64"), ("tape", "terngrad:share_scale=true,bucket=100,residual=true")],
             3: [("keras", "powersgd:rank=2"), ("tape", "terngrad:share_scale=true,bucket=100,residual=true")]}
# TF on 2 workers in the default suite: the exchange kinds of TF3_SPECS. efsignsgd and onebit (signs
# gathered as signSGD's, with their own state) and TernGrad without the shared scale repeat those
# exchanges; their TF state and arithmetic are checked against the oracle in one process
# (tests/test_quantizers.py) and on 2 and 3 real workers in PyTorch. HVDC_EXTENDED_TESTS=1 trains
# (and resumes) them on 2 TF workers too.
TF_EXTENDED_ONLY = ("efsignsgd", "onebit", "terngrad:bucket=100")


def tf_specs(world: int):
    """The specs the TF launch of ``world`` workers trains (``tf_everything``)."""
    if world != 2:
        return list(TF3_SPECS)
    return [s for s in SPECS if kit.extended() or s not in TF_EXTENDED_ONLY]


# signSGD keeps no compression state but the step: its tape resume repeats the tape checkpoint path
# TernGrad's resume runs (with a residual) and tf_core's DGC resume (tests/test_tf_multiprocess.py);
# PyTorch resumes signSGD on 2 workers. Extended tier (two traces per TF process).
TF_RESUME_EXTENDED_ONLY = (("tape", "signsgd"),)


def tf_resume(world: int):
    """``(kind, spec)`` of the TF resume checks in the launch of ``world`` workers."""
    return [(k, s) for k, s in TF_RESUME[world]
            if kit.extended() or (s not in TF_EXTENDED_ONLY and (k, s) not in TF_RESUME_EXTENDED_ONLY)]


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
            total += payload_bytes(spec.name, spec.params, numel, shape=shape)
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
    from scenarios.kit import torch_batch as _batch, torch_identical as _identical_across_ranks
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
    from scenarios.kit import torch_mlp as _model
    model = _model()
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=spec,
                                   schedule=schedule)
    return model, opt


def _torch_one(spec, schedule="layerwise"):
    import horovod.torch as hvd
    from scenarios.kit import torch_flat as _flat, torch_mlp as _model
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
    from scenarios.kit import torch_flat as _flat
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
            "max_diff": float((_flat(model) - _flat(model2)).abs().max()),
            "state": sorted({k for st in state.values() for k in st})}


INTEROP = ("none", "fp16", "bf16")  # the specs Horovod's own optimizers can run (horovod_interop)


def tf_interop():
    """The specs run inside Horovod's own Keras optimizer: fp16 (a codec that changes the payload,
    through the compress/decompress hooks every spec takes there); ``none`` and bf16 (float32 on the
    wire, its rounding checked on TF tensors by test_quantizers.py's protocol test) too in the
    extended tier (PyTorch runs all three). Each costs two Keras traces per process."""
    return [n for n in INTEROP if kit.extended() or n == "fp16"]

TIE = {0: [1.0, -1.0, 1.0, 0.0, -2.0], 1: [-1.0, -1.0, 1.0, 5.0, 2.0], 2: [1.0, 1.0, -1.0, 0.0, 3.0]}
VOTE = {2: [0.0, -1.0, 1.0, 1.0, 0.0], 3: [1.0, -1.0, 1.0, 1.0, 1.0]}  # sign of the vote: ties -> 0


def _torch_interop_one(name, op_name="Average"):
    """Horovod's own optimizer with ``hvc.Compression.<name>``, next to ours with the same spec:
    identical ranks after every step, and the same parameters as ours at the end."""
    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    import hvdcompress.torch as hvc
    from scenarios.kit import (
        torch_batch as _batch,
        torch_flat as _flat,
        torch_identical as _identical_across_ranks,
        torch_mlp as _model,
    )
    flats, identical = {}, []
    for who in ("horovod", "ours"):
        model = _model()
        sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        compression = getattr(hvc.Compression, name)
        op = getattr(hvd, op_name)
        if who == "horovod":
            opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression,
                                           op=op)
        else:
            opt = hvc.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression,
                                           schedule="layerwise", op=op)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(hvd.rank(), step)
            nn.CrossEntropyLoss()(model(x), y).backward()
            opt.step()
            if who == "horovod":
                identical.append(_identical_across_ranks(model))
        flats[who] = _flat(model)
    payload, _ = getattr(hvc.Compression, name).compress(torch.ones(3))
    return {"identical": identical, "equal_to_ours": bool(torch.equal(flats["horovod"], flats["ours"])),
            "max_diff": float((flats["horovod"] - flats["ours"]).abs().max()), "payload": str(payload.dtype),
            "moved": float((flats["horovod"] - _flat(_model())).abs().max())}


def _torch_fp16_average_rounding():
    """Why Horovod's fp16 Average can differ from ours in the last bit of tiny values: Horovod
    scales the half-precision sum by 1/size in half precision, we scale it in float32. Two ranks
    send the fp16 subnormals 2**-24 and 2 * 2**-24: Horovod's average is 1.5 * 2**-24 rounded to
    half (ties to even: 2**-23), ours is 1.5 * 2**-24."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc
    x = torch.tensor([2.0 ** -24 * (hvd.rank() + 1)])
    got = hvd.allreduce(x, op=hvd.Average, compression=hvc.Compression.fp16, name="q.fp16.average")
    return {"horovod": float(got), "ours": float(torch.tensor([3 * 2.0 ** -24], dtype=torch.float16).float() * 0.5)}


def _torch_interop_refused():
    """A spec Horovod's protocol cannot carry raises in the first gradient hook, on every rank,
    before Horovod launched any collective."""
    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    import hvdcompress.torch as hvc
    from scenarios.kit import torch_batch as _batch, torch_mlp as _model
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   compression=hvc.Compression.topk(ratio=0.01))
    try:
        nn.CrossEntropyLoss()(model(_batch(hvd.rank(), 0)[0]), _batch(hvd.rank(), 0)[1]).backward()
        return {"raised": None}
    except ValueError as e:
        return {"raised": str(e)}


def _torch_tie():
    """signSGD's vote on real workers: a parameter whose gradient is rank r's row of TIE (plain
    SGD, lr 1): the update is -sign(sum of the ranks' signs), 0 where an even world ties."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc
    w = torch.nn.Parameter(torch.zeros(5))
    opt = hvc.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)], compression="signsgd")
    opt.zero_grad()
    (w * torch.tensor(TIE[hvd.rank()])).sum().backward()
    opt.step()
    return {"update": (-w.detach()).tolist()}


def _torch_momentum_inside():
    """efsignsgd wrapped around SGD(momentum=0.9, nesterov=True), through the real optimizer: the
    momentum is taken over (the wrapped SGD runs with 0) and applied before compression, so every
    step's exchanged gradient is the oracle's ``efsignsgd:momentum=0.9,nesterov=true`` on the ranks'
    gradients, bit for bit; parameters identical on every rank; the velocity u, as the oracle's,
    in the optimizer's checkpoint. The loss sum(w * c[rank, step]) makes every rank's gradient
    c[rank, step], known to all ranks without a collective."""
    import horovod.torch as hvd
    import numpy as np
    import torch
    import hvdcompress.torch as hvc
    from hvdcompress import parse_spec
    from hvdcompress.reference import simulate
    from scenarios.kit import torch_identical as _identical_across_ranks
    world, shape = hvd.size(), (6, 5)
    model = torch.nn.Linear(5, 6, bias=False)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, nesterov=True),
                                   named_parameters=[("w", model.weight)], compression="efsignsgd")

    def coef(rank, step):
        return np.random.default_rng(100 * step + rank).standard_normal(shape).astype(np.float32)

    oracle, states = parse_spec("efsignsgd:momentum=0.9,nesterov=true"), [{} for _ in range(world)]
    exact, identical = [], []
    for step in range(STEPS):
        opt.zero_grad()
        (model.weight * torch.from_numpy(coef(hvd.rank(), step))).sum().backward()
        opt.step()
        want, _, _ = simulate(oracle, [coef(r, step) for r in range(world)], states, key="w", step=step, shape=shape)
        exact.append(bool(np.array_equal(model.weight.grad.numpy().reshape(-1), want)))
        identical.append(_identical_across_ranks(model))
    saved = opt.state_dict()["hvdcompress"]["state"]
    (u,) = [st["u"] for st in saved.values() if "u" in st]
    return {"exact": exact, "identical": identical, "group_momentum": opt.param_groups[0]["momentum"],
            "state": sorted({k for st in saved.values() for k in st}),
            "u_equal": bool(np.array_equal(u.reshape(-1).numpy(), states[hvd.rank()]["u"]))}


def torch_everything() -> dict:
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc
    torch.set_num_threads(1)
    hvd.init()
    world = hvd.size()
    out = {"world": world, "train": {}, "auto": {}, "resume": {}, "bad": {}, "interop": {}}
    for spec in SPECS:
        out["train"][spec] = _guard(_torch_one, spec)
    if world == 2:
        for spec in ("qsgd:levels=3,bucket=64", "powersgd:rank=2"):  # the default schedule
            out["auto"][spec] = _guard(_torch_one, spec, "auto")
    for spec in RESUME[world]:
        out["resume"][spec] = _guard(_torch_resume, spec)
    out["tie"] = _guard(_torch_tie)
    if world == 2:  # Horovod's own optimizer with our specs
        for name in INTEROP:
            out["interop"][name] = _guard(_torch_interop_one, name)
        out["interop"]["fp16 op=Sum"] = _guard(_torch_interop_one, "fp16", "Sum")
        out["fp16_average_rounding"] = _guard(_torch_fp16_average_rounding)
        out["refused"] = _guard(_torch_interop_refused)
        out["momentum_inside"] = _guard(_torch_momentum_inside)
    from scenarios.kit import torch_mlp as _model
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
def _keras_one(spec, resume_to=None):
    """STEPS Keras steps: identical ranks and the declared bytes after every step. With
    ``resume_to`` (a path prefix), this run is also the straight run of the Keras resume check
    (TensorFlow traces each model's step once per process: the costly part of these runs): the
    weights (optimizer and compression state included) saved after step 2 are loaded into a fresh
    model, which repeats steps 2-3; returned as ``_tf_resume`` returns it."""
    import hvdcompress.keras as hvc
    import numpy as np
    from scenarios.tf_core import _keras
    from scenarios.kit import (
        np_batch as _batch,
        tf_flat as _flat,
        tf_identical as _identical,
        keras_mlp as _model,
    )
    model, opt, _ = _keras(spec, momentum=0.9)
    start = _flat(_model()).numpy()
    identical, sent = [], []
    path = f"{resume_to}-{spec.split(':')[0]}-rank{hvc.rank()}" if resume_to else None
    for step in range(STEPS):
        if path and step == 2:
            model.save_weights(path)
        opt.gradient_compression.set_epoch(step)  # as _tf_resume's runs (epoch_every=1)
        model.train_on_batch(*_batch(hvc.rank(), step))
        identical.append(_identical(model))
        sent.append(opt.stats.last_bytes)
    out = {"identical": identical, "sent": sent,
           "expected": expected_bytes(spec, [tuple(v.shape) for v in model.trainable_variables]),
           "moved": float(abs(_flat(model).numpy() - start).max())}
    if path:
        straight = _flat(model).numpy()
        model2, opt2, run2 = _keras(spec, momentum=0.9, epoch_every=1)
        model2.load_weights(path)
        run2(2, STEPS)
        resumed = _flat(model2).numpy()
        out["resume"] = {"equal": bool(np.array_equal(straight, resumed)), "identical": [_identical(model2)],
                         "max_diff": float(np.abs(straight - resumed).max()),
                         "state": sorted({k for s in opt2.gradient_compression.slots for k in s})}
    return out


def _tf_resume(kind, spec, tmp):
    import hvdcompress.tensorflow as hvc
    import numpy as np
    import tensorflow as tf
    from scenarios.tf_core import _keras, _tape
    from scenarios.kit import tf_flat as _flat, tf_identical as _identical
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
            "max_diff": float(np.abs(straight - _flat(model2).numpy()).max()),
            "state": sorted({k for s in comp2.slots for k in s})}


def _tf_interop_one(name):
    """``horovod.tensorflow.keras.DistributedOptimizer`` with ``hvc.Compression.<name>``, next to
    ours (``hvdcompress.keras``) with the same spec: identical ranks, the same parameters."""
    import horovod.tensorflow.keras as hvdk
    import numpy as np
    import tensorflow as tf
    import hvdcompress.keras as hvc
    from scenarios.kit import (
        np_batch as _batch,
        tf_flat as _flat,
        tf_identical as _identical,
        keras_loss as _loss,
        keras_mlp as _model,
    )
    flats, identical = {}, []
    for who in ("horovod", "ours"):
        model = _model()
        sgd = tf.keras.optimizers.SGD(LR, momentum=0.9)
        compression = getattr(hvc.Compression, name)
        make = hvdk.DistributedOptimizer if who == "horovod" else hvc.DistributedOptimizer
        model.compile(optimizer=make(sgd, compression=compression), loss=_loss())
        for step in range(STEPS):
            model.train_on_batch(*_batch(hvc.rank(), step))
            if who == "horovod":
                identical.append(_identical(model))
        flats[who] = _flat(model).numpy()
    payload, _ = getattr(hvc.Compression, name).compress(tf.ones([3]))
    return {"identical": identical, "equal_to_ours": bool(np.array_equal(flats["horovod"], flats["ours"])),
            "max_diff": float(abs(flats["horovod"] - flats["ours"]).max()), "payload": payload.dtype.name,
            "moved": float(abs(flats["horovod"] - _flat(_model()).numpy()).max())}


def _tf_interop_refused():
    import horovod.tensorflow.keras as hvdk
    import tensorflow as tf
    import hvdcompress.keras as hvc
    from scenarios.kit import np_batch as _batch, keras_loss as _loss, keras_mlp as _model
    model = _model()
    model.compile(optimizer=hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(LR),
                                                      compression=hvc.Compression.qsgd), loss=_loss())
    try:
        model.train_on_batch(*_batch(hvc.rank(), 0))
        return {"raised": None}
    except ValueError as e:
        return {"raised": str(e)}


def _tf_tie():
    import numpy as np
    import tensorflow as tf
    import hvdcompress.tensorflow as hvc
    w = tf.Variable(tf.zeros([5]))
    comp = hvc.GradientCompression("signsgd")
    sgd = tf.keras.optimizers.SGD(1.0)
    sgd.build([w])  # its slots now: made in the step's first trace, they would trace it twice

    @tf.function
    def step(g):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * g)
        tape = hvc.DistributedGradientTape(tape, compression=comp)
        sgd.apply_gradients(zip(tape.gradient(loss, [w]), [w]))

    step(tf.constant(TIE[hvc.rank()]))
    return {"update": (-np.asarray(w.numpy(), np.float64)).tolist()}


def tf_everything() -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    import hvdcompress.keras as hvc
    world = hvd.size()
    out = {"world": world, "train": {}, "resume": {}, "bad": {}, "interop": {}}
    tmp = tempfile.mkdtemp()
    keras_resume = {spec for kind, spec in tf_resume(world) if kind == "keras"}
    for spec in tf_specs(world):
        out["train"][spec] = got = _guard(_keras_one, spec, os.path.join(tmp, "train") if spec in keras_resume else None)
        if spec in keras_resume:  # the Keras resume check rode on this run
            out["resume"][spec] = got.pop("resume") if "resume" in got else got
    for kind, spec in tf_resume(world):
        if kind == "tape":
            out["resume"][spec] = _guard(_tf_resume, kind, spec, tmp)
    out["tie"] = _guard(_tf_tie)
    if world == 2:  # Horovod's own Keras optimizer with our specs
        for name in tf_interop():
            out["interop"][name] = _guard(_tf_interop_one, name)
        out["refused"] = _guard(_tf_interop_refused)
    for label, text in BAD.items():
        try:
            hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=text)
            out["bad"][label] = None
        except ValueError as e:
            out["bad"][label] = str(e)
    out["after"] = float(hvd.allreduce(tf.ones([1]), name="q_after", op=hvd.Sum).numpy()[0])
    hvd.shutdown()
    return out
