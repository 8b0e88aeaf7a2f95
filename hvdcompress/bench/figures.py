"""From the workers' raw timings and counters to the figures the benchmark reports.

Definitions (also written into the JSON's ``definitions``):

- step time: for each timed step, the slowest rank's time (ranks are coupled by the exchange, so
  this is the step of the job); then the median over the timed steps. The phases of one launch
  (compute-only and every spec) are timed interleaved, one step of each per round;
- samples/s: workers x batch per worker / step time;
- payload bytes per step: what each rank handed to Horovod per step by the optimizer's own
  accounting (``opt.stats``), averaged over ranks; dense bytes: the fp32 gradient size;
- wire bytes per step: the worker interface's tx/rx byte counters over the timed steps, divided by
  the steps and averaged over ranks -- Ethernet/IP/TCP headers and Horovod's own coordination
  traffic included (None in loopback mode, where all ranks share ``lo``);
- expected wire tx: the payload times what an ideal ring moves per rank -- 2(N-1)/N for an
  allreduce, (N-1) for an allgather of equal shares -- so wire / expected near 1 means the
  payload accounting and the link agree;
- compute-only: the same model, batch and plain SGD step on every rank at once, no exchange,
  timed in the same launch (same link, same load) as the specs it is compared with.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from hvdcompress.spec import GATHERED, parse_spec

from .netns import parse_bandwidth

DEFINITIONS = {
    "step_time_s": "median over the timed steps of the slowest rank's step time (seconds)",
    "samples_per_s": "workers * batch per worker / step_time_s",
    "bytes_per_step": "payload bytes each rank handed to Horovod per step (opt.stats), mean over ranks",
    "dense_bytes_per_step": "fp32 gradient bytes per step (what dense allreduce hands to Horovod)",
    "compute_seconds_per_step": "compression + decompression seconds per step (opt.stats), mean over ranks; "
                                "null with --framework tf (the exchange runs inside the traced step: not timed "
                                "apart)",
    "wire_tx_bytes_per_step": "bytes sent on the worker's veth per step (interface counters, headers and "
                              "Horovod coordination included), mean over ranks; null on loopback",
    "wire_rx_bytes_per_step": "bytes received on the worker's veth per step, as above",
    "expected_wire_tx_bytes_per_step": "payload * 2(N-1)/N (allreduce) or * (N-1) (allgather): an ideal ring",
    "x_compute_only": "step_time_s / the compute-only step time of the same launch (workers, link)",
    "memory_pass_s": "one pass over a gradient-sized fp32 buffer in a worker (r.add_(g), TF: r.assign_add(g): "
                     "read g, read and write r), median of 7, slowest rank; measured at the start of each launch",
    "wire_time_s": "max(wire tx, wire rx) bytes per step * 8 / the link rate (0 on an unlimited link; null "
                   "on loopback, where no wire bytes are counted)",
    "limit_s": "compute-only step time + memory_pass_s + wire_time_s: what a step could take if compression "
               "cost one pass over the gradient and the exchange only its measured bytes' transfer time",
    "x_of_limit": "step_time_s / limit_s",
    "speedup_vs_dense": "step time of 'none' (dense allreduce) / step_time_s, same link and worker count "
                        "(and same schedule when 'none' was measured with it)",
    "schedule": "the optimizer's merge schedule (DistributedOptimizer(schedule=...)); plan.schedule is what "
                "'auto' resolved to",
    "plan": "groups, tensors per group and predicted step time of the plan the phase ran with",
    "predicted_step_time_s": "the plan's predicted step time: forward + modelled backward/compression/"
                             "exchange timeline + update, from the cost model fitted on this link in this "
                             "launch and the backward times profiled by the optimizer",
    "prediction_error": "predicted_step_time_s / step_time_s - 1",
    "back_to_back_step_time_s": "the step time the optimizer itself measured (opt.timings, end of one step to "
                                "the end of the next) over the warm-up steps run back to back with the final "
                                "plan: median per rank, slowest rank",
    "back_to_back_prediction_error": "predicted_step_time_s / back_to_back_step_time_s - 1",
    "after_forward_s": "median over timed steps of the slowest rank's (step time - its zero_grad + forward "
                       "time): backward, compression, exchange, update -- the part a schedule changes",
    "predicted_after_forward_s": "the plan's prediction of that part (modelled timeline end + profiled update)",
    "after_forward_prediction_error": "predicted_after_forward_s / after_forward_s - 1",
    "timings": "medians over the timed steps of rank 0's opt.timings (seconds): backward (first to last "
               "gradient hook), hook (compression and launches inside backward), synchronize (waiting "
               "for the exchanges, decompression, scatter), update",
    "advise_predicted_s": "with --advise: `hvdcompress advise`'s predicted step, from its own measurement on "
                          "this launch's link before the timed phases (the model's workload timed with every rank "
                          "running, compression timed on the CPU, the link's fitted cost model): the spec under "
                          "the phase's schedule, the codec_choice='auto' prediction for a '+choice' entry, the "
                          "workload's compute time for compute-only; null without --advise",
    "advise_prediction_error": "advise_predicted_s / step_time_s - 1",
    "latency_ms_injected": "delay added to the completion of every exchange round in the worker process "
                           "(not network-emulated); 0 when not used",
}


def step_time(rank_phases: List[dict]) -> Dict[str, object]:
    """Median / min / max over steps of the slowest rank's step time, and the per-step series."""
    per_step = [max(ts) for ts in zip(*(p["step_times_s"] for p in rank_phases))]
    q = statistics.quantiles(per_step, n=4) if len(per_step) >= 2 else [per_step[0]] * 3
    return {"step_time_s": statistics.median(per_step), "step_time_min_s": min(per_step),
            "step_time_max_s": max(per_step), "step_time_q1_s": q[0], "step_time_q3_s": q[2],
            "step_times_s": per_step}


