"""The compressor contract (v2; docs/design.md section 3 has the whole of it, with an example).

Three roles, three small interfaces:

* **Compressor** -- pure functions of (tensor, state): encode a flat tensor into a payload, say how
  the payload travels, turn what comes back into a dense tensor. Never touches Horovod. A class
  implements the algorithm it names (``name = "topk"``), declared in ``hvdcompress.reference``.
* **State** -- what must survive between steps (error-feedback residuals via ``torch_ops.memory``,
  DGC's and the sketch's momenta, PowerSGD's Q), inside ``ExchangeContext.state``, which the
  optimizer saves in its ``state_dict()``.
* **Communicator** (``torch_ops.collectives``) -- carries out the requests an exchange yields, on
  the optimizer's process set.

An *exchange* is a generator::

    def exchange(self, x, ctx):             # x: flat gradient (a view; do not modify it in place,
                                            # except as ctx.out, after the last read of x)
        ...                                 # compress, update memory
        results = yield (Allgather(values), Allgather(indices))   # one round
        ...                                 # may yield again: multi-round (sketch, PowerSGD)
        return dense_sum * ctx.scale        # every rank returns the same tensor

Each ``yield`` is one round: a tuple of requests (``Allreduce`` sums in place, ``Allgather``
concatenates in rank order; sizes may differ per rank and may be zero). The driver sends back
the tuple of results. Nothing runs between rounds but the generator's own code, so the pipeline
can keep many exchanges in flight (one per tensor or per merged group), interleave their rounds,
advance them by polling from later hooks and finish them at a later step (the optimizer's
``PendingQueue``), without threads. Every decision an exchange
makes from gathered or summed data is identical on all ranks, so all ranks apply the same update.

``summed`` (allreduce) vs gathered (allgather) is declared by the compressor for its first round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Type

import torch

from hvdcompress.contract import ELEMENTWISE, ExchangeContext, Member, Registered
from hvdcompress.spec import CompressionSpec, info_for

from ..collectives import Allgather, Allreduce, Exchange
from ..memory import Memory, memory_for


COMPRESSORS: Dict[str, Type["Compressor"]] = {}


class Compressor(Registered, ABC):
    """Base of every compressor: holds the validated spec; subclasses define ``exchange``.

    A subclass implements the registered algorithm it names (``name = "topk"``; the algorithm is
    declared in its oracle module, ``hvdcompress.reference``) and registers itself by doing so.
    The optimizer calls the hooks below for every compressor alike; none is special-cased.
    """

    registry = COMPRESSORS
    summed: bool = True
    horovod_codec: Any = None  # the codec Horovod's own optimizers use, for a spec declared horovod_codec=True

    @classmethod
    def _check_name(cls, name: str) -> None:
        info_for(name)  # the algorithm must be declared (ValueError otherwise)

    def __init__(self, spec: CompressionSpec):
        self.spec = spec

    @property
    def merge(self) -> str:
        """How its tensors may be merged (``hvdcompress.spec`` ELEMENTWISE / PER_MEMBER / LAYERWISE)."""
        return self.spec.info.merge

    @property
    def elementwise_state(self) -> bool:
        """Every state tensor has one entry per element, so merged groups concatenate the members'
        state and split it back (``torch_ops.grouping``)."""
        return self.merge == ELEMENTWISE

    # -- hooks the optimizer calls generically --------------------------------------------------
    @classmethod
    def adapt_optimizer(cls, spec: CompressionSpec, param_groups: List[Dict[str, Any]]) -> CompressionSpec:
        """Called once when the optimizer is wrapped: may take settings over from the wrapped
        optimizer's parameter groups (DGC takes SGD's momentum) and returns the spec to use.
        Raises ValueError for what cannot be honoured. Default: nothing to adapt."""
        return spec

    def after_load(self, param_groups: List[Dict[str, Any]]) -> None:
        """Called after ``load_state_dict`` restored the wrapped optimizer's parameter groups
        (e.g. so a loaded group does not bring back momentum the compressor took over)."""

    def before_step(self, param_groups: List[Dict[str, Any]], state: Dict[Any, Dict[str, Any]]) -> None:
        """Called with the exchanged gradients in ``.grad``, right before the wrapped optimizer's
        step (``state``: its per-parameter state, saved with it). DGC adds the weight decay it took
        over here. Default: nothing."""

    #: True when the exchange's result is the optimizer's update direction rather than an averaged
    #: gradient (1-bit Adam: the compressor applies Adam's step itself). Such a result cannot be
    #: split into local and delayed terms (delay / sync_every), be DiLoCo's outer gradient, or be
    #: handed to an optimizer that was not taken over.
    returns_update = False

    def local_momentum(self) -> Optional[Tuple[float, bool]]:
        """(momentum, nesterov) when the compressor keeps the training's momentum in its memory
        (the wrapped optimizer then runs without): delayed averaging (``torch_ops.delayed``)
        applies the same momentum to the local steps it takes while an exchange is in flight.
        Default: None (the exchanged result is a gradient; the optimizer's momentum applies)."""
        return None

    def global_state(self) -> Dict[str, Any]:
        """State of the compressor as a whole (not per tensor), saved in the optimizer's
        checkpoint: plain Python values. Default: none."""
        return {}

    def load_global_state(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore what ``global_state`` returned (None or {} when the checkpoint has none)."""

    @property
    def warmup_epoch_steps(self) -> Optional[int]:
        """For compressors whose density follows the epoch (a warm-up): the epoch length, in
        steps, used when the training loop never calls ``set_epoch``; None: no warm-up."""
        return self.spec.params.get("warmup_epoch_steps") if "warmup_epochs" in self.spec.params else None

    def density(self, epoch: int) -> Optional[float]:
        """The fraction of entries sent during ``epoch`` (ratio-based compressors), else None."""
        return self.spec.params.get("ratio")

    @abstractmethod
    def exchange(self, x: torch.Tensor, ctx: ExchangeContext) -> Exchange:
        """Generator: yields rounds of requests, returns the dense result (see module doc)."""

    # -- a group the planner sends dense or in fp16 instead (torch_ops.codec_choice) -------------
    @property
    def can_send_dense(self) -> bool:
        """Whether ``dense_send`` is defined for this spec (every compressor here, except DGC
        with momentum correction off, whose momentum is applied after the exchange)."""
        return True

    def dense_send(self, x: torch.Tensor, ctx: ExchangeContext) -> Tuple[torch.Tensor, Optional[str]]:
        """(the dense tensor to allreduce in place of this compressor's payload, the state entry
        that carries what a lossy cast leaves out, or None). Error feedback: ``a = g + r`` and the
        residual is zeroed, so a group that turns dense sends what earlier steps held back and
        loses nothing."""
        r = ctx.state.get("residual")
        if r is None:
            return x.clone(), None
        a = x + r.view_as(x)
        r.zero_()
        return a, "residual"

    def check_state(self, key: str, state: Dict[str, torch.Tensor], numel: int) -> None:
        """Raise ValueError when saved state cannot belong to a tensor of ``numel`` elements.
        Default: every state tensor is as large as the tensor (residuals, momenta)."""
        for name, t in state.items():
            if t.numel() != numel:
                raise ValueError(f"load_state_dict: compression state '{name}' of '{key}' has "
                                 f"{t.numel()} elements, the parameter has {numel} (a checkpoint of "
                                 "a different model?)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"


class TakesMomentum:
    """Mixin for compressors that keep the momentum in their memory (DGC, the count sketch,
    efsignsgd and onebit): the
    wrapped optimizer's momentum moves into the spec (``hvdcompress.momentum``) and its parameter
    groups run with momentum 0, also after ``load_state_dict``.

    SGD's ``weight_decay`` is taken over with the momentum (whenever the compressor's momentum is
    above 0; other optimizers keep theirs): each group's decay moves to ``group["hvc_weight_decay"]`` (the group's own
    ``weight_decay`` becomes 0), and ``before_step`` adds the decay term, with its own momentum
    ``w = m*w + wd*p`` kept in the optimizer's state (``"hvc_weight_decay_momentum"``), to the
    exchanged gradient: the placement of the paper's reference implementation (the oracle
    ``hvdcompress.reference.dgc.weight_decay_step``), so DGC with a weight-decayed momentum SGD
    trains like the dense one. What cannot be honoured is refused (``check_sgd_groups``)."""

    @classmethod
    def adapt_optimizer(cls, spec: CompressionSpec, param_groups: List[Dict[str, Any]]) -> CompressionSpec:
        from hvdcompress.momentum import check_sgd_groups, take_over_momentum

        new = take_over_momentum(spec, [(g.get("momentum", 0.0), g.get("nesterov", False)) for g in param_groups])
        check_sgd_groups(new, param_groups)
        if new is not spec:
            for g in param_groups:
                g["momentum"] = 0.0
                if "nesterov" in g:
                    g["nesterov"] = False
        cls._take_weight_decay(new, param_groups)
        return new

    @staticmethod
    def _take_weight_decay(spec: CompressionSpec, param_groups: List[Dict[str, Any]]) -> None:
        """SGD's groups (they have ``dampening``) only: Adam's or AdamW's decay is theirs to apply."""
        from hvdcompress.momentum import momentum_of

        if momentum_of(spec) > 0.0:
            for g in param_groups:
                if "dampening" in g and g.get("weight_decay", 0.0):
                    g["hvc_weight_decay"] = g["weight_decay"]
                    g["weight_decay"] = 0.0

    def local_momentum(self) -> Optional[Tuple[float, bool]]:
        from hvdcompress.momentum import momentum_of

        m = momentum_of(self.spec)
        return (m, bool(self.spec.params.get("nesterov", False))) if m > 0.0 else None

    def dense_send(self, x: torch.Tensor, ctx: ExchangeContext) -> Tuple[torch.Tensor, Optional[str]]:
        """The momentum stays local, as for the tensors these compressors send dense anyway:
        ``u = m*u + g``, send ``u`` (Nesterov: ``g + m*u``) plus the accumulated velocity ``v``
        not sent yet, and ``v`` is zeroed: the mean of the ranks' ``u`` is momentum SGD's."""
        momentum = self.local_momentum()
        if momentum is None:  # nothing taken over: plain error feedback
            return super().dense_send(x, ctx)
        m, nesterov = momentum
        u = ctx.state.get("u")
        if u is None:
            u = ctx.state["u"] = torch.zeros_like(x)
        u.mul_(m).add_(x)
        send = x + u * m if nesterov else u.clone()
        for carried in ("v", "residual"):  # DGC / the sketch keep v; the EF quantizers a residual
            held = ctx.state.get(carried)
            if held is not None:
                send.add_(held.view_as(send))
                held.zero_()
                return send, carried
        return send, None

    def after_load(self, param_groups: List[Dict[str, Any]]) -> None:
        for g in param_groups:  # a loaded param_group must not bring the momentum back
            if "momentum" in g:
                g["momentum"] = 0.0
        self._take_weight_decay(self.spec, param_groups)

    def before_step(self, param_groups: List[Dict[str, Any]], state: Dict[Any, Dict[str, Any]]) -> None:
        m, nesterov = self.spec["momentum"] or 0.0, self.spec.params.get("nesterov", False)
        self._take_weight_decay(self.spec, param_groups)  # also a weight_decay set since
        with torch.no_grad():
            for g in param_groups:
                wd = g.get("hvc_weight_decay", 0.0)
                if not wd:
                    continue
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    st = state[p]
                    w = st.get("hvc_weight_decay_momentum")
                    if w is None:
                        w = st["hvc_weight_decay_momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    d = p.detach() * wd  # d = wd*p; w = m*w + d; the term: w (Nesterov: d + m*w)
                    w.mul_(m).add_(d)
                    if p.grad.is_sparse:
                        p.grad = p.grad.to_dense()
                    p.grad.add_(d + w * m if nesterov else w)


class OneRoundCompressor(Compressor):
    """A compressor whose whole exchange is one round of one kind of collective.

    Subclasses define ``compress`` (flat tensor -> payload tuple), ``decompress`` (own payload ->
    dense, for the residual) and ``aggregate`` (collective results -> dense sum over ranks).
    Error feedback, when the spec asks for it, is wrapped around them here, once for all.
    """

    def __init__(self, spec: CompressionSpec):
        super().__init__(spec)
        self.memory: Memory = memory_for(spec)

    @abstractmethod
    def compress(self, a: torch.Tensor, ctx: ExchangeContext) -> Tuple[torch.Tensor, ...]:
        """Flat tensor -> the payload tensors this rank puts on the wire."""

    @abstractmethod
    def decompress(self, payload: Tuple[torch.Tensor, ...], like: torch.Tensor,
                   ctx: ExchangeContext) -> torch.Tensor:
        """This rank's own payload -> the dense tensor it stands for (shape and dtype of like)."""

    def unsent(self, payload: Tuple[torch.Tensor, ...], a: torch.Tensor, ctx: ExchangeContext) -> torch.Tensor:
        """What this rank's payload leaves out of ``a``: a - D(C(a)), the error-feedback residual.
        Sparsifiers override it with one copy instead of a dense decompression and a subtraction."""
        return a - self.decompress(payload, a, ctx)

    @abstractmethod
    def aggregate(self, results: Tuple[torch.Tensor, ...], like: torch.Tensor,
                  ctx: ExchangeContext) -> torch.Tensor:
        """Collective results -> the dense sum over ranks (a new tensor or a summed payload)."""

    def exchange(self, x: torch.Tensor, ctx: ExchangeContext) -> Exchange:
        a = self.memory.compensate(x, ctx.state)
        payload = self.compress(a, ctx)
        self.memory.update(lambda: self.unsent(payload, a, ctx), ctx.state)
        same = self.spec.info.same_shape
        results = yield tuple(Allreduce(t) if self.summed else Allgather(t, same) for t in payload)
        total = self.aggregate(results, a, ctx)
        if ctx.scale != 1.0:
            total.mul_(ctx.scale)
        return total
