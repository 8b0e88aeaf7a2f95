"""DGC on real training recipes, inside real Horovod workers (tests/test_dgc_recipes.py):
weight decay through the momentum, the two clipping scopes independent of the merge schedule,
checkpoints of both, and the refusals. One launch per backend runs every scenario of it.

DGC with everything sent (ratio 1, sample_ratio 1 so the sampled threshold takes every entry),
no warm-up and momentum masking off (masking at ratio 1 zeroes the momentum every step, by the
paper's design) is dense momentum SGD, up to float rounding: the setting of the equivalence checks.
"""

from __future__ import annotations

import copy
import os
from functools import partial

import numpy as np

from scenarios import kit

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

EVERYTHING = "dgc:ratio=1.0,sample_ratio=1.0,warmup_epochs=0,momentum_masking=false"
STEPS = 40

# fc1.weight / the first kernel: 1280 entries (DGC's sparse path); the 64x10 one and biases: dense path
MLP, ACTS = (20, 64, 10), ("relu",)
_batch = partial(kit.np_batch, classes=10)
_torch_model = partial(kit.torch_mlp, MLP, ACTS)
_tf_model = partial(kit.keras_mlp, MLP, ACTS)


# -- PyTorch ----------------------------------------------------------------------------------------
def _torch_make(spec, wd=0.0, nesterov=False, schedule="layerwise", **sgd):
    import torch
    import hvdcompress.torch as hvc
    model = _torch_model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": weights, "weight_decay": wd}, {"params": biases, "weight_decay": wd / 2}]
    opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=nesterov, **sgd)
    opt = hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=spec,
                                   schedule=schedule)
    return model, opt


def _torch_steps(model, opt, first, last) -> bool:
    """Train steps [first, last); True when every rank held the same parameters after each."""
    import torch
    import torch.nn.functional as F
    import hvdcompress.torch as hvc
    same = True
    for step in range(first, last):
        x, y = _batch(hvc.rank(), step)
        opt.zero_grad()
        F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
        same = kit.torch_identical(model, f"same.{step}") and same
    return same


def torch_weight_decay() -> dict:
    out = {}
    for nesterov in (False, True):
        for wd in (0.0, 5e-3):
            flats, same = {}, True
            for spec in ("none", EVERYTHING):
                model, opt = _torch_make(spec, wd=wd, nesterov=nesterov)
                same = _torch_steps(model, opt, 0, STEPS) and same
                flats[spec] = kit.torch_flat(model).numpy()
                if spec != "none":
                    taken = [[g["weight_decay"], g.get("hvc_weight_decay"), g["momentum"]] for g in opt.param_groups]
            out[f"nesterov={nesterov},wd={wd}"] = {
                "max_abs_diff": float(np.abs(flats["none"] - flats[EVERYTHING]).max()),
                "moved": float(np.abs(flats["none"] - kit.torch_flat(_torch_model()).numpy()).max()),
                "identical": same, "groups": taken}
    return out


def torch_clipping() -> dict:
    out = {}
    for scope in ("tensor", "global"):
        spec = f"{EVERYTHING},clip_norm=0.05,clip_scope={scope}"
        flats, groups, same = {}, {}, True
        for schedule in ("layerwise", "single", "size:0.003"):
            model, opt = _torch_make(spec, schedule=schedule)
            same = _torch_steps(model, opt, 0, 8) and same
            flats[schedule], groups[schedule] = kit.torch_flat(model).numpy(), len(opt.groups)
        ref = flats["layerwise"]
        out[scope] = {"equal": {s: bool(np.array_equal(ref, f)) for s, f in flats.items()},
                      "max_abs_diff": {s: float(np.abs(ref - f).max()) for s, f in flats.items()},
                      "groups": groups, "identical": same, "flat": ref.tolist()}
    model, opt = _torch_make(EVERYTHING)
    _torch_steps(model, opt, 0, 8)
    out["unclipped"] = kit.torch_flat(model).numpy().tolist()
    return out