def _mean(values: List[float]) -> float:
    return sum(values) / len(values)


def _mean_or_none(values: List[Optional[float]]) -> Optional[float]:
    """The mean, or None when a rank did not measure it (the TF worker: compression seconds)."""
    return None if not values or None in values else _mean(values)


def wire_factor(spec: str, workers: int) -> float:
    """Bytes an ideal ring moves per rank per payload byte, for the spec's exchange."""
    if workers < 2:
        return 0.0
    if parse_spec(spec).exchange == GATHERED:
        return float(workers - 1)
    return 2.0 * (workers - 1) / workers


def summarize(rank_results: List[dict], batch: int) -> Dict[str, object]:
    """Figures of one launch: ``{"compute_only": {...} or None, "phases": [{...} per spec]}``."""
    workers = len(rank_results)
    out: Dict[str, object] = {"compute_only": None, "phases": []}
    passes = [r["memory_pass_s"] for r in rank_results if r.get("memory_pass_s") is not None]
    memory_pass = max(passes) if len(passes) == workers else None
    for i, first in enumerate(rank_results[0]["phases"]):
        phases = [r["phases"][i] for r in rank_results]
        steps = len(first["step_times_s"])
        fig: Dict[str, object] = {"compression": first["compression"], "steps": steps,
                                  "memory_pass_s": memory_pass}
        if "schedule" in first:
            fig["schedule"] = first["schedule"]
        fig.update(step_time(phases))
        advised = first.get("advise_predicted_s")  # rank 0's
        fig["advise_predicted_s"] = advised
        fig["advise_prediction_error"] = advised / fig["step_time_s"] - 1.0 if advised else None
        fig["samples_per_s"] = workers * batch / fig["step_time_s"]
        has_wire = "iface_tx_bytes" in first
        for key in ("tx", "rx"):
            fig[f"wire_{key}_bytes_per_step"] = (
                _mean([p[f"iface_{key}_bytes"] for p in phases]) / steps if has_wire else None)
        if "bytes_per_step" not in first:  # compute-only
            fig["wire_tx_bytes_per_s_idle"] = (
                _mean([p["iface_tx_bytes"] / sum(p["step_times_s"]) for p in phases]) if has_wire else None)
            out["compute_only"] = fig
            continue
        payload = _mean([p["bytes_per_step"] for p in phases])
        expected = payload * wire_factor(first["compression"], workers)
        fig.update({
            "bytes_per_step": payload,
            "dense_bytes_per_step": first["dense_bytes_per_step"],
            "compression_ratio": first["dense_bytes_per_step"] / payload if payload else None,
            "compute_seconds_per_step": _mean_or_none([p.get("compute_seconds_per_step") for p in phases]),
            "expected_wire_tx_bytes_per_step": expected,
            "wire_over_expected": (fig["wire_tx_bytes_per_step"] / expected
                                   if has_wire and expected else None),
        })
        plan = first.get("plan")
        predicted = plan.get("predicted_seconds") if plan else None
        fig.update({"plan": plan, "timings": first.get("timings"), "predicted_step_time_s": predicted,
                    "prediction_error": predicted / fig["step_time_s"] - 1.0 if predicted else None})
        b2b = [statistics.median(p["back_to_back_step_times_s"]) for p in phases
               if p.get("back_to_back_step_times_s")]
        complete = bool(b2b) and len(b2b) == len(phases)
        fig["back_to_back_step_time_s"] = max(b2b) if complete else None
        fig["back_to_back_prediction_error"] = predicted / max(b2b) - 1.0 if complete and predicted else None
        after = plan.get("predicted_after_forward_seconds") if plan else None
        if after is not None and "forward_times_s" in first:
            rest = statistics.median(max(p["step_times_s"][i] - p["forward_times_s"][i] for p in phases)
                                     for i in range(steps))
            fig.update({"after_forward_s": rest, "predicted_after_forward_s": after,
                        "after_forward_prediction_error": after / rest - 1.0})
        if first.get("traces"):  # rank 0's traced steps and the plan's predicted timeline
            fig["traces_rank0"] = first["traces"]
            fig["predicted_timeline"] = first.get("predicted_timeline")
        out["phases"].append(fig)
    return out


