"""Contract v2: a new algorithm is one oracle module + one module per backend (the toy in
tests/toy_algorithm), exchanges run their rounds generically, and every collective runs on the
user's process set (3 ranks, a 2-rank set: no hang)."""

import os

import numpy as np
import pytest

import toy_algorithm.reference_toy  # noqa: F401  (declares "toysign")
from hvdcompress import Compression, parse_spec
from hvdcompress.schedule.costmodel import CostModel, payload, rounds
from hvdcompress.reference import simulate
from hvdcompress.contract import Allgather, Allreduce, Alltoall
from hvdcompress.reference.oracle import Oracle, simulate as sim
from hvdcompress.spec import LAYERWISE, describe
from scenarios.local_world import run_lockstep


def _grads(world, n=10, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(world)]


def test_a_declared_algorithm_gets_a_factory_a_string_spec_and_a_wire_cost():
    spec = Compression.toysign(gain=2.0)
    assert spec == parse_spec("toysign:gain=2") and spec.info.merge == LAYERWISE
    assert "gain" in describe("toysign")
    with pytest.raises(ValueError, match="toysign: parameter 'gain' must be float in \\(0.0, inf\\)"):
        Compression.toysign(gain=0)
    r = rounds(spec, [100.0, 1000.0])
    assert len(r) == 2 and list(r[1].nbytes) == [400.0, 4000.0]
    kind, ops, nbytes = payload(spec, [100.0])
    assert ops == 2 and list(nbytes) == [404.0]
    model = CostModel.from_link(2, gbit_per_s=1.0, latency_s=1e-3)
    one_round = model.comm_seconds("none", 400.0)
    assert model.comm_seconds(spec, 400.0) > one_round  # two rounds: two start-ups


def test_the_oracle_simulates_rounds_generically():
    grads = _grads(3)
    states = [{} for _ in grads]
    total, states, sent = simulate(Compression.toysign(), grads, states, key="w")
    mx = np.float32(0)
    for g in grads:
        mx = np.float32(mx + np.abs(g).max())
    signs = np.zeros(10, np.float32)
    for g in grads:
        signs = signs + np.sign(g)
    assert np.array_equal(total, signs * (mx * np.float32(1 / 3)))
    assert [len(s) for s in sent] == [2, 2, 2] and all(float(st["calls"][0]) == 1.0 for st in states)


def test_simulated_alltoall_and_disagreeing_ranks():
    class Swap(Oracle):
        name = None  # not registered: driven by hand below

    def exch(x, rank):
        (got,) = yield (Alltoall(np.arange(4, dtype=np.float32) + 10 * rank, (1, 3)),)
        return got

    from hvdcompress.contract import check_round
    from hvdcompress.reference.oracle import answer_round
    answers = answer_round([(Alltoall(np.arange(4, dtype=np.float32), (1, 3)),),
                            (Alltoall(np.arange(4, dtype=np.float32) + 10, (2, 2)),)])
    assert answers[0][0].tolist() == [0.0, 10.0, 11.0] and answers[1][0].tolist() == [1.0, 2.0, 3.0, 12.0, 13.0]
    with pytest.raises(AssertionError, match="different rounds"):
        check_round([(Allreduce(np.zeros(1)),), (Allgather(np.zeros(1)),)])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_torch_toy_matches_its_oracle(world):
    import torch
    import toy_algorithm.torch_toy  # noqa: F401
    from torch_ops.compressors import ExchangeContext, build_compressor
    spec = Compression.toysign(gain=0.5)
    comp = build_compressor(spec)
    np_states = [{} for _ in range(world)]
    t_states = [{} for _ in range(world)]
    for step in range(3):
        grads = _grads(world, seed=step)
        want, _, _ = simulate(spec, grads, np_states, key="w", step=step)
        gens = [comp.exchange(torch.from_numpy(g.copy()), ExchangeContext("w", step, world, 1.0 / world, st, (10,)))
                for g, st in zip(grads, t_states)]
        got, sent = run_lockstep(gens)
        for r in got:
            assert np.array_equal(r.numpy(), want)
        assert sent == [4 + 40] * world
    assert all(float(st["calls"]) == 3.0 for st in t_states)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tf_toy_matches_its_oracle(world):
    import tensorflow as tf
    import toy_algorithm.tf_toy  # noqa: F401
    from tf_ops.compressors import ExchangeContext, build_compressor
    spec = Compression.toysign(gain=0.5)
    comp = build_compressor(spec)
    np_states = [{} for _ in range(world)]
    tf_states = [comp.new_state((10,), tf.float32) for _ in range(world)]
    assert all(v.shape == (1,) for st in tf_states for v in st.values())
    for step in range(3):
        grads = _grads(world, seed=step)
        want, _, _ = simulate(spec, grads, np_states, key="w", step=step)
        gens = [comp.exchange(tf.constant(g), ExchangeContext("w", step, world, 1.0 / world, st, (10,)))
                for g, st in zip(grads, tf_states)]
        got, _ = run_lockstep(gens)
        for r in got:
            assert np.array_equal(r.numpy(), want)


