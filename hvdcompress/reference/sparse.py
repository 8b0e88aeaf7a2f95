"""Sparsifiers, declared and defined in numpy: topk, threshold, randomk.

    topk       {"indices": int32, "values": a[i]}  the k = ceil(ratio*n) largest |a|, ties to the
               lower index; gathered, scatter-added in rank order
    threshold  {"indices": int32, "values": a[i]}  every |a| >= threshold (possibly none); gathered
    randomk    {"values": a[i]}                    i from ``hvdcompress.sampling`` (seed, step, key
               shared by all ranks); allreduced, scattered at the shared indices. ``unbiased``:
               {"values": a[i] * float32(n / k)} (Stich et al.'s scaled random-k, E[D(C(a))] = a),
               without error feedback (the scaled residual a - (n/k) a[i] would grow, not shrink).

Random-k with error feedback delivers each entry about once every n/k steps: it needs no momentum
(heavy-ball momentum on that delayed signal diverges or stalls at this density) and many more steps
than dense training; the optimizers warn when it is wrapped around an optimizer with momentum.
"""

from __future__ import annotations

from abc import abstractmethod
import numpy as np

from ..sampling import random_indices
from ..spec import GATHERED, RATIO_RANGE, SUMMED, Param, num_selected, register, residual_param
from ..wire import sparse_gathered, sparse_summed
from .oneround import OneRoundOracle
from .selection import threshold_indices, topk_indices

register("topk", GATHERED, "send the k = ceil(ratio * numel) largest-magnitude entries "
         "(ties to the lower index) as (indices, values)",
         Param("ratio", float, 0.01, "fraction of entries sent", **RATIO_RANGE), residual_param(True),
         wire=sparse_gathered, same_shape=True)
def _check_randomk(p) -> None:
    if p["unbiased"] and p["residual"]:
        raise ValueError("randomk: parameter 'unbiased' must be false with residual=true (error feedback on the "
                         "n/k-scaled values would grow the residual); use unbiased=true,residual=false")


def randomk_momentum_warning(momentum: float) -> str:
    """What the optimizers warn when random-k is wrapped around an optimizer with momentum."""
    return (f"compression 'randomk' with the optimizer's momentum={momentum}: random-k sends each entry about once "
            "every 1/ratio steps, and momentum on that delayed signal tends to diverge or stall; random-k needs no "
            "momentum (use momentum=0) and many more steps than dense training")


register("randomk", SUMMED, "send k = ceil(ratio * numel) entries at indices drawn from a seed shared "
         "by all ranks, so the values can be allreduced; needs no momentum and many more steps than dense",
         Param("ratio", float, 0.01, "fraction of entries sent", **RATIO_RANGE),
         Param("seed", int, 0, "seed shared by all ranks", low=0, high=2**63 - 1),
         residual_param(True),
         Param("unbiased", bool, False, "scale the sent values by n/k (an unbiased estimate of the tensor); "
               "needs residual=false"),
         check=_check_randomk, wire=sparse_summed,
         horovod_refusal="its indices are shared through (seed, step, tensor name), and Horovod's compress(tensor) "
                         "is told neither the step nor the name (and its error-feedback residual would be state "
                         "Horovod does not checkpoint)")
register("threshold", GATHERED, "send every entry with |x| >= threshold as (indices, values)",
         Param("threshold", float, 1e-3, "magnitude threshold", low=0.0, low_open=True),
         residual_param(True), wire=sparse_gathered)


class _GatheredSparseOracle(OneRoundOracle):
    summed = False
    fields = ("indices", "values")

    @abstractmethod
    def select(self, a: np.ndarray) -> np.ndarray:
        """The indices sent, in the order the payload carries them."""

    def payload(self, a, ctx):
        idx = self.select(a)
        return {"indices": idx, "values": a[idx]}

    def decompress(self, payload, numel, dtype, ctx):
        out = np.zeros(numel, dtype=dtype)
        np.add.at(out, payload["indices"].astype(np.int64), payload["values"].astype(dtype))
        return out

    def aggregate(self, results, numel, dtype, ctx):
        indices, values = results  # rank order: every index sums its ranks' values in that order
        out = np.zeros(numel, dtype=dtype)
        np.add.at(out, indices.astype(np.int64), values.astype(dtype))
        return out


class TopKOracle(_GatheredSparseOracle):
    name = "topk"

    def select(self, a):
        return topk_indices(a, num_selected(self.spec["ratio"], a.size))


class ThresholdOracle(_GatheredSparseOracle):
    name = "threshold"

    def select(self, a):
        return threshold_indices(a, self.spec["threshold"])


def unbiased_factor(numel: int, k: int, dtype=np.float32):
    """n / k, computed in double and rounded once to the values' dtype (1 for an empty tensor)."""
    return np.dtype(dtype).type(numel / k if k else 1.0)


class RandomKOracle(OneRoundOracle):
    name = "randomk"
    summed = True
    fields = ("values",)

    def _indices(self, numel, ctx):
        return random_indices(numel, num_selected(self.spec["ratio"], numel), self.spec["seed"], ctx.step, ctx.key)

    def payload(self, a, ctx):
        idx = self._indices(a.size, ctx)
        if self.spec["unbiased"]:
            return {"values": a[idx] * unbiased_factor(a.size, idx.size, a.dtype)}
        return {"values": a[idx]}

    def decompress(self, payload, numel, dtype, ctx):
        out = np.zeros(numel, dtype=dtype)
        out[self._indices(numel, ctx)] = payload["values"]
        return out

    def aggregate(self, results, numel, dtype, ctx):
        return self.decompress({"values": results[0]}, numel, dtype, ctx)
