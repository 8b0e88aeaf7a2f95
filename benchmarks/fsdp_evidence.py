"""FSDP2 with compressed gradients against plain FSDP2: the evidence of issue 42 (loss, bytes, memory, time).

The char transformer of docs/across-the-world.md (``hvdcompress.bench.example_models``), every block
and the model sharded with ``fully_shard``, AdamW, each rank on its own random windows of the
standard library's source, trained the same number of steps from the same initial weights with
plain FSDP2 and with ``hvdcompress.fsdp.compress`` for each configuration. Per configuration:

* held-out loss (nats per character, 256 windows of the test text) after the steps, and its
  distance to plain FSDP2's in percent (issue 42's targets: int8 within 0.5%, 4-bit within 2%);
* payload bytes each rank sent per step (``fsdp.stats``; plain FSDP2: what a ring reduce-scatter
  sends, (W-1)/W of the padded flat gradient); with ``--topology`` (plain: native HSDP on the 2-D
  mesh; ours: FSDP inside a node, the spec across), the bytes across nodes (plain: a ring
  all-reduce of the shard, 2(N-1)/N of it) and inside a node apart;
* on an emulated link, the bytes the busiest interface carried per measured step in its busier
  direction (``/proc/net/dev``: headers, the all-gathers and this script's timing collectives
  included; with ``--topology`` an interface is a node's link, shared by its ranks);
* step time: the slowest rank's, median over the steps after ``--warmup``; and the CPU seconds a
  step costs the busiest rank (``time.process_time``, all its threads: compute, encoding and the
  transport's own work), which a loaded machine stretches far less than the wall clock;
* peak memory per rank: on CUDA ``torch.cuda.max_memory_allocated`` (tensors only); on CPU the
  process's resident-set high-water mark (``getrusage`` ``ru_maxrss``: the whole process, Python
  and torch included, so it shows differences, not the tensors alone); and the state kept between
  steps, in bytes per model parameter on the fullest rank: plain FSDP2's own (the sharded
  parameters, their gradients and AdamW's state, exact bytes of the tensors) and the compression
  state (exact bytes of the sessions' tensors, as ``state_dict`` saves them);
* whether every rank's gathered parameters are identical at the end.

``--seeds 0,1,2`` runs every configuration once per seed (the initial weights, each rank's batches
and the spec's stochastic rounding); the tables give the loss's mean and spread over the seeds and
its distance to plain FSDP2's taken seed by seed. ``--preset wire`` is a wider char LM on few
tokens per step, sized so that the wire dominates the step on a slow link. ``--merge`` summarizes
the JSON files of several runs into one table.

The workers run on the machine's loopback (``--link loopback``) or, with ``--link 1gbit,10gbit``,
each in a network namespace whose link is limited by ``tbf`` both ways
(``hvdcompress.bench.netns.EmulatedNetwork``, the benches' emulated network; no latency added;
needs root); with ``--topology`` one namespace per node, so the ranks of a node talk over its
unlimited loopback and only traffic between nodes crosses the limited links. Figures from those
runs are labelled "emulated". A smoke run (few steps) proves only
that it runs; the measurement needs a quiet machine. Commands: docs/fsdp.md.

    python benchmarks/fsdp_evidence.py --workers 4 --steps 300 --link loopback,1gbit,10gbit \\
        --json fsdp_evidence.json --markdown fsdp_evidence.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional


# name -> (spec or "plain", residual mode): plain FSDP2 and every kind of supported spec
CONFIGS = {
    "plain": ("plain", None),
    "int8": ("qsgd:levels=127,bucket=128", "none"),
    "4bit": ("qsgd:levels=7,bucket=128", "none"),
    "4bit-ef8": ("qsgd:levels=7,bucket=128", "int8"),
    "4bit-ef32": ("qsgd:levels=7,bucket=128", "full"),
    "fp16": ("fp16", None),
    "bf16": ("bf16", None),
    "topk-full": ("topk:ratio=0.05", "full"),
    "topk-int8": ("topk:ratio=0.05", "int8"),
    "topk-none": ("topk:ratio=0.05", "none"),
}
TARGETS = {"int8": 0.5, "4bit": 2.0, "4bit-ef8": 2.0, "4bit-ef32": 2.0}  # loss within this % of plain FSDP2's
# the model and batch: "small", the char LM of the first runs (compute-bound on a small machine);
# "wire", a wider char LM on few tokens per step, sized so that the bytes dominate the step on a
# slow link (docs/fsdp.md gives the arithmetic)
PRESETS = {
    "small": {"width": 128, "layers": 2, "context": 64, "batch_size": 16},
    "wire": {"width": 512, "layers": 2, "context": 32, "batch_size": 2},
}


# -- one rank ------------------------------------------------------------------------------------------
def _link_bytes(iface: str):
    """(received, sent) bytes so far on ``iface`` in this network namespace, or None."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface and rest:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    return None


