"""Horovod Elastic with our TensorFlow/Keras wrappers: ``horovodrun --gloo`` elastic on localhost, a
host-discovery script whose answer the training itself changes (2 workers -> a third joins -> it is
removed again), for the Keras DistributedOptimizer (``hvc.elastic.KerasState``, train_on_batch) and
the tape (``hvc.elastic.TensorFlowKerasState(..., compression=...)``). Every step, every rank checks
that all ranks hold identical parameters and optimizer variables and the same exchange counter
(tests/scenarios/tf_elastic_worker.py writes what it saw, one JSON line per step and process)."""

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


@pytest.mark.parametrize("mode", ["keras", pytest.param("tape", marks=pytest.mark.extended)])  # tape: extended tier
def test_training_continues_identical_through_a_worker_joining_and_leaving(tmp_path, mode):
    out = str(tmp_path)
    discover = kit.elastic_discovery(out)
    # a joining worker imports TensorFlow before it reaches the rendezvous: more than Gloo's default
    # 30 s on a loaded machine
    env = dict(os.environ, OMP_NUM_THREADS="1", HOROVOD_CYCLE_TIME=HOROVOD_SETTINGS["HOROVOD_CYCLE_TIME"],
               HOROVOD_GLOO_TIMEOUT_SECONDS="120",
               TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = ["horovodrun", "-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", discover,
           "--gloo", "--network-interface", "lo", sys.executable, os.path.join(HERE, "scenarios", "tf_elastic_worker.py"), out,
           mode]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    records = []
    for path in glob.glob(os.path.join(out, "*.jsonl")):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "done" not in r and "sync" not in r]
    syncs = [r for r in records if r.get("sync")]
    done = [r for r in records if r.get("done")]
    sizes = [r["size"] for r in sorted(steps, key=lambda r: r["step"]) if r["rank"] == 0]
    assert 3 in sizes, sizes                                       # the third worker joined
    assert sizes[-1] == 2 and sizes.index(3) < len(sizes) - 1, sizes  # ... and left again
    assert steps and all(r["identical"] for r in steps)           # identical parameters, every step
    assert all(len(set(r["counters"])) == 1 and len(r["counters"]) == r["size"] for r in steps)
    assert {r["rank"] for r in done} == {0, 1} and all(r["phase"] == "back" for r in done)
    if mode == "keras":                                            # the averaging factor follows the size
        assert all(abs(r["scale"] - 1.0 / r["size"]) < 1e-12 for r in steps), {r["scale"] for r in steps}

    # at each sync after a reset: the survivors keep their own residuals (what they had after their
    # last step), the joining rank starts with none, and it takes the exchange counter over
    last = {(r["rank"], r["step"]): r for r in steps}
    joined = [r for r in syncs if r["size"] == 3]
    assert {r["rank"] for r in joined} == {0, 1, 2}, joined
    for r in syncs:
        if r["step"] == 0:
            continue
        assert r["counter"] == r["step"], r
        before = last.get((r["rank"], r["step"] - 1))
        if before is None:                                         # the joining rank
            assert r["rank"] == 2 and r["residual_norm"] == 0.0, r
        else:
            assert r["residual_norm"] == before["residual_norm"] > 0, (r, before)


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "dgc:ratio=0.01", "fp16"])
def test_snapshot_and_sync_carry_the_density(spec):
    """A commit snapshot restores the density it saw, and a sync hands rank 0's density on
    (through ``GradientCompression.density``); a spec without one has None throughout."""
    import tf_ops  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
    from tf_ops.compression import GradientCompression
    from tf_ops.elastic import CompressionSnapshot, sync_compression

    c = GradientCompression(spec)
    before = c.density
    snapshot = CompressionSnapshot([c])
    snapshot.save()
    if before is None:
        snapshot.restore()
        sync_compression(c, lambda obj: obj)
        assert c.density is None
        return
    c.density = 0.5
    snapshot.restore()
    assert c.density == before
    sent = {}

    def bcast(obj):  # rank 0 says 0.25
        sent.update(obj)
        return dict(obj, density=0.25)

    sync_compression(c, bcast)
    assert sent["density"] == before and c.density == 0.25
