"""Launching N Horovod Gloo workers without ``horovodrun``: rendezvous, environment, supervision.

A :class:`Placement` says where each rank runs: inside a network namespace of an
:class:`~hvdcompress.bench.netns.EmulatedNetwork`, or (loopback mode) as a plain local process
talking over 127.0.0.1. :func:`run_workers` starts the rendezvous server (in worker 0's
namespace), then the N workers (``python -m hvdcompress.bench.torch_worker CONFIG``, or the
``worker_argv`` given, e.g. ``hvdcompress.bench.tf_worker``) with the Gloo
environment horovodrun would give them, and supervises them: when one fails, or the time limit
passes, or the harness is interrupted, every process it started is stopped (by process group,
SIGTERM then SIGKILL) before the error goes up. Every wait has a time limit.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import hvdcompress

from .rendezvous import slot_environment
from .signals import held_signals

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hvdcompress.__file__)))
RENDEZVOUS_START_TIMEOUT_S = 60
STOP_GRACE_S = 5
GLOO_TIMEOUT_S = 300  # one collective may take minutes at 10 Mbit/s


class WorkerFailure(RuntimeError):
    """A worker failed or the launch ran past its time limit. ``summary`` is one line; the
    message adds the tail of the relevant log."""

    def __init__(self, summary: str, log_tail: str = ""):
        super().__init__(f"{summary}\n{log_tail}" if log_tail else summary)
        self.summary = summary


@dataclass
class Placement:
    """Where the ranks run and how they reach each other."""

    workers: int
    hosts: str  # Horovod host string, e.g. "h0:1,h1:1" or "localhost:2"
    rendezvous_addr: str
    iface: str  # HOROVOD_GLOO_IFACE
    count_iface: Optional[str]  # interface whose byte counters are this worker's alone (None: shared)
    prefixes: List[List[str]] = field(default_factory=list)  # command prefix per rank

    @classmethod
    def loopback(cls, workers: int) -> "Placement":
        return cls(workers, f"localhost:{workers}", "127.0.0.1", "lo", None, [[]] * workers)

    @classmethod
    def in_network(cls, net) -> "Placement":
        hosts = ",".join(f"{h}:1" for h in net.hostnames)
        return cls(net.workers, hosts, net.addresses[0], net.iface, net.iface,
                   [net.exec_prefix(r) for r in range(net.workers)])


def _worker_env(placement: Placement, port: int, slot: Dict[str, str], threads: int) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH")) if p)
    env.update(slot)
    env.update({
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": placement.rendezvous_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": placement.iface,
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT_S),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _stop(procs: List[subprocess.Popen]) -> None:
    """SIGTERM each process group we started, then SIGKILL what is left after a grace period."""
    with held_signals():
        live = [p for p in procs if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                try:
                    p.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass  # unkillable for now (uninterruptible I/O); the namespace teardown retries


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # each child leads its own session: its group id is its pid
    except ProcessLookupError:
        pass


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _read_port(proc: subprocess.Popen, log: str) -> int:
    deadline = time.monotonic() + RENDEZVOUS_START_TIMEOUT_S
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith("PORT "):
                    return int(line.split()[1])
        elif proc.poll() is not None:
            break
    raise WorkerFailure(f"the rendezvous server did not start within {RENDEZVOUS_START_TIMEOUT_S} s",
                        f"{buf.decode(errors='replace')}{_tail(log)}")


WORKER_ARGV = ("-m", "hvdcompress.bench.torch_worker")


def run_workers(placement: Placement, config: dict, workdir: str, timeout_s: float,
                on_output=None, worker_argv: Sequence[str] = WORKER_ARGV) -> List[dict]:
    """Run one launch of ``placement.workers`` bench workers with ``config``; returns each rank's
    result (rank order). Raises :class:`WorkerFailure` on a failed worker or after ``timeout_s``;
    every process started here is stopped before this returns or raises. Each worker runs
    ``python <worker_argv> CONFIG.json`` from the project root (default: the harness's worker; a
    benchmark script may give its own, which must write its result JSON to ``config["out"]``)."""
    n = placement.workers
    os.makedirs(workdir, exist_ok=True)
    config = dict(config, iface=placement.count_iface, out=os.path.join(workdir, "rank{rank}.json"))
    config_path = os.path.join(workdir, "config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    procs: List[subprocess.Popen] = []
    logs: List[str] = []
    try:
        rdv_log = os.path.join(workdir, "rendezvous.log")
        with open(rdv_log, "w") as err, held_signals():  # no Ctrl-C between start and bookkeeping
            rdv = subprocess.Popen(
                placement.prefixes[0] + [sys.executable, "-m", "hvdcompress.bench.rendezvous",
                                         "--addr", placement.rendezvous_addr, "--hosts", placement.hosts,
                                         "--np", str(n), "--lifetime", str(int(timeout_s) + 60)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                    p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p)))
            procs.append(rdv)
        port = _read_port(rdv, rdv_log)
        for rank, slot in enumerate(slot_environment(placement.hosts, n)):
            log = os.path.join(workdir, f"rank{rank}.log")
            logs.append(log)
            with open(log, "w") as out, held_signals():
                procs.append(subprocess.Popen(
                    placement.prefixes[rank] + [sys.executable, *worker_argv, config_path],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env=_worker_env(placement, port, slot, config["threads"]), cwd=PROJECT_ROOT))
        _supervise(procs[1:], logs, timeout_s, on_output)
        results = []
        for rank in range(n):
            with open(config["out"].format(rank=rank)) as f:
                results.append(json.load(f))
        return results
    finally:
        _stop(procs)
        for p in procs:
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()


def _supervise(workers: List[subprocess.Popen], logs: List[str], timeout_s: float, on_output) -> None:
    deadline = time.monotonic() + timeout_s
    seen = 0
    while True:
        codes = [w.poll() for w in workers]
        if on_output is not None:  # rank 0's progress lines, as they come
            text = _tail(logs[0], 10_000).splitlines()
            for line in text[seen:]:
                if line.startswith("[bench worker]"):
                    on_output(line)
            seen = max(seen, len(text))
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            r = failed[0]
            raise WorkerFailure(f"worker {r} exited with status {codes[r]}; the others were stopped",
                                f"last lines of its log:\n{_tail(logs[r])}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise WorkerFailure(f"the workers did not finish within {timeout_s:g} s (--launch-timeout) "
                                "and were stopped", f"last lines of rank 0's log:\n{_tail(logs[0])}")
        time.sleep(0.2)
