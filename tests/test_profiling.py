"""Profiling on a real 2-worker Gloo job: collectives, compression, backward hooks, the fit, the cache."""

import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios.launch import part  # noqa: E402
from scenarios.shared_launch import TORCH_2  # noqa: E402


def test_profiler_returns_sane_samples_fit_and_identical_plans():
    ranks = part(TORCH_2.results("test_profiling"), "profile")  # scenarios/profiling.py, a fresh cache
    r0 = ranks[0]
    assert all(r["model"] == r0["model"] and r["workload"] == r0["workload"] for r in ranks)
    assert all(r["groups"] == r0["groups"] and r["cached"] for r in ranks)
    model = r0["model"]
    assert model["world_size"] == 2 and model["key"].startswith("n2-")
    samples = model["meta"]["samples"]
    for kind in ("allreduce", "allgather"):
        assert [b for b, _ in samples[kind]] == [4096, 65536, 262144]
        assert all(0 < t < 5 for _, t in samples[kind])
        fit = model[kind]
        assert fit["alpha"] >= 0 and fit["beta"] >= 0 and fit["alpha"] + fit["beta"] > 0
    assert set(model["compress"]) == {"topk:ratio=0.1,residual=true", "none"}
    assert all(0 < t < 5 for _, t in samples["compress"]["topk:ratio=0.1,residual=true"])
    assert model["compress"]["topk:ratio=0.1,residual=true"]["form"] in ("dlogd", "linear")
    w = r0["workload"]
    assert w["names"][:2] in (["4.bias", "4.weight"], ["4.weight", "4.bias"])  # the last layer first
    assert sorted(w["names"]) == sorted(f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias"))
    assert w["sizes_bytes"][w["names"].index("2.weight")] == 64 * 64 * 4
    assert all(t >= 0 for t in w["t_b"]) and sum(w["t_b"]) > 0 and w["forward_seconds"] > 0
    assert r0["schedule"] == "mgs" and sum(len(g) for g in r0["groups"]) == 6 and r0["predicted"] > 0
    assert r0["cache_files"] == [f"costmodel-{model['key']}.json"]
