"""PowerSGD (Vogels et al. 2019) in PyTorch: rank-r factors by one power iteration, two rounds.

A translation of the numpy oracle ``hvdcompress.reference.powersgd`` (which spells the algorithm
out): P = M Q summed (round 1), Gram-Schmidt on P, Q = M^T P^ summed (round 2), result P^ Q^T,
error feedback, the summed Q kept as the next step's warm start. 1-D tensors and matrices whose
factors are no smaller than the matrix are allreduced dense. State per tensor: ``residual`` (n*m
entries) and ``q`` (m*r entries, not elementwise: ``check_state`` knows its size), so the
compressor is never merged (``merge=LAYERWISE``). Allreduce sums in place: what a round's
results are needed for is computed before the next round is yielded. Large buffers are reused:
the compensation and the new residual live in the residual's buffer, the result in ``ctx.out``.
"""

from __future__ import annotations

import torch

from hvdcompress.reference.powersgd import is_compressed, matrix_shape

from ..collectives import Allreduce
from .base import Compressor
from .packing import uniform


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt (modified) on the columns, in order; a zero column stays zero."""
    p = p.clone()
    for i in range(p.shape[1]):
        col = p[:, i]
        for j in range(i):
            col = col - torch.dot(p[:, j], col) * p[:, j]
        norm = torch.sqrt(torch.dot(col, col))
        p[:, i] = col / norm if norm > 0 else torch.zeros_like(col)
    return p


class PowerSGDCompressor(Compressor):
    name = "powersgd"
    summed = True

    def exchange(self, x, ctx):
        p = self.spec.params
        r = p["rank"]
        shape = tuple(ctx.shape) if ctx.shape else (x.numel(),)
        if not is_compressed(shape, r):
            send = x.clone()
            (total,) = yield (Allreduce(send),)
            return total.mul_(ctx.scale) if ctx.scale != 1.0 else total
        n, m = matrix_shape(shape)
        st = ctx.state
        mat = x.view(n, m)
        res = st.get("residual") if p["residual"] else None
        own = res is not None and res.dtype == x.dtype and res.numel() == x.numel()
        if own:  # the compensated gradient in the residual's buffer (r + x == x + r), rebuilt below
            mat = res.view(n, m).add_(mat)
        elif res is not None:
            mat = mat + res.view(n, m)
        q = st.get("q")
        if q is None or not bool(q.any()):
            q = uniform(m * r, p["seed"], ctx.step, ctx.key, 0, device=x.device).sub_(0.5)
        q = q.view(m, r).to(mat.dtype)
        # The skinny products are taken as (Q^T M^T)^T and (P^T M)^T: on one CPU thread BLAS runs
        # them several times faster than M Q and M^T P (the same sums; the order within each may differ).
        (psum,) = yield (Allreduce(torch.mm(q.t(), mat.t()).t().contiguous()),)
        phat = orthogonalize(psum)
        qloc = torch.mm(phat.t(), mat).t().contiguous()
        if p["residual"]:  # M - D(C(M)), with D(C(M)) rounded as the result is, so nothing is lost
            approx = phat @ qloc.t()
            st["residual"] = (mat.sub_(approx) if own else torch.sub(mat, approx, out=approx)).reshape(-1)
        (qsum,) = yield (Allreduce(qloc),)
        st["q"] = qsum.reshape(-1).clone()
        left = phat * ctx.scale if ctx.scale != 1.0 else phat  # the scale on the n x r factor, not on n x m
        out = ctx.out  # x is no longer read: the result is built in the buffer offered for it
        if out is not None and out.dtype == x.dtype and out.numel() == x.numel() and out.is_contiguous():
            return torch.mm(left, qsum.t(), out=out.view(n, m)).view(-1)
        return (left @ qsum.t()).reshape(-1)

    def check_state(self, key, state, numel):
        """``residual`` has one entry per element; ``q`` is m*r for the tensor's n x m view, which
        numel alone cannot tell: it must be r times a divisor m of numel for which the tensor is
        exchanged compressed."""
        r = self.spec["rank"]
        for name, t in state.items():
            if name == "q":
                m = t.numel() // r
                ok = t.numel() % r == 0 and m > 0 and numel % m == 0 and is_compressed((numel // m, m), r)
                if not ok:
                    raise ValueError(f"load_state_dict: compression state 'q' of '{key}' has {t.numel()} "
                                     f"elements, which is not m*{r} for an n x m view of {numel} elements "
                                     "(a checkpoint of a different model or rank?)")
            elif t.numel() != numel:
                raise ValueError(f"load_state_dict: compression state '{name}' of '{key}' has "
                                 f"{t.numel()} elements, the parameter has {numel} (a checkpoint of "
                                 "a different model?)")
