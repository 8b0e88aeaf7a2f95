"""Compression specs: the framework-agnostic description of *what* to do to the gradients.

A spec is a name plus validated parameters, e.g. ``CompressionSpec("topk", {"ratio": 0.01,
"residual": True})``. It is written three ways, all equivalent::

    Compression.topk(ratio=0.01)          # factory (mirrors ``horovod.torch.Compression``)
    parse_spec("topk:ratio=0.01")         # string, as given on a command line
    CompressionSpec.from_dict({...})      # saved with a checkpoint

Specs know nothing about torch or TensorFlow: each backend keeps a table from spec name to its
own compressor class. Validation happens here, at construction, so bad input raises a
``ValueError`` naming the parameter and its accepted range on every rank before any collective
starts (every rank runs the same code on the same arguments).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

SUMMED = "allreduce"
GATHERED = "allgather"


@dataclass(frozen=True)
class Param:
    """One parameter of a compressor: its type, default and accepted range."""

    name: str
    kind: type
    default: Any
    doc: str
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False  # True: the range excludes ``low``
    high_open: bool = False
    optional: bool = False  # None (written "none") is accepted and means "off"

    def range_text(self) -> str:
        if self.kind is bool:
            return "true or false"
        if self.kind is tuple:
            return "floats in (0, 1] separated by '/' (empty for the default)"
        if self.optional:
            return self._numeric_range() + " or none"
        return self._numeric_range()

    def _numeric_range(self) -> str:
        lo = "-inf" if self.low is None else repr(self.low)
        hi = "inf" if self.high is None else repr(self.high)
        left = "(" if (self.low is None or self.low_open) else "["
        right = ")" if (self.high is None or self.high_open) else "]"
        return f"{self.kind.__name__} in {left}{lo}, {hi}{right}"

    def check(self, spec_name: str, value: Any) -> Any:
        where = f"{spec_name}: parameter '{self.name}'"
        if self.optional and (value is None or (isinstance(value, str) and value.lower() == "none")):
            return None
        value = _coerce(where, self.kind, value, self.range_text())
        if self.kind in (int, float):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{where} must be finite, {self.range_text()}; got {value!r}")
            too_low = self.low is not None and (value < self.low or (self.low_open and value == self.low))
            too_high = self.high is not None and (value > self.high or (self.high_open and value == self.high))
            if too_low or too_high:
                raise ValueError(f"{where} must be {self.range_text()}; got {value!r}")
        return value


def _coerce(where: str, kind: type, value: Any, accepted: str) -> Any:
    if kind is tuple:  # a list of floats: "0.25/0.0625" or a sequence
        items = [s for s in value.split("/") if s.strip()] if isinstance(value, str) else value
        try:
            return tuple(_coerce(where, float, v, accepted) for v in items)
        except TypeError:
            raise ValueError(f"{where} must be {accepted}; got {value!r}") from None
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{where} must be {accepted}; got {value!r}")
    if isinstance(value, bool):
        raise ValueError(f"{where} must be {accepted}; got the bool {value!r}")
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be {accepted}; got {value!r}") from None


@dataclass(frozen=True)
class CompressorInfo:
    """Registry entry: what a compressor is called, what it takes, how its payload travels."""

    name: str
    exchange: str  # SUMMED or GATHERED (the first round, for multi-round compressors)
    params: Tuple[Param, ...]
    doc: str
    check: Optional[Callable[[Dict[str, Any]], None]] = None  # cross-parameter validation

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        accepted = ", ".join(p.name for p in self.params) or "none"
        raise ValueError(f"{self.name}: unknown parameter '{name}'; accepted parameters: {accepted}")


REGISTRY: Dict[str, CompressorInfo] = {}


def register(name: str, exchange: str, doc: str, *params: Param,
             check: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
    REGISTRY[name] = CompressorInfo(name, exchange, tuple(params), doc, check)


def _residual(default: bool) -> Param:
    return Param("residual", bool, default,
                 "error feedback: keep what was not sent and add it to the next step's gradient")


_RATIO = dict(low=0.0, high=1.0, low_open=True)

register("none", SUMMED, "dense allreduce, no compression (what Horovod does by default)")
register("fp16", SUMMED, "cast to IEEE half precision, allreduce in fp16, cast back",
         _residual(False))
register("bf16", GATHERED, "round to bfloat16 (nearest even), allgather the 16-bit codes, sum in fp32",
         _residual(False))
register("topk", GATHERED, "send the k = ceil(ratio * numel) largest-magnitude entries "
         "(ties to the lower index) as (indices, values)",
         Param("ratio", float, 0.01, "fraction of entries sent", **_RATIO), _residual(True))
register("randomk", SUMMED, "send k = ceil(ratio * numel) entries at indices drawn from a seed shared "
         "by all ranks, so the values can be allreduced",
         Param("ratio", float, 0.01, "fraction of entries sent", **_RATIO),
         Param("seed", int, 0, "seed shared by all ranks", low=0, high=2**63 - 1),
         _residual(True))
register("threshold", GATHERED, "send every entry with |x| >= threshold as (indices, values)",
         Param("threshold", float, 1e-3, "magnitude threshold", low=0.0, low_open=True),
         _residual(True))



def _check_dgc(p: Dict[str, Any]) -> None:
    from .warmup import warmup_densities

    if p["warmup_schedule"]:  # an explicit schedule sets the warm-up length
        p["warmup_epochs"] = len(p["warmup_schedule"])
    try:
        warmup_densities(p["ratio"], p["warmup_epochs"], p["warmup_schedule"])
    except ValueError as e:
        raise ValueError(f"dgc: {e}".replace("warm-up: ", "")) from None


register("dgc", GATHERED, "Deep Gradient Compression (Lin et al., ICLR 2018): top-k by a sampled "
         "threshold on the accumulated velocity, with momentum correction, local gradient clipping, "
         "momentum factor masking and sparsity warm-up; small and 1-D tensors are sent dense",
         Param("ratio", float, 0.001, "target density (fraction of entries sent)", **_RATIO),
         Param("momentum", float, 0.9, "momentum, applied in the compressor memory", low=0.0, high=1.0,
               high_open=True),
         Param("nesterov", bool, False, "Nesterov momentum"),
         Param("momentum_correction", bool, True, "accumulate velocity (u = m*u + g; v += u) instead of "
               "gradients; off: accumulate gradients, apply momentum to the exchanged average"),
         Param("clip_norm", float, None, "local clipping: each tensor's gradient norm is clipped to "
               "clip_norm / sqrt(world size) before accumulation", low=0.0, low_open=True, optional=True),
         Param("momentum_masking", bool, True, "zero the momentum u where an entry was sent"),
         Param("warmup_epochs", int, 4, "epochs of exponentially falling density", low=0),
         Param("warmup_schedule", tuple, (), "explicit warm-up densities, one per epoch, decreasing "
               "(sets warmup_epochs to its length); empty: exponential from 1 to ratio"),
         Param("sample_ratio", float, 0.01, "fraction of |v| sampled to estimate the threshold", **_RATIO),
         Param("adapt_iters", int, 4, "times the threshold may be lowered (x0.8) when fewer than 0.8k "
               "entries pass it", low=0, high=32),
         Param("min_sparse_numel", int, 1024, "tensors with fewer elements (and 1-D tensors) are sent "
               "dense", low=1),
         Param("fp16_values", bool, False, "send the selected values as fp16"),
         Param("seed", int, 0, "seed of the sampling offset, shared by all ranks", low=0, high=2**63 - 1),
         check=_check_dgc)


@dataclass(frozen=True)
class CompressionSpec:
    """A validated compressor name and its full parameter set (defaults filled in)."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        info = info_for(self.name)
        given = dict(self.params)
        full = {}
        for p in info.params:
            full[p.name] = p.check(self.name, given.pop(p.name, p.default))
        if given:
            info.param(next(iter(given)))  # raises: unknown parameter, with the accepted list
        if info.check is not None:
            info.check(full)
        object.__setattr__(self, "params", full)

    @property
    def info(self) -> CompressorInfo:
        return REGISTRY[self.name]

    @property
    def exchange(self) -> str:
        return self.info.exchange

    def __getitem__(self, key: str) -> Any:
        return self.params[key]

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CompressionSpec":
        return cls(d["name"], d.get("params", {}))

    def __str__(self) -> str:
        if not self.params:
            return self.name
        args = ",".join(f"{k}={_fmt(v)}" for k, v in self.params.items())
        return f"{self.name}:{args}"

    def __call__(self) -> "CompressionSpec":
        # ``Compression.fp16`` and ``Compression.fp16()`` both work, as in Horovod.
        return self


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):
        return "/".join(repr(x) for x in v)
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    return repr(v) if isinstance(v, float) else str(v)


