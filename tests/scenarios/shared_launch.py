"""Worker launches shared by several test modules: one launch per (framework, world size) per
test session instead of one per module.

Every launch costs seconds before its first scenario (Python, PyTorch or TensorFlow, Horovod and
the Gloo rendezvous start in every worker; about 15 s for TensorFlow on 2 cores), so the modules
listed in a ``SharedLaunch``'s table do not launch their own workers: the first of them to need
its results launches the workers once, running in sequence the scenarios of every listed module
that was collected (``launch.run_scenarios``: one ``hvd.init``; a scenario's own
``hvd.shutdown`` is held back to the end; each scenario's environment changes are undone after
it), and each module reads its part. A scenario that raises is reported in its own part; the
others still run.

A table maps a test module's name to its scenarios, each ``(module, function, args)`` with
``module`` a ``scenarios`` module name and ``args`` a function returning the arguments (called
when the launch starts):

- one scenario, ``(module, function, args)``: ``results(test_module)`` is that scenario's result
  on each rank, and fails the test if it raised (as ``shared_tf_launch`` does);
- several, ``{name: (module, function, args)}``: ``results(test_module)`` is, per rank, a dict
  ``{name: result}`` to read with ``launch.part(results, name)``.

Under pytest-xdist the tests reading one launch may run in two xdist workers (conftest.py puts the
TF launch's tests and the others in two groups): the first worker to need a launch runs it and
leaves its results in ``launch_dir()`` (one directory per test run), holding a file lock meanwhile;
a worker that needs it later waits for that lock and reads them. A launch runs once per session
whichever workers read it.

Launches that need something of their own stay separate: a ``hvd.init(process_sets=...)``, other
TensorFlow threading, a worker that dies, ``horovodrun`` elastic.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from typing import Dict, List, Optional, Set

COLLECTED: Set[str] = set()  # test modules of this session (conftest.pytest_collection_modifyitems)


# The directory of this test session's shared results, made by conftest.py in the pytest process
# that starts the xdist workers (they inherit it).
LAUNCH_DIR = "HVDC_TESTS_LAUNCH_DIR"


def launch_dir() -> Optional[str]:
    """Where the xdist workers of this test run leave the shared launches' results (None outside
    xdist: each launch's results stay in this process)."""
    run, root = os.environ.get("PYTEST_XDIST_TESTRUNUID"), os.environ.get(LAUNCH_DIR)
    if not run or not root:
        return None
    path = os.path.join(root, run)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Optional[str]):
    """An exclusive lock on ``path`` (a file) while the block runs; nothing when ``path`` is None."""
    if path is None:
        yield
        return
    import fcntl
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def scratch_dir() -> str:
    """A new empty directory (a cost-model cache of a scenario's own)."""
    return tempfile.mkdtemp(prefix="hvdcompress-test-")


class SharedLaunch:
    def __init__(self, framework: str, world: int, table: dict, env: Optional[Dict[str, str]] = None,
                 start_timeout: int = 60):
        self.framework, self.world, self.table = framework, world, table
        self.env, self.start_timeout = env, start_timeout
        self._results: Dict[str, List[dict]] = {}

    def results(self, module: str) -> List[dict]:
        """``module``'s results on each rank (rank order); see the module docstring for the shape."""
        if module not in self._results:
            self._launch(module)
        out = self._results[module]
        if not isinstance(self.table[module], dict):
            errors = [r["error"] for r in out if isinstance(r, dict) and set(r) == {"error"}]
            if errors:
                import pytest
                pytest.fail(f"{module}'s scenario raised in the shared {self.framework} launch:\n{errors[0]}")
        return out

    def _launch(self, module: str) -> None:
        """Run the launch (or, under xdist, read what another worker's run of it left) and keep
        each listed module's results."""
        shared = launch_dir()
        stem = None if shared is None else os.path.join(shared, f"{self.framework}-{self.world}")
        with _locked(None if stem is None else stem + ".lock"):
            if stem is not None and os.path.exists(stem + ".pickle"):
                with open(stem + ".pickle", "rb") as f:
                    self._results.update(pickle.load(f))
            if module not in self._results:
                self._run(module)
                if stem is not None:
                    with open(stem + ".part", "wb") as f:
                        pickle.dump(self._results, f)
                    os.replace(stem + ".part", stem + ".pickle")

    def _run(self, module: str) -> None:
        import importlib

        from scenarios.launch import run_scenarios
        names = [m for m in self.table if m in COLLECTED or m == module]
        calls = []
        for m in names:
            for key, (mod, fn, args) in self._entries(m):
                calls.append((key, getattr(importlib.import_module(mod), fn), args()))
        out = run_scenarios(self.framework, self.world, calls, start_timeout=self.start_timeout, env=self.env)
        assert len(out) == self.world
        print(f"shared {self.framework} launch on {self.world} workers, seconds per scenario (rank 0):",
              out[0]["seconds"], "CPU seconds per scenario (rank 0):", out[0]["cpu"])
        from scenarios import cpu_log
        for key in out[0]["cpu"]:
            cpu_log.write(launch=f"{self.framework}-{self.world}", scenario=key, cpu=[r["cpu"][key] for r in out],
                          wall=out[0]["seconds"][key])
        for m in names:
            if isinstance(self.table[m], dict):
                self._results[m] = [{name: r[f"{m}:{name}"] for name in self.table[m]} for r in out]
            else:
                self._results[m] = [r[m] for r in out]

    def _entries(self, module: str):
        entry = self.table[module]
        if isinstance(entry, dict):
            return [(f"{module}:{name}", e) for name, e in entry.items()]
        return [(module, entry)]


