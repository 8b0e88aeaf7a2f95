"""Where the test suite spends its CPU: with ``HVDC_TESTS_CPU_LOG=<file>`` set, conftest.py appends
one JSON line per test (CPU seconds of the pytest process and of the processes it waited for,
over the test's setup, call and teardown) and each shared launch one line per scenario (each
worker's CPU seconds in it, ``launch.in_sequence``). CPU, not wall time: on a loaded machine the
wall time says little, the CPU of the tree is what the two cores must give.

    HVDC_TESTS_CPU_LOG=/tmp/cpu.jsonl make test
    python tests/scenarios/cpu_log.py /tmp/cpu.jsonl     # the costliest tests and scenarios
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Dict

CPU_LOG = "HVDC_TESTS_CPU_LOG"


def enabled() -> bool:
    return bool(os.environ.get(CPU_LOG))


def snapshot() -> Dict[str, float]:
    """CPU seconds so far of this process and of its waited-for children, and the wall clock."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"cpu": own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime, "wall": time.perf_counter()}


def since(start: Dict[str, float]) -> Dict[str, float]:
    now = snapshot()
    return {k: round(now[k] - start[k], 2) for k in now}


def write(**record) -> None:
    """Append ``record`` as one JSON line to the log (one write: the xdist workers share the file)."""
    path = os.environ.get(CPU_LOG)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def summary(path: str, top: int = 40) -> str:
    tests, scenarios = [], []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            (tests if "test" in r else scenarios).append(r)
    lines = [f"{len(tests)} tests, {sum(r['cpu'] for r in tests):.0f} CPU-s in all; costliest:"]
    lines += [f"{r['cpu']:8.1f} {r['wall']:8.1f}  {r['test']}" for r in sorted(tests, key=lambda r: -r["cpu"])[:top]]
    if scenarios:
        lines.append("shared-launch scenarios (CPU-s per worker):")
        lines += [f"{sum(r['cpu']):8.1f}  {r['launch']} {r['scenario']} {r['cpu']}"
                  for r in sorted(scenarios, key=lambda r: -sum(r["cpu"]))]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
