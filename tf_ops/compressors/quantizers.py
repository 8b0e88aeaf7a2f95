"""Quantizers with real bit packing in TensorFlow ops: signsgd, efsignsgd, onebit, terngrad, qsgd.

A translation of ``torch_ops.compressors.quantizers`` (same payload: one gathered uint8 tensor,
``[float32 scales as bytes | packed codes]``), following the numpy oracle
``hvdcompress.reference.quantizers`` operation for operation, eagerly and inside ``tf.function``
(the step may be a tensor: it seeds the stochastic rounding of terngrad and qsgd). efsignsgd and
onebit keep the momentum taken over from a Keras SGD in the flat variable ``u`` and compress the
velocity (the oracle's module doc); ``onebit:scope=column`` sends a pair of values per column.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Optional

import numpy as np
import tensorflow as tf

from hvdcompress.momentum import momentum_of
from hvdcompress.native.quant import Codec, codec
from hvdcompress.packing import bits_for_levels
from hvdcompress.reference.quantizers import SCALE_BYTES, Layout, column_spans, layout_for
from hvdcompress.rng import stream_base

from . import host
from ..collectives import Allgather
from ..memory import Memory, ResidualMemory
from .base import OneRoundCompressor, TakesMomentum, scaled
from .dgc import grouped_add
from .packing import pack, uniform, unpack


def bucket_reduce(v: tf.Tensor, lay: Layout, op: str) -> tf.Tensor:
    """Per segment, along the last axis: "max" (of v >= 0) or "sum" (in v's dtype), zero-padded
    buckets. Leading axes (quantities stacked to be reduced together) reduce row by row exactly
    as alone."""
    out = []
    lead = v.shape.as_list()[:-1]
    for off, n, nb in lay.member_segments():
        if nb == 0:
            continue
        width = lay.bucket if lay.bucket else n
        part = v[..., off:off + n]
        if nb * width != n:
            part = tf.pad(part, [[0, 0]] * len(lead) + [[0, nb * width - n]])
        grid = tf.reshape(part, lead + [nb, width])
        out.append(tf.reduce_max(grid, axis=-1) if op == "max" else tf.reduce_sum(grid, axis=-1))
    if not out:
        return tf.zeros(lead + [0], v.dtype)
    return out[0] if len(out) == 1 else tf.concat(out, -1)


def _pieces(lay: Layout, numel: int):
    """(end offsets, scale slots) of the runs of entries sharing a scale, in order: each segment,
    and each gap between members (slot ``lay.segments``: the zero appended to the scales)."""
    ends, slots, pos, i = [], [], 0, 0
    for off, n, nb in lay.member_segments():
        if off > pos:
            ends.append(off)
            slots.append(lay.segments)
        at = off
        for c in lay.counts[i:i + nb]:
            at += c
            ends.append(at)
            slots.append(i)
            i += 1
        pos = off + n
    if numel > pos:
        ends.append(numel)
        slots.append(lay.segments)
    return np.array(ends, np.int32), np.array(slots, np.int32)


def _run_index(ends: np.ndarray, numel: int) -> tf.Tensor:
    """int32 [numel]: for every entry, the run (of ``ends``) it falls in."""
    return tf.searchsorted(tf.constant(ends), tf.range(numel, dtype=tf.int32), side="right", out_type=tf.int32)


def expand(scales: tf.Tensor, lay: Layout, numel: int) -> tf.Tensor:
    """Every entry's segment value along the last axis (entries outside every member get 0), in
    a shape that broadcasts against [..., numel]: [..., 1] for one segment covering the tensor,
    else [..., numel] -- repeated when one member tiles the tensor, else gathered by each entry's
    segment (``_run_index``: a few ops whatever the number of members)."""
    if lay.segments == 0:  # nothing to scale (no entries, or only empty members)
        return tf.zeros_like(scales[..., :1]) if numel else scales
    if lay.spans == ((0, numel),):
        if lay.segments == 1:
            return scales[..., :1]
        if numel % lay.bucket == 0:
            return tf.repeat(scales, lay.bucket, axis=-1)
        return tf.repeat(scales, list(lay.counts), axis=-1)
    ends, slots = _pieces(lay, numel)
    runs = _run_index(ends, numel)
    if len(slots) != lay.segments:  # gaps between members: their runs take an appended zero
        scales = tf.concat([scales, tf.zeros_like(scales[..., :1])], -1)
        runs = tf.gather(tf.constant(slots), runs)
    return tf.gather(scales, runs, axis=-1)


def sign_bits(a: tf.Tensor) -> tf.Tensor:
    return tf.cast(a >= 0, tf.uint8)


class Compiled:
    """One exchange on the shared compiled kernels (``hvdcompress.native.quant``), called through
    ``host.call``: ``encode`` (the payload; the residual variable assigned the kernel's new
    residual) and ``decode_sum`` (the sum over ranks, times the scale). The same bytes and results
    as the TF ops, bit for bit."""

    def __init__(self, lib, layout: Codec, comp, ctx, residual: Optional[tf.Variable]):
        self.lib, self.layout, self.ctx, self.residual = lib, layout, ctx, residual
        self.buffers = host.Buffers()  # the new residual and the result, reused across steps
        params = comp.spec.params
        self.seed = params["seed"] if "seed" in params else None

    def _base(self, step) -> int:
        ctx = self.ctx
        return 0 if self.seed is None else stream_base(self.seed, int(step), ctx.key, ctx.rank)

    def encode(self, x: tf.Tensor) -> tf.Tensor:
        lay, lib, n = self.layout, self.lib, self.layout.numel
        r = self.residual
        step = self.ctx.step
        inputs = [x] + ([r] if r is not None else [])
        stepped = self.seed is not None and tf.is_tensor(step)
        if stepped:
            inputs.append(tf.cast(step, tf.int64))
        fixed = None if stepped else self._base(step)

        def enc(xa, *rest):
            ra = rest[0] if r is not None else None
            out = host.empty(lay.part, np.uint8)
            rout = self.buffers.get(n, np.float32) if r is not None else None
            lay.encode(lib, host.address(xa), host.address(ra), host.address(rout),
                       self._base(rest[-1]) if stepped else fixed, host.address(out))
            return (out,) if rout is None else (out, rout)

        outputs = [(tf.uint8, [lay.part])] + ([(tf.float32, [n])] if r is not None else [])
        results = host.call(enc, inputs, outputs)
        if r is not None:
            r.assign(results[1], read_value=False)
        return results[0]

    def decode_sum(self, gathered: tf.Tensor) -> tf.Tensor:
        lay, lib, n = self.layout, self.lib, self.layout.numel
        world, scale = self.ctx.world_size, self.ctx.scale

        def dec(ga):
            if ga.size != world * lay.part:
                raise ValueError(f"{lay.name}: gathered {ga.size} bytes, expected {world} x {lay.part}")
            out = self.buffers.get(n, np.float32)
            lay.decode_sum(lib, host.address(ga), world, scale, host.address(out))
            return (out,)

        return host.call(dec, [gathered], [(tf.float32, [n])])[0]


def compiled(comp, x: tf.Tensor, ctx) -> Optional[Compiled]:
    """A ``Compiled`` exchange when the kernels serve it (float32 on CPU, no other memory than the
    residual, a layout the kernels take: ``hvdcompress.native.quant.codec``), else None."""
    if type(comp.memory) not in (Memory, ResidualMemory) or len(x.shape) != 1:
        return None
    residual = None
    if comp.spec.params.get("residual", False):
        residual = ctx.state.get("residual")
        if residual is None or residual.dtype != tf.float32:
            return None  # the TF ops (which say what is missing)
    lib = host.kernels(x)
    if lib is None:
        return None
    n = int(x.shape[0])
    layout = codec(comp.name, comp.spec.params, ctx.members, ctx.shape, n)
    if layout is None or (residual is not None and tuple(residual.shape) != (n,)):
        return None
    return Compiled(lib, layout, comp, ctx, residual)


class _Packed(OneRoundCompressor):
    summed = False
    bits = 1
    scales_per_segment = 0

    def exchange(self, x, ctx):
        """The shared compiled kernels where they serve (``compiled``: float32 on CPU), else the TF ops."""
        job = compiled(self, x, ctx)
        if job is None:
            return (yield from super().exchange(x, ctx))
        (gathered,) = yield (Allgather(job.encode(x), same_shape=True),)
        return job.decode_sum(gathered)

    def layout(self, numel: int, ctx) -> Layout:
        return layout_for(ctx.members, numel, self.spec.params.get("bucket", 0))

    @abstractmethod
    def encode(self, a, lay, ctx):
        """(float32 scales, uint8 codes)."""

    @abstractmethod
    def decode(self, scales, codes, lay, numel, ctx):
        """The dense float tensor the payload stands for."""

    def select(self, a, ctx):
        return {}  # ``compress`` leaves its (scales, codes) here, so ``unsent`` decodes them unpacked

    def compress(self, a, sel, ctx):
        numel = int(a.shape[0])
        lay = self.layout(numel, ctx)
        scales, codes = self.encode(tf.cast(a, tf.float32), lay, ctx)
        sel["decoded"] = lambda: self.decode(scales, codes, lay, numel, ctx)
        head = tf.reshape(tf.bitcast(scales, tf.uint8), [-1])
        return (tf.concat([head, pack(codes, self.bits)], 0),)

    def unsent(self, payload, a, sel, ctx):
        return a - tf.cast(sel["decoded"](), a.dtype)

    def scale_count(self, lay: Layout, numel: int, ctx) -> int:
        """float32 scales at the head of a payload."""
        return lay.segments * self.scales_per_segment

    def _decode_buffers(self, bufs, numel, ctx):
        """[ranks, bytes] payloads -> [ranks, numel] decoded values, every rank at once."""
        lay = self.layout(numel, ctx)
        count = self.scale_count(lay, numel, ctx)
        world = int(bufs.shape[0])
        scales = tf.bitcast(tf.reshape(bufs[:, :SCALE_BYTES * count], [world, count, SCALE_BYTES]), tf.float32)
        return self.decode(scales, unpack(bufs[:, SCALE_BYTES * count:], self.bits, numel), lay, numel, ctx)

    def decompress(self, payload, like, sel, ctx):
        numel = int(like.shape[0])
        return tf.cast(tf.reshape(self._decode_buffers(payload[0][None], numel, ctx), [numel]), like.dtype)

    def aggregate(self, results, like, sel, ctx):
        numel = int(like.shape[0])
        values = self._decode_buffers(tf.reshape(results[0], [ctx.world_size, -1]), numel, ctx)
        total = values[0]
        for r in range(1, ctx.world_size):  # rank order
            total = total + values[r]
        return tf.cast(tf.reshape(total, [numel]), like.dtype)


class SignSGDCompressor(_Packed):
    name = "signsgd"

    def encode(self, a, lay, ctx):
        return tf.zeros([0], tf.float32), sign_bits(a)

    def decode(self, scales, codes, lay, numel, ctx):
        return tf.cast(codes, tf.float32) * 2.0 - 1.0

    def aggregate(self, results, like, sel, ctx):
        numel = int(like.shape[0])
        world = ctx.world_size
        ones = tf.reduce_sum(tf.cast(unpack(tf.reshape(results[0], [world, -1]), 1, numel), tf.int32), axis=0)
        votes = tf.reshape(ones * 2 - world, [numel])  # the sum of the ranks' +-1 (integers: any order)
        return tf.cast(tf.cast(tf.sign(votes), tf.float32) * float(world), like.dtype)


class _MomentumInside(TakesMomentum):
    """The optimizer's momentum before compression: the exchange compresses the velocity
    u = m*u + g (Nesterov: g + m*u), kept in the variable ``u``, with error feedback on it. With
    ``momentum_correction=false`` nothing is taken over and the optimizer keeps its momentum."""

    @classmethod
    def adapt_optimizer(cls, spec, config):
        return super().adapt_optimizer(spec, config) if spec["momentum_correction"] else (spec, config)

    def state_slots(self, shape):
        slots = super().state_slots(shape)
        return slots + ("u",) if momentum_of(self.spec) > 0.0 else slots

    def initial_value(self, slot):
        return 0.0 if slot == "u" else super().initial_value(slot)

    @property
    def stateful(self) -> bool:
        return super().stateful or momentum_of(self.spec) > 0.0

    def exchange(self, x, ctx):
        m = momentum_of(self.spec)
        if m > 0.0:  # only with momentum_correction (the spec's check)
            u = ctx.state["u"]
            mf = tf.constant(m, x.dtype)  # m rounded once to x's dtype (tf.cast(m) would round to float32 first)
            # sums kept apart (``grouped_add``): Grappler would flatten them with the residual's
            # add into one AddN and round differently from the oracle
            u_new = grouped_add(u * mf, x)
            u.assign(u_new)
            x = grouped_add(x, u_new * mf) if self.spec["nesterov"] else u_new
        return (yield from super().exchange(x, ctx))


class EFSignSGDCompressor(_MomentumInside, _Packed):
    name = "efsignsgd"
    scales_per_segment = 1

    def encode(self, a, lay, ctx):
        sums = bucket_reduce(tf.cast(tf.abs(a), tf.float64), lay, "sum")
        return tf.cast(sums / tf.constant(lay.counts, tf.float64), tf.float32), sign_bits(a)

    def decode(self, scales, codes, lay, numel, ctx):
        s = expand(scales, lay, numel)
        return tf.where(codes == 1, s, -s)


class OneBitCompressor(_MomentumInside, _Packed):
    name = "onebit"
    scales_per_segment = 2

    def columns(self, numel, ctx):
        return column_spans(ctx.members, numel, ctx.shape) if self.spec["scope"] == "column" else None

    def scale_count(self, lay, numel, ctx) -> int:
        cols = self.columns(numel, ctx)
        return super().scale_count(lay, numel, ctx) if cols is None else 2 * sum(c for _, _, c in cols)

    def encode(self, a, lay, ctx):
        cols = self.columns(int(a.shape[0]), ctx)
        if cols is not None:
            return encode_columns(a, cols), sign_bits(a)
        bits = sign_bits(a)
        one = bits == 1
        a64 = tf.cast(a, tf.float64)
        zero = tf.zeros_like(a64)
        # the three sums reduced together, each row as alone
        pos_sum, pos_n, neg_sum = tf.unstack(bucket_reduce(
            tf.stack([tf.where(one, a64, zero), tf.cast(bits, tf.float64), tf.where(one, zero, a64)]), lay, "sum"))
        neg_n = tf.constant(lay.counts, tf.float64) - pos_n
        pos = tf.cast(tf.math.divide_no_nan(pos_sum, pos_n), tf.float32)
        neg = tf.cast(tf.math.divide_no_nan(neg_sum, neg_n), tf.float32)
        return tf.reshape(tf.stack([pos, neg], axis=1), [-1]), bits

    def decode(self, scales, codes, lay, numel, ctx):
        cols = self.columns(numel, ctx)
        if cols is not None:
            return decode_columns(scales, codes, cols, numel)
        pn = tf.reshape(scales, scales.shape.as_list()[:-1] + [-1, 2])
        return tf.where(codes == 1, expand(pn[..., 0], lay, numel), expand(pn[..., 1], lay, numel))


def encode_columns(a: tf.Tensor, cols) -> tf.Tensor:
    """Per column of every member: (mean of the entries >= 0, mean of the others), float64 sums
    rounded once to float32, 0 for an empty part; pairs in column order (the oracle's rule). The
    parts are computed once for the whole tensor; each member's three column sums are reductions
    of its own (rows, columns) view, as the oracle's are."""
    if not cols:
        return tf.zeros([0], tf.float32)
    a64 = tf.cast(a, tf.float64)
    one = a64 >= 0
    zero = tf.zeros_like(a64)
    parts = tf.stack([tf.cast(one, tf.float64), tf.where(one, a64, zero), tf.where(one, zero, a64)])
    sums, rows_of = [], []
    for off, rows, c in cols:
        counts, pos, neg = tf.unstack(tf.reshape(parts[:, off:off + rows * c], [3, rows, c]))
        sums.append(tf.stack([tf.reduce_sum(counts, axis=0), tf.reduce_sum(pos, axis=0), tf.reduce_sum(neg, axis=0)]))
        rows_of += [rows] * c
    pos_n, pos_sum, neg_sum = tf.unstack(sums[0] if len(sums) == 1 else tf.concat(sums, 1))
    pos = tf.cast(tf.math.divide_no_nan(pos_sum, pos_n), tf.float32)
    neg = tf.cast(tf.math.divide_no_nan(neg_sum, tf.constant(rows_of, tf.float64) - pos_n), tf.float32)
    return tf.reshape(tf.stack([pos, neg], axis=1), [-1])


def decode_columns(scales: tf.Tensor, codes: tf.Tensor, cols, numel: int) -> tf.Tensor:
    """Every entry's column value for its bit, along the last axis (entries outside every member
    get 0): the column pairs tiled for one member covering the tensor, else gathered by each
    entry's column (a few ops whatever the number of members)."""
    pairs = tf.reshape(scales, scales.shape.as_list()[:-1] + [-1, 2])
    pos, neg = pairs[..., 0], pairs[..., 1]
    if len(cols) == 1 and cols[0][0] == 0 and cols[0][1] * cols[0][2] == numel:
        rows, c = cols[0][1], cols[0][2]
        if c > 1:
            reps = [1] * (len(pos.shape) - 1) + [rows]
            pos, neg = tf.tile(pos, reps), tf.tile(neg, reps)
        return tf.where(codes == 1, pos, neg)
    ends, firsts, widths, bases, at, base = [], [], [], [], 0, 0
    for off, rows, c in cols:
        if off > at:  # a gap: the zero appended after the last column
            ends.append(off), firsts.append(at), widths.append(1), bases.append(-1)
        ends.append(off + rows * c), firsts.append(off), widths.append(c), bases.append(base)
        at, base = off + rows * c, base + c
    if numel > at:
        ends.append(numel), firsts.append(at), widths.append(1), bases.append(-1)
    bases = [base if b < 0 else b for b in bases]
    runs = _run_index(np.array(ends, np.int32), numel)
    rel = tf.range(numel, dtype=tf.int32) - tf.gather(tf.constant(firsts, tf.int32), runs)
    column = tf.gather(tf.constant(bases, tf.int32), runs) + tf.math.floormod(rel, tf.gather(tf.constant(widths, tf.int32), runs))
    zero = tf.zeros_like(pos[..., :1])
    return tf.where(codes == 1, tf.gather(tf.concat([pos, zero], -1), column, axis=-1),
                    tf.gather(tf.concat([neg, zero], -1), column, axis=-1))


class TernGradCompressor(_Packed):
    name = "terngrad"
    bits = 2
    scales_per_segment = 1
    uses_step = True

    def ternarize(self, a, s, lay, ctx):
        """2-bit codes of ``a`` for scales ``s``: keep |a| / s with probability, sign in the code."""
        numel = int(a.shape[0])
        p = tf.math.divide_no_nan(tf.abs(a), expand(s, lay, numel))
        keep = uniform(numel, self.spec["seed"], ctx.step, ctx.key, ctx.rank) < p
        return tf.where(keep, tf.where(a >= 0, tf.constant(1, tf.uint8), tf.constant(2, tf.uint8)),
                        tf.constant(0, tf.uint8))

    def encode(self, a, lay, ctx):
        s = bucket_reduce(tf.abs(a), lay, "max")
        return s, self.ternarize(a, s, lay, ctx)

    def decode(self, scales, codes, lay, numel, ctx):
        s = expand(scales, lay, numel)
        return tf.where(codes == 1, s, tf.where(codes == 2, -s, tf.zeros_like(s)))

    def exchange(self, x, ctx):
        """With ``share_scale`` (Wen et al.'s scaler sharing): the scales are gathered first and
        every rank quantizes with their max over ranks; then the codes alone are gathered and
        the result is (the int32 sum of the ranks' +-1/0) * s. Otherwise one round."""
        if not self.spec["share_scale"]:
            return (yield from super().exchange(x, ctx))
        a = self.memory.compensate(x, ctx.state)
        a32 = tf.cast(a, tf.float32)
        numel = int(a.shape[0])
        lay = self.layout(numel, ctx)
        (gathered,) = yield (Allgather(bucket_reduce(tf.abs(a32), lay, "max"), same_shape=True),)
        s = tf.reduce_max(tf.reshape(gathered, [ctx.world_size, lay.segments]), axis=0)
        codes = self.ternarize(a32, s, lay, ctx)
        self.memory.update(lambda: a - tf.cast(self.decode(s, codes, lay, numel, ctx), a.dtype), ctx.state)
        (packed,) = yield (Allgather(pack(codes, self.bits), same_shape=True),)
        got = unpack(tf.reshape(packed, [ctx.world_size, -1]), self.bits, numel)
        votes = tf.reduce_sum(tf.cast(got == 1, tf.int32) - tf.cast(got == 2, tf.int32), axis=0)  # integers: any order
        total = tf.cast(tf.cast(tf.reshape(votes, [numel]), tf.float32) * expand(s, lay, numel), a.dtype)
        return scaled(total, ctx.scale)


class QSGDCompressor(_Packed):
    name = "qsgd"
    scales_per_segment = 1
    uses_step = True

    def __init__(self, spec):
        super().__init__(spec)
        self.bits = bits_for_levels(2 * spec["levels"] + 1)

    def encode(self, a, lay, ctx):
        numel = int(a.shape[0])
        s = tf.constant(float(self.spec["levels"]), tf.float32)
        v = tf.cast(tf.sqrt(bucket_reduce(tf.square(tf.cast(a, tf.float64)), lay, "sum")), tf.float32)
        f = tf.where(v > 0, s / v, tf.zeros_like(v))  # 0 for a NaN norm too (the oracle's rule)
        r = tf.abs(a) * expand(f, lay, numel)
        low = tf.floor(r)
        u = uniform(numel, self.spec["seed"], ctx.step, ctx.key, ctx.rank)
        level = tf.minimum(low + tf.cast(u < (r - low), tf.float32), s)
        signed = tf.where(a >= 0, level, -level)
        # a NaN's code is 0 (numpy's conversion on x86, the oracle's); TF's cast gives another byte
        codes = tf.cast(signed + s, tf.uint8)
        return v, tf.where(tf.math.is_nan(signed), tf.zeros_like(codes), codes)

    def decode(self, scales, codes, lay, numel, ctx):
        s = tf.constant(float(self.spec["levels"]), tf.float32)
        w = scales * tf.constant(1.0 / self.spec["levels"], tf.float32)
        return (tf.cast(codes, tf.float32) - s) * expand(w, lay, numel)
