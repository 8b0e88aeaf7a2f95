"""Flat against two-level exchanges on an EMULATED two-level network: the evidence of issue 43 (items 4-5).

Four torch.distributed (gloo) processes as 2 nodes x 2 ranks on this machine
(``hvdcompress.bench.dist_launch.run_ranks``): the ranks of a node share a network namespace and
reach each other over its own loopback routing (unlimited), and reach the other node only through
the node's link, which ``tbf`` limits to each rate of ``--links`` both ways (no latency added;
needs root). Every figure is labelled "emulated": one machine's 2 cores run all 4 ranks.

Per link, one launch runs these rows, each from the same initial weights, with the same batches
and recipe (``DistributedOptimizer(backend="torch")``, SGD with momentum, ``schedule="auto"``
with its measured validation), for ``--steps`` steps:

* flat dense (``none``, ``topology="flat"``) and hierarchical dense (``none``, ``topology="2x2"``:
  a dense reduce-scatter inside the node, an allreduce of each local rank's slice with its peer
  on the other node, an allgather inside the node; Horovod's hierarchical allreduce);
* per ``--spec``: the spec flat and two-level (dense inside the node, the spec across);
* the default: ``--choice-spec`` with ``topology`` and ``codec_choice`` left to their defaults (the
  launcher's ``LOCAL_WORLD_SIZE``, 2 here, makes it two-level; the per-group codec choice on);
  every other row has ``codec_choice="off"``, so it is the configuration it names;
* with ``--front ddp``, the default through the DDP hook too (layout "choice (ddp)":
  ``hvdcompress.ddp.comm_hook(--choice-spec)`` on ``DistributedDataParallel``, topology left to the
  launcher's, so each bucket chooses flat or two-level, measured; no cost-model schedule, so no
  prediction).

Each row reports: the step time (median over the last ``--measure`` steps of the slowest rank's
step; a barrier starts every step), whether the plan (profiling, measured validation) was settled
before those steps, the bytes the node's link carried per step in its busier direction
(``/sys/class/net`` counters: headers, barriers and every collective that crosses included), the
payload bytes each rank handed to each hop per step (``opt.stats``; two-level rows inside /
across, flat rows the whole exchange), held-out accuracy on the digits test split, and whether
every rank ends with identical parameters. Ratios: two-level against flat of the same spec
(hierarchical against flat dense) and the default against the best flat row and the best row.

The simulator's prediction of each row (``hvdcompress.schedule.scaling.predict_route``; the
default's: ``predict_choice_row``) uses the compute-only workload (``compute_workload``: per-layer
backward times of the same model on every rank at once, no exchange in flight, profiled once per
link before the rows) and a ``TwoLevelCostModel`` fitted on this launch's links before the rows run: the flat model timed
on all 4 ranks (``torch_ops.profiling.profile_cost_model``: collectives and codecs; saved as the
cached model the rows' optimizers then use), the intra model timed on both nodes' local groups at
once, the inter model on both cross-node groups at once (so it holds the sharing of a node's link
by its 2 ranks: ``nics_per_node=2``). Measured / predicted is printed beside each row. A row's own
profiled workload (``opt.workload``, where its plan profiled) includes the contention of its
exchange with the backward pass on the shared cores; the prediction from it is kept in the JSON
(``predicted_own_workload``), not used for the check.

The contention term (``hvdcompress.schedule.scaling.contended_step``: the 4 ranks share the
machine's ``--cores``, so the step is at least ranks/cores x one rank's CPU seconds per step)
takes the CPU seconds the ranks' CPU clocks (``time.process_time``: every thread of the rank,
user and system) measured: the compute-only phase's per step (``compute.cpu_seconds``) and each
row's over its timed steps (``cpu_seconds_per_step``; its exchange's is the difference). CPU time
barely depends on how busy the cores are, unlike the step's wall time. Each row records
``predicted_contended`` beside ``predicted`` (whose ``contended_step_seconds`` is the fits' estimate
of the same term: codec fits and the loopback hop's seconds per byte, no CPU clock), and
``measured_over_contended``. ``--recheck RUN.json --cpu-from OTHER.json`` runs nothing: it puts a
stored run's rows (their step and prediction as stored) through the term with another run's CPU
seconds per step, for runs recorded before the CPU clock was.

The model is a wide MLP on the 8x8 digits (``hvdcompress.datasets.load_digits``): 64 inputs,
``--depth`` hidden layers of ``--width``, 10 classes; with the defaults 2,476,042 parameters
(9.9 MB of fp32 gradients), so dense exchanges at 100 Mbit/s are bound by the wire.

    sudo python benchmarks/two_level_evidence.py --out benchmarks/results/scaling/two-level-evidence
    sudo python benchmarks/two_level_evidence.py --quick --out /tmp/tl-quick   # smoke: < 2 minutes
    # a stored run through the contention term, with the CPU seconds of another run
    python benchmarks/two_level_evidence.py --recheck benchmarks/results/scaling/two-level-evidence.json \
        --cpu-from benchmarks/results/scaling/two-level-cpu.json --out /tmp/recheck
    # the default where two-level wins: qsgd at 100 Mbit/s, through both front ends
    sudo python benchmarks/two_level_evidence.py --links 100mbit --spec qsgd --choice-spec qsgd --front optimizer \
        --front ddp --out benchmarks/results/scaling/two-level-default-qsgd

The full run is sized for about 15 minutes on a quiet 2-core machine. A smoke run proves only
that it runs; the measurement needs a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SPECS = ("dgc:ratio=0.001,warmup_epochs=0", "qsgd", "powersgd:rank=2")
LINKS = "1gbit,100mbit"
TOPOLOGY = "2x2"
QUICK = dict(width=128, depth=1, steps=10, measure=4, links="1gbit", repeats=2)
PROFILE_MAX_BYTES = 4 << 20  # collectives timed up to 4 MiB per rank: the fits are linear in bytes
PROFILE_MAX_ELEMENTS = 1 << 20  # codecs timed up to 1 Mi entries: every rank times them at once on 2 cores
TARGET_SPEEDUP, TARGET_CHOICE = 1.5, 1.05  # issue 43: two-level >= 1.5x flat; the default within 5% of the best flat
FRONTS = ("optimizer", "ddp")  # --front: the default row through DistributedOptimizer, through the DDP hook
CHOICES = {"optimizer": "choice", "ddp": "choice (ddp)"}  # the default row's layout per front


def rows_for(specs, choice_spec: str, topology: str, fronts=("optimizer",)) -> List[dict]:
    """The configurations of one link, in run order (module doc); ``layout`` is a key of
    ``hvdcompress.schedule.scaling.LAYOUT_ROUTES`` or a default row's (``CHOICES``, one per front)."""
    out = [dict(layout="flat dense", spec="none", topology="flat", codec_choice="off"),
           dict(layout="hierarchical dense", spec="none", topology=topology, codec_choice="off")]
    for s in specs:
        out += [dict(layout="flat spec", spec=s, topology="flat", codec_choice="off"),
                dict(layout="two-level spec", spec=s, topology=topology, codec_choice="off")]
    return out + [dict(layout=CHOICES[f], spec=choice_spec, topology=None, codec_choice=None)
                  for f in FRONTS if f in fronts]


