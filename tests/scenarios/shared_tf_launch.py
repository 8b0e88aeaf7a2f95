"""The TensorFlow launch shared by the 2-worker TF test modules (``shared_launch.SharedLaunch``).

Every TF worker spends about 15 s (2 cores) importing TensorFlow and starting Horovod before its
first scenario, so the modules listed in ``SCENARIOS`` do not launch their own workers: one launch
of 2 workers per test session runs the scenario of every listed module that was collected, and
each module reads its part. Modules keep their scenario functions unchanged (each sets TF to one
thread, which repeats as a no-op). tests/test_tf_reliability.py keeps a launch of its own: its
workers run two inter-op threads.
"""

from __future__ import annotations

import os
from typing import List

from scenarios.launch import NO_GRAPH_OPTIMIZER
from scenarios.shared_launch import SharedLaunch, scratch_dir

# Horovod's cycle and response cache are every launch's (``launch.HOROVOD_SETTINGS``): each cycle is
# a Gloo negotiation on each rank, and on 2 cores that traffic takes the CPU the workers'
# TensorFlow traces need.
ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", NO_GRAPH_OPTIMIZER: "1"}
WORLD = 2


def _digits_epochs() -> int:  # the Keras digits run trains to an accuracy: extended tier only
    return 20 if os.environ.get("HVDC_EXTENDED_TESTS", "") == "1" else 0


# test module -> (scenario module, function, args)
SCENARIOS = {
    "test_tf_multiprocess": ("scenarios.tf_core", "everything", lambda: (WORLD, _digits_epochs())),
    "test_tf_delayed": ("scenarios.tf_delayed", "everything", lambda: ()),
    "test_tf_sparse": ("scenarios.tf_sparse", "everything", lambda: ()),
    "test_sketch_multiprocess": ("scenarios.sketch", "tf_all", lambda: (WORLD,)),
    "test_dgc_recipes": ("scenarios.dgc_recipes", "tf_all", lambda: ()),
    "test_quantizers_multiprocess": ("scenarios.quantizers", "tf_everything", lambda: ()),
    "test_docs": ("scenarios.docs_snippets", "tf_all", lambda: ()),
    "test_tf_diloco": ("scenarios.tf_diloco", "everything", lambda: ()),
    "test_tf_schedules_multiprocess": ("scenarios.tf_schedules", "everything", lambda: (WORLD, scratch_dir())),
    "test_onebitadam_multiprocess": ("scenarios.onebitadam", "tf_all", lambda: ()),
    "test_topkadam_multiprocess": ("scenarios.onebitadam", "tf_topkadam", lambda: ()),
    "test_tf_session": ("scenarios.tf_session", "everything", lambda: ()),
}


def digits_epochs() -> int:
    return _digits_epochs()


_LAUNCH = SharedLaunch("tf", WORLD, SCENARIOS, env=ENV, start_timeout=120)


def results(module: str) -> List[dict]:
    """``module``'s scenario result from each rank (rank order), from the session's shared launch."""
    return _LAUNCH.results(module)
