"""QSGD Adam: 1-bit Adam's frozen-variance Adam (``hvdcompress.reference.onebitadam``, after
Tang et al., arXiv 2102.02888) with ``qsgd``'s codes (Alistarh et al., arXiv 1610.02132) in place
of the 1-bit codec, declared and defined in numpy: the oracle.

After the warm-up each rank sends its first moment (``space=direction``, the default: divided by
the frozen denominator) as QSGD's payload, error feedback on: per bucket of ``bucket`` entries one
float32 norm w = ||a||_2 and, per entry, a code of ceil(log2(2s+1)) bits, s = ``levels``, for the
stochastically rounded level (``hvdcompress.reference.quantizers``, qsgd):

    t <= T_w:  g = mean_i g_i (dense; warmup_codec: fp16 or bf16 as 1-bit Adam's);
               m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
    t >  T_w:  v frozen;  m_i = b1*m + (1-b1)*g_i
               direction:  u_i = m_i/den + e_i;  send C(u_i);  e_i = u_i - D(C(u_i));  m = den * mean_i D(C(u_i))
               moment:     a_i = m_i + e_i;      send C(a_i);  e_i = a_i - D(C(a_i));  m = mean_i D(C(a_i))
               C(a)_j = sign(a_j) * l_j,  l_j = floor(r_j) + [xi_j < r_j - floor(r_j)],  r_j = |a_j| * s / w
               D(C(a))_j = sign(a_j) * l_j * w / s        (E[D(C(a))] = a: unbiased)
    d = m/(1 - b1^t) / (sqrt(v/(1 - b2^min(t, T_w))) + eps);  p = p*(1 - lr*wd) - lr*d

Why ``direction`` by default: as for 1-bit Adam, the codec's error then lands in the update's
units; in ``moment`` space it is divided by den, which is ~eps where a coordinate's variance is tiny
next to its bucket's. QSGD reconstructs such an entry as 0 or +-w/s, so the rare round up steps
it by about w/(s*eps).

Error feedback with an *unbiased* codec is stable only while the codec's relative variance
omega = E||D(C(a)) - a||^2 / ||a||^2 stays below 1: the residual then shrinks from step to step
on average; above 1 it grows geometrically. For QSGD omega is at most min(n/s^2, sqrt(n)/s) on a
bucket of n entries, and about sqrt(2n/pi)/s on a dense bucket (every entry of Adam's normalized
update is of the same order): the codes that reach >= 8x fewer bytes (s <= 7 on 512 entries) sit
above 1. On the char LM under AdamW of docs/fidelity.md (AdamW) it diverged at levels 1 and 7 on
512-entry buckets, in both spaces: at these rates QSGD's unbiased codes cannot carry the moment
with error feedback. So the spec refuses a setting whose bound min(n/s^2, sqrt(n)/s) is not below 1
(``OMEGA_BOUND``; ``bucket=0``, one norm per tensor of any size, is refused with it), and its
defaults, levels 15 on 128-entry buckets (bound 0.57, 5-bit codes: about 6.2x fewer bytes than
float32), are the first stable setting, chosen by that bound (on the char LM of docs/fidelity.md
it ended -0.06% from dense's loss, three seeds). The
bytes: ceil(log2(2s+1)) bits a code plus 32/``bucket`` bits of norm; even 2-bit codes (s = 1, which
the bound refuses below 4-entry buckets) give at most 16x fewer than float32.

The update, the take-over of an Adam/AdamW optimizer and the state (``m``, ``v``, ``residual``)
are 1-bit Adam's. The stochastic rounding's uniforms are qsgd's: seeded by (``seed``, step,
tensor name, rank), so every backend draws the same ones.
"""

from __future__ import annotations

import numpy as np

from ..packing import bits_for_levels
from ..spec import GATHERED, PER_MEMBER, CompressionSpec, Param, Round, register
from .onebitadam import FrozenVarianceAdamOracle, adam_params

SCALE_BYTES = 4
OMEGA_BOUND = 1.0  # error feedback around an unbiased code: stable while its relative variance is below 1


def omega(levels: int, bucket: int) -> float:
    """QSGD's bound on the relative variance of one bucket's codes: min(n/s^2, sqrt(n)/s)."""
    return min(bucket / levels ** 2, bucket ** 0.5 / levels)


def _check(p) -> None:
    if p["bucket"] == 0 or omega(p["levels"], p["bucket"]) >= OMEGA_BOUND:
        stable = [(s, b) for s in (3, 7, 15, 31) for b in (4, 16, 64, 128, 512) if omega(s, b) < OMEGA_BOUND]
        best = max((b for s, b in stable if s == p["levels"]), default=None)
        hint = (f"bucket <= {best} at levels={p['levels']}" if best else
                f"levels >= {min(s for s, b in stable if b == p['bucket'])} at bucket={p['bucket']}"
                if p["bucket"] and any(b == p["bucket"] for _, b in stable) else "levels=15, bucket=128")
        raise ValueError(f"qsgdadam: parameters 'levels' and 'bucket' must keep QSGD's variance bound "
                         f"min(bucket/levels^2, sqrt(bucket)/levels) below {OMEGA_BOUND:g} (error feedback around "
                         f"an unbiased code diverges above it; bucket 0 is one norm per tensor, refused); got "
                         f"levels={p['levels']}, bucket={p['bucket']}"
                         + (f" (bound {omega(p['levels'], p['bucket']):.3g})" if p["bucket"] else "")
                         + f". Accepted e.g.: {hint}")


def _wire(params, d, itemsize, world, density):
    """The compressed stage (every step after the warm-up): qsgd's payload, codes and float32 norms
    (the float32 moment's whatever the gradient's itemsize). The warm-up's dense exchanges are
    counted by the stats, not planned."""
    bits = bits_for_levels(2 * params["levels"] + 1)
    bucket = params["bucket"]
    norms = np.where(d > 0, np.ceil(d / bucket) if bucket else 1, 0)
    return (Round(GATHERED, 1, np.ceil(d * bits / 8) + SCALE_BYTES * norms),)


register("qsgdadam", GATHERED, "QSGD Adam: dense Adam for warmup_steps, then the second moment is frozen and "
         "the first moment is exchanged as QSGD's codes (s levels, stochastic rounding, one L2 norm per bucket) "
         "with error feedback; the result is Adam's direction (takes an Adam/AdamW optimizer over)",
         Param("levels", int, 15, "s, QSGD's levels per sign (codes in [-s, s], ceil(log2(2s+1)) bits each); "
               "min(bucket/s^2, sqrt(bucket)/s) must be below 1", low=1, high=127),
         Param("bucket", int, 128, "entries per norm (0, one norm per tensor, is refused: see levels)", low=0,
               high=2 ** 31 - 1),
         Param("seed", int, 0, "seed of the stochastic rounding (with step, tensor name, rank)", low=0,
               high=2 ** 32 - 1),
         *adam_params(), check=_check, wire=_wire, merge=PER_MEMBER, same_shape=True)


def inner_spec(spec: CompressionSpec) -> CompressionSpec:
    """The ``qsgd`` spec that carries the first moment after the warm-up: error feedback on."""
    return CompressionSpec("qsgd", {"levels": spec["levels"], "bucket": spec["bucket"], "seed": spec["seed"],
                                    "residual": True})


class QSGDAdamOracle(FrozenVarianceAdamOracle):
    name = "qsgdadam"

    def moment_spec(self):
        return inner_spec(self.spec)