def is_choice(row: dict) -> bool:
    """A default row (the choice on), of either front."""
    return row["layout"] in CHOICES.values()


# -- one rank ------------------------------------------------------------------------------------------
def mlp(width: int, depth: int):
    import torch
    layers, last = [torch.nn.Flatten()], 64
    for _ in range(depth):
        layers += [torch.nn.Linear(last, width), torch.nn.ReLU()]
        last = width
    return torch.nn.Sequential(*layers, torch.nn.Linear(last, 10))


def fit_links(cfg: dict, topology) -> dict:
    """The launch's cost models (module doc): ``flat`` (all ranks, codecs too; cached for the rows'
    optimizers), ``intra`` (each node's ranks, both nodes at once) and ``inter`` (each cross-node
    group, all of them at once)."""
    import torch.distributed as dist

    from hvdcompress.schedule.costmodel import fit_cost_model
    from torch_ops.dist_collectives import TorchDistCommunicator, new_subgroups
    from torch_ops.profiling import DEFAULT_COMPRESS_ELEMENTS, comm_sizes_up_to, profile_cost_model, time_collectives

    rank = dist.get_rank()
    sizes = comm_sizes_up_to(min(PROFILE_MAX_BYTES, cfg["gradient_bytes"]))
    elements = comm_sizes_up_to(min(PROFILE_MAX_ELEMENTS, cfg["parameters"]), DEFAULT_COMPRESS_ELEMENTS)
    flat = profile_cost_model([*cfg["specs"], "fp16", "none"], comm_bytes=sizes, compress_elements=elements,
                              repeats=cfg["repeats"], comm=TorchDistCommunicator())
    groups = new_subgroups(topology.local_groups() + topology.cross_groups())
    local = TorchDistCommunicator(groups[topology.node_of(rank)])
    cross = TorchDistCommunicator(groups[topology.nodes + topology.local_rank(rank)])
    fitted = {"flat": flat}
    for name, comm, world in (("intra", local, topology.local_size), ("inter", cross, topology.nodes)):
        timed = time_collectives(("allreduce", "allgather"), sizes, repeats=cfg["repeats"], comm=comm)
        fitted[name] = fit_cost_model(world, timed["allreduce"], timed["allgather"],
                                      meta={"timed_on": f"{name} groups, all at once"})
    return fitted


