"""The pieces every scenario builds on: a small seeded model, a rank- and step-dependent batch,
the parameters as one flat vector, and the check that every rank holds the same parameters.

PyTorch (``torch_*``) and TensorFlow/Keras (``keras_*``, ``tf_*``) versions build the same kind
of thing from the same arguments. A scenario module states its own sizes (``MLP = (20, 32, 32, 4)``)
and seeds; the defaults here are the standard ones (``torch_core``/``tf_core``). Frameworks are
imported inside the functions, so a PyTorch worker never imports TensorFlow and the reverse.

Identical parameters are checked bit for bit: every rank's flat vector is allgathered and compared
with rank 0's, so the check is itself a collective that every rank of the set must call.
"""

from __future__ import annotations

import os
import traceback

STANDARD_MLP = (20, 32, 32, 4)  # in, hidden..., out
STANDARD_ACTS = ("relu", "tanh")  # after the first, second, ... hidden layer


def extended() -> bool:
    """True in the extended tier (``HVDC_EXTENDED_TESTS=1``, ``make test-full``): scenarios then also
    run the cases that repeat an exchange the default suite covers (workers inherit the variable)."""
    return os.environ.get("HVDC_EXTENDED_TESTS", "") == "1"


def guard(fn, *args):
    """``fn(*args)``, or ``{"error": traceback}`` if it raised: a worker reports its failure as data
    instead of leaving the other ranks waiting in the next collective."""
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


# -- PyTorch --------------------------------------------------------------------------------------
def torch_mlp(sizes=STANDARD_MLP, acts=STANDARD_ACTS, seed=0):
    """``nn.Sequential`` of Linear layers ``sizes[0] -> ... -> sizes[-1]``, ``acts[i]`` after the
    i-th hidden layer (module indices 0, 2, 4, ... for the Linears), initialized from ``seed``."""
    import torch
    import torch.nn as nn
    kinds = {"relu": nn.ReLU, "tanh": nn.Tanh}
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        if i:
            layers.append(kinds[acts[i - 1]]())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def torch_batch(rank, step, n=16, features=20, classes=4, stride=1000):
    """``n`` Gaussian inputs seeded by ``stride * rank + step`` (different on every rank and step)
    and the label each one's largest of its first ``classes`` features names."""
    import torch
    g = torch.Generator().manual_seed(stride * rank + step)
    x = torch.randn(n, features, generator=g)
    return x, x[:, :classes].argmax(1)


def torch_flat(model):
    """Every parameter of ``model``, flattened and concatenated in ``parameters()`` order."""
    import torch
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def torch_meet(name, poll_s=0.01) -> None:
    """Every rank of the job meets here, waiting without using a core: a 1-element allreduce,
    polled with sleeps. ``hvd.barrier()`` (like ``hvd.synchronize``) busy-waits in Horovod's
    ``WaitAndClear`` (a loop of ``std::this_thread::yield()``), so a rank that waits long there --
    one outside a process set, while the set trains -- holds a whole core that the ranks it waits
    for, and every rank's Horovod background thread, then lack on a 2-core machine."""
    import time

    import horovod.torch as hvd
    import torch
    handle = hvd.allreduce_async(torch.zeros(1), name=name)
    while not hvd.poll(handle):
        time.sleep(poll_s)
    hvd.synchronize(handle)


def torch_identical(model, name="check.params", process_set=None) -> bool:
    """True when every rank (of ``process_set``, else of the job) holds bit-identical parameters."""
    import horovod.torch as hvd
    import torch
    kw = {} if process_set is None else {"process_set": process_set}
    rows = hvd.allgather(torch_flat(model).unsqueeze(0), name=name, **kw)
    return bool(all(torch.equal(rows[0], r) for r in rows))


# -- TensorFlow / Keras ---------------------------------------------------------------------------
def keras_mlp(sizes=STANDARD_MLP, acts=STANDARD_ACTS, seed=0):
    """The Keras counterpart of ``torch_mlp``: Dense layers, ``acts[i]`` on the i-th hidden one."""
    import tensorflow as tf
    tf.keras.utils.set_random_seed(seed)
    layers = []
    for i, width in enumerate(sizes[1:]):
        kw = {"activation": acts[i]} if i < len(sizes) - 2 else {}
        if i == 0:
            kw["input_shape"] = (sizes[0],)
        layers.append(tf.keras.layers.Dense(width, **kw))
    return tf.keras.Sequential(layers)


def np_batch(rank, step, n=16, features=20, classes=4, stride=1000):
    """``torch_batch``'s counterpart in numpy (float32 inputs, int labels), for Keras and TF."""
    import numpy as np
    rng = np.random.default_rng(stride * rank + step)
    x = rng.standard_normal((n, features)).astype(np.float32)
    return x, x[:, :classes].argmax(1)


def keras_loss():
    import tensorflow as tf
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def tf_flat(model_or_variables):
    """A model's trainable variables (or the given variables), flattened and concatenated."""
    import tensorflow as tf
    variables = getattr(model_or_variables, "trainable_variables", model_or_variables)
    return tf.concat([tf.reshape(v, [-1]) for v in variables], 0)


def tf_gather_flat(model_or_variables, name="check_params", process_set=None):
    """Every rank's ``tf_flat`` (of ``process_set``, else of the job), one row per rank (numpy)."""
    import horovod.tensorflow as hvd
    kw = {} if process_set is None else {"process_set": process_set}
    return hvd.allgather(tf_flat(model_or_variables)[None], name=name, **kw).numpy()


