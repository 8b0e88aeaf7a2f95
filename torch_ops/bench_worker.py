"""One benchmark worker: ``python -m torch_ops.bench_worker CONFIG.json``.

Started by the harness (``hvdcompress bench``, see ``hvdcompress.bench``) once per rank, with the
Gloo environment already set (rank, size, rendezvous address, interface). It initialises Horovod,
fixes torch to ``threads`` CPU threads, and measures one *phase* per entry:

- ``compute-only`` (when ``compute_only`` is true): the same model, batch and plain SGD step
  with no exchange at all -- the limit that compression approaches. Every rank runs it at the same
  time, so the ranks share the CPU cores as they do in the exchanging phases;
- one phase per compression spec: ``DistributedOptimizer`` with that spec, set to epoch ``epoch``
  (``opt.set_epoch``) so a schedule such as DGC's density warm-up is timed where asked.

Each phase runs ``warmup`` steps, then ``steps`` timed steps (zero_grad, forward, backward,
``step()``, which waits for the exchange), between two barriers; with ``phase_budget_s`` set, only
as many timed steps as fit in that many seconds at the last warm-up step's pace (at least 3), so
a slow link does not make a sweep endless. It records each step's time,
the optimizer's own accounting over the timed steps (payload bytes, dense bytes, compression
seconds: ``opt.stats``) and, when ``iface`` is set, the interface's byte counters
(``/sys/class/net/<iface>/statistics``) before and after, so the bytes that really crossed the
link can be compared with the payload. The rank writes its figures as JSON to ``out``.

Every rank builds the model from the same seed, so parameters start identical without a
broadcast (which would cost seconds per phase on a slow link). Plain SGD without momentum is
used in every phase, so the compressors that keep momentum themselves (DGC) fit too; only the
time of a step matters here, not what it learns.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .bench_models import build, count_parameters, synthetic_batch
from .collectives import HorovodDriver
from .injected_latency import LatencyDriver
from .optimizer import DistributedOptimizer

COMPUTE_ONLY = "compute-only"
MIN_STEPS = 3  # timed steps per phase, whatever the time budget
REQUIRED = ("model", "batch", "steps", "warmup", "threads", "seed", "compute_only", "specs",
            "latency_ms", "epoch", "iface", "out")


def read_counters(iface: Optional[str]) -> Dict[str, int]:
    """tx/rx byte counters of ``iface`` in this process's network namespace ({} without one)."""
    if not iface:
        return {}
    out = {}
    for key in ("tx_bytes", "rx_bytes"):
        with open(f"/sys/class/net/{iface}/statistics/{key}") as f:
            out[key] = int(f.read())
    return out


def _stats_totals(opt) -> Dict[str, float]:
    s = opt.stats
    return {"steps": s.steps, "bytes": s.total_bytes, "dense": s.total_dense_bytes,
            "compute": s.total_compute_seconds}


def timed_steps(cfg: dict, warmup_times: List[float], hvd) -> int:
    """``steps``, or fewer when ``phase_budget_s`` is set: as many as fit in the budget at rank 0's
    last warm-up step time (at least ``MIN_STEPS``). Rank 0 decides, every rank follows."""
    budget = cfg.get("phase_budget_s")
    if not budget or not warmup_times:
        return cfg["steps"]
    fit = int(budget / max(warmup_times[-1], 1e-6))
    return int(hvd.broadcast_object(min(cfg["steps"], max(MIN_STEPS, fit)), root_rank=0))


def run_phase(cfg: dict, spec: Optional[str], hvd) -> dict:
    """Warm up, then time ``cfg['steps']`` training steps with ``spec`` (None: no exchange)."""
    model = build(cfg["model"], seed=cfg["seed"])
    x, y = synthetic_batch(cfg["batch"], seed=cfg["seed"] + 1000 * (1 + hvd.rank()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if spec is not None:
        latency_s = cfg["latency_ms"] / 1000.0
        driver = LatencyDriver(latency_s) if latency_s > 0 else HorovodDriver()
        opt = DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=spec,
                                   driver=driver)
        opt.set_epoch(cfg["epoch"])  # schedules (DGC's density warm-up) at the epoch asked for

    def train_step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return time.perf_counter() - start

    hvd.barrier()
    warmup_times = [train_step() for _ in range(cfg["warmup"])]
    steps = timed_steps(cfg, warmup_times, hvd)
    hvd.barrier()
    before_stats = _stats_totals(opt) if spec is not None else None
    before_iface = read_counters(cfg["iface"])
    times: List[float] = [train_step() for _ in range(steps)]
    after_iface = read_counters(cfg["iface"])
    phase = {"compression": spec if spec is not None else COMPUTE_ONLY, "step_times_s": times}
    if spec is not None:
        after = _stats_totals(opt)
        n = after["steps"] - before_stats["steps"]
        phase.update({
            "bytes_per_step": (after["bytes"] - before_stats["bytes"]) / n,
            "dense_bytes_per_step": (after["dense"] - before_stats["dense"]) / n,
            "compute_seconds_per_step": (after["compute"] - before_stats["compute"]) / n,
        })
    if before_iface:
        phase.update({f"iface_{k}": after_iface[k] - before_iface[k] for k in before_iface})
    hvd.barrier()
    del opt, model
    gc.collect()
    return phase


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m torch_ops.bench_worker CONFIG.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        cfg = json.load(f)
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"bench worker config {argv[0]}: missing keys {', '.join(missing)}")

    torch.set_num_threads(int(cfg["threads"]))
    import horovod
    import horovod.torch as hvd

    hvd.init()
    params, tensors = count_parameters(build(cfg["model"], seed=cfg["seed"]))
    phases = [None] if cfg["compute_only"] else []
    phases += list(cfg["specs"])
    result = {"rank": hvd.rank(), "size": hvd.size(), "threads": torch.get_num_threads(),
              "model": cfg["model"], "parameters": params, "parameter_tensors": tensors,
              "iface": cfg["iface"], "phases": [],
              "versions": {"torch": torch.__version__, "horovod": horovod.__version__,
                           "python": sys.version.split()[0]}}
    for spec in phases:
        phase = run_phase(cfg, spec, hvd)
        result["phases"].append(phase)
        if hvd.rank() == 0:
            times = sorted(phase["step_times_s"])
            print(f"[bench worker] {phase['compression']}: median step {times[len(times) // 2]:.3f} s",
                  flush=True)
    with open(cfg["out"].format(rank=hvd.rank()), "w") as f:
        json.dump(result, f)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