def predicted(row: dict, workload, fitted: dict, topology, host=None) -> dict:
    """The simulator's step and bytes for ``row`` on ``workload`` (module doc); with ``host``, also
    the fits' estimate of the step on the shared cores (``contended_step_seconds``)."""
    from hvdcompress.schedule.scaling import LAYOUT_ROUTES, predict_choice_row, predict_route
    from hvdcompress.schedule.twolevel import TwoLevelCostModel

    model = TwoLevelCostModel(topology, fitted["flat"], fitted["intra"], fitted["inter"],
                              nics_per_node=topology.local_size)
    if row["layout"] == "choice":
        got = predict_choice_row(workload, model, row["spec"], host=host)
    else:
        got = predict_route(workload, model, row["spec"], LAYOUT_ROUTES[row["layout"]], host=host)
    return {"step_seconds": got["step_seconds"], "label": got["label"], "groups": got["groups"],
            "bytes_per_worker": got["bytes_per_worker"], "inter_bytes_per_node": got["inter_bytes_per_node"],
            **{k: got[k] for k in ("counts", "contended_step_seconds", "cpu_seconds") if k in got}}


def host_of(cfg: dict, fitted: dict):
    """The machine's ranks on its cores (every rank of the launch shares them) and the transport's
    seconds per byte, timed on the node's loopback with every rank busy (the intra fit's hop)."""
    from hvdcompress.schedule.scaling import Host
    from hvdcompress.schedule.twolevel import hop_fit
    return Host(cfg["workers"], cfg["cores"], hop_fit(fitted["intra"]).beta)


def contended(row: dict, step_seconds: float, compute_cpu: float, host) -> dict:
    """The contention term on ``row`` (``hvdcompress.schedule.scaling.contended_step``) with the CPU
    seconds its ranks' CPU clocks measured per step: the compute-only phase's, and the row's (so
    its exchange's: the difference). CPU time barely depends on how the cores are shared; the
    step's wall time is not used."""
    from hvdcompress.schedule.scaling import contended_step
    cpu = row["cpu_seconds_per_step"]
    return {"step_seconds": contended_step(step_seconds, cpu, host), "cpu_seconds": cpu,
            "exchange_cpu_seconds": cpu - compute_cpu, "share": host.share}


class _Front:
    """What a row trains through: ``DistributedOptimizer(backend="torch")``, or for the DDP row the
    DDP hook on ``DistributedDataParallel`` (module doc): the module to call, the optimizer to
    step, the stats, whether its decisions are settled, and what it kept."""

    def __init__(self, row: dict, cfg: dict, model):
        import torch
        sgd = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        self.ddp = row["layout"] == CHOICES["ddp"]
        if self.ddp:
            import hvdcompress.ddp as hddp
            self.net = torch.nn.parallel.DistributedDataParallel(model)
            self.hook, hook = hddp.comm_hook(row["spec"], model=self.net, optimizer=sgd, topology=row["topology"])
            self.net.register_comm_hook(self.hook, hook)
            self.opt, self.stats = sgd, self.hook.stats
        else:
            import hvdcompress.torch as hvc
            self.net = model
            self.opt = hvc.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                compression=row["spec"], backend="torch", topology=row["topology"],
                                                codec_choice=row["codec_choice"])
            self.stats = self.opt.stats

    @property
    def settled(self) -> bool:
        return self.hook.routes_settled if self.ddp else self.opt.engine.scheduler.done

    def described(self) -> dict:
        """topology_used, codec_choice_used and the plan kept (for the DDP row: its buckets' routes)."""
        if self.ddp:
            choice = self.hook.route_choice
            record = choice.record if choice is not None else None
            return dict(topology_used=str(getattr(self.hook.transport, "topology", "flat")), codec_choice_used=None,
                        plan={"schedule": "ddp buckets", "groups": len(choice.groups) if choice is not None else None,
                              "codecs": None, "kept": record["kept_label"] if record else None, "revalidations": None,
                              "routes": dict(self.stats.routes) or None})
        opt, plan = self.opt, self.opt.plan
        tuned = plan.tuning if plan is not None and isinstance(plan.tuning, dict) else {}
        return dict(topology_used=str(getattr(opt.engine.transport, "topology", "flat")),
                    codec_choice_used=opt.codec_choice,
                    plan={"schedule": plan.schedule if plan else None, "groups": len(opt.groups),
                          "codecs": list(plan.codecs) if plan is not None and plan.codecs else None,
                          "kept": tuned.get("kept_label"), "revalidations": tuned.get("revalidations"),
                          "routes": dict(opt.stats.routes) or None})

    @property
    def workload(self):
        return None if self.ddp else self.opt.workload


