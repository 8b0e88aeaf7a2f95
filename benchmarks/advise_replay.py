"""Replay ``hvdcompress advise``'s in-launch predictions offline, against the measured steps.

A bench run with ``--advise`` saves, per launch (one link), what advise measured: the calibrated
workload, the link's cost model (with its raw collective samples) and the reference steps. This
script rebuilds advise's prediction of every phase from those saved inputs with the *current*
code (``hvdcompress.bench.advise.predict``), so a change to the cost model or the timeline can be
checked against every measured cell without a new launch. Optional ``--link-patch`` arguments
change the saved link model before predicting, for terms the saved run did not measure (for
example ``half_sum_ns=27``: an fp16 allreduce costs at least 27 ns per byte, the CPU sum of
halves timed elsewhere; ``refit=1``: the collectives refitted from the saved samples with the
current fits). Runs of an emulated model that saved no tensor shapes get them from the run's
profile (``saved_shapes``; ``--no-shapes`` leaves them out), so wire costs that depend on the
shape (PowerSGD's P and Q) are charged by it.

    python benchmarks/advise_replay.py benchmarks/results/scheduler/codec-choice/codec-choice-{resnet50,vgg16}{,-dense}.json.gz
    python benchmarks/advise_replay.py FILES --recorded     # also the prediction the launch recorded

Per cell it prints the measured step, the replayed prediction and its error (predicted / measured
- 1); at the end, how many are within 15% and the worst error. Every number but "measured" is a
prediction.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from dataclasses import replace
from typing import Callable, Dict, Iterable, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hvdcompress.bench import advise, schedules  # noqa: E402
from hvdcompress.schedule.costmodel import CostModel, LinearFit, fit_cost_model  # noqa: E402
from hvdcompress.schedule.planner import Workload  # noqa: E402

WITHIN = 0.15


def launches(data: dict) -> Dict[str, dict]:
    """The file's advise measurements by link (one per launch)."""
    out = {}
    for a in data.get("advise") or []:
        out[a["bandwidth"]] = a
    return out


def saved_shapes(workload: Workload, meta: dict) -> Optional[Workload]:
    """``workload`` with its tensors' shapes, for a run of an emulated model that did not save them:
    from the run's profile at its scale (``meta["compute"]``); None for other runs."""
    compute = meta.get("compute") or {}
    if compute.get("mode") != "emulated" or not compute.get("profile"):
        return None
    return advise.profile_shapes(workload, compute["profile"], float(compute.get("scale", 1.0)))