# -- real Horovod --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_workers():
    """The toy algorithm and DGC's default warm-up, in the session's shared 2-worker PyTorch launch."""
    from scenarios.shared_launch import TORCH_2
    return TORCH_2.results("test_contract")


@pytest.mark.multiprocess
def test_toy_algorithm_trains_through_the_real_optimizer(two_workers):
    from scenarios.launch import part
    for r in part(two_workers, "toy"):
        assert "error" not in r, r.get("error")
        assert all(r["identical"]), r["identical"]
        assert all(len(g) == 1 for g in r["groups"])  # auto -> layerwise: the toy cannot merge
        assert set(r["calls"].values()) == {6.0}  # its non-elementwise state was saved per tensor
        assert r["resumed_equal"]
        assert r["stats"]["bytes_per_step"] == sum(4 + 4 * n for n in (12 * 16, 16, 16 * 3, 3))


@pytest.mark.multiprocess
def test_default_dgc_leaves_warmup_without_set_epoch(two_workers):
    from scenarios.launch import part
    from hvdcompress.reference.dgc import dgc_density
    for r in part(two_workers, "warmup"):
        assert "error" not in r, r.get("error")
        spec = Compression.dgc(ratio=0.01, warmup_epoch_steps=2)
        assert r["densities"] == [dgc_density(spec, s // 2) for s in range(12)]
        assert r["densities"][-1] == 0.01 and r["epoch"] == 6 and r["warnings"] == 1 and r["identical"]
        assert r["sent"][0] > 10 * r["sent"][-1]  # 25% of the 64x64 weights at first, 1% at the end


@pytest.mark.multiprocess
def test_every_collective_runs_on_the_process_set_torch(tmp_path):
    from scenarios.launch import run_workers
    from scenarios import contract
    results = run_workers(contract.process_set_torch, 3, env={"HVDCOMPRESS_CACHE": str(tmp_path)})
    for rank, r in enumerate(results):
        assert "error" not in r, r.get("error")
        assert r["done"]
        if rank < 2:
            assert all(r["layerwise"]) and all(r["mgs"])
            assert r["plan"] == "mgs" and r["world"] == 2  # profiled on the 2-rank set
        else:  # outside the set: local steps of the wrapped optimizer, bit for bit Horovod's
            assert r["outside"]["same"] == [True] * 4 and r["outside"]["moved"] > 0
            assert r["outside"]["momentum"] == 0.9  # DGC did not take the momentum over there
            assert "hvdcompress" in r["outside"]["saved"]
    assert any(f.endswith(".json") for f in os.listdir(tmp_path))  # the profiled model was cached


@pytest.mark.multiprocess
def test_every_collective_runs_on_the_process_set_tf(tmp_path):
    # launched by horovodrun: under horovod.runner.run, Horovod 0.28.1 does not register TF's static
    # process sets in the worker (process_set.size() raises); under horovodrun it does
    import json
    import subprocess
    import sys
    from scenarios.launch import GLOO_TIMEOUT_S, HOROVOD_SETTINGS
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]),
               TF_USE_LEGACY_KERAS="1", OMP_NUM_THREADS="1", HOROVOD_CYCLE_TIME=HOROVOD_SETTINGS["HOROVOD_CYCLE_TIME"],
               HOROVOD_GLOO_TIMEOUT_SECONDS=GLOO_TIMEOUT_S)
    proc = subprocess.run(["horovodrun", "-np", "3", "-H", "localhost:3", "--gloo", sys.executable,
                           os.path.join(here, "scenarios", "contract.py"), "process_set_tf", str(tmp_path)],
                          env=env, timeout=300, capture_output=True, text=True)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if "Error" in line or "error" in line or "Traceback" in line]
    assert proc.returncode == 0, "\n".join(errors[-30:])
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(3)]
    for rank, r in enumerate(results):
        assert "error" not in r, r.get("error")
        assert r["done"]
        if rank < 2:
            for schedule in ("layerwise", "single", "mgwfbp"):
                assert all(r[schedule]), (schedule, r[schedule])


