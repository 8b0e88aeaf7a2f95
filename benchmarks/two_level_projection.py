"""Project flat and two-level exchanges to 16-1024 GPUs in nodes of 8 (PREDICTIONS, nothing is run).

The workload is the shipped ResNet-50 profile (``hvdcompress/bench/profiles/resnet50-v100.json``:
published layer shapes, ASSUMED V100-class throughput, batch 64); the codec times are the linear fits
of the Triton branch's times MEASURED on one H200 at 10M and 25M elements
(``benchmarks/results/kernels/cuda_check-h200-ede7fe8.json``; below 10M the fit's constant, launch
overhead, is ASSUMED to hold); the links are ASSUMED: NVLink-class inside a node (``--intra-gbps``,
``--intra-latency-us``), Ethernet between nodes (``--gbps``, ``--latency-us``), one NIC per node
shared by its 8 GPUs (``--nics-per-node``). The model is ``hvdcompress.schedule.twolevel`` through
``hvdcompress.schedule.scaling.two_level_sweep``; docs/scaling.md publishes the table.

    python benchmarks/two_level_projection.py --out benchmarks/results/scaling/two-level-resnet50.json \
        --md benchmarks/results/scaling/two-level-resnet50.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CODEC_TIMES = os.path.join(ROOT, "benchmarks", "results", "kernels", "cuda_check-h200-ede7fe8.json")
SPECS = ("dgc:ratio=0.001", "qsgd", "powersgd:rank=4")
COLUMNS = ("workers", "gbps", "layout", "label", "step_seconds", "efficiency", "groups", "intra_bytes_per_worker",
           "inter_bytes_per_worker", "inter_bytes_per_node", "counts")


CONTENDED = "contended_step_seconds"  # a column only where --cores says a node's ranks share cores


def _row(r: dict, columns=COLUMNS) -> list:
    """One row of the sweep as a list in ``columns`` order, floats to 4 significant digits."""
    flat = dict(r, intra_bytes_per_worker=r["bytes_per_worker"]["intra"],
                inter_bytes_per_worker=r["bytes_per_worker"]["inter"])
    return [float(f"{flat[k]:.4g}") if isinstance(flat.get(k), float) else flat.get(k) for k in columns]


def rows_of(result: dict) -> list:
    """The stored rows as dicts (``COLUMNS`` keys)."""
    return [dict(zip(result["columns"], r)) for r in result["rows"]]


def run(args) -> dict:
    from hvdcompress.bench.advise import workload_from_profile
    from hvdcompress.schedule.costmodel import CostModel
    from hvdcompress.schedule.scaling import TWO_LEVEL_NOTE, Host, codec_fits, two_level_sweep

    workload = workload_from_profile(args.profile)
    # a GPU per rank: no host, the timeline's step; --cores: a node's ranks share that many cores
    host = None if args.cores is None else Host(args.gpus_per_node, args.cores, args.cpu_per_byte)
    fits = codec_fits((), args.codec_times, args.codec_branch)
    base = CostModel.from_link(2, args.gbps[0], args.latency_us * 1e-6, fits)
    rows = two_level_sweep(workload, base, args.spec, local_size=args.gpus_per_node, workers=args.workers,
                           gbps=args.gbps, intra_gbps=args.intra_gbps, intra_latency_s=args.intra_latency_us * 1e-6,
                           latency_s=args.latency_us * 1e-6, nics_per_node=args.nics_per_node, gtopk=True,
                           host=host)
    columns = COLUMNS + ((CONTENDED,) if host is not None else ())
    return {"note": TWO_LEVEL_NOTE,
            "command": "python benchmarks/two_level_projection.py " + " ".join(sys.argv[1:]),
            "assumed": {"workload": f"profile {args.profile} (nominal V100-class times, batch 64)",
                        "intra": f"{args.intra_gbps:g} Gbit/s, {args.intra_latency_us:g} us per hop (NVLink-class)",
                        "inter": f"{', '.join(f'{g:g}' for g in args.gbps)} Gbit/s, {args.latency_us:g} us per hop",
                        "nics_per_node": args.nics_per_node, "gpus_per_node": args.gpus_per_node,
                        **({"cores_per_node": args.cores, "cpu_per_byte": args.cpu_per_byte} if host else {})},
            "measured": {"codec_times": os.path.relpath(args.codec_times, ROOT), "branch": args.codec_branch,
                         "fits": {k: v.to_dict() for k, v in fits.items()}},
            "compute_seconds": workload.compute_seconds, "gradient_bytes": float(sum(workload.sizes_bytes)),
            "columns": list(columns), "rows": [_row(r, columns) for r in rows]}


def markdown(result: dict, workers: int) -> str:
    """The table docs/scaling.md shows: at ``workers`` GPUs, per inter-node rate and route."""
    lines = [f"| inter-node | route | step ms | efficiency | MB per GPU inside | MB per GPU across | "
             f"MB per node across |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows_of(result):
        if r["workers"] != workers:
            continue
        name = r["label"] + (" (" + ", ".join(f"{k} x{n}" for k, n in r["counts"].items()) + ")"
                             if r.get("counts") else "")
        lines.append(f"| {r['gbps']:g} Gbit/s | {name} | {r['step_seconds'] * 1e3:.1f} | {r['efficiency']:.2f} | "
                     f"{r['intra_bytes_per_worker'] / 1e6:.1f} | {r['inter_bytes_per_worker'] / 1e6:.3g} | "
                     f"{r['inter_bytes_per_node'] / 1e6:.3g} |")
    return "\n".join(lines) + "\n"


def workers_table(result: dict, gbps: float, spec: str = "dgc:ratio=0.001") -> str:
    """Per worker count at one inter-node rate: step and a node's bytes across, flat against two-level."""
    layouts = ("flat dense", "hierarchical dense", "flat spec", "flat spec, gtopk", "two-level spec",
               "two-level spec, gtopk", "choice")
    rows = [r for r in rows_of(result) if r["gbps"] == gbps and (r["layout"] in layouts[:2] or spec in r["label"])]
    workers = sorted({r["workers"] for r in rows})
    head = "| route | " + " | ".join(f"{w} GPUs" for w in workers) + " |"
    lines = [f"Step ms / MB a node sends across per step, {spec}, {gbps:g} Gbit/s between nodes:", "", head,
             "|---|" + "---:|" * len(workers)]
    for layout in layouts:
        cells = {r["workers"]: r for r in rows if r["layout"] == layout}
        if not cells:
            continue
        name = next(iter(cells.values()))["label"].split(" (")[0] if layout == "choice" else \
            next(iter(cells.values()))["label"]
        lines.append(f"| {name} | " + " | ".join(
            f"{cells[w]['step_seconds'] * 1e3:.0f} / {cells[w]['inter_bytes_per_node'] / 1e6:.3g}" for w in workers)
            + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="resnet50-v100")
    ap.add_argument("--spec", action="append", default=None, help=f"default: {', '.join(SPECS)}")
    ap.add_argument("--workers", type=lambda t: [int(x) for x in t.split(",")], default=[16, 64, 128, 256, 1024])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gbps", type=lambda t: [float(x) for x in t.split(",")], default=[1.0, 10.0, 100.0],
                    help="ASSUMED inter-node rates (Gbit/s)")
    ap.add_argument("--latency-us", type=float, default=50.0, help="ASSUMED inter-node latency per hop")
    ap.add_argument("--intra-gbps", type=float, default=2400.0, help="ASSUMED intra-node rate (Gbit/s)")
    ap.add_argument("--intra-latency-us", type=float, default=2.0, help="ASSUMED intra-node latency per hop")
    ap.add_argument("--nics-per-node", type=int, default=1)
    ap.add_argument("--cores", type=int, default=None, help="cores a node's ranks share (the contention term, "
                    "hvdcompress.schedule.scaling.contended_step; default: each GPU rank its own device)")
    ap.add_argument("--cpu-per-byte", type=float, default=0.0, help="with --cores: the transport's seconds per byte")
    ap.add_argument("--codec-times", default=CODEC_TIMES)
    ap.add_argument("--codec-branch", default="triton")
    ap.add_argument("--out", default="two-level-projection.json")
    ap.add_argument("--md", default=None, help="also write the tables as Markdown here")
    ap.add_argument("--render", default=None, help="only write the tables of a stored JSON (no sweep)")
    args = ap.parse_args(argv)
    args.spec = args.spec or list(SPECS)
    if args.cores is not None and args.cores < 1:
        ap.error(f"--cores: must be an integer >= 1; got {args.cores}")
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
    else:
        result = run(args)
        with open(args.out, "w") as f:
            json.dump(result, f, separators=(",", ":"))
    workers = sorted({r["workers"] for r in rows_of(result)})
    rates = sorted({r["gbps"] for r in rows_of(result)})
    table = markdown(result, 128 if 128 in workers else workers[-1]) + "\n" + workers_table(result, rates[0])
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)
    print(table)
    if not args.render:
        print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
