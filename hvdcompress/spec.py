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
    choices: Tuple[str, ...] = ()  # kind str: the accepted values

    def range_text(self) -> str:
        if self.kind is bool:
            return "true or false"
        if self.kind is tuple:
            return "floats in (0, 1] separated by '/' (empty for the default)"
        if self.choices:
            return "one of " + ", ".join(self.choices)
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
        if self.choices:
            if not isinstance(value, str) or value.lower() not in self.choices:
                raise ValueError(f"{where} must be {self.range_text()}; got {value!r}")
            return value.lower()
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


# How a compressor's tensors may be merged into one exchange (``schedule=``):
ELEMENTWISE = "elementwise"  # every state tensor has one entry per element; merging tensors does
#                              not change their results (a flat buffer is exchanged)
PER_MEMBER = "per-member"    # merged groups are fine: the compressor applies its per-tensor rules
#                              to each member of the group (``ExchangeContext.members``)
LAYERWISE = "layerwise"      # one exchange per tensor only (state shaped by the tensor, e.g.
#                              low-rank factors): "auto" resolves to "layerwise"
MERGE_POLICIES = (ELEMENTWISE, PER_MEMBER, LAYERWISE)


@dataclass(frozen=True)
class Round:
    """One round of an exchange as the cost model sees it: the collective kind, how many
    collectives of that kind, and the bytes this rank contributes (an array over tensor sizes)."""

    kind: str  # SUMMED or GATHERED
    collectives: int
    nbytes: Any


# wire(params, d, itemsize, world, density) -> rounds; d is an array of element counts, density
# the measured fraction sent (None: the spec's own value). Vectorised over d.
WireRule = Callable[[Mapping[str, Any], Any, int, int, Optional[float]], Tuple[Round, ...]]


@dataclass(frozen=True)
class CompressorInfo:
    """Registry entry: one algorithm, declared once (``register``) in its oracle module.

    name      spec name (``"topk"``); the factory ``Compression.<name>`` is generated from it
    exchange  SUMMED or GATHERED: how its first round travels
    params    validated parameters (``Param``)
    doc       what it does, one sentence (the factory's docstring starts with it)
    check     cross-parameter validation; may fill derived values (ValueError names the parameter)
    wire      per-round wire cost for the cost model and planner (``WireRule``); None: one round
              of ``exchange`` carrying the dense tensor
    merge     ELEMENTWISE, PER_MEMBER or LAYERWISE (see above)
    """

    name: str
    exchange: str
    params: Tuple[Param, ...]
    doc: str
    check: Optional[Callable[[Dict[str, Any]], None]] = None
    wire: Optional[WireRule] = None
    merge: str = ELEMENTWISE

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        accepted = ", ".join(p.name for p in self.params) or "none"
        raise ValueError(f"{self.name}: unknown parameter '{name}'; accepted parameters: {accepted}")

    def rounds(self, params: Mapping[str, Any], d, itemsize: int = 4, world: int = 1,
               density: Optional[float] = None) -> Tuple[Round, ...]:
        """The wire cost per round for tensors of ``d`` elements (array ok)."""
        import numpy as np

        d = np.asarray(d, dtype=float)
        if self.wire is None:
            return (Round(self.exchange, 1, d * itemsize),)
        return tuple(self.wire(params, d, itemsize, world, density))


REGISTRY: Dict[str, CompressorInfo] = {}


def register(name: str, exchange: str, doc: str, *params: Param,
             check: Optional[Callable[[Dict[str, Any]], None]] = None, wire: Optional[WireRule] = None,
             merge: str = ELEMENTWISE) -> CompressorInfo:
    """Declare an algorithm: spec name, parameters, wire cost, merge policy. Called once, when
    its oracle module (``hvdcompress.reference.<module>``) is imported; a backend implements it by
    subclassing its ``Compressor`` with ``name = "<name>"`` (see docs/design.md)."""
    if exchange not in (SUMMED, GATHERED):
        raise ValueError(f"register {name!r}: exchange must be {SUMMED!r} or {GATHERED!r}; got {exchange!r}")
    if merge not in MERGE_POLICIES:
        raise ValueError(f"register {name!r}: merge must be one of {MERGE_POLICIES}; got {merge!r}")
    info = REGISTRY[name] = CompressorInfo(name, exchange, tuple(params), doc, check, wire, merge)
    return info