def test_an_algorithm_is_added_by_dropping_its_three_modules_into_the_family_folders(tmp_path):
    """tests/toy_algorithm's three modules, copied unchanged into the oracle, PyTorch and TF family
    folders of a copy of the tree (nothing else edited): the spec factory, both backends and TF's
    GradientCompression find the algorithm, and both backends match the oracle."""
    import shutil
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    for pkg in ("hvdcompress", "torch_ops", "tf_ops"):
        shutil.copytree(os.path.join(root, pkg), tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    toy = os.path.join(here, "toy_algorithm")
    shutil.copy(os.path.join(toy, "reference_toy.py"), tmp_path / "hvdcompress" / "reference" / "toysign.py")
    shutil.copy(os.path.join(toy, "torch_toy.py"), tmp_path / "torch_ops" / "compressors" / "toysign.py")
    shutil.copy(os.path.join(toy, "tf_toy.py"), tmp_path / "tf_ops" / "compressors" / "toysign.py")
    script = """
import os
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import numpy as np, tensorflow as tf, torch
from hvdcompress import Compression
from hvdcompress.contract import ExchangeContext
from hvdcompress.reference import simulate
from torch_ops.compressors import build_compressor as torch_build
from tf_ops.compressors import build_compressor as tf_build
from tf_ops.compression import GradientCompression
import torch_ops.compressors.toysign as t, tf_ops.compressors.toysign as f, hvdcompress.reference.toysign as r
assert all(os.path.dirname(m.__file__).endswith(d) for m, d in
           ((t, "torch_ops/compressors"), (f, "tf_ops/compressors"), (r, "hvdcompress/reference")))
spec = Compression.toysign(gain=0.5)
GradientCompression("toysign:gain=0.5")
grads = [np.arange(6, dtype=np.float32) - 2.5, np.ones(6, np.float32)]
want, _, _ = simulate(spec, grads, key="w")
for build, tensor in ((torch_build, torch.from_numpy), (tf_build, tf.constant)):
    comp = build(spec)
    states = [{} for _ in grads] if build is torch_build else [comp.new_state((6,), tf.float32) for _ in grads]
    gens = [comp.exchange(tensor(g.copy()), ExchangeContext("w", 0, 2, 0.5, st, (6,))) for g, st in zip(grads, states)]
    from scenarios.local_world import run_lockstep
    got, _ = run_lockstep(gens)
    assert all(np.array_equal(np.asarray(x), want) for x in got), (got, want)
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), here]))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
