"""Fidelity of every compressor: test accuracy vs dense and measured bytes per step, each method at
its own best learning rate.

    horovodrun -np 2 -H localhost:2 --gloo --cycle-time-ms 1 python benchmarks/fidelity.py --dataset mnist1d

For every compressor in the spec registry (``hvdcompress.spec.REGISTRY``; a compressor without a
headline setting below runs with its defaults, and the table says so), inside one Horovod job:

1. learning-rate sweep: one run per rate of ``--lrs`` with the first seed;
2. the rate with the best test accuracy is the method's own (ties to the smaller rate), and the
   other seeds run at it; the table reports the mean over all seeds at that rate (the first seed's
   run is the sweep's own).

Every run trains the examples' model (``hvdcompress.bench.example_models``) from the same
initialisation per seed, with SGD (momentum 0.9; DGC, the sketch, efsignsgd and onebit take the
momentum over and apply it before compression) and
the same epochs and batch size; the loop is ``hvdcompress.bench.convergence.train_and_test``.
signSGD's exchanged update is a sign (magnitude 1 per entry, whatever the gradient's scale), so its
rates are the sweep's times ``SIGN_LR_SCALE``; every other method uses the sweep as given.

Rank 0 prints a markdown table and writes JSON after every compressor (``--resume`` skips runs
already in it, so an interrupted job can go on). Compressors may be split over several jobs
(``--configs`` and ``--out``); ``--merge A.json B.json --out C.json`` (no Horovod) joins their
results, recomputes the comparison with dense and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

import hvdcompress.torch as hvc
from hvdcompress.bench.convergence import best_lr, train_and_test
from hvdcompress.datasets import load
from hvdcompress.spec import REGISTRY, parse_spec

# The setting each compressor is known by (README tables); DGC as in "DGC evidence".
HEADLINE = {  # in the order they run: dense first (the reference), then issue 13's, then the others
    "none": "none",
    "signsgd": "signsgd",
    "efsignsgd": "efsignsgd",
    "onebit": "onebit",  # Seide et al.'s per-column reconstruction values (scope=column)
    "onebit_tensor": "onebit:scope=tensor",
    "terngrad": "terngrad",
    "qsgd": "qsgd:levels=7,bucket=512",
    "powersgd": "powersgd:rank=2",
    "fp16": "fp16",
    "bf16": "bf16",
    "topk": "topk:ratio=0.01",
    "randomk": "randomk:ratio=0.01",
    "threshold": "threshold:threshold=0.001",
    "dgc": "dgc:ratio=0.001,clip_norm=2.0",
    "sketch": "sketch:ratio=0.01",
}
SIGN_LR_SCALE = 0.01
# compressors whose memory carries what was not applied to the next step without a ``residual``
# switch: DGC and the sketch accumulate the velocity they did not send
ACCUMULATING = ("dgc", "sketch")
# compressors that replace Adam's update (the SGD here cannot run them): benchmarks/fidelity_adam.py
ADAM_ONLY = ("onebitadam", "topkadam", "qsgdadam")


def configs() -> dict:
    out = {}
    for name in list(HEADLINE) + sorted(set(REGISTRY) - set(HEADLINE)):
        if HEADLINE.get(name, name).split(":")[0] not in REGISTRY or name in ADAM_ONLY:
            continue
        spec = parse_spec(HEADLINE.get(name, name))
        out[name] = {"spec": HEADLINE.get(name, name), "headline": name in HEADLINE,
                     "error_feedback": bool(spec.params.get("residual")) or spec.name in ACCUMULATING,
                     "lr_scale": SIGN_LR_SCALE if name == "signsgd" else 1.0}
    return out


def _floats(text):
    return [float(v) for v in str(text).split(",") if v.strip()]


def _key(lr: float, seed: int) -> str:
    return f"lr={lr:g},seed={seed}"


def table(results: dict, seeds) -> str:
    dense = results.get("none", {}).get("mean_accuracy")
    out = ["| compressor | spec | error feedback | sweep (seed %d: lr -> accuracy) | own lr | accuracy per seed | "
           "mean | vs dense (pp) | bytes/step/worker | smaller than dense | within 0.5 pp |" % seeds[0],
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "mean_accuracy" not in r:
            continue
        sweep = ", ".join(f"{lr:g}: {a:.4f}" for lr, a in r["sweep"])
        accs = ", ".join(f"{a:.4f}" for a in r["accuracy_per_seed"])
        delta = "" if dense is None or name == "none" else f"{100 * (r['mean_accuracy'] - dense):+.2f}"
        ok = "" if dense is None or name == "none" else (
            "yes" if r["mean_accuracy"] >= dense - 0.005 else "**no**")
        out.append(f"| {name} | `{r['spec']}` | {'yes' if r['error_feedback'] else 'no'} | {sweep} | {r['lr']:g} | "
                   f"{accs} | {r['mean_accuracy']:.4f} | {delta} | {r['bytes_per_step']:,.0f} | "
                   f"{r['dense_bytes_per_step'] / r['bytes_per_step']:.1f}x | {ok} |")
    return "\n".join(out)


def _compare_with_dense(results: dict) -> None:
    dense = results.get("none", {}).get("mean_accuracy")
    if dense is not None:
        for r in results.values():
            r["vs_dense_pp"] = 100 * (r["mean_accuracy"] - dense)
            r["within_half_pp"] = r["mean_accuracy"] >= dense - 0.005


def merge(paths, out: str) -> int:
    """Join the results of several jobs (same data set, epochs, batch and sweep) into ``out``."""
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    keys = ("dataset", "world_size")
    for part in parts[1:]:
        for k in keys:
            if part[k] != parts[0][k]:
                raise ValueError(f"merge: {k} differs between the files ({part[k]!r} vs {parts[0][k]!r})")
        for k in ("epochs", "batch_size", "lrs", "seeds", "schedule"):
            if part["args"][k] != parts[0]["args"][k]:
                raise ValueError(f"merge: --{k} differs between the files")
    found = {}
    for part in parts:
        found.update(part["results"])
    order = list(configs())
    results = {k: found[k] for k in sorted(found, key=lambda k: order.index(k) if k in order else len(order))}
    _compare_with_dense(results)
    merged = {**parts[0], "argv": [p["argv"] for p in parts], "merged_from": list(paths),
              "load_average_start": [p["load_average_start"] for p in parts],
              "load_average_end": [p["load_average_end"] for p in parts],
              "elapsed_s": [p["elapsed_s"] for p in parts],
              "complete": set(order) <= set(results), "results": results}
    with open(out, "w") as f:
        json.dump(merged, f, indent=2)
    a = parts[0]["args"]
    print(f"{parts[0]['dataset']}, {parts[0]['world_size']} workers, {a['epochs']} epochs, batch {a['batch_size']} "
          f"per worker, seeds {a['seeds']}, sweep {a['lrs']}\n")
    print(table(results, a["seeds"]))
    print(f"\nwrote {out}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=["digits", "mnist1d"], default="mnist1d")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lrs", type=_floats, default=[0.05, 0.1, 0.2],
                   help="comma-separated learning-rate sweep (signSGD: times %g)" % SIGN_LR_SCALE)
    p.add_argument("--configs", nargs="+", help="subset of compressors (default: every registered one)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--schedule", default="layerwise",
                   help="merge schedule; default layerwise (every tensor compressed on its own, as in the papers)")
    p.add_argument("--out", default="benchmarks/results/accuracy/fidelity_{dataset}.json")
    p.add_argument("--resume", action="store_true", help="skip the runs already in --out")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these jobs' results into --out and print the "
                   "table (no training, no Horovod)")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out.format(dataset="merged"))
    torch.set_num_threads(1)
    all_configs = configs()
    chosen = args.configs or list(all_configs)
    for name in chosen:
        if name not in all_configs:
            p.error(f"--configs: unknown compressor {name!r}; accepted: {', '.join(all_configs)}")
    out = args.out.format(dataset=args.dataset)
    previous = {}
    if args.resume and os.path.exists(out):  # read by every rank before any rank writes
        with open(out) as f:
            previous = json.load(f).get("results", {})
    hvc.init()
    data = load(args.dataset)
    load_start, started = os.getloadavg(), time.time()
    results = {k: v for k, v in previous.items() if k not in chosen}  # other subsets' results are kept

    def run(name, lr, seed):
        done = previous.get(name, {}).get("runs", {}).get(_key(lr, seed))
        if done is not None and done["spec"] == all_configs[name]["spec"] and done["epochs"] == args.epochs \
                and done["batch_size"] == args.batch_size:
            return done
        t0 = time.perf_counter()
        r = train_and_test(all_configs[name]["spec"], data, args.dataset, lr=lr, seed=seed, epochs=args.epochs,
                           batch_size=args.batch_size, schedule=args.schedule,
                           check_name=f"check.{name}.{lr}.{seed}")
        r.update({"spec": all_configs[name]["spec"], "lr": lr, "seed": seed, "epochs": args.epochs,
                  "batch_size": args.batch_size, "seconds": time.perf_counter() - t0})
        if hvc.rank() == 0:
            print(f"{name:10s} lr {lr:<8g} seed {seed}: accuracy {r['accuracy']:.4f}  "
                  f"{r['bytes_per_step']:,.0f} B/step  identical {r['identical']}  ({r['seconds']:.0f} s)", flush=True)
        return r

    for name in chosen:
        cfg = all_configs[name]
        lrs = [lr * cfg["lr_scale"] for lr in args.lrs]
        runs = {}
        for lr in lrs:
            runs[_key(lr, args.seeds[0])] = run(name, lr, args.seeds[0])
        own = best_lr({lr: runs[_key(lr, args.seeds[0])]["accuracy"] for lr in lrs})
        for seed in args.seeds[1:]:
            runs[_key(own, seed)] = run(name, own, seed)
        at_own = [runs[_key(own, s)] for s in args.seeds]
        results[name] = {**cfg, "lr": own, "lr_at_sweep_edge": own in (min(lrs), max(lrs)),
                         "sweep": [(lr, runs[_key(lr, args.seeds[0])]["accuracy"]) for lr in lrs],
                         "accuracy_per_seed": [r["accuracy"] for r in at_own],
                         "mean_accuracy": float(np.mean([r["accuracy"] for r in at_own])),
                         "std_accuracy": float(np.std([r["accuracy"] for r in at_own])),
                         "bytes_per_step": float(np.mean([r["bytes_per_step"] for r in at_own])),
                         "dense_bytes_per_step": at_own[0]["dense_bytes_per_step"],
                         "identical": all(r["identical"] for r in runs.values()),
                         "finite": all(r["finite"] for r in at_own), "runs": runs}
        if hvc.rank() == 0:
            _compare_with_dense(results)
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with open(out + ".tmp", "w") as f:
                json.dump({"dataset": args.dataset, "world_size": hvc.size(), "args": vars(args),
                           "argv": sys.argv[1:], "torch_threads": 1, "sign_lr_scale": SIGN_LR_SCALE,
                           "load_average_start": load_start, "load_average_end": os.getloadavg(),
                           "elapsed_s": time.time() - started,
                           "conditions": "2-core machine shared with other jobs, workers under nice; Gloo over "
                                         "loopback; learning rate chosen on the first seed's test accuracy",
                           "complete": set(all_configs) <= set(results), "results": results}, f, indent=2)
            os.replace(out + ".tmp", out)
    if hvc.rank() == 0:
        print(f"\n{args.dataset}, {hvc.size()} workers, {args.epochs} epochs, batch {args.batch_size} per worker, "
              f"seeds {args.seeds}, sweep {args.lrs}\n")
        print(table(results, args.seeds))
        print(f"\nwrote {out}")
    hvc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