def _peak_memory(device) -> Dict[str, object]:
    import resource

    import torch
    if device.type == "cuda":
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)), "peak_kind": "cuda max_memory_allocated"}
    return {"peak_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
            "peak_kind": "process RSS high-water mark (ru_maxrss)"}


def seeded(spec, seed: int):
    """``spec`` with its stochastic rounding or sampling seeded by ``seed`` (specs without a
    ``seed`` parameter, and seed 0, the default, as given)."""
    from hvdcompress.registry import names_with_param
    from hvdcompress.spec import parse_spec
    if spec is None or spec == "plain" or not seed or parse_spec(spec).name not in names_with_param("seed"):
        return spec
    return str(parse_spec(spec)(seed=seed))


def _local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _fsdp_state_bytes(model, opt) -> int:
    """What plain FSDP2 keeps on this rank between steps: the sharded parameters, their gradients
    and the optimizer's state (AdamW: two moments and a step count per tensor)."""
    params = list(model.parameters())
    return (_local_bytes(params) + _local_bytes(p.grad for p in params if p.grad is not None)
            + _local_bytes(t for st in opt.state.values() for t in st.values() if hasattr(t, "element_size")))


def _state_bytes(fsdp) -> int:
    if fsdp is None:
        return 0
    sessions = [fsdp.session] + ([fsdp.inside_session] if fsdp.inside_session is not None else [])
    return sum(t.numel() * t.element_size() for s in sessions for st in s.param_state().values()
               for t in st.values())


