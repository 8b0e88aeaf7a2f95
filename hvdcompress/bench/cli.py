"""``hvdcompress bench`` / ``python -m hvdcompress.bench``: the benchmark command line.

For every worker count and link bandwidth it builds the emulated network (or, with
``--loopback``, uses 127.0.0.1 with no rate limit), launches the Horovod workers once, and has them
time the compute-only limit and every compression spec, interleaved step by step (so a load that
drifts on a shared machine weighs on all of them alike; see ``hvdcompress.bench.torch_worker``, or
with ``--framework tf`` ``hvdcompress.bench.tf_worker``: the same figures for a Keras model). It
writes ``OUT.json`` (every figure), ``OUT.png`` (step time vs bandwidth) and ``OUT.md`` (the
table, also printed). The JSON is rewritten after every launch, so an interrupted run keeps what
it measured. Whatever happens -- a failed worker, a time limit, Ctrl-C, SIGTERM -- the workers are
stopped and the namespaces, links and /etc/netns entries removed before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from typing import List, Optional

from hvdcompress.schedule.planner import parse_schedule
from hvdcompress.spec import parse_spec

from . import netns, schedules
from .figures import DEFINITIONS, add_relative, summarize
from .report import (markdown_table, pipelining_summary, pipelining_table, tuning_summary, write_chart, write_json,
                     write_timeline_chart)
from .signals import raise_on_sigterm

MODELS = ("vgg", "mlp", "deep")
FRAMEWORKS = ("torch", "tf")
WORKERS = {"torch": ("-m", "hvdcompress.bench.torch_worker"), "tf": ("-m", "hvdcompress.bench.tf_worker")}
TF_SCHEDULES = ("layerwise", "single", "size")  # fixed schedules: no cost model (its fit is torch-only)
# Horovod settings the workers inherit from this process that change what is measured
HOROVOD_TUNING = ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY",
                  "HOROVOD_BATCH_D2D_MEMCOPIES", "HOROVOD_DISABLE_GROUP_FUSION")  # defined in hvdcompress/bench/torch_models.py (not imported: no torch here)


BENCH_EPILOG = """\
what is real, emulated, injected:
  links      emulated: one network namespace per worker, tbf at the link rate both ways (root);
             --loopback: 127.0.0.1, no rate limit
  latency    injected (--latency-ms): every exchange round completes no sooner than L ms after
             its launch, inside the workers (netem is unavailable); labelled in every output
  compute    real (the --model on the CPU) or emulated (--compute emulated:<profile>: per-layer
             GPU-like times spent waiting; compression and exchange stay real)

outputs (--out OUT): OUT.json every figure and step, OUT.md the table (also printed), OUT.png
step time vs link rate; with emulated compute also OUT-timeline.png (traced steps vs the plan).

examples:
  hvdcompress bench --loopback -n 2 -c none topk:ratio=0.01 --steps 4        # no root needed
  hvdcompress bench --loopback -n 2 -c none topk:ratio=0.01 --steps 4 --advise   # advise's predictions too
  hvdcompress bench --framework tf --loopback -n 2 --model mlp -c none topk:ratio=0.01 -s layerwise,single
  hvdcompress bench -n 4 -b 10mbit,100mbit,1gbit -c none fp16 dgc:ratio=0.001 -s layerwise
  HOROVOD_FUSION_THRESHOLD=0 hvdcompress bench --compute emulated:vgg16-v100 --emulated-scale 32 \\
      -c topk:ratio=0.001 -s layerwise,single,mgs,mgs+tune -n 2 -b 1gbit --warmup 7 --profile-steps 4

