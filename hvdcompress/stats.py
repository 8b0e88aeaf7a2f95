"""Bytes on the wire, per step and in total, measured from the payloads handed to the transport."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class WireStats:
    """Counts what one rank hands to collectives, next to what dense exchange would have sent.

    ``bytes_sent`` is the size of this rank's payload tensors (for an allgather, its own
    contribution). Ring allreduce moves about 2(N-1)/N of that per rank and an allgather receives
    (N-1) times the others' share; those transport factors are the same for dense exchange, so the
    ratio dense_bytes / bytes_sent compares like with like for summed compressors and gives the
    send-side ratio for gathered ones.
    """

    steps: int = 0
    last_bytes: int = 0
    last_dense_bytes: int = 0
    total_bytes: int = 0
    total_dense_bytes: int = 0
    last_compute_seconds: float = 0.0
    total_compute_seconds: float = 0.0
    density: Optional[float] = None  # the fraction of entries sent in the last step (ratio-based)
    # two-level exchanges: payload bytes per hop ("local": inside the node, "cross": between nodes)
    last_hop_bytes: Dict[str, int] = field(default_factory=dict)
    total_hop_bytes: Dict[str, int] = field(default_factory=dict)
    # a two-level topology choosing per group: the route and spec of each group of the last step
    routes: Dict[str, str] = field(default_factory=dict)

    def record(self, bytes_sent: int, dense_bytes: int, compute_seconds: float = 0.0,
               density: Optional[float] = None, hops: Optional[Dict[str, int]] = None,
               routes: Optional[Dict[str, str]] = None) -> None:
        """One step: payload bytes, dense bytes, seconds spent compressing/decompressing, the
        density the compressor used (None when it has none) and, for a two-level exchange, the
        payload bytes per hop (included in ``bytes_sent``) and, where routes are chosen per group,
        each group's route and spec (group key -> e.g. "flat dgc:ratio=0.001")."""
        if routes:
            self.routes = dict(routes)
        if hops is not None:
            self.last_hop_bytes = {k: int(v) for k, v in hops.items()}
            for k, v in self.last_hop_bytes.items():
                self.total_hop_bytes[k] = self.total_hop_bytes.get(k, 0) + v
        self.steps += 1
        self.density = density
        self.last_bytes, self.last_dense_bytes = int(bytes_sent), int(dense_bytes)
        self.total_bytes += self.last_bytes
        self.total_dense_bytes += self.last_dense_bytes
        self.last_compute_seconds = float(compute_seconds)
        self.total_compute_seconds += self.last_compute_seconds

    @property
    def ratio(self) -> float:
        """Dense bytes / sent bytes over all recorded steps (inf when nothing was sent)."""
        return self.total_dense_bytes / self.total_bytes if self.total_bytes else float("inf")

    def as_dict(self) -> dict:
        per_step = self.total_bytes / self.steps if self.steps else 0.0
        dense_per_step = self.total_dense_bytes / self.steps if self.steps else 0.0
        return {"steps": self.steps, "bytes_per_step": per_step, "dense_bytes_per_step": dense_per_step,
                "last_bytes": self.last_bytes, "last_dense_bytes": self.last_dense_bytes,
                "total_bytes": self.total_bytes, "total_dense_bytes": self.total_dense_bytes,
                "ratio": self.ratio, "density": self.density,
                "compute_seconds_per_step": self.total_compute_seconds / self.steps if self.steps else 0.0,
                **({"hop_bytes_per_step": {k: v / self.steps for k, v in self.total_hop_bytes.items()}}
                   if self.total_hop_bytes and self.steps else {}),
                **({"routes": dict(self.routes)} if self.routes else {})}