def run_config(cfg: dict) -> dict:
    """One configuration on this rank (torch.distributed initialized); rank 0's figures, with
    every rank's step times, bytes and memory gathered."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hvdcompress.fsdp
    from hvdcompress.bench.example_models import CharTransformer, char_batches, char_eval_loss
    from hvdcompress.datasets import load_stdlib_text

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(cfg["device"], int(os.environ.get("LOCAL_RANK", 0))) if cfg["device"] == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    spec, residual = CONFIGS[cfg["config"]]
    topology = cfg.get("topology")
    if topology:  # plain: native HSDP on the 2-D mesh; ours: FSDP inside a node, the hook across
        hybrid = hvdcompress.fsdp.hybrid_mesh(topology, device.type)
        mesh, shard_world = (hybrid if spec == "plain" else hybrid["shard"]), hybrid["shard"].size()
    else:
        mesh = init_device_mesh(device.type, (world,))
        shard_world = world
    torch.manual_seed(cfg["seed"])  # the initial weights; the batches and the spec's rounding below
    text = load_stdlib_text()
    model = CharTransformer(width=cfg["width"], layers=cfg["layers"], context=cfg["context"]).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp = None
    if spec != "plain":
        kw = dict(topology=topology, inside=seeded(cfg.get("inside"), cfg["seed"])) if topology else {}
        fsdp = hvdcompress.fsdp.compress(model, seeded(spec, cfg["seed"]), residual=residual, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    # every rank and seed its own stream (seeds below 1000); seed 0 the streams of the first runs
    batches = char_batches(text.train, cfg["batch_size"], cfg["context"], seed=1000 * (rank + 1) + cfg["seed"])
    times, cpu, counted, losses = [], [], None, []
    iface = cfg.get("iface")
    for step in range(cfg["steps"]):
        x, y = (t.to(device) for t in next(batches))
        if step == cfg["warmup"] and iface:
            counted = _link_bytes(iface)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        losses.append(float(loss))
    link = None
    if counted is not None:
        now = _link_bytes(iface)
        measured = cfg["steps"] - cfg["warmup"]
        link = max(now[0] - counted[0], now[1] - counted[1]) / measured
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    rows = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(rows, full)
    numel = sum(p.numel() for p in model.parameters())
    shard_bytes = sum(-(-p.shape[0] // shard_world) * (p[0].numel() if p.dim() > 1 else 1) * 4
                      for p in model.parameters())
    plain_bytes = shard_bytes * (shard_world - 1)  # what a ring reduce-scatter sends per rank and step
    if topology:  # plain: native HSDP's dense ring all-reduce of the shard across the nodes
        nodes = world // shard_world
        plain_bytes, plain_inside = shard_bytes * 2 * (nodes - 1) // nodes, plain_bytes
    if fsdp is None:
        sent, inside_sent = plain_bytes, (plain_inside if topology else None)
    else:
        sent = fsdp.stats.as_dict()["bytes_per_step"]
        inside_sent = (fsdp.inside_stats.as_dict()["bytes_per_step"] if fsdp.inside_stats is not None
                       else plain_inside if topology else None)
    mine = dict(_peak_memory(device), step_times=times, cpu_s=statistics.median(cpu) if cpu else None, link_bytes_per_step=link, state_bytes=_state_bytes(fsdp),
                fsdp_state_bytes=_fsdp_state_bytes(model, opt))
    every = [None] * world
    dist.all_gather_object(every, mine)
    slowest = [max(ts) for ts in zip(*[e["step_times"] for e in every])] if times else []
    return {"config": cfg["config"], "spec": spec, "residual": residual, "topology": topology,
            "inside": cfg.get("inside") if fsdp is not None else None, "seed": cfg["seed"], "workers": world, "parameters": numel,
            "steps": cfg["steps"], "preset": cfg.get("preset"),
            "held_out_loss": char_eval_loss(model, text.test, cfg["context"], windows=256),
            "final_train_loss": statistics.fmean(losses[-10:]),
            "bytes_per_step": sent, "inside_bytes_per_step": inside_sent, "plain_bytes_per_step": plain_bytes,
            "median_step_s": statistics.median(slowest) if slowest else None,
            "cpu_s_per_step": max((e["cpu_s"] or 0) for e in every) if times else None,
            "link_bytes_per_step": max((e["link_bytes_per_step"] or 0) for e in every) if iface else None,
            "peak_bytes_per_rank": [e["peak_bytes"] for e in every], "peak_kind": every[0]["peak_kind"],
            "state_bytes_per_rank": [e["state_bytes"] for e in every],
            "fsdp_state_bytes_per_rank": [e["fsdp_state_bytes"] for e in every],
            "identical": all(bool(torch.equal(rows[0], r)) for r in rows)}


def worker_main(cfg_json: str, out_path: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    warnings.simplefilter("ignore")
    torch.set_num_threads(int(os.environ.get("HVC_THREADS", "1")))
    cfg = json.loads(cfg_json)
    dist.init_process_group("nccl" if cfg["device"] == "cuda" else "gloo")
    try:
        result = run_config(cfg)
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


# -- the launcher ----------------------------------------------------------------------------------------
def launch(cfg: dict, workers: int, link: str) -> dict:
    """One configuration on ``workers`` processes: on loopback, or in namespaces whose links ``tbf``
    limits to ``link`` (an emulated network): one namespace per worker, or with a topology one per
    node, its ranks talking over the namespace's own (unlimited) loopback and to other nodes over
    the node's limited link, as ranks inside a node and across nodes do
    (``hvdcompress.bench.dist_launch.run_ranks``)."""
    from hvdcompress.bench.dist_launch import run_ranks
    from hvdcompress.topology import parse_topology
    local = parse_topology(cfg["topology"], workers).local_size if cfg.get("topology") and link != "loopback" else 1
    with tempfile.TemporaryDirectory(prefix="hvc-fsdp-evidence-") as tmp:
        out = os.path.join(tmp, "result.json")

        def command(iface):
            mine = dict(cfg, iface=iface) if iface else cfg  # the workers count the bytes their link carries
            return [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(mine), out]
        try:
            run_ranks(command, workers, link, local, "fsdp")
        except RuntimeError as e:
            raise RuntimeError(f"{cfg['config']}: {e}") from None
        with open(out) as f:
            return json.load(f)


def _fmt(v, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def summarize(rows: List[dict]) -> List[dict]:
    """One summary per (link, layout, inside, config), in the rows' order: the figures over the
    seeds, and the loss's distance to plain FSDP2's taken seed by seed (same initial weights and
    batches), its mean and its worst seed."""
    def key(r):
        return r["link"], r["topology"] or "flat", r.get("inside") or ""
    out = []
    for k in dict.fromkeys(key(r) + (r["config"],) for r in rows):
        runs = [r for r in rows if key(r) + (r["config"],) == k]
        plain = {r["seed"]: r for r in rows if key(r)[:2] == k[:2] and r["config"] == "plain"}  # any inside
        losses = [r["held_out_loss"] for r in runs]
        paired = [100.0 * (r["held_out_loss"] - plain[r["seed"]]["held_out_loss"]) / plain[r["seed"]]["held_out_loss"]
                  for r in runs if r["seed"] in plain]
        medians = [r["median_step_s"] for r in runs if r["median_step_s"]]
        cpus = [r["cpu_s_per_step"] for r in runs if r.get("cpu_s_per_step")]
        links = [r["link_bytes_per_step"] for r in runs if r["link_bytes_per_step"] is not None]
        first = runs[0]
        out.append({
            "link": k[0], "layout": k[1], "inside": k[2] or None, "config": k[3], "spec": first["spec"],
            "residual": first["residual"], "workers": first["workers"], "parameters": first["parameters"],
            "steps": first["steps"], "seeds": [r["seed"] for r in runs], "peak_kind": first["peak_kind"],
            "loads_at_start": [r["load_at_start"] for r in runs if r.get("load_at_start") is not None],
            "loss_mean": statistics.fmean(losses), "loss_sd": statistics.stdev(losses) if len(losses) > 1 else None,
            "loss_vs_plain_pct": statistics.fmean(paired) if paired else None,
            "loss_vs_plain_worst_pct": max(paired) if paired else None,
            "target_pct": TARGETS.get(k[3]),
            "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in runs),
            "plain_bytes_per_step": first["plain_bytes_per_step"],
            "inside_bytes_per_step": first["inside_bytes_per_step"],
            "link_bytes_per_step": statistics.fmean(links) if links else None,
            "median_step_s": statistics.median(medians) if medians else None,
            "cpu_s_per_step": statistics.median(cpus) if cpus else None,
            "peak_bytes": max(max(r["peak_bytes_per_rank"]) for r in runs),
            "state_bytes_per_param": max(max(r["state_bytes_per_rank"]) for r in runs) / first["parameters"],
            "fsdp_state_bytes_per_param": (max(max(r["fsdp_state_bytes_per_rank"]) for r in runs) / first["parameters"]
                                           if all("fsdp_state_bytes_per_rank" in r for r in runs) else None),
            "identical": all(r["identical"] for r in runs)})
    return out


def markdown(rows: List[dict], load: Optional[float] = None) -> str:
    """One table per (link, layout): every configuration's figures over the seeds next to plain
    FSDP2's (``summarize``); ``load``, the machine's load average when the run started."""
    summaries = summarize(rows)
    out = []
    for key in dict.fromkeys((s["link"], s["layout"], s["inside"]) for s in summaries):
        group = [s for s in summaries if (s["link"], s["layout"], s["inside"]) == key]
        plain = next((s for s in group if s["config"] == "plain"), None)
        link, layout, inside = key
        seeds = sorted({x for s in group for x in s["seeds"]})
        loads = [x for s in group for x in s["loads_at_start"]]
        loaded = (f"; load average {load:.2f} at the start" if load is not None else
                  f"; load average {min(loads):.1f} to {max(loads):.1f} at the runs' starts" if loads else "")
        out.append(f"\n**{group[0]['workers']} workers, {link}, layout {layout}"
                   f"{', inside ' + inside if inside else ''}** ({group[0]['parameters']:,} parameters, "
                   f"{group[0]['steps']} steps, seeds {','.join(map(str, seeds))}{loaded}; "
                   f"peak memory: {group[0]['peak_kind']}; state: bytes per model parameter on the fullest rank)\n")
        out.append("| config | spec | residual | bytes/step | vs plain | inside bytes/step | link bytes/step | "
                   "held-out loss (mean ± sd) | vs plain (mean; worst seed) | target | step ms | CPU ms/step | peak MiB | "
                   "FSDP2 state B/param | compression state B/param | identical |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for s in group:
            ratio = plain["plain_bytes_per_step"] / s["bytes_per_step"] if plain and s["bytes_per_step"] else None
            target, dloss = s["target_pct"], s["loss_vs_plain_pct"]
            verdict = "-" if target is None or dloss is None else \
                f"{'met' if dloss <= target else 'missed'} (<= {target}%)"
            versus = "1x" if s["config"] == "plain" else f"{ratio:.2f}x fewer" if ratio else "-"
            spread = f" ± {s['loss_sd']:.4f}" if s["loss_sd"] is not None else ""
            out.append("| " + " | ".join([
                s["config"], f"`{s['spec']}`", _fmt(s["residual"]), _fmt(s["bytes_per_step"], ",.0f"), versus,
                _fmt(s["inside_bytes_per_step"], ",.0f"), _fmt(s["link_bytes_per_step"], ",.0f"),
                f"{s['loss_mean']:.4f}{spread}",
                "-" if s["config"] == "plain" or dloss is None else
                f"{dloss:+.2f}%; {s['loss_vs_plain_worst_pct']:+.2f}%", verdict,
                f"{1e3 * s['median_step_s']:.1f}" if s["median_step_s"] else "-",
                f"{1e3 * s['cpu_s_per_step']:.1f}" if s["cpu_s_per_step"] else "-",
                f"{s['peak_bytes'] / 2**20:.0f}", _fmt(s["fsdp_state_bytes_per_param"], ".2f"),
                f"{s['state_bytes_per_param']:.2f}", str(s["identical"])]) + " |")
    return "\n".join(out) + "\n"


def write(json_path: Optional[str], markdown_path: Optional[str], record: dict, table: str) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(record, f, indent=1)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(table)


def _ints(text: str, name: str, low: int, high: int) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not low <= v <= high for v in values):
        raise ValueError(f"{name}: comma-separated integers in [{low}, {high}]; got {text!r}")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--link", default="loopback", help="comma-separated: loopback, 1gbit, 10gbit, ... (emulated: root)")
    p.add_argument("--topology", default=None, help="e.g. 2x2: the two-level layout (configs are the hop across)")
    p.add_argument("--inside", default=None, help="with --topology: the spec inside a node (default FSDP's, dense)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=5, help="steps not timed")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS),
                   help="the model and batch: " + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()))
    p.add_argument("--width", type=int, default=None, help="(default: the preset's)")
    p.add_argument("--layers", type=int, default=None, help="(default: the preset's)")
    p.add_argument("--context", type=int, default=None, help="(default: the preset's)")
    p.add_argument("--batch-size", type=int, default=None, help="windows per rank and step (default: the preset's)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seeds", default="0", help="comma-separated seeds in [0, 999] (initial weights, batches, "
                   "the spec's rounding); each configuration runs once per seed")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: NCCL, one GPU per rank")
    p.add_argument("--merge", default=None, help="comma-separated JSON files of earlier runs: their rows "
                   "summarized together into --json / --markdown (nothing is run)")
    p.add_argument("--json", help="write every row here (rewritten after each run)")
    p.add_argument("--markdown", help="write the tables here (rewritten after each run)")
    args = p.parse_args(argv)
    if args.merge:
        parts = []
        for path in [f.strip() for f in args.merge.split(",") if f.strip()]:
            with open(path) as f:
                parts.append(json.load(f))
        rows = [r for part in parts for r in part["rows"]]
        write(args.json, args.markdown, {"merged": [part["argv"] for part in parts], "rows": rows,
                                         "summary": summarize(rows)}, markdown(rows))
        print(markdown(rows))
        return 0
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    if args.warmup >= args.steps:
        p.error("--warmup must be below --steps")
    try:
        seeds = _ints(args.seeds, "--seeds", 0, 999)
    except ValueError as e:
        p.error(str(e))
    shape = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in PRESETS[args.preset].items()}
    load = os.getloadavg()[0]
    rows = []
    # seed by seed, so that a run cut short leaves whole seeds
    for link in [s.strip() for s in args.link.split(",") if s.strip()]:
        for seed in seeds:
            for name in names:
                cfg = dict(shape, config=name, steps=args.steps, warmup=args.warmup, lr=args.lr, seed=seed,
                           device=args.device, topology=args.topology, inside=args.inside, preset=args.preset)
                started, row_load = time.perf_counter(), os.getloadavg()[0]
                row = launch(cfg, args.workers, link)
                row["link"] = link if link == "loopback" else f"{link} (tbf, emulated)"
                row["wall_s"] = round(time.perf_counter() - started, 1)
                row["load_at_start"] = round(row_load, 2)
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("link", "config", "seed", "held_out_loss", "bytes_per_step",
                                                      "median_step_s", "identical", "wall_s")}), flush=True)
                write(args.json, args.markdown, {"argv": sys.argv[1:] if argv is None else list(argv),
                                                 "load_at_start": load, "rows": rows, "summary": summarize(rows)},
                      markdown(rows, load))
    print(markdown(rows, load))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(main())
