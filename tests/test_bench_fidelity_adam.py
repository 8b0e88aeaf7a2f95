"""benchmarks/fidelity_adam.py (issue 44's AdamW measurement): its quick mode end to end on each
front -- the PyTorch ``DistributedOptimizer`` on Horovod, torch DDP with the comm hook on
torch.distributed gloo, Keras on Horovod TensorFlow -- with 2 real workers: every exchanged run ends
with identical parameters on every rank, the bytes are counted in all and after the warm-up, and the
table and JSON are written. The figures of a quick run mean nothing (a tiny model, a few steps)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "fidelity_adam.py")
QUICK_DENSE_BYTES = 69504  # the quick char LM's 17,376 float32 parameters


def _quick(tmp_path, front, configs, steps=6):
    out = str(tmp_path / f"quick-{front}")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--front", front, "--quick", "--workers", "2", "--steps", str(steps),
         "--pretrain-steps", "2", "--seeds", "0", "--onebitadam-warmup", "0.34", "--configs", *configs,
         "--out", out, "--launch-timeout", "1200"],
        capture_output=True, text=True, timeout=1500, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(open(out + ".json").read())
    assert report["meta"]["front"] == front and open(out + ".md").read().count("\n| ") == len(configs) + 1
    return report["rows"]


def _check(rows, steps):
    warm = round(0.34 * steps)
    dense = rows["none"]
    assert dense["identical"] and dense["bytes_per_step"] == dense["bytes_per_step_after_warmup"] == QUICK_DENSE_BYTES
    for name in ("onebitadam", "topkadam"):
        if name not in rows:
            continue
        r = rows[name]
        assert r["identical"], r
        assert r["spec"].endswith(f"warmup_steps={warm}")
        # the warm-up is dense; after it the moment travels compressed
        total = (warm * QUICK_DENSE_BYTES + (steps - warm) * r["bytes_per_step_after_warmup"]) / steps
        assert r["bytes_per_step"] == pytest.approx(total)
        assert r["fewer_bytes_after_warmup"] > 16, r
    if "alone" in rows:
        assert rows["alone"]["identical"] is None and rows["alone"]["bytes_per_step"] == 0


# A benchmark's end-to-end smoke, not the library's: the specs it runs are tested against their
# oracles on real workers (test_onebitadam_multiprocess, test_topkadam_multiprocess, test_ddp_hook,
# the Keras tests), so every front is in the extended tier (make test-full).
@pytest.mark.multiprocess
@pytest.mark.extended
@pytest.mark.parametrize("front", ["horovod", "ddp"])
def test_quick_run_on_a_torch_front(tmp_path, front):
    rows = _quick(tmp_path, front, ["none", "alone", "onebitadam", "topkadam"])
    _check(rows, 6)


@pytest.mark.multiprocess
@pytest.mark.extended
def test_quick_run_on_keras(tmp_path):
    _check(_quick(tmp_path, "keras", ["none", "onebitadam"], steps=3), 3)
