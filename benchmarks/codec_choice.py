"""Acceptance of the per-group codec choice (``codec_choice="auto"``): measured step times of the
choice against the best of {the spec everywhere, fp16 everywhere, dense everywhere}, per link.

Three modes:

    python benchmarks/codec_choice.py commands            # the bench launches (root: netns + tbf)
    python benchmarks/codec_choice.py smoke               # a tiny loopback launch, no root (seconds)
    python benchmarks/codec_choice.py table OUT.json ...  # the table from the launches' JSON

``table`` reads every ``hvdcompress bench`` JSON given, keys each row by (model, spec, link), and
for every (model, user spec, link) cell reports the median step of: the spec everywhere
(``auto+tune``), the choice (``auto+tune+choice``), fp16 and dense (``auto``: mgwfbp, the plan as
made; measured validation would cost minutes per step on the slowest links); the best fixed one; the
choice's ratio to it; whether it is within 5% (``within``) and, in cells where the best fixed
choice differs from the neighbouring link's (the crossover), whether it is >= 10% faster than
all three (``beats``); and the crossover link per spec, measured (between which links the best
fixed choice changes) and predicted (between which links advise's predicted best fixed choice
changes). Writes ``--out`` .json and .md.

The predictions are ``hvdcompress advise``'s, made inside each launch (``bench --advise``: before
the timed phases the workers run advise's measurement on the live link -- the emulated model's
workload timed, compression timed, the link's fitted cost model) and read from the rows'
``advise_predicted_s``: for every cell, the predicted step of each fixed choice and of the choice,
and its error against the measured step; ``advise_within_15pct`` says whether every error is
within 15%. A predicted crossover is located between the measured links only: advise's link
models exist at the rates the launches ran.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = ("vgg16-v100", "resnet50-v100")
SPECS = ("dgc:ratio=0.001", "powersgd:rank=4")
LINKS = ("10mbit", "100mbit", "1gbit", "10gbit", "unlimited")
SCALE = 32  # tensors 32x smaller than the profiled model's, times kept (as the pipelining figures)
COMMON = (f"-n 4 -b {','.join(LINKS)} --emulated-scale {SCALE} --steps 8 --warmup 7 --profile-steps 4 "
          "--tune-steps 3 --phase-budget-s 60 --advise")
ADVISE_WITHIN = 0.15  # advise's predicted step within 15% of the measured one


def commands() -> List[str]:
    out = []
    for prof in PROFILES:
        stem = f"benchmarks/results/codec-choice-{prof.split('-')[0]}"
        out.append(f"flock /tmp/hvdc-timing.lock env HOROVOD_FUSION_THRESHOLD=0 hvdcompress bench "
                   f"--compute emulated:{prof} {COMMON} -c {' '.join(SPECS)} -s auto+tune,auto+tune+choice "
                   f"--out {stem}")
        out.append(f"flock /tmp/hvdc-timing.lock env HOROVOD_FUSION_THRESHOLD=0 hvdcompress bench "
                   f"--compute emulated:{prof} {COMMON} -c fp16 none -s auto --out {stem}-dense")
        out.append(f"python benchmarks/codec_choice.py table {stem}.json {stem}-dense.json --out {stem}-table")
    return out


def smoke() -> int:
    cmd = [sys.executable, "-m", "hvdcompress.bench", "--loopback", "-n", "2", "--model", "mlp", "-c",
           "topk:ratio=0.01", "none", "-s", "auto+tune+choice", "--steps", "2", "--warmup", "6", "--profile-steps",
           "1", "--tune-steps", "1", "--no-profile", "--advise", "--out", "/tmp/hvdc-codec-choice-smoke"]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def _rows(paths):
    """From bench JSON files: (model, compression, schedule entry, link) -> median step seconds,
    the same keys -> advise's in-launch predicted step (rows measured with ``--advise``), and the
    files' meta per model."""
    out, advised, meta = {}, {}, {}
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:  # stored runs are gzipped
            data = json.load(f)
        model = data["meta"].get("model")
        meta[model] = data["meta"]
        for r in data["results"]:
            if r.get("status") == "ok" and r.get("step_time_s") is not None:
                key = (model, r["compression"], r.get("schedule") or "auto", r["bandwidth"])
                out[key] = float(r["step_time_s"])
                if r.get("advise_predicted_s") is not None:
                    advised[key] = float(r["advise_predicted_s"])
    return out, advised, meta


def predicted_crossovers(cells) -> List[dict]:
    """Between which links advise's predicted best fixed choice changes, per (model, spec): from
    the cells' in-launch predictions (cells with a prediction for all three fixed choices)."""
    out = []
    for model, spec in dict.fromkeys((c["model"], c["spec"]) for c in cells):
        names = (spec, "fp16", "none")
        best = {c["link"]: min(names, key=lambda n: c[f"{n}_predicted_s"]) for c in cells
                if (c["model"], c["spec"]) == (model, spec) and all(f"{n}_predicted_s" in c for n in names)}
        links = [l for l in LINKS if l in best]
        for a, b in zip(links, links[1:]):
            if best[a] != best[b]:
                out.append({"model": model, "spec": spec, "between": [a, b], "below": best[a], "above": best[b]})
    return out


