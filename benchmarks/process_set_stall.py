"""Does a rank outside a Horovod process set hold up the set's collectives?

Three local Gloo workers; ranks 0 and 1 run 1-element allreduces on ProcessSet([0, 1]) for
``--seconds`` while rank 2 takes part in no collective. Two runs: rank 2 sleeps throughout, and
rank 2 is frozen with SIGSTOP for ``--freeze`` seconds from ``--at`` on (as if it got no CPU). The
longest allreduce on the set, and when it started, show whether the set waited for rank 2.

    python benchmarks/process_set_stall.py --out process_set_stall.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time


def _worker(freeze_s: float, at_s: float, seconds: float) -> dict:
    import horovod.torch as hvd
    import torch
    ps = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[ps])
    t0 = time.time()
    out = {"rank": hvd.rank()}
    if not ps.included():
        if freeze_s > 0:
            pid = os.getpid()
            subprocess.Popen(["sh", "-c", f"sleep {at_s}; kill -STOP {pid}; sleep {freeze_s}; kill -CONT {pid}"])
        time.sleep(seconds + 1)
    else:
        x, lat, i = torch.ones(1), [], 0
        while time.time() - t0 < seconds:
            start = time.time()
            hvd.allreduce(x, name=f"ps.{i % 4}", process_set=ps)
            lat.append((start - t0, time.time() - start))
            i += 1
        worst = max(lat, key=lambda p: p[1])
        ordered = sorted(s for _, s in lat)
        out.update(allreduces=len(lat), longest_s=round(worst[1], 3), longest_started_at_s=round(worst[0], 2),
                   median_ms=round(1e3 * ordered[len(ordered) // 2], 2))
    handle = hvd.allreduce_async(torch.zeros(1), name="meet")  # every rank; waits without spinning
    while not hvd.poll(handle):
        time.sleep(0.01)
    hvd.synchronize(handle)
    hvd.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--freeze", type=float, default=3.0, help="seconds rank 2 is stopped (default 3)")
    ap.add_argument("--at", type=float, default=2.0, help="when rank 2 is stopped, seconds from the start")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long ranks 0 and 1 run allreduces")
    ap.add_argument("--out", default=None, help="also write the results here (JSON)")
    args = ap.parse_args()
    from horovod.runner import run
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HOROVOD_CYCLE_TIME", "1")
    report = {"freeze_s": args.freeze, "freeze_at_s": args.at, "cycle_ms": os.environ["HOROVOD_CYCLE_TIME"],
              "load_average": os.getloadavg(), "runs": {}}
    for label, freeze in (("rank 2 sleeps", 0.0), ("rank 2 frozen", args.freeze)):
        ranks = run(_worker, args=(freeze, args.at, args.seconds), num_proc=3, hosts="localhost:3", use_gloo=True)
        report["runs"][label] = [r for r in ranks if "allreduces" in r]
        print(label, json.dumps(report["runs"][label]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
