"""One TensorFlow launch shared by the 2-worker TF test modules.

Every TF worker spends about 15 s (2 cores) importing TensorFlow and starting Horovod before its
first scenario, so the modules listed in ``SCENARIOS`` do not launch their own workers: the first
of them to need its results launches 2 workers once per test session, running in sequence the
scenarios of every listed module that was collected (``launch.run_scenarios``: one ``hvd.init``;
each scenario's own ``hvd.shutdown`` is held back to the end), and each module reads its part.
A scenario that raises is reported in its own part; the others still run. Modules keep their
scenario functions unchanged (each sets TF to one thread, which repeats as a no-op).
tests/test_tf_reliability.py keeps a launch of its own: its workers run two inter-op threads.
"""

from __future__ import annotations

import os
from typing import Dict, List, Set

# Horovod's cycle at 0.2 ms instead of the tests' 1 ms: these Keras runs wait on many small
# collectives (measured on 2 cores, the quantizers' Keras runs: 70 s against 80-83 s at 1 ms; the
# PyTorch launches were not faster with it, so they keep 1 ms)
ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "HOROVOD_CYCLE_TIME": "0.2"}
WORLD = 2


def _digits_epochs() -> int:  # the Keras digits run trains to an accuracy: extended tier only
    return 20 if os.environ.get("HVDC_EXTENDED_TESTS", "") == "1" else 0


# test module -> (scenario module, function, args)
SCENARIOS = {
    "test_tf_multiprocess": ("mp_tf_scenarios", "everything", lambda: (WORLD, _digits_epochs())),
    "test_tf_delayed": ("mp_tf_delayed_scenarios", "everything", lambda: ()),
    "test_tf_sparse": ("mp_tf_sparse_scenarios", "everything", lambda: ()),
    "test_sketch_multiprocess": ("mp_sketch_scenarios", "tf_all", lambda: (WORLD,)),
    "test_dgc_recipes": ("mp_dgc_recipe_scenarios", "tf_all", lambda: ()),
    "test_quantizers_multiprocess": ("mp_quantizer_scenarios", "tf_everything", lambda: ()),
    "test_tf_diloco": ("mp_tf_diloco_scenarios", "everything", lambda: ()),
}

COLLECTED: Set[str] = set()  # test modules of this session (conftest.pytest_collection_modifyitems)
_results: Dict[str, List[dict]] = {}


def digits_epochs() -> int:
    return _digits_epochs()


def results(module: str) -> List[dict]:
    """``module``'s scenario result from each rank (rank order), from the session's shared launch."""
    if module not in _results:
        import importlib
        from launch import run_scenarios
        names = [m for m in SCENARIOS if m in COLLECTED or m == module]
        calls = []
        for m in names:
            mod, fn, args = SCENARIOS[m]
            calls.append((m, getattr(importlib.import_module(mod), fn), args()))
        out = run_scenarios("tf", WORLD, calls, start_timeout=120, env=ENV)
        assert len(out) == WORLD
        print("shared TF launch, seconds per scenario (rank 0):", out[0]["seconds"])
        for m in names:
            _results[m] = [r[m] for r in out]
    errors = [r["error"] for r in _results[module] if isinstance(r, dict) and set(r) == {"error"}]
    if errors:
        import pytest
        pytest.fail(f"{module}'s scenario raised in the shared TF launch:\n{errors[0]}")
    return _results[module]
