"""Per-group codec choice on TensorFlow: a group the planner decided to send dense or in fp16
instead of with the user's compressor (``GradientCompression(codec_choice="auto")``).

The plan (``tf_ops.grouping.make_groups``; t_b = 0, all gradients are ready at once) picks for
every group the user's spec, ``fp16`` or ``none``, whichever the cost model predicts makes the
exchange shortest (``hvdcompress.schedule.planner.make_plan(alternatives=...)``). The state stays
in the compressor's per-position slots; a group sent dense goes through the compressor's
``dense_send`` (``tf_ops.compressors.base``; the rule of ``hvdcompress.reference.fallback``, as in
``torch_ops.codec_choice``): error feedback sends ``g + r`` and zeroes ``r``, DGC and the sketch
keep the momentum local and send their velocity along; with fp16 what the cast rounds away goes
back into that slot. One allreduce; every rank gets the same sum.

A compressor that never merges (``merge=LAYERWISE``: PowerSGD) is chosen for groups of one
gradient only (``hvdcompress.schedule.search.Option.merges``); a merged group is then always sent
with fp16 or dense and works on its members' elementwise slots (the residual; zeros for a member
without one, a bias, whose share is dropped again after: see ``grouping.join_state``), while each
member's ``q`` stays in its own slot, untouched, for when it is sent with PowerSGD again.
"""

from __future__ import annotations

import tensorflow as tf

from hvdcompress.spec import resolve

from .collectives import Allreduce
from .compressors.base import scaled

ALTERNATIVES = ("fp16", "none")
CHOICES = ("auto", "off")


def check_codec_choice(value, compressor, delay: int = 0, sync_every: int = 1) -> tuple:
    """The alternatives the planner may choose from: ``ALTERNATIVES`` for "auto", () for "off" or
    None; ValueError naming ``codec_choice`` otherwise (also with delayed averaging and for a
    compressor without a dense form)."""
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


def fallback_exchange(compressor, codec: str, x: tf.Tensor, ctx):
    """The exchange generator of a group sent with ``codec`` ("none" or "fp16") by
    ``compressor``'s state (module doc)."""
    name = resolve(codec).name if isinstance(codec, str) and codec.split(":")[0] in ALTERNATIVES else codec
    if name not in ALTERNATIVES:
        raise ValueError(f"codec: must be one of {', '.join(ALTERNATIVES)} (a spec string); got {codec!r}")
    codec = name
    a, slot = compressor.dense_send(x, ctx)
    if codec == "fp16":
        wire = tf.cast(a, tf.float16)
        if slot is not None:  # what the cast rounds away stays to be sent later
            ctx.state[slot].assign(a - tf.cast(wire, a.dtype))
    else:
        wire = a
    (total,) = yield (Allreduce(wire),)
    return scaled(tf.cast(total, x.dtype), ctx.scale)