COMPUTE_CPU_STEPS = 5  # plain steps whose CPU time gives the compute's CPU seconds per step


def compute_workload(cfg: dict, data):
    """The model's per-layer backward, forward and update times with no exchange in flight (every
    rank computes at once, as in training; times averaged over the ranks): the compute-only
    workload the simulator predicts every row from; and the CPU seconds one such step takes by the
    ranks' CPU clocks (``time.process_time``, mean over the ranks and ``COMPUTE_CPU_STEPS`` steps)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from torch_ops.dist_collectives import TorchDistCommunicator
    from torch_ops.profiling import profile_workload

    torch.manual_seed(cfg["seed"])
    model = mlp(cfg["width"], cfg["depth"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    x_train, y_train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    rng = np.random.default_rng([cfg["seed"], dist.get_rank(), 1])

    def closure():
        idx = torch.from_numpy(rng.integers(0, len(y_train), cfg["batch_size"]))
        return torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])

    workload = profile_workload(model, closure, iters=10, warmup=3, optimizer=opt, comm=TorchDistCommunicator())
    began = time.process_time()
    for _ in range(COMPUTE_CPU_STEPS):
        opt.zero_grad()
        closure().backward()
        opt.step()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (time.process_time() - began) / COMPUTE_CPU_STEPS)
    return workload, statistics.fmean(every)


def run_row(row: dict, cfg: dict, data):
    """One configuration on this rank: trained, timed, evaluated. Returns the figures every rank
    agrees on and the workload the optimizer profiled (None where its plan needed none, and for
    the DDP row)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from hvdcompress.bench.worker_common import read_counters

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg["seed"])
    model = mlp(cfg["width"], cfg["depth"])
    front = _Front(row, cfg, model)
    opt, stats = front.opt, front.stats
    x_train, y_train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    rng = np.random.default_rng([cfg["seed"], rank])
    start = cfg["steps"] - cfg["measure"]
    times, cpu, settled, before = [], [], None, None
    for step in range(cfg["steps"]):
        idx = torch.from_numpy(rng.integers(0, len(y_train), cfg["batch_size"]))
        if step == start:
            before = (stats.total_bytes, dict(stats.total_hop_bytes), read_counters(cfg["iface"]))
        dist.barrier()
        began, began_cpu = time.perf_counter(), time.process_time()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(front.net(x_train[idx]), y_train[idx]).backward()
        opt.step()
        if step >= start:
            times.append(time.perf_counter() - began)
            cpu.append(time.process_time() - began_cpu)
        if settled is None and front.settled:
            settled = step + 1
    n = cfg["measure"]
    counters = read_counters(cfg["iface"])
    hops = {k: (v - before[1].get(k, 0)) / n for k, v in stats.total_hop_bytes.items()}
    mine = {"times": times, "cpu": statistics.fmean(cpu), "payload": (stats.total_bytes - before[0]) / n, "hops": hops,
            "link": max(counters[k] - before[2][k] for k in counters) / n if counters else None}
    every = [None] * world
    dist.all_gather_object(every, mine)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(data.x_test)).argmax(1) == torch.from_numpy(data.y_test))
                         .float().mean())
    slowest = [max(ts) for ts in zip(*[e["times"] for e in every])]
    return dict(row, **front.described(), median_step_s=statistics.median(slowest),
                settled_at_step=settled, settled_before_measure=settled is not None and settled <= start,
                cpu_seconds_per_step=statistics.fmean(e["cpu"] for e in every),
                link_bytes_per_step=max((e["link"] or 0) for e in every) if cfg["iface"] else None,
                payload_bytes_per_rank=statistics.fmean(e["payload"] for e in every),
                hop_bytes_per_rank={k: statistics.fmean(e["hops"].get(k, 0.0) for e in every)
                                    for k in every[0]["hops"]} or None,
                held_out_accuracy=accuracy, identical=all(bool(torch.equal(copies[0], c)) for c in copies)), \
        front.workload


