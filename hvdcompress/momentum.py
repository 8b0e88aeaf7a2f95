"""Taking an optimizer's momentum over (DGC, the count sketch): one rule for both backends.

Compressors with momentum correction keep the momentum in their memory (``u = m*u + g``), so the
wrapped optimizer must run without its own or momentum would be applied twice. The optimizer's
momentum (and Nesterov flag) then replaces the spec's, with a warning when they differ; the
backend sets the optimizer's momentum to 0. What cannot be honoured raises ValueError: parameter
groups with different momenta (one memory, one momentum), or Nesterov for a compressor without it.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Tuple

from .spec import CompressionSpec


def take_over_momentum(spec: CompressionSpec, momenta: Iterable[Tuple[float, bool]]) -> CompressionSpec:
    """The spec with the optimizer's momentum, from its (momentum, nesterov) per parameter group;
    ``spec`` itself when no group has momentum. Nesterov is kept when the spec has a ``nesterov``
    parameter, refused otherwise."""
    name = spec.name
    momenta = {(float(m), bool(n)) for m, n in momenta}
    nonzero = {mn for mn in momenta if mn[0] > 0.0}
    if not nonzero:
        return spec
    if len(momenta) > 1:
        raise ValueError(f"compression '{name}': the optimizer's parameter groups use different momenta "
                         f"{sorted(momenta)}; {name} applies one momentum in its memory. Give every group the "
                         f"same momentum, or momentum=0 and set it in the spec ({name}:momentum=...)")
    (m, nesterov), = nonzero
    has_nesterov = "nesterov" in spec.params
    if nesterov and not has_nesterov:
        raise ValueError(f"compression '{name}': Nesterov momentum is not supported; use nesterov=False")
    said = (spec["momentum"], spec["nesterov"]) if has_nesterov else (spec["momentum"], False)
    if (m, nesterov) != said:
        warnings.warn(f"compression '{name}': taking over the optimizer's momentum={m}, nesterov={nesterov} "
                      f"(the spec said momentum={said[0]}, nesterov={said[1]}); the optimizer itself now runs "
                      "with momentum=0")
    params = dict(spec.params, momentum=m)
    if has_nesterov:
        params["nesterov"] = nesterov
    return CompressionSpec(name, params)
