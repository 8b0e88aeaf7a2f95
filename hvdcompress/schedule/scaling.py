"""Predicted step time and scaling efficiency at scale, from a fitted cost model.

Everything this module outputs is a PREDICTION of the model in ``hvdcompress.schedule.costmodel`` and
``hvdcompress.schedule.timeline``, not a measurement: the collectives' alpha-beta fits are carried from the
world size they were measured at to 16..1024 workers by ring-algorithm scaling (a_N ~ (N-1),
b_N ~ (N-1)/N), optionally with another link bandwidth; compression and backward times are those
profiled on one worker. Where measured step times are supplied (``--measured``), the prediction
for those configurations is printed next to them with its relative error.

    step(N)       = forward + end of the backward/exchange timeline of the plan + update
    efficiency(N) = (forward + backward + update) / step(N)   (1.0: communication fully hidden)
    speedup(N)    = N * efficiency(N)                          (vs one worker without exchange)

Usage (the profile comes from ``python -m hvdcompress.bench.profile transport --model ... --out profile.json``)::

    python -m hvdcompress.schedule.scaling --profile profile.json --gbps 0.1,1,10 \\
        --compression none --compression topk:ratio=0.01 --out sim.json --plot sim.png
    python -m hvdcompress.schedule.scaling --link 1,50 --synthetic 160,100,200,100   # no profile at hand
    python -m hvdcompress.schedule.scaling --bench benchmarks/results/scheduler/schedules-deep.json   # from a benchmark

With ``--bench`` the cost model fitted on the emulated link of one launch of ``hvdcompress bench``
(``--bench-launch``), the workload profiled by that launch's first phase that has one, and every
step time measured in that launch are used: the error of the model is shown on exactly the
configurations that were measured, next to its predictions for 16..1024 workers.

Two levels (``--gpus-per-node L --intra-gbps X``): the workers are nodes of L ranks whose links
inside a node run at X Gbit/s (an ideal ring, ``--intra-latency-us``) and whose links between nodes
are the model's (or ``--gbps``); ``two_level_sweep`` predicts, per worker count and inter-node rate,
flat dense, hierarchical dense (Horovod's hierarchical allreduce), and per spec flat spec, two-level
spec (dense inside; ``hvdcompress.schedule.twolevel``), with ``--gtopk`` both with a global top-k
across (top-k, DGC), and the planner's choice of route and spec per group; each with bytes per
worker per step on each link class. ``--codec-fit SPEC=FORM,A,B`` and ``--codec-times FILE`` (a
``benchmarks/cuda_check.py`` JSON: a linear fit per spec over its sizes) give compression times
where the model has none. ``--measured`` with two levels takes records of measured steps
(``compare_two_level``: workers, layout, compression, seconds, and the inter-node rate, ranks per
node and intra rate where they differ) and prints each prediction's error and whether all are
within 15%. ``--cores C`` (with ``--cpu-per-byte``) says a node's ranks share C cores: each row adds
the step on those shared cores (``contended_step``: the host's CPU work against the timeline; not
given, each rank has its own device and nothing changes)::

    python -m hvdcompress.schedule.scaling --link 1,50 --workload w.json --gpus-per-node 8 \\
        --intra-gbps 2400 --gbps 1,10,100 --workers 16,128,1024 --compression dgc:ratio=0.001 --gtopk \\
        --codec-times benchmarks/results/kernels/cuda_check-h200-ede7fe8.json --out two-level.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from typing import Iterable, List, Optional, Sequence

import numpy as np

from .costmodel import ComputeFit, CostModel, fit_compute
from .planner import Workload, parse_schedule
from .twolevel import (FLAT, GATHER, GTOPK, GTOPK_SPECS, HIERARCHICAL, TWO_LEVEL, Candidate, Route, TwoLevelCostModel,
                       candidates, label, plan_routes, spec_label, step_bytes)
from ..spec import resolve
from ..topology import Topology

NOTE = ("PREDICTIONS from the fitted cost model (alpha-beta collectives scaled to N workers by ring "
        "formulas, profiled compression and backward times), not measurements")
DEFAULT_WORKERS = (16, 32, 64, 128, 256, 512, 1024)
DEFAULT_SCHEDULES = ("layerwise", "single", "size:64", "auto")
TWO_LEVEL_NOTE = ("PREDICTIONS of the two-level cost model (hvdcompress.schedule.twolevel: ring collectives per "
                  "link class, the cross-node link shared by a node's ranks), not measurements; the links, the "
                  "NICs per node and any codec times not measured are ASSUMED")


def synthetic_workload(tensors: int, total_mb: float, backward_ms: float, forward_ms: float,
                       seed: int = 0) -> Workload:
    """A stand-in model: ``tensors`` parameter tensors whose sizes span three decades (log-uniform,
    fixed seed) and add up to ``total_mb`` MiB; backward time split half evenly per tensor, half
    in proportion to size."""
    rng = np.random.default_rng(seed)
    raw = np.exp(rng.uniform(0, math.log(1000), tensors))
    sizes = np.maximum(4, np.round(raw / raw.sum() * total_mb * (1 << 20) / 4) * 4)
    t_b = backward_ms / 1e3 * (0.5 / tensors + 0.5 * sizes / sizes.sum())
    return Workload(tuple(f"t{i}" for i in range(tensors)), tuple(sizes.tolist()), tuple(t_b.tolist()),
                    forward_ms / 1e3, 0.0)


def model_at(cost_model: CostModel, workers: int, gbps: Optional[float] = None,
             latency_s: Optional[float] = None) -> CostModel:
    """The cost model for ``workers`` ranks (the fitted one when nothing changes)."""
    if workers == cost_model.world_size and gbps is None and latency_s is None:
        return cost_model
    return cost_model.for_world_size(workers, gbps, latency_s)


def predict_step(workload: Workload, cost_model: CostModel, spec, schedule, workers: int,
                 gbps: Optional[float] = None, latency_s: Optional[float] = None,
                 overlap: str = "shared") -> dict:
    """One configuration: the plan's predicted step, efficiency and speedup (module doc)."""
    spec = resolve(spec)
    model = model_at(cost_model, workers, gbps, latency_s)
    plan = workload.plan(schedule, model, spec, workers, overlap=overlap)
    compute = workload.compute_seconds
    step = plan.predicted_seconds
    return {"workers": workers, "gbps": gbps, "compression": str(spec), "schedule": str(parse_schedule(schedule)),
            "plan": plan.schedule, "groups": len(plan.groups), "step_seconds": step,
            "compute_seconds": compute, "exposed_seconds": step - compute, "efficiency": compute / step,
            "speedup": workers * compute / step}


