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


FRAMEWORK_NAMES = {"torch": "PyTorch", "tf": "TensorFlow/Keras"}


def _framework_text(meta: dict) -> str:
    """'PyTorch' or 'TensorFlow/Keras' (reports written before the option existed are torch's)."""
    fw = meta.get("framework", "torch")
    return FRAMEWORK_NAMES.get(fw, fw)


def _threads_text(meta: dict) -> str:
    if meta.get("framework", "torch") == "tf":
        return f"TensorFlow inter-op and intra-op threads per worker: {meta['threads_per_worker']} each"
    return f"torch threads per worker: {meta['threads_per_worker']}"


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
    if plan.get("tuning"):  # measured validation: the candidate kept
        name = f"{name}→{plan['tuning']['kept_label']}"
    elif plan.get("schedule") and plan["schedule"] != name:
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


def _advised(r: dict) -> str:
    """'0.031 (+5%)': advise's predicted step and its error against the measured one."""
    if r.get("advise_predicted_s") is None:
        return "–"
    return f"{_num(r['advise_predicted_s'])} ({r['advise_predicted_s'] / r['step_time_s'] - 1:+.0%})"


def write_json(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def markdown_table(report: dict) -> str:
    """The results table (OUT.md): one row per (workers, link, compression), compute-only rows included."""
    meta = report["meta"]
    lines = [
        f"{_framework_text(meta)}: model {_model_text(meta)}, batch {meta['batch']} per worker, synthetic data; "
        f"{_threads_text(meta)}; median of {_steps_text(meta)} after "
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
    co = {(c["workers"], c["bandwidth"]): c for c in report["compute_only"]}
    advised = bool(meta.get("advise")) or any(r.get("advise_predicted_s") is not None
                                              for r in [*report["results"], *report["compute_only"]])
    adv = (lambda r: f" {_advised(r)} |") if advised else (lambda r: "")  # noqa: E731
    if advised:
        lines.append("advise predicted (error): `hvdcompress advise`'s prediction from its own measurement on "
                     "the launch's link (--advise), against the measured step.")
    lines += ["",
              "| workers | link | compression | schedule (groups) | steps | step time (s) | predicted (s) "
              + ("| advise predicted (s) (error) " if advised else "")
              + "| samples/s | x compute-only | x of limit "
              "| speed-up vs dense | payload/step/worker | wire tx/step/worker (measured) | wire / ideal ring "
              "| compress s/step |",
              "|" + "---|" * (16 if advised else 15)]
    rows = sorted(report["results"], key=lambda r: (r["workers"], _bw_key(r["bandwidth"])))
    last_group = None
    for r in rows:
        group = (r["workers"], r["bandwidth"])
        if group != last_group and group in co:
            c = co[group]
            lines.append(f"| {c['workers']} | {format_bandwidth(parse_bandwidth(c['bandwidth']))} | "
                         f"compute-only | – | {c['steps']} | {_num(c['step_time_s'])} | – |{adv(c)} "
                         f"{_num(c['samples_per_s'])} | 1 | – | – | 0 | {_bytes(c['wire_tx_bytes_per_step'])} | – | – |")
        last_group = group
        if r["status"] != "ok":
            lines.append(f"| {r['workers']} | {format_bandwidth(parse_bandwidth(r['bandwidth']))} | "
                         f"`{r['compression']}` | {_schedule(r)} | | {r['status']} | | | | | | | | | |"
                         + (" |" if advised else ""))
            continue
        lines.append(
            f"| {r['workers']} | {format_bandwidth(parse_bandwidth(r['bandwidth']))} | `{r['compression']}` | "
            f"{_schedule(r)} | {r['steps']} | {_num(r['step_time_s'])} | {_predicted(r)} |{adv(r)} "
            f"{_num(r['samples_per_s'])} | {_num(r['x_compute_only'])} | {_num(r.get('x_of_limit'))} | "
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
    fw = "torch" if meta.get("framework", "torch") == "torch" else "TF"
    title = (f"{_framework_text(meta)}: model {_model_text(meta).replace('`', '')}, batch {meta['batch']}/worker\n"
             f"{meta['threads_per_worker']} {fw} thread(s)/worker; {meta['mode']}")
    if _load_text(meta):
        title += f"\n{_load_text(meta).lower()}"
    if meta["latency_ms_injected"]:
        title += f"; {meta['latency_ms_injected']:g} ms latency INJECTED (not emulated)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- emulated GPU compute: schedules side by side, and the timeline of one step ---------------------
def _ms(v: Optional[float]) -> str:
    return "–" if v is None else f"{v * 1e3:.1f}"


def _config_rows(report: dict):
    """(workers, link, compression) -> its ok rows, in run order."""
    out: Dict[tuple, List[dict]] = {}
    for r in report["results"]:
        if r.get("status") == "ok":
            out.setdefault((r["workers"], r["bandwidth"], r["compression"]), []).append(r)
    return out


FIXED = ("layerwise", "single")


def pipelining_table(report: dict) -> str:
    """Per (workers, link, compression): every schedule's median step (quartiles), prediction and
    its error, and the ratio to the better of layerwise/single and to the best fixed schedule."""
    meta = report["meta"]
    lines = ["| workers | link | compression | schedule → plan (groups) | step time ms, median (q1–q3) | "
             "predicted ms | error | vs better of layerwise/single | vs best fixed |",
             "|---|---|---|---|---|---|---|---|---|"]
    co = {(c["workers"], c["bandwidth"]): c for c in report["compute_only"]}
    for (n, bw, spec), rows in sorted(_config_rows(report).items(), key=lambda kv: (kv[0][0], _bw_key(kv[0][1]))):
        link = format_bandwidth(parse_bandwidth(bw))
        if (n, bw) in co:
            c = co.pop((n, bw))
            lines.append(f"| {n} | {link} | compute-only | – | {_ms(c['step_time_s'])} "
                         f"({_ms(c.get('step_time_q1_s'))}–{_ms(c.get('step_time_q3_s'))}) | – | – | – | – |")
        by = {r.get("schedule"): r for r in rows}
        base = [by[s]["step_time_s"] for s in FIXED if s in by]
        fixed = [r["step_time_s"] for r in rows if not str(r.get("schedule", "")).startswith(("mgs", "mgwfbp", "auto"))]
        for r in rows:
            t = r["step_time_s"]
            err = f"{r['prediction_error']:+.0%}" if r.get("prediction_error") is not None else "–"
            vs = f"{t / min(base):.2f}x" if base else "–"
            vf = f"{t / min(fixed):.2f}x" if fixed else "–"
            lines.append(f"| {n} | {link} | `{spec}` | {_schedule(r)} | {_ms(t)} ({_ms(r.get('step_time_q1_s'))}–"
                         f"{_ms(r.get('step_time_q3_s'))}) | {_ms(r.get('predicted_step_time_s'))} | {err} | {vs} | {vf} |")
    note = meta.get("compute", {}).get("note")
    return ("" if not note else f"Compute: {note}\n\n") + "\n".join(lines) + "\n"


def measured_groups(trace: dict) -> List[dict]:
    """Per group of a traced step (seconds from the first gradient hook): ready (its last
    gradient's hook entered), compression (that hook's entry to exit: compression and launch),
    exchange (first round launched to last round completed, by the tracing transport)."""
    hooks = {n: (a, b) for n, a, b in trace["hooks"]}
    out = []
    for key, names in zip(trace["group_keys"], trace["groups"]):
        last = max((hooks[n] for n in names if n in hooks), key=lambda ab: ab[0], default=None)
        rounds = [v for k, v in trace["rounds"].items() if k.startswith(key + ".r")]
        launched = [a for a, _ in rounds if a is not None]
        done = [b for _, b in rounds if b is not None]
        out.append({"ready": last[0] if last else None, "compress_start": last[0] if last else None,
                    "compress_end": last[1] if last else None,
                    "comm_start": min(launched) if launched else None, "comm_end": max(done) if done else None})
    return out


def write_timeline_chart(rows: List[dict], path: str, title: str = "") -> None:
    """For each row (a phase with traces): the predicted timeline of its plan (top) and the traced
    step (below): backward (between groups), compression and exchange per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("traces_rank0") and r.get("predicted_timeline")]
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 2.9 * len(rows)), squeeze=False)
    colors = ["tab:blue", "tab:orange"]
    for ax, r in zip(axes[:, 0], rows):
        tl = r["predicted_timeline"]
        trace = min(r["traces_rank0"], key=lambda t: t["step_end"] - t["step_start"])  # the least disturbed
        meas = measured_groups(trace)
        pred = [{k: tl[k][g] for k in ("ready", "compress_start", "compress_end", "comm_start", "comm_end")}
                for g in range(len(tl["groups"]))]
        for y0, label, groups, end in ((3.0, "predicted", pred, tl.get("end")),
                                       (0.0, "measured", meas, trace["synchronize"][1])):
            prev = 0.0
            for g, e in enumerate(groups):
                c = colors[g % 2]
                if e["ready"] is not None:
                    ax.broken_barh([(prev, max(0.0, e["ready"] - prev))], (y0 + 2.0, 0.8), color="0.75",
                                   edgecolor="0.4", linewidth=0.3)
                if e["compress_start"] is not None and e["compress_end"] is not None:
                    ax.broken_barh([(e["compress_start"], max(1e-4, e["compress_end"] - e["compress_start"]))],
                                   (y0 + 1.0, 0.8), color=c)
                    prev = e["compress_end"]
                if e["comm_start"] is not None and e["comm_end"] is not None:
                    ax.broken_barh([(e["comm_start"], max(1e-4, e["comm_end"] - e["comm_start"]))],
                                   (y0, 0.8), color=c, alpha=0.7)
            if end is not None:
                ax.axvline(end, ymin=(y0 + 0.1) / 6.2, ymax=(y0 + 2.9) / 6.2, color="k", linestyle=":")
        ax.set_yticks([0.4, 1.4, 2.4, 3.4, 4.4, 5.4])
        ax.set_yticklabels(["measured: exchange", "measured: compress", "measured: backward",
                            "predicted: exchange", "predicted: compress", "predicted: backward"], fontsize=7)
        ax.set_ylim(-0.2, 6.0)
        pl = r.get("plan") or {}
        ax.set_title(f"{r['workers']} workers, {format_bandwidth(parse_bandwidth(r['bandwidth']))}, "
                     f"{r['compression']} @ {r.get('schedule')} → {pl.get('schedule')} ({pl.get('groups')} groups): "
                     f"predicted {_ms(r.get('predicted_step_time_s'))} ms, measured median "
                     f"{_ms(r['step_time_s'])} ms per step", fontsize=8)
        ax.set_xlabel("seconds from the first gradient hook (rank 0; dotted: backward + exchange + scatter done)",
                      fontsize=8)
        ax.grid(True, axis="x", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pipelining_summary(report: dict) -> str:
    """One row per (workers, link, compression): compute-only, the better of layerwise/single, the
    best fixed schedule, mgs (and its plan), mgs:greedy, mgs's gain and its prediction error."""
    co = {(c["workers"], c["bandwidth"]): c["step_time_s"] for c in report["compute_only"]}
    lines = ["| workers | link | compression | compute-only ms | better of layerwise/single ms | best fixed ms "
             "| mgs ms (groups) | mgs:greedy ms (groups) | mgs faster than better of layerwise/single by | mgs vs best fixed "
             "| mgs predicted ms (error) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (n, bw, spec), rows in sorted(_config_rows(report).items(), key=lambda kv: (kv[0][0], _bw_key(kv[0][1]))):
        by = {r.get("schedule"): r for r in rows}
        base = min((by[s] for s in FIXED if s in by), key=lambda r: r["step_time_s"], default=None)
        fixed = min((r for r in rows if not str(r.get("schedule", "")).startswith(("mgs", "mgwfbp", "auto"))),
                    key=lambda r: r["step_time_s"], default=None)
        m, g = by.get("mgs") or by.get("mgwfbp") or by.get("auto"), by.get("mgs:greedy") or by.get("mgwfbp:greedy")
        if m is None or base is None:
            continue
        groups = lambda r: (r.get("plan") or {}).get("groups")  # noqa: E731
        gain = 1.0 - m["step_time_s"] / base["step_time_s"]
        vs_fixed = m["step_time_s"] / fixed["step_time_s"] - 1.0
        err = m.get("prediction_error")
        lines.append(
            f"| {n} | {format_bandwidth(parse_bandwidth(bw))} | `{spec}` | {_ms(co.get((n, bw)))} | "
            f"{_ms(base['step_time_s'])} ({base['schedule']}) | {_ms(fixed['step_time_s'])} ({fixed['schedule']}) | "
            f"{_ms(m['step_time_s'])} ({groups(m)}) | "
            + (f"{_ms(g['step_time_s'])} ({groups(g)})" if g else "–") + " | "
            f"{gain:+.0%} | {vs_fixed:+.0%} | {_ms(m.get('predicted_step_time_s'))} "
            + (f"({err:+.0%})" if err is not None else "") + " |")
    return "\n".join(lines) + "\n"


def _is_model_schedule(schedule) -> bool:
    return str(schedule or "").startswith(("mgs", "mgwfbp", "auto"))


def tuning_summary(report: dict) -> str:
    """One row per (workers, link, compression) with a '+tune' schedule: the better of
    layerwise/single, the best fixed schedule, the model's plan as made, the measured validation's
    kept plan (label, groups) and its candidates' medians, the tuned plan against both, and its
    prediction's error; empty without '+tune' rows."""
    lines = ["| workers | link | compression | better of layerwise/single ms | best fixed ms | model's plan ms (groups) "
             "| tuned: kept (groups) | tuned ms | tuned faster than better of layerwise/single by | tuned vs best fixed "
             "| tuned predicted ms (error) | exchange skew | candidates' medians during validation, ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows_out = 0
    for (n, bw, spec), rows in sorted(_config_rows(report).items(), key=lambda kv: (kv[0][0], _bw_key(kv[0][1]))):
        by = {r.get("schedule"): r for r in rows}
        tuned = [r for r in rows if str(r.get("schedule", "")).endswith("+tune")]
        base = min((by[s] for s in FIXED if s in by), key=lambda r: r["step_time_s"], default=None)
        fixed = min((r for r in rows if not _is_model_schedule(r.get("schedule"))),
                    key=lambda r: r["step_time_s"], default=None)
        for t in tuned:
            plan = t.get("plan") or {}
            info = plan.get("tuning") or {}
            model = by.get(t["schedule"][:-len("+tune")])
            err = t.get("prediction_error")
            meds = "; ".join(f"{c['label']} ({c['groups']}) {_ms(m)}" for c, m in
                             zip(info.get("candidates", []), info.get("medians_seconds", [])))
            skew = (plan.get("calibration") or {}).get("skew")
            lines.append(
                f"| {n} | {format_bandwidth(parse_bandwidth(bw))} | `{spec}` | "
                + (f"{_ms(base['step_time_s'])} ({base['schedule']})" if base else "–") + " | "
                + (f"{_ms(fixed['step_time_s'])} ({fixed['schedule']})" if fixed else "–") + " | "
                + (f"{_ms(model['step_time_s'])} ({(model.get('plan') or {}).get('groups')})" if model else "–") + " | "
                f"{info.get('kept_label', '–')} ({plan.get('groups')}) | {_ms(t['step_time_s'])} | "
                + (f"{1.0 - t['step_time_s'] / base['step_time_s']:+.0%}" if base else "–") + " | "
                + (f"{t['step_time_s'] / fixed['step_time_s'] - 1.0:+.0%}" if fixed else "–") + " | "
                f"{_ms(t.get('predicted_step_time_s'))} " + (f"({err:+.0%})" if err is not None else "") + " | "
                + (f"{skew:.2f}" if skew is not None else "–") + f" | {meds or '–'} |")
            rows_out += 1
    return "\n".join(lines) + "\n" if rows_out else ""