SPEC is a compression spec ('topk:ratio=0.01'; `hvdcompress specs` lists them). Guide:
docs/benchmarks.md (how to read the figures) and docs/scheduler.md (schedules).
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option; the epilog's layout kept as written."""


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description="Step time, bytes and speed-up of gradient compressors vs dense Horovod on\n"
        "an emulated network (network namespaces + tbf; root) or on loopback. For each worker count and\n"
        "link rate it launches the Horovod Gloo workers once; they time the compute-only step and every\n"
        "spec x schedule interleaved, one step each per round (median of the slowest rank per step).",
        epilog=BENCH_EPILOG, formatter_class=_HelpFormatter)
    ap.add_argument("--framework", choices=FRAMEWORKS, default="torch",
                    help="torch: torch_ops' DistributedOptimizer (hvdcompress.torch); tf: a tf.function step with "
                         "hvdcompress.keras.DistributedOptimizer (fixed schedules only; no emulated compute, "
                         "latency injection, cost-model fit or tracing)")
    ap.add_argument("--tf-graph-optimizer", choices=("on", "off"), default=argparse.SUPPRESS,
                    help="with --framework tf: Grappler's graph rewrites on (as in model.fit; default) or off "
                         "(off: each phase's first, traced step costs less CPU; recorded in the JSON)")
    ap.add_argument("--compression", "-c", nargs="+", default=["none", "fp16", "topk:ratio=0.001"],
                    metavar="SPEC", help="compression specs to measure (space-separated)")
    ap.add_argument("--schedules", "-s", default=argparse.SUPPRESS,
                    help="comma-separated merge schedules (DistributedOptimizer(schedule=...)): layerwise, single, "
                         "size:<MB>, mgs, mgwfbp, auto; a cost-model schedule followed by '+tune' (e.g. mgs+tune) runs "
                         "with measured validation (--tune-steps), without it with the model's plan as made; every "
                         "spec is timed with every schedule (default: auto; with --framework tf: layerwise, and only "
                         "layerwise, single, size:<MB> are accepted)")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="do not fit the cost model on the link at the start of each launch (then only the "
                         "cost-model schedules profile, through the cache, and the others get no prediction); "
                         "--framework tf never fits one")
    ap.add_argument("--advise", action="store_true",
                    help="check `hvdcompress advise` against the measured steps: in every launch, before the "
                         "timed phases, the workers run advise's measurement on the live link (the model's "
                         "workload timed, compression timed, the link's fitted cost model) and the JSON and "
                         "table give advise's predicted step beside every measured one (advise_predicted_s); "
                         "--framework torch only")
    ap.add_argument("--profile-max-mib", type=float, default=4.0,
                    help="largest collective (MiB per rank) timed for the cost model's fit")
    ap.add_argument("--profile-steps", type=int, default=3,
                    help="optimizer steps measured before a cost-model plan is made (warm-up must exceed it)")
    ap.add_argument("--tune-steps", type=int, default=3,
                    help="measured steps per candidate plan for the '+tune' schedules (DistributedOptimizer("
                         "tune_steps=)); their warm-up is extended until the validation is done")
    ap.add_argument("--bandwidths", "-b", default=argparse.SUPPRESS,
                    help="comma-separated per-worker link rates, e.g. 10mbit,100mbit,1gbit,10gbit,unlimited "
                         "(default: 100mbit; with --loopback only 'unlimited')")
    ap.add_argument("--workers", "-n", default="4", help="comma-separated worker counts")
    ap.add_argument("--model", choices=MODELS, default="vgg",
                    help="vgg: 6.4M-parameter CNN; mlp: 12.6M-parameter MLP; deep: 0.33M parameters in 100 tensors")
    ap.add_argument("--compute", default="real",
                    help="real: the --model's forward/backward run on the CPU; emulated:<profile>: GPU-like "
                         "emulation (hvdcompress/bench/emulated.py): a model built from the profile (a shipped "
                         "name such as resnet50-v100 or vgg16-v100, or a JSON path) with real parameters and "
                         "gradients whose per-layer forward/backward time is spent waiting, so the cores stay "
                         "free for compression and Horovod; --model is ignored, --batch is the profile's")
    ap.add_argument("--emulated-scale", type=float, default=1.0,
                    help="with --compute emulated: divide every parameter tensor's size by about this factor, "
                         "times kept; compression then does 1/S of the full model's CPU work (a stand-in for "
                         "compression on a GPU) and payloads are 1/S of the full model's. 1: full size, "
                         "compression at real CPU speed")
    ap.add_argument("--trace-steps", type=int, default=None,
                    help="untimed steps per phase after the timed ones, traced per group (hook, launch and "
                         "completion of every round) for the timeline figure (default: 1 with --compute "
                         "emulated, else 0)")
    ap.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=5,
                    help="untimed steps of each phase, back to back, before the timed rounds")
    ap.add_argument("--phase-budget-s", type=float, default=None,
                    help="time only as many rounds (at least 3, at most --steps) as give each phase about this "
                         "many seconds at the warm-up pace: bounds slow links (default: always --steps)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads per worker (torch.set_num_threads; TF: inter-op and intra-op threads each)")
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="INJECT this delay into the completion of every exchange round in the workers "
                         "(not network-emulated: netem is unavailable)")
    ap.add_argument("--loopback", action="store_true",
                    help="no namespaces, no root: workers on 127.0.0.1 with no rate limit")
    ap.add_argument("--out", default="results/bench", help="output prefix: OUT.json, OUT.png, OUT.md")
    ap.add_argument("--launch-timeout", type=float, default=900.0,
                    help="seconds one launch (all specs at one bandwidth and worker count) may take")
    ap.add_argument("--epoch", type=int, default=1000,
                    help="epoch given to opt.set_epoch() before timing, so schedules (DGC's density warm-up) "
                         "are measured at that epoch; the default is past any warm-up")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation and synthetic data")
    ap.add_argument("--cleanup-stale", action="store_true",
                    help="only delete namespaces left by benchmark runs that were killed, then exit")
    return ap


