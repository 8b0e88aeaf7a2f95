"""Worker code for tests/test_contract.py: the toy algorithm trained through the real optimizer,
and every collective on a process set smaller than the job (a rank outside the set runs none of
the set's collectives and must not make them wait)."""

from __future__ import annotations

import copy
import os
import traceback
from functools import partial

from scenarios import kit

_torch_model = partial(kit.torch_mlp, (12, 16, 3), ("relu",))
_torch_batch = partial(kit.torch_batch, n=8, features=12, classes=3, stride=100)


def _torch_train(spec, steps, schedule="auto", process_set=None, model=None, opt=None, first=0, **kw):
    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    import hvdcompress.torch as hvc
    if model is None:
        model = _torch_model()
        opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=spec,
                                       schedule=schedule, process_set=process_set, **kw)
        if process_set is None:  # (Horovod 0.28's broadcast_parameters has no process_set; the
            hvc.broadcast_parameters(model.state_dict(), root_rank=0)  # seeded model is the same anyway)
    identical = []
    for step in range(first, first + steps):
        opt.zero_grad()
        x, y = _torch_batch(hvd.rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        identical.append(kit.torch_identical(model, process_set=process_set))
    return model, opt, identical


def toy_training() -> dict:
    """The toy algorithm (tests/toy_algorithm: oracle + one module per backend, nothing else)
    through the real DistributedOptimizer with its default schedule, the toy on every tensor
    (``codec_choice="off"``: the choice would send the other tensors merged, in fp16 or dense)."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc
    import toy_algorithm.reference_toy  # noqa: F401  (declares the algorithm)
    import toy_algorithm.torch_toy  # noqa: F401  (registers the PyTorch implementation)
    hvd.init()
    try:
        model, opt, identical = _torch_train(hvc.Compression.toysign(gain=0.5), 4, codec_choice="off")
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        _, _, _ = _torch_train(None, 2, model=model, opt=opt, first=4)
        straight = kit.torch_flat(model)
        model2 = _torch_model()
        opt2 = hvc.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9),
                                        named_parameters=model2.named_parameters(), compression="toysign:gain=0.5",
                                        codec_choice="off")
        model2.load_state_dict(saved[0])
        opt2.load_state_dict(saved[1])
        _torch_train(None, 2, model=model2, opt=opt2, first=4)
        out = {"identical": identical, "groups": opt.groups, "stats": opt.stats.as_dict(),
               "calls": {k: float(v["calls"]) for k, v in opt.state_dict()["hvdcompress"]["state"].items()},
               "resumed_equal": bool(torch.equal(straight, kit.torch_flat(model2)))}
    except Exception:
        out = {"error": traceback.format_exc()}
    hvd.shutdown()
    return out


def dgc_default_warmup() -> dict:
    """The default DGC spec and no set_epoch call: the warm-up counts epochs of steps and reaches
    the asked ratio; stats report the density in use."""
    import warnings
    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    import hvdcompress.torch as hvc
    hvd.init()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
        opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       compression="dgc:ratio=0.01,warmup_epoch_steps=2,min_sparse_numel=256",
                                       schedule="layerwise")
        densities, sent = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(12):
                opt.zero_grad()
                x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * hvd.rank() + step))
                nn.CrossEntropyLoss()(model(x), x[:, :3].argmax(1)).backward()
                opt.step()
                densities.append(opt.stats.as_dict()["density"])
                sent.append(opt.stats.last_bytes)
        out = {"densities": densities, "sent": sent, "epoch": opt.epoch, "identical": kit.torch_identical(model),
               "warnings": sum("set_epoch() was not called" in str(w.message) for w in caught)}
    except Exception:
        out = {"error": traceback.format_exc()}
    hvd.shutdown()
    return out


def _outside_the_set(ps) -> dict:
    """On a rank outside ``ps``: our optimizer and Horovod's on ``ps``, side by side on the same
    model and batches; as Horovod's, ours exchanges nothing and steps the wrapped optimizer (SGD
    with its momentum: DGC would take it over on a rank in the set) on the local gradients, also
    after ``synchronize()`` / ``skip_synchronize()`` as in Horovod's gradient-clipping recipe."""
    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    import hvdcompress.torch as hvc
    models = {"ours": _torch_model(), "horovod": _torch_model()}
    opts = {"ours": hvc.DistributedOptimizer(
                torch.optim.SGD(models["ours"].parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                named_parameters=models["ours"].named_parameters(), compression="dgc:ratio=0.3",
                process_set=ps),
            "horovod": hvd.DistributedOptimizer(
                torch.optim.SGD(models["horovod"].parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                named_parameters=models["horovod"].named_parameters(), process_set=ps)}
    same = []
    for step in range(4):
        for key, model in models.items():
            opt = opts[key]
            opt.zero_grad()
            x, y = _torch_batch(hvd.rank(), step)
            nn.CrossEntropyLoss()(model(x), y).backward()
            if step == 3:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        same.append(bool(torch.equal(kit.torch_flat(models["ours"]), kit.torch_flat(models["horovod"]))))
    opts["ours"].flush()
    return {"same": same, "momentum": opts["ours"].param_groups[0]["momentum"],
            "moved": float((kit.torch_flat(models["ours"]) - kit.torch_flat(_torch_model())).abs().max()),
            "saved": sorted(opts["ours"].state_dict())}


def process_set_torch() -> dict:
    """3 ranks, the optimizer on ProcessSet([0, 1]); rank 2 takes no part in its collectives.
    Layerwise, then a cost-model schedule that profiles the transport (fresh cache) and plans;
    rank 2 meanwhile steps optimizers on the set locally (``_outside_the_set``)."""
    import horovod.torch as hvd
    ps = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[ps])
    out = {}
    try:
        if ps.included():
            _, opt, ident = _torch_train("topk:ratio=0.3", 3, schedule="layerwise", process_set=ps)
            out["layerwise"] = ident
            _, opt, ident = _torch_train("topk:ratio=0.3", 6, schedule="mgs", process_set=ps, profile_steps=2)
            out["mgs"] = ident
            out["plan"] = None if opt.plan is None else opt.plan.schedule
            out["world"] = opt.cost_model.world_size if opt.cost_model is not None else None
        else:
            out["outside"] = _outside_the_set(ps)
        kit.torch_meet("meet.again")  # all three ranks meet again: nothing hung
        out["done"] = True
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out



def process_set_tf() -> dict:
    """The same on TensorFlow: a tape and a Keras optimizer on ProcessSet([0, 1]) of 3 ranks."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf
    import hvdcompress.tensorflow as hvc
    from hvdcompress.schedule.costmodel import CostModel
    from hvdcompress.schedule.groups import process_set_size
    ps = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[ps])
    out = {}
    try:
        if ps.included():
            process_set_size(ps)  # Horovod registers static sets in its background thread: wait for it
            tf.random.set_seed(0)
            model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu", input_shape=(12,)),
                                         tf.keras.layers.Dense(3)])
            init = np.random.default_rng(0)  # the same initial weights on every rank
            model.set_weights([(init.standard_normal(w.shape) * 0.3).astype(np.float32) for w in model.get_weights()])
            opt = tf.keras.optimizers.SGD(0.05)
            results = {}
            for schedule, kw in (("layerwise", {}), ("single", {}),
                                 ("mgwfbp", {"cost_model": CostModel.from_link(2, gbit_per_s=1.0, latency_s=5e-5)})):
                comp = hvc.GradientCompression("topk:ratio=0.3", name=f"ps_{schedule}", schedule=schedule, **kw)
                same = []
                for step in range(3):
                    rng = np.random.default_rng(100 * hvd.rank() + step)
                    x = tf.constant(rng.standard_normal((8, 12)), tf.float32)
                    y = tf.argmax(x[:, :3], axis=1)
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                            y, model(x), from_logits=True))
                    tape = hvc.DistributedGradientTape(tape, compression=comp, process_set=ps)
                    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                            model.trainable_variables))
                    same.append(kit.tf_identical(model, f"check.{schedule}.{step}", process_set=ps))
                results[schedule] = same
            out.update(results)
        hvd.allreduce(tf.zeros(1), name="meet.again")  # all three ranks meet again: nothing hung
        out["done"] = True
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


if __name__ == "__main__":  # under horovodrun: python contract.py <scenario> <out dir>
    import json
    import sys
    result = globals()[sys.argv[1]]()
    import horovod.tensorflow as _hvd  # noqa: F401  (rank from the environment horovodrun set)
    with open(os.path.join(sys.argv[2], f"rank{os.environ.get('HOROVOD_RANK', '0')}.json"), "w") as f:
        json.dump(result, f)
