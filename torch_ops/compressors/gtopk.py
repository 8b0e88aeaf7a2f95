"""Global top-k (gTop-k): local top-k, then log2 P rounds of pairwise swaps by recursive doubling,
each merging two k-sparse vectors and keeping the top k of their sum (one or two rounds more where
P is not a power of two). The algorithm, its rounds and its error semantics are the oracle's,
``hvdcompress.reference.gtopk``, which this follows operation for operation.

A swap is an ``Alltoall`` whose only non-empty piece goes to the partner: uint8 rows of (index
bytes, value bytes [, flag byte]), one request per round. State: the residual (``residual=true``),
the compensated a = g + r with this rank's delivered entries zeroed; while the rounds run it holds
a without the local selection (what top-k would keep), and the entries the merges dropped are put
back when the last round is in.
"""

from __future__ import annotations

import torch

from hvdcompress.reference.gtopk import FOLD, UNFOLD, plan, row_bytes, sources
from hvdcompress.sampling import index_dtype
from hvdcompress.spec import num_selected

from ..collectives import Alltoall
from ..memory import memory_for
from .base import Compressor
from .selection import topk_indices


def _index_type(numel: int) -> torch.dtype:
    return torch.int32 if index_dtype(numel).itemsize == 4 else torch.int64


def pack(indices: torch.Tensor, values: torch.Tensor, index_type: torch.dtype, flags=None) -> torch.Tensor:
    """(m, row bytes) uint8 rows: index, value bytes, flag byte (the oracle's ``pack``); m > 0."""
    m = indices.numel()
    cols = [indices.to(index_type).contiguous().view(torch.uint8).reshape(m, -1),
            values.contiguous().view(torch.uint8).reshape(m, -1)]
    if flags is not None:
        cols.append(flags.to(torch.uint8).reshape(m, 1))
    return torch.cat(cols, dim=1)


def _column_bytes(rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes start:stop of every row, flat, in a buffer of their own (aligned for a view as a wider dtype)."""
    return rows[:, start:stop].clone(memory_format=torch.contiguous_format).reshape(-1)


def unpack(rows: torch.Tensor, index_type: torch.dtype, dtype: torch.dtype, flagged: bool):
    """``pack`` 's inverse: (indices as int64, values, flags as bool or None)."""
    ib = torch.empty(0, dtype=index_type).element_size()
    vb = torch.empty(0, dtype=dtype).element_size()
    idx = _column_bytes(rows, 0, ib).view(index_type).long()
    vals = _column_bytes(rows, ib, ib + vb).view(dtype)
    flags = rows[:, ib + vb].bool() if flagged else None
    return idx, vals, flags


def merge(ia: torch.Tensor, va: torch.Tensor, ib: torch.Tensor, vb: torch.Tensor, k: int):
    """Two k-sparse vectors summed (0 + a + b in the values' dtype), then the top k of the sum, ties
    to the lower index: (indices ascending, values)."""
    union = torch.unique(torch.cat([ia, ib]))  # sorted
    vals = torch.zeros(union.numel(), dtype=va.dtype, device=va.device)
    vals.index_add_(0, torch.searchsorted(union, ia), va)
    vals.index_add_(0, torch.searchsorted(union, ib), vb)
    keep = topk_indices(vals, k)
    return union[keep], vals[keep]


def global_topk(indices: torch.Tensor, values: torch.Tensor, k: int, n: int, ctx):
    """The rounds over this rank's k-sparse vector, as a sub-generator (``yield from``): returns
    (global indices, their summed values, this rank's own indices whose contribution is in them);
    the oracle's ``global_topk``."""
    idx, vals = indices, values
    mine, folded = indices, None
    itype = _index_type(n)
    world, rank = ctx.world_size, ctx.rank
    for kind, dest in (plan(world) if world > 1 and k else ()):
        to = dest[rank]
        if to >= 0:
            rows = pack(idx, vals, itype, torch.isin(idx, folded) if kind == UNFOLD else None)
        else:
            rows = torch.zeros((0, row_bytes(kind, values.element_size(), itype.itemsize)), dtype=torch.uint8,
                               device=values.device)
        splits = tuple(rows.shape[0] if q == to else 0 for q in range(world))
        (got,) = yield (Alltoall(rows, splits),)
        if not sources(dest, rank):
            continue
        their_idx, their_vals, flags = unpack(got.to(values.device), itype, values.dtype, kind == UNFOLD)
        if kind == UNFOLD:
            idx, vals, mine = their_idx, their_vals, their_idx[flags]
            continue
        if kind == FOLD:
            folded = their_idx
        idx, vals = merge(idx, vals, their_idx, their_vals, k)
        mine = mine[torch.isin(mine, idx)]
        if folded is not None:
            folded = folded[torch.isin(folded, idx)]
    return idx, vals, mine


class GlobalTopKCompressor(Compressor):
    name = "gtopk"
    summed = False

    def __init__(self, spec):
        super().__init__(spec)
        self.memory = memory_for(spec)

    def exchange(self, x, ctx):
        n = x.numel()
        k = num_selected(self.spec["ratio"], n)
        a = self.memory.compensate(x, ctx.state)
        own = topk_indices(a, k)
        own_vals = a[own]
        use_residual = bool(self.spec["residual"])
        if use_residual:  # the local selection leaves a (in the residual's buffer when a lives there)
            r = a if a is ctx.state.get("residual") else a.clone()
            ctx.state["residual"] = r.index_fill_(0, own, 0)
        idx, vals, mine = yield from global_topk(own, own_vals, k, n, ctx)
        if use_residual and mine.numel() != own.numel():  # the merges dropped some: back to the residual
            dropped = ~torch.isin(own, mine)
            ctx.state["residual"][own[dropped]] = own_vals[dropped]
        out = ctx.out
        if out is None or out.shape != a.shape or out.dtype != a.dtype:
            out = torch.zeros_like(a)
        else:
            out.zero_()
        out[idx] = vals * ctx.scale if ctx.scale != 1.0 else vals
        return out
