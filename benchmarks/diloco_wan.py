"""Training across the world: dense sync, DGC, delayed averaging and the DiLoCo family on a
character-level language model, with final loss, bytes per worker per step, step time and compute
utilisation, on EMULATED links with INJECTED latency (or on loopback for the loss/bytes part).

    # loss and bytes (any machine, loopback workers, no latency): 4 workers, 1500 steps each
    python benchmarks/diloco_wan.py run --network loopback --workers 4 --steps 1500 \\
        --out benchmarks/results/diloco-quality-4workers
    # timing on the emulated WAN (root: network namespaces + tbf; latency INJECTED in the workers)
    python benchmarks/diloco_wan.py run --network emulated --bandwidth 20mbit --latency-ms 150 \\
        --workers 4 --steps 300 --out benchmarks/results/diloco-wan-20mbit
    python benchmarks/diloco_wan.py run --network emulated --bandwidth 100mbit --latency-ms 150 \\
        --workers 4 --steps 300 --out benchmarks/results/diloco-wan-100mbit
    # a quick smoke run (tiny model, few steps; the figures mean nothing)
    python benchmarks/diloco_wan.py run --network loopback --workers 2 --steps 20 --quick --out /tmp/diloco-smoke

Methods (``--methods``; all by default; ``DistributedOptimizer`` with a fixed schedule, so no
profiling steps: one allreduce per tensor for dense, as Horovod's own optimizer, one group for
DGC), every one with AdamW (lr ``--lr``, weight decay 0.1,
betas 0.9/0.95) as the optimizer, or the inner optimizer of the DiLoCo family:

    dense        DistributedOptimizer, no compression (allreduce every step)
    dgc          DistributedOptimizer, dgc:ratio=0.001,momentum=0 (0.1%, no warm-up; AdamW keeps the
                 momentum, so DGC's momentum correction is off: its sampled top-k with error feedback)
    delayed4     DistributedOptimizer, delayed averaging D = 4 (uncompressed)
    diloco10/50/100  DiLoCo, H = 10 / 50 / 100, outer SGD lr 0.7, momentum 0.9, Nesterov
    streaming    Streaming DiLoCo: H = 50, 5 fragments, overlap 5 steps, mix 0.5, 4-bit outer
                 gradients (qsgd:levels=7: codes in [-7, 7], 4 bits, a norm per 512 entries)
    sparseloco   SparseLoCo-like: H = 50, sparseloco:ratio=0.02,bits=2,beta=0.95, outer SGD lr 1 without
                 momentum (as in the SparseLoCo paper: the decayed error-feedback accumulator takes the
                 outer momentum's place)
    sparseloco8  the same at 8% density (a short run has few outer steps: each entry must be sent
                 several times over the run for error feedback to deliver it)

With ``--pretrain-steps N`` every method (and the compute-only phase) starts from the same model
trained N steps with dense synchronous AdamW first, as the DiLoCo paper starts from a pretrained
model; ``--lr-schedule cosine`` decays the (inner) learning rate over the method's steps.

``--compute-ms C`` adds C ms of EMULATED compute (a sleep) to every step: with four workers
sharing two cores, the real compute's step time depends on how the scheduler shares them, and an
accelerator's step (hundreds of ms for a language model) is what the exchange competes with.

Each worker runs the methods one after another (a *phase* each, never interleaved: an exchange in
flight must not be hidden by another phase's steps), preceded by a compute-only phase (AdamW, no
exchange) that gives the compute time per step. Every phase starts from the same initial model
(seed 0); rank r reads its own random windows of the training text (seed 1000 * (r + 1)). After
the last step the phase flushes (DiLoCo: every fragment synchronised, identical replicas; delayed
averaging: corrections applied), checks that every rank holds the same parameters, and evaluates
the next-character cross-entropy on the held-out text.

Figures (per method): ``final_loss`` (nats per character, held-out text, after the flush),
``bytes_per_worker_step`` (payload bytes each worker handed to the collectives during the steps,
counted by the communicator for every method alike, mean over ranks, divided by the steps; the
final flush is not counted), ``step_time_s`` (the phase's wall time over its steps: from the
barrier that starts it to the last rank's last step, before the flush, so DiLoCo's sync steps and
the waits for the slowest rank count once; per-step maxima over ranks would count a slow rank's
steps and the others' wait for it at the sync twice), ``compute_utilisation`` (the compute-only
phase's step time / the method's). Compute is the
real model on the CPU (one thread per worker). The corpus is the Python standard library's source
(``hvdcompress.datasets.load_stdlib_text``: present on every machine, version stated in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

METHODS = {
    "dense": {"kind": "sync", "compression": "none", "delay": 0},
    "dgc": {"kind": "sync", "compression": "dgc:ratio=0.001,momentum=0,warmup_epochs=0", "delay": 0},
    "delayed4": {"kind": "sync", "compression": "none", "delay": 4},
    "diloco10": {"kind": "diloco", "sync_every": 10},
    "diloco50": {"kind": "diloco", "sync_every": 50},
    "diloco100": {"kind": "diloco", "sync_every": 100},
    "streaming": {"kind": "diloco", "sync_every": 50, "fragments": 5, "overlap_steps": 5, "mix": 0.5,
                  "compression": "qsgd:levels=7,bucket=512"},
    "sparseloco": {"kind": "diloco", "sync_every": 50, "compression": "sparseloco:ratio=0.02,bits=2,beta=0.95",
                   "outer": {"lr": 1.0, "momentum": 0.0}},
    "sparseloco8": {"kind": "diloco", "sync_every": 50, "compression": "sparseloco:ratio=0.08,bits=2,beta=0.95",
                    "outer": {"lr": 1.0, "momentum": 0.0}},
}
MODEL = {"width": 128, "layers": 2, "heads": 4, "context": 64}
QUICK_MODEL = {"width": 32, "layers": 1, "heads": 2, "context": 16}


def counting(base, *args):
    """A ``Communicator`` (or subclass) that counts the payload bytes of every exchange round it
    launches (``request_bytes``: the non-finite flag excluded), the same count for every method."""
    from torch_ops.collectives import request_bytes

    class Counting(base):
        payload_bytes = 0

        def launch(self, requests, name):
            self.payload_bytes += request_bytes(requests)
            return super().launch(requests, name)

    return Counting(*args)


def lr_schedule(name: str, steps: int):
    """The inner learning rate's factor at step s: "constant" (1), or "cosine": a linear warm-up over
    the first 5% of the steps, then a cosine decay to 10% of the peak (the usual language-model
    schedule, as in the DiLoCo paper's inner optimizer)."""
    import math

    if name == "constant":
        return lambda s: 1.0
    warm = max(1, steps // 20)

    def cosine(s):
        if s < warm:
            return (s + 1) / warm
        t = min(1.0, (s - warm) / max(1, steps - warm))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t))
    return cosine


