"""The emulated network: one Linux network namespace per worker, rate-limited links, a bridge.

Topology for N workers (all names carry this process's id, so concurrent runs never collide)::

    ns hvcb<pid>-<k>-w0: hvc0 10.213.0.1/24 --veth-- hvcp0 \
    ns hvcb<pid>-<k>-w1: hvc0 10.213.0.2/24 --veth-- hvcp1  }-- bridge hvcbr in ns hvcb<pid>-<k>-br
    ...                                                     /

The 10.213.0.0/24 addresses exist only inside these namespaces: nothing is routed to or from the
machine's own network. With a bandwidth set, a ``tbf`` qdisc limits *both* directions of every
worker's link (on ``hvc0``, what the worker sends; on the bridge's ``hvcp<i>``, what it receives),
so each worker has a full-duplex link of that rate into a switch. No latency is added here:
``netem`` needs a kernel module a host may lack (see ``--latency-ms``, injected in the workers).

``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``; we write one per
namespace mapping the worker's host name and the machine's host name to that namespace's address,
because Horovod 0.28.1 builds its process-set Gloo context from the resolved machine host name
(which would otherwise be 127.0.0.1 and refuse connections). Teardown removes the namespaces, their
links, the ``/etc/netns`` entries and any process still inside them, and never raises.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from typing import List, Optional, Sequence

from .signals import held_signals

PREFIX = "hvcb"
SUBNET = "10.213.0"  # a /24 that exists only inside the namespaces created here
WORKER_IFACE = "hvc0"
BRIDGE = "hvcbr"
NETNS_ETC = "/etc/netns"
COMMAND_TIMEOUT_S = 15
_OURS = re.compile(rf"^{PREFIX}(\d+)-[A-Za-z0-9]+-(?:w\d+|br)$")  # pid, tag, member


class SetupError(RuntimeError):
    """The emulated network could not be built (the message says what failed and why)."""


_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_bandwidth(text: str) -> Optional[int]:
    """``"100mbit"`` -> 100_000_000 bit/s; ``"unlimited"`` -> None. Units: bit, kbit, mbit, gbit."""
    t = str(text).strip().lower()
    if t in ("unlimited", "inf", "none"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?bit)", t)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"bandwidth: expected e.g. 10mbit, 100mbit, 1gbit, 10gbit or unlimited; got {text!r}")
    bps = float(m.group(1)) * _UNITS[m.group(2)]
    if bps < 10**5:
        raise ValueError(f"bandwidth: {text!r} is below 100kbit, too slow for a benchmark")
    return int(bps)


def format_bandwidth(bps: Optional[int]) -> str:
    """100_000_000 -> ``"100 Mbit/s"``; None -> ``"unlimited"``."""
    if bps is None:
        return "unlimited"
    for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps} bit/s"


def missing_prerequisites() -> Optional[str]:
    """Why namespaces cannot be used here (not root, ``ip``/``tc`` missing), or None."""
    problems = []
    if os.geteuid() != 0:
        problems.append("it must run as root (network namespaces and qdiscs need CAP_NET_ADMIN)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            problems.append(f"'{tool}' is not on PATH (install {package})")
    return "; ".join(problems) or None


def _run(args: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SetupError(f"'{' '.join(args)}' did not finish within {timeout:g} s") from None
    if done.returncode != 0:
        raise SetupError(f"'{' '.join(args)}' failed (exit {done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()}")
    return done.stdout


def list_namespaces() -> List[str]:
    """Names of all network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(owner_pid: Optional[int] = None) -> List[str]:
    """Our namespaces still present: all of them, or those made by ``owner_pid``."""
    found = []
    for name in list_namespaces():
        m = _OURS.match(name)
        if m and (owner_pid is None or int(m.group(1)) == owner_pid):
            found.append(name)
    return found


def remove_stale() -> List[str]:
    """Delete our namespaces whose creating process is gone (a run killed with SIGKILL)."""
    stale = [n for n in leftovers() if not _pid_alive(int(_OURS.match(n).group(1)))]
    remove(stale)
    return stale


