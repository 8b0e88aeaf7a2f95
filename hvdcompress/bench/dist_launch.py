"""torch.distributed ranks on this machine, on loopback or as the nodes of an emulated network.

The benches that run on torch.distributed (no Horovod) start their ranks with ``run_ranks``: each
rank is ``command(iface)`` with torch.distributed's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` = the rank, the device index on this one machine, ``MASTER_ADDR``,
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``), one CPU thread each (``OMP_NUM_THREADS=1``) and this
checkout first on ``PYTHONPATH``.

``link="loopback"``: plain local processes talking over 127.0.0.1 (``iface`` None). Any other
``link`` is a rate (``netns.parse_bandwidth``: ``"1gbit"``, ``"100mbit"``): the ranks run in an
``hvdcompress.bench.netns.EmulatedNetwork`` of ``workers // local_size`` namespaces whose links
``tbf`` limits to that rate both ways, ranks ``[k*L, (k+1)*L)`` in namespace k. With
``local_size`` 1 that is one namespace, and one limited link, per rank. With ``local_size`` L > 1
it is a two-level network: the L ranks of a "node" share its namespace, so they reach each other
over the namespace's own loopback routing (their own address is local: unlimited, as a node's
NVLink or PCIe is to its slow NIC), and reach the other nodes only through the node's limited
link, which they share, as a node's ranks share its NIC. ``iface`` is then that link's interface
in every namespace: its ``/proc/net/dev`` counters are the node's traffic across, nothing else.
Needs root (``netns.missing_prerequisites``); everything is torn down on the way out.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from contextlib import ExitStack
from typing import Callable, List, Optional, Sequence

import hvdcompress

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hvdcompress.__file__)))
STOP_GRACE_S = 5


class RankFailure(RuntimeError):
    """A rank exited with an error, or the ranks ran past their time limit."""


def free_port() -> int:
    """A TCP port free on this machine now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM the ranks still running, SIGKILL what is left after a grace period."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait(procs: Sequence[subprocess.Popen], timeout_s: Optional[float]) -> List[int]:
    """Every rank's exit status; when one fails, the others are stopped (they would wait for it in a
    collective until Gloo's own time-out), and so are all of them past ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            _stop(procs)
            break
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs)
            raise RankFailure(f"the ranks ran past the time limit of {timeout_s:g} s and were stopped")
        time.sleep(0.2)
    return [p.wait() for p in procs]


def run_ranks(command: Callable[[Optional[str]], Sequence[str]], workers: int, link: str = "loopback",
              local_size: int = 1, tag: str = "dist", timeout_s: Optional[float] = None) -> None:
    """Run ``workers`` ranks of ``command(iface)`` and wait for them (module doc): on loopback, or
    on an emulated network of ``workers // local_size`` nodes joined by ``link``-limited links
    (``iface`` is then the node link's interface, else None). ``tag`` names the namespaces.
    Raises ``RankFailure`` when a rank exits with an error (the others are stopped) or the
    ranks run past ``timeout_s``; ``ValueError`` when ``local_size`` does not divide ``workers``."""
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 or workers % local_size:
        raise ValueError(f"local_size: must be an integer >= 1 that divides workers={workers}; got {local_size!r}")
    with ExitStack() as stack:
        prefixes, addr, iface = [[] for _ in range(workers)], "127.0.0.1", None
        if link != "loopback":
            from .netns import EmulatedNetwork, parse_bandwidth
            net = stack.enter_context(EmulatedNetwork(workers // local_size, parse_bandwidth(link), tag))
            prefixes = [net.exec_prefix(r // local_size) for r in range(workers)]
            addr, iface = net.addresses[0], net.iface
        port = free_port()
        path = os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p)
        procs: List[subprocess.Popen] = []
        try:
            for r in range(workers):
                env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(workers), LOCAL_RANK=str(r), MASTER_ADDR=addr,
                           MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=iface or "lo", OMP_NUM_THREADS="1",
                           PYTHONPATH=path)
                procs.append(subprocess.Popen(prefixes[r] + list(command(iface)), env=env))
            codes = _wait(procs, timeout_s)
        finally:
            _stop(procs)
        if any(codes):
            raise RankFailure(f"ranks exited with {codes}")