# -- worker (one per rank) -----------------------------------------------------------------------
def pretrain(cfg, text):
    """The common starting point with ``--pretrain-steps N``: N steps of dense synchronous AdamW
    (constant lr, a data stream of its own per rank) from the seed-0 model, as the DiLoCo paper
    starts its runs from a pretrained model; returns the parameters (identical on every rank)."""
    import torch

    import hvdcompress.torch as hvc
    from hvdcompress.bench.example_models import CharTransformer, char_batches

    dims = cfg["model"]
    torch.manual_seed(0)
    model = CharTransformer(width=dims["width"], layers=dims["layers"], heads=dims["heads"], context=dims["context"])
    inner = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    opt = hvc.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression="none",
                                   schedule="layerwise")
    batches = char_batches(text.train, cfg["batch"], dims["context"], seed=1000 * (hvc.rank() + 1) + 500)
    for _ in range(cfg["pretrain_steps"]):
        x, y = next(batches)
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
    opt.flush()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker_main(config_path: str) -> int:
    import numpy as np
    import torch

    import hvdcompress.torch as hvc
    from hvdcompress.bench.example_models import CharTransformer, char_batches, char_eval_loss
    from hvdcompress.bench.injected_latency import LatencyTransport
    from hvdcompress.datasets import load_stdlib_text
    from torch_ops.collectives import Communicator

    with open(config_path) as f:
        cfg = json.load(f)
    torch.set_num_threads(int(cfg["threads"]))
    hvc.init()
    rank, size = hvc.rank(), hvc.size()
    text = load_stdlib_text(cfg["corpus_bytes"])
    dims = cfg["model"]
    figures = []
    start_state = pretrain(cfg, text) if cfg["pretrain_steps"] else None
    for k, name in enumerate(["compute-only"] + cfg["methods"]):
        torch.manual_seed(0)
        model = CharTransformer(width=dims["width"], layers=dims["layers"], heads=dims["heads"], context=dims["context"])
        if start_state is not None:
            model.load_state_dict(start_state)
        inner = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1, betas=(0.9, 0.95))
        lr_at = lr_schedule(cfg["lr_schedule"], cfg["steps"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lr_at)
        m = METHODS.get(name, {"kind": "local"})
        latency = float(cfg["latency_ms"]) / 1000.0
        transport = counting(LatencyTransport, latency) if latency > 0 else counting(Communicator)
        transport = transport if m["kind"] != "local" else None
        if m["kind"] == "sync":
            opt = hvc.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                           compression=m["compression"], delay=m["delay"], transport=transport,
                                           schedule="layerwise" if m["compression"] == "none" else "single")
            opt.set_epoch(1000)  # past any warm-up: the density asked for is the one measured
        elif m["kind"] == "diloco":
            outer = None  # DiLoCo's default: SGD lr 0.7, momentum 0.9, Nesterov
            if "outer" in m:
                outer = torch.optim.SGD(model.parameters(), lr=m["outer"]["lr"], momentum=m["outer"]["momentum"])
            opt = hvc.DiLoCo(model, inner, outer_optimizer=outer, sync_every=m["sync_every"], fragments=m.get("fragments", 1),
                             overlap_steps=m.get("overlap_steps", 0), mix=m.get("mix", 0.0),
                             compression=m.get("compression"), transport=transport)
        else:
            opt = inner
        batches = char_batches(text.train, cfg["batch"], dims["context"], seed=1000 * (rank + 1))
        hvc.allreduce(torch.zeros(1), name=f"barrier.{k}.a")
        phase_start = time.perf_counter()  # every rank leaves the barrier at about the same time
        times, losses = [], []
        for _ in range(cfg["steps"]):
            x, y = next(batches)
            start = time.perf_counter()
            opt.zero_grad()
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            scheduler.step()  # drives the inner optimizer's lr (DiLoCo: the inner steps only)
            if cfg["compute_ms"]:  # EMULATED accelerator time per step: the core is left free
                time.sleep(cfg["compute_ms"] / 1000.0)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        wall = time.perf_counter() - phase_start  # this rank's steps, waits at syncs included; no flush
        sent = transport.payload_bytes if transport is not None else 0  # the steps' exchanges, not the flush's
        if m["kind"] != "local":
            opt.flush()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        rows = hvc.allgather(flat[None], name=f"check.{k}")
        identical = bool(all(torch.equal(rows[0], r) for r in rows)) if m["kind"] != "local" else None
        fig = {"method": name, "config": m, "step_times_s": times, "wall_s": wall, "bytes_sent": int(sent),
               "train_loss_last50": float(np.mean(losses[-50:])),
               "final_loss": char_eval_loss(model, text.test, dims["context"], windows=cfg["eval_windows"]),
               "identical_after_flush": identical}
        hvc.allreduce(torch.zeros(1), name=f"barrier.{k}.b")
        figures.append(fig)
        if rank == 0:
            print(f"[diloco worker] {name}: mean step {statistics.mean(times) * 1e3:.1f} ms (rank 0), "
                  f"final loss {fig['final_loss']:.4f}, bytes/step {sent / cfg['steps']:.0f}", flush=True)
    with open(cfg["out"].format(rank=rank), "w") as f:
        json.dump({"rank": rank, "size": size, "phases": figures, "corpus": text.source,
                   "parameters": sum(p.numel() for p in model.parameters()),
                   "versions": {"torch": torch.__version__}}, f)
    hvc.shutdown()
    return 0


