"""Distance to the limit of an ``hvdcompress bench`` run: step time against
compute-only + one pass over the gradient + the payload's time on the link.

    python benchmarks/network_limit.py benchmarks/results/quantizers-vgg-4workers.json

For every (workers, link, spec) of the harness's JSON, the limit is

    compute-only step (measured in the same launch)
    + one memory pass over the fp32 gradient (``g * 1.0`` on one thread, timed here, median of 9)
    + expected wire bytes per worker (payload x what an ideal ring moves: ``expected_wire_tx_bytes_per_step``)
      / the link rate

i.e. what a step would cost if compression were one pass and the exchange moved exactly the payload
at the link's rate with nothing overlapped. Prints a markdown table and writes ``<input>-limit.json``.
The pass is timed when this script runs, not in the harness's launch: say so next to the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from hvdcompress.bench.netns import format_bandwidth, parse_bandwidth


def one_pass_seconds(numel: int, repeats: int = 9) -> float:
    torch.set_num_threads(1)
    g = torch.randn(numel)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        g * 1.0
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def limits(report: dict, pass_s: float) -> list:
    co = {(c["workers"], c["bandwidth"]): c["step_time_s"] for c in report["compute_only"]}
    rows = []
    for r in report["results"]:
        if r.get("status") != "ok" or (r["workers"], r["bandwidth"]) not in co:
            continue
        rate = parse_bandwidth(r["bandwidth"])
        wire_s = r["expected_wire_tx_bytes_per_step"] * 8 / rate if rate else 0.0
        compute = co[(r["workers"], r["bandwidth"])]
        limit = compute + (pass_s if r["compression"] != "none" else 0.0) + wire_s
        rows.append({"workers": r["workers"], "bandwidth": r["bandwidth"], "compression": r["compression"],
                     "step_time_s": r["step_time_s"], "compute_only_s": compute, "one_pass_s": pass_s,
                     "wire_s": wire_s, "limit_s": limit, "x_limit": r["step_time_s"] / limit,
                     "gap_s": r["step_time_s"] - limit, "compress_s_per_step": r.get("compute_seconds_per_step"),
                     "bytes_per_step": r["bytes_per_step"]})
    return rows


def table(rows: list) -> str:
    out = ["| workers | link | compression | step (s) | compute-only (s) | payload on the link (s) | limit (s) | "
           "step / limit | step - limit (s) | compress+decompress (s/step) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['workers']} | {format_bandwidth(parse_bandwidth(r['bandwidth']))} | `{r['compression']}` | "
                   f"{r['step_time_s']:.2f} | {r['compute_only_s']:.2f} | {r['wire_s']:.3f} | {r['limit_s']:.2f} | "
                   f"{r['x_limit']:.2f}x | {r['gap_s']:+.2f} | {r['compress_s_per_step'] or 0:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="the harness's OUT.json")
    args = p.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    pass_s = one_pass_seconds(int(report["meta"]["parameters"]))
    rows = limits(report, pass_s)
    print(f"one pass over {report['meta']['parameters']:,} fp32 entries (g * 1.0, one thread): {pass_s * 1e3:.1f} ms "
          f"(timed now, load average {os.getloadavg()[0]:.1f})\n")
    print(table(rows))
    out = os.path.splitext(args.report)[0] + "-limit.json"
    with open(out, "w") as f:
        json.dump({"source": args.report, "one_pass_s": pass_s, "one_pass_load_average": os.getloadavg(),
                   "definition": __doc__, "rows": rows}, f, indent=2)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