def table(paths, out_stem: str) -> dict:
    rows, advised, meta = _rows(paths)
    cells, crossings = [], []
    for model in sorted({k[0] for k in rows}):
        for spec in SPECS:
            best_by_link = {}
            for link in LINKS:
                keys = {spec: (model, spec, "auto+tune", link), "fp16": (model, "fp16", "auto", link),
                        "none": (model, "none", "auto", link)}
                fixed = {k: rows.get(key) for k, key in keys.items()}
                choice = rows.get((model, spec, "auto+tune+choice", link))
                if choice is None or any(v is None for v in fixed.values()):
                    continue
                best = min(fixed, key=fixed.get)
                best_by_link[link] = best
                cell = {"model": model, "spec": spec, "link": link, "choice_s": choice,
                        **{f"{k}_s": v for k, v in fixed.items()}, "best_fixed": best,
                        "ratio_to_best": choice / fixed[best], "within": choice <= 1.05 * fixed[best],
                        "beats_all_by_10pct": choice <= 0.9 * min(fixed.values())}
                keys["choice"] = (model, spec, "auto+tune+choice", link)
                for name, key in keys.items():  # advise's in-launch prediction of each measured step
                    if key in advised:
                        cell[f"{name}_predicted_s"] = advised[key]
                        cell[f"{name}_prediction_error"] = advised[key] / cell[f"{name}_s"] - 1.0
                cells.append(cell)
            links = [l for l in LINKS if l in best_by_link]
            for a, b in zip(links, links[1:]):
                if best_by_link[a] != best_by_link[b]:
                    crossings.append({"model": model, "spec": spec, "between": [a, b],
                                      "below": best_by_link[a], "above": best_by_link[b]})
                    for c in cells:  # the crossover cells
                        if (c["model"], c["spec"]) == (model, spec) and c["link"] in (a, b):
                            c["crossover"] = True
    errors = [v for c in cells for k, v in c.items() if k.endswith("_prediction_error")]
    result = {"cells": cells, "crossovers_measured": crossings, "crossovers_predicted": predicted_crossovers(cells),
              "all_within_5pct": all(c["within"] for c in cells),
              "crossover_cells_beat_by_10pct": all(c["beats_all_by_10pct"] for c in cells if c.get("crossover")),
              "advise_within_15pct": all(abs(e) <= ADVISE_WITHIN for e in errors) if errors else None,
              "advise_worst_error": max(errors, key=abs) if errors else None, "meta": meta}
    with open(out_stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| model | spec | link | choice ms | spec ms | fp16 ms | dense ms | best fixed | choice / best | within 5% | crossover: >=10% faster |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['model']} | {c['spec']} | {c['link']} | {c['choice_s'] * 1e3:.1f} | {c[c['spec'] + '_s'] * 1e3:.1f} "
                     f"| {c['fp16_s'] * 1e3:.1f} | {c['none_s'] * 1e3:.1f} | {c['best_fixed']} | {c['ratio_to_best']:.3f} "
                     f"| {'yes' if c['within'] else 'NO'} | "
                     f"{('yes' if c['beats_all_by_10pct'] else 'NO') if c.get('crossover') else '-'} |")
    verdict = {True: "yes", False: "NO", None: "no predictions in these files: run the bench with --advise"}
    lines += ["", f"advise's predicted step against the measured one (predicted in each launch, on its link: "
              f"bench --advise); all within {ADVISE_WITHIN:.0%}: {verdict[result['advise_within_15pct']]}"]
    for c in cells:
        errs = [f"{label} {c[n + '_predicted_s'] * 1e3:.1f} ms ({c[n + '_prediction_error']:+.0%})"
                for n, label in ((c["spec"], c["spec"]), ("fp16", "fp16"), ("none", "dense"), ("choice", "choice"))
                if n + "_prediction_error" in c]
        if errs:
            lines.append(f"- {c['model']} {c['spec']} {c['link']}: " + ", ".join(errs))
    lines += ["", "Crossovers (the best fixed choice changes between these links), measured and as advise "
              "predicted them in the launches:"]
    for kind, found in (("measured", crossings), ("predicted", result["crossovers_predicted"])):
        for c in found:
            lines.append(f"- {kind} {c['model']} {c['spec']}: between {c['between'][0]} and {c['between'][1]} "
                         f"({c['below']} below, {c['above']} above)")
    with open(out_stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    sub.add_parser("commands")
    sub.add_parser("smoke")
    t = sub.add_parser("table")
    t.add_argument("json", nargs="+")
    t.add_argument("--out", default="benchmarks/results/codec-choice-table")
    args = ap.parse_args(argv)
    if args.mode == "commands":
        print("\n".join(commands()))
        return 0
    if args.mode == "smoke":
        return smoke()
    table(args.json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
