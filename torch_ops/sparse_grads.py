"""Sparse gradients (``nn.Embedding(sparse=True)``, ``torch.sparse_coo`` grads), exchanged sparse.

Horovod's own optimizer exchanges a sparse gradient as an allgather of its indices and of its
values, and rebuilds a sparse tensor of the sum (divided by the world size to average), so
``torch.optim.SparseAdam`` gets the sparse gradient it requires. This does the same, as an
exchange generator of the usual shape:

    indices, values = yield (Allgather(g.indices().t()), Allgather(g.values()))
    return sparse_coo_tensor(indices.t(), values * scale, g.shape)     (uncoalesced: duplicates add)

Compression is not applied to sparse gradients: they are already sparse (the rows a batch
touched), and every compressor here is defined on dense tensors. ``sparse_as_dense=True``
densifies them instead, so they are compressed like any other gradient. A parameter whose
gradient has been sparse is exchanged alone (never merged into a group), and delayed averaging
densifies sparse gradients (its corrections are dense).
"""

from __future__ import annotations

import torch

from .collectives import Allgather


def sparse_exchange(grad: torch.Tensor, scale: float):
    """Generator: the averaged (``scale`` = 1/N) or summed sparse gradient, every rank the same."""
    g = grad.coalesce()
    indices, values = yield (Allgather(g.indices().t().contiguous()), Allgather(g.values().contiguous()))
    if scale != 1.0:
        values = values * scale
    return torch.sparse_coo_tensor(indices.t(), values, g.shape)


def split_out(groups, sparse_names):
    """Groups (lists of names) with every name in ``sparse_names`` taken out into a group of its
    own, in place in the order: [a, b, S, c] -> [a, b], [S], [c]."""
    out = []
    for g in groups:
        run = []
        for n in g:
            if n in sparse_names:
                if run:
                    out.append(run)
                    run = []
                out.append([n])
            else:
                run.append(n)
        if run:
            out.append(run)
    return out
