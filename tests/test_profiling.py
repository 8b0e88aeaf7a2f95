"""Profiling on a real 2-worker Gloo job: collectives, compression, backward hooks, the fit, the cache."""

import os

import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios.launch import run_workers as _run  # noqa: E402

SPECS = ["topk:ratio=0.1", "none"]


def _profile_on_every_rank() -> dict:
    import horovod.torch as hvd
    import torch
    import torch.nn as nn

    from torch_ops import profiling

    hvd.init()
    model = profiling.profile_cost_model(SPECS, comm_bytes=[4096, 65536, 262144],
                                         compress_elements=[1024, 8192, 65536], repeats=2)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    workload = profiling.profile_workload(net, lambda: nn.functional.cross_entropy(net(x), y), iters=2,
                                          warmup=1, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    plan = workload.plan("auto", model, "topk:ratio=0.1")
    again = profiling.load_or_profile(["topk:ratio=0.1"])  # from the cache this time
    out = {"model": model.to_dict(), "workload": workload.to_dict(), "groups": plan.groups,
           "schedule": plan.schedule, "predicted": plan.predicted_seconds, "cached": again == model,
           "cache_files": sorted(f for f in os.listdir(os.environ["HVDCOMPRESS_CACHE"])
                                 if f != "native")}  # the compiled selection kernels' folder
    hvd.shutdown()
    return out


def test_profiler_returns_sane_samples_fit_and_identical_plans(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDCOMPRESS_CACHE", str(tmp_path))
    ranks = _run(_profile_on_every_rank, 2)
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
