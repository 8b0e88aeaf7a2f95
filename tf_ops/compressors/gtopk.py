"""Global top-k (gTop-k) in TensorFlow: the oracle's algorithm (``hvdcompress.reference.gtopk``:
local top-k, log2 P rounds of pairwise swaps by recursive doubling, each merging two k-sparse
vectors and keeping the top k of the sum; a fold and an unfold where P is not a power of two),
operation for operation, in TF ops that trace into one graph.

A swap is an ``Alltoall`` of uint8 rows (index bytes, value bytes [, flag byte]) whose only
non-empty piece goes to the partner, so the rounds' shapes are static: k is the spec's ratio of the
tensor's size (no warm-up density: ``has_density`` is False).
"""

from __future__ import annotations

import tensorflow as tf

from hvdcompress.reference.gtopk import FOLD, UNFOLD, plan, row_bytes, sources
from hvdcompress.sampling import index_dtype
from hvdcompress.spec import num_selected

from ..collectives import Alltoall
from ..memory import memory_for
from .base import Compressor, scaled
from .selection import topk_indices


def pack(indices, values, index_type, flags=None):
    """(m, row bytes) uint8 rows: index, value bytes, flag byte (the oracle's ``pack``)."""
    cols = [tf.bitcast(tf.cast(indices, index_type), tf.uint8), tf.bitcast(values, tf.uint8)]
    if flags is not None:
        cols.append(tf.cast(flags, tf.uint8)[:, None])
    return tf.concat(cols, axis=1)


def unpack(rows, index_type, dtype, flagged: bool):
    """``pack`` 's inverse: (indices as int64, values, flags as bool or None)."""
    ib, vb = index_type.size, dtype.size
    idx = tf.cast(tf.bitcast(rows[:, :ib], index_type), tf.int64)
    vals = tf.bitcast(rows[:, ib:ib + vb], dtype)
    flags = tf.cast(rows[:, ib + vb], tf.bool) if flagged else None
    return idx, vals, flags


def member(values, ascending):
    """Which of ``values`` are in the ascending, distinct ``ascending`` (possibly empty)."""
    pos = tf.searchsorted(ascending, values)
    padded = tf.concat([ascending, tf.constant([-1], ascending.dtype)], axis=0)  # never an index
    return tf.equal(tf.gather(padded, pos), values)


def merge(ia, va, ib, vb, k: int):
    """Two k-sparse vectors summed (0 + a + b in the values' dtype), then the top k of the sum, ties
    to the lower index: (indices ascending, values)."""
    union = tf.sort(tf.unique(tf.concat([ia, ib], axis=0)).y)
    vals = tf.zeros(tf.shape(union), va.dtype)
    vals = tf.tensor_scatter_nd_add(vals, tf.searchsorted(union, ia)[:, None], va)
    vals = tf.tensor_scatter_nd_add(vals, tf.searchsorted(union, ib)[:, None], vb)
    keep = tf.cast(topk_indices(vals, k), tf.int64)
    return tf.gather(union, keep), tf.gather(vals, keep)


def global_topk(indices, values, k: int, n: int, ctx):
    """The rounds over this rank's k-sparse vector, as a sub-generator (``yield from``): returns
    (global indices, their summed values, this rank's own indices whose contribution is in them);
    the oracle's ``global_topk``."""
    idx, vals = indices, values
    mine, folded = indices, None
    itype = tf.int32 if index_dtype(n).itemsize == 4 else tf.int64
    world, rank = ctx.world_size, int(ctx.rank)
    for kind, dest in (plan(world) if world > 1 and k else ()):
        to = dest[rank]
        if to >= 0:
            rows = pack(idx, vals, itype, member(idx, folded) if kind == UNFOLD else None)
        else:
            rows = tf.zeros([0, row_bytes(kind, values.dtype.size, itype.size)], tf.uint8)
        splits = tuple(k if q == to else 0 for q in range(world))
        (got,) = yield (Alltoall(rows, splits),)
        if not sources(dest, rank):
            continue
        their_idx, their_vals, flags = unpack(got, itype, values.dtype, kind == UNFOLD)
        if kind == UNFOLD:
            idx, vals, mine = their_idx, their_vals, tf.boolean_mask(their_idx, flags)
            continue
        if kind == FOLD:
            folded = their_idx
        idx, vals = merge(idx, vals, their_idx, their_vals, k)
        mine = tf.boolean_mask(mine, member(mine, idx))
        if folded is not None:
            folded = tf.boolean_mask(folded, member(folded, idx))
    return idx, vals, mine


class GlobalTopKCompressor(Compressor):
    name = "gtopk"
    summed = False

    def __init__(self, spec):
        super().__init__(spec)
        self.memory = memory_for(spec)

    @property
    def has_density(self) -> bool:
        return False  # k is the spec's: every round's shapes are static

    def state_slots(self, shape):
        return self.memory.slots

    def initial_value(self, slot):
        return self.memory.initial

    @property
    def stateful(self) -> bool:
        return bool(self.memory.slots)

    def exchange(self, x, ctx):
        n = int(x.shape[0])
        k = num_selected(self.spec["ratio"], n)
        a = self.memory.compensate(x, ctx.state)
        own = tf.cast(topk_indices(a, k), tf.int64)
        idx, vals, mine = yield from global_topk(own, tf.gather(a, own), k, n, ctx)
        self.memory.update(lambda: tf.tensor_scatter_nd_update(a, mine[:, None], tf.zeros(tf.shape(mine), a.dtype)),
                           ctx.state)
        total = tf.tensor_scatter_nd_update(tf.zeros([n], a.dtype), idx[:, None], vals)
        return scaled(total, ctx.scale)
