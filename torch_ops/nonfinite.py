"""Non-finite gradients are never hidden (the contract an AMP ``GradScaler`` relies on).

A sparsifier never selects NaN (every comparison with NaN is false), a quantizer's sign of NaN is
a bit like any other, random-k may not sample it: any compressor can turn a non-finite gradient
into a finite exchanged result, and keep the bad value in its state forever. So the optimizer
wraps every exchange (``guard``): its first round carries one more float, this rank's count of
non-finite entries in the group (summed by allreduce; Horovod fuses it with the round's other
collectives), and when any rank counted one,

- the exchanged result is NaN everywhere on every rank (so ``torch.isfinite`` checks, the AMP
  skip pattern ``opt.synchronize(); scaler.step(opt)`` and Horovod-style loss-scale checks see it,
  as they would with Horovod's dense allreduce), and
- every non-finite entry of the group's compression state (residuals, momenta, sketch errors) is
  set to 0 on every rank: a skipped step leaves no NaN or inf behind in the state (the finite
  rest of that step's compensation stays, as it would after any step).

Cost: one read of the gradient (its sum: finite only when every entry is; ``count_nonfinite``
counts exactly only when it is not; on CUDA one counting pass on the device, nothing read back:
``nonfinite_flag``) and one 4-byte allreduce per group and step (not counted in ``opt.stats``,
which counts payload).
Checkpoints with non-finite compression state are refused on load (``check_state_finite``).
"""

from __future__ import annotations

from typing import Dict

import torch

from .collectives import Flag


def count_nonfinite(x: torch.Tensor) -> int:
    """The number of NaN/inf entries of ``x``. A NaN or inf entry makes the sum NaN or inf, so a
    finite sum (one read, no temporary) proves there is none; only a non-finite sum (a bad entry,
    or finite entries whose sum overflows) pays for the exact count (``isfinite`` builds a mask:
    several times slower than the sum on one thread)."""
    if x.numel() == 0 or bool(torch.isfinite(x.sum())):
        return 0
    return x.numel() - int(torch.isfinite(x).sum())


def nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """This rank's count of NaN/inf entries of ``x`` as the guard sends it: one float32 on ``x``'s
    device (NCCL moves CUDA tensors only). On CUDA it is counted on the device, nothing read back,
    so the host does not wait for the gradient (the exchange runs on a side stream: torch_ops.streams);
    elsewhere with ``count_nonfinite``'s finite-sum shortcut."""
    if x.is_cuda:
        return torch.isfinite(x).logical_not_().sum().to(torch.float32).reshape(1)
    return torch.tensor([float(count_nonfinite(x))], dtype=torch.float32, device=x.device)


def guard(gen, x: torch.Tensor, state: Dict[str, torch.Tensor]):
    """Wrap an exchange generator (see the module doc); same results when every rank is finite."""
    bad = nonfinite_flag(x)
    try:
        first = next(gen)
    except StopIteration as stop:  # an exchange without collectives (nothing to guard)
        return stop.value
    results = yield tuple(first) + (Flag(bad),)
    flagged = float(results[-1][0]) > 0
    results = tuple(results[:-1])
    while True:
        try:
            requests = gen.send(results)
        except StopIteration as stop:
            out = stop.value
            break
        results = yield requests
    if flagged:
        out = torch.full_like(out, float("nan"))
        for t in state.values():
            if torch.is_tensor(t) and t.is_floating_point():
                t.masked_fill_(~torch.isfinite(t), 0.0)
    return out


def check_state_finite(key: str, state: Dict[str, torch.Tensor]) -> None:
    """A checkpoint must not bring non-finite compression state back (ValueError)."""
    for name, t in state.items():
        if torch.is_tensor(t) and t.is_floating_point() and count_nonfinite(t):
            raise ValueError(f"load_state_dict: compression state '{name}' of '{key}' holds non-finite values "
                             "(NaN or inf); refusing to resume from it (a checkpoint saved after a diverged step?)")
