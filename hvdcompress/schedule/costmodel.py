"""Cost model of one training step's communication and compression, fitted from timings.

Communication (alpha-beta, per worker count N, fitted on the real transport)::

    allreduce  t = a_N + b_N * m          m: bytes each rank contributes
    allgather  t = a_N + b_N * N * m      N * m: bytes every rank ends up holding

An allreduce of 16-bit floats (fp16) has a fit of its own (``allreduce_half``) when it was
timed: the transport adds the halves on the CPU (Gloo converts every element to float and back),
which on a CPU host costs more per byte than the wire, so half the bytes is not half the time.
Without that fit, such an allreduce is charged the fp32 fit for its bytes.

The fitted start-up a_N is a collective timed alone right after a barrier, every rank lined up.
In a training step a collective rarely runs so: Horovod's background thread negotiates whatever
was queued since its last cycle, then runs those collectives one after another. Two more
start-ups may be given for the step's *prediction* (``start_ups``; the searches keep a_N):

    alone_alpha   a collective launched when the one before it is done or under way, alone in
                  its cycle, the ranks not lined up (``torch_ops.profiling.time_sequence``:
                  collectives one after another, each launched when the previous completed)
    queued_alpha  a further collective negotiated in one cycle with others (``time_burst``: many
                  launched at once)

``hvdcompress.schedule.timeline`` charges a group ``queued_alpha`` per collective when it was
ready before the previous group's exchange started, else ``alone_alpha``. None (the default):
every collective pays a_N. advise's measurement records both timings in the model's meta
(``step_start_ups``) without setting them: timed on a machine at rest they may not be what a step
of busy workers pays, which measured steps decide.

An exchange of a (merged) tensor of d elements issues one or more collectives; its time is the
sum over them (``comm_seconds``). Top-k sends an int32-index allgather and a float32-value
allgather of k = ceil(ratio * d) entries each, so t_c = 2 * (a_N + b_N * 4 * N * k), as in
docs/design.md. Which collectives a compressor issues, in how many rounds, is what its
registration declares (``spec.register(..., wire=)``; ``rounds`` below). Where the cost depends on
the tensor's shape, not only its element count (PowerSGD: P has n*r values, Q m*r), a tensor of
known shape is charged by its shape (``register(..., shaped_wire=)``, ``tensor_comm_seconds``).
Between two ranks a gathered round of a same-shape algorithm (``register(..., same_shape=True)``:
quantizers, top-k, bf16) is charged the allreduce fit for its bytes, as the communicators send it
as a sum (``SummedGather``); the allgather fit stays for the others (DGC, threshold).

Compression (per compressor spec) ``t_s(d) = a * f(d) + b`` with ``f(d) = d * log2(d)``
("dlogd", sort-like selection) or ``f(d) = d`` ("linear"); both forms are fitted and the one with
the smaller relative RMS error is kept, with both errors recorded.

Every fit is weighted least squares on the *relative* residual ``(a + b*x - t) / t``, because
sizes span many decades and the start-up term would otherwise be fitted to noise; a coefficient
that comes out negative is fixed at 0 and the other refitted (``fit_linear``). A collective's fit
takes its per-byte term from the transfer-bound samples only (``fit_transfer``): a rate limiter
such as tbf passes a burst at line rate, so small messages do not show the link's rate, and a
relative fit over all sizes then bends the slope toward them and under-predicts large messages.

To another world size the model is carried by ring-algorithm scaling (``for_world_size``):
ring allreduce costs 2(N-1) alpha + 2(N-1)/N * m * beta, ring allgather (N-1) alpha +
(N-1)/N * (N m) * beta, so b_N scales with (N-1)/N and the per-hop part of a_N with (N-1); the
per-link alpha and beta come from the fitted N, or from a given bandwidth and hop latency (then
the rest of the fitted start-up, Horovod's coordination, stays fixed). This is an extrapolation.

A ``CostModel`` is JSON (``to_dict``/``save``/``load``), keyed by world size and host set, cached
under ``~/.cache/hvdcompress`` (``cache_path``). One can be written by hand, e.g.
``CostModel.from_link(4, gbit_per_s=1.0, latency_s=50e-6)`` or with explicit ``LinearFit``s.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..spec import GATHERED, SUMMED, CompressionSpec, resolve

VERSION = 1
FORMS = ("dlogd", "linear")


@dataclass(frozen=True)
class LinearFit:
    """``t = alpha + beta * x``; ``rel_rmse``: RMS of (fit - t) / t over the samples it came from."""

    alpha: float
    beta: float
    rel_rmse: float = 0.0
    samples: int = 0

    def __call__(self, x):
        return self.alpha + self.beta * np.asarray(x, dtype=float)

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "rel_rmse": self.rel_rmse, "samples": self.samples}

    @classmethod
    def from_dict(cls, d: Mapping) -> "LinearFit":
        return cls(float(d["alpha"]), float(d["beta"]), float(d.get("rel_rmse", 0.0)), int(d.get("samples", 0)))


@dataclass(frozen=True)
class ComputeFit:
    """``t_s(d) = a * f(d) + b`` for d elements; ``errors``: relative RMS error of every form tried."""

    form: str
    a: float
    b: float
    errors: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"compute fit: form must be one of {', '.join(FORMS)}; got {self.form!r}")

    def __call__(self, d):
        return self.a * _feature(self.form, d) + self.b

    @property
    def rel_rmse(self) -> float:
        return float(self.errors.get(self.form, 0.0))

    def to_dict(self) -> dict:
        return {"form": self.form, "a": self.a, "b": self.b, "errors": dict(self.errors)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ComputeFit":
        return cls(d["form"], float(d["a"]), float(d["b"]), {k: float(v) for k, v in d.get("errors", {}).items()})


def _feature(form: str, d) -> np.ndarray:
    d = np.maximum(np.asarray(d, dtype=float), 0.0)
    if form == "linear":
        return d
    return d * np.log2(np.maximum(d, 1.0))


def fit_linear(x: Sequence[float], t: Sequence[float]) -> LinearFit:
    """Least squares ``t ~ alpha + beta * x`` minimising sum(((alpha + beta*x - t) / t)^2), with
    alpha, beta >= 0 (a negative one is fixed at 0 and the other refitted)."""
    x, t = np.asarray(x, dtype=float), np.asarray(t, dtype=float)
    if x.shape != t.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"fit: need at least 2 (size, seconds) samples of equal length; got {len(x)}, {len(t)}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(t)) and np.all(t > 0) and np.all(x >= 0)):
        raise ValueError("fit: sizes must be finite and >= 0, times finite and > 0")
    w = 1.0 / t
    design = np.stack([w, x * w], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if beta < 0:
        alpha, beta = float(np.sum(w) / np.sum(w * w)), 0.0  # argmin of sum((alpha * w - 1)^2)
    elif alpha < 0:
        alpha, beta = 0.0, float(np.sum(x * w) / np.sum((x * w) ** 2))
    pred = alpha + beta * x
    err = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    return LinearFit(float(alpha), float(beta), err, len(x))


TRANSFER_SPAN = 16.0  # fit_transfer: the slope comes from the samples within this factor of the largest size


def fit_transfer(x: Sequence[float], t: Sequence[float], span: float = TRANSFER_SPAN) -> LinearFit:
    """A collective's ``t ~ alpha + beta * x``: beta is the least-squares slope of the samples whose
    size is within ``span`` of the largest (transfer-bound: what large messages pay per byte),
    alpha the relative fit of the start-up with that slope fixed (what small messages show),
    both >= 0. With fewer than two such sizes, or no positive slope among them (noise: nothing is
    transfer-bound), ``fit_linear``. ``rel_rmse`` is over all samples."""
    x, t = np.asarray(x, dtype=float), np.asarray(t, dtype=float)
    rel = fit_linear(x, t)  # checks the samples
    big = x >= x.max() / span
    if len(np.unique(x[big])) < 2:
        return rel
    beta = float(np.polyfit(x[big], t[big], 1)[0])
    if not beta > 0:
        return rel
    w = 1.0 / t
    alpha = max(0.0, float(np.sum(w * (1.0 - beta * x * w)) / np.sum(w * w)))  # argmin sum((alpha + beta x - t) / t)^2
    err = float(np.sqrt(np.mean(((alpha + beta * x - t) / t) ** 2)))
    return LinearFit(alpha, beta, err, len(x))


def fit_compute(d: Sequence[float], t: Sequence[float], forms: Iterable[str] = FORMS) -> ComputeFit:
    """Fit ``t_s(d)`` in every form of ``forms`` (see the module doc); keep the smallest error."""
    fits = {}
    for form in forms:
        if form not in FORMS:
            raise ValueError(f"compute fit: form must be one of {', '.join(FORMS)}; got {form!r}")
        lin = fit_linear(_feature(form, d), t)
        fits[form] = lin
    best = min(fits, key=lambda f: fits[f].rel_rmse)
    return ComputeFit(best, fits[best].beta, fits[best].alpha, {f: v.rel_rmse for f, v in fits.items()})


# --- what a compressor puts on the wire ---------------------------------------------------------
# Every algorithm declares its rounds (``spec.register(..., wire=)``, in its oracle module); the
# model sums the rounds' start-ups and transfers.


def rounds(spec, d, itemsize: int = 4, density: Optional[float] = None, world_size: int = 1):
    """The ``spec.Round`` s of one exchange of d-element tensors (array ok)."""
    spec = resolve(spec)
    return spec.info.rounds(spec.params, np.asarray(d, dtype=float), itemsize, world_size, density)


def payload(spec, d, itemsize: int = 4, density: Optional[float] = None) -> Tuple[str, int, np.ndarray]:
    """(kind of the first round, collectives per exchange over all rounds, bytes this rank sends
    over all rounds) for d-element tensors."""
    rs = rounds(spec, d, itemsize, density)
    return rs[0].kind, sum(r.collectives for r in rs), sum(r.nbytes for r in rs)


# --- the model ----------------------------------------------------------------------------------
def host_key(world_size: int, hosts: Iterable[str] = ()) -> str:
    """``n<N>-<10 hex digits of sha1 of the sorted distinct hosts>``: names a cached model."""
    digest = hashlib.sha1(",".join(sorted(set(hosts))).encode()).hexdigest()[:10]
    return f"n{int(world_size)}-{digest}"


def cache_dir() -> str:
    """$HVDCOMPRESS_CACHE, else $XDG_CACHE_HOME/hvdcompress, else ~/.cache/hvdcompress."""
    if os.environ.get("HVDCOMPRESS_CACHE"):
        return os.environ["HVDCOMPRESS_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hvdcompress")


def cache_path(world_size: int, hosts: Iterable[str] = ()) -> str:
    return os.path.join(cache_dir(), f"costmodel-{host_key(world_size, hosts)}.json")


def _ring_factors(n: int) -> Tuple[float, float]:
    """(latency factor, bandwidth factor) of a ring collective on n ranks: (n-1, (n-1)/n)."""
    return float(n - 1), (n - 1) / n


@dataclass(frozen=True)
class CostModel:
    """Fitted (or hand-written) costs for one world size and host set; see the module doc."""

    world_size: int
    allreduce: LinearFit
    allgather: LinearFit
    compress: Mapping[str, ComputeFit] = field(default_factory=dict)
    hosts: Tuple[str, ...] = ()
    meta: Mapping[str, object] = field(default_factory=dict)
    decompress: Mapping[str, ComputeFit] = field(default_factory=dict)
    launch_seconds: float = 0.0  # CPU time to hand one collective to Horovod (on the compute stream)
    exchange_skew: float = 0.0  # the closing exchange ends this x (compression + transfer) late: closing_seconds
    allreduce_half: Optional[LinearFit] = None  # an allreduce of 16-bit floats (module doc); None: the fp32 fit
    alone_alpha: Optional[float] = None  # start-up of a collective alone in its cycle (module doc)
    queued_alpha: Optional[float] = None  # start-up of a collective negotiated with others (module doc)

    def __post_init__(self):
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"cost model: world_size must be an int >= 1; got {self.world_size!r}")
        # compressor keys are normalised spec strings, so "topk:ratio=0.01" finds its fit
        object.__setattr__(self, "compress", {str(resolve(k)): v for k, v in dict(self.compress).items()})
        object.__setattr__(self, "decompress", {str(resolve(k)): v for k, v in dict(self.decompress).items()})
        if not (math.isfinite(self.launch_seconds) and self.launch_seconds >= 0):
            raise ValueError(f"cost model: launch_seconds must be finite and >= 0; got {self.launch_seconds!r}")
        if not (math.isfinite(self.exchange_skew) and self.exchange_skew >= 0):
            raise ValueError(f"cost model: exchange_skew must be finite and >= 0; got {self.exchange_skew!r}")
        for name in ("alone_alpha", "queued_alpha"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"cost model: {name} must be finite and >= 0 (or None); got {v!r}")
        object.__setattr__(self, "hosts", tuple(sorted(set(self.hosts))))

    @property
    def key(self) -> str:
        return host_key(self.world_size, self.hosts)

    # -- predictions ---------------------------------------------------------------------------
    def collective_seconds(self, kind: str, nbytes, world_size: Optional[int] = None, half: bool = False):
        """One collective: ``kind`` is "allreduce" or "allgather", nbytes what each rank sends
        (``half``: an allreduce of 16-bit floats, ``summed_fit``)."""
        model = self if world_size in (None, self.world_size) else self.for_world_size(world_size)
        nbytes = np.asarray(nbytes, dtype=float)
        if kind == GATHERED:
            return model.allgather(model.world_size * nbytes)
        return model.summed_fit(half)(nbytes)

    def summed_fit(self, half: bool = False) -> LinearFit:
        """The allreduce fit of fp32 values, or of 16-bit floats (``allreduce_half`` where timed,
        else the fp32 one)."""
        return self.allreduce_half if half and self.allreduce_half is not None else self.allreduce

    def comm_seconds(self, spec, dense_bytes, world_size: Optional[int] = None, itemsize: int = 4,
                     density: Optional[float] = None, start_up: Optional[float] = None):
        """t_c: seconds to exchange tensors of ``dense_bytes`` (array ok) compressed by ``spec``;
        ``start_up``: every collective's start-up in place of the fits' (``start_ups``)."""
        d = np.asarray(dense_bytes, dtype=float) / itemsize
        model = self if world_size in (None, self.world_size) else self.for_world_size(world_size)
        return model._rounds_seconds(spec, rounds(spec, d, itemsize, density, model.world_size), start_up,
                                     np.zeros_like(d))

    def _rounds_seconds(self, spec, rs, start_up: Optional[float], total):
        """``total`` plus the seconds of the rounds ``rs`` of ``spec``, run one after another, on
        this model's world size. A same-shape gather between two ranks travels as an allreduce of
        its bytes (``SummedGather``), so it is charged the allreduce fit."""
        summed_gather = self.world_size == 2 and resolve(spec).info.same_shape
        for r in rs:
            gathered = r.kind == GATHERED and not summed_gather
            fit = self.allgather if gathered else self.summed_fit(getattr(r, "half", False))
            scale = self.world_size if gathered else 1
            alpha = fit.alpha if start_up is None else start_up
            total = total + r.collectives * alpha + fit.beta * scale * r.nbytes
        return total

    def tensor_comm_seconds(self, spec, shape, world_size: Optional[int] = None, itemsize: int = 4,
                            start_up: Optional[float] = None) -> float:
        """t_c of one tensor of a known ``shape`` sent alone by ``spec``: as ``comm_seconds``, over
        the rounds of that shape (``CompressorInfo.shape_rounds``). Where the wire cost depends on
        the shape (PowerSGD: P has n*r values, Q m*r), the element count alone misjudges it."""
        spec = resolve(spec)
        model = self if world_size in (None, self.world_size) else self.for_world_size(world_size)
        rs = spec.info.shape_rounds(spec.params, tuple(shape), itemsize, model.world_size)
        return float(model._rounds_seconds(spec, rs, start_up, 0.0))

    @property
    def start_ups(self) -> Optional[Tuple[float, float]]:
        """(alone, queued) start-ups of a collective in a training step, where both were timed
        (module doc); None otherwise."""
        if self.alone_alpha is None or self.queued_alpha is None:
            return None
        return float(self.alone_alpha), float(self.queued_alpha)

    def exchange_seconds(self, spec, dense_bytes, world_size: Optional[int] = None, itemsize: int = 4,
                         density: Optional[float] = None):
        """The exchange time the planner uses for every group: ``comm_seconds``; the last group's
        exchange, which closes the step, also takes ``closing_seconds``."""
        return self.comm_seconds(spec, dense_bytes, world_size, itemsize, density)

    def closing_seconds(self, spec, dense_bytes, world_size: Optional[int] = None, itemsize: int = 4,
                        density: Optional[float] = None):
        """How late the *closing* exchange (the last group's, launched once backward is done) ends
        beyond its alpha-beta time: ``exchange_skew`` x (its compression and launch time + its
        transfer time). A collective completes only when the *slowest* rank has compressed its
        group and contributed; the ranks drift apart over a step, and the drift lands in the
        exchange that closes it, not in an alpha-beta fit timed with the ranks lined up by a
        barrier, nor (mostly) in the exchanges launched during backward, which the rest of
        backward hides. ``exchange_skew`` is 0 in a fitted model and is measured in training steps
        (``torch_ops.scheduling``, ``skew_factor``); ``hvdcompress.schedule.timeline`` (``t_close``)."""
        d = np.asarray(dense_bytes, dtype=float)
        if not self.exchange_skew:
            return np.zeros_like(d)
        t_c = self.comm_seconds(spec, d, world_size, itemsize, density)
        return self.exchange_skew * (t_c + self.group_cpu_seconds(spec, d, itemsize))

    def has_compress_fit(self, spec) -> bool:
        spec = resolve(spec)
        return spec.name == "none" or str(spec) in self.compress

    def compress_seconds(self, spec, dense_bytes, itemsize: int = 4):
        """t_s: seconds to compress tensors of ``dense_bytes`` (array ok); 0 for ``none``."""
        spec = resolve(spec)
        fit = self.compress.get(str(spec))
        if fit is None:
            if spec.name == "none":
                return np.zeros_like(np.asarray(dense_bytes, dtype=float))
            known = ", ".join(sorted(self.compress)) or "none"
            raise ValueError(f"cost model: no compression-time fit for '{spec}' (fitted: {known}); "
                             "profile it (torch_ops.profiling) or add a ComputeFit by hand")
        return fit(np.asarray(dense_bytes, dtype=float) / itemsize)

    def group_cpu_seconds(self, spec, dense_bytes, itemsize: int = 4):
        """What a group costs on the compute stream before its exchange: compression (t_s, if
        fitted; 0 otherwise) plus handing each of its collectives to Horovod."""
        spec = resolve(spec)
        d = np.asarray(dense_bytes, dtype=float)
        _, ops, _ = payload(spec, d / itemsize, itemsize, None)
        base = self.compress_seconds(spec, d, itemsize) if self.has_compress_fit(spec) else np.zeros_like(d)
        return base + ops * self.launch_seconds

    def has_decompress_fit(self, spec) -> bool:
        return str(resolve(spec)) in self.decompress

    def decompress_seconds(self, spec, dense_bytes, itemsize: int = 4):
        """t_d: seconds to turn a group's results back into gradients (0 without a fit)."""
        fit = self.decompress.get(str(resolve(spec)))
        d = np.asarray(dense_bytes, dtype=float)
        return fit(d / itemsize) if fit is not None else np.zeros_like(d)

    def scaled(self, compress: float = 1.0, decompress: float = 1.0) -> "CostModel":
        """This model with every compression fit and the launch cost times ``compress``, every
        decompression fit times ``decompress``: a calibration to what a training step measured."""
        def times(fits, k):
            return {name: ComputeFit(f.form, f.a * k, f.b * k, f.errors) for name, f in fits.items()}
        meta = dict(self.meta, calibration={"compress": compress, "decompress": decompress})
        return replace(self, compress=times(self.compress, compress), meta=meta,
                       decompress=times(self.decompress, decompress), launch_seconds=self.launch_seconds * compress)

    def with_skew(self, exchange_skew: float) -> "CostModel":
        """This model with ``exchange_skew`` set (see ``exchange_seconds``)."""
        meta = dict(self.meta, exchange_skew=float(exchange_skew))
        return replace(self, meta=meta, exchange_skew=float(exchange_skew))

    # -- other worlds --------------------------------------------------------------------------
    def for_world_size(self, world_size: int, gbit_per_s: Optional[float] = None,
                       latency_s: Optional[float] = None) -> "CostModel":
        """This model carried to ``world_size`` ranks by ring scaling (module doc).

        ``gbit_per_s``: another link bandwidth in place of the fitted one. ``latency_s``: the
        per-hop latency of the network; the part of the fitted start-up time it does not explain
        (Horovod's coordination, cycle time) is then kept as a fixed cost per collective. Without
        it, all of the fitted start-up time is taken as per-hop latency (a pessimistic carry)."""
        if self.world_size < 2:
            raise ValueError("cost model: a model fitted on 1 rank has no communication to scale")
        n0_lat, n0_bw = _ring_factors(self.world_size)
        lat, bw = _ring_factors(int(world_size))
        fits = []
        for fit, hops in ((self.allreduce, 2.0), (self.allgather, 1.0)):  # ring allreduce: 2 passes
            if latency_s is None:
                alpha = fit.alpha / n0_lat * lat
            else:
                alpha = max(0.0, fit.alpha - hops * n0_lat * latency_s) + hops * lat * latency_s
            beta = fit.beta / n0_bw * bw if gbit_per_s is None else hops * bw * 8.0 / (gbit_per_s * 1e9)
            fits.append(LinearFit(alpha, beta))
        half = None
        if self.allreduce_half is not None:  # the fp32 carry plus what the halves' sums add, per byte and rank
            extra_a = max(0.0, self.allreduce_half.alpha - self.allreduce.alpha) / n0_lat * lat
            extra_b = max(0.0, self.allreduce_half.beta - self.allreduce.beta) / n0_bw * bw
            half = LinearFit(fits[0].alpha + extra_a, fits[0].beta + extra_b)
        meta = dict(self.meta, scaled_from=self.world_size)
        return replace(self, world_size=int(world_size), allreduce=fits[0], allgather=fits[1], meta=meta,
                       allreduce_half=half, alone_alpha=self._per_hops(self.alone_alpha, n0_lat, lat, latency_s),
                       queued_alpha=self._per_hops(self.queued_alpha, n0_lat, lat, latency_s))

    @staticmethod
    def _per_hops(start_up: Optional[float], n0_lat: float, lat: float, latency_s: Optional[float]):
        """A start-up carried to another ring: per hop, as the fits' without a given latency."""
        if start_up is None or latency_s is not None:
            return start_up
        return start_up / n0_lat * lat

    @classmethod
    def from_link(cls, world_size: int, gbit_per_s: float, latency_s: float,
                  compress: Optional[Mapping[str, ComputeFit]] = None) -> "CostModel":
        """A hand-built model: ring collectives over links of ``gbit_per_s`` and ``latency_s``."""
        if not (gbit_per_s > 0 and latency_s >= 0):
            raise ValueError("cost model: gbit_per_s must be > 0 and latency_s >= 0")
        lat, bw = _ring_factors(int(world_size))
        beta = 8.0 / (gbit_per_s * 1e9)
        return cls(int(world_size), LinearFit(2 * lat * latency_s, 2 * bw * beta),
                   LinearFit(lat * latency_s, bw * beta), compress or {},
                   meta={"source": f"from_link({gbit_per_s} Gbit/s, {latency_s} s)"})

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": VERSION, "key": self.key, "world_size": self.world_size, "hosts": list(self.hosts),
                "allreduce": self.allreduce.to_dict(), "allgather": self.allgather.to_dict(),
                "compress": {k: v.to_dict() for k, v in self.compress.items()}, "meta": dict(self.meta),
                "decompress": {k: v.to_dict() for k, v in self.decompress.items()},
                "launch_seconds": self.launch_seconds, "exchange_skew": self.exchange_skew,
                "allreduce_half": self.allreduce_half.to_dict() if self.allreduce_half is not None else None,
                "alone_alpha": self.alone_alpha, "queued_alpha": self.queued_alpha}

    @classmethod
    def from_dict(cls, d: Mapping) -> "CostModel":
        if d.get("version") != VERSION:
            raise ValueError(f"cost model: expected version {VERSION}; got {d.get('version')!r}")
        return cls(int(d["world_size"]), LinearFit.from_dict(d["allreduce"]), LinearFit.from_dict(d["allgather"]),
                   {k: ComputeFit.from_dict(v) for k, v in d.get("compress", {}).items()},
                   tuple(d.get("hosts", ())), dict(d.get("meta", {})),
                   {k: ComputeFit.from_dict(v) for k, v in d.get("decompress", {}).items()},
                   float(d.get("launch_seconds", 0.0)), float(d.get("exchange_skew", 0.0)),
                   LinearFit.from_dict(d["allreduce_half"]) if d.get("allreduce_half") else None,
                   _opt_float(d.get("alone_alpha")), _opt_float(d.get("queued_alpha")))

    def save(self, path: Optional[str] = None) -> str:
        """Write JSON to ``path`` (default: ``cache_path`` of this world and host set); returns it."""
        path = path or cache_path(self.world_size, self.hosts)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # readers never see half a file
        return path

    @classmethod
    def load(cls, path: str) -> "CostModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def cached(cls, world_size: int, hosts: Iterable[str] = ()) -> Optional["CostModel"]:
        """The cached model of this world size and host set, or None."""
        path = cache_path(world_size, hosts)
        return cls.load(path) if os.path.exists(path) else None


