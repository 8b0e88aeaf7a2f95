"""Sketched-SGD (Ivkin, Rothchild, Ullah, Braverman, Stoica, Arora, NeurIPS 2019), step by step,
in numpy: the oracle, and the declaration of the ``sketch`` compressor.

Per worker and tensor (or merged group: a merged group is sketched as ONE vector), d entries,
N workers, state u (momentum) and v (accumulated velocity), both one entry per element:

    u <- m*u + g;  v <- v + u                  (momentum taken over from the wrapped SGD; m = 0:
                                                v <- v + g)
    S[j, h_j(i)] += s_j(i) * v[i]              r x c count sketch of v (positive and negative
                                                entries summed apart, each in index order)
    round 1:  S <- Allreduce(S)                r*c floats, summed (sketches are linear)
    est[i] = lower median over j of s_j(i) * S[j, h_j(i)]    (sorted ascending, element (r-1)//2)
    C = the P*k largest |est| (ties to the lower index), ascending
    round 2:  w <- Allreduce(v[C])             P*k floats, summed: the exact summed v at C
    I = the k entries of C with the largest |w| (ties to the lower index)
    result[I] = w[I] * scale (0 elsewhere);  u[I] <- 0;  v[I] <- 0 on every rank

Every decision is taken from summed data, so every rank selects the same I. The hashes h_j, s_j
are computed from (index, row, seed, crc32(key)) by ``hvdcompress.hashing`` (never stored per
entry): simple tabulation gives a 32-bit x_j(i), one multiply-shift turns it into a signed cell
y_j(i) in [0, 2c) (bucket y >> 1, sign - where y is odd). k = ``k`` if given, else ceil(ratio * d); c = ``cols`` if given, else ceil(cols_ratio * d).

Dense rule: a tensor with d < ``min_sketch_numel`` entries, or whose sketch would not be smaller
than the tensor (r*c + P*k >= d), is exchanged dense: u <- m*u + g; one Allreduce of u (d floats);
result = sum * scale (plain momentum SGD, as DGC's dense path; v stays zero).

Arithmetic is float32, one operation at a time in the order written. The sketch is built as 2c
signed cells per row (``signed_table``: v scattered by y, no sign multiply), each cell's entries
added in ascending index order (``np.add.at``), then folded: S[j, b] = cell[2b] - cell[2b+1]. The
estimate gathers s_j(i) * S[j, h_j(i)] as entry y_j(i) of [S, -S] interleaved. So the PyTorch and
TensorFlow ports match it bit for bit where their scatter-add keeps index order.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import numpy as np

from ..hashing import MAX_COLS, cells, row_keys
from ..spec import RATIO_RANGE, SUMMED, Param, Round, num_selected, register
from ..wire import selected
from ..contract import Allreduce, ExchangeContext
from .oracle import Oracle
from .selection import topk_indices

F32 = np.float32


class Geometry(NamedTuple):
    """What a sketch exchange of d entries does: k selected, r x c table, P*k candidates."""

    d: int
    k: int
    rows: int
    cols: int
    candidates: int
    dense: bool


def geometry(params: Dict[str, Any], d: int) -> Geometry:
    """The sizes for a tensor (or merged group) of ``d`` entries; the one rule all ports use."""
    d = int(d)
    k = min(d, params["k"]) if params["k"] is not None else num_selected(params["ratio"], d)
    cols = params["cols"] if params["cols"] is not None else max(1, num_selected(params["cols_ratio"], d))
    rows = params["rows"]
    cand = params["p2"] * k
    dense = d < params["min_sketch_numel"] or rows * cols + cand >= d
    return Geometry(d, k, rows, cols, cand, dense)


def lower_median(rows: np.ndarray) -> np.ndarray:
    """The lower median over axis 0: sorted ascending, element (r-1)//2 (the median for odd r)."""
    r = rows.shape[0]
    return np.sort(rows, axis=0)[(r - 1) // 2]


def signed_table(v: np.ndarray, keys, cols: int) -> np.ndarray:
    """The r x 2c table of signed cells: cell (j, y) = sum over i with y_j(i) = y of v[i], added
    in ascending index order, in v's dtype (even y: the positive entries of bucket y // 2, odd y:
    the negative ones; ``hvdcompress.hashing``)."""
    table = np.zeros((len(keys), 2 * cols), dtype=v.dtype)
    for j, rk in enumerate(keys):
        np.add.at(table[j], cells(rk, v.size, cols), v)
    return table


def fold(signed: np.ndarray) -> np.ndarray:
    """The count sketch from the signed cells: S[j, b] = cell[j, 2b] - cell[j, 2b + 1]."""
    return signed[:, 0::2] - signed[:, 1::2]


def sketch_table(v: np.ndarray, keys, cols: int) -> np.ndarray:
    """The r x c count sketch of v: S[j, b] = sum over i with h_j(i) = b of s_j(i)*v[i], as the
    positive entries' sum minus the negative entries' sum (each added in ascending index order)."""
    return fold(signed_table(v, keys, cols))


def unfold(table: np.ndarray) -> np.ndarray:
    """The r x 2c signed cells of a (summed) sketch: [S[j, 0], -S[j, 0], S[j, 1], -S[j, 1], ...],
    so that s_j(i) * S[j, h_j(i)] is entry y_j(i) (negation is exact)."""
    return np.stack([table, -table], axis=2).reshape(table.shape[0], -1)


def estimates(table: np.ndarray, keys, d: int) -> np.ndarray:
    """Every coordinate's estimate from a (summed) table: lower median of s_j(i) * S[j, h_j(i)]."""
    signed = unfold(table)
    cols = table.shape[1]
    per_row = np.empty((len(keys), d), dtype=table.dtype)
    for j, rk in enumerate(keys):
        per_row[j] = signed[j][cells(rk, d, cols)]
    return lower_median(per_row)


class SketchOracle(Oracle):
    """One rank's Sketched-SGD exchange (the module doc, in order); state "u", "v"."""

    name = "sketch"

    def exchange(self, x, ctx: ExchangeContext):
        p = self.spec.params
        g = np.asarray(x).reshape(-1)
        st = ctx.state
        u = st.setdefault("u", np.zeros_like(g))
        v = st.setdefault("v", np.zeros_like(g))
        m = g.dtype.type(p["momentum"])
        scale = g.dtype.type(ctx.scale)
        geo = geometry(p, g.size)
        u[:] = u * m + g
        if geo.dense:
            (total,) = yield (Allreduce(u.copy()),)
            return total * scale
        v[:] = v + u
        keys = row_keys(p["seed"], ctx.key, geo.rows)
        table = sketch_table(v, keys, geo.cols)
        (summed,) = yield (Allreduce(table.reshape(-1)),)
        est = estimates(summed.reshape(geo.rows, geo.cols), keys, g.size)
        cand = topk_indices(est, geo.candidates).astype(np.int64)
        (w,) = yield (Allreduce(v[cand]),)
        pos = topk_indices(w, geo.k).astype(np.int64)
        sel = cand[pos]
        total = np.zeros_like(g)
        total[sel] = w[pos]
        u[sel] = 0
        v[sel] = 0
        return total * scale


def _wire(params, d, itemsize, world, density):
    """Round 1: r*c floats (d floats for a dense tensor); round 2: P*k floats (no collective for
    a dense tensor), both summed. ``density`` is not used: the sizes follow from the spec."""
    d = np.asarray(d, dtype=float)
    k = np.minimum(d, params["k"]) if params["k"] is not None else selected(params["ratio"], d)
    cols = (np.full_like(d, params["cols"]) if params["cols"] is not None
            else np.maximum(1, selected(params["cols_ratio"], d)))
    cand = params["p2"] * k
    table = params["rows"] * cols
    dense = (d < params["min_sketch_numel"]) | (table + cand >= d)
    return (Round(SUMMED, 1, np.where(dense, d, table) * itemsize),
            Round(SUMMED, np.where(dense, 0, 1), np.where(dense, 0, cand) * itemsize))


register("sketch", SUMMED, "Sketched-SGD (Ivkin et al., NeurIPS 2019): momentum and error "
         "accumulation on the worker, an r x c count sketch of the accumulated velocity summed by "
         "allreduce, then the exact summed values of the P*k heavy-hitter candidates in a second "
         "allreduce; the k largest are applied and zeroed; small tensors are sent dense",
         Param("ratio", float, 0.01, "fraction of entries applied per step, k = ceil(ratio * numel) "
               "(unless k is given)", **RATIO_RANGE),
         Param("k", int, None, "entries applied per step (overrides ratio; at most numel)", low=1,
               optional=True),
         Param("rows", int, 5, "rows r of the count sketch (the estimate is their median)", low=1, high=32),
         Param("cols", int, None, "columns c of the count sketch (overrides cols_ratio)", low=1,
               high=MAX_COLS, optional=True),
         Param("cols_ratio", float, 0.02, "columns as a fraction of numel, c = ceil(cols_ratio * numel) "
               "(unless cols is given)", **RATIO_RANGE),
         Param("p2", int, 4, "candidates factor P: the second round fetches the exact summed values of "
               "the P*k largest estimates", low=1, high=1024),
         Param("momentum", float, 0.9, "momentum, applied in the compressor memory (an SGD optimizer's "
               "momentum is taken over)", low=0.0, high=1.0, high_open=True),
         Param("seed", int, 0, "seed of the sketch hashes, shared by all ranks", low=0, high=2**63 - 1),
         Param("min_sketch_numel", int, 1024, "tensors with fewer elements are sent dense (so are "
               "tensors whose sketch is not smaller: rows*cols + p2*k >= numel)", low=1),
         wire=_wire,
         horovod_refusal="it needs two rounds (the summed sketch, then the values at the candidates)")
