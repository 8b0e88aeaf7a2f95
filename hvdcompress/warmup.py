"""Sparsity warm-up (Lin et al., DGC, section 3.3): density falls exponentially over the first
epochs, then stays at the target.

Default ("exponential") schedule for ``warmup_epochs`` = W and target density rho:

    density(e) = rho ** ((e + 1) / (W + 1))   for e < W,     density(e) = rho   for e >= W

which for rho = 0.001, W = 4 gives 25.1%, 6.3%, 1.58%, 0.40%, then 0.1% -- the paper's
25% -> 6.25% -> 1.5625% -> 0.4% -> 0.1%. An explicit schedule lists the warm-up densities, one per
epoch (e.g. ``(0.25, 0.0625, 0.015625, 0.004)``); it must decrease strictly, stay in (0, 1] and
stay above the target. Pure functions, shared by the PyTorch optimizer and the Keras callback.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple


def warmup_densities(ratio: float, warmup_epochs: int,
                     schedule: Optional[Sequence[float]] = None) -> Tuple[float, ...]:
    """The densities of the warm-up epochs (empty when there is no warm-up), validated."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"warm-up: ratio must be in (0, 1]; got {ratio!r}")
    if schedule is None or len(schedule) == 0:
        if warmup_epochs < 0:
            raise ValueError(f"warm-up: warmup_epochs must be an int >= 0; got {warmup_epochs!r}")
        return tuple(ratio ** ((e + 1) / (warmup_epochs + 1)) for e in range(warmup_epochs))
    densities = tuple(float(d) for d in schedule)
    if warmup_epochs not in (0, len(densities)):
        raise ValueError(f"warm-up: warmup_schedule lists {len(densities)} epochs but warmup_epochs is "
                         f"{warmup_epochs}; give one density per warm-up epoch")
    for i, d in enumerate(densities):
        if not 0.0 < d <= 1.0:
            raise ValueError(f"warm-up: warmup_schedule[{i}] must be in (0, 1]; got {d!r}")
        if i and d >= densities[i - 1]:
            raise ValueError("warm-up: warmup_schedule must decrease strictly; "
                             f"got {densities[i - 1]!r} then {d!r}")
    if densities[-1] <= ratio:
        raise ValueError(f"warm-up: the last warm-up density {densities[-1]!r} must be above the target "
                         f"ratio {ratio!r}")
    return densities


def density_at(epoch: int, ratio: float, warmup_epochs: int,
               schedule: Optional[Sequence[float]] = None) -> float:
    """Density to use during ``epoch`` (0-based)."""
    if epoch < 0:
        raise ValueError(f"warm-up: epoch must be >= 0; got {epoch!r}")
    densities = warmup_densities(ratio, warmup_epochs, schedule)
    return densities[epoch] if epoch < len(densities) else ratio


def auto_epoch(step: int, epoch_steps: int) -> int:
    """The warm-up epoch of exchange ``step`` when the training loop never tells the epoch
    (``set_epoch`` never called): epochs of ``epoch_steps`` steps."""
    return int(step) // int(epoch_steps)
