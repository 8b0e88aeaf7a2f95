"""Launching real Horovod workers from the tests: ``run_workers`` (local Gloo processes through
``horovod.runner.run``), ``run_scenarios`` (several scenarios in sequence in one launch: every
launch costs seconds of Python, PyTorch/TensorFlow and Horovod start-up per worker) and ``part``
(one scenario's results from every rank, failing on errors).

The workers inherit this process's environment plus: the tests' directory on PYTHONPATH (the
``scenarios`` package), one torch/OMP thread, Horovod's 1 ms cycle with its response cache
(``HOROVOD_SETTINGS``: these runs are latency bound), a 300 s Gloo timeout (``GLOO_TIMEOUT_S``),
and a cost-model cache that is never the user's ``~/.cache/hvdcompress`` (``worker_cache_dir``).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from typing import Dict, Optional, Sequence, Tuple


# Gloo's own default is 30 s per collective. Each cycle of a worker's Horovod background thread
# takes part in the negotiation of every process set the worker belongs to, the global set
# included (a Gloo allreduce of the response-cache bits), so a worker that gets no CPU for a while
# holds up the collectives of all the others, even of a process set it is not in. With 3 workers
# on the 2 cores of the CI machine (and TensorFlow imports or busy waits competing for them) such a
# wait can reach 30 s; the workers get a longer timeout, and a real hang still fails, later.
GLOO_TIMEOUT_S = "300"

# Horovod's settings as every worker must see them when it initializes Horovod. horovod.runner.run
# (0.28.1) writes its own HOROVOD_CYCLE_TIME and HOROVOD_CACHE_CAPACITY into each worker's
# environment, over the launching process's: "(None,)" when the caller gives none (its argument
# defaults end in a stray comma), which Horovod parses as 0, that is a background thread that
# negotiates without pause (about half a core per idle worker) and no response cache (every
# collective negotiated in full). ``run_workers`` therefore sets them again inside each worker,
# before the worker's function runs; a launch's ``env`` may still override them.
# HVDC_TESTS_HOROVOD_CYCLE_MS changes the cycle for every launch of a test run (each idle worker's
# background thread runs a Gloo negotiation per cycle: a longer cycle costs less CPU and adds latency
# to every collective; compare with HVDC_TESTS_CPU_LOG, scenarios/cpu_log.py).
HOROVOD_SETTINGS = {"HOROVOD_CYCLE_TIME": os.environ.get("HVDC_TESTS_HOROVOD_CYCLE_MS", "1"),
                    "HOROVOD_CACHE_CAPACITY": "1024"}

# Set to "1" in a TF launch's environment: its workers run every tf.function without Grappler's
# graph rewrites (about a third of the CPU a Keras step's first call takes, which a test launch
# pays once per compressor and model). The single-process tests keep the rewrites on and check
# tf.function against the numpy oracle bit for bit, so what they could change is still covered.
NO_GRAPH_OPTIMIZER = "HVDC_TESTS_NO_GRAPH_OPTIMIZER"


def tf_graph_options() -> None:
    """In a TF worker, before its first tf.function runs: Grappler off when the launch asked
    (``NO_GRAPH_OPTIMIZER``)."""
    if os.environ.get(NO_GRAPH_OPTIMIZER) == "1":
        import tensorflow as tf
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})


def worker_cache_dir() -> str:
    """The cost-model cache the workers use: $HVDCOMPRESS_CACHE as the test session set it
    (conftest.py: a temporary directory per session; a test may set its own), else a temporary
    one made here -- never the user's ~/.cache/hvdcompress."""
    if not os.environ.get("HVDCOMPRESS_CACHE"):
        os.environ["HVDCOMPRESS_CACHE"] = tempfile.mkdtemp(prefix="hvdcompress-test-cache-")
    return os.environ["HVDCOMPRESS_CACHE"]


# Under pytest, conftest.py sets this per test: True for a test marked ``multiprocess``, False for
# one that is not (``make test-fast`` deselects the marked ones, so an unmarked launch would slip
# into the single-process run). None outside pytest: no check.
LAUNCH_ALLOWED: Optional[bool] = None


