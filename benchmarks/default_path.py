"""The user's default against the fixed choices, per link: is the default within 5% of the best?

The default is ``compression="dgc:ratio=0.001,warmup_epochs=0"`` alone: schedule "auto" with
measured validation, the per-group codec choice and its drift watch (the bench entry
``auto+tune+choice`` is exactly that: ``codec_choice="auto"`` is what None resolves to there).
Against it, on the same launch and interleaved step by step with it: the same spec with
``codec_choice="off"`` (``auto+tune``: its own validated partition) and on the fixed schedules
``single`` and ``layerwise``; in a second launch per link, fp16 and dense everywhere (``auto``:
mgwfbp, the plan as made; measured validation would cost minutes per step on the slow link). Every
figure is the median of the slowest rank's step over the timed steps, taken after the warm-up:
with the defaults, 50 untimed steps per phase (the profiling and the measured validation run in
them) then 20 timed rounds -- the median of the last 20 of 70 steps. The default is the first
phase of every round, right after the compute-only step; the workers meet after that one
(``hvdcompress.bench.worker_common.timed_round``), so the default's slowest rank does not count as
its own the ranks' compute skew, which the compute-only step leaves and no training step carries.

    python benchmarks/default_path.py run        # root: network namespaces + tbf, 100mbit and unlimited
    python benchmarks/default_path.py run --loopback   # no root: loopback only, no rate limit (labelled)
    python benchmarks/default_path.py commands   # the bench launches it runs
    python benchmarks/default_path.py smoke      # a tiny loopback run of the whole pipeline (no root)
    python benchmarks/default_path.py table A.json B.json --out STEM

``run`` writes ``benchmarks/results/default-path-{spec,fixed}.json`` (the bench's own outputs) and
``benchmarks/results/default-path.{json,md}``: per link the default, off and every fixed choice,
the best fixed one, the default's ratio to it (``within_5pct``) and to off, and what each
validation kept and the step noise it measured.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = "dgc:ratio=0.001,warmup_epochs=0"
DEFAULT = "auto+tune+choice"  # what codec_choice=None resolves to for SPEC under schedule="auto"
OFF = "auto+tune"
SPEC_FIXED = ("single", "layerwise")
DENSE = ("fp16", "none")
LINKS = ("100mbit", "unlimited")
WITHIN = 0.05


def _bench(args, specs, schedules: str, warmup: int, steps: int, out: str) -> List[str]:
    cmd = [sys.executable, "-m", "hvdcompress.bench", "-n", "2", "--model", args.model, "-c", *specs,
           "-s", schedules, "--warmup", str(warmup), "--steps", str(steps), "--profile-steps", str(args.profile_steps),
           "--tune-steps", str(args.tune_steps), "--out", out]
    if args.loopback:
        cmd.append("--loopback")
        if args.latency_ms:
            cmd += ["--latency-ms", str(args.latency_ms)]
    else:
        cmd += ["-b", ",".join(args.links)]
    return cmd


def launches(args) -> List[List[str]]:
    """The two bench launches: the spec's phases (default, off, fixed schedules), then fp16 and dense."""
    stem = os.path.join(args.out_dir, "default-path")
    return [_bench(args, [SPEC], ",".join((DEFAULT, OFF) + SPEC_FIXED), args.warmup, args.steps, stem + "-spec"),
            _bench(args, list(DENSE), "auto", args.dense_warmup, args.dense_steps, stem + "-fixed")]


