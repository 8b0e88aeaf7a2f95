"""Top-k Adam: 1-bit Adam's frozen-variance Adam (``hvdcompress.reference.onebitadam``, after
Tang et al., arXiv 2102.02888) with ``topk`` in place of the 1-bit codec, declared and defined in
numpy: the oracle.

Error-fed sparsification of the *gradient* in front of Adam hands Adam's per-coordinate RMS rare,
large accumulated residuals its variance was never estimated for. Here, as in 1-bit Adam, the
sparsified quantity is Adam's first moment, once the second moment has stopped moving, in the
space ``space`` names (1-bit Adam's module doc). By default ``space=moment``, the paper's rule with
C = top-k: the k kept entries are the moment's largest, and the key-bias pattern that makes 1-bit
Adam diverge in that space does not arise (an entry of near-zero moment is never among the k
largest). ``space=direction`` keeps the largest entries of the update u = m/den, den = sqrt(v_hat)
+ eps; on the char LM of docs/fidelity.md it diverged on one seed of three where moment did not. C keeps the k = ceil(ratio * n) largest
|entries|, ties to the lower index; the payload is topk's: int32 indices and float32 values:

    t <= T_w:  g = mean_i g_i (dense);  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
    t >  T_w:  v frozen;  m_i = b1*m + (1-b1)*g_i
               direction:  u_i = m_i/den + e_i;  send C(u_i);  e_i = u_i - D(C(u_i));  m = den * mean_i D(C(u_i))
               moment:     a_i = m_i + e_i;      send C(a_i);  e_i = a_i - D(C(a_i));  m = mean_i D(C(a_i))
               (D(C(.)): the k sent entries kept, the rest zero; e_i: the sent entries zeroed, the rest kept)
    d = m/(1 - b1^t) / (sqrt(v/(1 - b2^min(t, T_w))) + eps);  p = p*(1 - lr*wd) - lr*d

The averaged moment is sparse: it is nonzero only on the union of the ranks' kept indices (at
most N*k entries), so a coordinate no rank sent this step takes no step; what a rank did not send
stays in its residual e_i and is carried into its next step, so nothing is dropped, only delayed.
Unlike the gradient's error feedback, the delayed quantity is the moment (or its update), whose
scale the frozen variance was estimated for. The exchange returns the direction d; the update, the
take-over of an Adam/AdamW optimizer and the state (``m``, ``v``, ``residual``) are 1-bit Adam's.
"""

from __future__ import annotations

from ..spec import GATHERED, RATIO_RANGE, CompressionSpec, Param, register
from ..wire import sparse_gathered
from .onebitadam import FrozenVarianceAdamOracle, adam_params

MOMENT_BYTES = 4  # the moment is float32 whatever the gradient's dtype


def _wire(params, d, itemsize, world, density):
    """The compressed stage (every step after the warm-up): topk's payload of float32 values. The
    warm-up's dense allreduces are counted by the stats, not planned."""
    return sparse_gathered(params, d, itemsize, world, density, value_bytes=MOMENT_BYTES)


register("topkadam", GATHERED, "top-k Adam: dense Adam for warmup_steps, then the second moment is frozen and "
         "the first moment is exchanged as its k = ceil(ratio * numel) largest entries with error feedback; "
         "the result is Adam's direction (takes an Adam/AdamW optimizer over)",
         Param("ratio", float, 0.01, "fraction of the first moment's entries sent", **RATIO_RANGE),
         *adam_params(space="moment"), wire=_wire, same_shape=True)


def inner_spec(spec: CompressionSpec) -> CompressionSpec:
    """The ``topk`` spec that carries the first moment after the warm-up: error feedback on."""
    return CompressionSpec("topk", {"ratio": spec["ratio"], "residual": True})


class TopKAdamOracle(FrozenVarianceAdamOracle):
    name = "topkadam"

    def moment_spec(self):
        return inner_spec(self.spec)
