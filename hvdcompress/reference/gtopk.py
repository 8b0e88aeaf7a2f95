"""Global top-k (gTop-k; Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k
Sparsification for Low Bandwidth Networks", arXiv 1901.04359), declared and defined in numpy.

Every rank selects its local top-k of a = g + r (k = ceil(ratio * n), ties to the lower index, as
``topk``). Instead of gathering all P selections (each rank receives (P - 1) k pairs), the ranks
merge them pairwise by recursive doubling: in round i rank q and rank q XOR 2^i swap their current
k-sparse vectors, both add them up (the union of the indices, values summed where both have one)
and keep the top k of the sum. After log2 P rounds every rank holds the same k-sparse vector, the
global top-k; each rank received k pairs per round, O(k log P) bytes in all.

World sizes that are not a power of two: with p the largest power of two <= P, rank p + j
(j < P - p) first folds its selection into rank j (a merge and re-selection there), the first p
ranks double, and rank j finally sends the result to rank p + j, one byte more per pair: whether
rank p + j's contribution is in that entry (rank j kept track of it). Two rounds and k pairs more.

Error semantics. The result holds exactly k entries, times the average's scale. An entry of a rank's selection reaches the result when its index survives every
re-selection of the sets that carry it; what does not -- dropped by a merge of any round, or not
selected at all -- stays in that rank's residual, so nothing is lost, only delayed (the paper puts
a rank's locally selected but globally dropped entries back into its residual; this follows the
contribution itself, so an index dropped in one round that comes back from another rank's side in
a later round, without this rank's value, also stays here). Hence, with ``residual``, over all
ranks: sum of the residuals + P * scale * result == sum of the compensated gradients, up to the
rounding of the merged sums.

Wire: each round is one ``Alltoall`` of a uint8 tensor whose rows are (index bytes, value bytes
[, flag byte]), with rows only for the partner; ranks without a partner in a round send and
receive nothing but still take part. ``received_bytes`` / ``worker_bytes`` are the bytes per rank
as a function of P (against ``allgather_bytes``, top-k's gather), for the cost model.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from ..contract import Alltoall
from ..registry import GATHERED, RATIO_RANGE, SUMMED, Param, Round, num_selected, register, residual_param
from ..sampling import index_dtype
from ..wire import index_bytes, selected
from .oracle import Oracle
from .selection import topk_indices

# -- the plan: who sends to whom in each round (pure) -----------------------------------------------
FOLD, PAIR, UNFOLD = "fold", "pair", "unfold"


def plan(world: int) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """The rounds of a gTop-k exchange among ``world`` ranks: (kind, destination of every rank's
    message, -1 where a rank sends nothing). ``FOLD``: rank p + j sends its selection to rank j;
    ``PAIR``: rank q and q XOR 2^i swap (q < p); ``UNFOLD``: rank j sends the result to p + j
    (p: the largest power of two <= world). No round for one rank."""
    if world < 1:
        raise ValueError(f"gtopk: world must be >= 1; got {world}")
    p = 1 << (world.bit_length() - 1)
    extra = world - p
    rounds = []
    if extra:
        rounds.append((FOLD, tuple(q - p if q >= p else -1 for q in range(world))))
    step = 1
    while step < p:
        rounds.append((PAIR, tuple(q ^ step if q < p else -1 for q in range(world))))
        step <<= 1
    if extra:
        rounds.append((UNFOLD, tuple(q + p if q < extra else -1 for q in range(world))))
    return tuple(rounds)


def sources(dest: Tuple[int, ...], rank: int) -> List[int]:
    """The ranks that send to ``rank`` in a round of ``plan`` (none or one)."""
    return [q for q, d in enumerate(dest) if d == rank]


def row_bytes(kind: str, itemsize: int, index_size: int = 4) -> int:
    """Bytes of one pair on the wire in a round of ``kind`` (``UNFOLD`` adds the flag byte)."""
    return index_size + itemsize + (1 if kind == UNFOLD else 0)


def received_bytes(world: int, k: int, itemsize: int = 4, index_size: int = 4) -> List[int]:
    """Payload bytes each rank receives in one exchange of k pairs (``itemsize``-byte values,
    ``index_size``-byte indices) among ``world`` ranks: k pairs per round it has a partner in,
    log2 P rounds (one or two more where P is not a power of two)."""
    got = [0] * world
    for kind, dest in plan(world):
        for q, d in enumerate(dest):
            if d >= 0:
                got[d] += k * row_bytes(kind, itemsize, index_size)
    return got


def sent_bytes(world: int, k: int, itemsize: int = 4, index_size: int = 4) -> List[int]:
    """Payload bytes each rank sends in one exchange (the transposed ``received_bytes``)."""
    out = [0] * world
    for kind, dest in plan(world):
        for q, d in enumerate(dest):
            if d >= 0:
                out[q] += k * row_bytes(kind, itemsize, index_size)
    return out


def worker_bytes(world: int, k: int, itemsize: int = 4, index_size: int = 4) -> int:
    """The most payload bytes any rank receives in one exchange of a k-pair gTop-k among ``world``
    ranks: k (index_size + itemsize) log2 P for a power of two P, k (index_size + itemsize)
    (floor(log2 P) + 1) otherwise (rank j < P - p also takes the fold). What the cost model charges
    per tensor and step; O(k log P)."""
    return max(received_bytes(world, k, itemsize, index_size))


def allgather_bytes(world: int, k: int, itemsize: int = 4, index_size: int = 4) -> int:
    """What each rank receives from ``topk`` 's gather of the same k pairs: (P - 1) k pairs, O(kP)."""
    return (world - 1) * k * (index_size + itemsize)


