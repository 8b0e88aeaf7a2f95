"""Deep Gradient Compression (Lin et al., ICLR 2018) in TensorFlow ops.

Per worker and tensor (u: momentum, v: accumulated velocity, flat variables in ``ctx.state``; the
numpy oracle ``hvdcompress.reference.dgc`` spells out every step and the order of operations, and
this port follows it operation for operation, so the results agree bit for bit):

    g <- g * min(1, clip_norm / sqrt(N) / (||g|| + 1e-6))      local clipping (norm in float64,
         of each member tensor: clip_scope=tensor; clip_scope=global is PyTorch-only so far)
    u <- m*u + g;  v <- v + u   (Nesterov: v <- v + (g + m*u))   momentum correction
    I <- sampled-threshold top-k of |v|, k = ceil(density * n)
    send (I, v[I]);  v[I] <- 0;  u[I] <- 0                       momentum factor masking
    result = (sum over ranks of the scattered values) * scale

Tensors that are 1-D or smaller than ``min_sparse_numel`` are exchanged dense (allreduce of u).
With momentum correction off, v accumulates gradients and momentum is applied to the exchanged
average instead. The momentum lives here, so the optimizer must run without its own: the Keras
``DistributedOptimizer`` takes an SGD optimizer's momentum over. Keras's ``weight_decay`` is
decoupled (``w -= lr * wd * w``, applied to the variables, never through the momentum, in dense
training too), so the rebuilt optimizer keeps applying it unchanged and DGC trains like the dense
optimizer with the same decay; L2 regularization in the loss (kernel regularizers) reaches DGC as
part of the gradient (momentum applied, sparsified with it). Keras's own gradient clipping
(``clipnorm``, ``clipvalue``, ``global_clipnorm``) would clip the exchanged velocity, not the
gradient, and is refused with DGC (``TakesMomentum``); DGC's ``clip_norm`` clips before the memory. The density comes from
``ctx.density`` (a variable that ``GradientCompression.set_epoch`` / the warm-up callback set)
or, when absent, from the spec's warm-up schedule for ``ctx.epoch``.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from hvdcompress.momentum import check_dgc_under_adam
from hvdcompress.native import select as shared
from hvdcompress.sampling import sample_stride
from hvdcompress.reference.dgc import dgc_density, dgc_sends_dense
from hvdcompress.spec import CompressionSpec

from . import host
from ..collectives import Allgather, Allreduce
from .base import Compressor, ExchangeContext, scaled, selected_count, TakesMomentum
from .selection import sampled_threshold_select, sampling_offset, wire_index_dtype


@tf.function(experimental_attributes={"_noinline": True}, autograph=False)
def grouped_add(a, b):
    """a + b, computed before it is added to anything else. Inside a traced function Grappler's
    arithmetic optimizer would flatten ``v + (g + m*u)`` into one AddN summed left to right,
    ((v + g) + m*u), which rounds differently than the oracle; a function it may not inline keeps
    the parenthesised sum."""
    return a + b


def _update_in_place(u: tf.Variable, v: tf.Variable, g: tf.Tensor, momentum, nesterov: bool) -> None:
    """DGC's state update, in the variables' own buffers:

        momentum given:  u <- m*u + g;  v <- v + u   (nesterov: v <- v + (g + m*u))
        momentum None:   v <- v + g

    For float32/float64 with momentum this is TF's fused momentum kernel
    (``ResourceApplyMomentum``: accum <- accum*momentum + grad; var <- var - lr*accum, Nesterov
    var <- var - (grad*lr + accum*momentum*lr)) with var = v, accum = u and lr = -1: one pass that
    reads g, u, v and writes u, v, with the oracle's roundings (multiplying by -1 and negating a
    sum are exact). Other dtypes: the same operations one at a time."""
    if momentum is None:
        v.assign_add(g, read_value=False)
        return
    dtype = v.dtype
    if dtype in (tf.float32, tf.float64):
        tf.raw_ops.ResourceApplyMomentum(var=v.handle, accum=u.handle, lr=tf.constant(-1, dtype), grad=g,
                                         momentum=tf.constant(momentum, dtype), use_nesterov=nesterov)
        return
    m = tf.cast(momentum, dtype)
    u_new = u * m + g
    u.assign(u_new, read_value=False)
    v.assign_add(grouped_add(g, u_new * m) if nesterov else u_new, read_value=False)


def scaled_sum(indices: tf.Tensor, values: tf.Tensor, n: int, scale: float) -> tf.Tensor:
    """The dense sum of gathered (index, value) pairs (``tf.scatter_nd`` adds repeated indices in
    their order: rank order), times ``scale`` -- only the entries some rank sent are scaled (each
    to ``sum * scale``, the rounding of scaling the whole tensor, whose other entries stay 0),
    instead of a pass over all of it."""
    at = tf.cast(indices, tf.int64)[:, None]
    total = tf.scatter_nd(at, values, tf.constant([n], tf.int64))
    if scale == 1.0:
        return total
    return tf.tensor_scatter_nd_update(total, at, tf.gather_nd(total, at) * tf.cast(scale, total.dtype))


class CompiledStep:
    """DGC's update, selection, send values and masking on the shared compiled kernels
    (``hvdcompress.native.select.dgc_select`` and ``take_and_zero``), in one host call: reads g,
    u, v; writes the new u and v (buffers TensorFlow adopts when the variables are assigned), the
    indices and the values. The TF ops' results bit for bit (the rule is ``hvdcompress.sampling``'s
    and the update the oracle's order, in the kernels as in ``_update_in_place``)."""

    def __init__(self, comp: "DGCCompressor", n: int):
        self.comp, self.n = comp, n
        self.buffers = host.Buffers()

    def _run(self, g, u_in, v_in, k, offset):
        comp, n = self.comp, self.n
        p = comp.spec.params
        momentum = comp.m if comp.correction else None
        k, offset = int(k), int(offset)
        v = self.buffers.get(n, v_in.dtype)
        u = self.buffers.get(n, u_in.dtype) if momentum is not None else u_in  # no momentum: u stays
        idx = shared.dgc_select(g, u_in, v_in, u, v, momentum, comp.nesterov, k, p["sample_ratio"],
                                p["adapt_iters"], offset)
        if idx is None:  # the kernels were switched off after tracing: the same update in numpy
            mt = v_in.dtype.type(comp.m)
            if momentum is None:
                np.add(v_in, g, out=v)
            else:
                np.add(u_in * mt, g, out=u)
                np.add(v_in, g + u * mt if comp.nesterov else u, out=v)
            sample = np.abs(v[offset::sample_stride(p["sample_ratio"])])
            idx = shared.sampled_select(v, k, sample, p["adapt_iters"])
        values = shared.take_and_zero(v, u if comp.masking else None, idx)
        out = (idx.astype(np.int64, copy=False), values, v)
        return out + (u,) if momentum is not None else out

    def __call__(self, g: tf.Tensor, u: tf.Variable, v: tf.Variable, k, offset):
        """(indices int64, values); u and v assigned their new values."""
        dtype, n = v.dtype, self.n
        outputs = [(tf.int64, [None]), (dtype, [None]), (dtype, [n])]
        with_u = self.comp.correction
        if with_u:
            outputs.append((dtype, [n]))
        results = host.call(self._run, [g, u, v, tf.cast(k, tf.int64), tf.cast(offset, tf.int64)], outputs)
        idx, values = results[0], results[1]
        v.assign(results[2], read_value=False)
        if with_u:
            u.assign(results[3], read_value=False)
        return idx, values


