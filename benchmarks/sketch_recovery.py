"""Heavy-hitter recovery of Sketched-SGD as a function of (rows r, columns c, candidates factor P).

    python benchmarks/sketch_recovery.py            # writes benchmarks/results/accuracy/sketch_recovery.{json,png}
    python benchmarks/sketch_recovery.py --data synthetic   # the heavy-tailed stand-in only

Data (real gradients, not synthetic): the digits CNN of ``examples/`` (``DigitsCNN``, 38,570
parameters, the whole model as one flat vector, as a merged group) trained with dense
data-parallel momentum SGD (lr 0.05, m 0.9) over ``--workers`` simulated workers in one process,
batch 32 per worker. At steps 10, 20, ..., every worker's momentum buffer u_w is taken as its
vector v_w (what a worker sketches right after a step's ``v += u`` when nothing is pending).

For every (r, c, P) the oracle's own functions (``hvdcompress.reference.sketch``) run the
exchange: S = sum_w sketch(v_w); candidates = top P*k |median estimate|; selected = top k of
|sum_w v_w| among the candidates. Reported: recall = |selected & T| / k where T is the true
top-k of |sum_w v_w|, the candidates' recall |C & T| / k, and the l2 mass captured,
||sum v [selected]||^2 / ||sum v [T]||^2 (what matters for the update); k = ceil(ratio * d) (1%
default), mean over the saved steps and 3 hash seeds; and the wire cost (r*c + P*k) / d.

``--data synthetic`` adds (default: both) a heavy-tailed stand-in, stated as such: a shared
Student-t(1.5) signal of d = 100,000 plus per-worker Gaussian noise (one snapshot).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

from hvdcompress.bench.example_models import DigitsCNN
from hvdcompress.datasets import load_digits
from hvdcompress.hashing import row_keys
from hvdcompress.reference.selection import topk_indices
from hvdcompress.reference.sketch import estimates, sketch_table
from hvdcompress.spec import num_selected


def momentum_buffers(workers: int, steps: int, every: int, seed: int = 0):
    """Per-worker momentum buffers (flat float32) of dense data-parallel SGD, every ``every`` steps."""
    torch.manual_seed(seed)
    d = load_digits(seed)
    x, y = torch.from_numpy(d.x_train), torch.from_numpy(d.y_train)
    model = DigitsCNN()
    params = list(model.parameters())
    u = [[torch.zeros_like(p) for p in params] for _ in range(workers)]
    gen = torch.Generator().manual_seed(seed)
    saved = []
    for step in range(1, steps + 1):
        grads = []
        for w in range(workers):
            idx = torch.randint(0, x.shape[0], (32,), generator=gen)
            model.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            g = [p.grad.detach().clone() for p in params]
            for ub, gb in zip(u[w], g):
                ub.mul_(0.9).add_(gb)
            grads.append(g)
        with torch.no_grad():
            for i, p in enumerate(params):
                p -= 0.05 * sum(u[w][i] for w in range(workers)) / workers
        if step % every == 0:
            saved.append([torch.cat([t.reshape(-1) for t in u[w]]).numpy().copy() for w in range(workers)])
    return saved


def synthetic(workers: int, d: int, seed: int = 0):
    """Heavy-tailed stand-in: a shared Student-t (df 1.5) signal plus per-worker Gaussian noise
    of the signal's median magnitude, one snapshot."""
    rng = np.random.default_rng(seed)
    signal = rng.standard_t(1.5, d)
    noise = np.median(np.abs(signal))
    return [[(signal + noise * rng.standard_normal(d)).astype(np.float32) for _ in range(workers)]]