def fit_cost_model(world_size: int, allreduce_samples, allgather_samples, compress_samples=None,
                   hosts: Iterable[str] = (), meta: Optional[Mapping] = None, decompress_samples=None,
                   launch_seconds: float = 0.0, allreduce_half_samples=None) -> CostModel:
    """Fit a model from timings: ``allreduce_samples`` (bytes per rank, seconds) pairs,
    ``allgather_samples`` likewise (bytes per rank; fitted on N * bytes), ``compress_samples`` and
    ``decompress_samples`` {spec: [(elements, seconds), ...]}; ``launch_seconds`` as measured;
    ``allreduce_half_samples``: (bytes per rank, seconds) of allreduces of 16-bit floats, if timed."""
    ar = np.asarray(list(allreduce_samples), dtype=float).reshape(-1, 2)
    ag = np.asarray(list(allgather_samples), dtype=float).reshape(-1, 2)

    def fits(samples_by_spec):
        out = {}
        for spec, samples in (samples_by_spec or {}).items():
            s = np.asarray(list(samples), dtype=float).reshape(-1, 2)
            out[str(resolve(spec))] = fit_compute(s[:, 0], s[:, 1])
        return out

    return CostModel(int(world_size), fit_transfer(ar[:, 0], ar[:, 1]),
                     fit_transfer(world_size * ag[:, 0], ag[:, 1]), fits(compress_samples), tuple(hosts),
                     dict(meta or {}), fits(decompress_samples), float(launch_seconds),
                     allreduce_half=fit_half(allreduce_half_samples))


