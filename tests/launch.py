"""Launching real Horovod workers from the tests: ``run_workers`` (local Gloo processes through
``horovod.runner.run``) and ``part`` (one scenario's results from every rank, failing on errors).

The workers inherit this process's environment plus: the tests' directory on PYTHONPATH (the
scenario modules), one torch/OMP thread, Horovod's 1 ms cycle (these runs are latency bound), and
a cost-model cache that is never the user's ``~/.cache/hvdcompress`` (``worker_cache_dir``).
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, Optional


def worker_cache_dir() -> str:
    """The cost-model cache the workers use: $HVDCOMPRESS_CACHE as the test session set it
    (conftest.py: a temporary directory per session; a test may set its own), else a temporary
    one made here -- never the user's ~/.cache/hvdcompress."""
    if not os.environ.get("HVDCOMPRESS_CACHE"):
        os.environ["HVDCOMPRESS_CACHE"] = tempfile.mkdtemp(prefix="hvdcompress-test-cache-")
    return os.environ["HVDCOMPRESS_CACHE"]


def run_workers(fn, np_: int, *args, env: Optional[Dict[str, str]] = None, start_timeout: int = 60):
    """Run ``fn(*args)`` on ``np_`` local Gloo workers; returns each rank's result, rank order.
    ``env`` adds or overrides environment variables for the workers only."""
    from horovod.runner import run

    here = os.path.dirname(os.path.abspath(__file__))
    cache = worker_cache_dir()
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), saved.get("PYTHONPATH", "")])
    os.environ["HVDCOMPRESS_CACHE"] = cache
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["HOROVOD_CYCLE_TIME"] = "1"
    os.environ.update(env or {})
    try:
        return run(fn, args=args, num_proc=np_, hosts=f"localhost:{np_}", use_gloo=True,
                   start_timeout=start_timeout)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def part(results, name):
    """Scenario ``name``'s result from every rank; fails with the worker's error if it raised."""
    for r in results:
        assert "error" not in r[name], r[name].get("error")
    return [r[name] for r in results]
