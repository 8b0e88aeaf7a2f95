"""The optimizer's own state in ``state_dict()``: what compression keeps between steps.

Saved under the key ``"hvdcompress"`` next to the wrapped optimizer's state: the step counter and
epoch (warm-ups), the compressor's state per parameter name whatever the grouping (residuals,
DGC's momenta, sketches' errors), the plan in use, delayed averaging's in-flight corrections and
local terms, and the compressor's global state. Residuals differ per rank, so each rank saves and
loads its own. Loading checks the saved state against this optimizer (``check_checkpoint``) before
anything is changed, and restores the plan only when the schedule is the same.
"""

from __future__ import annotations

import warnings

import torch

from .arguments import check_checkpoint
from .collectives import PendingQueue

STATE_KEY = "hvdcompress"
STATE_VERSION = 1


def save(opt, sd: dict) -> dict:
    """``sd`` (the wrapped optimizer's state dict) with our state added under ``STATE_KEY``.
    Delayed exchanges in flight are completed first and saved as corrections due at their steps,
    so that resuming is exact."""
    if opt._hvc_delayed.active and not opt._hvc_launched_now():
        with torch.no_grad():
            opt._hvc_complete_in_flight()
    sd[STATE_KEY] = {
        "version": STATE_VERSION,
        "compression": opt._hvc_spec.to_dict(),
        "step": opt._hvc_step,
        "epoch": opt._hvc_epoch,
        "epoch_set": opt._hvc_epoch_set,
        "state": opt._hvc_param_state(),
        "plan": opt._hvc_scheduler.plan_dict(),
        "delayed": opt._hvc_delayed.state() if opt._hvc_delayed.active else None,
        "compressor": opt._hvc_compressor.global_state(),
    }
    return sd


def split(opt, state_dict: dict):
    """(the wrapped optimizer's part, ours or None), ours checked before anything is loaded."""
    state_dict = dict(state_dict)
    ours = state_dict.pop(STATE_KEY, None)
    if ours is not None:
        check_checkpoint(ours, opt._hvc_spec, opt._hvc_compressor,
                         {opt._hvc_names[p]: p.numel() for p in opt._hvc_params})
    return state_dict, ours


def load(opt, ours) -> None:
    """Restore our part (after the wrapped optimizer's own ``load_state_dict``)."""
    opt._hvc_compressor.after_load(opt.param_groups)
    if ours is None:
        warnings.warn("load_state_dict: the state dict has no compression state (saved by a "
                      "plain optimizer?); residuals start from zero.")
        return
    opt._hvc_step = int(ours["step"])
    opt._hvc_epoch = int(ours["epoch"])
    opt._hvc_epoch_set = bool(ours.get("epoch_set", True))
    opt._hvc_compressor.load_global_state(ours.get("compressor"))
    by_name = opt._hvc_by_name
    per = {n: {} for n in by_name}
    per.update({key: {k: t.detach().clone().to(by_name[key].device) for k, t in st.items()}
                for key, st in ours["state"].items()})
    groups = opt._hvc_scheduler.restore(ours.get("plan")) or opt.groups  # same schedule: its plan
    opt._hvc_state = {n: {} for n in by_name}
    opt._hvc_pending = PendingQueue()
    opt._hvc_delayed.load(ours.get("delayed"), lambda n: by_name[n].device)
    opt._hvc_regroup(groups, per)
