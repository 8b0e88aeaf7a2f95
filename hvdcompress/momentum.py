"""Taking an optimizer's momentum over (DGC, the count sketch, efsignsgd and onebit): one rule for
both backends.

Compressors with momentum correction keep the momentum in their memory (``u = m*u + g``), so the
wrapped optimizer must run without its own or momentum would be applied twice. The optimizer's
momentum (and Nesterov flag) then replaces the spec's, with a warning when they differ; the
backend sets the optimizer's momentum to 0. What cannot be honoured raises ValueError: parameter
groups with different momenta (one memory, one momentum), or Nesterov for a compressor without it.

Weight decay is taken over with the momentum (PyTorch SGD's coupled ``weight_decay``): it keeps its
own momentum outside the exchange, identical on every rank, and its term is added to the exchanged
result (``hvdcompress.reference.dgc.weight_decay_step`` states the math and why this placement).
``check_sgd_groups`` refuses the SGD settings that cannot be honoured once the momentum lives in
the compressor: ``dampening`` != 0 (the memory computes ``u = m*u + g``, undampened) and
``maximize=True`` with weight decay (the optimizer would negate the decay term it is handed).
Keras's ``weight_decay`` is decoupled (applied to the variables, never through the momentum, in
dense training too), so it needs no taking over: the Keras optimizer keeps applying it.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Tuple

from .spec import CompressionSpec


def momentum_of(spec: CompressionSpec) -> float:
    """The spec's momentum as a float; a ``momentum`` of None ("the optimizer's", efsignsgd and
    onebit) that nothing was taken over into is 0."""
    return float(spec.params.get("momentum") or 0.0)


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
    if spec["momentum"] is not None and (m, nesterov) != said:  # None: "the optimizer's", nothing to warn
        warnings.warn(f"compression '{name}': taking over the optimizer's momentum={m}, nesterov={nesterov} "
                      f"(the spec said momentum={said[0]}, nesterov={said[1]}); the optimizer itself now runs "
                      "with momentum=0")
    params = dict(spec.params, momentum=m)
    if has_nesterov:
        params["nesterov"] = nesterov
    return CompressionSpec(name, params)


def check_sgd_groups(spec: CompressionSpec, groups: Iterable[Mapping[str, Any]]) -> None:
    """ValueError for what the wrapped optimizer's parameter groups (PyTorch SGD's keys; a group
    with ``dampening`` is SGD's) ask and a compressor keeping the momentum cannot honour (the
    module doc); call on every rank, before any collective."""
    name = spec.name
    for i, g in enumerate(groups):
        damp = g.get("dampening", 0.0)
        if g.get("momentum", 0.0) > 0.0 and damp != 0:
            raise ValueError(f"compression '{name}': the optimizer's dampening={damp} (parameter group {i}) "
                             f"cannot be honoured: {name} applies the momentum in its memory as u = m*u + g, "
                             "undampened; dampening must be 0")
        if "dampening" in g and g.get("maximize", False) and g.get("weight_decay", 0.0) and momentum_of(spec) > 0.0:
            raise ValueError(f"compression '{name}': maximize=True with weight_decay (parameter group {i}) "
                             f"cannot be honoured: {name} adds the decay term to the exchanged gradient, which "
                             "the optimizer would negate; weight_decay must be 0 with maximize=True")


def check_keras_config(spec: CompressionSpec, config: Mapping[str, Any]) -> None:
    """ValueError for a Keras optimizer config a compressor keeping the momentum cannot honour:
    Keras's gradient clipping (``clipnorm``, ``clipvalue``, ``global_clipnorm``) would act on the
    exchanged velocity (momentum already applied), not on the gradient, as it does in dense
    training; the compressor's own clipping (DGC's ``clip_norm``) clips before the momentum.
    Nothing to refuse when the compressor's momentum is 0 (plain SGD on the exchanged gradient)."""
    if momentum_of(spec) <= 0.0:
        return
    for key in ("clipnorm", "clipvalue", "global_clipnorm"):
        if config.get(key) is not None:
            hint = f" (use {spec.name}:clip_norm=...)" if "clip_norm" in spec.params else ""
            raise ValueError(f"compression '{spec.name}': the optimizer's {key}={config[key]!r} cannot be honoured: "
                             f"{spec.name} applies the momentum before the optimizer sees the gradient, so it would "
                             f"clip the velocity; {key} must be None{hint}")