def _wire(params, d, itemsize, world, density):
    """One round per round of ``plan(world)``, k pairs each (the unfold: one byte more per pair),
    priced as an allreduce of those bytes (a pairwise swap moves half of what a ring allreduce of
    the same bytes moves: the cost model has no pairwise fit). A world of one sends nothing."""
    k = selected(density if density is not None else params["ratio"], d)
    ib = index_bytes(d)
    if world < 2:
        return (Round(SUMMED, 0, 0 * k),)
    return tuple(Round(SUMMED, 1, k * (ib + itemsize + (1 if kind == UNFOLD else 0))) for kind, _ in plan(world))


register("gtopk", GATHERED, "global top-k (gTop-k): each rank's k = ceil(ratio * numel) largest entries merged "
         "pairwise by recursive doubling, keeping the top k of each sum, so every rank receives O(k log P) "
         "bytes instead of top-k's O(kP); the result has k entries, what it drops stays in the residuals.",
         Param("ratio", float, 0.01, "fraction of entries kept (locally and in the global result)", **RATIO_RANGE),
         residual_param(True), wire=_wire,
         horovod_refusal="it exchanges in log2 P rounds of pairwise swaps with a merge between them, and "
                         "Horovod's compress(tensor) is one payload")


# -- the rows on the wire -----------------------------------------------------------------------------
def pack(indices: np.ndarray, values: np.ndarray, index_type, flags=None) -> np.ndarray:
    """(m, row bytes) uint8 rows: each index in ``index_type``, its value's bytes, its flag byte."""
    m = indices.size
    cols = [np.ascontiguousarray(indices.astype(index_type)).view(np.uint8).reshape(m, -1),
            np.ascontiguousarray(values).view(np.uint8).reshape(m, -1)]
    if flags is not None:
        cols.append(flags.astype(np.uint8).reshape(m, 1))
    return np.concatenate(cols, axis=1) if m else np.zeros((0, sum(c.shape[1] for c in cols)), np.uint8)


def unpack(rows: np.ndarray, index_type, dtype, flagged: bool):
    """``pack`` 's inverse: (indices as int64, values, flags as bool or None)."""
    ib, vb = np.dtype(index_type).itemsize, np.dtype(dtype).itemsize
    rows = np.ascontiguousarray(rows)
    idx = np.ascontiguousarray(rows[:, :ib]).view(index_type).reshape(-1).astype(np.int64)
    vals = np.ascontiguousarray(rows[:, ib:ib + vb]).view(dtype).reshape(-1)
    flags = rows[:, ib + vb].astype(bool) if flagged else None
    return idx, vals, flags


def merge(ia: np.ndarray, va: np.ndarray, ib: np.ndarray, vb: np.ndarray, k: int):
    """Two k-sparse vectors (indices ascending, distinct) summed, then the top k of the sum (ties to
    the lower index): (indices, values). Each sum is 0 + a + b in the values' dtype, the same on
    both partners (two float additions commute)."""
    union = np.union1d(ia, ib)
    vals = np.zeros(union.size, dtype=va.dtype)
    np.add.at(vals, np.searchsorted(union, ia), va)
    np.add.at(vals, np.searchsorted(union, ib), vb)
    keep = topk_indices(vals, k).astype(np.int64)
    return union[keep], vals[keep]


def global_topk(indices: np.ndarray, values: np.ndarray, k: int, n: int, ctx):
    """The rounds of ``plan`` over this rank's k-sparse vector (indices ascending, of an n-entry
    tensor), as a sub-generator (``yield from``): returns (the global indices, their summed values,
    the indices of this rank's own entries whose contribution is in them). Any selection that
    sends k pairs can be aggregated this way (top-k here)."""
    idx, vals = indices, values
    mine, folded = indices, None  # folded: the entries of rank p + j still in rank j's set
    itype = index_dtype(n)
    world, rank = ctx.world_size, ctx.rank
    for kind, dest in (plan(world) if world > 1 and k else ()):
        to = dest[rank]
        rows = np.zeros((0, row_bytes(kind, values.dtype.itemsize, itype.itemsize)), np.uint8)
        if to >= 0:
            rows = pack(idx, vals, itype, np.isin(idx, folded) if kind == UNFOLD else None)
        splits = tuple(rows.shape[0] if q == to else 0 for q in range(world))
        (got,) = yield (Alltoall(rows, splits),)
        if not sources(dest, rank):
            continue
        their_idx, their_vals, flags = unpack(got, itype, values.dtype, kind == UNFOLD)
        if kind == UNFOLD:  # the result, and which of its entries carry my contribution
            idx, vals, mine = their_idx, their_vals, their_idx[flags]
            continue
        if kind == FOLD:
            folded = their_idx
        idx, vals = merge(idx, vals, their_idx, their_vals, k)
        mine = mine[np.isin(mine, idx)]
        if folded is not None:
            folded = folded[np.isin(folded, idx)]
    return idx, vals, mine


class GlobalTopKOracle(Oracle):
    name = "gtopk"

    def exchange(self, x, ctx):
        n = x.size
        k = num_selected(self.spec["ratio"], n)
        use_residual = bool(self.spec["residual"])
        r = ctx.state.get("residual")
        a = x + r if (use_residual and r is not None) else x
        own = topk_indices(a, k).astype(np.int64)
        idx, vals, mine = yield from global_topk(own, a[own], k, n, ctx)
        if use_residual:
            left = a.copy()
            left[mine] = 0
            ctx.state["residual"] = left
        out = np.zeros(n, dtype=a.dtype)
        out[idx] = vals
        return (out * np.float32(ctx.scale)).astype(np.float32)