def _no_args():
    return ()


def _diloco():
    import scenarios.diloco
    return scenarios.diloco


# PyTorch, 2 workers: every 2-worker torch scenario of these modules in one launch.
TORCH_2 = SharedLaunch("torch", 2, {
    "test_multiprocess": {"training": ("scenarios.torch_core", "training", lambda: (2,)),
                          "empty": ("scenarios.torch_core", "empty_selection", _no_args),
                          "bad": ("scenarios.torch_core", "bad_arguments", _no_args),
                          "resume": ("scenarios.torch_core", "checkpoint_resume", _no_args),
                          "broadcast_state": ("scenarios.torch_core", "broadcast_optimizer_state", _no_args)},
    "test_multiprocess_schedules": {"everything": ("scenarios.schedules", "everything", lambda: (2, scratch_dir()))},
    "test_quantizers_multiprocess": {"everything": ("scenarios.quantizers", "torch_everything", _no_args)},
    "test_sketch_multiprocess": {"all": ("scenarios.sketch", "torch_all", lambda: (2,))},
    "test_dgc_recipes": {"all": ("scenarios.dgc_recipes", "torch_all", _no_args)},
    "test_delayed": {"unrolled": ("scenarios.delayed", "unrolled_identity", _no_args),
                     "momentum": ("scenarios.delayed", "unrolled_identity_with_momentum", _no_args),
                     "zero": ("scenarios.delayed", "zero_delay_is_the_synchronous_optimizer", _no_args),
                     "flush": ("scenarios.delayed", "flush_makes_replicas_identical", _no_args),
                     "resume": ("scenarios.delayed", "resume_with_exchanges_in_flight", _no_args),
                     "nonfinite": ("scenarios.delayed", "nonfinite_with_exchanges_in_flight", _no_args)},
    "test_reliability": {"sparse": ("scenarios.reliability", "sparse_gradients", _no_args),
                         "models": ("scenarios.reliability", "different_models", _no_args),
                         "faults": ("scenarios.reliability", "nonfinite_faults", _no_args),
                         "partial": ("scenarios.reliability", "partial_gradients", _no_args)},
    "test_mp_tuning": {"everything": ("scenarios.tuning", "everything", lambda: (2,))},
    "test_profiling": {"profile": ("scenarios.profiling", "profile_on_every_rank", lambda: (scratch_dir(),))},
    "test_contract": {"toy": ("scenarios.contract", "toy_training", _no_args),
                      "warmup": ("scenarios.contract", "dgc_default_warmup", _no_args)},
    "test_diloco": {"reference": ("scenarios.diloco", "compare_with_reference",
                                  lambda: (_diloco().TORCH_CONFIGS, _diloco().TORCH_STEPS)),
                    "checkpoint": ("scenarios.diloco", "checkpoint_resume", lambda: (_diloco().CKPT, 9, 5)),
                    "checkpoint_dense": ("scenarios.diloco", "checkpoint_resume",
                                         lambda: (dict(_diloco().CKPT, compression="none"), 9, 5)),
                    "nan": ("scenarios.diloco", "non_finite",
                            lambda: (dict(sync_every=2, compression="sparseloco:ratio=0.5"), 4, 2)),
                    "flush": ("scenarios.diloco", "flush_and_bad_arguments", _no_args),
                    "elastic": ("scenarios.diloco", "elastic_state", lambda: (_diloco().CKPT, 9, 5))},
    "test_docs": {"torch": ("scenarios.docs_snippets", "torch_all", _no_args)},
    "test_onebitadam_multiprocess": {"all": ("scenarios.onebitadam", "torch_all", _no_args)},
    "test_topkadam_multiprocess": {"all": ("scenarios.onebitadam", "torch_topkadam", _no_args)},
})

# PyTorch, 3 workers: an odd world (sums and votes in rank order, a rank that is neither first nor
# last) for the modules that check one.
TORCH_3 = SharedLaunch("torch", 3, {
    "test_multiprocess": {"training": ("scenarios.torch_core", "training", lambda: (3,))},
    "test_multiprocess_schedules": {"merged": ("scenarios.schedules", "merged_training", lambda: (3,))},
    "test_quantizers_multiprocess": {"everything": ("scenarios.quantizers", "torch_everything", _no_args)},
    "test_sketch_multiprocess": {"all": ("scenarios.sketch", "torch_all", lambda: (3,))},
    "test_delayed": {"unrolled": ("scenarios.delayed", "unrolled_identity", _no_args)},
    "test_gtopk": {"horovod": ("scenarios.gtopk", "horovod_optimizer", _no_args)},
})