def sweep(workload: Workload, cost_model: CostModel, specs: Iterable, schedules: Iterable,
          workers: Iterable[int] = DEFAULT_WORKERS, gbps: Iterable[Optional[float]] = (None,),
          latency_s: Optional[float] = None, overlap: str = "shared") -> List[dict]:
    return [predict_step(workload, cost_model, spec, sched, n, g, latency_s, overlap)
            for g in gbps for spec in specs for sched in schedules for n in workers]


def compare(measured: Sequence[dict], workload: Workload, cost_model: CostModel,
            latency_s: Optional[float] = None, overlap: str = "shared") -> List[dict]:
    """Prediction vs measurement. Each record: workers, compression, schedule, seconds (measured
    step time) and optionally gbps (None: the transport the model was fitted on)."""
    rows = []
    for m in measured:
        missing = {"workers", "compression", "schedule", "seconds"} - set(m)
        if missing:
            raise ValueError(f"measured record {m!r} lacks {', '.join(sorted(missing))}")
        row = predict_step(workload, cost_model, m["compression"], m["schedule"], int(m["workers"]),
                           m.get("gbps"), latency_s, overlap)
        row["measured_seconds"] = float(m["seconds"])
        row["rel_error"] = row["step_seconds"] / row["measured_seconds"] - 1.0
        rows.append(row)
    return rows


def _label(row: dict) -> str:
    plan = row["schedule"] if row["schedule"] == row["plan"] else f"{row['schedule']}={row['plan']}"
    return f"{row['compression']} / {plan}"


