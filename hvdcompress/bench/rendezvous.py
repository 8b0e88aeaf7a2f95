"""Horovod's Gloo rendezvous server, run by the harness in place of ``horovodrun``.

``python -m hvdcompress.bench.rendezvous --addr ADDR --hosts h0:1,h1:1 --np 2 --lifetime S``
starts Horovod's own ``RendezvousServer`` (``horovod.runner.http.http_server``) bound to ADDR
only (worker 0's namespace address, or 127.0.0.1 in loopback mode) on a free port, initialises
it with the same host assignment horovodrun would make (``get_host_assignments(parse_hosts(...),
np)``), prints ``PORT <port>`` and serves until its stdin closes (the harness holds the other
end, so the server ends with the harness) or ``--lifetime`` seconds pass, whichever is first.
"""

from __future__ import annotations

import argparse
import select
import sys
import time

from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer, RendezvousServer
from horovod.runner.util.threads import in_thread


class BoundRendezvousServer(RendezvousServer):
    """``RendezvousServer`` that listens on one address (the stock one binds every address)."""

    def start_on(self, addr: str) -> int:
        """Listen on ``addr`` at a port the system picks; returns the port."""
        self._httpd = RendezvousHTTPServer((addr, 0), RendezvousHandler, self._verbose)
        self._listen_thread = in_thread(target=self._httpd.serve_forever)
        return self._httpd.server_address[1]


def slot_environment(hosts: str, np_: int) -> list:
    """Per rank, the HOROVOD_* variables horovodrun would set for ``hosts`` and ``np_`` workers."""
    env = []
    for slot in get_host_assignments(parse_hosts(hosts), np_):
        env.append({"HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank),
                    "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
                    "HOROVOD_LOCAL_SIZE": str(slot.local_size), "HOROVOD_CROSS_RANK": str(slot.cross_rank),
                    "HOROVOD_CROSS_SIZE": str(slot.cross_size)})
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--addr", required=True)
    ap.add_argument("--hosts", required=True)
    ap.add_argument("--np", type=int, required=True)
    ap.add_argument("--lifetime", type=float, required=True, help="seconds before it stops anyway")
    args = ap.parse_args(argv)

    server = BoundRendezvousServer()
    port = server.start_on(args.addr)
    server.init(get_host_assignments(parse_hosts(args.hosts), args.np))
    print(f"PORT {port}", flush=True)
    deadline = time.monotonic() + args.lifetime
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sys.stdin], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
            if ready and not sys.stdin.buffer.read1(4096):
                break  # the harness closed our stdin: it is done (or gone)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
