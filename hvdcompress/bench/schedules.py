"""Schedule entries of ``hvdcompress bench -s``: a ``DistributedOptimizer`` schedule string, with
``+tune`` appended for a cost-model schedule timed with measured validation (``tune_steps`` =
``--tune-steps``; ``hvdcompress.schedule.tuning``). Without the suffix a cost-model schedule runs with
``tune_steps=0`` -- the model's plan as made -- so one launch can time both side by side.
``+choice`` (last) runs the optimizer with ``codec_choice="auto"``: the plan also picks, per
group, the compressor, fp16 or dense (``torch_ops.codec_choice``), e.g. ``auto+tune+choice``;
an entry without it runs with ``codec_choice="off"`` -- the spec on every group -- whatever the
optimizer's default, so one launch times the spec everywhere and the choice side by side."""

from __future__ import annotations

from typing import Tuple

from hvdcompress.schedule.planner import parse_schedule

TUNED = "+tune"
CHOICE = "+choice"


def chooses(entry: str) -> bool:
    """Whether the entry asks for the per-group codec choice (``+choice``)."""
    return entry.endswith(CHOICE)


def codec_choice(entry: str) -> str:
    """The optimizer's ``codec_choice`` for the entry: "auto" with ``+choice``, else "off"."""
    return "auto" if chooses(entry) else "off"


def split(entry: str) -> Tuple[str, bool]:
    """(the schedule string, whether it is tuned); ValueError for a bad entry."""
    if chooses(entry):
        entry = entry[:-len(CHOICE)]
    tuned = entry.endswith(TUNED)
    base = entry[:-len(TUNED)] if tuned else entry
    sched = parse_schedule(base)
    if tuned and sched.kind not in ("mgs", "mgwfbp", "auto"):
        raise ValueError(f"schedules: '{TUNED}' applies to the cost-model schedules (mgs, mgwfbp, auto); got {entry!r}")
    return base, tuned
