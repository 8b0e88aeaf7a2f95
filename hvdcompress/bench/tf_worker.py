"""One TensorFlow benchmark worker: ``python -m hvdcompress.bench.tf_worker CONFIG.json``.

The ``--framework tf`` counterpart of ``hvdcompress.bench.torch_worker``, started by the harness the
same way (once per rank, the Gloo environment set) and writing the same per-rank JSON, so the
same figures come out of it. It initialises Horovod (``horovod.tensorflow``), fixes TensorFlow to
``threads`` inter-op and ``threads`` intra-op threads before any op runs (and, with
``graph_optimizer`` false, turns Grappler's graph rewrites off), and times one *phase*
per entry, each with its own Keras model (``tf_models``; built from the same seed, then rank 0's
variables broadcast):

- ``compute-only`` (when ``compute_only`` is true): the same model, batch and plain SGD step
  with no exchange at all -- the limit that compression approaches;
- one phase per (compression spec, merge schedule): ``hvdcompress.keras.DistributedOptimizer``
  over the same SGD, with that spec and ``schedule`` (fixed schedules only: "layerwise",
  "single", "size:<MB>"; the harness refuses the others before launching), set to epoch
  ``epoch`` (``gradient_compression.set_epoch``) so a density warm-up is timed where asked.

A step is one ``tf.function`` (forward, backward, ``optimizer.minimize`` with the tape: the
exchange runs inside it, as in ``model.fit``), traced during the warm-up. Warm-up and timing
follow the torch worker: ``warmup`` untimed steps per phase back to back, then ``steps`` (or, with
``phase_budget_s``, as many as fit) interleaved rounds, one timed step of every phase per round, so
a drifting load weighs on all phases alike (``worker_common.timed_round``: the ranks meet, untimed,
after the compute-only step, which leaves them apart). Bytes are the optimizer's own accounting
(``optimizer.stats``: the payload tensors handed to Horovod, counted as the torch engine counts
them), before and after the timed rounds; the interface's counters are read around each timed
step when ``iface`` is set. Compression seconds are not measured (the exchange runs inside the
traced step): ``compute_seconds_per_step`` is null.

After the timed rounds every rank hashes each exchanging phase's variables and the digests are
allgathered: if any phase's parameters differ between ranks the worker fails (``ReplicasDiffer``),
so a broken exchange cannot yield a table. (The compute-only phase exchanges nothing: its ranks
diverge by design.) Plain SGD without momentum everywhere, as in the torch worker.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tf_ops  # noqa: E402,F401  (TF_USE_LEGACY_KERAS before TensorFlow: Horovod's Keras needs Keras 2)
import tensorflow as tf  # noqa: E402

from hvdcompress.schedule.planner import parse_schedule  # noqa: E402

from .worker_common import (COMPUTE_ONLY, check_identical, digest, load_config, read_counters,  # noqa: E402
                            timed_round, timed_rounds)

OPTIONAL = {"schedules": ["layerwise"], "profile": False, "trace_steps": 0, "graph_optimizer": True}
FIXED_SCHEDULES = ("layerwise", "single", "size")


def check_config(cfg: dict) -> None:
    """What this worker cannot do, refused before Horovod starts (the harness refuses it earlier)."""
    if str(cfg["model"]).startswith("emulated:"):
        raise ValueError("compute: emulated compute is torch-only; --framework tf runs the --model on the CPU")
    if cfg["latency_ms"]:
        raise ValueError("latency-ms: latency injection is torch-only (the TF exchange runs inside the traced step)")
    if cfg["profile"]:
        raise ValueError("profile: the cost-model fit is torch-only; --framework tf needs --no-profile")
    if cfg["trace_steps"]:
        raise ValueError("trace-steps: per-group tracing is torch-only")
    for sched in cfg["schedules"]:
        kind = parse_schedule(sched).kind
        if kind not in FIXED_SCHEDULES:
            raise ValueError(f"schedules: {sched!r} is not a fixed schedule; --framework tf takes "
                             "layerwise, single or size:<MB>")


class Phase:
    """One Keras model + optimizer (compressed exchange, or none at all) and what its timed steps cost."""

    def __init__(self, cfg: dict, spec: Optional[str], rank: int, index: int, hvd, schedule: Optional[str] = None):
        import hvdcompress.keras as hvc
        from .tf_models import build, synthetic_batch

        self.spec, self.schedule = spec, schedule
        self.model = build(cfg["model"], seed=cfg["seed"])
        hvd.broadcast_variables(self.model.variables, root_rank=0)
        self.x, self.y = synthetic_batch(cfg["batch"], seed=cfg["seed"] + 1000 * (1 + rank))
        opt = tf.keras.optimizers.SGD(0.01)
        if spec is not None:  # distinct names: each phase's collectives are its own in Horovod
            opt = hvc.DistributedOptimizer(opt, compression=spec, schedule=schedule, name=f"bench{index}")
            opt.gradient_compression.set_epoch(cfg["epoch"])  # schedules (DGC's warm-up) at the epoch asked for
        self.opt = opt
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model, variables, x, y = self.model, self.model.trainable_variables, self.x, self.y

        @tf.function
        def train_step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            opt.minimize(loss, variables, tape=tape)

        self._train_step = train_step
        self.iface = cfg["iface"]
        self.times: List[float] = []
        self.wire = {"tx_bytes": 0, "rx_bytes": 0}
        self._stats_before: Optional[Dict[str, int]] = None
        self._stats_after: Optional[Dict[str, int]] = None

    @property
    def label(self) -> str:
        return COMPUTE_ONLY if self.spec is None else f"{self.spec} @ {self.schedule}"

    def step(self) -> float:
        start = time.perf_counter()
        self._train_step()
        return time.perf_counter() - start

    def _stats(self) -> Dict[str, int]:
        s = self.opt.stats
        return {"steps": s.steps, "bytes": s.total_bytes, "dense": s.total_dense_bytes}

    def start_timing(self) -> None:
        if self.spec is not None:
            self._stats_before = self._stats()

    def end_timing(self) -> None:
        if self.spec is not None:
            self._stats_after = self._stats()

    def timed_step(self) -> None:
        before = read_counters(self.iface)
        self.times.append(self.step())
        after = read_counters(self.iface)
        for key in before:
            self.wire[key] += after[key] - before[key]

    def digest(self) -> str:
        return digest(v.numpy() for v in self.model.trainable_variables)

    def figures(self) -> dict:
        out = {"compression": self.spec if self.spec is not None else COMPUTE_ONLY, "step_times_s": self.times}
        if self.spec is not None:
            now, was = self._stats_after or self._stats(), self._stats_before
            n = now["steps"] - was["steps"]
            if n != len(self.times):
                raise RuntimeError(f"{self.label}: the optimizer counted {n} exchanges over {len(self.times)} "
                                   "timed steps")
            gc = self.opt.gradient_compression
            out.update({"bytes_per_step": (now["bytes"] - was["bytes"]) / n,
                        "dense_bytes_per_step": (now["dense"] - was["dense"]) / n,
                        "compute_seconds_per_step": None,  # not measured: the exchange runs inside the traced step
                        "schedule": self.schedule, "plan": plan_figures(gc),
                        "back_to_back_step_times_s": [], "extra_warmup_steps": 0})
        if self.iface:
            out.update({f"iface_{k}": v for k, v in self.wire.items()})
        return out


def plan_figures(gc) -> Optional[dict]:
    """The groups a phase's ``GradientCompression`` exchanged (no cost model: no prediction)."""
    groups = gc.groups
    if groups is None:
        return None
    plan = gc.plan
    return {"schedule": plan.schedule if plan is not None else gc.schedule, "groups": len(groups),
            "tensors_per_group": [len(g) for g in groups], "predicted_seconds": None,
            "notes": list(plan.notes) if plan is not None else []}


