import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(__file__))

# Tests never read or write the user's cache (~/.cache/hvdcompress: fitted cost models): one
# fresh directory per pytest session, inherited by every worker the tests launch. A test that
# needs its own (monkeypatch.setenv) still sets it.
SESSION_CACHE = tempfile.mkdtemp(prefix="hvdcompress-test-cache-")
os.environ["HVDCOMPRESS_CACHE"] = SESSION_CACHE
atexit.register(shutil.rmtree, SESSION_CACHE, True)


# Two tiers. The default suite (the README's test command, CI) runs every feature on real Horovod
# processes on both backends. HVDC_EXTENDED_TESTS=1 (``make test-full``) adds the runs marked
# ``extended``: ones that repeat a path the default suite already covers, at a cost in minutes on
# a 2-core machine (TensorFlow on 3 workers, a second elastic mode, training to an accuracy).
EXTENDED = os.environ.get("HVDC_EXTENDED_TESTS", "") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "extended: a costly repeat of covered paths; runs with HVDC_EXTENDED_TESTS=1")


def pytest_collection_modifyitems(config, items):
    from scenarios import shared_tf_launch  # the TF modules of this session share one launch of 2 workers
    shared_tf_launch.COLLECTED.update(getattr(item.module, "__name__", "") for item in items)
    if EXTENDED:
        return
    import pytest
    skip = pytest.mark.skip(reason="extended tier: set HVDC_EXTENDED_TESTS=1 (make test-full)")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)