def remove(names: Sequence[str]) -> List[str]:
    """Delete these namespaces of ours (processes inside, links, /etc/netns entries); never raises.
    Returns the problems met."""
    with held_signals():
        problems = [_delete_namespace(ns) for ns in names]
    return [p for p in problems if p]


def _kill_processes_in(ns: str) -> None:
    """SIGKILL every process still inside ``ns`` (only ever ones this harness started there)."""
    try:
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns]).split()]
    except SetupError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete_namespace(ns: str) -> Optional[str]:
    """Remove one namespace, its processes and its /etc/netns entry; returns a problem or None."""
    problem = None
    _kill_processes_in(ns)
    try:
        _run(["ip", "netns", "delete", ns])
    except SetupError as e:
        if ns in list_namespaces():
            problem = str(e)
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
    return problem


class EmulatedNetwork:
    """N worker namespaces joined by a bridge, each link limited to ``bandwidth_bps`` (None: no
    limit). Use as a context manager: entering builds it, leaving tears it down."""

    def __init__(self, workers: int, bandwidth_bps: Optional[int], tag: str):
        if not 1 <= workers <= 250:
            raise ValueError(f"workers: the emulated network holds 1 to 250 workers; got {workers}")
        base = f"{PREFIX}{os.getpid()}-{tag}"
        self.workers = workers
        self.bandwidth_bps = bandwidth_bps
        self.namespaces = [f"{base}-w{i}" for i in range(workers)]
        self.bridge_namespace = f"{base}-br"
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(workers)]
        self.hostnames = [f"h{i}" for i in range(workers)]
        self.iface = WORKER_IFACE
        self._created: List[str] = []

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Build the namespaces, links, addresses, qdiscs and hosts files (undone on failure)."""
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        br = self.bridge_namespace
        self._add_namespace(br)
        _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        machine = socket.gethostname()
        for i, ns in enumerate(self.namespaces):
            self._add_namespace(ns)
            peer = f"hvcp{i}"
            _run(["ip", "-n", ns, "link", "add", self.iface, "type", "veth", "peer", "name", peer,
                  "netns", br])
            _run(["ip", "-n", br, "link", "set", peer, "master", BRIDGE])
            _run(["ip", "-n", br, "link", "set", peer, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", self.iface])
            _run(["ip", "-n", ns, "link", "set", self.iface, "up"])
            if self.bandwidth_bps is not None:
                self._limit(ns, self.iface)
                self._limit(br, peer)
            self._write_hosts(ns, self.addresses[i], [self.hostnames[i], machine])

    def _limit(self, ns: str, dev: str) -> None:
        rate = self.bandwidth_bps
        # a small bucket (1 ms at full rate, >= 10 full-size frames), so a short message is limited
        # like a long one, as on a real link (tbf segments larger GSO packets itself)
        burst = max(15000, rate // 8 // 1000)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
              "burst", str(burst), "latency", "50ms"])

    def _write_hosts(self, ns: str, own_address: str, own_names: Sequence[str]) -> None:
        lines = ["127.0.0.1 localhost", f"{own_address} {' '.join(own_names)}"]
        lines += [f"{a} {h}" for a, h in zip(self.addresses, self.hostnames) if a != own_address]
        os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
        with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def down(self) -> List[str]:
        """Tear everything down (processes inside, namespaces and links, /etc/netns entries).
        Never raises; returns the problems met. Ctrl-C/SIGTERM are held back until it is done."""
        problems = remove(list(reversed(self._created)))
        self._created = []
        return problems

    # -- what the launcher needs -----------------------------------------------------------------
    def exec_prefix(self, rank: int) -> List[str]:
        """Command prefix that runs a program inside worker ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank]]

    def describe(self) -> str:
        limit = ("no rate limit" if self.bandwidth_bps is None else
                 f"tbf rate {format_bandwidth(self.bandwidth_bps)} on both ends of every worker's veth")
        return (f"{self.workers} network namespaces ({SUBNET}.0/24), veth pairs into a bridge in its "
                f"own namespace, {limit}")
