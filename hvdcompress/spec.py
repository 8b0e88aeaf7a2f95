"""Compression specs: the framework-agnostic description of *what* to do to the gradients.

A spec is a name plus validated parameters, e.g. ``CompressionSpec("topk", {"ratio": 0.01,
"residual": True})``. It is written three ways, all equivalent::

    Compression.topk(ratio=0.01)          # factory (mirrors ``horovod.torch.Compression``)
    parse_spec("topk:ratio=0.01")         # string, as given on a command line
    CompressionSpec.from_dict({...})      # saved with a checkpoint

Specs know nothing about torch or TensorFlow: the algorithms are declared in the registry
(``hvdcompress.registry``), and each backend looks its own implementation up by the spec's name. Validation happens here, at construction, so bad input raises a
``ValueError`` naming the parameter and its accepted range on every rank before any collective
starts (every rank runs the same code on the same arguments).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Tuple

from .contract import ELEMENTWISE, LAYERWISE, MERGE_POLICIES, PER_MEMBER  # noqa: F401  (register's merge rules)
from .registry import (GATHERED, RATIO_RANGE, REGISTRY, SUMMED, CompressorInfo, Param, Round,  # noqa: F401
                       WireRule, build_from, describe, info_for, names_with_param, num_selected, register,
                       registered, residual_param)


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
        args = ",".join(f"{k}={format_value(v)}" for k, v in self.params.items())
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


def format_value(v: Any) -> str:
    """A parameter's value as a spec string writes it (``0.01``, ``true``, ``none``, ``0.25/0.0625``)."""
    if isinstance(v, tuple):
        return "/".join(repr(x) for x in v)
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    return repr(v) if isinstance(v, float) else str(v)


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
        if name not in REGISTRY:
            raise AttributeError(f"Compression has no compressor {name!r}; known: {', '.join(sorted(REGISTRY))}")
        return CompressionSpec(name)

    def __dir__(cls):
        return sorted(set(super().__dir__()) | set(REGISTRY))


class Compression(metaclass=_Factories):
    """Factories for every registered compressor, mirroring ``horovod.torch.Compression``.

    ``Compression.<name>`` is the spec with its defaults, and calling it sets parameters:
    ``Compression.topk(ratio=0.01)``. Uncalled values work too (``Compression.fp16``), as in
    Horovod. ``describe(name)`` lists an algorithm's parameters and ranges.
    """


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


