"""The format of the optimizer's own state in ``state_dict()``: what compression keeps between steps.

Saved under the key ``"hvdcompress"`` next to the wrapped optimizer's state (``pack``): the step
counter and epoch (warm-ups), the compressor's state per parameter name whatever the grouping
(residuals, DGC's momenta, sketches' errors), the plan in use, the sync policy's state (delayed
averaging's in-flight corrections and local terms, under ``"delayed"``), and the compressor's
global state. Residuals differ per rank, so each rank saves and loads its own. ``check`` validates
saved state against an optimizer before anything is changed; the engine
(``torch_ops.engine.Engine.state_dict`` / ``load_state_dict``) saves and restores it.
"""

from __future__ import annotations

from typing import Dict, Optional

from hvdcompress.spec import CompressionSpec

from .nonfinite import check_state_finite

STATE_KEY = "hvdcompress"
STATE_VERSION = 1


def pack(*, spec: CompressionSpec, step: int, epoch: int, epoch_set: bool, state: dict, plan: Optional[dict],
         policy: Optional[dict], compressor) -> dict:
    """The saved form (a plain dict of tensors and Python values)."""
    return {"version": STATE_VERSION, "compression": spec.to_dict(), "step": step, "epoch": epoch,
            "epoch_set": epoch_set, "state": state, "plan": plan, "delayed": policy, "compressor": compressor}


def check(ours, spec, compressor, numel: Dict[str, int]) -> None:
    """``state_dict()["hvdcompress"]`` of a checkpoint must fit this optimizer (ValueError
    otherwise, before anything is loaded): the state version, the same compression spec, known
    parameters, state the compressor accepts, finite values, a plan over the same parameters."""
    if not isinstance(ours, dict) or ours.get("version") != STATE_VERSION:
        raise ValueError(f"load_state_dict: state_dict['{STATE_KEY}'] is not hvdcompress state "
                         f"version {STATE_VERSION}")
    saved = CompressionSpec.from_dict(ours["compression"])
    if saved != spec:
        raise ValueError(f"load_state_dict: the checkpoint was saved with compression '{saved}', "
                         f"this optimizer uses '{spec}'")
    unknown = sorted(set(ours["state"]) - set(numel))
    if unknown:
        raise ValueError("load_state_dict: the checkpoint holds compression state for parameters this "
                         f"optimizer does not have: {', '.join(unknown[:5])}")
    for key, st in ours["state"].items():
        compressor.check_state(key, st, numel[key])
        check_state_finite(key, st)
    delayed = ours.get("delayed") or {}
    for part in ("velocity", "accumulated", "applied"):  # delayed averaging (torch_ops.delayed)
        for key, t in (delayed.get(part) or {}).items():
            check_state_finite(key, {f"delayed {part}": t})
    for due, corrections in (delayed.get("corrections") or {}).items():
        for key, t in corrections.items():
            check_state_finite(key, {f"delayed correction due at step {due}": t})
    plan = ours.get("plan")
    if plan is not None and sorted(plan.get("order", ())) != sorted(numel):
        raise ValueError("load_state_dict: the checkpoint's plan groups other parameters than this "
                         "optimizer has (a checkpoint of a different model?)")
