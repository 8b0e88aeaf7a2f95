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
fixed choice changes) and predicted (``hvdcompress advise``'s bisection on the emulated
profile, the same tensors scale). Writes ``--out`` .json and .md.
"""

from __future__ import annotations

import argparse
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
          "--tune-steps 3 --phase-budget-s 60")
GBPS = {"10mbit": 0.01, "100mbit": 0.1, "1gbit": 1.0, "10gbit": 10.0, "unlimited": None}


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
           "1", "--tune-steps", "1", "--no-profile", "--out", "/tmp/hvdc-codec-choice-smoke"]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def _rows(paths) -> Dict[tuple, float]:
    """(model, compression, schedule entry, link) -> median step seconds, from bench JSON files."""
    out, meta = {}, {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        model = data["meta"].get("model")
        meta[model] = data["meta"]
        for r in data["results"]:
            if r.get("status") == "ok" and r.get("step_time_s") is not None:
                out[(model, r["compression"], r.get("schedule") or "auto", r["bandwidth"])] = float(r["step_time_s"])
    return out, meta


def table(paths, out_stem: str, scale: float = SCALE) -> dict:
    rows, meta = _rows(paths)
    cells, crossings = [], []
    for model in sorted({k[0] for k in rows}):
        for spec in SPECS:
            best_by_link = {}
            for link in LINKS:
                fixed = {spec: rows.get((model, spec, "auto+tune", link)), "fp16": rows.get((model, "fp16", "auto", link)),
                         "none": rows.get((model, "none", "auto", link))}
                choice = rows.get((model, spec, "auto+tune+choice", link))
                if choice is None or any(v is None for v in fixed.values()):
                    continue
                best = min(fixed, key=fixed.get)
                best_by_link[link] = best
                cells.append({"model": model, "spec": spec, "link": link, "choice_s": choice,
                              **{f"{k}_s": v for k, v in fixed.items()}, "best_fixed": best,
                              "ratio_to_best": choice / fixed[best], "within": choice <= 1.05 * fixed[best],
                              "beats_all_by_10pct": choice <= 0.9 * min(fixed.values())})
            links = [l for l in LINKS if l in best_by_link]
            for a, b in zip(links, links[1:]):
                if best_by_link[a] != best_by_link[b]:
                    crossings.append({"model": model, "spec": spec, "between": [a, b],
                                      "below": best_by_link[a], "above": best_by_link[b]})
                    for c in cells:  # the crossover cells
                        if (c["model"], c["spec"]) == (model, spec) and c["link"] in (a, b):
                            c["crossover"] = True
    predicted, per_cell = _predicted(sorted({k[0] for k in rows}), scale)
    for c in cells:  # advise's prediction of each fixed choice's step, where the link has a rate
        for name in (c["spec"], "fp16", "none"):
            p = per_cell.get((c["model"], name, c["link"]))
            if p is not None:
                c[f"{name}_predicted_s"] = p
                c[f"{name}_prediction_error"] = p / c[f"{name}_s"] - 1.0
    result = {"cells": cells, "crossovers_measured": crossings, "crossovers_predicted": predicted,
              "all_within_5pct": all(c["within"] for c in cells),
              "crossover_cells_beat_by_10pct": all(c["beats_all_by_10pct"] for c in cells if c.get("crossover")),
              "meta": meta}
    with open(out_stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| model | spec | link | choice ms | spec ms | fp16 ms | dense ms | best fixed | choice / best | within 5% | crossover: >=10% faster |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['model']} | {c['spec']} | {c['link']} | {c['choice_s'] * 1e3:.1f} | {c[c['spec'] + '_s'] * 1e3:.1f} "
                     f"| {c['fp16_s'] * 1e3:.1f} | {c['none_s'] * 1e3:.1f} | {c['best_fixed']} | {c['ratio_to_best']:.3f} "
                     f"| {'yes' if c['within'] else 'NO'} | "
                     f"{('yes' if c['beats_all_by_10pct'] else 'NO') if c.get('crossover') else '-'} |")
    lines += ["", "advise's predicted step against the measured one (fixed choices, rate-limited links):"]
    for c in cells:
        errs = [f"{n} {c[n + '_prediction_error']:+.0%}" for n in (c["spec"], "fp16", "none")
                if n + "_prediction_error" in c]
        if errs:
            lines.append(f"- {c['model']} {c['link']}: " + ", ".join(errs))
    lines += ["", "Crossovers, measured (the best fixed choice changes between these links) and predicted:"]
    for c in crossings:
        lines.append(f"- {c['model']} {c['spec']}: between {c['between'][0]} and {c['between'][1]} "
                     f"({c['below']} below, {c['above']} above)")
    for p in predicted:
        lines.append(f"- predicted {p['model']} {p['spec']}: {p['gbps']:.3g} Gbit/s ({p['below']} below, {p['above']} above)")
    with open(out_stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def _predicted(models, scale: float):
    """``hvdcompress advise``'s crossovers for the emulated profiles the launches ran (compression
    timed on this CPU, ring links of 50 us per hop, 4 workers), and its predicted step of every
    fixed choice per rate-limited link: {(model, spec, link): seconds}."""
    from hvdcompress.bench import advise
    out, steps = [], {}
    for model in models:
        if not str(model).startswith("emulated:"):
            continue
        prof = model.split(":", 1)[1]
        w = advise.workload_from_profile(prof, scale)
        fits = advise.compression_fits([*SPECS, "fp16"], max(w.sizes_bytes) / 4, quick=False)
        for spec in SPECS:
            for c in advise.crossovers(w, fits, 4, 50e-6, spec):
                out.append(dict(c, model=model, spec=spec))
        for link, gbps in GBPS.items():
            if gbps is not None:
                cm = advise.link_model(4, gbps, 50e-6, fits)
                for spec in (*SPECS, "fp16", "none"):
                    steps[(model, spec, link)] = advise.predict(w, cm, spec)["step_seconds"]
    return out, steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    sub.add_parser("commands")
    sub.add_parser("smoke")
    t = sub.add_parser("table")
    t.add_argument("json", nargs="+")
    t.add_argument("--out", default="benchmarks/results/codec-choice-table")
    t.add_argument("--scale", type=float, default=SCALE)
    args = ap.parse_args(argv)
    if args.mode == "commands":
        print("\n".join(commands()))
        return 0
    if args.mode == "smoke":
        return smoke()
    table(args.json, args.out, args.scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
