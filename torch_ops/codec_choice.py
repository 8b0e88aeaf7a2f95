"""Per-group codec choice: a group the planner decided to send dense or in fp16 instead of
with the user's compressor (``DistributedOptimizer(codec_choice="auto")``).

The planner (``hvdcompress.schedule.planner.make_plan(alternatives=...)``) picks, jointly with
the merge plan, for every group one of the user's spec, ``fp16`` (summed on the wire, so it keeps
the dense allreduce's collective) and ``none`` (dense), whichever the calibrated cost model says
makes the step shortest: on a fast link, or for a small group, encoding costs more than it saves.

State stays per parameter and belongs to the user's compressor; a group sent dense goes through
the compressor's ``dense_send`` (``torch_ops.compressors.base``): error feedback adds the
residual to the gradient and zeroes it (nothing held back is lost when a group turns dense), DGC
and the count sketch keep their momentum local and send their velocity with it. With ``fp16``
what the cast rounds away goes back into that carried entry, so nothing is lost there either.
The exchange is one allreduce; every rank gets the same sum, so parameters stay identical.

``codec_choice=None`` (the default) turns the choice on where measuring makes it safe
(``resolve_codec_choice``): with a cost-model schedule and measured validation on, the user's
spec on every group of each partition its own validation tries is always among the measured
candidates, so the plan kept is never measurably slower than the plan the spec alone would keep;
everywhere else None means "off".
"""

from __future__ import annotations

import torch

from hvdcompress.spec import resolve

from .collectives import Allreduce

ALTERNATIVES = ("fp16", "none")
CHOICES = ("auto", "off")
# specs that send the dense gradient (cast or not): the alternatives hold nothing better to choose
NOTHING_TO_CHOOSE = ("none", "fp16", "bf16")
# schedules whose plan is searched, and so measured against the fixed choices (tune_steps > 0)
SEARCHED = ("auto", "mgs", "mgwfbp")


def check_codec_choice(value, compressor, delay: int = 0, sync_every: int = 1) -> tuple:
    """The alternatives the planner may choose from: ``ALTERNATIVES`` for "auto", () for "off"
    (or None). ValueError, on every rank before any collective, for another value, for delayed
    averaging (its local steps follow the compressor's own update) and for a compressor that has
    no dense form."""
    if value is None or value == "off":
        return ()
    if value != "auto":
        raise ValueError(f"codec_choice: must be one of {', '.join(map(repr, CHOICES))} or None; got {value!r}")
    if delay != 0 or sync_every != 1:
        raise ValueError("codec_choice: 'auto' needs synchronous training (delay=0, sync_every=1); "
                         f"got delay={delay}, sync_every={sync_every}")
    if not compressor.can_send_dense:
        raise ValueError(f"codec_choice: 'auto' needs a compressor with a dense form; '{compressor.spec}' "
                         "applies its momentum after the exchange (momentum_correction=false)")
    return ALTERNATIVES


def chooses_by_default(spec, compressor, schedule, tune_steps: int, delay: int = 0, sync_every: int = 1,
                       elastic: bool = False) -> bool:
    """Whether ``codec_choice=None`` means "auto" (else "off"). All of these must hold:

    - ``spec`` compresses (not none / fp16 / bf16: there is nothing to choose);
    - ``schedule`` is a cost-model schedule ("auto", "mgs", "mgwfbp", ":greedy" too; a parsed
      ``Schedule``, its string or None) that the choice can plan for ``spec``: a compressor that never
      merges (``merge=LAYERWISE``) only under "auto" and the exact searches;
    - ``tune_steps`` > 0: the measured validation runs the spec on every group beside the choice,
      so the plan kept is never measurably slower than the spec's own plan;
    - synchronous training (``delay`` 0, ``sync_every`` 1) and a compressor with a dense form
      (``compressor.can_send_dense``): what "auto" itself needs;
    - not under Horovod Elastic (``elastic``): after a reset the plan is made again without
      measured validation.

    Pure: arguments already checked (``check_arguments``, ``check_tune_steps``)."""
    from hvdcompress.contract import LAYERWISE
    from hvdcompress.schedule.planner import parse_schedule

    if spec.name in NOTHING_TO_CHOOSE:
        return False
    if isinstance(schedule, (list, tuple)):  # explicit groups: nothing is searched
        return False
    parsed = parse_schedule(schedule)
    if parsed.kind not in SEARCHED:
        return False
    if spec.info.merge == LAYERWISE and parsed.search != "dp":  # the greedy rule cannot keep it alone
        return False
    return (tune_steps > 0 and delay == 0 and sync_every == 1 and bool(compressor.can_send_dense)
            and not elastic)


def resolve_codec_choice(value, spec, compressor, schedule, tune_steps: int, delay: int = 0,
                         sync_every: int = 1, elastic: bool = False) -> tuple:
    """The alternatives the planner may choose from for ``codec_choice=value``: "auto" and "off"
    as ``check_codec_choice`` says (its ValueErrors included); None is "auto" where
    ``chooses_by_default`` holds, else "off", silently."""
    if value is None:
        value = "auto" if chooses_by_default(spec, compressor, schedule, tune_steps, delay, sync_every,
                                             elastic) else "off"
    return check_codec_choice(value, compressor, delay, sync_every)


def chooses_routes(topology, resolved, alternatives, schedule, tune_steps: int, compressor) -> bool:
    """Whether the groups of a two-level ``resolved`` topology choose flat or two-level each
    (``torch_ops.twolevel.RouteChoice``), ``topology`` being the argument as given (None: the
    launcher's). All of these must hold:

    - ``resolved`` has more than one node of more than one rank;
    - the compressor's state is a sum over ranks (not an Adam family's variance:
      ``compressor.returns_update``), so a group may change route without losing any;
    - the per-group codec choice is on (``alternatives``), or the topology is the launcher's and
      ``schedule`` a cost-model schedule with ``tune_steps`` > 0 (the default path).

    Else every group goes two-level, as with an explicit ``topology=`` and ``codec_choice="off"``.
    Pure: arguments already checked."""
    from hvdcompress.schedule.planner import parse_schedule

    if resolved.flat or getattr(compressor, "returns_update", False):
        return False
    if alternatives:
        return True
    if topology is not None or isinstance(schedule, (list, tuple)):
        return False
    return parse_schedule(schedule).kind in SEARCHED and tune_steps > 0


def fallback_exchange(compressor, codec: str, x: torch.Tensor, ctx):
    """The exchange generator of a group sent with ``codec`` ("none" or "fp16") by ``compressor``'s
    state (module doc): one allreduce, the sum times ``ctx.scale``."""
    name = resolve(codec).name if isinstance(codec, str) and codec.split(":")[0] in ALTERNATIVES else codec
    if name not in ALTERNATIVES:
        raise ValueError(f"codec: must be one of {', '.join(ALTERNATIVES)} (a spec string); got {codec!r}")
    codec = name
    a, slot = compressor.dense_send(x, ctx)
    if codec == "fp16":
        wire = a.to(torch.float16)
        if slot is not None:  # what the cast rounds away stays to be sent later
            ctx.state[slot].view_as(a).copy_(a - wire.to(a.dtype))
    else:
        wire = a
    (total,) = yield (Allreduce(wire),)
    total = total.to(x.dtype) if total.dtype != x.dtype else total
    return total.mul_(ctx.scale) if ctx.scale != 1.0 else total
