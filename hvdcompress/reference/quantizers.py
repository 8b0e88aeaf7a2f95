"""Quantizers with real bit packing, declared and defined in numpy: the oracle.

Every quantizer sends ONE gathered uint8 buffer per exchange (``hvdcompress.packing`` layout)::

    packed = [float32 scales, little-endian bytes | codes packed ``bits`` per entry]

and every rank decodes the gathered buffers rank by rank and sums them in rank order, in float32.

    signsgd    Bernstein et al. 2018, majority vote. 1 bit: 1 iff a >= 0 (a zero votes +1, one bit
               cannot say 0). Result = sign(sum over ranks of +-1) * world * scale, i.e. the sign of
               the vote for op=Average. Tie (an even number of ranks split evenly): 0, no update.
    efsignsgd  Karimireddy et al. 2019. a = g + e; send scale = mean|a| (one float32 per tensor)
               and sign bits; decoded = +-scale; e = a - decoded.
    onebit     Seide et al. 2014. a = g + e; bits a >= 0; two float32 reconstruction values, the
               mean of a over the 1-bits and over the 0-bits (0 when a part is empty), per tensor
               (``scope=tensor``) or per column (``scope=column``, the default, the paper's rule: the
               tensor viewed as (shape[0], -1), one pair per column; a 1-D tensor is one column);
               e = a - decoded.

    Momentum inside (efsignsgd, onebit; ``momentum`` > 0, the wrapped SGD's taken over): the
    momentum is applied BEFORE compression and error feedback acts on the velocity, as DGC's
    momentum correction does: u = m*u + g; v = u (Nesterov: g + m*u); a = v + e; e = a - decoded.
    The optimizer then runs without momentum (its update is the exchanged velocity). Heavy-ball
    momentum applied after the exchange, to an error-fed sign, is unstable: the residual hands the
    momentum a delayed remainder that it amplifies.
    terngrad   Wen et al. 2017. s = max|a| per tensor (``bucket=0``) or per bucket of ``bucket``
               entries; b = (u < |a| / s); code 0 (zero), 1 (+s), 2 (-s), 2 bits; unbiased.
               ``share_scale`` (the paper's scaler sharing): two gathered rounds, the float32
               scales first, then every rank uses s = max over ranks and sends only its packed
               codes; the result is (sum over ranks of the codes' +-1/0, an int32) * s.
    qsgd       Alistarh et al. 2017. v = ||a||_2 per bucket; r = |a| * (s / v); level = floor(r)
               + (u < r - floor(r)), at most s; code = sign * level + s in [0, 2s], packed in
               ceil(log2(2s+1)) bits (fixed width, not the paper's Elias code); decoded = (code -
               s) * (v * float32(1/s)) (a product: graph compilers may turn a division by a
               constant into one anyway); unbiased.

``u`` is ``hvdcompress.rng.uniform(numel, seed, step, key, rank)`` (the entry's index in the
exchanged flat tensor). Reductions (means, norms) are summed in float64 and rounded once to
float32, so that the order in which a framework adds does not change the float32 result (except
with probability ~2**-29 per value); max is exact in any order. All other arithmetic is float32,
one IEEE operation at a time, so torch and TensorFlow reproduce this module bit for bit.

Scales are per tensor (per column for ``onebit:scope=column``): in a merged group
(``merge=PER_MEMBER``) each member of ``ctx.members`` gets its own scale(s) and buckets, so merging
changes nothing; an exchange given no members treats the flat tensor as one member (one scale for
the whole group).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from ..momentum import momentum_of
from ..packing import bits_for_levels, pack, packed_size, unpack
from ..rng import uniform
from ..spec import GATHERED, PER_MEMBER, Param, Round, register, residual_param
from .oneround import OneRoundOracle
from ..contract import Allgather, Member

F32 = np.float32
SCALE_BYTES = 4


# -- declarations ----------------------------------------------------------------------------------
def _levels(p) -> int:
    return 2 * p["levels"] + 1


def _codes_bits(name: str, p) -> int:
    return {"signsgd": 1, "efsignsgd": 1, "onebit": 1, "terngrad": 2}.get(name) or bits_for_levels(_levels(p))


def _scales_per_tensor(name: str, p, d):
    """float32 scales sent per tensor of d entries (array): bucket counts for terngrad/qsgd. For
    ``onebit:scope=column`` the rule sees sizes only, not shapes: it counts the columns of a
    square matrix, ceil(sqrt(d)) (``payload_bytes`` with the shape is exact)."""
    if name == "signsgd":
        return np.zeros_like(d)
    if name == "onebit" and p.get("scope") == "column":
        return np.where(d > 0, 2 * np.ceil(np.sqrt(d)), 0)
    if name in ("efsignsgd", "onebit"):
        return np.where(d > 0, 1 if name == "efsignsgd" else 2, 0)
    bucket = p["bucket"]
    return np.where(d > 0, np.ceil(d / bucket) if bucket else 1, 0)


def _wire_for(name: str):
    def rule(params, d, itemsize, world, density):
        codes = np.ceil(d * _codes_bits(name, params) / 8)
        scales = SCALE_BYTES * _scales_per_tensor(name, params, d)
        if params.get("share_scale"):  # terngrad's scaler sharing: scales first, then codes
            return (Round(GATHERED, 1, scales), Round(GATHERED, 1, codes))
        return (Round(GATHERED, 1, codes + scales),)
    return rule


BUCKET = dict(low=0, high=2 ** 31 - 1)
SEED = Param("seed", int, 0, "seed of the stochastic rounding (with step, tensor name, rank)", low=0, high=2 ** 32 - 1)


def momentum_params():
    """efsignsgd's and onebit's momentum inside (the module doc), DGC's conventions."""
    return (Param("momentum", float, None, "momentum applied before compression (u = m*u + g; error feedback "
                  "on the velocity); none: the wrapped SGD's momentum, taken over (0 without one)",
                  low=0.0, high=1.0, high_open=True, optional=True),
            Param("nesterov", bool, False, "Nesterov momentum (v = g + m*u); taken over with the momentum"),
            Param("momentum_correction", bool, True, "apply the momentum inside, before compression; off: "
                  "the wrapped optimizer keeps its momentum and applies it to the exchanged result"))


