"""Validation of the delayed-averaging arguments, shared by both backends (``delay``,
``sync_every``; the math is in ``torch_ops/delayed.py`` and ``tf_ops/delayed.py``)."""

from __future__ import annotations


def check_delay(delay) -> int:
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ValueError(f"delay: must be an int >= 0 (steps between launching an exchange and applying its "
                         f"result; 0 = synchronous); got {delay!r}")
    return delay


def check_sync_every(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"sync_every: must be an int >= 1 (exchange once every this many steps; 1 = every "
                         f"step); got {k!r}")
    return k