# -- orchestrator --------------------------------------------------------------------------------
def summarize(ranks, steps):
    """One row per method from every rank's phases (module doc's figures)."""
    rows = []
    for i, first in enumerate(ranks[0]["phases"]):
        per_step = [max(r["phases"][i]["step_times_s"][s] for r in ranks) for s in range(steps)]
        rows.append({"method": first["method"], "config": first["config"],
                     "final_loss": first["final_loss"], "train_loss_last50": first["train_loss_last50"],
                     "final_loss_per_rank": [r["phases"][i]["final_loss"] for r in ranks],
                     "identical_after_flush": first["identical_after_flush"],
                     "bytes_per_worker_step": statistics.mean(r["phases"][i]["bytes_sent"] for r in ranks) / steps,
                     "step_time_s": max(r["phases"][i]["wall_s"] for r in ranks) / steps,
                     "step_time_slowest_mean_s": statistics.mean(per_step),
                     "step_time_median_s": statistics.median(per_step)})
    base = rows[0]["step_time_s"]
    dense = next((r for r in rows if r["method"] == "dense"), None)
    for r in rows:
        r["compute_utilisation"] = base / r["step_time_s"] if r["step_time_s"] > 0 else None
        if dense is not None and r["method"] != "compute-only":
            r["loss_vs_dense_pct"] = 100.0 * (r["final_loss"] - dense["final_loss"]) / dense["final_loss"]
            r["bytes_reduction_vs_dense"] = (dense["bytes_per_worker_step"] / r["bytes_per_worker_step"]
                                             if r["bytes_per_worker_step"] else None)
    return rows