def add_relative(results: List[dict], compute_only: List[dict]) -> None:
    """Fill ``x_compute_only`` and ``speedup_vs_dense`` in place, from the entries measured in the
    same launch (same worker count and link)."""
    dense: Dict[tuple, float] = {}
    for r in results:  # dense with the same schedule, else the fastest dense of the launch
        if r.get("status") == "ok" and r["compression"] == "none":
            dense[(r["workers"], r["bandwidth"], r.get("schedule"))] = r["step_time_s"]
            key = (r["workers"], r["bandwidth"])
            dense[key] = min(dense.get(key, r["step_time_s"]), r["step_time_s"])
    limits = {(c["workers"], c["bandwidth"]): c for c in compute_only}
    for r in results:
        if r.get("status") != "ok":
            continue
        co: Optional[dict] = limits.get((r["workers"], r["bandwidth"]))
        r["x_compute_only"] = r["step_time_s"] / co["step_time_s"] if co else None
        r["wire_time_s"] = wire_time(r)
        parts = [co["step_time_s"] if co else None, r.get("memory_pass_s"), r["wire_time_s"]]
        r["limit_s"] = sum(parts) if None not in parts else None
        r["x_of_limit"] = r["step_time_s"] / r["limit_s"] if r["limit_s"] else None
        d = dense.get((r["workers"], r["bandwidth"], r.get("schedule")), dense.get((r["workers"], r["bandwidth"])))
        r["speedup_vs_dense"] = d / r["step_time_s"] if d else None


def wire_time(r: dict) -> Optional[float]:
    """Seconds the row's measured wire bytes need on its link: the larger of tx and rx per step
    (tbf limits each direction) over the rate; 0 when unlimited, None without counters."""
    tx, rx = r.get("wire_tx_bytes_per_step"), r.get("wire_rx_bytes_per_step")
    if tx is None:
        return None
    bps = parse_bandwidth(r["bandwidth"])
    return 0.0 if bps is None else max(tx, rx or 0.0) * 8.0 / bps