def residual_param(default: bool) -> Param:
    return Param("residual", bool, default,
                 "error feedback: keep what was not sent and add it to the next step's gradient")


RATIO_RANGE = dict(low=0.0, high=1.0, low_open=True)


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

    def __call__(self, **params: Any) -> "CompressionSpec":
        """This spec with ``params`` changed: ``Compression.topk(ratio=0.01)``. Uncalled and
        called without arguments are the same spec (``Compression.fp16`` as in Horovod)."""
        return CompressionSpec(self.name, {**self.params, **params}) if params else self

    def __hash__(self) -> int:  # Horovod's TF optimizers cache functions keyed by `compression`
        return hash((self.name, tuple(sorted(self.params.items()))))

    # Horovod's Compression protocol, so a spec also works in hvd.DistributedOptimizer(opt,
    # compression=spec): only none, fp16 and bf16 fit it (``hvdcompress.horovod_interop``).
    def compress(self, tensor: Any) -> Tuple[Any, Any]:
        """Horovod's ``compress(tensor) -> (payload, ctx)`` (torch or TF tensor); ValueError for a
        spec that cannot run inside Horovod's own optimizer, saying why."""
        from .horovod_interop import compress

        return compress(self, tensor)

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Horovod's ``decompress(summed payload, ctx) -> tensor``."""
        from .horovod_interop import decompress

        return decompress(self, tensor, ctx)


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):
        return "/".join(repr(x) for x in v)
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    return repr(v) if isinstance(v, float) else str(v)


def _load_builtins() -> None:
    """Import the built-in algorithms' oracle modules, which register them (idempotent)."""
    from . import reference  # noqa: F401  (each algorithm module calls ``register``)


def info_for(name: str) -> CompressorInfo:
    if not isinstance(name, str) or name not in REGISTRY:
        _load_builtins()
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


class _Factories(type):
    """``Compression.<name>`` for every registered algorithm, made from the registry."""

    def __getattr__(cls, name: str) -> "CompressionSpec":
        if name.startswith("_"):
            raise AttributeError(name)
        _load_builtins()
        if name not in REGISTRY:
            raise AttributeError(f"Compression has no compressor {name!r}; known: {', '.join(sorted(REGISTRY))}")
        return CompressionSpec(name)

    def __dir__(cls):
        _load_builtins()
        return sorted(set(super().__dir__()) | set(REGISTRY))


class Compression(metaclass=_Factories):
    """Factories for every registered compressor, mirroring ``horovod.torch.Compression``.

    ``Compression.<name>`` is the spec with its defaults, and calling it sets parameters:
    ``Compression.topk(ratio=0.01)``. Uncalled values work too (``Compression.fp16``), as in
    Horovod. ``describe(name)`` lists an algorithm's parameters and ranges.
    """


def describe(name: str) -> str:
    """An algorithm's one-line doc and its parameters with their ranges and defaults."""
    info = info_for(name)
    return info.doc + "".join(f"\n  {p.name} ({p.range_text()}, default {p.default!r}): {p.doc}"
                              for p in info.params)


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


def build_from(table: Mapping[str, Callable[[CompressionSpec], Any]], spec: CompressionSpec, backend: str,
               make: bool = True):
    """A backend's compressor for ``spec`` from its name table (or its class, ``make=False``);
    ValueError if it has none."""
    try:
        cls = table[spec.name]
    except KeyError:
        raise ValueError(f"compression: {spec.name!r} has no {backend} implementation; "
                         f"available: {', '.join(sorted(table))}") from None
    return cls(spec) if make else cls


def num_selected(ratio: float, numel: int) -> int:
    """k = ceil(ratio * numel), the number of entries a ratio-based sparsifier sends.

    At least one entry of a non-empty tensor is sent. The product is taken with a relative slack
    of 1e-9 so that float noise (0.07 * 100 = 7.000000000000001) does not add an entry.
    """
    if numel <= 0:
        return 0
    x = ratio * numel
    return max(1, min(numel, int(math.ceil(x - 1e-9 * x))))