def table(report) -> str:
    m = report["meta"]
    out = [f"{m['workers']} workers; {m['network']}; latency: {m['latency']}; compute: {m['compute']}; "
           f"{m['steps']} steps from {m.get('pretrain_steps', 0)} dense pretraining steps; batch {m['batch_per_worker']} "
           f"per worker; AdamW lr {m['lr']:g} ({m.get('lr_schedule', 'constant')}); "
           f"corpus: {m.get('corpus', '?')}.", "",
           "| method | final loss (nats/char) | vs dense | bytes/worker/step | fewer bytes than dense | "
           "step time (ms: phase wall time / steps) | compute utilisation |", "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        vs = f"{r['loss_vs_dense_pct']:+.2f}%" if r.get("loss_vs_dense_pct") is not None else "-"
        red = f"{r['bytes_reduction_vs_dense']:.0f}x" if r.get("bytes_reduction_vs_dense") else "-"
        out.append(f"| {r['method']} | {r['final_loss']:.4f} | {vs} | {r['bytes_per_worker_step']:.0f} | {red} | "
                   f"{r['step_time_s'] * 1e3:.1f} | {100 * r['compute_utilisation']:.1f}% |")
    return "\n".join(out)


def _plot(report, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in report["rows"] if r["bytes_per_worker_step"] > 0]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["bytes_per_worker_step"], r["final_loss"])
        ax.annotate(r["method"], (r["bytes_per_worker_step"], r["final_loss"]), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes per worker per step (payload)")
    ax.set_ylabel("final held-out loss (nats/char)")
    ax.set_title(f"char-LM, {report['meta']['workers']} workers, {report['meta']['steps']} steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args, argv) -> int:
    from hvdcompress.bench.launch import Placement, WorkerFailure, run_workers

    methods = args.methods or list(METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"unknown methods {unknown}; known: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    config = {"methods": methods, "steps": args.steps, "batch": args.batch, "lr": args.lr, "lr_schedule": args.lr_schedule,
              "pretrain_steps": args.pretrain_steps,
              "compute_ms": args.compute_ms, "threads": 1,
              "latency_ms": args.latency_ms, "corpus_bytes": args.corpus_bytes,
              "model": dict(QUICK_MODEL if args.quick else MODEL), "eval_windows": 16 if args.quick else 256}
    for key in ("width", "layers", "context"):
        if getattr(args, key) is not None:
            config["model"][key] = getattr(args, key)
    meta = {"command": "python benchmarks/diloco_wan.py " + shlex.join(argv), "workers": args.workers,
            "steps": args.steps, "batch_per_worker": args.batch, "model": config["model"], "lr": args.lr,
            "lr_schedule": args.lr_schedule, "pretrain_steps": args.pretrain_steps,
            "latency": (f"{args.latency_ms:g} ms INJECTED in the worker processes (LatencyTransport: every exchange "
                        "round completes no sooner than that after its launch; netem is unavailable)")
            if args.latency_ms > 0 else "none added",
            "compute": "real CPU compute, one thread per worker" + (
                f", plus {args.compute_ms:g} ms per step EMULATED (sleep: accelerator-like step time)"
                if args.compute_ms else ""),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_1_5_15_at_start": list(os.getloadavg()),
            "machine": f"{os.cpu_count()} cores"}
    with tempfile.TemporaryDirectory(prefix="hvcdiloco-") as tmp:
        try:
            if args.network == "emulated":
                from hvdcompress.bench import netns
                problem = netns.missing_prerequisites()
                if problem:
                    print(f"cannot emulate a network here: {problem}", file=sys.stderr)
                    return 2
                netns.remove_stale()
                bps = netns.parse_bandwidth(args.bandwidth)
                meta["network"] = (f"EMULATED: {args.workers} network namespaces, veth into a bridge, tbf "
                                   f"{netns.format_bandwidth(bps)} on both ends of every worker's link")
                with netns.EmulatedNetwork(args.workers, bps, tag="l") as net:
                    ranks = run_workers(Placement.in_network(net), config, tmp, args.launch_timeout,
                                        lambda line: print(line, flush=True),
                                        worker_argv=[os.path.abspath(__file__), "worker"])
            else:
                meta["network"] = "loopback (no link emulation: step times are not WAN figures)"
                ranks = run_workers(Placement.loopback(args.workers), config, tmp, args.launch_timeout,
                                    lambda line: print(line, flush=True),
                                    worker_argv=[os.path.abspath(__file__), "worker"])
        except WorkerFailure as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
    meta["corpus"] = ranks[0]["corpus"]
    meta["parameters"] = ranks[0]["parameters"]
    meta["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    meta["load_average_1_5_15_at_end"] = list(os.getloadavg())
    report = {"meta": meta, "rows": summarize(ranks, args.steps)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = table(report)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    _plot(report, args.out + ".png")
    print(text)
    return 0


def combine(quality_path: str, wan_paths, out: str) -> int:
    """One table from a loopback quality run (loss, bytes) and emulated-WAN runs (step time,
    utilisation), joined by method; targets checked as the module doc states them; a
    loss-against-bytes plot."""
    with open(quality_path) as f:
        quality = json.load(f)
    wans = []
    for path in wan_paths:
        with open(path) as f:
            wans.append(json.load(f))
    by_method = [{r["method"]: r for r in w["rows"]} for w in wans]
    links = [w["meta"]["network"].split("tbf ")[-1].split(" on")[0] + " + " + w["meta"]["latency"].split(" INJECTED")[0]
             + " injected" for w in wans]
    head = ["method", "final loss", "vs dense", "bytes/worker/step", "fewer bytes than dense"]
    for link in links:
        head += [f"step ms, {link}", f"utilisation, {link}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = []
    known = {r["method"] for r in quality["rows"]}
    extra = [dict(r, final_loss=None, loss_vs_dense_pct=None) for w in wans[:1] for r in w["rows"]
             if r["method"] not in known]  # timed on the WAN, not in the quality run: loss "-"
    for r in quality["rows"] + extra:
        m = r["method"]
        row = {"method": m, "final_loss": r["final_loss"], "loss_vs_dense_pct": r.get("loss_vs_dense_pct"),
               "bytes_per_worker_step": r["bytes_per_worker_step"],
               "bytes_reduction_vs_dense": r.get("bytes_reduction_vs_dense"), "wan": {}}
        cells = [m if m != "compute-only" else "no exchange (each worker alone)",
                 f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-",
                 f"{r['loss_vs_dense_pct']:+.2f}%" if r.get("loss_vs_dense_pct") is not None else "-",
                 f"{r['bytes_per_worker_step']:.0f}",
                 f"{r['bytes_reduction_vs_dense']:.0f}x" if r.get("bytes_reduction_vs_dense") else "-"]
        for link, w in zip(links, by_method):
            t = w.get(m)
            row["wan"][link] = None if t is None else {"step_time_s": t["step_time_s"],
                                                       "compute_utilisation": t["compute_utilisation"]}
            cells += ([f"{t['step_time_s'] * 1e3:.1f}", f"{100 * t['compute_utilisation']:.1f}%"] if t else ["-", "-"])
        rows.append(row)
        lines.append("| " + " | ".join(cells) + " |")
    first = links[0] if links else None

    def meets(row, within, reduction):
        return (row["loss_vs_dense_pct"] is not None and row["loss_vs_dense_pct"] <= within
                and (row["bytes_reduction_vs_dense"] or 0) >= reduction
                and (first is None or (row["wan"].get(first) or {}).get("compute_utilisation", 0) >= 0.9))
    family = [r for r in rows if r["method"].startswith(("diloco", "streaming", "sparseloco"))]
    verdict = {"family_within_2pct_100x_90pct_util": [r["method"] for r in family if meets(r, 2.0, 100.0)]}
    loss = {r["method"]: r for r in rows}
    compressed = []
    for r in family:  # a compressed variant against the uncompressed DiLoCo with the same H
        h = (METHODS.get(r["method"]) or {}).get("sync_every")
        plain = loss.get(f"diloco{h}")
        if r["method"].startswith("sparseloco") and plain:
            compressed.append({"method": r["method"], "against": plain["method"],
                               "fewer_bytes": plain["bytes_per_worker_step"] / r["bytes_per_worker_step"],
                               "loss_vs_uncompressed_pct": 100 * (r["final_loss"] / plain["final_loss"] - 1)})
    verdict["compressed_vs_uncompressed"] = compressed
    report = {"quality": quality["meta"], "wan": [w["meta"] for w in wans], "rows": rows, "targets": verdict}
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = "\n".join(lines)
    text += ("\n\nDiLoCo family within 2% of dense's loss at >= 100x fewer bytes"
             + (f" and >= 90% utilisation on {first}" if first else "") + ": "
             + (", ".join(verdict["family_within_2pct_100x_90pct_util"]) or "none") + ".")
    for c in compressed:
        text += (f"\n{c['method']} against {c['against']}: {c['fewer_bytes']:.1f}x fewer bytes, loss "
                 f"{c['loss_vs_uncompressed_pct']:+.2f}%.")
    with open(out + ".md", "w") as f:
        f.write(text + "\n")
    _plot({"rows": quality["rows"], "meta": quality["meta"]}, out + ".png")
    print(text)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["worker"]:
        return worker_main(argv[1])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="train every method once; figures to <out>.json/.md/.png")
    r.add_argument("--network", choices=("loopback", "emulated"), default="loopback")
    r.add_argument("--bandwidth", default="20mbit", help="link rate of the emulated network")
    r.add_argument("--latency-ms", type=float, default=0.0, help="latency INJECTED per exchange round")
    r.add_argument("--workers", type=int, default=4)
    r.add_argument("--steps", type=int, default=1500)
    r.add_argument("--batch", type=int, default=32)
    r.add_argument("--lr", type=float, default=2e-3)
    r.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="inner learning rate over the steps (cosine: 5%% warm-up, decay to 10%% of --lr)")
    r.add_argument("--pretrain-steps", type=int, default=0,
                   help="dense synchronous steps every method starts from (0: from the initial model)")
    r.add_argument("--compute-ms", type=float, default=0.0,
                   help="EMULATED compute added to every step (sleep), as an accelerator's step time")
    r.add_argument("--corpus-bytes", type=int, default=2_000_000)
    r.add_argument("--methods", nargs="*", default=None, help=f"subset of: {', '.join(METHODS)}")
    r.add_argument("--width", type=int, default=None, help=f"model width (default {MODEL['width']})")
    r.add_argument("--layers", type=int, default=None, help=f"transformer blocks (default {MODEL['layers']})")
    r.add_argument("--context", type=int, default=None, help=f"characters per window (default {MODEL['context']})")
    r.add_argument("--quick", action="store_true", help="a tiny model (smoke test; figures mean nothing)")
    r.add_argument("--launch-timeout", type=float, default=7200.0)
    r.add_argument("--out", default="benchmarks/results/diloco-wan")
    c = sub.add_parser("combine", help="one table from a loopback quality run and emulated-WAN runs")
    c.add_argument("quality", help="the loopback run's JSON (loss, bytes)")
    c.add_argument("wan", nargs="*", help="emulated-WAN runs' JSON (step time, utilisation; the first is the "
                                          "link the utilisation target is checked on)")
    c.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.what == "combine":
        return combine(args.quality, args.wan, args.out)
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
