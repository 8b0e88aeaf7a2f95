"""Signal handling for the harness: Ctrl-C and SIGTERM end a run through its cleanup code."""

from __future__ import annotations

import contextlib
import signal

HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def raise_on_sigterm() -> None:
    """Make SIGTERM (and SIGHUP) raise KeyboardInterrupt, as Ctrl-C does, so every ``finally``
    (stopping workers, deleting namespaces) runs whichever way the run is ended."""

    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)


@contextlib.contextmanager
def held_signals():
    """Hold Ctrl-C/SIGTERM/SIGHUP back while the block runs (teardown must not be cut short); a signal
    that arrived meanwhile is delivered when the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