def replay_rows(path: str, patch: Optional[Callable[[CostModel], CostModel]] = None,
                shapes: bool = True) -> List[dict]:
    """Per measured phase of ``path`` (a bench JSON written with ``--advise``): model, link, spec,
    schedule entry, measured step, the launch's recorded prediction and the replayed one.
    ``shapes``: the tensors' shapes where the run saved none (``saved_shapes``)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:  # stored runs are gzipped
        data = json.load(f)
    by_link = launches(data)
    if not by_link:
        raise ValueError(f"{path}: no advise measurements (run the bench with --advise)")
    model_name = data["meta"].get("model", "?")
    rows = []
    for r in data["results"]:
        a = by_link.get(r.get("bandwidth"))
        if a is None or r.get("status", "ok") != "ok" or r.get("step_time_s") is None:
            continue
        workload = Workload.from_dict(a["workload"])
        if shapes and workload.shapes is None:
            workload = saved_shapes(workload, data["meta"]) or workload
        link = CostModel.from_dict(a["link"])
        if patch is not None:
            link = patch(link)
        entry = r.get("schedule") or "auto"
        base, _ = schedules.split(entry)
        alternatives = advise.ALTERNATIVES if schedules.chooses(entry) else ()
        step = advise.predict(workload, link, r["compression"], alternatives, schedule=base)["step_seconds"]
        rows.append({"model": model_name, "link": r["bandwidth"], "spec": r["compression"], "entry": entry,
                     "measured_s": float(r["step_time_s"]), "recorded_s": r.get("advise_predicted_s"),
                     "predicted_s": float(step), "error": float(step) / float(r["step_time_s"]) - 1.0})
    return rows


PATCHES = {
    "refit": "1: refit the collectives from the saved samples with the current fits (fit_cost_model)",
    "half_sum_ns": "an fp16 allreduce's per-byte time is at least this (ns per byte): the transport's CPU "
                   "sum of halves, timed elsewhere (start-up: the fp32 fit's)",
    "start_ups": "1: the start-ups of a training step the launch timed (meta step_start_ups: alone, queued)",
    "alone_alpha_ms": "a collective's start-up in a step when alone in its cycle (CostModel.alone_alpha)",
    "queued_alpha_ms": "a collective's start-up in a step when queued with others (CostModel.queued_alpha)",
}


def link_patch(settings: Iterable[str]) -> Optional[Callable[[CostModel], CostModel]]:
    """``name=value`` settings (``PATCHES``) applied to every saved link model, for terms the saved
    run did not measure; None without any."""
    values = {}
    for s in settings:
        key, _, val = s.partition("=")
        if key not in PATCHES:
            raise ValueError(f"link patch: unknown setting {key!r}; known: {', '.join(PATCHES)}")
        try:
            values[key] = float(val)
        except ValueError:
            raise ValueError(f"link patch: {key} needs a number; got {val!r}") from None
    if not values:
        return None

    def patch(model: CostModel) -> CostModel:
        kw = {}
        if values.get("refit"):
            samples = model.meta["samples"]
            fitted = fit_cost_model(model.world_size, samples["allreduce"], samples["allgather"],
                                    allreduce_half_samples=samples.get("allreduce_half"))
            kw.update(allreduce=fitted.allreduce, allgather=fitted.allgather)
            if fitted.allreduce_half is not None:
                kw["allreduce_half"] = fitted.allreduce_half
        if "half_sum_ns" in values:
            ar = kw.get("allreduce", model.allreduce)
            kw["allreduce_half"] = LinearFit(ar.alpha, max(ar.beta, values["half_sum_ns"] * 1e-9))
        if values.get("start_ups"):
            timed = model.meta.get("step_start_ups")
            if not timed:
                raise ValueError("link patch start_ups: this launch's link has no step_start_ups (timed by "
                                 "advise's measurement since it records them)")
            kw.update(alone_alpha=float(timed["alone_s"]), queued_alpha=float(timed["queued_s"]))
        for name in ("alone_alpha", "queued_alpha"):
            if name + "_ms" in values:
                kw[name] = values[name + "_ms"] * 1e-3
        return replace(model, **kw)
    return patch


def label(row: dict) -> str:
    spec = row["spec"].split(":")[0]
    return {"none": "dense"}.get(spec, spec) + ("+choice" if "choice" in row["entry"] else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="bench JSON files written with --advise")
    ap.add_argument("--recorded", action="store_true", help="also print the prediction recorded in the launch")
    ap.add_argument("--link-patch", action="append", default=[], metavar="NAME=VALUE",
                    help="change every saved link model first: " + "; ".join(f"{k}: {v}" for k, v in PATCHES.items()))
    ap.add_argument("--no-shapes", action="store_true",
                    help="leave out the tensors' shapes where a run saved none (wire costs by element count)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    try:
        patch = link_patch(args.link_patch)
        rows = [row for p in args.files for row in replay_rows(p, patch, not args.no_shapes)]
    except (OSError, ValueError, KeyError) as e:
        print(f"advise_replay: {e}", file=sys.stderr)
        return 2
    print(f"{'model':<24} {'link':<8} {'phase':<16} {'measured ms':>11} "
          + (f"{'recorded ms':>11} {'err':>6} " if args.recorded else "") + f"{'predicted ms':>12} {'err':>6}")
    for r in rows:
        rec = ""
        if args.recorded:
            rec = (f"{r['recorded_s'] * 1e3:11.1f} {r['recorded_s'] / r['measured_s'] - 1:+6.0%} "
                   if r["recorded_s"] else f"{'-':>11} {'':>6} ")
        print(f"{r['model']:<24} {r['link']:<8} {label(r):<16} {r['measured_s'] * 1e3:11.1f} {rec}"
              f"{r['predicted_s'] * 1e3:12.1f} {r['error']:+6.0%}")
    within = sum(abs(r["error"]) <= WITHIN for r in rows)
    worst = max(rows, key=lambda r: abs(r["error"]))
    mean_abs = sum(abs(r["error"]) for r in rows) / len(rows)
    print(f"within {WITHIN:.0%}: {within} of {len(rows)}; mean |error| {mean_abs:.1%}; worst {worst['error']:+.0%} "
          f"({worst['model']} {worst['link']} {label(worst)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