def recovery(vs, k, rows, cols, p2, seed):
    d = vs[0].size
    keys = row_keys(seed, "model", rows)
    table = sum(sketch_table(v, keys, cols) for v in vs)
    est = estimates(table, keys, d)
    cand = topk_indices(est, min(d, p2 * k)).astype(np.int64)
    total = np.sum(np.stack(vs), axis=0, dtype=np.float32)
    sel = cand[topk_indices(total[cand], k).astype(np.int64)]
    true_idx = topk_indices(total, k).astype(np.int64)
    truth = set(true_idx.tolist())
    mass = float(np.sum(total[sel].astype(np.float64) ** 2) / np.sum(total[true_idx].astype(np.float64) ** 2))
    return len(truth & set(sel.tolist())) / k, len(truth & set(cand.tolist())) / k, mass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 3, 5, 7])
    p.add_argument("--cols-per-k", type=float, nargs="+", default=[0.5, 1, 2, 4, 8, 16])
    p.add_argument("--p2", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--data", nargs="+", default=["digits", "synthetic"], choices=["digits", "synthetic"])
    p.add_argument("--synthetic-d", type=int, default=100_000)
    p.add_argument("--out", default="benchmarks/results/accuracy/sketch_recovery.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = {"ratio": args.ratio, "seeds": args.seeds, "workers": args.workers, "datasets": {}}
    for name in args.data:
        if name == "digits":
            saved = momentum_buffers(args.workers, args.steps, args.every)
            what = (f"DigitsCNN momentum buffers (m=0.9) of {args.workers} simulated workers, dense SGD lr 0.05, "
                    f"batch 32 per worker, steps {list(range(args.every, args.steps + 1, args.every))}")
        else:
            saved = synthetic(args.workers, args.synthetic_d)
            what = (f"synthetic heavy-tailed: shared Student-t(1.5) signal + per-worker Gaussian noise of its "
                    f"median magnitude, {args.workers} workers")
        print(f"--- {name}: {what}")
        out["datasets"][name] = sweep(args, saved, what)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")
    plot(out, os.path.splitext(args.out)[0] + ".png")
    return 0


def sweep(args, saved, what):
    d = saved[0][0].size
    k = num_selected(args.ratio, d)
    rows_out = []
    for r in args.rows:
        for cpk in args.cols_per_k:
            c = max(1, int(round(cpk * k)))
            for p2 in args.p2:
                rec = [recovery(vs, k, r, c, p2, s) for vs in saved for s in range(args.seeds)]
                row = {"rows": r, "cols": c, "cols_per_k": cpk, "p2": p2,
                       "recall": float(np.mean([a for a, _, _ in rec])), "recall_min": float(np.min([a for a, _, _ in rec])),
                       "candidate_recall": float(np.mean([b for _, b, _ in rec])),
                       "mass": float(np.mean([m for _, _, m in rec])),
                       "wire_fraction": (r * c + p2 * k) / d}
                rows_out.append(row)
                print(f"r={r} c={c:>5} ({cpk:g}k) P={p2}: recall {row['recall']:.3f} (min {row['recall_min']:.3f}), "
                      f"candidates {row['candidate_recall']:.3f}, l2 mass {row['mass']:.3f}, wire {row['wire_fraction']:.3f} of dense", flush=True)
    return {"data": what, "d": d, "k": k, "rows": rows_out}


def plot(out, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(out["datasets"])
    p2s = sorted({r["p2"] for r in out["datasets"][names[0]]["rows"]})
    fig, axes = plt.subplots(len(names), len(p2s), figsize=(3.6 * len(p2s), 3.2 * len(names)), sharey=True,
                             squeeze=False)
    for row_axes, name in zip(axes, names):
        meta = out["datasets"][name]
        for ax, p2 in zip(row_axes, p2s):
            for r in sorted({x["rows"] for x in meta["rows"]}):
                pts = sorted((x["wire_fraction"], x["recall"]) for x in meta["rows"] if x["p2"] == p2 and x["rows"] == r)
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", ms=3, label=f"r={r}")
            ax.set_xscale("log")
            ax.set_ylim(0, 1.02)
            ax.set_title(f"{name} (d={meta['d']:,}, k={meta['k']}), P={p2}", fontsize=9)
            ax.set_xlabel("wire (r*c + P*k) / d; c = k/2 ... 16k")
            ax.grid(alpha=0.3)
        row_axes[0].set_ylabel("recall of the true top-k")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Sketched-SGD heavy-hitter recovery, k = {out['ratio']:.0%} of d, {out['workers']} workers",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
