"""1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", arXiv 2102.02888), declared and defined in numpy: the oracle.

Adam's update divides each coordinate by its own running RMS, so error-fed compression of the
*gradient* in front of Adam hands it accumulated residuals its variance was never estimated for.
1-bit Adam compresses Adam's *first moment* instead, once the second moment has stopped moving:

Warm-up, steps t = 1 .. T_w (``warmup_steps``): dense Adam. The gradients are averaged exactly
(one allreduce of the float32 gradient, counted in the bytes) and every rank updates

    g = mean_i g_i;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g

``warmup_codec`` sends that gradient in 16 bits, halving the warm-up's bytes (the warm-up is
dense, so it dominates the bytes of a short run): ``fp16`` is the ``fp16`` spec's exchange
(g = fp16(sum_i fp16(g_i)) * (1/N), the sum rounded to half after each add), ``bf16`` the ``bf16``
spec's (g = (sum_i bf16(g_i), in float32, in rank order) * (1/N)); the moments are then updated from
that g as above. ``none`` (the default) is the float32 allreduce.

Compression, t > T_w: v is frozen at v_{T_w}, so Adam's denominator is frozen too and identical
on every rank, den = sqrt(v) * f2 + eps (f2 below, at T_w), and Adam's update is linear in the first
moment: d = f1 * m / den. Each rank i updates its own copy of the moment from the last averaged one,
m_i = b1*m + (1-b1)*g_i, and sends it compressed with error feedback (``onebit``'s packing: sign
bits, 8 per byte, and the two reconstruction values, per tensor or per column, ``scope``) in one
of two spaces (``space``):

    direction (default):  u_i = m_i / den + e_i;  send C(u_i);  e_i = u_i - D(C(u_i))
                          m = den * mean_i D(C(u_i))
    moment (the paper's Algorithm 1):
                          a_i = m_i + e_i;      send C(a_i);  e_i = a_i - D(C(a_i))
                          m = mean_i D(C(a_i))

Without compression both are the paper's update. They differ in where the codec's error lands.
In ``moment`` space it is an error in m, which the update divides by den: a coordinate whose
variance is tiny next to its tensor's (an attention key bias, whose gradient is zero up to
rounding since softmax ignores a per-query constant: den ~ eps there) is reconstructed by the
1-bit codec at about the tensor's mean |m| and takes a step of about mean|m| / eps, which
overflows a transformer within a few steps of the freeze. In ``direction`` space the codec
compresses the update itself, so its error is in the update's units (for 1-bit, at most the
tensor's largest |u|) and is never multiplied by 1/den. The residual e_i is in the space's units.
The denominator is not stored: it is recomputed from the frozen v at every step by the same
float32 operations, so it is the same at every step after the freeze and after a resume.

The paper's server (a worker holding a chunk) compresses the averaged moment again with an error
of its own, e_s, before broadcasting it. Here every rank gathers every payload, decodes them all and
averages exactly, so m is identical on every rank without a second compression: the server's error
is zero at every step (its compensation is an identity), and the result is the paper's update with
C_server = identity.

The result of an exchange is Adam's direction, with torch AdamW's bias correction (the second
moment's frozen with it at T_w)::

    d = (m * f1) / (sqrt(v) * f2 + eps),   f1 = 1 / (1 - b1^t),  f2 = 1 / sqrt(1 - b2^min(t, T_w))

and the step that applies it is AdamW's, decoupled weight decay wd at learning rate lr:
``p = p*(1 - lr*wd) - lr*d`` (``adamw_step``). A plain SGD step without momentum on d is the same
update (its weight decay added to d: ``p - lr*(d + wd*p)``); an optimizer of the Adam family is
taken over (``hvdcompress.momentum.take_over_adam``): its betas and eps move into the spec and the
update is applied for it.

State per tensor: ``m`` (the averaged first moment, identical on every rank), ``v`` (the second
moment, frozen after the warm-up, identical on every rank), ``residual`` (this rank's e_i). All
arithmetic is float32, one IEEE operation at a time (the constants 1-b1, 1-b2 and the factors
f1, f2 computed in float64 and rounded once; sqrt(v) taken in float64 and rounded once), so torch
and TensorFlow reproduce it bit for bit.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Mapping

import numpy as np

from ..contract import Allreduce
from ..spec import GATHERED, PER_MEMBER, CompressionSpec, Param, Round, register
from .oracle import Oracle, oracle_for

F32 = np.float32
DEFAULTS = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}  # torch's and Keras's Adam defaults


def _wire(params, d, itemsize, world, density):
    """The compressed stage (every step after the warm-up): onebit's payload. The warm-up's dense
    allreduces are counted by the stats, not planned."""
    pairs = np.ceil(np.sqrt(d)) if params.get("scope") == "column" else 1
    return (Round(GATHERED, 1, np.where(d > 0, np.ceil(d / 8) + 4 * 2 * pairs, 0)),)


def _optional_beta(name: str, default: float) -> Param:
    return Param(name, float, None, f"Adam's {name} (none: the wrapped Adam optimizer's, {default} without one)",
                 low=0.0, high=1.0, high_open=True, optional=True)


SPACES = ("direction", "moment")
WARMUP_CODECS = ("none", "fp16", "bf16")


def adam_params(space: str = "direction") -> tuple:
    """The parameters every frozen-variance Adam spec declares: the warm-up's length, Adam's
    constants (None: taken over from the wrapped optimizer) and the space the codec works in
    (``space``: the spec's default, the one its measurement on a transformer under AdamW chose)."""
    return (Param("warmup_steps", int, 100, "dense Adam steps before the variance is frozen (counted in the bytes)",
                  low=1, high=2 ** 31 - 1),
            _optional_beta("beta1", DEFAULTS["beta1"]), _optional_beta("beta2", DEFAULTS["beta2"]),
            Param("eps", float, None, f"Adam's eps (none: the wrapped Adam optimizer's, {DEFAULTS['eps']} without one)",
                  low=0.0, low_open=True, optional=True),
            Param("space", str, space, "what is compressed after the warm-up: 'direction' (the first moment "
                  "divided by the frozen denominator: the codec's error in the update's units) or 'moment' (the "
                  "paper's Algorithm 1; diverges where a coordinate's variance is tiny next to its tensor's)",
                  choices=SPACES),
            Param("warmup_codec", str, "none", "how the warm-up's dense gradient travels: 'none' (float32 "
                  "allreduce), 'fp16' (fp16's allreduce: half the bytes, summed in half) or 'bf16' (bf16's "
                  "gather: half the bytes, summed in float32)", choices=WARMUP_CODECS))


register("onebitadam", GATHERED, "1-bit Adam: dense Adam for warmup_steps, then the second moment is frozen "
         "and the first moment is exchanged as 1-bit codes with error feedback; the result is Adam's "
         "direction (takes an Adam/AdamW optimizer over)",
         *adam_params(),
         Param("scope", str, "tensor", "where the two reconstruction values of the 1-bit moment apply: 'tensor' "
               "(one pair per tensor) or 'column' (one pair per column, as onebit's default)",
               choices=("tensor", "column")),
         wire=_wire, merge=PER_MEMBER, same_shape=True)


# -- the algorithm, shared by the backends' tests ---------------------------------------------------
def adam_constants(spec: CompressionSpec) -> Mapping[str, float]:
    """beta1, beta2, eps of ``spec`` with "none" resolved to Adam's defaults."""
    return {k: float(spec.params.get(k) if spec.params.get(k) is not None else DEFAULTS[k]) for k in DEFAULTS}


def bias_corrections(spec: CompressionSpec, step: int):
    """(1 / (1 - b1^t), 1 / sqrt(1 - b2^min(t, T_w))) for exchange number ``step`` (0-based,
    t = step + 1), computed in float64: the two factors every backend rounds once to float32 and
    multiplies by (a product, since frameworks turn a division by a scalar into one anyway)."""
    c = adam_constants(spec)
    t = step + 1
    tv = min(t, int(spec["warmup_steps"]))
    return 1.0 / (1.0 - c["beta1"] ** t), 1.0 / math.sqrt(1.0 - c["beta2"] ** tv)


def warmup_spec(spec: CompressionSpec) -> CompressionSpec:
    """The dense spec (``fp16`` or ``bf16``, no residual) that carries the warm-up's gradient when
    ``warmup_codec`` is not "none"."""
    return CompressionSpec(spec["warmup_codec"], {"residual": False})


def inner_spec(spec: CompressionSpec) -> CompressionSpec:
    """The ``onebit`` spec that carries the first moment after the warm-up: error feedback on,
    no momentum of its own, 1-bit Adam's scope."""
    return CompressionSpec("onebit", {"residual": True, "scope": spec["scope"], "momentum": None,
                                      "nesterov": False, "momentum_correction": True})


def denominator(v: np.ndarray, f2: float, eps) -> np.ndarray:
    """Adam's denominator sqrt(v) * f2 + eps in float32, the square root taken in float64 and
    rounded once (correctly rounded: not every float32 sqrt is)."""
    root = np.sqrt(np.asarray(v).astype(np.float64)).astype(F32)
    return (root * F32(f2) + F32(eps)).astype(F32)


def adamw_step(p: np.ndarray, d: np.ndarray, lr: float, weight_decay: float) -> np.ndarray:
    """AdamW's step with the exchanged direction: p*(1 - lr*wd) - lr*d (float32)."""
    p = p.astype(F32)
    if weight_decay:
        p = p * F32(1.0 - lr * weight_decay)
    return (p - d.astype(F32) * F32(lr)).astype(F32)


class FrozenVarianceAdamOracle(Oracle):
    """The frozen-variance Adam of the module doc with the first moment's codec left open: a
    subclass names it (``moment_spec``: a one-round spec with error feedback on, whose oracle
    keeps the residual in ``ctx.state``). ``topkadam`` is the same algorithm with top-k."""

    @abstractmethod
    def moment_spec(self) -> CompressionSpec:
        """The spec that carries the first moment after the warm-up."""

    def exchange(self, x, ctx):
        c = adam_constants(self.spec)
        b1, b2, eps = F32(c["beta1"]), F32(c["beta2"]), F32(c["eps"])
        one_b1, one_b2 = F32(1.0 - c["beta1"]), F32(1.0 - c["beta2"])
        g = np.asarray(x, dtype=F32)
        st = ctx.state
        for k in ("m", "v"):
            if st.get(k) is None:
                st[k] = np.zeros_like(g)
        f1, f2 = bias_corrections(self.spec, ctx.step)
        if ctx.step < self.spec["warmup_steps"]:
            if self.spec["warmup_codec"] == "none":
                (total,) = yield (Allreduce(g.copy()),)
                mean = (total * F32(ctx.scale)).astype(F32)
            else:
                mean = yield from oracle_for(warmup_spec(self.spec)).exchange(g.copy(), ctx)
                mean = np.asarray(mean, dtype=F32)
            st["m"] = (st["m"] * b1 + mean * one_b1).astype(F32)
            st["v"] = (st["v"] * b2 + (mean * mean) * one_b2).astype(F32)
            denom = denominator(st["v"], f2, eps)
        else:
            denom = denominator(st["v"], f2, eps)  # v frozen: the same den at every step after the freeze
            local = (st["m"] * b1 + g * one_b1).astype(F32)
            direction = self.spec["space"] == "direction"
            if direction:
                local = (local / denom).astype(F32)
            mean = yield from oracle_for(self.moment_spec()).exchange(local, ctx)
            mean = np.asarray(mean, dtype=F32)
            st["m"] = (mean * denom).astype(F32) if direction else mean.copy()
        return ((st["m"] * F32(f1)) / denom).astype(F32)


class OneBitAdamOracle(FrozenVarianceAdamOracle):
    name = "onebitadam"

    def moment_spec(self):
        return inner_spec(self.spec)


def transcription(grad, params0: np.ndarray, steps: int, workers: int, lr: float, weight_decay: float,
                  warmup_steps: int, compress, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                  space: str = "moment"):
    """The paper's Algorithm 1 written out directly in float64, for the oracle's test: worker i's
    gradient at step t is ``grad(i, t, p)``; the warm-up is dense Adam, then the variance is frozen
    and the momentum is sent compressed (``compress(a) -> D(C(a))``: 1-bit here, top-k for
    ``topkadam``) with worker error feedback, the server's average exact. ``space="direction"``
    sends m_i / den instead and multiplies the average by den (the module doc). Returns the parameters
    after every step."""
    m = np.zeros_like(params0, dtype=np.float64)
    v = np.zeros_like(m)
    err = [np.zeros_like(m) for _ in range(workers)]
    p = params0.astype(np.float64)
    out = []
    for t in range(1, steps + 1):
        grads = [np.asarray(grad(i, t, p), np.float64) for i in range(workers)]
        if t <= warmup_steps:
            g = sum(grads) / workers
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
        else:
            frozen = np.sqrt(v / (1 - beta2 ** warmup_steps)) + eps if space == "direction" else 1.0
            sent = []
            for i, gi in enumerate(grads):
                a = (beta1 * m + (1 - beta1) * gi) / frozen + err[i]
                d = compress(a)
                err[i] = a - d
                sent.append(d)
            m = frozen * (sum(sent) / workers)
        vhat = v / (1 - beta2 ** min(t, warmup_steps))
        mhat = m / (1 - beta1 ** t)
        p = p * (1 - lr * weight_decay) - lr * mhat / (np.sqrt(vhat) + eps)
        out.append(p.copy())
    return out
