import atexit
import os
import re
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # the ``scenarios`` package

# Tests never read or write the user's cache (~/.cache/hvdcompress: fitted cost models): one
# fresh directory per pytest session, inherited by every worker the tests launch. A test that
# needs its own (monkeypatch.setenv) still sets it.
# Where scripts/install.sh put triton for the GPU kernels' interpreter tests (tests/test_triton_kernels.py),
# read from the user's cache before the override below.
os.environ.setdefault("HVDCOMPRESS_TRITON_PATH", os.path.join(
    os.environ.get("HVDCOMPRESS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hvdcompress")), "triton-3.9.0"))
SESSION_CACHE = tempfile.mkdtemp(prefix="hvdcompress-test-cache-")
os.environ["HVDCOMPRESS_CACHE"] = SESSION_CACHE
atexit.register(shutil.rmtree, SESSION_CACHE, True)
# Where the xdist workers leave the shared launches' results for each other (scenarios/shared_launch.py):
# made once, by the process that starts the workers, which inherit it.
from scenarios.shared_launch import LAUNCH_DIR  # noqa: E402
if LAUNCH_DIR not in os.environ:
    os.environ[LAUNCH_DIR] = tempfile.mkdtemp(prefix="hvdcompress-test-launches-")
    atexit.register(shutil.rmtree, os.environ[LAUNCH_DIR], True)
# The compiled kernels (torch_ops/compressors/native.py) are the exception: a build is named by the
# digest of its source and flags, so the one `make install` made serves the tests too, instead of
# a compile per session (and per xdist worker).
os.environ.setdefault("HVDCOMPRESS_NATIVE_CACHE",
                      os.path.join(os.path.expanduser("~"), ".cache", "hvdcompress", "native"))


# Two tiers. The default suite (the README's test command, CI) runs every feature on real Horovod
# processes on both backends. HVDC_EXTENDED_TESTS=1 (``make test-full``) adds the runs marked
# ``extended``: ones that repeat a path the default suite already covers, at a cost in minutes on
# a 2-core machine (TensorFlow on 3 workers, a second elastic mode, training to an accuracy).
EXTENDED = os.environ.get("HVDC_EXTENDED_TESTS", "") == "1"


def _load_triton_first():
    """Load triton (when installed) before Horovod's TensorFlow ops: loading its library after
    them crashes the process (triton 3.9.0, horovod 0.28.1), and torch imports triton on its own
    (torch.optim's constructors import torch._dynamo, which looks for it)."""
    import importlib.util
    if importlib.util.find_spec("triton") is not None:
        try:
            import triton  # noqa: F401
        except Exception:  # a broken install: the tests that need it skip
            pass


_load_triton_first()


def _horovod_missing():
    """None when Horovod (with its Gloo runner, PyTorch and TensorFlow ops) imports, else why not."""
    try:
        import horovod.runner  # noqa: F401
        import horovod.tensorflow  # noqa: F401
        import horovod.torch  # noqa: F401
    except Exception as e:  # ImportError, or a broken build's OSError / undefined symbol
        return f"{type(e).__name__}: {e}"
    return None


HOROVOD_MISSING = None  # _horovod_missing()'s answer, set by pytest_configure where tests run