def worker_main(cfg_json: str, out_path: str) -> None:
    import warnings

    began = time.perf_counter()
    import torch
    import torch.distributed as dist
    warnings.simplefilter("ignore")
    cfg = json.loads(cfg_json)
    os.environ["HVDCOMPRESS_CACHE"] = cfg["cache"]  # this link's cost model, fitted below, and nothing else
    os.environ["LOCAL_WORLD_SIZE"] = str(cfg["local_size"])  # what torchrun would say: the default's topology
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        from hvdcompress.datasets import load_digits
        from hvdcompress.topology import parse_topology
        topology = parse_topology(cfg["topology"], dist.get_world_size())
        data = load_digits(seed=cfg["seed"])
        if dist.get_rank() == 0:
            print(f"started in {time.perf_counter() - began:.1f} s", flush=True)
        began = time.perf_counter()
        fitted = fit_links(cfg, topology)
        if dist.get_rank() == 0:
            print(f"links fitted in {time.perf_counter() - began:.1f} s", flush=True)
        compute, compute_cpu = compute_workload(cfg, data)
        host = host_of(cfg, fitted)
        rows, workloads = [], []
        for row in rows_for(cfg["specs"], cfg["choice_spec"], cfg["topology"], cfg.get("fronts", ("optimizer",))):
            started = time.perf_counter()
            got, workload = run_row(row, cfg, data)
            got["wall_s"] = round(time.perf_counter() - started, 1)
            rows.append(got)
            workloads.append(workload)
            if dist.get_rank() == 0:
                print(json.dumps({k: got[k] for k in ("layout", "spec", "median_step_s", "held_out_accuracy",
                                                      "identical", "wall_s")}), flush=True)
        if dist.get_rank() == 0:
            for row, workload in zip(rows, workloads):
                if row["layout"] == CHOICES["ddp"]:  # no cost-model schedule: nothing to predict with
                    row["predicted"], row["workload_of"], row["predicted_contended"] = None, None, None
                    continue
                row["predicted"] = predicted(row, compute, fitted, topology, host)
                row["workload_of"] = "compute only"
                row["predicted_contended"] = contended(row, row["predicted"]["step_seconds"], compute_cpu, host)
                # a plan that needed no profiling (PowerSGD's layerwise) has no workload of its own
                row["predicted_own_workload"] = predicted(row, workload, fitted, topology) if workload else None
            with open(out_path, "w") as f:
                json.dump({"rows": rows, "fits": {k: m.to_dict() for k, m in fitted.items()},
                           "compute": {"workload": compute.to_dict(), "cpu_seconds": compute_cpu,
                                       "cores": host.cores, "ranks": host.ranks,
                                       "cpu_per_byte": host.cpu_per_byte}}, f)
    finally:
        dist.destroy_process_group()


# -- the launcher and the tables ---------------------------------------------------------------------------
def link_label(link: str) -> str:
    return f"{link} (tbf, emulated)"


def launch(cfg: dict, link: str, timeout_s: float) -> dict:
    """One link's rows on the emulated two-level network (module doc)."""
    from hvdcompress.bench.dist_launch import run_ranks
    from hvdcompress.topology import parse_topology
    topology = parse_topology(cfg["topology"], cfg["workers"])
    with tempfile.TemporaryDirectory(prefix="hvc-two-level-evidence-") as tmp:
        out = os.path.join(tmp, "result.json")
        mine = dict(cfg, cache=os.path.join(tmp, "cache"), local_size=topology.local_size)

        def command(iface):
            return [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(dict(mine, iface=iface)), out]
        run_ranks(command, cfg["workers"], link, topology.local_size, "tl", timeout_s)
        with open(out) as f:
            got = json.load(f)
    for r in got["rows"]:
        r["link"] = link_label(link)
    return got


def add_ratios(rows: List[dict]) -> List[dict]:
    """Per link: each row's ratios beside it (``speedup_vs_flat``: the flat row of the same spec's
    step over this one's; ``accuracy_vs_flat``: the difference), and one summary per link: the
    default against the best flat row and the best row, the two-level speed-ups against the
    target. Returns the summaries."""
    summaries = []
    for link in dict.fromkeys(r["link"] for r in rows):
        mine = [r for r in rows if r["link"] == link]
        flat = {r["spec"]: r for r in mine if r["layout"] in ("flat dense", "flat spec")}
        for r in mine:
            base = flat.get(r["spec"])
            if base is not None and r is not base:
                r["speedup_vs_flat"] = base["median_step_s"] / r["median_step_s"]
                r["accuracy_vs_flat"] = r["held_out_accuracy"] - base["held_out_accuracy"]
            p = r.get("predicted")
            r["measured_over_predicted"] = r["median_step_s"] / p["step_seconds"] if p else None
            c = r.get("predicted_contended")
            r["measured_over_contended"] = r["median_step_s"] / c["step_seconds"] if c else None
        choice = next((r for r in mine if r["layout"] == CHOICES["optimizer"]), None)
        fixed = [r for r in mine if not is_choice(r)]
        best_flat = min(flat.values(), key=lambda r: r["median_step_s"])
        best = min(fixed, key=lambda r: r["median_step_s"])
        summary = {"link": link, "best_flat": f"{best_flat['layout']} {best_flat['spec']}",
                   "best_fixed": f"{best['layout']} {best['spec']}",
                   "two_level_speedups": {r["spec"]: r["speedup_vs_flat"] for r in mine
                                          if r["layout"] in ("two-level spec", "hierarchical dense")}}
        if choice is not None:
            summary.update(choice_over_best_flat=choice["median_step_s"] / best_flat["median_step_s"],
                           choice_over_best_fixed=choice["median_step_s"] / best["median_step_s"],
                           choice_within_target=choice["median_step_s"] <= TARGET_CHOICE * best_flat["median_step_s"],
                           choice_settled=choice["settled_before_measure"])
        ddp = next((r for r in mine if r["layout"] == CHOICES["ddp"]), None)
        if ddp is not None:
            summary.update(ddp_choice_over_best_flat=ddp["median_step_s"] / best_flat["median_step_s"],
                           ddp_choice_over_best_fixed=ddp["median_step_s"] / best["median_step_s"],
                           ddp_choice_settled=ddp["settled_before_measure"])
        summaries.append(summary)
    return summaries