def _positive(name: str, value, low: float = 1) -> None:
    if not value >= low:
        raise ValueError(f"{name}: must be >= {low:g}; got {value!r}")


def _parse_args(argv: List[str], prog: Optional[str]) -> argparse.Namespace:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    try:
        if not hasattr(args, "schedules"):
            args.schedules = "layerwise" if args.framework == "tf" else "auto"
        for spec in args.compression:
            parse_spec(spec)
        args.schedule_list = [s.strip() for s in args.schedules.split(",") if s.strip()]
        if not args.schedule_list:
            raise ValueError("schedules: give at least one schedule")
        for sched in args.schedule_list:
            schedules.split(sched)
        if not 1 <= args.tune_steps <= 100:
            raise ValueError(f"tune-steps: must be in [1, 100]; got {args.tune_steps!r}")
        args.worker_counts = [int(w) for w in args.workers.split(",") if w.strip()]
        if not args.worker_counts or min(args.worker_counts) < 2:
            raise ValueError(f"workers: every worker count must be >= 2; got {args.workers!r}")
        if not hasattr(args, "bandwidths"):
            args.bandwidths = "unlimited" if args.loopback else "100mbit"
        args.bandwidth_list = [b.strip() for b in args.bandwidths.split(",") if b.strip()]
        rates = [netns.parse_bandwidth(b) for b in args.bandwidth_list]
        if args.loopback and any(r is not None for r in rates):
            raise ValueError("--loopback has no rate limit: use --bandwidths unlimited (or leave it out)")
        for name in ("batch", "steps", "threads"):
            _positive(name, getattr(args, name))
        _positive("warmup", args.warmup, 0)
        if args.framework == "tf":
            _check_tf(args)
        elif hasattr(args, "tf_graph_optimizer"):
            raise ValueError("tf-graph-optimizer: applies to --framework tf only")
        args.tf_graph_optimizer = getattr(args, "tf_graph_optimizer", "on" if args.framework == "tf" else None)
        _positive("profile-steps", args.profile_steps, 1)
        _positive("profile-max-mib", args.profile_max_mib, 0.01)
        kinds = {parse_schedule(schedules.split(x)[0]).kind for x in args.schedule_list}
        if (args.profile or kinds & {"auto", "mgs", "mgwfbp"}) and args.warmup <= args.profile_steps:
            raise ValueError(f"warmup: must exceed --profile-steps ({args.profile_steps}) so every plan is made "
                             f"before timing; got {args.warmup}")
        if kinds - {"layerwise"} and args.warmup < 1:
            raise ValueError("warmup: merged schedules need >= 1 warm-up step (step 0 learns the backward order)")
        _positive("epoch", args.epoch, 0)
        if args.phase_budget_s is not None:
            _positive("phase-budget-s", args.phase_budget_s, 1)
            if args.warmup < 1:
                raise ValueError("phase-budget-s: needs --warmup >= 1 (the pace comes from a warm-up step)")
        _positive("latency-ms", args.latency_ms, 0)
        if args.advise and args.latency_ms:
            raise ValueError("advise: its link measurement does not see the latency --latency-ms injects in the "
                             "workers, so its predictions could not be compared; drop one of them")
        _positive("emulated-scale", args.emulated_scale, 1)
        args.emulated = None
        if args.compute != "real":
            if not args.compute.startswith("emulated:"):
                raise ValueError(f"compute: 'real' or 'emulated:<profile>'; got {args.compute!r}")
            args.emulated = _emulated_profile(args.compute.split(":", 1)[1])
            args.model = args.compute
            args.batch = int(args.emulated.get("batch") or args.batch)
        if args.trace_steps is None:
            args.trace_steps = 1 if args.emulated else 0
        _positive("trace-steps", args.trace_steps, 0)
        _positive("launch-timeout", args.launch_timeout, 10)
    except ValueError as e:
        ap.error(str(e))
    return args