def _xdist_controller(config) -> bool:
    """The process that hands tests to pytest-xdist workers and runs none itself (-n N)."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def pytest_configure(config):
    global HOROVOD_MISSING
    config.addinivalue_line("markers", "extended: a costly repeat of covered paths; runs with HVDC_EXTENDED_TESTS=1")
    config.addinivalue_line("markers", "multiprocess: launches real Horovod/Gloo worker processes "
                                       "(deselect with -m 'not multiprocess': make test-fast)")
    if _xdist_controller(config):
        return  # checked in each xdist worker, which collects and runs the tests: no TF/torch import here
    HOROVOD_MISSING = _horovod_missing()
    if HOROVOD_MISSING:
        # modules that import Horovod fail to collect; the tests of every other module still run
        config.option.continue_on_collection_errors = True


def pytest_report_header(config):
    if _xdist_controller(config):
        return "horovod: checked on import in each xdist worker (a multiprocess test fails with the reason)"
    return f"horovod: {'MISSING (' + HOROVOD_MISSING + ')' if HOROVOD_MISSING else 'ok'}"


def pytest_collection_finish(session):
    # modules share launches (scenarios/shared_launch.py): only the scenarios of the modules with a
    # test left to run (after -k / -m deselection) run in them
    from scenarios import shared_launch
    shared_launch.COLLECTED.update(getattr(item.module, "__name__", "") for item in session.items)


# a test name or fixture name that says TensorFlow: test_tf_..., test_keras_..., tf_results, [tf-2]
_TF_NAME = re.compile(r"(^|[_\-\[])(tf|keras)([_\-\]]|$)")


def _multiprocess_group(item) -> str:
    """The xdist group of a test that launches workers: "multiprocess-tf" for the tests that read
    the shared TensorFlow launch (every multiprocess test of a module only in its table; in a
    module in the PyTorch launches' tables too, those whose name or fixtures say tf or keras),
    "multiprocess" for the others (the shared PyTorch launches and the launches of their own)."""
    from scenarios import shared_launch, shared_tf_launch
    module = getattr(item.module, "__name__", "")
    if module not in shared_tf_launch.SCENARIOS:
        return "multiprocess"
    if module not in set(shared_launch.TORCH_2.table) | set(shared_launch.TORCH_3.table):
        return "multiprocess-tf"
    named = [item.name] + list(getattr(item, "fixturenames", ()))
    return "multiprocess-tf" if any(_TF_NAME.search(n) for n in named) else "multiprocess"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the items
def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (`make test`: -n 2 --dist loadgroup) the tests that launch workers form two
    # groups, each run in order in one xdist worker (_multiprocess_group): the shared TF launch's
    # tests in one; the shared PyTorch launches' tests and the modules with launches of their own
    # in the other. xdist hands out the two groups first (its largest units), then the
    # single-process tests to whichever worker is done with its group. The shared TF launch is the
    # longest run of the suite, so it starts at once in a worker of its own, while the other
    # worker runs the PyTorch launches. A launch runs once per session even when tests of both
    # groups read it (scenarios/shared_launch.py: the second worker reads the first one's results),
    # as a test that reads both a PyTorch and the TF launch does.
    for item in items:
        if "multiprocess" in item.keywords:
            item.add_marker(pytest.mark.xdist_group(_multiprocess_group(item)))
    if EXTENDED:
        return
    skip = pytest.mark.skip(reason="extended tier: set HVDC_EXTENDED_TESTS=1 (make test-full)")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    from scenarios import launch
    marked = item.get_closest_marker("multiprocess") is not None
    launch.LAUNCH_ALLOWED = marked  # run_workers refuses to start workers for an unmarked test
    if marked and HOROVOD_MISSING:
        import pytest
        pytest.fail(f"Horovod is not importable ({HOROVOD_MISSING}); the multiprocess tests need it. "
                    "Install it with `make install`, or run only the single-process tests: "
                    "pytest -m 'not multiprocess'.", pytrace=False)


def pytest_runtest_teardown(item):
    from scenarios import launch
    launch.LAUNCH_ALLOWED = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # HVDC_TESTS_CPU_LOG=<file>: one JSON line per test with the CPU seconds (user + sys) of this
    # process and of every process it waited for (launched workers, subprocesses) over its setup,
    # call and teardown: where the suite's CPU goes (the shared launches add a line per scenario).
    from scenarios import cpu_log
    if not cpu_log.enabled():
        yield
        return
    start = cpu_log.snapshot()
    yield
    cpu_log.write(test=item.nodeid, **cpu_log.since(start))
