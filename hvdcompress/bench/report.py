"""Writing the benchmark's figures: JSON (everything), a markdown table, a PNG chart."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

from .netns import format_bandwidth, parse_bandwidth


def _bw_key(label: str) -> float:
    bps = parse_bandwidth(label)
    return math.inf if bps is None else float(bps)


def _num(v: Optional[float], digits: int = 3) -> str:
    if v is None:
        return "–"
    if v == 0:
        return "0"
    return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"


def _bytes(v: Optional[float]) -> str:
    if v is None:
        return "–"
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} B"


def _model_text(meta: dict) -> str:
    if meta.get("parameters") is None:  # nothing measured yet
        return f"`{meta['model']}`"
    return f"`{meta['model']}` ({meta['parameters'] / 1e6:.2g}M parameters, {meta['parameter_tensors']} tensors)"


def _load_text(meta: dict) -> str:
    start, end = meta.get("load_average_1_5_15_at_start"), meta.get("load_average_1_5_15_at_end")
    if not start or not end:
        return ""
    return (f"Machine load average (1 min) {start[0]:.1f} at start, {end[0]:.1f} at end, "
            f"on {meta['cpu_count']} cores")


def _steps_text(meta: dict) -> str:
    if meta.get("phase_budget_s"):
        return (f"{meta['steps']} timed steps, or as many (>= 3) as give each phase about "
                f"{meta['phase_budget_s']:g} s (column 'steps')")
    return f"{meta['steps']} timed steps"


def _schedule(r: dict) -> str:
    """'mgs (4)': the schedule asked for, what 'auto' resolved to, and the number of groups."""
    if not r.get("schedule"):
        return "–"
    plan = r.get("plan") or {}
    name = r["schedule"]
    if plan.get("schedule") and plan["schedule"] != name:
        name = f"{name}→{plan['schedule']}"
    return f"{name} ({plan['groups']})" if plan.get("groups") else name


def _predicted(r: dict) -> str:
    """'0.031 (+5%; back to back 0.030, +3%)': the prediction and its error against the interleaved
    timed steps, then against the steps the optimizer timed back to back during warm-up."""
    if r.get("predicted_step_time_s") is None:
        return "–"
    text = f"{_num(r['predicted_step_time_s'])} ({r['prediction_error']:+.0%}"
    if r.get("back_to_back_prediction_error") is not None:
        text += (f"; back to back {_num(r['back_to_back_step_time_s'])}, "
                 f"{r['back_to_back_prediction_error']:+.0%}")
    return text + ")"


def write_json(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def markdown_table(report: dict) -> str:
    """The README table: one row per (workers, link, compression), compute-only rows included."""
    meta = report["meta"]
    lines = [
        f"Model {_model_text(meta)}, batch {meta['batch']} per worker, synthetic data; "
        f"torch threads per worker: {meta['threads_per_worker']}; median of {_steps_text(meta)} after "
        f"{meta['warmup']} warm-up; {meta['network']}."]
    load = _load_text(meta)
    if load:
        lines.append(load + ".")
    if meta.get("horovod_env"):
        lines.append("Horovod settings: " + ", ".join(f"{k}={v}" for k, v in meta["horovod_env"].items())
                     + " (HOROVOD_FUSION_THRESHOLD=0: Horovod fuses nothing, so each group of a schedule is "
                       "its own collective).")
    if meta["latency_ms_injected"]:
        lines.append(f"Latency: {meta['latency_ms_injected']:g} ms INJECTED into the completion of every "
                     "exchange round in the worker processes (not network-emulated).")
    lines += ["",
              "| workers | link | compression | schedule (groups) | steps | step time (s) | predicted (s) "
              "| samples/s | x compute-only "
              "| speed-up vs dense | payload/step/worker | wire tx/step/worker (measured) | wire / ideal ring "
              "| compress s/step |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    co = {(c["workers"], c["bandwidth"]): c for c in report["compute_only"]}
    rows = sorted(report["results"], key=lambda r: (r["workers"], _bw_key(r["bandwidth"])))
    last_group = None
    for r in rows:
        group = (r["workers"], r["bandwidth"])
        if group != last_group and group in co:
            c = co[group]
            lines.append(f"| {c['workers']} | {format_bandwidth(parse_bandwidth(c['bandwidth']))} | "
                         f"compute-only | – | {c['steps']} | {_num(c['step_time_s'])} | – | "
                         f"{_num(c['samples_per_s'])} | 1 | – | 0 | {_bytes(c['wire_tx_bytes_per_step'])} | – | – |")
        last_group = group
        if r["status"] != "ok":
            lines.append(f"| {r['workers']} | {format_bandwidth(parse_bandwidth(r['bandwidth']))} | "
                         f"`{r['compression']}` | {_schedule(r)} | | {r['status']} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['workers']} | {format_bandwidth(parse_bandwidth(r['bandwidth']))} | `{r['compression']}` | "
            f"{_schedule(r)} | {r['steps']} | {_num(r['step_time_s'])} | {_predicted(r)} | "
            f"{_num(r['samples_per_s'])} | {_num(r['x_compute_only'])} | "
            f"{_num(r['speedup_vs_dense'])} | {_bytes(r['bytes_per_step'])} | "
            f"{_bytes(r['wire_tx_bytes_per_step'])} | {_num(r['wire_over_expected'], 2)} | "
            f"{_num(r['compute_seconds_per_step'], 2)} |")
    return "\n".join(lines) + "\n"


def write_chart(report: dict, path: str) -> None:
    """Step time vs link bandwidth: one line per compressor, compute-only (timed in each launch)
    dashed; one panel per worker count. 'unlimited' is the rightmost point; the y axis is log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    meta = report["meta"]
    ok = [r for r in report["results"] if r["status"] == "ok"]
    worker_counts = sorted({r["workers"] for r in ok} | {c["workers"] for c in report["compute_only"]})
    if not worker_counts:
        return
    labels = sorted({r["bandwidth"] for r in report["results"]}, key=_bw_key)
    xs = {b: i for i, b in enumerate(labels)}
    fig, axes = plt.subplots(1, len(worker_counts), figsize=(6.4 * len(worker_counts), 5.0), squeeze=False)
    for ax, n in zip(axes[0], worker_counts):
        by_spec: Dict[str, List[dict]] = {}
        for r in ok:
            if r["workers"] == n:
                label = r["compression"] + (f" @ {r['schedule']}" if r.get("schedule") else "")
                by_spec.setdefault(label, []).append(r)
        for spec, rs in by_spec.items():
            rs.sort(key=lambda r: _bw_key(r["bandwidth"]))
            ax.plot([xs[r["bandwidth"]] for r in rs], [r["step_time_s"] for r in rs], marker="o", label=spec)
        limits = sorted((c for c in report["compute_only"] if c["workers"] == n),
                        key=lambda c: _bw_key(c["bandwidth"]))
        if limits:
            ax.plot([xs[c["bandwidth"]] for c in limits], [c["step_time_s"] for c in limits], color="black",
                    linestyle="--", marker="x", label="compute-only (no exchange)")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([format_bandwidth(parse_bandwidth(b)) for b in labels])
        ax.set_yscale("log")
        fmt = FuncFormatter(lambda v, _: f"{v:.3g}")
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(fmt)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("link bandwidth per worker (tbf, both directions)")
        ax.set_ylabel("step time (s, median)")
        ax.set_title(f"{n} workers")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    title = (f"model {_model_text(meta).replace('`', '')}, batch {meta['batch']}/worker, "
             f"{meta['threads_per_worker']} torch thread(s)/worker\n{meta['mode']}")
    if _load_text(meta):
        title += f"; {_load_text(meta).lower()}"
    if meta["latency_ms_injected"]:
        title += f"; {meta['latency_ms_injected']:g} ms latency INJECTED (not emulated)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