def _check_momentum(name: str):
    def check(p) -> None:
        if not p["momentum_correction"] and (p["momentum"] or p["nesterov"]):
            raise ValueError(f"{name}: parameter 'momentum' must be none or 0 and 'nesterov' false with "
                             f"momentum_correction=false (the optimizer then keeps its own momentum); got "
                             f"momentum={p['momentum']!r}, nesterov={p['nesterov']!r}")
    return check


register("signsgd", GATHERED, "signSGD with majority vote: 1 bit per entry (packed 8 per byte), the "
         "result is the sign of the vote (0 on a tie)", wire=_wire_for("signsgd"), merge=PER_MEMBER, same_shape=True)
register("efsignsgd", GATHERED, "error-feedback signSGD: sign bits (packed 8 per byte) times mean|a| "
         "per tensor; the optimizer's momentum is applied before compression (taken over)",
         residual_param(True), *momentum_params(), check=_check_momentum("efsignsgd"),
         wire=_wire_for("efsignsgd"), merge=PER_MEMBER, same_shape=True)
register("onebit", GATHERED, "1-bit SGD: sign bits (packed 8 per byte) and two reconstruction values "
         "(the means of the two parts) per tensor or per column, with error feedback; the optimizer's "
         "momentum is applied before compression (taken over)", residual_param(True),
         Param("scope", str, "column", "where the two reconstruction values apply: 'column' (Seide et al.: "
               "one pair per column of the tensor viewed as (shape[0], -1), 2 * columns float32 on the wire; "
               "a 1-D tensor is one column), 'tensor' (one pair per tensor)", choices=("column", "tensor")),
         *momentum_params(), check=_check_momentum("onebit"), wire=_wire_for("onebit"), merge=PER_MEMBER, same_shape=True)