def _load(path: str) -> dict:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def table(paths: List[str], out_stem: str) -> dict:
    """Per (model, link): the default's median step against off and every fixed choice."""
    rows: Dict[tuple, dict] = {}
    meta = {}
    for path in paths:
        data = _load(path)
        meta[os.path.basename(path)] = {k: data["meta"].get(k) for k in (
            "command", "mode", "network", "model", "parameters", "latency_note", "warmup", "steps", "started_utc",
            "load_average_1_5_15_at_start", "load_average_1_5_15_at_end")}
        for r in data["results"]:
            if r.get("status") == "ok" and r.get("step_time_s") is not None:
                rows[(data["meta"]["model"], r["bandwidth"], r["compression"], r.get("schedule") or "auto")] = r
    cells = []
    for model, link in dict.fromkeys((k[0], k[1]) for k in rows):
        def row(spec, sched):
            return rows.get((model, link, spec, sched))

        default = row(SPEC, DEFAULT)
        fixed = {"off (auto+tune)": row(SPEC, OFF), **{f"dgc @ {s}": row(SPEC, s) for s in SPEC_FIXED},
                 **{("dense" if d == "none" else d) + " @ auto": row(d, "auto") for d in DENSE}}
        fixed = {k: v for k, v in fixed.items() if v is not None}
        if default is None or not fixed:
            continue
        best = min(fixed, key=lambda k: fixed[k]["step_time_s"])
        d = default["step_time_s"]
        cell = {"model": model, "link": link, "default_s": d,
                **{f"{k}_s": v["step_time_s"] for k, v in fixed.items()},
                "best_fixed": best, "best_fixed_s": fixed[best]["step_time_s"],
                "default_to_best": d / fixed[best]["step_time_s"],
                "within_5pct": d <= (1 + WITHIN) * fixed[best]["step_time_s"],
                "missing_fixed": [k for k in ("off (auto+tune)", "dense @ auto", "fp16 @ auto") if k not in fixed]}
        if "off (auto+tune)" in fixed:
            cell["default_to_off"] = d / fixed["off (auto+tune)"]["step_time_s"]
        for name, r in (("default", default), ("off", fixed.get("off (auto+tune)"))):
            plan = (r or {}).get("plan") or {}
            tuned = plan.get("tuning") or {}
            cell[f"{name}_kept"] = tuned.get("kept_label")
            cell[f"{name}_groups"] = plan.get("groups")
            cell[f"{name}_codecs"] = sorted(set(c.split(":")[0] for c in plan.get("codecs") or [])) or None
            cell[f"{name}_step_noise"] = tuned.get("step_noise")
            cell[f"{name}_wire_bytes_per_step"] = r.get("bytes_per_step") if r else None
        cells.append(cell)
    result = {"cells": cells, "all_within_5pct": bool(cells) and all(c["within_5pct"] for c in cells),
              "definition": "step times: median over the timed steps of the slowest rank's step, after the warm-up "
                            "(hvdcompress bench step_time_s)", "meta": meta}
    with open(out_stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    names = ["off (auto+tune)"] + [f"dgc @ {s}" for s in SPEC_FIXED] + ["fp16 @ auto", "dense @ auto"]
    lines = ["| model | link | default ms | " + " | ".join(f"{n} ms" for n in names)
             + " | best fixed | default / best | within 5% | default / off | default kept | off kept |",
             "|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|---|"]
    for c in cells:
        vals = " | ".join(f"{c[n + '_s'] * 1e3:.1f}" if n + "_s" in c else "-" for n in names)
        lines.append(f"| {c['model']} | {c['link']} | {c['default_s'] * 1e3:.1f} | {vals} | {c['best_fixed']} | "
                     f"{c['default_to_best']:.3f} | {'yes' if c['within_5pct'] else 'NO'} | "
                     f"{c.get('default_to_off', float('nan')):.3f} | {c['default_kept']} ({c['default_groups']} groups"
                     f"{', ' + '/'.join(c['default_codecs']) if c['default_codecs'] else ''}) | "
                     f"{c['off_kept']} ({c['off_groups']} groups) |")
    notes = {v.get("latency_note") for v in meta.values() if v.get("latency_note") not in (None, "none injected")}
    modes = {v.get("network") for v in meta.values()}
    lines += ["", f"network: {'; '.join(sorted(m for m in modes if m))}"]
    lines += [f"latency: {n}" for n in sorted(notes)]
    lines += [f"all within 5% of the best fixed choice: {'yes' if result['all_within_5pct'] else 'NO'}"]
    with open(out_stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def run(args) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    stems = []
    for cmd in launches(args):
        print(" ".join(cmd), flush=True)
        rc = subprocess.call(cmd, cwd=ROOT)
        stem = cmd[cmd.index("--out") + 1]
        if rc != 0 and not os.path.exists(stem + ".json"):
            print(f"default_path: the launch failed (exit {rc}) and wrote nothing", file=sys.stderr)
            return rc
        stems.append(stem + ".json")
    table(stems, os.path.join(args.out_dir, args.name))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    for mode in ("run", "commands", "smoke"):
        p = sub.add_parser(mode, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.add_argument("--model", default="mlp", help="the bench model (mlp: 12.6M parameters in 8 tensors)")
        p.add_argument("--links", default=",".join(LINKS), help="per-worker link rates (network namespaces)")
        p.add_argument("--loopback", action="store_true", help="127.0.0.1, no rate limit, no root (labelled)")
        p.add_argument("--latency-ms", type=float, default=0.0,
                       help="with --loopback: latency INJECTED into every exchange round in the workers (labelled)")
        p.add_argument("--warmup", type=int, default=50, help="untimed steps per phase of the spec's launch")
        p.add_argument("--steps", type=int, default=20, help="timed rounds of the spec's launch")
        p.add_argument("--dense-warmup", type=int, default=4, help="untimed steps per fp16 / dense phase")
        p.add_argument("--dense-steps", type=int, default=5, help="timed rounds of the fp16 / dense launch")
        p.add_argument("--profile-steps", type=int, default=3)
        p.add_argument("--tune-steps", type=int, default=3, help="the optimizer's default")
        p.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
        p.add_argument("--name", default="default-path", help="the table's file stem in --out-dir")
    t = sub.add_parser("table")
    t.add_argument("json", nargs="+")
    t.add_argument("--out", default=os.path.join("benchmarks", "results", "default-path"))
    args = ap.parse_args(argv)
    if args.mode == "table":
        table(args.json, args.out)
        return 0
    args.links = [l for l in args.links.split(",") if l]
    if args.mode == "smoke":  # the whole pipeline in about a minute: loopback, a small model, few steps
        args.loopback, args.model, args.warmup, args.steps = True, "deep", 3, 2
        args.dense_warmup, args.dense_steps, args.profile_steps, args.tune_steps = 2, 2, 1, 1
        args.out_dir, args.name = "/tmp/hvdc-default-path-smoke", "default-path"
    if args.mode == "commands":
        for cmd in launches(args):
            print(" ".join(cmd))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
