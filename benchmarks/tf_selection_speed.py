"""TensorFlow selection and DGC compression speed, side by side in one run (CPU, traced functions).

    TF_USE_LEGACY_KERAS=1 python benchmarks/tf_selection_speed.py   # 100K, 1M, 10M, 25M x 0.1%, 1%

Columns, all on the same tensor, alternating within every repeat (median of ``--repeats``), each a
``tf.function`` with k as a tensor, as the Keras tape path runs them:

    top_k         ``tf.math.top_k(tf.abs(a), k, sorted=False)`` -- unordered, no tie rule
    top_k+sort    the previous ``topk_indices``: ``tf.sort(tf.math.top_k(|a|, k, sorted=True).indices)``
    topk (ours)   ``tf_ops.compressors.topk_indices``: the oracle's exact set, ascending
    DGC select    ``sampled_threshold_select`` (sample ratio 0.01, 4 adaptations)
    max           ``tf.reduce_max(a)``: one read of a
    DGC step      ``DGCCompressor.exchange`` up to its send (state update, selection, values,
                  zeroing), on tf.Variables
    (g,u,v) pass  ``v.assign(v + u * g)``: one read of g, u, v and one write of v

Intra- and inter-op parallelism are 1 thread (``--threads``). Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvdcompress import parse_spec  # noqa: E402
from hvdcompress.spec import num_selected  # noqa: E402
from tf_ops.compressors import ExchangeContext, build_compressor  # noqa: E402
from tf_ops.compressors.selection import sampled_threshold_select, topk_indices  # noqa: E402

COLUMNS = ["top_k", "top_k_sort", "topk", "dgc_select", "read", "dgc_step", "guv_pass"]
HEAD = ["top_k", "top_k+sort (before)", "topk (ours)", "DGC select", "max", "DGC step", "(g,u,v) pass"]


def bench(size: int, density: float, repeats: int, rng: np.random.Generator):
    a = tf.constant((rng.standard_normal(size) * rng.random(size)).astype(np.float32))
    g = tf.constant((rng.standard_normal(size) * rng.random(size)).astype(np.float32))
    k = num_selected(density, size)
    kt = tf.constant(k, tf.int32)
    dgc = build_compressor(parse_spec(f"dgc:ratio={density},warmup_epochs=0,min_sparse_numel=1"))
    state = dgc.new_state((1, size), tf.float32)
    w = tf.Variable(tf.zeros([size]))
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def dgc_step(x):
        step.assign_add(1)
        ctx = ExchangeContext("w", step, 2, 0.5, state, (1, size), 0, density=tf.constant(density, tf.float64))
        return tuple(r.tensor for r in next(dgc.exchange(x, ctx)))

    fns = {
        "top_k": tf.function(lambda x, kk: tf.math.top_k(tf.abs(x), kk, sorted=False).indices),
        "top_k_sort": tf.function(lambda x, kk: tf.sort(tf.math.top_k(tf.abs(x), kk, sorted=True).indices)),
        "topk": tf.function(lambda x, kk: topk_indices(x, kk)),
        "dgc_select": tf.function(lambda x, kk: sampled_threshold_select(x, kk, 0.01, 4, 7)),
        "read": tf.function(lambda x, kk: tf.reduce_max(x)),
        "dgc_step": lambda x, kk: dgc_step(g),
        "guv_pass": tf.function(lambda x, kk: w.assign(w + state["u"] * g, read_value=False) and kk),
    }
    times = {c: [] for c in COLUMNS}
    for rep in range(repeats + 1):
        for c in COLUMNS:
            t0 = time.perf_counter()
            out = fns[c](a, kt)
            _ = [t.numpy() for t in tf.nest.flatten(out)]
            if rep:  # the first round traces
                times[c].append(time.perf_counter() - t0)
    row = {"numel": size, "density": density, "k": k}
    row.update({f"{c}_s": statistics.median(times[c]) for c in COLUMNS})
    row["topk_vs_top_k"] = row["top_k_s"] / row["topk_s"]
    row["topk_vs_before"] = row["top_k_sort_s"] / row["topk_s"]
    row["dgc_step_x_pass"] = row["dgc_step_s"] / row["guv_pass_s"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e5, 1e6, 1e7, 2.5e7])
    p.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/kernels/selection_speed_tf.json")
    args = p.parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    for size in map(int, args.sizes):
        for density in args.densities:
            rows.append(bench(size, density, args.repeats, rng))
            r = rows[-1]
            print(f"numel {size:>10,} density {density:.1%}: top_k {r['top_k_s'] * 1e3:.1f} ms, topk "
                  f"{r['topk_s'] * 1e3:.1f} ms, DGC step {r['dgc_step_s'] * 1e3:.1f} ms", flush=True)
    print(f"\ntensorflow {tf.__version__}, {args.threads} thread(s), median of {args.repeats} repeats, "
          "milliseconds per call\n")
    print("| elements | density | k | " + " | ".join(HEAD) + " | topk vs top_k | topk vs before "
          "| DGC step / (g,u,v) pass |")
    print("|---" * (len(HEAD) + 6) + "|")
    for r in rows:
        cells = " | ".join(f"{r[f'{c}_s'] * 1e3:.2f}" for c in COLUMNS)
        print(f"| {r['numel']:,} | {r['density']:.1%} | {r['k']:,} | {cells} | {r['topk_vs_top_k']:.1f}x | "
              f"{r['topk_vs_before']:.1f}x | {r['dgc_step_x_pass']:.2f}x |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"tensorflow": tf.__version__, "threads": args.threads, "repeats": args.repeats,
                   "machine": platform.processor() or platform.machine(), "unit": "seconds per call",
                   "columns": dict(zip(COLUMNS, HEAD)), "rows": rows}, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
