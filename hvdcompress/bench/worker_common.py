"""What every bench worker shares, whatever its framework (``torch_worker``, ``tf_worker``): the
config it reads, the interface counters, the number of timed rounds, how a round is timed, and
the check that every rank ends with the same parameters. Imports neither torch nor TensorFlow; the Horovod module
(``horovod.torch`` or ``horovod.tensorflow``) is passed in.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable, Dict, Iterable, List, Optional

COMPUTE_ONLY = "compute-only"
MIN_STEPS = 3  # timed rounds, whatever the time budget
REQUIRED = ("model", "batch", "steps", "warmup", "threads", "seed", "compute_only", "specs",
            "latency_ms", "epoch", "phase_budget_s", "iface", "out")


def load_config(path: str, optional: dict) -> dict:
    """The launch's config (``run_workers`` writes it), ``optional``'s defaults filled in; a
    ValueError naming the missing keys."""
    with open(path) as f:
        cfg = json.load(f)
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"bench worker config {path}: missing keys {', '.join(missing)}")
    return dict(optional, **cfg)


def read_counters(iface: Optional[str]) -> Dict[str, int]:
    """tx/rx byte counters of ``iface`` in this process's network namespace ({} without one)."""
    if not iface:
        return {}
    out = {}
    for key in ("tx_bytes", "rx_bytes"):
        with open(f"/sys/class/net/{iface}/statistics/{key}") as f:
            out[key] = int(f.read())
    return out


def timed_rounds(cfg: dict, last_round_s: float, phases: int, hvd) -> int:
    """``steps``, or fewer when ``phase_budget_s`` is set: as many rounds as fit in the budget at
    rank 0's last warm-up round's pace (at least ``MIN_STEPS``). Rank 0 decides, every rank follows."""
    budget = cfg["phase_budget_s"]
    if not budget or cfg["warmup"] < 1:
        return cfg["steps"]
    fit = int(budget * phases / max(last_round_s, 1e-6))
    return int(hvd.broadcast_object(min(cfg["steps"], max(MIN_STEPS, fit)), root_rank=0))


def timed_round(phases: List, meet: Callable[[], None]) -> None:
    """One timed step of every phase (``phase.timed_step()``), in turn. A compute-only step
    (``phase.spec is None``) exchanges nothing, so the ranks leave it as far apart as their compute
    differed; they ``meet`` after it (untimed), or the next phase's slowest rank would count that
    gap as its own step time, which no step of its own in training carries (its ranks leave each
    of its steps together, from the exchange's last wait)."""
    for p in phases:
        p.timed_step()
        if p.spec is None:
            meet()


def digest(arrays: Iterable) -> str:
    """sha256 of the arrays' bytes, in order (numpy arrays or anything with ``tobytes``)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()


class ReplicasDiffer(RuntimeError):
    """Ranks ended a launch with different parameters: the exchange is broken, the timings void."""


def check_identical(labels: List[str], digests: List[str], hvd) -> None:
    """Allgather every rank's per-phase parameter digests; raise :class:`ReplicasDiffer` naming
    the phases whose parameters differ between ranks (on every rank, so all of them fail)."""
    everyone = hvd.allgather_object(list(digests))
    differ = [label for i, label in enumerate(labels) if len({d[i] for d in everyone}) > 1]
    if differ:
        raise ReplicasDiffer(f"parameters differ between ranks after the timed steps in phase(s): "
                             f"{', '.join(differ)}; every rank must apply the same update")