def _check_tf(args: argparse.Namespace) -> None:
    """What ``--framework tf`` cannot run, refused (ValueError naming the option) before any launch.
    It never fits the cost model: its schedules are fixed."""
    if args.compute != "real":
        raise ValueError(f"compute: {args.compute!r} needs --framework torch; --framework tf computes the "
                         "--model on the CPU (--compute real)")
    if args.latency_ms:
        raise ValueError("latency-ms: latency injection needs --framework torch (the TF exchange completes "
                         "inside the traced step)")
    if args.trace_steps:
        raise ValueError("trace-steps: per-group tracing needs --framework torch")
    if args.advise:
        raise ValueError("advise: advise's measurement (workload, link fit) needs --framework torch")
    for entry in args.schedule_list:
        base, tuned = schedules.split(entry)
        if tuned or schedules.chooses(entry) or parse_schedule(base).kind not in TF_SCHEDULES:
            raise ValueError(f"schedules: {entry!r} needs a cost model, which --framework tf does not fit; "
                             "it takes the fixed schedules layerwise, single, size:<MB> (or use --framework torch)")
    if args.warmup < 1:
        raise ValueError("warmup: --framework tf needs >= 1 warm-up step (the first step traces the tf.function)")
    args.profile = False


def _emulated_profile(name: str) -> dict:
    """The profile's JSON (read here without torch; the workers check it fully)."""
    base = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
    path = name if (os.sep in name or name.endswith(".json")) else os.path.join(base, name + ".json")
    if not os.path.isfile(path):
        shipped = sorted(f[:-5] for f in os.listdir(base) if f.endswith(".json"))
        raise ValueError(f"compute: no profile {name!r} (shipped: {', '.join(shipped)}; or give a JSON path)")
    with open(path) as f:
        prof = json.load(f)
    if not prof.get("layers"):
        raise ValueError(f"compute: profile {path} has no layers")
    prof["path"] = os.path.abspath(path)
    return prof


