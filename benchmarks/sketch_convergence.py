"""Sketched-SGD vs local top-k (error feedback) vs dense at the SAME bytes sent per step, 2-16 workers.

    python benchmarks/sketch_convergence.py sim --dataset digits --workers 2 4 8 16    # one process
    horovodrun -np 4 -H localhost:4 --gloo python benchmarks/sketch_convergence.py real --dataset digits
    python benchmarks/sketch_convergence.py plot --inputs benchmarks/results/accuracy/sketch_convergence_*.json

Methods (``--sketch`` sets the sketch; top-k's ratio is then chosen so that the bytes each worker
puts on the wire per step, summed over the model's tensors, equal the sketch's, within one entry
per tensor):

    dense     ``none``: every gradient allreduced; SGD momentum 0.9
    sketch    ``--sketch`` (default ``sketch:ratio=0.01``: r=5, c=2% of d, P=4, k=1%); momentum 0.9
              lives in the compressor (the SGD's is taken over)
    topk      local top-k with error feedback at the matched ratio, gathered as (index, value)
              pairs; SGD momentum 0.9 applied to the averaged sparse result

``sim`` simulates N workers in ONE process: every step, each simulated worker computes the
gradient of its own mini-batch on the shared parameters (all workers hold the same parameters in
data-parallel SGD), and every tensor is exchanged among the N workers (allreduce = sum in rank
order, allgather = concatenation), each worker keeping its own residual / momentum / sketch
state: by the PyTorch compressors driven in lockstep (``--engine torch``, default; tested bit for
bit against the oracle) or by the numpy oracle's ``simulate`` (``--engine oracle``). ``real`` runs the same loop on real
Horovod workers (``hvdcompress.bench.convergence.train_and_test``, the library's optimizer), so
the simulated 2 and 4 workers can be checked against real ones.

The global batch (``--global-batch``) is the same for every N (each worker takes global/N per
step; each worker owns the shard ``rank::N`` of the training set and shuffles it with its own
generator, as the real loop), so every N takes the same number of steps and sees the same data
per step; what changes with N is how the gradient is split. Figures per step and worker:

    sent        bytes this worker puts on the wire (what ``opt.stats`` measures)
    received    bytes it gets back: the payload for an allreduce, every worker's payload for an
                allgather (N x sent for top-k)
    applied     nonzero entries of the averaged update, as a fraction of d (top-k: the union of
                the workers' supports; sketch: <= k; dense: d)

The paper's claim (Ivkin et al. 2019): local top-k's overall compression collapses with N (the
union of the supports, hence what a worker receives, grows with N), the sketch's does not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

DENSE = "none"
DEFAULTS = {"digits": {"lr": 0.05, "epochs": 20, "global_batch": 64},
            "mnist1d": {"lr": 0.1, "epochs": 10, "global_batch": 256}}


def tensor_sizes(dataset):
    from hvdcompress.bench.example_models import for_dataset
    return [(n, p.numel()) for n, p in for_dataset(dataset).named_parameters()]


def bytes_sent(spec, sizes, world=2) -> int:
    """Bytes one worker sends per step for ``spec`` over tensors of ``sizes``, measured by one
    simulated exchange of every tensor (the sizes do not depend on the values)."""
    from hvdcompress.reference import simulate
    rng = np.random.default_rng(0)
    total = 0
    for name, d in sizes:
        grads = [rng.standard_normal(d).astype(np.float32) for _ in range(world)]
        _, _, sent = simulate(spec, grads, key=name)
        total += sum(t.nbytes for rnd in sent[0] for t in rnd)
    return total


def matched_topk(sketch: str, sizes) -> tuple:
    """(top-k spec, its bytes, the sketch's bytes): the largest ratio whose bytes <= the sketch's."""
    target = bytes_sent(sketch, sizes)
    lo, hi = 1e-4, 1.0
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        if bytes_sent(f"topk:ratio={mid:.6g}", sizes) <= target:
            lo = mid
        else:
            hi = mid
    spec = f"topk:ratio={lo:.6g}"
    return spec, bytes_sent(spec, sizes), target


def methods(args, sizes):
    topk, topk_bytes, sketch_bytes = matched_topk(args.sketch, sizes)
    return {"dense": DENSE, "sketch": args.sketch, "topk": topk}, {"topk": topk_bytes, "sketch": sketch_bytes}


def momentum_for(spec: str) -> float:
    return 0.0 if spec.startswith("sketch") else 0.9  # the sketch keeps momentum 0.9 itself


# --- one process, N simulated workers -----------------------------------------------------------
def _lockstep(gens):
    """Drive the N ranks' torch exchange generators together: Allreduce = sum in rank order,
    Allgather = concatenation in rank order (as ``simulate``). Returns (result, bytes per rank)."""
    import torch

    from torch_ops.collectives import request_bytes
    n = len(gens)
    sent, results, inbox = [0] * n, [None] * n, None
    while True:
        requests, done = [], 0
        for r, gen in enumerate(gens):
            try:
                requests.append(next(gen) if inbox is None else gen.send(inbox[r]))
            except StopIteration as stop:
                results[r] = stop.value
                done += 1
        if done:
            assert done == n, "ranks disagree on the number of rounds"
            return results[0], sent
        inbox = [[] for _ in range(n)]
        for r in range(n):
            sent[r] += int(request_bytes(requests[r]))
        for i, req in enumerate(requests[0]):
            parts = [requests[r][i].tensor for r in range(n)]
            if type(req).__name__ in ("Allreduce", "Flag"):
                total = parts[0].clone()
                for t in parts[1:]:
                    total += t
                out = [total.clone() for _ in range(n)]
            else:
                cat = torch.cat(parts)
                out = [cat.clone() for _ in range(n)]
            for r in range(n):
                inbox[r].append(out[r])
        inbox = [tuple(a) for a in inbox]


def train_sim(spec_text, data, dataset, world, seed, lr, epochs, global_batch, engine="torch"):
    import torch
    import torch.nn.functional as F

    from hvdcompress.bench.example_models import for_dataset
    from hvdcompress.reference import simulate
    from hvdcompress.spec import parse_spec

    from torch_ops.compressors import ExchangeContext, build_compressor
    spec = parse_spec(spec_text)
    comp = build_compressor(spec)
    gathered = spec.exchange == "allgather"
    torch.manual_seed(seed)
    model = for_dataset(dataset)
    params = list(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum_for(spec_text))
    batch = global_batch // world
    shards = [(torch.from_numpy(data.x_train)[r::world], torch.from_numpy(data.y_train)[r::world])
              for r in range(world)]
    gens = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(world)]
    steps = len(data.x_train) // world // batch
    states = {name: [{} for _ in range(world)] for name, _ in params}
    d_total = sum(p.numel() for _, p in params)
    sent_b, recv_b, applied, nsteps = 0, 0, 0, 0
    for epoch in range(epochs):
        perms = [torch.randperm(len(x), generator=g) for (x, _), g in zip(shards, gens)]
        for i in range(steps):
            grads = []
            for r, (x, y) in enumerate(shards):
                idx = perms[r][i * batch:(i + 1) * batch]
                model.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                grads.append([p.grad.detach().numpy().copy() for _, p in params])
            for t, (name, p) in enumerate(params):
                if engine == "oracle":
                    total, _, sent = simulate(spec, [g[t] for g in grads], states[name], key=name, step=nsteps,
                                              epoch=epoch, scale=1.0 / world)
                    per_rank = [sum(x.nbytes for rnd in s for x in rnd) for s in sent]
                else:
                    exch = [comp.exchange(torch.from_numpy(g[t]).reshape(-1),
                                          ExchangeContext(name, nsteps, world, 1.0 / world, states[name][r],
                                                          tuple(p.shape), epoch, r))
                            for r, g in enumerate(grads)]
                    total, per_rank = _lockstep(exch)
                    total = total.numpy()
                sent_b += per_rank[0]
                recv_b += sum(per_rank) if gathered else per_rank[0]
                applied += int(np.count_nonzero(total))
                p.grad = torch.from_numpy(np.ascontiguousarray(total, dtype=np.float32)).view_as(p)
            opt.step()
            nsteps += 1
    model.eval()
    with torch.no_grad():
        acc = (model(torch.from_numpy(data.x_test)).argmax(1).numpy() == data.y_test).mean()
    finite = all(bool(torch.isfinite(p).all()) for _, p in params)
    return {"accuracy": float(acc), "sent_bytes_per_step": sent_b / nsteps, "received_bytes_per_step": recv_b / nsteps,
            "applied_fraction": applied / nsteps / d_total, "dense_bytes_per_step": 4 * d_total, "steps": nsteps,
            "finite": finite}


def run_sim(args) -> int:
    import torch

    from hvdcompress.datasets import load
    torch.set_num_threads(1)
    data = load(args.dataset)
    sizes = tensor_sizes(args.dataset)
    specs, matched = methods(args, sizes)
    print(f"{args.dataset}: d = {sum(d for _, d in sizes):,}; specs {specs}; bytes/step sent {matched}", flush=True)
    out = {"mode": "sim (N workers in one process)", "dataset": args.dataset, "specs": specs,
           "matched_bytes": matched, "lr": args.lr, "epochs": args.epochs, "global_batch": args.global_batch,
           "seeds": args.seeds, "runs": {}, "load_before": os.getloadavg()}
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        if old.get("specs") == specs and old.get("epochs") == args.epochs:
            out["runs"] = old.get("runs", {})  # resume
    for seed in args.seeds:  # seed outermost: a cut-off run still has every N for the first seeds
        for world in args.workers:
            for name in args.methods:
                key = f"{world}/{name}/{seed}"
                if key in out["runs"]:
                    continue
                t0 = time.time()
                r = train_sim(specs[name], data, args.dataset, world, seed, args.lr, args.epochs, args.global_batch,
                              args.engine)
                r["seconds"], r["engine"] = time.time() - t0, args.engine
                out["runs"][key] = r
                print(f"N={world:>2} {name:>6} seed {seed}: acc {r['accuracy']:.4f} sent {r['sent_bytes_per_step']:,.0f} "
                      f"recv {r['received_bytes_per_step']:,.0f} applied {r['applied_fraction']:.4f} "
                      f"({r['seconds']:.0f} s)", flush=True)
                out["load_after"] = os.getloadavg()
                write(args.out, out)
    summarize(out)
    write(args.out, out)
    return 0


# --- real Horovod workers ----------------------------------------------------------------------
def run_real(args) -> int:
    import torch

    import hvdcompress.torch as hvc
    from hvdcompress.bench.convergence import train_and_test
    from hvdcompress.datasets import load
    hvc.init()
    torch.set_num_threads(1)
    world = hvc.size()
    data = load(args.dataset)
    sizes = tensor_sizes(args.dataset)
    specs, matched = methods(args, sizes)
    out = {"mode": f"real ({world} Horovod Gloo workers)", "dataset": args.dataset, "specs": specs,
           "matched_bytes": matched, "lr": args.lr, "epochs": args.epochs, "global_batch": args.global_batch,
           "seeds": args.seeds, "runs": {}, "load_before": os.getloadavg()}
    for seed in args.seeds:
        for name in args.methods:
            t0 = time.time()
            r = train_and_test(specs[name], data, args.dataset, lr=args.lr, seed=seed, epochs=args.epochs,
                               batch_size=args.global_batch // world, momentum=momentum_for(specs[name]))
            r = {"accuracy": r["accuracy"], "sent_bytes_per_step": r["bytes_per_step"],
                 "dense_bytes_per_step": r["dense_bytes_per_step"], "identical": r["identical"],
                 "finite": r["finite"], "seconds": time.time() - t0}
            out["runs"][f"{world}/{name}/{seed}"] = r
            if hvc.rank() == 0:
                print(f"N={world} {name:>6} seed {seed}: acc {r['accuracy']:.4f} sent {r['sent_bytes_per_step']:,.0f} "
                      f"identical {r['identical']} ({r['seconds']:.0f} s)", flush=True)
                out["load_after"] = os.getloadavg()
                write(args.out, out)
    if hvc.rank() == 0:
        summarize(out)
        write(args.out, out)
    return 0


# --- report ------------------------------------------------------------------------------------
def summarize(out) -> None:
    table = {}
    for key, r in out["runs"].items():
        world, name, _ = key.split("/")
        table.setdefault((int(world), name), []).append(r)
    out["summary"] = []
    print(f"\n{out['dataset']}, {out['mode']}, {out['epochs']} epochs, global batch {out['global_batch']}, "
          f"lr {out['lr']}; mean over seeds\n")
    print("| workers | method | test accuracy | sent B/step | received B/step | applied / d | seeds |")
    print("|---|---|---|---|---|---|---|")
    for (world, name), rs in sorted(table.items()):
        row = {"workers": world, "method": name, "spec": out["specs"][name],
               "accuracy": statistics.mean(r["accuracy"] for r in rs),
               "accuracy_min": min(r["accuracy"] for r in rs), "accuracy_max": max(r["accuracy"] for r in rs),
               "sent_bytes_per_step": statistics.mean(r["sent_bytes_per_step"] for r in rs), "seeds": len(rs)}
        for k in ("received_bytes_per_step", "applied_fraction"):
            if k in rs[0]:
                row[k] = statistics.mean(r[k] for r in rs)
        if "identical" in rs[0]:
            row["identical"] = all(r["identical"] for r in rs)
        out["summary"].append(row)
        print(f"| {world} | {name} | {row['accuracy']:.4f} ({row['accuracy_min']:.4f}-{row['accuracy_max']:.4f}) | "
              f"{row['sent_bytes_per_step']:,.0f} | {row.get('received_bytes_per_step', float('nan')):,.0f} | "
              f"{row.get('applied_fraction', float('nan')):.4f} | {len(rs)} |")


def plot(paths, out_png) -> None:
    """Accuracy and bytes received per worker vs N, one column per data set (sim; real as markers)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = []
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        if "summary" not in res:
            summarize(res)
        results.append(res)
    datasets = sorted({r["dataset"] for r in results})
    fig, axes = plt.subplots(2, len(datasets), figsize=(5.5 * len(datasets), 7), squeeze=False)
    colors = {"dense": "tab:gray", "sketch": "tab:blue", "topk": "tab:red"}
    for col, ds in enumerate(datasets):
        for res in (r for r in results if r["dataset"] == ds):
            sim = res["mode"].startswith("sim")
            for name in ("dense", "sketch", "topk"):
                rows = sorted((r for r in res["summary"] if r["method"] == name), key=lambda r: r["workers"])
                if not rows:
                    continue
                ws = [r["workers"] for r in rows]
                style = dict(color=colors[name], marker="o" if sim else "x", linestyle="-" if sim else "none",
                             label=f"{name} ({'simulated' if sim else 'real workers'})")
                axes[0][col].plot(ws, [r["accuracy"] for r in rows], **style)
                if sim:
                    axes[1][col].plot(ws, [r["received_bytes_per_step"] / 1e3 for r in rows], **style)
        axes[0][col].set_title(f"{ds}: test accuracy (mean of seeds)")
        axes[1][col].set_title(f"{ds}: kB received per worker per step")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers")
            ax.grid(alpha=0.3)
        axes[1][col].set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Sketched-SGD vs local top-k (EF) vs dense at equal bytes sent per worker")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    print(f"wrote {out_png}")


def write(path, out) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["sim", "real", "plot"])
    p.add_argument("--inputs", nargs="*", default=[], help="plot: result JSON files")
    p.add_argument("--dataset", choices=sorted(DEFAULTS), default="digits")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16], help="sim: simulated worker counts")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=["dense", "sketch", "topk"])
    p.add_argument("--sketch", default="sketch:ratio=0.01")
    p.add_argument("--lr", type=float)
    p.add_argument("--epochs", type=int)
    p.add_argument("--global-batch", type=int)
    p.add_argument("--engine", choices=["torch", "oracle"], default="torch",
                   help="sim: exchanges by the PyTorch compressors driven in lockstep (bit for bit the oracle's, "
                        "tested; faster) or by the numpy oracle itself")
    p.add_argument("--out")
    args = p.parse_args(argv)
    for k, v in DEFAULTS[args.dataset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out is None:
        args.out = f"benchmarks/results/accuracy/sketch_convergence_{args.dataset}_{args.mode}.json"
        if args.mode == "real":
            args.out = args.out.replace(".json", "_{world}.json")
    if args.mode == "plot":
        plot(args.inputs, args.out or "benchmarks/results/accuracy/sketch_convergence.png")
        return 0
    if args.mode == "real":
        import hvdcompress.torch as hvc
        hvc.init()
        args.out = args.out.format(world=hvc.size())
        return run_real(args)
    return run_sim(args)


if __name__ == "__main__":
    sys.exit(main())
