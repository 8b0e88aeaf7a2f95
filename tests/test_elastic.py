"""Horovod Elastic with our optimizer: ``horovodrun --gloo`` elastic on localhost, a host-discovery
script whose answer the training itself changes (2 workers -> a third joins -> it is removed again).
Every step, every rank checks that all ranks hold identical parameters and the same exchange
counter (tests/scenarios/elastic_worker.py writes what it saw, one JSON line per step and process)."""

import glob
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios import kit  # noqa: E402
from scenarios.launch import HOROVOD_SETTINGS  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def test_training_continues_identical_through_a_worker_joining_and_leaving(tmp_path):
    out = str(tmp_path)
    discover = kit.elastic_discovery(out)
    env = dict(os.environ, OMP_NUM_THREADS="1", HOROVOD_CYCLE_TIME=HOROVOD_SETTINGS["HOROVOD_CYCLE_TIME"],
               PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = ["horovodrun", "-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", discover,
           "--gloo", "--network-interface", "lo", sys.executable, os.path.join(HERE, "scenarios", "elastic_worker.py"), out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    records = []
    for path in glob.glob(os.path.join(out, "*.jsonl")):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "done" not in r]
    done = [r for r in records if r.get("done")]
    sizes = [r["size"] for r in sorted(steps, key=lambda r: r["step"]) if r["rank"] == 0]
    assert 3 in sizes, sizes                                       # the third worker joined
    assert sizes[-1] == 2 and sizes.index(3) < len(sizes) - 1, sizes  # ... and left again
    assert steps and all(r["identical"] for r in steps)           # identical parameters, every step
    assert all(len(set(r["opt_steps"])) == 1 for r in steps)      # one exchange counter on every rank
    assert {r["rank"] for r in done} == {0, 1} and all(r["phase"] == "back" for r in done)