def fit_half(samples) -> Optional[LinearFit]:
    """The fit of allreduces of 16-bit floats from (bytes per rank, seconds) samples; None without any."""
    if samples is None or len(list(samples)) == 0:
        return None
    s = np.asarray(list(samples), dtype=float).reshape(-1, 2)
    return fit_transfer(s[:, 0], s[:, 1])


def sums_half(spec) -> bool:
    """Whether an exchange of ``spec`` allreduces 16-bit floats (a ``Round`` with ``half``): then
    the cost model wants ``allreduce_half`` timed."""
    return any(getattr(r, "half", False) for r in rounds(spec, np.array([1024.0])))


def skew_factor(measured_seconds: float, transfer_seconds: float, cpu_seconds: float,
                limit: float = 20.0) -> float:
    """``exchange_skew`` from one measured exchange: how much longer than modelled (``transfer``,
    the alpha-beta time) it took from its launch to its completion, over the work it stands for
    (its compression and launch on the compute stream, ``cpu``, plus ``transfer``); 0 when it
    took no longer, at most ``limit``."""
    vals = (measured_seconds, transfer_seconds, cpu_seconds)
    if not all(math.isfinite(v) and v >= 0 for v in vals):
        raise ValueError(f"skew_factor: times must be finite and >= 0; got {vals}")
    work = transfer_seconds + cpu_seconds
    if work <= 0:
        return 0.0
    return float(min(limit, max(0.0, (measured_seconds - transfer_seconds) / work)))