def barrier(hvd, name: str) -> None:
    """Every rank meets here (horovod.tensorflow has no ``barrier``): a 1-element allreduce."""
    hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name=f"bench.barrier.{name}")


def run(cfg: dict, hvd) -> List[dict]:
    """Warm up every phase, time the interleaved rounds, check the ranks' parameters agree;
    the phases' figures."""
    rank = hvd.rank()
    phases = [Phase(cfg, None, rank, 0, hvd)] if cfg["compute_only"] else []
    for spec in cfg["specs"]:
        for sched in cfg["schedules"]:
            phases.append(Phase(cfg, spec, rank, len(phases), hvd, sched))
    barrier(hvd, "built")
    last_round_s = 0.0
    for p in phases:  # back to back; the first step traces the tf.function
        last = 0.0
        start = time.perf_counter()
        for _ in range(cfg["warmup"]):
            last = p.step()
        last_round_s += last
        if rank == 0:
            print(f"[bench worker] {p.label}: {cfg['warmup']} warm-up steps (tracing included) in "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    rounds = timed_rounds(cfg, last_round_s, len(phases), hvd)
    if rank == 0:
        print(f"[bench worker] timing {rounds} interleaved rounds of {len(phases)} phases", flush=True)
    barrier(hvd, "warm")
    for p in phases:
        p.start_timing()
    for _ in range(rounds):
        timed_round(phases, lambda: barrier(hvd, "compute-only"))
    barrier(hvd, "timed")
    for p in phases:
        p.end_timing()
    exchanged = [p for p in phases if p.spec is not None]  # compute-only: each rank its own batch, no exchange
    check_identical([p.label for p in exchanged], [p.digest() for p in exchanged], hvd)
    return [p.figures() for p in phases]


def memory_pass_seconds(numel: int, repeats: int = 7) -> float:
    """One pass over a gradient-sized fp32 buffer -- ``r.assign_add(g)``: one read of g, one read
    and write of r (error feedback's a = g + r) -- median of ``repeats``, on this worker's threads."""
    g = tf.ones([numel], tf.float32)
    r = tf.Variable(tf.zeros([numel], tf.float32))
    r.assign_add(g)  # pages touched once before timing
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r.assign_add(g)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hvdcompress.bench.tf_worker CONFIG.json", file=sys.stderr)
        return 2
    cfg = load_config(argv[0], OPTIONAL)
    check_config(cfg)
    threads = int(cfg["threads"])
    if not cfg["graph_optimizer"]:  # before the first tf.function runs
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    import horovod
    import horovod.tensorflow as hvd

    from .tf_models import build, count_parameters

    hvd.init()
    params, tensors = count_parameters(build(cfg["model"], seed=cfg["seed"]))
    pass_s = memory_pass_seconds(params)
    figures = run(cfg, hvd)
    if hvd.rank() == 0:
        for phase in figures:
            times = sorted(phase["step_times_s"])
            label = phase["compression"] + (f" @ {phase['schedule']}" if phase.get("schedule") else "")
            print(f"[bench worker] {label}: median step {times[len(times) // 2]:.3f} s", flush=True)
        print("[bench worker] parameters identical on every rank in every phase", flush=True)
    result = {"rank": hvd.rank(), "size": hvd.size(), "framework": "tf",
              "threads": tf.config.threading.get_intra_op_parallelism_threads(),
              "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
              "graph_optimizer": bool(cfg["graph_optimizer"]),
              "model": cfg["model"], "parameters": params, "parameter_tensors": tensors,
              "iface": cfg["iface"], "phases": figures, "cost_model": None, "memory_pass_s": pass_s,
              "parameter_check": "every phase's trainable variables bit-identical on every rank after the timed "
                                 "steps (sha256 per rank, allgathered)",
              "versions": {"tensorflow": tf.__version__, "horovod": horovod.__version__,
                           "python": sys.version.split()[0]}}
    with open(cfg["out"].format(rank=hvd.rank()), "w") as f:
        json.dump(result, f)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