class DGCCompressor(TakesMomentum, Compressor):
    name = "dgc"
    summed = False
    uses_step = True  # the sampling offset is drawn per step
    has_schedule = True  # warm-up: the density follows the epoch

    @classmethod
    def adapt_optimizer(cls, spec: CompressionSpec, config):
        """SGD's momentum taken over (``TakesMomentum``); a Keras Adam-family config (``beta_1``) is refused or warned about
        first (``hvdcompress.momentum.check_dgc_under_adam``)."""
        check_dgc_under_adam(spec, "beta_1" in config)
        return super().adapt_optimizer(spec, config)

    def __init__(self, spec: CompressionSpec):
        super().__init__(spec)
        p = spec.params
        self.m = p["momentum"]
        self.nesterov = p["nesterov"]
        self.correction = p["momentum_correction"]
        self.masking = p["momentum_masking"] and p["momentum_correction"]
        self.clip_norm = p["clip_norm"]
        if p["clip_scope"] == "global" and p["clip_norm"] is not None:
            raise ValueError("dgc: parameter 'clip_scope' must be tensor with TensorFlow (clip_scope=global, the "
                             "previous step's whole-gradient norm, is implemented for PyTorch only so far); got "
                             "'global'")

    def scheduled_density(self, epoch: int) -> float:
        return dgc_density(self.spec, epoch)

    def is_dense(self, shape) -> bool:
        return dgc_sends_dense(self.spec, tuple(shape))

    def state_slots(self, shape):
        return ("u",) if self.is_dense(shape) else ("u", "v")

    @property
    def stateful(self) -> bool:
        return True

    def _clip(self, g: tf.Tensor, ctx: ExchangeContext) -> tf.Tensor:
        """Local clipping, each member tensor of the exchange by its own norm (so the result does
        not depend on the merge schedule)."""
        if self.clip_norm is None:
            return g
        parts = []
        for m, view in ctx.member_views(g, tf.reshape):
            part = tf.reshape(view, [-1])
            norm = tf.sqrt(tf.reduce_sum(tf.square(tf.cast(part, tf.float64))))
            coef = (self.clip_norm / math.sqrt(ctx.world_size)) / (norm + 1e-6)
            parts.append(tf.cond(coef < 1.0, lambda p=part, c=coef: p * tf.cast(c, g.dtype), lambda p=part: p))
        return parts[0] if len(parts) == 1 else tf.concat(parts, 0)

    def _momentum_after(self, avg: tf.Tensor, u: tf.Variable) -> tf.Tensor:
        """Momentum correction off: plain momentum on the exchanged average (same on all ranks)."""
        m = tf.cast(self.m, avg.dtype)
        u_new = u * m + avg
        u.assign(u_new)
        return avg + u_new * m if self.nesterov else u_new

    @property
    def can_send_dense(self) -> bool:
        return self.correction

    def dense_send(self, x, ctx):
        """Clipped like every exchange of this compressor, then ``TakesMomentum.dense_send``."""
        return super().dense_send(self._clip(x, ctx), ctx)

    def exchange(self, x: tf.Tensor, ctx: ExchangeContext):
        shape = ctx.shape or tuple(x.shape)
        m = tf.cast(self.m, x.dtype)
        g = self._clip(x, ctx)
        u = ctx.state["u"]
        if self.is_dense(shape):
            if self.correction:
                u_new = u * m + g
                u.assign(u_new)
                send = g + u_new * m if self.nesterov else u_new
            else:
                send = g
            (total,) = yield (Allreduce(send),)
            total = scaled(total, ctx.scale)
            return total if self.correction else self._momentum_after(total, u)

        v = ctx.state["v"]
        p = self.spec.params
        n = int(x.shape[0])
        k = selected_count(self.density(ctx), n)
        offset = sampling_offset(sample_stride(p["sample_ratio"]), n, p["seed"], ctx.step, ctx.key)
        dtype = v.dtype
        if self._compiled(g, u, v, n):
            idx, values = CompiledStep(self, n)(g, u, v, k, offset)
        else:
            _update_in_place(u, v, g, self.m if self.correction else None, self.nesterov)
            v_new = v.read_value()  # after the update (automatic control dependencies, or eager order)
            idx = sampled_threshold_select(v_new, k, p["sample_ratio"], p["adapt_iters"], offset)
            values = tf.gather(v_new, idx)
            del v_new  # no reference left when v is written: it is zeroed in place, not copied first
            at, zeros = idx[:, None], tf.zeros(tf.shape(idx), dtype)
            # zero the sent entries in place (a sparse update of the variable), once the values and
            # the selection are read
            with tf.control_dependencies([values, idx]):
                v.scatter_nd_update(at, zeros)
                if self.masking:
                    u.scatter_nd_update(at, zeros)
        if p["fp16_values"]:
            values = tf.cast(values, tf.float16)
        indices, gathered = yield (Allgather(tf.cast(idx, wire_index_dtype(n))), Allgather(values))
        total = scaled_sum(indices, tf.cast(gathered, dtype), n, ctx.scale)
        return total if self.correction else self._momentum_after(total, u)

    @staticmethod
    def _compiled(g: tf.Tensor, u: tf.Variable, v: tf.Variable, n: int) -> bool:
        """Whether the shared kernels serve this step (``CompiledStep``): float32/float64 state and
        gradient of one dtype on CPU, the library loaded and not switched off."""
        dtypes = (tf.float32, tf.float64)
        return (g.dtype == u.dtype == v.dtype and tuple(u.shape) == tuple(v.shape) == (n,)
                and host.kernels(g, u, v, dtypes=dtypes) is not None)