def _without_bandwidths(argv: List[str]) -> List[str]:
    """``argv`` less its bandwidth options (loopback has no rate limit)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("-b", "--bandwidths"):
            skip = True
        elif not a.startswith(("--bandwidths=", "-b")):
            out.append(a)
    return out


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_args(argv, prog)
    if args.cleanup_stale:
        problem = netns.missing_prerequisites()
        if problem:
            print(f"hvdcompress bench: cannot clean up namespaces: {problem}", file=sys.stderr)
            return 2
        removed = netns.remove_stale()
        print(f"removed {len(removed)} stale namespace(s){': ' + ', '.join(removed) if removed else ''}")
        return 0
    if not args.loopback:
        problem = netns.missing_prerequisites()
        if problem:
            print(f"hvdcompress bench: cannot emulate a network here: {problem}.\n"
                  "Run it as root on a machine with iproute2, or measure without a rate limit on loopback:\n"
                  f"  hvdcompress bench --loopback {shlex.join(_without_bandwidths(argv))}", file=sys.stderr)
            return 2
        removed = netns.remove_stale()
        if removed:
            print(f"removed {len(removed)} namespace(s) left by killed runs: {', '.join(removed)}")
    raise_on_sigterm()
    report = _new_report(args, argv)
    try:
        ok = _sweep(args, report)
    except KeyboardInterrupt as e:
        print(f"\ninterrupted ({e or 'Ctrl-C'}): workers stopped, network torn down; "
              f"partial results in {args.out}.json", file=sys.stderr)
        _finish(args, report)
        return 130
    finally:
        if not args.loopback:
            left = netns.leftovers(os.getpid())
            if left:
                print(f"warning: removing namespaces left behind: {', '.join(left)}", file=sys.stderr)
                netns.remove(left)
    _finish(args, report)
    print(markdown_table(report))
    print(f"wrote {args.out}.json, {args.out}.png, {args.out}.md")
    return 0 if ok else 1


def _new_report(args: argparse.Namespace, argv: List[str]) -> dict:
    return {
        "meta": {
            "command": "hvdcompress bench " + shlex.join(argv),
            "framework": args.framework,
            "tf_graph_optimizer": args.tf_graph_optimizer,
            "mode": "loopback (127.0.0.1, no rate limit)" if args.loopback else "network namespaces",
            "network": ("loopback 127.0.0.1, no rate limit" if args.loopback else
                        "one network namespace per worker, veth into a bridge, tbf on both directions "
                        "of each worker's link"),
            "model": args.model, "parameters": None, "parameter_tensors": None,
            "compute": _compute_meta(args),
            "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
            "phase_budget_s": args.phase_budget_s,
            "threads_per_worker": args.threads, "epoch": args.epoch,
            "latency_ms_injected": args.latency_ms,
            "latency_note": "injected into the completion of every exchange round in the worker process "
                            "(LatencyTransport), not network-emulated" if args.latency_ms else "none injected",
            "compression": list(args.compression), "schedules": args.schedule_list,
            "cost_model_profiled_per_launch": args.profile, "profile_steps": args.profile_steps,
            "tune_steps": args.tune_steps, "advise": args.advise,
            "bandwidths": args.bandwidth_list,
            "workers": args.worker_counts, "cpu_count": os.cpu_count(),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_1_5_15_at_start": list(os.getloadavg()),
            "horovod_env": {k: v for k, v in sorted(os.environ.items()) if k in HOROVOD_TUNING},
            "versions": {},
        },
        "definitions": DEFINITIONS,
        "compute_only": [],
        "results": [],
    }


def _compute_meta(args: argparse.Namespace) -> dict:
    if not args.emulated:
        return {"mode": "real", "note": "forward and backward computed on the CPU by the workers"}
    p = args.emulated
    return {"mode": "emulated", "profile": p.get("name"), "profile_path": p["path"], "device": p.get("device"),
            "source": p.get("source"), "profile_batch": p.get("batch"),
            "profile_parameters": p.get("parameters"), "layers": len(p["layers"]),
            "forward_s": sum(l["forward_s"] for l in p["layers"]),
            "backward_s": sum(l["backward_s"] for l in p["layers"]),
            "scale": args.emulated_scale,
            "note": "GPU-like compute EMULATED: each layer's forward/backward time (from the profile) is spent "
                    "sleeping, so the CPU cores stay free for compression and Horovod; parameters, gradients "
                    "(deterministic seeded patterns), compression and exchange are real. Tensors are about "
                    f"{args.emulated_scale:g}x smaller than the profiled model's (times unchanged): compression "
                    f"does 1/{args.emulated_scale:g} of the full model's CPU work and payloads are "
                    f"1/{args.emulated_scale:g} of the full model's."}


def _sweep(args: argparse.Namespace, report: dict) -> bool:
    """Every (worker count, bandwidth) launch in turn; returns False if any failed."""
    from tqdm import tqdm

    launches = [(n, b) for n in args.worker_counts for b in args.bandwidth_list]
    all_ok = True
    threads = ("torch.set_num_threads" if args.framework == "torch" else
               "TensorFlow inter-op and intra-op threads each")
    print(f"{args.framework} threads per worker: {args.threads} ({threads}); "
          f"{'loopback' if args.loopback else 'network namespaces'}; {len(launches)} launch(es)")
    from .launch import WorkerFailure  # imports Horovod's runner: not needed for --help

    with tempfile.TemporaryDirectory(prefix="hvcbench-") as tmp:
        bar = tqdm(launches, unit="launch", file=sys.stdout)
        for k, (n, bw) in enumerate(bar):
            bar.set_description(f"{n} workers @ {bw}")
            config = {"framework": args.framework, "graph_optimizer": args.tf_graph_optimizer != "off",
                      "model": args.model, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                      "threads": args.threads, "seed": args.seed, "compute_only": True,
                      "specs": list(args.compression), "latency_ms": args.latency_ms, "epoch": args.epoch,
                      "phase_budget_s": args.phase_budget_s, "schedules": args.schedule_list,
                      "profile": args.profile, "profile_max_mib": args.profile_max_mib,
                      "profile_steps": args.profile_steps, "emulated_scale": args.emulated_scale,
                      "trace_steps": args.trace_steps, "tune_steps": args.tune_steps, "advise": args.advise}
            workdir = os.path.join(tmp, f"launch{k}")
            try:
                ranks = _launch(args, n, bw, k, config, workdir, bar.write)
            except (WorkerFailure, netns.SetupError) as e:
                all_ok = False
                bar.write(f"FAILED: {n} workers @ {bw}: {e}")
                status = f"failed: {getattr(e, 'summary', str(e).splitlines()[0])}"
                report["results"] += [{"compression": s, "schedule": sc, "bandwidth": bw, "workers": n,
                                       "status": status}
                                      for s in args.compression for sc in args.schedule_list]
                if isinstance(e, netns.SetupError):
                    bar.write("the emulated network could not be built; --loopback needs no namespaces")
                    break
                continue
            _record(report, ranks, n, bw, args)
            write_json(report, args.out + ".json")
    return all_ok


def _launch(args, n: int, bw: str, k: int, config: dict, workdir: str, log) -> List[dict]:
    from .launch import Placement, run_workers

    worker = WORKERS[args.framework]
    if args.loopback:
        return run_workers(Placement.loopback(n), config, workdir, args.launch_timeout, log, worker)
    with netns.EmulatedNetwork(n, netns.parse_bandwidth(bw), tag=str(k)) as net:
        log(f"network: {net.describe()}")
        return run_workers(Placement.in_network(net), config, workdir, args.launch_timeout, log, worker)


def _record(report: dict, ranks: List[dict], n: int, bw: str, args: argparse.Namespace) -> None:
    meta = report["meta"]
    meta["parameters"], meta["parameter_tensors"] = ranks[0]["parameters"], ranks[0]["parameter_tensors"]
    meta["threads_per_worker"] = ranks[0]["threads"]
    meta["versions"] = ranks[0].get("versions", {})
    if ranks[0].get("parameter_check"):
        meta["parameter_check"] = ranks[0]["parameter_check"]
    summary = summarize(ranks, args.batch)
    if ranks[0].get("cost_model") is not None:
        report.setdefault("cost_models", []).append({"workers": n, "bandwidth": bw, "model": ranks[0]["cost_model"]})
    if ranks[0].get("advise") is not None:  # what advise measured on this link (its predictions: in the rows)
        report.setdefault("advise", []).append({"workers": n, "bandwidth": bw, **ranks[0]["advise"]})
    if summary["compute_only"] is not None:
        report["compute_only"].append(dict(summary["compute_only"], workers=n, bandwidth=bw))
    for fig in summary["phases"]:
        report["results"].append(dict(fig, bandwidth=bw, workers=n, status="ok",
                                      latency_ms_injected=args.latency_ms))
    add_relative(report["results"], report["compute_only"])


def _finish(args: argparse.Namespace, report: dict) -> None:
    report["meta"]["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["meta"]["load_average_1_5_15_at_end"] = list(os.getloadavg())
    write_json(report, args.out + ".json")
    with open(args.out + ".md", "w") as f:
        f.write(markdown_table(report))
        if args.emulated:
            f.write("\n" + pipelining_table(report) + "\n" + pipelining_summary(report))
            tuned = tuning_summary(report)
            if tuned:
                f.write("\n" + tuned)
    write_chart(report, args.out + ".png")
    if args.trace_steps:  # the cost-model plans' traced steps, predicted vs measured
        rows = [r for r in report["results"] if r.get("status") == "ok" and r.get("traces_rank0")
                and str(r.get("schedule")).startswith(("mgs", "mgwfbp", "auto")) and ":" not in str(r.get("schedule"))]
        write_timeline_chart(rows, args.out + "-timeline.png",
                             f"{report['meta']['model']}: one traced step per phase (rank 0), predicted vs measured")