def plot(rows: Sequence[dict], path: str, measured: Sequence[dict] = (), title: str = "") -> None:
    """Efficiency vs workers, one panel per bandwidth, one line per compressor and schedule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bands = list(dict.fromkeys(r["gbps"] for r in rows))
    fig, axes = plt.subplots(1, len(bands), figsize=(5.2 * len(bands), 4.2), squeeze=False, sharey=True)
    for ax, band in zip(axes[0], bands):
        lines = {}
        for r in rows:
            if r["gbps"] == band:
                lines.setdefault(_label(r), []).append((r["workers"], r["efficiency"]))
        for label, pts in lines.items():
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", ms=3, label=label)
        for m in measured:
            if m["gbps"] == band:
                ax.scatter([m["workers"]], [m["compute_seconds"] / m["measured_seconds"]], marker="x", s=50,
                           color="k", zorder=5, label="measured" if m is measured[0] else None)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("workers")
        ax.set_title("fitted link" if band is None else f"{band:g} Gbit/s links")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("predicted scaling efficiency")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle((title + "\n" if title else "") + "Predictions from the fitted cost model, not measurements",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- cores shared by ranks -------------------------------------------------------------------------
@dataclass(frozen=True)
class Host:
    """Where ranks share a machine's cores: ``ranks`` ranks on ``cores`` cores, and the transport's
    seconds per byte a rank sends (``cpu_per_byte``: Gloo's copies and sums, the TCP stack), timed
    as the codecs and the workload are, with the host's ranks all busy at once; a link that only
    moves bytes through the CPU measures it (a node's loopback: ``hop_fit(intra).beta``). Used by
    ``contended_step`` and ``exchange_cpu_estimate``."""

    ranks: int
    cores: int
    cpu_per_byte: float = 0.0

    def __post_init__(self):
        for name in ("ranks", "cores"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"host: {name} must be an integer >= 1; got {v!r}")
        c = self.cpu_per_byte
        if isinstance(c, bool) or not isinstance(c, (int, float, np.floating)) or not (math.isfinite(c) and c >= 0):
            raise ValueError(f"host: cpu_per_byte must be a finite number of seconds >= 0; got {c!r}")

    @property
    def share(self) -> float:
        """Ranks per core where they outnumber the cores, else 1 (each rank has its own)."""
        return max(1.0, self.ranks / self.cores)

    @property
    def oversubscribed(self) -> bool:
        return self.ranks > self.cores


def contended_step(step_seconds: float, cpu_seconds: float, host: Optional[Host]) -> float:
    """A step on a host whose ranks share its cores (issue 43's missing term).

    The timeline (``timeline.py``) gives a rank's compute stream and its transfers separate
    resources: a transfer overlaps the backward after it. That holds where each rank has its own
    device or cores. Where a host's R ranks share C < R cores, every CPU second any of them spends
    (forward, backward and update; encode and decode; the transport's own work: Gloo's copies and
    sums, the TCP stack of every hop, a node's loopback included) is drawn from the same C cores,
    so no CPU second hides behind another: the host does R x ``cpu_seconds`` of work per step, at
    most C at a time. A rank waiting on the wire uses no core, so the wire still overlaps the
    other ranks' work, as the timeline has it::

        step = max(timeline step, R/C x cpu_seconds)    where R > C
        step = timeline step                            otherwise (or no ``host``)

    ``cpu_seconds``: one rank's CPU seconds per step, compute and exchange (the mean over the
    host's ranks). Serial in this model: all CPU work of the host's ranks (one pool of C cores,
    spread evenly). Overlapping: the wire with CPU work. Not modelled: the waits where every rank
    idles on the wire at once while CPU work is still due (the bound is then low), and the ranks'
    drift (the slowest rank's share of the cores)."""
    step, cpu = float(step_seconds), float(cpu_seconds)
    for name, v in (("step_seconds", step), ("cpu_seconds", cpu)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"contended_step: {name} must be finite and >= 0; got {v!r}")
    if host is None or not host.oversubscribed:
        return step
    return max(step, host.share * cpu)


def exchange_cpu_estimate(model: TwoLevelCostModel, group_bytes: Sequence[float], choices: Sequence[Candidate],
                          host: Host, itemsize: int = 4) -> float:
    """Seconds of CPU work one rank's exchanges take per step, from the fits where no CPU clock
    measured them, as the fits were timed (with the host's ranks all busy at once): per group
    encode and decode (the cost model's codec fits, ``Hops.cpu`` and ``Hops.decompress``) plus the
    bytes the rank sends over both link classes times ``host.cpu_per_byte`` (every byte goes
    through the CPU, whichever link carries it)."""
    total = 0.0
    for b, c in zip(group_bytes, choices):
        h = model.hops(c.route, c.spec, np.array([float(b)]), itemsize)
        total += float(h.cpu[0] + h.decompress[0]) + host.cpu_per_byte * float(h.intra_bytes[0] + h.inter_bytes[0])
    return total


def _contention(row: dict, workload: Workload, model: TwoLevelCostModel, groups, choices,
                host: Optional[Host]) -> dict:
    """The row with the fits' estimate of the contended step (``host`` given; the row unchanged
    otherwise). The workload and the fits are taken as timed with the host's ranks all busy at
    once, so each of their seconds is ``share`` x the CPU seconds it takes."""
    if host is None:
        return row
    exchange = exchange_cpu_estimate(model, [sum(workload.sizes_bytes[i] for i in g) for g in groups], choices,
                                     host) / host.share
    cpu = workload.compute_seconds / host.share + exchange
    return dict(row, exchange_cpu_seconds=exchange, cpu_seconds=cpu,
                contended_step_seconds=contended_step(row["step_seconds"], cpu, host))


# --- two levels ------------------------------------------------------------------------------------
def predict_route(workload: Workload, model: TwoLevelCostModel, spec, route: Route, schedule="auto",
                  overlap: str = "shared", host: Optional[Host] = None) -> dict:
    """One fixed route: the planner's plan (``schedule``) and predicted step, bytes per link class;
    with ``host``, the fits' estimate of the step on its shared cores (``contended_step``)."""
    spec = resolve(spec)
    plan = workload.plan(schedule, model.for_route(route), spec, overlap=overlap)
    choices = [Candidate(route, spec)] * len(plan.groups)
    sent = step_bytes(model, plan.groups, workload.sizes_bytes, choices)
    row = _route_row(workload, model, label(route, spec), str(spec), plan.predicted_seconds, len(plan.groups),
                     sent, route=route.as_dict(), plan=plan.schedule)
    return _contention(row, workload, model, plan.groups, choices, host)


def predict_choice_row(workload: Workload, model: TwoLevelCostModel, spec, gtopk: bool = False,
                       overlap: str = "shared", host: Optional[Host] = None) -> dict:
    """The planner's choice of route and spec per group (``twolevel.plan_routes``); ``host`` as
    ``predict_route``."""
    spec = resolve(spec)
    found = plan_routes(workload.sizes_bytes, workload.t_b, model, spec, candidates(spec, model.topology, gtopk=gtopk),
                        overlap, workload.forward_seconds, workload.update_seconds)
    sent = step_bytes(model, found.groups, workload.sizes_bytes, found.choices)
    row = _route_row(workload, model, f"choice {spec_label(spec)}", str(spec), found.predicted_seconds,
                     len(found.groups), sent, counts=found.counts())
    return _contention(row, workload, model, found.groups, found.choices, host)


def _route_row(workload, model, text, spec, step, groups, sent, **extra) -> dict:
    t = model.topology
    compute = workload.compute_seconds
    return {"workers": t.world, "nodes": t.nodes, "local_size": t.local_size, "label": text, "compression": spec,
            "step_seconds": step, "compute_seconds": compute, "exposed_seconds": step - compute,
            "efficiency": compute / step, "speedup": t.world * compute / step, "groups": groups,
            "bytes_per_worker": {"intra": sent["intra"], "inter": sent["inter"]},
            "inter_bytes_per_node": sent["inter_per_node"], **extra}


def two_level_sweep(workload: Workload, cost_model: CostModel, specs: Iterable, *, local_size: int,
                    workers: Iterable[int] = DEFAULT_WORKERS, gbps: Iterable[Optional[float]] = (None,),
                    intra_gbps: float, intra_latency_s: float, latency_s: Optional[float] = None,
                    nics_per_node: int = 1, gtopk: bool = False, choice: bool = True,
                    overlap: str = "shared", host: Optional[Host] = None) -> List[dict]:
    """Per worker count (a multiple of ``local_size``) and inter-node rate: flat dense, hierarchical
    dense, and per spec flat spec and two-level spec (dense inside), with ``gtopk`` also both with a
    global top-k across (top-k, DGC), and with ``choice`` the planner's route and spec per group.
    ``cost_model`` is the inter-node link (carried by ring scaling as ``model_at``); the intra-node
    link an ideal ring of ``intra_gbps`` and ``intra_latency_s``. Rows: ``layout`` names the kind.
    ``host`` (a node's ranks on its cores; none: each rank its own device) adds the fits' estimate
    of the step on shared cores (``contended_step``); the rows are otherwise the same."""
    workers = [int(n) for n in workers]
    bad = [n for n in workers if n % local_size or n < local_size]
    if bad:
        raise ValueError(f"workers: every count must be a multiple of --gpus-per-node={local_size}; got {bad}")
    specs = [resolve(s) for s in specs]
    rows = []
    for g in gbps:
        for n in workers:
            model = TwoLevelCostModel.from_model(cost_model, Topology(n, local_size), intra_gbps, intra_latency_s,
                                                 g, latency_s, nics_per_node)

            def add(row, layout):
                rows.append(dict(row, layout=layout, gbps=g, intra_gbps=intra_gbps, nics_per_node=nics_per_node))
            add(predict_route(workload, model, "none", Route(), overlap=overlap, host=host), "flat dense")
            add(predict_route(workload, model, "none", HIERARCHICAL, overlap=overlap, host=host), "hierarchical dense")
            for spec in specs:
                if spec.name == "none":
                    continue
                aggregates = [GATHER] + ([GTOPK] if gtopk and spec.name in GTOPK_SPECS else [])
                for agg in aggregates:
                    tail = "" if agg == GATHER else ", gtopk"
                    add(predict_route(workload, model, spec, Route(FLAT, aggregate=agg), overlap=overlap,
                                      host=host), "flat spec" + tail)
                    add(predict_route(workload, model, spec, Route(TWO_LEVEL, aggregate=agg), overlap=overlap,
                                      host=host), "two-level spec" + tail)
                if choice:
                    add(predict_choice_row(workload, model, spec, gtopk, overlap, host), "choice")
    return rows


LAYOUT_ROUTES = {"flat dense": Route(), "hierarchical dense": HIERARCHICAL, "flat spec": Route(),
                 "two-level spec": Route(TWO_LEVEL), "two-level spec (fp16 inside)": Route(TWO_LEVEL, "fp16"),
                 "flat spec, gtopk": Route(FLAT, aggregate=GTOPK),
                 "two-level spec, gtopk": Route(TWO_LEVEL, aggregate=GTOPK)}


def compare_two_level(measured: Sequence[dict], workload: Workload, cost_model: CostModel, *, local_size: int,
                      intra_gbps: float, intra_latency_s: float, latency_s: Optional[float] = None,
                      nics_per_node: int = 1, overlap: str = "shared", host: Optional[Host] = None) -> List[dict]:
    """Prediction vs measurement on two levels. Each record: workers, layout (a key of
    ``LAYOUT_ROUTES``), compression (the spec; dense for the dense layouts), seconds (measured
    step), optionally gbps (the inter-node rate; None: the model's), local_size and intra_gbps
    (default: the sweep's), and cpu_seconds (one rank's CPU seconds per step by its CPU clock,
    for ``contended_step`` in place of the fits' estimate). With ``host`` (the ranks that share
    the measuring machine's cores) each row adds ``contended_step_seconds`` and
    ``rel_error_contended``."""
    rows = []
    for m in measured:
        missing = {"workers", "layout", "seconds"} - set(m)
        if missing:
            raise ValueError(f"measured record {m!r} lacks {', '.join(sorted(missing))}")
        if m["layout"] not in LAYOUT_ROUTES:
            raise ValueError(f"measured record {m!r}: layout must be one of {', '.join(LAYOUT_ROUTES)}")
        local = int(m.get("local_size", local_size))
        topo = Topology(int(m["workers"]), local)
        model = TwoLevelCostModel.from_model(cost_model, topo, float(m.get("intra_gbps", intra_gbps)),
                                             intra_latency_s, m.get("gbps"), latency_s, nics_per_node)
        spec = "none" if m["layout"].endswith("dense") else m.get("compression")
        if spec is None:
            raise ValueError(f"measured record {m!r}: layout {m['layout']!r} needs its compression")
        row = predict_route(workload, model, spec, LAYOUT_ROUTES[m["layout"]], overlap=overlap, host=host)
        row.update(layout=m["layout"], gbps=m.get("gbps"), measured_seconds=float(m["seconds"]),
                   rel_error=row["step_seconds"] / float(m["seconds"]) - 1.0)
        if host is not None:
            if m.get("cpu_seconds") is not None:
                row.update(cpu_seconds=float(m["cpu_seconds"]), cpu_measured=True,
                           contended_step_seconds=contended_step(row["step_seconds"], m["cpu_seconds"], host))
            row["rel_error_contended"] = row["contended_step_seconds"] / float(m["seconds"]) - 1.0
        rows.append(row)
    return rows


def codec_fits(pairs: Sequence[str] = (), times_path: Optional[str] = None, branch: str = "triton") -> dict:
    """Compression-time fits: ``SPEC=FORM,A,B`` strings (``ComputeFit``: a*f(d) + b), and from a
    ``benchmarks/cuda_check.py`` JSON (rows of size, spec, branch, ms) a linear fit per spec over
    the sizes timed on ``branch``."""
    fits = {}
    for text in pairs:
        spec, eq, rest = text.rpartition("=")  # a spec may hold "=" itself
        parts = rest.split(",")
        if not eq or len(parts) != 3:
            raise ValueError(f"--codec-fit: expected SPEC=FORM,A,B (e.g. qsgd=linear,3e-11,1e-4); got {text!r}")
        try:
            fits[str(resolve(spec))] = ComputeFit(parts[0], float(parts[1]), float(parts[2]))
        except ValueError as e:
            raise ValueError(f"--codec-fit {text!r}: {e}") from None
    if times_path:
        by_spec = {}
        for r in _load_json(times_path)["rows"]:
            if r.get("branch", branch) == branch:
                by_spec.setdefault(str(resolve(r["spec"])), []).append((float(r["size"]), float(r["ms"]) / 1e3))
        for spec, samples in by_spec.items():
            if spec not in fits and len({d for d, _ in samples}) >= 2:
                fits[spec] = fit_compute(*zip(*samples), forms=("linear",))
    return fits


def print_two_level(rows: Sequence[dict]) -> None:
    print(f"# {TWO_LEVEL_NOTE}")
    print(f"{'gbps':>7} {'workers':>7} {'route':<52} {'step ms':>9} {'eff':>6} {'intra MB':>9} {'inter MB':>9}")
    for r in rows:
        g = "fitted" if r["gbps"] is None else f"{r['gbps']:g}"
        print(f"{g:>7} {r['workers']:>7} {r['label'][:52]:<52} {r['step_seconds'] * 1e3:9.1f} {r['efficiency']:6.3f} "
              f"{r['bytes_per_worker']['intra'] / 1e6:9.2f} {r['bytes_per_worker']['inter'] / 1e6:9.3f}")


def _floats(text: str) -> List[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers; got {text!r}") from None


def _load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def bench_inputs(report: dict, launch: int = 0) -> tuple:
    """(cost model, workload, measured records) of launch ``launch`` of a ``hvdcompress bench`` JSON
    (one run with the cost model profiled: ``cost_models`` entries)."""
    models = report.get("cost_models") or []
    if not 0 <= launch < len(models):
        raise ValueError(f"bench: launch {launch} has no fitted cost model ({len(models)} in the file; run the "
                         "benchmark without --no-profile)")
    entry = models[launch]
    rows = [r for r in report["results"] if r.get("status") == "ok" and r["workers"] == entry["workers"]
            and r["bandwidth"] == entry["bandwidth"]]
    profiled = next((r["plan"]["profiled"] for r in rows if (r.get("plan") or {}).get("profiled")), None)
    if profiled is None:
        raise ValueError("bench: no phase of that launch recorded its profiled workload")
    measured = [{"workers": r["workers"], "compression": r["compression"], "schedule": r["schedule"],
                 "seconds": r["step_time_s"], "gbps": None} for r in rows if r.get("schedule")]
    return CostModel.from_dict(entry["model"]), Workload.from_dict(profiled), measured


def _inputs(args) -> tuple:
    if args.bench:
        model, workload, _ = bench_inputs(_load_json(args.bench), args.bench_launch)
        return model, workload
    profile = _load_json(args.profile) if args.profile else {}
    if args.cost_model:
        d = _load_json(args.cost_model)
        model = CostModel.from_dict(d.get("cost_model", d))
    elif "cost_model" in profile:
        model = CostModel.from_dict(profile["cost_model"])
    elif args.link:
        model = CostModel.from_link(2, args.link[0], args.link[1] * 1e-6)
    else:
        raise SystemExit("simulate: give --profile, --cost-model or --link GBPS,LATENCY_US")
    if args.workload:
        d = _load_json(args.workload)
        workload = Workload.from_dict(d.get("workload", d))
    elif "workload" in profile:
        workload = Workload.from_dict(profile["workload"])
    elif args.synthetic:
        if len(args.synthetic) != 4:
            raise SystemExit("simulate: --synthetic takes TENSORS,MB,BACKWARD_MS,FORWARD_MS")
        t, mb, bms, fms = args.synthetic
        workload = synthetic_workload(int(t), mb, bms, fms)
    else:
        raise SystemExit("simulate: give --profile (with a workload), --workload or --synthetic")
    return model, workload


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hvdcompress.schedule.scaling", description=__doc__.split("\n\n")[0] +
                                 ". " + NOTE + ".", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="JSON from python -m hvdcompress.bench.profile transport --out (cost model + workload)")
    ap.add_argument("--cost-model", help="a CostModel JSON (e.g. from ~/.cache/hvdcompress)")
    ap.add_argument("--workload", help="a Workload JSON (sizes, t_b, forward/update seconds)")
    ap.add_argument("--link", type=_floats, help="hand-built model: GBPS,LATENCY_US per ring hop")
    ap.add_argument("--synthetic", type=_floats, help="synthetic model: TENSORS,MB,BACKWARD_MS,FORWARD_MS")
    ap.add_argument("--compression", action="append", help="spec (repeatable; default: none + every "
                    "compressor with a compression-time fit in the model)")
    ap.add_argument("--schedule", action="append", help=f"repeatable; default: {', '.join(DEFAULT_SCHEDULES)}")
    ap.add_argument("--workers", type=_floats, default=list(DEFAULT_WORKERS))
    ap.add_argument("--gbps", type=_floats, default=None, help="link bandwidths to predict for (Gbit/s); "
                    "default: the fitted transport")
    ap.add_argument("--latency-us", type=float, default=None, help="per-hop latency in place of the fitted one")
    ap.add_argument("--overlap", default="shared", choices=("shared", "parallel"))
    ap.add_argument("--measured", help="JSON list of {workers, compression, schedule, seconds[, gbps]}; two levels: "
                    "{workers, layout, compression, seconds[, gbps, local_size, intra_gbps]} (compare_two_level)")
    ap.add_argument("--bench", help="a `hvdcompress bench` JSON: cost model, workload and measured step times "
                    "of one launch (module doc)")
    ap.add_argument("--bench-launch", type=int, default=0, help="which launch of --bench (0-based)")
    ap.add_argument("--out", default="simulation.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png; two levels: none unless given)")
    two = ap.add_argument_group("two levels (module doc)")
    two.add_argument("--gpus-per-node", type=int, default=None,
                     help="ranks per node: predict flat and two-level routes (workers must be multiples of it)")
    two.add_argument("--intra-gbps", type=float, default=None, help="ASSUMED link inside a node (Gbit/s)")
    two.add_argument("--intra-latency-us", type=float, default=2.0, help="ASSUMED per-hop latency inside a node")
    two.add_argument("--nics-per-node", type=int, default=1,
                     help="NICs a node's ranks share for the cross-node hop (ASSUMED; default 1)")
    two.add_argument("--gtopk", action="store_true", help="also predict a global top-k across (top-k, DGC)")
    two.add_argument("--no-choice", action="store_true", help="leave out the planner's per-group route choice")
    two.add_argument("--codec-fit", action="append", default=[], metavar="SPEC=FORM,A,B",
                     help="a compression-time fit a*f(d)+b (FORM linear or dlogd; repeatable)")
    two.add_argument("--codec-times", help="a benchmarks/cuda_check.py JSON: linear compression-time fits per spec")
    two.add_argument("--codec-branch", default="triton", help="which branch of --codec-times (default triton)")
    two.add_argument("--cores", type=int, default=None,
                     help="cores a node's ranks share (contended_step; default: each rank its own device)")
    two.add_argument("--cpu-per-byte", type=float, default=0.0,
                     help="with --cores: the transport's CPU seconds per byte a rank sends")
    args = ap.parse_args(argv)

    try:
        model, workload = _inputs(args)
        fits = codec_fits(args.codec_fit, args.codec_times, args.codec_branch)
    except ValueError as e:
        raise SystemExit(f"simulate: {e}") from None
    if fits:
        model = replace(model, compress={**model.compress, **fits})
    if args.gpus_per_node is not None:
        return _main_two_level(args, model, workload)
    specs = args.compression or (["none"] + [s for s in model.compress if resolve(s).name != "none"])
    schedules = args.schedule or list(DEFAULT_SCHEDULES)
    for s in schedules:
        parse_schedule(s)  # a bad string fails before any work
    latency = None if args.latency_us is None else args.latency_us * 1e-6
    gbps = args.gbps or [None]
    try:
        rows = sweep(workload, model, specs, schedules, [int(n) for n in args.workers], gbps, latency, args.overlap)
        records = _load_json(args.measured) if args.measured else []
        if args.bench:
            records += bench_inputs(_load_json(args.bench), args.bench_launch)[2]
        measured = compare(records, workload, model, latency, args.overlap)
    except ValueError as e:
        raise SystemExit(f"simulate: {e}") from None
    result = {"note": NOTE, "cost_model": {"key": model.key, "world_size": model.world_size,
                                           "meta": {k: v for k, v in model.meta.items() if k != "samples"}},
              "workload": {"tensors": len(workload.names), "bytes": float(sum(workload.sizes_bytes)),
                           "compute_seconds": workload.compute_seconds},
              "overlap": args.overlap, "rows": rows, "measured": measured}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = args.plot or (args.out.rsplit(".", 1)[0] + ".png")
    plot(rows, png, measured, title=f"{len(workload.names)} tensors, "
         f"{sum(workload.sizes_bytes) / (1 << 20):.1f} MiB, compute {workload.compute_seconds * 1e3:.1f} ms/step")
    print(f"# {NOTE}")
    print(f"{'gbps':>8} {'compression / schedule':>44} " + " ".join(f"{int(n):>7}" for n in args.workers))
    for g in gbps:
        for spec in specs:
            for sched in schedules:
                effs = [r for r in rows if r["gbps"] == g and r["compression"] == str(resolve(spec))
                        and r["schedule"] == str(parse_schedule(sched))]
                label = "fitted" if g is None else f"{g:g}"
                print(f"{label:>8} {_label(effs[0])[-44:]:>44} " + " ".join(f"{r['efficiency']:7.3f}" for r in effs))
    for m in measured:
        print(f"measured {m['workers']} workers {m['compression']} {m['schedule']}: {m['measured_seconds'] * 1e3:.2f} ms, "
              f"predicted {m['step_seconds'] * 1e3:.2f} ms ({m['rel_error']:+.1%})")
    print(f"wrote {args.out} and {png} (efficiency = compute / predicted step)")
    return 0


def _main_two_level(args, model: CostModel, workload: Workload) -> int:
    if args.gpus_per_node < 1 or args.intra_gbps is None or not args.intra_gbps > 0 or args.nics_per_node < 1 \
            or args.intra_latency_us < 0:
        raise SystemExit("simulate: --gpus-per-node needs an integer >= 1, --intra-gbps > 0, --intra-latency-us >= 0 "
                         "and --nics-per-node >= 1")
    specs = args.compression or [s for s in model.compress if resolve(s).name not in ("none", "fp16")]
    latency = None if args.latency_us is None else args.latency_us * 1e-6
    try:
        host = None if args.cores is None else Host(args.gpus_per_node, args.cores, args.cpu_per_byte)
        rows = two_level_sweep(workload, model, specs, local_size=args.gpus_per_node,
                               workers=[int(n) for n in args.workers], gbps=args.gbps or [None],
                               intra_gbps=args.intra_gbps, intra_latency_s=args.intra_latency_us * 1e-6,
                               latency_s=latency, nics_per_node=args.nics_per_node, gtopk=args.gtopk,
                               choice=not args.no_choice, overlap=args.overlap, host=host)
        measured = compare_two_level(_load_json(args.measured) if args.measured else [], workload, model,
                                     local_size=args.gpus_per_node, intra_gbps=args.intra_gbps,
                                     intra_latency_s=args.intra_latency_us * 1e-6, latency_s=latency,
                                     nics_per_node=args.nics_per_node, overlap=args.overlap, host=host)
    except ValueError as e:
        raise SystemExit(f"simulate: {e}") from None
    result = {"note": TWO_LEVEL_NOTE,
              "cost_model": {"key": model.key, "world_size": model.world_size,
                             "meta": {k: v for k, v in model.meta.items() if k != "samples"},
                             "compress": {k: v.to_dict() for k, v in model.compress.items()}},
              "workload": {"tensors": len(workload.names), "bytes": float(sum(workload.sizes_bytes)),
                           "compute_seconds": workload.compute_seconds},
              "two_level": {"local_size": args.gpus_per_node, "intra_gbps": args.intra_gbps,
                            "intra_latency_us": args.intra_latency_us, "nics_per_node": args.nics_per_node,
                            "inter_latency_us": args.latency_us, "cores": args.cores,
                            "cpu_per_byte": args.cpu_per_byte if args.cores is not None else None},
              "overlap": args.overlap, "rows": rows, "measured": measured}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=None, separators=(",", ":"))
    print_two_level(rows)
    for m in measured:
        print(f"measured {m['workers']} workers ({m['nodes']}x{m['local_size']}) {m['label']}: "
              f"{m['measured_seconds'] * 1e3:.2f} ms, predicted {m['step_seconds'] * 1e3:.2f} ms "
              f"({m['rel_error']:+.1%})")
    if measured:
        worst = max(abs(m["rel_error"]) for m in measured)
        print(f"worst error {worst:.1%}: {'within' if worst <= 0.15 else 'NOT within'} 15%")
    print(f"wrote {args.out}")
    if args.plot:
        plot([dict(r, compression=r["label"], schedule="auto", plan="auto") for r in rows], args.plot,
             title=f"{args.gpus_per_node} ranks per node, intra {args.intra_gbps:g} Gbit/s (ASSUMED)")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