def recheck(result: dict, cpu_source: dict) -> List[dict]:
    """The contention term on the rows of a stored run (``result``) whose CPU was not clocked: each
    row's stored prediction (``predicted``, unchanged) through ``contended_step`` with the CPU
    seconds per step of the same link, layout and spec in ``cpu_source``, another run's JSON
    (a default row takes the fixed row its kept plan matches when the specs differ: one route for
    every group). The share of the cores is ``cpu_source``'s (its ranks on its cores). Rows with
    their own CPU clock keep it."""
    from hvdcompress.schedule.scaling import Host, contended_step
    measured = {(r["link"], r["layout"], r["spec"]): r for r in cpu_source["rows"]
                if r.get("cpu_seconds_per_step") is not None}
    out = []
    for r in result["rows"]:
        p = r.get("predicted")
        if not p:
            continue
        compute = cpu_source["compute"][r["link"]]
        host = Host(compute["ranks"], compute["cores"])
        source, of = (r, "this row") if r.get("cpu_seconds_per_step") is not None else (None, None)
        if source is None:
            source = measured.get((r["link"], r["layout"], r["spec"]))
            of = "the same row of the CPU source" if source is not None else None
        if source is None and is_choice(r):
            routes = _routes(r)
            fixed = [m for m in measured.values() if m["link"] == r["link"] and not is_choice(m)
                     and len(routes) == 1 and routes == _routes(m)]
            source, of = (fixed[0], f"the CPU source's {fixed[0]['layout']} {fixed[0]['spec']}") if fixed \
                else (None, None)
        row = {k: r[k] for k in ("link", "layout", "spec", "median_step_s")}
        row.update(predicted_s=p["step_seconds"], measured_over_predicted=r["median_step_s"] / p["step_seconds"],
                   cpu_seconds_per_step=None, cpu_of=of, contended_s=None, measured_over_contended=None)
        if source is not None:
            cpu = source["cpu_seconds_per_step"]
            step = contended_step(p["step_seconds"], cpu, host)
            row.update(cpu_seconds_per_step=cpu, share=host.share, contended_s=step,
                       measured_over_contended=r["median_step_s"] / step)
        out.append(row)
    return out


def _routes(row: dict) -> set:
    """The routes a row's groups took ("flat dgc:ratio=0.001", ...): as its plan recorded them (a
    default row), or its layout's (a fixed row)."""
    from hvdcompress.schedule.scaling import LAYOUT_ROUTES
    from hvdcompress.schedule.twolevel import label
    got = set(((row.get("plan") or {}).get("routes") or {}).values())
    if not got and row["layout"] in LAYOUT_ROUTES:
        got = {label(LAYOUT_ROUTES[row["layout"]], row["spec"])}
    return got


