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
"""

from __future__ import annotations

import torch

from hvdcompress.spec import resolve

from .collectives import Allreduce

ALTERNATIVES = ("fp16", "none")
CHOICES = ("auto", "off")


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