def info_for(name: str) -> CompressorInfo:
    if not isinstance(name, str) or name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"compression: unknown compressor {name!r}; known compressors: {known}")
    return REGISTRY[name]


def parse_spec(text: str) -> CompressionSpec:
    """Parse ``"name"`` or ``"name:key=value,key=value"`` into a validated spec."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"compression: expected a spec string like 'topk:ratio=0.01'; got {text!r}")
    name, _, rest = text.strip().partition(":")
    params = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"compression: malformed parameter {item!r} in {text!r}; "
                             "expected key=value")
        params[key.strip()] = value.strip()
    return CompressionSpec(name.strip(), params)


def _factory(name: str) -> Callable[..., CompressionSpec]:
    info = REGISTRY[name]

    def make(**params: Any) -> CompressionSpec:
        return CompressionSpec(name, params)

    make.__name__ = name
    make.__doc__ = info.doc + "".join(
        f"\n\n{p.name} ({p.range_text()}, default {p.default!r}): {p.doc}" for p in info.params)
    return make


class Compression:
    """Factories for every compressor, mirroring ``horovod.torch.Compression``.

    ``Compression.none`` and ``Compression.fp16`` may be passed uncalled, as in Horovod.
    """

    none = CompressionSpec("none")
    fp16 = CompressionSpec("fp16")
    bf16 = staticmethod(_factory("bf16"))
    topk = staticmethod(_factory("topk"))
    randomk = staticmethod(_factory("randomk"))
    threshold = staticmethod(_factory("threshold"))
    dgc = staticmethod(_factory("dgc"))


_HOROVOD_NAMES = {"NoneCompressor": "none", "FP16Compressor": "fp16"}


def resolve(compression: Any) -> CompressionSpec:
    """Turn anything a user may pass as ``compression=`` into a spec, or raise ValueError."""
    if compression is None:
        return Compression.none
    if isinstance(compression, CompressionSpec):
        return compression
    if isinstance(compression, str):
        return parse_spec(compression)
    horovod_name = getattr(compression, "__name__", None) or type(compression).__name__
    if horovod_name in _HOROVOD_NAMES:  # horovod.torch.Compression.none / .fp16
        return CompressionSpec(_HOROVOD_NAMES[horovod_name])
    if callable(compression):
        made = compression()
        if isinstance(made, CompressionSpec):
            return made
    raise ValueError("compression: expected a spec string, an hvdcompress Compression.<name>(...) "
                     f"or Horovod's Compression.none/fp16; got {compression!r}")


def build_from(table: Mapping[str, Callable[[CompressionSpec], Any]], spec: CompressionSpec, backend: str):
    """A backend's compressor for ``spec`` from its name table; ValueError if it has none."""
    try:
        cls = table[spec.name]
    except KeyError:
        raise ValueError(f"compression: {spec.name!r} has no {backend} implementation; "
                         f"available: {', '.join(sorted(table))}") from None
    return cls(spec)


def dgc_density(spec: CompressionSpec, epoch: int) -> float:
    """DGC's density during ``epoch``: its warm-up schedule, then the target ratio."""
    from .warmup import density_at

    p = spec.params
    return density_at(epoch, p["ratio"], p["warmup_epochs"], p["warmup_schedule"])


def dgc_sends_dense(spec: CompressionSpec, shape: Tuple[int, ...]) -> bool:
    """DGC exchanges 1-D tensors and tensors under ``min_sparse_numel`` elements dense."""
    return len(shape) <= 1 or math.prod(shape) < spec["min_sparse_numel"]


def num_selected(ratio: float, numel: int) -> int:
    """k = ceil(ratio * numel), the number of entries a ratio-based sparsifier sends.

    At least one entry of a non-empty tensor is sent. The product is taken with a relative slack
    of 1e-9 so that float noise (0.07 * 100 = 7.000000000000001) does not add an entry.
    """
    if numel <= 0:
        return 0
    x = ratio * numel
    return max(1, min(numel, int(math.ceil(x - 1e-9 * x))))
