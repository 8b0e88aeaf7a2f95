"""The algorithm registry: every compression algorithm is declared here once, by name.

``register(name, exchange, doc, *params, wire=, merge=, ...)`` is called by the algorithm's oracle
module (a module of ``hvdcompress/reference``, imported by discovery, so an algorithm is added by
adding its module); ``Param`` validates one parameter (type, default, range), ``Round`` is one
round of its wire cost. Specs (``hvdcompress.spec``) are made from these entries; backends look
their implementations up by the same name.

The registry imports none of the modules that declare: the package (``hvdcompress/__init__``)
imports ``hvdcompress.reference`` once, so every built-in is declared before any name is looked up
and the arrows run one way (reference -> spec -> registry).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from .contract import ELEMENTWISE, LAYERWISE, MERGE_POLICIES, PER_MEMBER

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




@dataclass(frozen=True)
class Round:
    """One round of an exchange as the cost model sees it: the collective kind, how many
    collectives of that kind, and the bytes this rank contributes (an array over tensor sizes).
    ``half``: the summed values are 16-bit floats, which the transport adds on the CPU at a rate
    of its own (Gloo converts every element to float and back), so the cost model times such an
    allreduce separately (``CostModel.allreduce_half``)."""

    kind: str  # SUMMED or GATHERED
    collectives: int
    nbytes: Any
    half: bool = False


# wire(params, d, itemsize, world, density) -> rounds; d is an array of element counts, density
# the measured fraction sent (None: the spec's own value). Vectorised over d.
WireRule = Callable[[Mapping[str, Any], Any, int, int, Optional[float]], Tuple[Round, ...]]
# shaped_wire(params, shape, itemsize) -> rounds of one tensor of that shape (scalars), for
# algorithms whose wire cost depends on the shape, not only on the element count.
ShapedWireRule = Callable[[Mapping[str, Any], Tuple[int, ...], int], Tuple[Round, ...]]


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
    horovod_codec    True: it also runs inside Horovod's own optimizers (``compression=`` there:
              one summed payload, no state); each backend's class gives the codec
              (``horovod_codec``), see ``hvdcompress.horovod_interop``
    horovod_refusal  why it cannot run there, when more than its exchange kind says
    same_shape  its gathered payloads' shapes depend only on the tensor's size, never on its
              values, so every rank gathers the same shapes (``Allgather(same_shape=True)``,
              which two ranks send as a sum; the cost model prices such a round as an allreduce
              of its bytes at two ranks)
    shaped_wire      the wire cost of one tensor of a known shape (``ShapedWireRule``); None:
              ``wire`` of its element count
    """

    name: str
    exchange: str
    params: Tuple[Param, ...]
    doc: str
    check: Optional[Callable[[Dict[str, Any]], None]] = None
    wire: Optional[WireRule] = None
    merge: str = ELEMENTWISE
    horovod_codec: bool = False
    horovod_refusal: str = ""
    same_shape: bool = False
    shaped_wire: Optional[ShapedWireRule] = None

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

    def shape_rounds(self, params: Mapping[str, Any], shape: Tuple[int, ...], itemsize: int = 4, world: int = 1,
                     density: Optional[float] = None) -> Tuple[Round, ...]:
        """The wire cost per round of one tensor of ``shape`` (``shaped_wire``, else ``rounds`` of
        its element count)."""
        if self.shaped_wire is not None:
            return tuple(self.shaped_wire(params, tuple(int(x) for x in shape), itemsize))
        numel = 1
        for x in shape:
            numel *= int(x)
        return self.rounds(params, numel, itemsize, world, density)


REGISTRY: Dict[str, CompressorInfo] = {}


def register(name: str, exchange: str, doc: str, *params: Param,
             check: Optional[Callable[[Dict[str, Any]], None]] = None, wire: Optional[WireRule] = None,
             merge: str = ELEMENTWISE, horovod_codec: bool = False, horovod_refusal: str = "",
             same_shape: bool = False, shaped_wire: Optional[ShapedWireRule] = None) -> CompressorInfo:
    """Declare an algorithm: spec name, parameters, wire cost, merge policy, whether it runs inside
    Horovod's own optimizers. Called once, when its oracle module (a module of
    ``hvdcompress/reference``) is imported; a backend implements it by subclassing its
    ``Compressor`` with ``name = "<name>"`` (see docs/design.md)."""
    if exchange not in (SUMMED, GATHERED):
        raise ValueError(f"register {name!r}: exchange must be {SUMMED!r} or {GATHERED!r}; got {exchange!r}")
    if merge not in MERGE_POLICIES:
        raise ValueError(f"register {name!r}: merge must be one of {MERGE_POLICIES}; got {merge!r}")
    info = REGISTRY[name] = CompressorInfo(name, exchange, tuple(params), doc, check, wire, merge,
                                           horovod_codec, horovod_refusal, same_shape, shaped_wire)
    return info


def residual_param(default: bool) -> Param:
    return Param("residual", bool, default,
                 "error feedback: keep what was not sent and add it to the next step's gradient")


RATIO_RANGE = dict(low=0.0, high=1.0, low_open=True)


def registered() -> Dict[str, CompressorInfo]:
    """Every declared algorithm, by name."""
    return dict(REGISTRY)


def names_with_param(param: str) -> Tuple[str, ...]:
    """The algorithms that take parameter ``param`` (e.g. "ratio": the ones with a density)."""
    return tuple(sorted(n for n, info in registered().items() if any(p.name == param for p in info.params)))


def info_for(name: str) -> CompressorInfo:
    if not isinstance(name, str) or name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"compression: unknown compressor {name!r}; known compressors: {known}")
    return REGISTRY[name]


def describe(name: str) -> str:
    """An algorithm's one-line doc and its parameters with their ranges and defaults."""
    info = info_for(name)
    return info.doc + "".join(f"\n  {p.name} ({p.range_text()}, default {p.default!r}): {p.doc}"
                              for p in info.params)


def build_from(table: Mapping[str, Callable[[Any], Any]], spec, backend: str,
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
