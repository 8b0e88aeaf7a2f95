"""Delayed gradient averaging on the emulated network: step time under INJECTED latency behind
EMULATED links (root: network namespaces + tbf, as ``python -m hvdcompress.bench`` builds them).

    # 4 workers, 100 Mbit/s links, injected latency 0..300 ms, dense and DGC 0.1%, D = 0,1,2,4,8
    python benchmarks/delayed_network.py sweep --workers 4 --bandwidth 100mbit \\
        --latency-ms 0,50,100,200,300 --compression none dgc:ratio=0.001 --delay 0,1,2,4,8 \\
        --out benchmarks/results/across-the-world/delayed-network-4workers
    # the combined configuration: 20 Mbit/s + 150 ms injected, dense vs DGC 0.1%, D = 0 and 4
    python benchmarks/delayed_network.py sweep --workers 4 --bandwidth 20mbit --latency-ms 150 \\
        --compression none dgc:ratio=0.001 --delay 0,4 --out benchmarks/results/across-the-world/delayed-combined-20mbit
    python benchmarks/delayed_network.py combine benchmarks/results/across-the-world/delayed-combined-20mbit.json \\
        benchmarks/results/across-the-world/delayed-accuracy-*-combined.json

The network is the harness's own (``hvdcompress.bench.netns.EmulatedNetwork``: one namespace per
worker, veth into a bridge, tbf at the link rate on both ends of every worker's link) and the
workers are started by the harness's launcher (``hvdcompress.bench.launch.run_workers``), one
launch per injected latency; ``netem`` is unavailable, so the latency is INJECTED in the workers
(``LatencyTransport``: every exchange round completes no sooner than L after its launch), as with
``python -m hvdcompress.bench --latency-ms``.

Each worker times, one *phase* after another, the compute-only step (plain SGD, no exchange) and
``DistributedOptimizer(compression=spec, delay=D)`` for every (spec, D). The phases are NOT
interleaved (unlike the harness's own worker): with D > 0 an exchange in flight completes during
the following steps, and interleaving other phases' steps between them would hide latency that
the phase itself does not. Each phase runs ``D + warmup`` untimed steps (so exchanges are
completing in the timed ones), ``steps`` timed steps, then ``flush()`` and a barrier, so nothing of
one phase is in flight during the next. Step time: per timed step the slowest rank's, median over
the steps (``hvdcompress.bench.figures.step_time``). Compute is GPU-like EMULATED by default
(``--compute emulated:resnet50-v100``: each layer's forward/backward time spent sleeping,
parameters and gradients real, ``--emulated-scale S`` divides tensor sizes by S).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

WORKER_KEYS = ("model", "emulated_scale", "batch", "seed", "threads", "phases", "warmup", "steps", "epoch",
               "schedule", "dense_schedule", "lr", "out")


# -- worker (one per rank, started by the harness's launcher inside its namespace) ----------------
def worker_main(config_path: str) -> int:
    import torch
    import torch.nn.functional as F

    import hvdcompress.torch as hvc
    from hvdcompress.bench.injected_latency import LatencyTransport
    from hvdcompress.bench.torch_models import build, count_parameters, synthetic_batch
    from torch_ops.collectives import Communicator

    with open(config_path) as f:
        cfg = json.load(f)
    missing = [k for k in WORKER_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"worker config {config_path}: missing keys {', '.join(missing)}")
    torch.set_num_threads(int(cfg["threads"]))
    hvc.init()
    rank = hvc.rank()
    figures = []
    for ph in cfg["phases"]:
        model = build(cfg["model"], seed=cfg["seed"], scale=cfg["emulated_scale"])
        x, y = synthetic_batch(cfg["batch"], seed=cfg["seed"] + 1000 * (1 + rank))
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
        spec, delay, latency_ms = ph.get("compression"), int(ph.get("delay", 0)), float(ph.get("latency_ms", 0))
        if spec is not None:
            transport = LatencyTransport(latency_ms / 1000.0) if latency_ms > 0 else Communicator()
            schedule = cfg["dense_schedule"] if spec == "none" else cfg["schedule"]
            opt = hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=spec,
                                           schedule=schedule, delay=delay, transport=transport)
            opt.set_epoch(cfg["epoch"])  # DGC's density warm-up is over: the ratio asked for is timed

        def step():
            start = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            return time.perf_counter() - start

        hvc.allreduce(torch.zeros(1), name=f"barrier.{len(figures)}.a")
        for _ in range(delay + cfg["warmup"]):
            step()
        before = (opt.stats.steps, opt.stats.total_bytes, opt.stats.total_dense_bytes) if spec else None
        times = [step() for _ in range(cfg["steps"])]
        fig = {"compression": spec or "compute-only", "delay": delay, "latency_ms_injected": latency_ms,
               "step_times_s": times}
        if spec is not None:
            n = opt.stats.steps - before[0]
            fig.update({"bytes_per_step": (opt.stats.total_bytes - before[1]) / max(n, 1),
                        "dense_bytes_per_step": (opt.stats.total_dense_bytes - before[2]) / max(n, 1),
                        "density": opt.stats.as_dict().get("density")})
            opt.flush()  # nothing of this phase stays in flight during the next
        hvc.allreduce(torch.zeros(1), name=f"barrier.{len(figures)}.b")
        figures.append(fig)
        if rank == 0:
            print(f"[bench worker] {fig['compression']} D={delay} L={latency_ms:g} ms (injected): "
                  f"median {statistics.median(times) * 1e3:.1f} ms (rank 0)", flush=True)
    params, tensors = count_parameters(build(cfg["model"], seed=cfg["seed"], scale=cfg["emulated_scale"]))
    with open(cfg["out"].format(rank=rank), "w") as f:
        json.dump({"rank": rank, "size": hvc.size(), "parameters": params, "parameter_tensors": tensors,
                   "threads": torch.get_num_threads(), "phases": figures,
                   "versions": {"torch": torch.__version__}}, f)
    hvc.shutdown()
    return 0


# -- orchestrator (root) ------------------------------------------------------------------------
def _ints(text):
    return [int(v) for v in str(text).split(",") if v.strip()]


def _floats(text):
    return [float(v) for v in str(text).split(",") if v.strip()]


def sweep(args, argv) -> int:
    from hvdcompress.bench import netns
    from hvdcompress.bench.figures import step_time
    from hvdcompress.bench.launch import Placement, WorkerFailure, run_workers
    from hvdcompress.bench.signals import raise_on_sigterm

    problem = netns.missing_prerequisites()
    if problem:
        print(f"cannot emulate a network here: {problem}", file=sys.stderr)
        return 2
    netns.remove_stale()
    raise_on_sigterm()
    bps = netns.parse_bandwidth(args.bandwidth)
    report = {"meta": {
        "command": "python benchmarks/delayed_network.py " + shlex.join(argv),
        "network": f"EMULATED: {args.workers} network namespaces, veth into a bridge, tbf "
                   f"{netns.format_bandwidth(bps)} on both ends of every worker's link",
        "latency_note": "INJECTED in the worker processes (LatencyTransport): every exchange round completes no "
                        "sooner than the latency after its launch; not network-emulated (netem unavailable)",
        "compute": (f"GPU-like EMULATED ({args.compute}, tensors {args.emulated_scale:g}x smaller than the "
                    "profiled model's, times kept)" if args.compute.startswith("emulated:") else
                    f"real CPU compute ({args.compute})"),
        "workers": args.workers, "bandwidth": args.bandwidth, "schedule": args.schedule,
        "dense_schedule": args.dense_schedule,
        "batch": args.batch, "steps": args.steps, "warmup": f"D + {args.warmup}", "threads_per_worker": 1,
        "phases_interleaved": False, "optimizer": f"SGD lr={args.lr} (no momentum), epoch {args.epoch}",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_1_5_15_at_start": list(os.getloadavg()),
        "machine": f"{os.cpu_count()} cores shared with other jobs"},
        "definitions": {"step_time_s": "per timed step the slowest rank's time, median over the timed steps",
                        "x_sync_zero_latency": "step_time_s / the same compression's D=0 step at 0 ms injected",
                        "x_compute_only": "step_time_s / the compute-only step of the same launch"},
        "compute_only": [], "rows": []}
    model = args.compute if args.compute.startswith("emulated:") else args.compute.split(":", 1)[-1]
    with tempfile.TemporaryDirectory(prefix="hvcdelay-") as tmp, \
            netns.EmulatedNetwork(args.workers, bps, tag="d") as net:
        print(f"network: {net.describe()}", flush=True)
        for k, latency in enumerate(args.latency_ms):
            phases = [{"compression": None}] + [{"compression": s, "delay": d, "latency_ms": latency}
                                                 for s in args.compression for d in args.delay]
            config = {"model": model, "emulated_scale": args.emulated_scale, "batch": args.batch,
                      "seed": 0, "threads": 1, "phases": phases, "warmup": args.warmup, "steps": args.steps,
                      "epoch": args.epoch, "schedule": args.schedule, "dense_schedule": args.dense_schedule,
                      "lr": args.lr}
            try:
                ranks = run_workers(Placement.in_network(net), config, os.path.join(tmp, f"l{k}"),
                                    args.launch_timeout, lambda line: print(line, flush=True),
                                    worker_argv=[os.path.abspath(__file__), "worker"])
            except WorkerFailure as e:
                print(f"FAILED at {latency:g} ms: {e}", file=sys.stderr)
                report["rows"].append({"latency_ms_injected": latency, "status": f"failed: {e.summary}"})
                continue
            report["meta"]["parameters"] = ranks[0]["parameters"]
            report["meta"]["parameter_tensors"] = ranks[0]["parameter_tensors"]
            for i, first in enumerate(ranks[0]["phases"]):
                fig = dict(step_time([r["phases"][i] for r in ranks]),
                           **{k2: v for k2, v in first.items() if k2 != "step_times_s"})
                fig["rank_step_times_s"] = [r["phases"][i]["step_times_s"] for r in ranks]
                if fig["compression"] == "compute-only":
                    report["compute_only"].append(dict(fig, latency_ms_injected=latency))
                else:
                    fig["bytes_per_step"] = statistics.mean(r["phases"][i]["bytes_per_step"] for r in ranks)
                    fig["compute_only_s"] = report["compute_only"][-1]["step_time_s"]
                    fig["status"] = "ok"
                    report["rows"].append(fig)
            _relative(report)
            _write(report, args.out)
    report["meta"]["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["meta"]["load_average_1_5_15_at_end"] = list(os.getloadavg())
    _write(report, args.out)
    print(sweep_table(report))
    _plot(report, args.out + ".png")
    return 0


def _relative(report):
    rows = [r for r in report["rows"] if r.get("status") == "ok"]
    for r in rows:
        r["x_compute_only"] = r["step_time_s"] / r["compute_only_s"]
        base = [b for b in rows if b["compression"] == r["compression"] and b["delay"] == 0
                and b["latency_ms_injected"] == 0]
        r["x_sync_zero_latency"] = r["step_time_s"] / base[0]["step_time_s"] if base else None


def _write(report, out):
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(sweep_table(report) + "\n")


def sweep_table(report) -> str:
    rows = [r for r in report["rows"] if r.get("status") == "ok"]
    delays = sorted({r["delay"] for r in rows})
    co = ", ".join(f"{c['step_time_s'] * 1e3:.0f}" for c in report["compute_only"])
    m = report["meta"]
    out = [f"{m['workers']} workers, {m['network']}; latency {m['latency_note'].split(':')[0]}; compute "
           f"{m['compute']}. Compute-only step per launch (ms): {co}. Cells: step time in ms "
           "(x the same compression's synchronous step at 0 ms injected).", "",
           "| compression | injected latency (ms) | " + " | ".join("sync (D=0)" if d == 0 else f"D={d}" for d in delays)
           + " |", "|---|---|" + "---|" * len(delays)]
    for spec in dict.fromkeys(r["compression"] for r in rows):
        for lat in dict.fromkeys(r["latency_ms_injected"] for r in rows):
            cells = []
            for d in delays:
                r = [x for x in rows if x["compression"] == spec and x["latency_ms_injected"] == lat and x["delay"] == d]
                cells.append(f"{r[0]['step_time_s'] * 1e3:.0f} ({r[0]['x_sync_zero_latency']:.2f}x)"
                             if r and r[0]["x_sync_zero_latency"] is not None else
                             (f"{r[0]['step_time_s'] * 1e3:.0f}" if r else "-"))
            out.append(f"| `{spec}` | {lat:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in report["rows"] if r.get("status") == "ok"]
    specs = list(dict.fromkeys(r["compression"] for r in rows))
    fig, axes = plt.subplots(1, len(specs), figsize=(5.5 * len(specs), 4.2), squeeze=False)
    for ax, spec in zip(axes[0], specs):
        for d in sorted({r["delay"] for r in rows}):
            pts = sorted((r["latency_ms_injected"], r["step_time_s"] * 1e3) for r in rows
                         if r["compression"] == spec and r["delay"] == d)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="sync" if d == 0 else f"D={d}")
        co = statistics.median(c["step_time_s"] * 1e3 for c in report["compute_only"])
        ax.axhline(co, color="gray", ls="--", label="compute only")
        ax.set_xlabel("INJECTED latency per exchange round (ms)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{spec}, {report['meta']['workers']} workers, EMULATED {report['meta']['bandwidth']}",
                     fontsize=9)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- the combined table: step time on the emulated network + accuracy from the training runs -------
def combine(args) -> int:
    with open(args.network) as f:
        net = json.load(f)
    acc = _accuracy_columns(args.accuracy)
    rows = [r for r in net["rows"] if r.get("status") == "ok"]
    base = next(r for r in rows if r["compression"] == "none" and r["delay"] == 0)
    lat = base["latency_ms_injected"]
    heads = [name for name, _ in acc]
    out = [f"{net['meta']['workers']} workers, EMULATED {net['meta']['bandwidth']} links, {lat:g} ms INJECTED "
           f"latency, compute {net['meta']['compute']}. Accuracy: mean test accuracy over 3 seeds after "
           "flush() (pp vs dense synchronous, same data set and workers).", "",
           "| configuration | step time (ms) | speed-up vs dense sync | bytes/step | " + " | ".join(
               f"accuracy {h}" for h in heads) + " |", "|---|---|---|---|" + "---|" * len(heads)]
    for r in rows:
        cells = []
        for _, arows in acc:
            a = [x for x in arows if x["compression"] == r["compression"] and x["delay"] == r["delay"]
                 and x.get("sync_every", 1) == 1]
            b = [x for x in arows if x["compression"] == "none" and x["delay"] == 0 and x.get("sync_every", 1) == 1]
            cells.append(f"{a[0]['mean_accuracy']:.4f} ({100 * (a[0]['mean_accuracy'] - b[0]['mean_accuracy']):+.2f} pp)"
                         if a and b else "-")
        name = ("dense" if r["compression"] == "none" else f"`{r['compression']}`") + \
            (f", D={r['delay']}" if r["delay"] else " synchronous")
        out.append(f"| {name} | {r['step_time_s'] * 1e3:.0f} | {base['step_time_s'] / r['step_time_s']:.2f}x | "
                   f"{r['bytes_per_step']:.0f} | " + " | ".join(cells) + " |")
    table = "\n".join(out)
    print(table)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(table + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump({"network": args.network, "accuracy_files": args.accuracy, "columns": [a[0] for a in acc],
                       "table": table}, f, indent=1)
    return 0


def _accuracy_columns(patterns):
    """[(\"<data set>, <N> workers\", rows)]: the accuracy runs (JSON globs), merged per data set and
    worker count (on a repeated (compression, D, K) the first file's row wins)."""
    columns = {}
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            with open(path) as f:
                d = json.load(f)
            name = d.get("dataset") or next((n for n in ("mnist1d", "digits") if n in os.path.basename(path)), path)
            rows = columns.setdefault(f"{name}, {d.get('workers')} workers", [])
            have = {(x["compression"], x["delay"], x["sync_every"]) for x in rows}
            rows += [r for r in d["rows"] if (r["compression"], r["delay"], r["sync_every"]) not in have]
    return list(columns.items())


def accuracy_summary(args) -> int:
    """One table over several accuracy runs: mean test accuracy per (compression, D, K), in pp vs
    the same run's D=0, K=1, one column per run (data set, workers)."""
    runs = _accuracy_columns(args.accuracy)
    keys = list(dict.fromkeys((r["compression"], r["delay"], r["sync_every"]) for _, rows in runs for r in rows))
    keys.sort(key=lambda k: (k[0] != "none", k[0], k[2], k[1]))
    out = ["| compression | D | K | " + " | ".join(name for name, _ in runs) + " |",
           "|---|---|---|" + "---|" * len(runs)]
    for spec, d, k in keys:
        cells = []
        for _, rows in runs:
            r = [x for x in rows if (x["compression"], x["delay"], x["sync_every"]) == (spec, d, k)]
            b = [x for x in rows if (x["compression"], x["delay"], x["sync_every"]) == (spec, 0, 1)]
            cells.append("-" if not r else f"{r[0]['mean_accuracy']:.4f}" + (
                "" if (d, k) == (0, 1) or not b else f" ({100 * (r[0]['mean_accuracy'] - b[0]['mean_accuracy']):+.2f})")
                + ("" if r[0]["identical_after_flush"] else " NOT identical"))
        out.append(f"| `{spec}` | {d} | {k} | " + " | ".join(cells) + " |")
    table = "\n".join(out)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["worker"]:
        return worker_main(argv[1])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sweep", help="step time per (injected latency, compression, delay) on the emulated network")
    s.add_argument("--workers", type=int, default=4)
    s.add_argument("--bandwidth", default="100mbit")
    s.add_argument("--latency-ms", type=_floats, default=[0, 50, 100, 200, 300])
    s.add_argument("--compression", nargs="+", default=["none", "dgc:ratio=0.001"])
    s.add_argument("--delay", type=_ints, default=[0, 1, 2, 4, 8])
    s.add_argument("--compute", default="emulated:resnet50-v100",
                   help="emulated:<profile> (GPU-like, sleeping) or real:<vgg|mlp|deep>")
    s.add_argument("--emulated-scale", type=float, default=32.0)
    s.add_argument("--batch", type=int, default=64)
    s.add_argument("--schedule", default="single",
                   help="merge schedule of the compressed specs (single: one exchange per step)")
    s.add_argument("--dense-schedule", default="layerwise",
                   help="schedule of 'none' (layerwise: one allreduce per tensor from the backward hooks, "
                        "fused by Horovod, as hvd.DistributedOptimizer does)")
    s.add_argument("--steps", type=int, default=8)
    s.add_argument("--warmup", type=int, default=3, help="untimed steps per phase besides D")
    s.add_argument("--lr", type=float, default=0.01)
    s.add_argument("--epoch", type=int, default=1000)
    s.add_argument("--launch-timeout", type=float, default=900.0)
    s.add_argument("--out", default="benchmarks/results/across-the-world/delayed-network")
    c = sub.add_parser("combine", help="one table: the network sweep's step times and the accuracy runs")
    c.add_argument("network", help="JSON written by `sweep`")
    c.add_argument("accuracy", nargs="+", help="JSON files (globs) written by delayed_averaging.py accuracy")
    c.add_argument("--out", default=None)
    a = sub.add_parser("accuracy-summary", help="one table over accuracy runs (pp vs each run's D=0, K=1)")
    a.add_argument("accuracy", nargs="+", help="JSON files (globs) written by delayed_averaging.py accuracy")
    a.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.what == "sweep":
        return sweep(args, argv)
    if args.what == "accuracy-summary":
        return accuracy_summary(args)
    return combine(args)


if __name__ == "__main__":
    sys.exit(main())