register("terngrad", GATHERED, "TernGrad: stochastic ternary {-s, 0, s}, s = max|a| per tensor or per "
         "bucket, 2-bit codes packed 4 per byte",
         Param("bucket", int, 0, "entries per scale (0: one scale per tensor)", **BUCKET), SEED,
         residual_param(False),
         Param("share_scale", bool, False, "scaler sharing (Wen et al.): the scales are gathered first "
               "and every rank uses their max over ranks, so the codes share one scale"),
         wire=_wire_for("terngrad"), merge=PER_MEMBER, same_shape=True)
register("qsgd", GATHERED, "QSGD: s levels, stochastic rounding, scaled by the bucket's L2 norm; codes "
         "of ceil(log2(2s+1)) bits packed (fixed width)",
         Param("levels", int, 7, "s, the quantization levels per sign (codes in [-s, s])", low=1, high=127),
         Param("bucket", int, 512, "entries per norm (0: one norm per tensor)", **BUCKET), SEED,
         residual_param(False), wire=_wire_for("qsgd"), merge=PER_MEMBER, same_shape=True)


# -- layout shared by the backends -----------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Where the scales of an exchange sit: one segment per bucket of each member, in order.

    spans   (offset, numel) of each member in the flat tensor
    counts  entries of each segment (Python ints; a member of n entries and bucket b has
            ceil(n / b) segments, the last one shorter; bucket 0: one segment per member)
    """

    spans: Tuple[Tuple[int, int], ...]
    bucket: int
    counts: Tuple[int, ...]

    @property
    def segments(self) -> int:
        return len(self.counts)

    def member_segments(self) -> List[Tuple[int, int, int]]:
        """(offset, numel, segments) per member."""
        out = []
        for off, n in self.spans:
            out.append((off, n, 0 if n == 0 else (-(-n // self.bucket) if self.bucket else 1)))
        return out


def member_spans(members: Sequence, numel: int) -> Tuple[Tuple[int, int], ...]:
    """(offset, numel) per member; the whole flat tensor when no members are given."""
    if not members:
        return ((0, int(numel)),)
    return tuple((int(m.offset), int(m.numel)) for m in members)


def layout_for(members: Sequence, numel: int, bucket: int = 0) -> Layout:
    spans = member_spans(members, numel)
    counts: List[int] = []
    for off, n in spans:
        if n == 0:
            continue
        if bucket:
            counts.extend([bucket] * (n // bucket) + ([n % bucket] if n % bucket else []))
        else:
            counts.append(n)
    return Layout(spans, int(bucket), tuple(counts))


def bucket_reduce(v: np.ndarray, lay: Layout, op: str) -> np.ndarray:
    """Per segment: "max" (of v, >= 0) or "sum" (in v's dtype), zero-padded buckets."""
    out = []
    for off, n, nb in lay.member_segments():
        if nb == 0:
            continue
        part = v[off:off + n]
        width = lay.bucket if lay.bucket else n
        grid = np.zeros(nb * width, dtype=v.dtype)
        grid[:n] = part
        grid = grid.reshape(nb, width)
        out.append(grid.max(axis=1) if op == "max" else grid.sum(axis=1))
    return np.concatenate(out) if out else np.zeros(0, dtype=v.dtype)


def expand(scales: np.ndarray, lay: Layout) -> np.ndarray:
    """Every entry's segment value (entries outside every member get 0)."""
    total = sum(n for _, n in lay.spans)
    if lay.spans == ((0, total),):
        return np.repeat(scales, lay.counts)
    out = np.zeros(max((o + n for o, n in lay.spans), default=0), dtype=scales.dtype)
    i = 0
    for off, n, nb in lay.member_segments():
        out[off:off + n] = np.repeat(scales[i:i + nb], lay.counts[i:i + nb])
        i += nb
    return out


def _join(scales: np.ndarray, packed: np.ndarray) -> np.ndarray:
    return np.concatenate([np.ascontiguousarray(scales, dtype=F32).view(np.uint8), packed])


def _split(buf: np.ndarray, nscales: int) -> Tuple[np.ndarray, np.ndarray]:
    head = SCALE_BYTES * nscales
    return np.ascontiguousarray(buf[:head]).view(F32), buf[head:]


def column_spans(members: Sequence, numel: int, shape: Sequence[int] = ()) -> Tuple[Tuple[int, int, int], ...]:
    """(offset, rows, columns) per non-empty member, each viewed as (shape[0], -1); a 1-D (or 0-D)
    member is one column. Without members: the flat tensor, shaped ``shape`` when that matches."""
    if not members:
        shape = tuple(int(d) for d in shape)
        members = (Member("", shape if shape and int(np.prod(shape, dtype=np.int64)) == numel else (int(numel),), 0),)
    out = []
    for m in members:
        n, shp = int(m.numel), tuple(int(d) for d in m.shape)
        if n == 0:
            continue
        rows = shp[0] if len(shp) >= 2 else n
        out.append((int(m.offset), rows, n // rows))
    return tuple(out)


def payload_bytes(name: str, params, numel: int, members: Sequence = (), shape: Sequence[int] = ()) -> int:
    """Bytes one rank sends for an exchange of ``numel`` entries (what the backends allgather);
    ``shape`` (the tensor's, when no members are given) matters for ``onebit:scope=column`` only."""
    if name == "onebit" and params.get("scope") == "column":
        columns = sum(c for _, _, c in column_spans(members, numel, shape))
        return SCALE_BYTES * 2 * columns + packed_size(numel, 1)
    nscales = {"signsgd": 0, "efsignsgd": 1, "onebit": 2}
    lay = layout_for(members, numel, params.get("bucket", 0))
    per = nscales.get(name)
    scales = lay.segments * (1 if per is None else per)
    return SCALE_BYTES * scales + packed_size(numel, _codes_bits(name, params))


# -- oracles ---------------------------------------------------------------------------------------
class _PackedOracle(OneRoundOracle):
    summed = False
    fields = ("packed",)
    bits = 1
    scales_per_segment = 0

    def layout(self, numel, ctx) -> Layout:
        return layout_for(ctx.members, numel, self.spec.params.get("bucket", 0))

    @abstractmethod
    def encode(self, a, lay, ctx) -> Tuple[np.ndarray, np.ndarray]:
        """(float32 scales, uint8 codes)."""

    @abstractmethod
    def decode(self, scales, codes, lay, numel, ctx) -> np.ndarray:
        """The dense tensor the scales and codes stand for."""

    def payload(self, a, ctx):
        lay = self.layout(a.size, ctx)
        scales, codes = self.encode(a.astype(F32), lay, ctx)
        return {"packed": _join(scales, pack(codes, self.bits))}

    def scale_count(self, lay, numel, ctx) -> int:
        """float32 scales at the head of a payload."""
        return lay.segments * self.scales_per_segment

    def _decode_buffer(self, buf, numel, ctx):
        lay = self.layout(numel, ctx)
        scales, packed = _split(buf, self.scale_count(lay, numel, ctx))
        return self.decode(scales, unpack(packed, self.bits, numel), lay, numel, ctx)

    def decompress(self, payload, numel, dtype, ctx):
        return self._decode_buffer(payload["packed"], numel, ctx).astype(dtype)

    def aggregate(self, results, numel, dtype, ctx):
        parts = results[0].reshape(ctx.world_size, -1)
        total = self._decode_buffer(parts[0], numel, ctx)
        for part in parts[1:]:  # rank order
            total = total + self._decode_buffer(part, numel, ctx)
        return total.astype(dtype)


def sign_bits(a: np.ndarray) -> np.ndarray:
    return (a >= 0).astype(np.uint8)


class SignSGDOracle(_PackedOracle):
    name = "signsgd"

    def encode(self, a, lay, ctx):
        return np.zeros(0, F32), sign_bits(a)

    def aggregate(self, results, numel, dtype, ctx):
        parts = results[0].reshape(ctx.world_size, -1)
        votes = np.zeros(numel, dtype=np.int32)
        for part in parts:
            votes += 2 * unpack(part, 1, numel).astype(np.int32) - 1
        return (np.sign(votes).astype(F32) * F32(ctx.world_size)).astype(dtype)

    def decode(self, scales, codes, lay, numel, ctx):
        return codes.astype(F32) * F32(2) - F32(1)


class _MomentumInside:
    """Momentum before compression (the module doc): the exchange compresses the velocity."""

    def exchange(self, x, ctx):
        m = momentum_of(self.spec)
        if m > 0.0 and self.spec["momentum_correction"]:
            g = np.asarray(x)
            u = ctx.state.get("u")
            if u is None:
                u = ctx.state["u"] = np.zeros_like(g)
            mf = g.dtype.type(m)
            u[:] = u * mf + g
            x = g + u * mf if self.spec["nesterov"] else u.copy()
        return (yield from super().exchange(x, ctx))


class EFSignSGDOracle(_MomentumInside, _PackedOracle):
    name = "efsignsgd"
    scales_per_segment = 1

    def encode(self, a, lay, ctx):
        sums = bucket_reduce(np.abs(a).astype(np.float64), lay, "sum")
        return (sums / np.asarray(lay.counts, np.float64)).astype(F32), sign_bits(a)

    def decode(self, scales, codes, lay, numel, ctx):
        s = expand(scales, lay)
        return np.where(codes == 1, s, -s)


class OneBitOracle(_MomentumInside, _PackedOracle):
    name = "onebit"
    scales_per_segment = 2

    def columns(self, numel, ctx):
        return column_spans(ctx.members, numel, ctx.shape) if self.spec["scope"] == "column" else None

    def scale_count(self, lay, numel, ctx) -> int:
        cols = self.columns(numel, ctx)
        return super().scale_count(lay, numel, ctx) if cols is None else 2 * sum(c for _, _, c in cols)

    def encode(self, a, lay, ctx):
        cols = self.columns(a.size, ctx)
        if cols is not None:
            return encode_columns(a, cols), sign_bits(a)
        bits = sign_bits(a)
        a64 = a.astype(np.float64)
        pos_sum = bucket_reduce(np.where(bits == 1, a64, 0.0), lay, "sum")
        pos_n = bucket_reduce(bits.astype(np.float64), lay, "sum")
        neg_sum = bucket_reduce(np.where(bits == 1, 0.0, a64), lay, "sum")
        neg_n = np.asarray(lay.counts, np.float64) - pos_n
        with np.errstate(invalid="ignore", divide="ignore"):
            pos = np.where(pos_n > 0, pos_sum / pos_n, 0.0).astype(F32)
            neg = np.where(neg_n > 0, neg_sum / neg_n, 0.0).astype(F32)
        return np.stack([pos, neg], axis=1).reshape(-1), bits  # (pos, neg) per tensor

    def decode(self, scales, codes, lay, numel, ctx):
        cols = self.columns(numel, ctx)
        if cols is not None:
            return decode_columns(scales, codes, cols, numel)
        pn = scales.reshape(-1, 2)
        return np.where(codes == 1, expand(pn[:, 0].copy(), lay), expand(pn[:, 1].copy(), lay))


def encode_columns(a: np.ndarray, cols) -> np.ndarray:
    """Per column of every member (``column_spans``): (mean of the entries >= 0, mean of the
    others), float64 sums rounded once to float32, 0 for an empty part; pairs in column order."""
    out = []
    for off, rows, c in cols:
        part = a[off:off + rows * c].astype(np.float64).reshape(rows, c)
        one = part >= 0
        pos_n = one.sum(axis=0).astype(np.float64)
        neg_n = rows - pos_n
        pos_sum = np.where(one, part, 0.0).sum(axis=0)
        neg_sum = np.where(one, 0.0, part).sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            pos = np.where(pos_n > 0, pos_sum / pos_n, 0.0).astype(F32)
            neg = np.where(neg_n > 0, neg_sum / neg_n, 0.0).astype(F32)
        out.append(np.stack([pos, neg], axis=1).reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, F32)


def decode_columns(scales: np.ndarray, codes: np.ndarray, cols, numel: int) -> np.ndarray:
    """Every entry's column value for its bit (entries outside every member get 0)."""
    out = np.zeros(numel, F32)
    i = 0
    for off, rows, c in cols:
        pn = scales[2 * i:2 * (i + c)].reshape(c, 2)
        bits = codes[off:off + rows * c].reshape(rows, c)
        out[off:off + rows * c] = np.where(bits == 1, pn[None, :, 0], pn[None, :, 1]).reshape(-1)
        i += c
    return out


class TernGradOracle(_PackedOracle):
    name = "terngrad"
    bits = 2
    scales_per_segment = 1

    def ternarize(self, a, s, lay, ctx):
        """2-bit codes of ``a`` for scales ``s``: keep |a| / s with probability, sign in the code."""
        mag = np.abs(a)
        se = expand(s, lay)
        with np.errstate(invalid="ignore", divide="ignore"):
            p = np.where(se > 0, mag / se, F32(0)).astype(F32)
        u = uniform(a.size, self.spec["seed"], ctx.step, ctx.key, ctx.rank)
        keep = u < p
        return np.where(keep, np.where(a >= 0, 1, 2), 0).astype(np.uint8)

    def encode(self, a, lay, ctx):
        s = bucket_reduce(np.abs(a), lay, "max").astype(F32)
        return s, self.ternarize(a, s, lay, ctx)

    def decode(self, scales, codes, lay, numel, ctx):
        s = expand(scales, lay)
        return np.where(codes == 1, s, np.where(codes == 2, -s, F32(0))).astype(F32)

    def exchange(self, x, ctx):
        if not self.spec["share_scale"]:
            return (yield from super().exchange(x, ctx))
        use_residual = bool(self.spec["residual"])
        r = ctx.state.get("residual")
        a = x + r if (use_residual and r is not None) else x
        a32 = a.astype(F32)
        lay = self.layout(a.size, ctx)
        local = bucket_reduce(np.abs(a32), lay, "max").astype(F32)
        (gathered,) = yield (Allgather(local, same_shape=True),)
        s = gathered.reshape(ctx.world_size, -1).max(axis=0)  # exact in any order
        codes = self.ternarize(a32, s, lay, ctx)
        if use_residual:
            ctx.state["residual"] = a - self.decode(s, codes, lay, a.size, ctx).astype(a.dtype)
        (packed,) = yield (Allgather(pack(codes, self.bits), same_shape=True),)
        votes = np.zeros(a.size, dtype=np.int32)
        for part in packed.reshape(ctx.world_size, -1):  # integer sum: any order
            got = unpack(part, self.bits, a.size).astype(np.int32)
            votes += (got == 1).astype(np.int32) - (got == 2).astype(np.int32)
        total = (votes.astype(F32) * expand(s, lay)).astype(a.dtype)
        return (total * F32(ctx.scale)).astype(F32)


class QSGDOracle(_PackedOracle):
    name = "qsgd"
    scales_per_segment = 1

    def __init__(self, spec):
        super().__init__(spec)
        self.bits = bits_for_levels(_levels(spec.params))

    def encode(self, a, lay, ctx):
        s = self.spec["levels"]
        sq = bucket_reduce(a.astype(np.float64) ** 2, lay, "sum")
        v = np.sqrt(sq).astype(F32)
        with np.errstate(divide="ignore"):
            f = np.where(v > 0, F32(s) / v, F32(0)).astype(F32)
        r = (np.abs(a) * expand(f, lay)).astype(F32)
        low = np.floor(r)
        u = uniform(a.size, self.spec["seed"], ctx.step, ctx.key, ctx.rank)
        level = np.minimum(low + (u < (r - low)).astype(F32), F32(s))
        signed = np.where(a >= 0, level, -level)
        return v, (signed + F32(s)).astype(np.uint8)

    def decode(self, scales, codes, lay, numel, ctx):
        s = self.spec["levels"]
        w = (scales * F32(1.0 / s)).astype(F32)
        return ((codes.astype(F32) - F32(s)) * expand(w, lay)).astype(F32)