def _opt_float(v) -> Optional[float]:
    return None if v is None else float(v)


def describe(model: CostModel) -> str:
    """A few lines a person can read: the fits and their errors."""
    lines = [f"cost model {model.key} (world size {model.world_size})"]
    named = [("allreduce", model.allreduce), ("allgather", model.allgather)]
    if model.allreduce_half is not None:
        named.append(("allreduce fp16", model.allreduce_half))
    for name, fit in named:
        per = "byte gathered" if name == "allgather" else "byte per rank"
        bw = 8 / fit.beta / 1e9 if fit.beta > 0 else math.inf
        lines.append(f"  {name}: {fit.alpha * 1e6:.1f} us + {fit.beta * 1e9:.4f} ns/{per} "
                     f"(effective {bw:.2f} Gbit/s), rel. RMS error {fit.rel_rmse:.1%} over {fit.samples} samples")
    for what, table in (("compress", model.compress), ("decompress", model.decompress)):
        for spec, fit in table.items():
            alt = ", ".join(f"{f} {e:.1%}" for f, e in fit.errors.items())
            lines.append(f"  {what} {spec}: {fit.a:.3g}*{'d*log2(d)' if fit.form == 'dlogd' else 'd'} + "
                         f"{fit.b * 1e6:.1f} us (rel. RMS error: {alt})")
    if model.start_ups is not None:
        lines.append(f"  start-up in a step: {model.alone_alpha * 1e6:.1f} us alone in its cycle, "
                     f"{model.queued_alpha * 1e6:.1f} us queued with others (predictions)")
    if model.launch_seconds:
        lines.append(f"  launch: {model.launch_seconds * 1e6:.1f} us per collective handed to Horovod")
    if model.exchange_skew:
        lines.append(f"  exchange skew: the exchange closing a step ends {model.exchange_skew:.3g} x "
                     "(compression + transfer) later than the fits say (measured in training steps)")
    return "\n".join(lines)