def run_workers(fn, np_: int, *args, env: Optional[Dict[str, str]] = None, start_timeout: int = 60):
    """Run ``fn(*args)`` on ``np_`` local Gloo workers; returns each rank's result, rank order.
    ``env`` adds or overrides environment variables for the workers only."""
    if LAUNCH_ALLOWED is False:
        raise RuntimeError("this test launches Horovod workers: mark it @pytest.mark.multiprocess "
                           "(or the module: pytestmark = pytest.mark.multiprocess)")
    from horovod.runner import run

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds the scenarios package
    cache = worker_cache_dir()
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join([tests, os.path.dirname(tests), saved.get("PYTHONPATH", "")])
    os.environ["HVDCOMPRESS_CACHE"] = cache
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", GLOO_TIMEOUT_S)
    os.environ.update(env or {})
    settings = dict(HOROVOD_SETTINGS, **{k: v for k, v in (env or {}).items() if k in HOROVOD_SETTINGS})
    try:
        return run(in_worker, args=(settings, fn) + tuple(args), num_proc=np_, hosts=f"localhost:{np_}",
                   use_gloo=True, start_timeout=start_timeout)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def in_worker(settings: Dict[str, str], fn, *args):
    """Worker side of ``run_workers``: ``settings`` into the environment (``HOROVOD_SETTINGS``),
    then ``fn(*args)``."""
    os.environ.update(settings)
    return fn(*args)


def part(results, name):
    """Scenario ``name``'s result from every rank; fails with the worker's error if it raised."""
    for r in results:
        assert "error" not in r[name], r[name].get("error")
    return [r[name] for r in results]


def in_sequence(framework: str, calls: Sequence[Tuple[str, object, tuple]]) -> dict:
    """Worker side of ``run_scenarios``: initialize Horovod once, run each ``(name, fn, args)`` in
    order and return ``{name: fn(*args)}`` (``{"error": traceback}`` where one raised, so the other
    scenarios still run and the test shows the worker's error), plus ``"seconds"`` (wall) and
    ``"cpu"`` (the worker process's CPU seconds, all its threads) per scenario.

    The scenarios may call ``hvd.init()``/``hvd.shutdown()`` themselves, as they do when launched
    alone: a second ``init`` does nothing, and ``shutdown`` is held back until the last one ran.
    What a scenario sets in ``os.environ`` (a cost-model cache of its own) is undone after it, so
    each scenario starts from the launch's environment."""
    import importlib
    hvd = importlib.import_module({"torch": "horovod.torch", "tf": "horovod.tensorflow"}[framework])
    if framework == "tf":
        tf_graph_options()
        # one thread each, as the TF scenarios set for themselves: set before any of them runs, so
        # that one which sets nothing (and starts TF's runtime with its defaults) cannot make a later
        # one's setting fail, whichever modules were collected
        import tensorflow as tf
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    shutdown, hvd.shutdown = hvd.shutdown, lambda: None
    out = {"seconds": {}, "cpu": {}}
    try:
        for name, fn, args in calls:
            start, cpu, environ = time.perf_counter(), time.process_time(), dict(os.environ)
            try:
                out[name] = fn(*args)
            except Exception:  # report, do not hang the next scenarios on a worker traceback
                out[name] = {"error": traceback.format_exc()}
            finally:
                os.environ.clear()
                os.environ.update(environ)
            out["seconds"][name] = round(time.perf_counter() - start, 2)
            out["cpu"][name] = round(time.process_time() - cpu, 2)
    finally:
        hvd.shutdown = shutdown
    shutdown()
    return out


def run_scenarios(framework: str, np_: int, calls, **kwargs):
    """One launch of ``np_`` workers running ``calls`` (``(name, fn, args)``, ``fn`` importable in
    the workers: a scenario module's function) in sequence; each rank's ``in_sequence`` result.
    Read one scenario's results with ``part(results, name)``."""
    return run_workers(in_sequence, np_, framework, [(n, f, tuple(a)) for n, f, a in calls], **kwargs)
