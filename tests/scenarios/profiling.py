"""Worker code for tests/test_profiling.py: the profiler on a real job (collectives, compression,
backward hooks, the fit, the cache)."""

from __future__ import annotations

import os

SPECS = ["topk:ratio=0.1", "none"]


def profile_on_every_rank(cache_dir: str) -> dict:
    """Profile into the empty cache ``cache_dir``, plan a small model, then load from the cache."""
    import horovod.torch as hvd
    import torch
    import torch.nn as nn

    from torch_ops import profiling

    os.environ["HVDCOMPRESS_CACHE"] = cache_dir
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
           "cache_files": sorted(f for f in os.listdir(cache_dir) if f != "native")}  # (compiled kernels)
    hvd.shutdown()
    return out
