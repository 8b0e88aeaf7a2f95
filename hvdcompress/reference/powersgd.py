"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019), declared and defined in numpy: the oracle.

Per tensor of shape (n, ...) viewed as an n x m matrix (m = the product of the other dimensions),
rank r, with error feedback (state ``residual``, n*m entries) and a warm-started Q (state ``q``,
m*r entries, the same on every rank):

    M = G + E                                   (E: the residual, when ``residual``)
    Q = q, or when q is absent or all zero: uniform(m*r, seed, step, key, rank 0) - 0.5
    P = M Q                        round 1: P <- allreduce(P)           (n*r floats)
    P^ = orthogonalize(P)          Gram-Schmidt on the columns, in order (a zero column stays 0)
    Q = M^T P^;  E = M - P^ Q^T    (the local decompression, as in the paper's Algorithm 2)
                                   round 2: Q <- allreduce(Q)           (m*r floats)
    result = (P^ Q^T) * scale;  q = Q  (the summed Q warm-starts the next step)

Tensors with one dimension (biases, norms), and matrices where the factors are no smaller than the
matrix ((n + m) * r >= n * m), are exchanged dense: one allreduce, no state. One power iteration
per step, as in the paper. The state is shaped by the matrix, so tensors are never merged
(``merge=LAYERWISE``: ``schedule="auto"`` runs layerwise).

Numbers: the matrix products and dot products are float32 with the framework's own summation
order, so torch and TensorFlow agree with this oracle closely, not bit for bit (Gram-Schmidt amplifies
last-bit differences by the ratio of P's singular values; the tests allow 1e-4 of the largest
magnitude over 4 steps); within one framework every rank computes the same result from the same summed P and Q.
"""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np

from ..rng import uniform
from ..spec import SUMMED, LAYERWISE, Param, Round, register, residual_param
from ..contract import Allreduce, ExchangeContext
from .oracle import Oracle

F32 = np.float32


def matrix_shape(shape: Tuple[int, ...]) -> Tuple[int, int]:
    """(n, m) of the matrix view of a tensor of ``shape``: (shape[0], product of the rest)."""
    n = int(shape[0]) if shape else 1
    return n, int(math.prod(shape[1:])) if len(shape) > 1 else 1


def is_compressed(shape: Tuple[int, ...], rank: int) -> bool:
    """A tensor is exchanged as rank-r factors when it has 2+ dimensions and the factors are
    smaller than the matrix."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    return (n + m) * rank < n * m


def _wire(params, d, itemsize, world, density):
    """Square matrices assumed (only sizes are known here; ``_shaped_wire`` where the shape is): n = m = sqrt(d); 2 allreduces of
    sqrt(d)*r values; dense (one allreduce of d, no second round) when 2*sqrt(d)*r >= d. The measured bytes
    (``opt.stats``) use the real shapes: (n + m) * r * itemsize per matrix (P and Q travel in the
    gradient's dtype)."""
    r = params["rank"]
    side = np.sqrt(d)
    dense = 2 * side * r >= d
    return (Round(SUMMED, 1, np.where(dense, d * itemsize, side * r * itemsize)),
            Round(SUMMED, np.where(dense, 0, 1), np.where(dense, 0, side * r * itemsize)))


def _shaped_wire(params, shape, itemsize):
    """One tensor of a known shape, as the exchange sends it: a compressed matrix n x m sends P
    (n*r values), then Q (m*r values); any other tensor one dense allreduce."""
    r = params["rank"]
    if not is_compressed(shape, r):
        numel = math.prod(shape) if shape else 1
        return (Round(SUMMED, 1, float(numel * itemsize)),)
    n, m = matrix_shape(shape)
    return (Round(SUMMED, 1, float(n * r * itemsize)), Round(SUMMED, 1, float(m * r * itemsize)))


register("powersgd", SUMMED, "PowerSGD: rank-r factors P, Q of each matrix by one power iteration "
         "(warm-started Q, Gram-Schmidt on P, error feedback), two allreduces; 1-D tensors dense",
         Param("rank", int, 2, "rank r of the approximation", low=1, high=2 ** 16),
         Param("seed", int, 0, "seed of the initial Q (the same on every rank)", low=0, high=2 ** 32 - 1),
         residual_param(True), wire=_wire, merge=LAYERWISE, shaped_wire=_shaped_wire,
         horovod_refusal="it needs two allreduce rounds (P, then Q) and state (Q, the residual); Horovod's "
                         "protocol has one allreduce and no state")


def orthogonalize(p: np.ndarray) -> np.ndarray:
    """Gram-Schmidt (modified) on the columns of p, in order; a zero column stays zero."""
    p = p.astype(F32, copy=True)
    for i in range(p.shape[1]):
        col = p[:, i]
        for j in range(i):
            col = col - np.dot(p[:, j], col) * p[:, j]
        norm = np.sqrt(np.dot(col, col))
        p[:, i] = col / norm if norm > 0 else np.zeros_like(col)
    return p


def initial_q(m: int, rank: int, seed: int, step: int, key: str) -> np.ndarray:
    return (uniform(m * rank, seed, step, key, 0) - F32(0.5)).reshape(m, rank)


class PowerSGDOracle(Oracle):
    name = "powersgd"

    def exchange(self, x, ctx: ExchangeContext):
        p = self.spec.params
        r = p["rank"]
        x = np.asarray(x, dtype=F32).reshape(-1)
        shape = tuple(ctx.shape) if ctx.shape else (x.size,)
        if not is_compressed(shape, r):
            (total,) = yield (Allreduce(x.copy()),)
            return (total * F32(ctx.scale)).astype(F32)
        n, m = matrix_shape(shape)
        st = ctx.state
        mat = x.reshape(n, m)
        if p["residual"] and "residual" in st:
            mat = mat + st["residual"].reshape(n, m)
        q = st.get("q")
        if q is None or not q.any():
            q = initial_q(m, r, p["seed"], ctx.step, ctx.key)
        q = q.reshape(m, r)
        (psum,) = yield (Allreduce(mat @ q),)
        phat = orthogonalize(psum)
        qloc = mat.T @ phat
        if p["residual"]:
            st["residual"] = (mat - phat @ qloc.T).reshape(-1)
        (qsum,) = yield (Allreduce(qloc),)
        st["q"] = qsum.reshape(-1).copy()
        return ((phat @ qsum.T) * F32(ctx.scale)).astype(F32).reshape(-1)
