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
