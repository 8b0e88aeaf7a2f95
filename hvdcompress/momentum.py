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

Adam: ``onebitadam``, ``topkadam`` and ``qsgdadam`` compute Adam's direction themselves, so they take an
Adam/AdamW optimizer's betas and eps over (``take_over_adam``) and apply AdamW's step for it;
DGC's momentum correction is SGD's, so DGC under Adam is refused or warned about (``check_dgc_under_adam``).
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


# -- Adam ------------------------------------------------------------------------------------------
def is_adam_group(group: Mapping[str, Any]) -> bool:
    """A PyTorch Adam or AdamW parameter group (``betas`` and ``amsgrad``; NAdam, RAdam and Adamax
    have betas but other updates)."""
    return "betas" in group and "amsgrad" in group


def take_over_adam(spec: CompressionSpec, groups: Iterable[Mapping[str, Any]]) -> CompressionSpec:
    """``onebitadam`` / ``topkadam`` with the wrapped PyTorch optimizer's parameter groups: Adam's or AdamW's betas
    and eps move into the spec (a warning when the spec said otherwise); the learning rate and the
    decoupled weight decay stay in the groups, read at every step. SGD without momentum needs
    nothing (its step on the exchanged direction is AdamW's). ValueError, on every rank before any
    collective, for what cannot be honoured: another optimizer, SGD with momentum (a second
    momentum on Adam's direction), amsgrad, maximize, Adam's coupled (L2) weight decay, groups with
    different betas or eps."""
    name = spec.name
    groups = list(groups)
    adam = []
    for i, g in enumerate(groups):
        if is_adam_group(g):
            for key in ("amsgrad", "maximize"):
                if g.get(key):
                    raise ValueError(f"compression '{name}': the optimizer's {key}=True (parameter group {i}) "
                                     f"cannot be honoured: {name} applies Adam's update itself; {key} must be False")
            if g.get("weight_decay", 0.0) and not g.get("decoupled_weight_decay", False):
                raise ValueError(f"compression '{name}': Adam's weight_decay={g['weight_decay']} (parameter group {i}) "
                                 "is an L2 term inside the moments, which the exchanged moment cannot carry; use "
                                 "torch.optim.AdamW (decoupled weight decay) or weight_decay=0")
            adam.append((float(g["betas"][0]), float(g["betas"][1]), float(g["eps"])))
        elif "dampening" in g:  # SGD
            if g.get("momentum", 0.0) > 0.0:
                raise ValueError(f"compression '{name}': the optimizer's momentum={g['momentum']} (parameter group "
                                 f"{i}) would apply a second momentum to Adam's direction; wrap torch.optim.AdamW "
                                 "(taken over) or SGD with momentum=0")
        else:
            raise ValueError(f"compression '{name}': the optimizer (parameter group {i} has keys "
                             f"{sorted(k for k in g if k != 'params')}) is neither Adam/AdamW nor SGD; {name} "
                             "computes Adam's direction itself: wrap torch.optim.AdamW (or Adam), or SGD with "
                             "momentum=0")
    if not adam:
        return spec
    if len(adam) != len(groups) or len(set(adam)) > 1:
        raise ValueError(f"compression '{name}': the optimizer's parameter groups use different betas/eps "
                         f"{sorted(set(adam))} (or mix Adam with SGD); {name} keeps one pair of moments' "
                         "constants: give every group the same betas and eps")
    (b1, b2, eps), = set(adam)
    taken = {"beta1": b1, "beta2": b2, "eps": eps}
    said = {k: spec.params.get(k) for k in taken}
    differ = {k: v for k, v in said.items() if v is not None and v != taken[k]}
    if differ:
        warnings.warn(f"compression '{name}': taking over the optimizer's betas=({b1}, {b2}), eps={eps} (the spec "
                      f"said {differ}); the optimizer's own update is replaced by {name}'s")
    return CompressionSpec(name, dict(spec.params, **taken))


def take_over_keras_adam(spec: CompressionSpec, config: Mapping[str, Any]) -> CompressionSpec:
    """``onebitadam`` / ``topkadam`` with a Keras optimizer's config: Keras SGD with momentum 0 applies the
    exchanged direction as AdamW does (its ``weight_decay`` is decoupled); a Keras Adam's update
    cannot be replaced from the outside, nor can SGD's momentum be removed from Adam's direction.
    ValueError naming what to pass instead."""
    name = spec.name
    if "beta_1" in config:
        raise ValueError(f"compression '{name}': a Keras {config.get('name', 'Adam')} optimizer would apply Adam "
                         f"again to the direction {name} exchanges; wrap tf.keras.optimizers.SGD(learning_rate, "
                         f"momentum=0.0, weight_decay=...) (decoupled, as AdamW's) and give Adam's constants in the "
                         f"spec ({name}:beta1=...,beta2=...,eps=...)")
    if "momentum" not in config:
        raise ValueError(f"compression '{name}': the Keras optimizer {config.get('name')!r} would rescale the "
                         f"direction {name} exchanges; wrap tf.keras.optimizers.SGD with momentum=0.0")
    if config.get("momentum"):
        raise ValueError(f"compression '{name}': the optimizer's momentum={config['momentum']} would apply a second "
                         f"momentum to Adam's direction; momentum must be 0.0")
    return spec


def check_dgc_under_adam(spec: CompressionSpec, adam: bool) -> None:
    """DGC under an Adam optimizer (``adam``: the wrapped optimizer is of the Adam family): its
    momentum correction is SGD's, so with momentum > 0 Adam would apply a second momentum to DGC's
    velocity: ValueError. With momentum 0, Adam divides each coordinate by a variance estimated on
    the gradients while the sparsified exchange hands it rare large residuals (on the char LM of
    docs/across-the-world.md it ended above the loss of workers that never communicate): a
    warning. Both point to the specs that keep Adam's loss."""
    if not adam:
        return
    hint = ("use 'onebitadam' (1-bit Adam: the first moment exchanged 1-bit after a dense warm-up), 'topkadam' "
            "(the same with the moment's top-k) or 'fp16' with Adam/AdamW (docs/fidelity.md, AdamW)")
    if momentum_of(spec) > 0.0:
        raise ValueError(f"compression '{spec.name}': momentum={spec['momentum']} under an Adam optimizer: DGC's "
                         f"momentum correction is SGD's, and Adam would apply its own moments on top of DGC's "
                         f"velocity; {hint}")
    warnings.warn(f"compression '{spec.name}' with an Adam optimizer: Adam's per-coordinate scaling misreads the "
                  f"sparse, residual-accumulated gradients DGC exchanges (measured worse than no communication on "
                  f"a transformer); {hint}")