def recheck_markdown(rows: List[dict], note: str) -> str:
    out = [note, "", "| link | layout | spec | step ms | predicted ms | measured/predicted | CPU ms/step (of) "
           "| contended ms | measured/contended |", "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        cpu = f"{1e3 * r['cpu_seconds_per_step']:.1f} ({r['cpu_of']})" if r["cpu_of"] else "-"
        out.append("| " + " | ".join([
            r["link"], r["layout"], f"`{r['spec']}`", f"{1e3 * r['median_step_s']:.1f}", f"{1e3 * r['predicted_s']:.1f}",
            f"{r['measured_over_predicted']:.2f}", cpu,
            f"{1e3 * r['contended_s']:.1f}" if r["contended_s"] else "-",
            f"{r['measured_over_contended']:.2f}" if r["measured_over_contended"] else "-"]) + " |")
    got = [r["measured_over_contended"] for r in rows if r["measured_over_contended"]]
    if got:
        out += ["", f"measured/contended {min(got):.2f}-{max(got):.2f} over {len(got)} rows; "
                f"{sum(abs(x - 1) <= 0.15 for x in got)} within 15%"]
    return "\n".join(out) + "\n"


def _mb(v) -> str:
    return "-" if v is None else f"{v / 1e6:.3g}"


def markdown(result: dict) -> str:
    m = result["model"]
    out = [f"**EMULATED two-level network**: {result['workers']} processes as {result['topology']} "
           f"(nodes over one tbf-limited link each, ranks of a node over its loopback), one machine "
           f"({os.cpu_count()} cores); MLP {m['parameters']:,} parameters ({_mb(m['gradient_bytes'])} MB of gradients), "
           f"{result['steps']} steps, step time = median of the slowest rank over the last {result['measure']}.", "",
           "| link | layout | spec | step ms | vs flat | predicted ms | measured/predicted | contended ms "
           "| measured/contended | CPU ms/step | node link MB/step "
           "| predicted MB/node across | payload MB/rank: inside / across | accuracy | vs flat | identical | settled |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|"]
    for r in result["rows"]:
        p, c = r.get("predicted") or {}, r.get("predicted_contended")
        hops = r.get("hop_bytes_per_rank")
        payload = f"{_mb(hops.get('local'))} / {_mb(hops.get('cross'))}" if hops else f"{_mb(r['payload_bytes_per_rank'])} (flat)"
        spec = r["spec"] + (f" ({r['plan']['kept']})" if is_choice(r) and r["plan"].get("kept") else "")
        if is_choice(r) and r["plan"].get("routes"):  # the route and spec of each group, counted
            routes = list(r["plan"]["routes"].values())
            spec += "; " + ", ".join(f"{routes.count(x)}x {x}" for x in sorted(set(routes)))
        out.append("| " + " | ".join([
            r["link"], r["layout"], f"`{spec}`", f"{1e3 * r['median_step_s']:.1f}",
            f"{r['speedup_vs_flat']:.2f}x" if r.get("speedup_vs_flat") else "-",
            f"{1e3 * p['step_seconds']:.1f}" if p else "-",
            f"{r['measured_over_predicted']:.2f}" if r.get("measured_over_predicted") else "-",
            f"{1e3 * c['step_seconds']:.1f}" if c else "-",
            f"{r['measured_over_contended']:.2f}" if r.get("measured_over_contended") else "-",
            f"{1e3 * r['cpu_seconds_per_step']:.1f}" if r.get("cpu_seconds_per_step") is not None else "-",
            _mb(r["link_bytes_per_step"]), _mb(p.get("inter_bytes_per_node")), payload,
            f"{r['held_out_accuracy']:.4f}",
            f"{100 * r['accuracy_vs_flat']:+.2f} pt" if r.get("accuracy_vs_flat") is not None else "-",
            str(r["identical"]), str(r["settled_before_measure"])]) + " |")
    out.append("")
    for s in result["summary"]:
        speed = ", ".join(f"{k}: {v:.2f}x" for k, v in s["two_level_speedups"].items())
        line = f"- {s['link']}: two-level / hierarchical over flat of the same spec: {speed} (target >= {TARGET_SPEEDUP}x " \
               f"where the slow hop dominates); best flat: {s['best_flat']}"
        if "choice_over_best_flat" in s:
            line += (f"; the default takes {s['choice_over_best_flat']:.3f}x the best flat row's step "
                     f"({'within' if s['choice_within_target'] else 'OUTSIDE'} the {TARGET_CHOICE:g}x target; "
                     f"{s['choice_over_best_fixed']:.3f}x the best row, {s['best_fixed']})")
        if "ddp_choice_over_best_flat" in s:
            line += (f"; the DDP hook's default takes {s['ddp_choice_over_best_flat']:.3f}x the best flat row's step "
                     f"({s['ddp_choice_over_best_fixed']:.3f}x the best row)")
        out.append(line)
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", default=LINKS, help="comma-separated rates of the links between nodes (tbf)")
    p.add_argument("--spec", action="append", default=None, help=f"repeatable; default: {', '.join(SPECS)}")
    p.add_argument("--choice-spec", default=None, help="the default row's spec (default: the first --spec)")
    p.add_argument("--front", action="append", choices=FRONTS, default=None,
                   help="repeatable: the front ends the default row runs through (default: optimizer)")
    p.add_argument("--topology", default=TOPOLOGY, help="NxL: N nodes of L ranks")
    p.add_argument("--steps", type=int, default=80, help="training steps per row")
    p.add_argument("--measure", type=int, default=20, help="the last steps, timed")
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--depth", type=int, default=2, help="hidden layers")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timings per size when fitting the links")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per link before the ranks are stopped")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                   help="cores the ranks share (the contention term; default: the cores this process may use)")
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "scaling", "two-level-evidence"),
                   help="writes OUT.json and OUT.md")
    p.add_argument("--recheck", default=None, metavar="RUN.json",
                   help="run nothing: the contention term on a stored run's rows (recheck), CPU from --cpu-from")
    p.add_argument("--cpu-from", default=None, metavar="RUN.json",
                   help="with --recheck: the run whose rows' CPU seconds per step are used (default: RUN.json)")
    args = p.parse_args(argv)
    if args.recheck:
        return _recheck(args)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    specs = args.spec or list(SPECS)
    from hvdcompress.bench.netns import missing_prerequisites, parse_bandwidth
    from hvdcompress.spec import resolve
    from hvdcompress.topology import parse_topology
    try:
        for s in specs + ([args.choice_spec] if args.choice_spec else []):
            resolve(s)
        links = [s.strip() for s in args.links.split(",") if s.strip()]
        for link in links:
            parse_bandwidth(link)
        topology = parse_topology(args.topology, _world(args.topology))
    except ValueError as e:
        p.error(str(e))
    if topology.flat:
        p.error(f"--topology: a two-level layout is needed (nodes and local size > 1); got {args.topology}")
    if not 1 <= args.measure < args.steps:
        p.error("--measure: must be >= 1 and below --steps")
    if args.cores < 1:
        p.error(f"--cores: must be an integer >= 1; got {args.cores}")
    why = missing_prerequisites()
    if why:
        p.error(f"the emulated network needs network namespaces: {why}")
    parameters = sum(o * i + o for i, o in zip([64] + [args.width] * args.depth, [args.width] * args.depth + [10]))
    cfg = {"workers": topology.world, "topology": args.topology, "specs": specs,
           "choice_spec": args.choice_spec or specs[0], "fronts": list(dict.fromkeys(args.front or ["optimizer"])),
           "steps": args.steps, "measure": args.measure,
           "width": args.width, "depth": args.depth, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
           "repeats": args.repeats, "parameters": parameters, "gradient_bytes": 4 * parameters, "cores": args.cores}
    rows, fits, compute = [], {}, {}
    for link in links:
        started = time.perf_counter()
        got = launch(cfg, link, args.timeout)
        rows += got["rows"]
        fits[link_label(link)] = got["fits"]
        compute[link_label(link)] = got["compute"]
        print(f"{link_label(link)}: {time.perf_counter() - started:.0f} s", flush=True)
    result = {"label": "EMULATED: one machine, network namespaces and tbf (hvdcompress.bench.dist_launch)",
              "command": "python benchmarks/two_level_evidence.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "workers": topology.world, "topology": args.topology, "steps": args.steps, "measure": args.measure,
              "model": {"kind": "MLP on digits", "width": args.width, "depth": args.depth, "parameters": parameters,
                        "gradient_bytes": 4 * parameters, "batch_size": args.batch_size, "lr": args.lr},
              "links": [link_label(link) for link in links], "fits": fits, "compute": compute, "rows": rows}
    result["summary"] = add_ratios(rows)
    table = markdown(result)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    return 0


def _recheck(args) -> int:
    with open(args.recheck) as f:
        result = json.load(f)
    with open(args.cpu_from or args.recheck) as f:
        source = json.load(f)
    if "compute" not in source:
        raise SystemExit(f"--cpu-from {args.cpu_from or args.recheck}: no CPU clocked in it (a run before the "
                         "contention term)")
    rows = recheck(result, source)
    note = (f"Contention term (hvdcompress.schedule.scaling.contended_step) on the rows of {args.recheck} "
            f"(their measured step and stored prediction), CPU seconds per step from {args.cpu_from or args.recheck}.")
    table = recheck_markdown(rows, note)
    print(table)
    with open(args.out + ".json", "w") as f:
        json.dump({"note": note, "recheck": args.recheck, "cpu_from": args.cpu_from or args.recheck,
                   "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    return 0


def _world(text: str) -> int:
    """The ranks of an ``NxL`` layout (the launch makes exactly that many)."""
    nodes, _, local = str(text).partition("x")
    try:
        return int(nodes) * int(local)
    except ValueError:
        raise ValueError(f"--topology: expected NxL (e.g. 2x2); got {text!r}") from None


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(main())
