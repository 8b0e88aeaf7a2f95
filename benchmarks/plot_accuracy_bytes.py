"""Accuracy against bytes per step, one point per compressor, from benchmarks/fidelity.py's results.

    python benchmarks/plot_accuracy_bytes.py      # -> benchmarks/results/accuracy/accuracy-vs-bytes.png

Reads the merged fidelity JSON of each data set (each compressor at its own best learning rate,
mean test accuracy over the seeds, this worker's payload bytes per step from ``opt.stats``) and
draws one panel per data set: x = payload bytes per step (log scale), y = test accuracy, dense
marked, methods with error feedback drawn filled. Nothing is measured here; the figure only
redraws the JSON.
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "accuracy")


def load(path: str):
    with open(path) as f:
        d = json.load(f)
    rows = []
    for name, r in d["results"].items():
        if r.get("mean_accuracy") is None or not r.get("bytes_per_step"):
            continue
        rows.append((name, r["bytes_per_step"], r["mean_accuracy"], bool(r.get("error_feedback"))))
    return d["dataset"], d.get("world_size"), rows


def plot(inputs, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(inputs), figsize=(6.2 * len(inputs), 4.6), squeeze=False)
    for ax, path in zip(axes[0], inputs):
        dataset, world, rows = load(path)
        dense = next((r for r in rows if r[0] == "none"), None)
        for name, nbytes, acc, ef in rows:
            ax.scatter(nbytes, acc, s=36, marker="o", facecolors="C0" if ef else "none", edgecolors="C0")
            ax.annotate(name, (nbytes, acc), textcoords="offset points", xytext=(4, 3), fontsize=8)
        if dense:
            ax.axhline(dense[2], color="gray", lw=0.8, ls="--")
            ax.axhline(dense[2] - 0.005, color="gray", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("payload bytes per step per worker (log)")
        ax.set_ylabel("test accuracy (mean of seeds)")
        ax.set_title(f"{dataset}, {world} workers: each method at its own learning rate")
        ax.grid(True, which="both", alpha=0.3)
    fig.text(0.01, 0.01, "filled: error feedback; dashed: dense; dotted: dense - 0.5 pp. "
             "Source: benchmarks/fidelity.py (real training, Gloo over loopback, 2-core machine).",
             fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=90)
    print("wrote", out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", nargs="+", default=[os.path.join(RESULTS, f"fidelity_{d}_merged.json")
                                                    for d in ("digits", "mnist1d")])
    ap.add_argument("--out", default=os.path.join(RESULTS, "accuracy-vs-bytes.png"))
    args = ap.parse_args(argv)
    plot(args.inputs, args.out)


if __name__ == "__main__":
    main()