def torch_resume() -> dict:
    """Global clipping's norm and the weight decay's momentum are checkpointed: a run resumed
    from a checkpoint continues bit-identically."""
    spec = "dgc:ratio=0.05,warmup_epochs=0,clip_norm=0.05,clip_scope=global,min_sparse_numel=256"
    model, opt = _torch_make(spec, wd=1e-3)
    _torch_steps(model, opt, 0, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _torch_steps(model, opt, 3, 6)
    model2, opt2 = _torch_make(spec, wd=1e-3)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    _torch_steps(model2, opt2, 3, 6)
    st = saved_opt["state"]
    return {"equal": bool(np.array_equal(kit.torch_flat(model).numpy(), kit.torch_flat(model2).numpy())),
            "saved_norm": saved_opt["hvdcompress"]["compressor"]["global_norm"]["norm"],
            "wd_momentum_saved": all("hvc_weight_decay_momentum" in s for s in st.values()) and len(st) == 4}


def _refused(make) -> str:
    try:
        make()
    except ValueError as e:
        return str(e)
    return "accepted"


def torch_refusals() -> dict:
    return {"dampening": _refused(lambda: _torch_make("dgc", dampening=0.1)),
            "maximize": _refused(lambda: _torch_make("dgc", wd=1e-4, maximize=True)),
            "sketch_dampening": _refused(lambda: _torch_make("sketch", dampening=0.5))}


def torch_all() -> dict:
    import torch
    import hvdcompress.torch as hvc
    torch.set_num_threads(1)
    hvc.init()
    out = {}
    for name, fn in (("weight_decay", torch_weight_decay), ("clipping", torch_clipping), ("resume", torch_resume),
                     ("refusals", torch_refusals)):
        out[name] = kit.guard(fn)
    hvc.shutdown()
    return out


# -- TensorFlow / Keras -----------------------------------------------------------------------------
def _tf_make(spec, schedule="layerwise", **sgd):
    import tensorflow as tf
    import hvdcompress.keras as hvc
    model = _tf_model()
    opt = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9, **sgd), compression=spec,
                                   schedule=schedule)
    model.compile(optimizer=opt, loss=kit.keras_loss())
    return model, opt


def _tf_steps(model, first, last) -> bool:
    import horovod.tensorflow as hvd
    same = True
    for step in range(first, last):
        model.train_on_batch(*_batch(hvd.rank(), step))
        same = kit.tf_identical(model, f"same.{step}") and same
    return same


# Keras cases of the default suite: weight decay and Nesterov each once (a Keras trace per case
# and process is the cost); the other two combinations in the extended tier. PyTorch runs all four.
TF_WEIGHT_DECAY_CASES = ((False, 5e-3), (True, None))


def tf_weight_decay() -> dict:
    out = {}
    cases = [(n, wd) for n in (False, True) for wd in (None, 5e-3)]
    for nesterov, wd in cases if kit.extended() else TF_WEIGHT_DECAY_CASES:
        flats, same = {}, True
        for spec in ("none", EVERYTHING):
            model, opt = _tf_make(spec, nesterov=nesterov, weight_decay=wd)
            same = _tf_steps(model, 0, STEPS) and same
            flats[spec] = kit.tf_flat(model).numpy()
            if spec != "none":
                config = opt.get_config()
                kept = [config.get("weight_decay"), config.get("momentum")]
        out[f"nesterov={nesterov},wd={wd}"] = {
            "max_abs_diff": float(np.abs(flats["none"] - flats[EVERYTHING]).max()),
            "moved": float(np.abs(flats["none"] - kit.tf_flat(_tf_model()).numpy()).max()),
            "identical": same, "config": kept}
    return out


def tf_clipping() -> dict:
    spec = f"{EVERYTHING},clip_norm=0.05,clip_scope=tensor"
    flats, same = {}, True
    for schedule in ("layerwise", "single"):
        model, _ = _tf_make(spec, schedule=schedule)
        same = _tf_steps(model, 0, 8) and same
        flats[schedule] = kit.tf_flat(model).numpy()
    model, _ = _tf_make(EVERYTHING)
    _tf_steps(model, 0, 8)
    return {"equal": bool(np.array_equal(flats["layerwise"], flats["single"])),
            "max_abs_diff": float(np.abs(flats["layerwise"] - flats["single"]).max()),
            "clipping_acts": float(np.abs(flats["layerwise"] - kit.tf_flat(model).numpy()).max()), "identical": same}


def tf_refusals() -> dict:
    return {key: _refused(lambda k=key: _tf_make("dgc", **{k: 1.0})) for key in ("clipnorm", "clipvalue",
                                                                               "global_clipnorm")} | {
        "global": _refused(lambda: _tf_make("dgc:clip_norm=1.0,clip_scope=global"))}


def tf_all() -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    out = {}
    for name, fn in (("weight_decay", tf_weight_decay), ("clipping", tf_clipping), ("refusals", tf_refusals)):
        out[name] = kit.guard(fn)
    hvd.shutdown()
    return out