def tf_identical(model_or_variables, name="check_params", finite=False, process_set=None) -> bool:
    """True when every rank holds bit-identical variables (and, with ``finite``, all finite)."""
    import numpy as np
    rows = tf_gather_flat(model_or_variables, name, process_set)
    if finite and not np.isfinite(rows).all():
        return False
    return bool(all(np.array_equal(rows[0], r) for r in rows))


# -- elastic ----------------------------------------------------------------------------------------
# The elastic workers train 2 ranks, then rank 0 adds a host (a third worker joins), and once that
# worker took part in STEPS_AT_THREE steps it removes it again; the run ends STEPS_AFTER steps
# later, or at CAP steps if the job never reached a phase (the test then fails on the sizes seen).
ELASTIC_ADD_AT, ELASTIC_STEPS_AT_THREE, ELASTIC_STEPS_AFTER, ELASTIC_CAP = 3, 3, 3, 300
HOSTS_TWO, HOSTS_THREE = "localhost:2\n", "localhost:2\n127.0.0.1:1\n"


def write_hosts(out_dir, text):
    """Replace OUT_DIR/hosts atomically: the discovery script may read it at any moment."""
    import os
    tmp = os.path.join(out_dir, "hosts.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out_dir, "hosts"))


def elastic_finished(state) -> bool:
    return state.step >= ELASTIC_CAP or (state.phase == "back" and state.after >= ELASTIC_STEPS_AFTER)


def elastic_advance(state, size, rank, out_dir):
    """One step of the two -> adding -> three -> removing -> back plan on ``state`` (an elastic
    State with ``step``, ``phase``, ``at_three``, ``after``), after ``state.step`` was counted.
    Rank 0 edits the host file; the others follow through ``size``."""
    import time
    if state.phase == "two" and state.step >= ELASTIC_ADD_AT:
        state.phase = "adding"
        if rank == 0:
            write_hosts(out_dir, HOSTS_THREE)
    elif state.phase == "adding" and size == 3:
        state.phase = "three"
    elif state.phase == "three":
        state.at_three += 1
        if state.at_three >= ELASTIC_STEPS_AT_THREE:
            state.phase = "removing"
            if rank == 0:
                write_hosts(out_dir, HOSTS_TWO)
    elif state.phase == "removing" and size == 2:
        state.phase = "back"
    elif state.phase == "back":
        state.after += 1
    if state.phase in ("adding", "removing"):
        time.sleep(0.2)  # give the driver time to notice the host change


def elastic_discovery(out_dir) -> str:
    """Write OUT_DIR/hosts (two slots on localhost) and a discovery script that prints it; its path."""
    import os
    write_hosts(out_dir, HOSTS_TWO)
    script = os.path.join(out_dir, "discover.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\ncat {os.path.join(out_dir, 'hosts')}\n")
    os.chmod(script, 0o755)
    return script


# -- torch.distributed (Gloo) processes, no Horovod ---------------------------------------------------
def dist_identical(model) -> bool:
    """``torch_identical`` over torch.distributed's default group (every rank must call it)."""
    import torch
    import torch.distributed as dist
    flat = torch_flat(model)
    rows = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, flat)
    return all(torch.equal(rows[0], r) for r in rows)


def gloo_init(rank, world, port) -> None:
    """In a spawned worker: Horovod made unimportable, one torch thread, warnings off, and the
    default process group over Gloo on ``port``."""
    import sys
    sys.modules["horovod"] = None  # any import of Horovod on these paths fails
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))


def load_benchmark(filename):
    """The module of ``benchmarks/<filename>`` (the benchmarks folder is not a package), loaded
    afresh, so a test calls its pure functions and ``main``."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "benchmarks", filename)
    spec = importlib.util.spec_from_file_location(f"bench_{os.path.splitext(filename)[0]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_scenarios(names, call) -> dict:
    """In a worker: ``call(name)`` for each scenario name, in order; each one's result, or its
    traceback as ``{"error": ...}`` (so one failing scenario leaves the others theirs), and its
    seconds under ``"seconds"``."""
    import time
    import traceback

    out = {"seconds": {}}
    for name in names:
        start = time.perf_counter()
        try:
            out[name] = call(name)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        out["seconds"][name] = round(time.perf_counter() - start, 2)
    return out


def gloo_finish(out, out_dir, rank) -> None:
    """In a spawned worker: leave the process group and hand ``out`` to ``gloo_spawn``."""
    import pickle

    import torch.distributed as dist
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_spawn(worker, world: int, args=(), prefix="hvc-gloo-") -> list:
    """Spawn ``world`` processes running ``worker(rank, world, port, *args, out_dir)`` (which ends
    with ``gloo_finish``); every rank's ``out``, in rank order. The workers find the repository and
    the scenarios package on PYTHONPATH, run one OpenMP thread and cache cost models in a folder of
    their own (they are cached per world size and hosts, not per transport); the environment is
    restored afterwards."""
    import pickle
    import tempfile

    import torch.multiprocessing as mp
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds the scenarios package
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [tests, os.path.dirname(tests), saved.get("PYTHONPATH")] if p)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with tempfile.TemporaryDirectory(prefix=prefix) as out_dir:
            os.environ["HVDCOMPRESS_CACHE"] = os.path.join(out_dir, "cache")
            mp.start_processes(worker, args=(world, free_port(), *args, out_dir), nprocs=world, start_method="spawn")
            results = []
            for r in range(world):
                with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
            return results
    finally:
        os.environ.clear()
        os.environ.update(saved)
