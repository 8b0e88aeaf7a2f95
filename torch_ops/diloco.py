"""DiLoCo, Streaming DiLoCo and SparseLoCo on PyTorch (Horovod or torch.distributed): an outer
loop around any optimizer.

``DiLoCo`` wraps the user's inner optimizer as Horovod's ``DistributedOptimizer`` wraps one: the
training loop calls ``opt.zero_grad()``, ``loss.backward()`` and ``opt.step()`` as before. Inner
steps exchange nothing; after each, the outer loop of ``hvdcompress.diloco`` runs (its module doc
states the rules; ``hvdcompress.reference.diloco`` is the numpy oracle this is tested against):

* launch: fragment p's pseudo-gradients ``Delta_i = theta_global - theta_i`` (global MINUS
  local) are compressed with the spec (error feedback on the pseudo-gradient where the spec has
  it) and exchanged as async ops on the transport (Horovod's ``Communicator``, or under torchrun
  ``backend="torch"``: ``TorchDistCommunicator``), one exchange per tensor, started by an exchange
  session (``torch_ops.session``, which owns the compressor, the per-tensor state and the guard:
  a NaN or inf on any rank makes the result NaN on every rank). They stay in flight while the
  next ``overlap_steps`` inner steps compute.
* apply: the outer optimizer (default SGD, lr 0.7, momentum 0.9, Nesterov) steps
  ``theta_global`` of p with the mean Delta; the local parameters become ``theta_global + mix *
  (theta_local - theta_global)``.

The outer optimizer is a torch optimizer over the model's parameters (as in torchft): at an
apply the fragment's parameters are set to ``theta_global`` with ``.grad = mean Delta`` and only
they are stepped (the other parameters get no gradient for that call; the users' inner gradients
are put back afterwards).

Horovod Elastic: ``hvc.elastic.TorchState(model=model, diloco=opt)`` (Horovod's ``TorchState``
with a state handler for ``DiLoCo``, registered when one is built): ``save``/``restore`` copy and
load ``state_dict()``; ``sync`` (after a reset, on every rank, new ones included) drops the fragment
in flight (its Horovod handles belonged to the Horovod that was shut down; what it carried is not
lost: the pseudo-gradient is measured from ``theta_global`` again at that fragment's next sync) and
gives every rank rank 0's ``theta_global``, optimizers' states and counters; each rank keeps its own
residuals (a rank that joins starts with none).

State (``state_dict``): the inner and outer optimizers' states, ``theta_global``, this rank's
compression state, the step and per-fragment sync counters, and the fragment in flight as its
inputs (this rank's Delta and its compression state before the launch): a resumed run launches
it again at its next step and applies it when it was due, so resuming is exact. Saving needs no
collective (rank 0 may save alone).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch

from hvdcompress.contract import transport_argument
from hvdcompress.diloco import OUTER_LR, OUTER_MOMENTUM, OUTER_NESTEROV, check_arguments, split_fragments
from hvdcompress.stats import WireStats

from .arguments import check_devices
from .nonfinite import check_state_finite
from .session import ExchangeSession, exchange_name
from .transport import make_transport

STATE_KEY = "hvdcompress_diloco"


def _named(model) -> List[tuple]:
    if hasattr(model, "named_parameters"):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    else:
        named = [(f"p{i}", p) for i, p in enumerate(model)]
    if not named or not all(isinstance(p, torch.Tensor) for _, p in named):
        raise ValueError("DiLoCo: model must be a torch.nn.Module or a list of tensors with at least one "
                         "parameter that requires grad")
    return named


class DiLoCo:
    """The DiLoCo outer loop around ``inner_optimizer`` (module doc).

    Args:
        model: the ``torch.nn.Module`` (or list of parameters) trained by ``inner_optimizer``.
            Its parameters must be identical on every rank when this is built (broadcast them
            first, as with Horovod): they are the first ``theta_global``.
        inner_optimizer: any torch optimizer over those parameters (AdamW in the paper).
        outer_optimizer: a torch optimizer over the same parameters; default
            ``SGD(lr=0.7, momentum=0.9, nesterov=True)``.
        sync_every: H, inner steps between two syncs of each fragment (int >= 1).
        fragments: P, how many fragments (consecutive parameters of about equal size) sync in
            turn, one every H / P steps; H must be divisible by P.
        overlap_steps: tau in [0, H / P - 1], inner steps a fragment's exchange runs in flight.
        mix: alpha in [0, 1]; after a sync the parameters are ``global + mix * (local - global)``.
        compression: any registered spec (string or ``Compression.<name>(...)``) for the
            pseudo-gradients, e.g. ``"sparseloco:ratio=0.02,bits=2"`` (SparseLoCo) or
            ``"qsgd:levels=7"``; a compressor with a momentum of its own is refused.
        process_set: the Horovod process set to run on (default: all ranks); with
            ``backend="torch"`` a torch.distributed process group (default: the default group).
        transport: the transport all collectives go through (``hvdcompress.contract.Transport``;
            default: the backend's on process_set).
        backend: "horovod" (default; launched by horovodrun) or "torch": torch.distributed
            (launched by torchrun, any backend; Horovod is never imported).
        driver: the former name of ``transport`` (deprecated: a DeprecationWarning; removed in
            the next release).
    """

    def __init__(self, model, inner_optimizer, outer_optimizer=None, sync_every: int = 500, fragments: int = 1,
                 overlap_steps: int = 0, mix: float = 0.0, compression=None, process_set=None, transport=None,
                 backend: str = "horovod", driver=None):
        transport = transport_argument(transport, driver, "DiLoCo")
        named = _named(model)
        check_devices("model", named)
        self.cfg = check_arguments(len(named), sync_every, fragments, overlap_steps, mix, compression)
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise ValueError(f"DiLoCo: inner_optimizer must be a torch.optim.Optimizer; got {inner_optimizer!r}")
        self.names = [n for n, _ in named]
        if len(set(self.names)) != len(self.names):
            raise ValueError("DiLoCo: parameter names must be unique (they name the exchanges)")
        self.params = [p for _, p in named]
        ids = {id(p) for p in self.params}
        for which, opt in (("inner_optimizer", inner_optimizer), ("outer_optimizer", outer_optimizer)):
            if opt is None:
                continue
            if not isinstance(opt, torch.optim.Optimizer):
                raise ValueError(f"DiLoCo: {which} must be a torch.optim.Optimizer; got {opt!r}")
            if any(id(p) not in ids for g in opt.param_groups for p in g["params"]):
                raise ValueError(f"DiLoCo: {which} holds tensors that are not parameters of the model")
        # ValueError here when the spec has no PyTorch implementation
        self.session = ExchangeSession(self.cfg.compression, dict(named), who="hvdcompress.DiLoCo", owner="DiLoCo")
        if self.session.compressor.returns_update:
            raise ValueError(f"compression: {self.cfg.compression.name} exchanges an optimizer's update, not the "
                             "outer gradient DiLoCo averages; use a gradient compressor (e.g. onebit, qsgd, topk)")
        self.inner = inner_optimizer
        self.outer = outer_optimizer if outer_optimizer is not None else torch.optim.SGD(
            self.params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=OUTER_NESTEROV)
        self.fragments = split_fragments([p.numel() for p in self.params], self.cfg.fragments)
        self.transport = self.session.transport = make_transport(backend, process_set, transport)
        self.world = self.transport.size()
        self.process_set = self.transport.process_set
        with torch.no_grad():
            self.global_params = [p.detach().clone() for p in self.params]
        self.rounds = [0] * self.cfg.fragments
        self.t = 0
        self._in_flight: Optional[dict] = None
        self.bytes_sent = 0  # payload bytes this rank handed to the transport
        if backend == "horovod":
            _register_elastic_handler()

    # -- optimizer face ----------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One inner step, then the outer loop's launch/apply for this step (module doc)."""
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.t += 1
        with torch.no_grad():
            self._relaunch()
            p = self.cfg.launched_at(self.t)
            if p is not None:
                self._launch(p, self.cfg.due(self.t))
            if self._in_flight is not None:
                self.session.pending.poll()
                if self._in_flight["due"] == self.t:
                    self._apply(self.cfg.mix)
        return loss

    def flush(self) -> None:
        """Make every replica identical: apply the fragment in flight now, then sync every fragment
        at once with mix 0, so every rank holds ``theta_global`` (for evaluation, checkpoints that
        all ranks must agree on, the end of training). A collective: call it on every rank."""
        with torch.no_grad():
            self._relaunch()
            if self._in_flight is not None:
                self._apply(self.cfg.mix)
            for p in range(self.cfg.fragments):
                self._launch(p, self.t)
                self._apply(0.0)

    @property
    def stats(self) -> WireStats:
        """Bytes this rank handed to the transport per outer exchange (one fragment's sync, a
        ``steps`` count each; a flush counts one per fragment) and in total, next to dense."""
        return self.session.stats

    def global_parameters(self) -> List[torch.Tensor]:
        """``theta_global`` (identical on every rank), in model order: copies."""
        return [g.clone() for g in self.global_params]

    # -- the two halves of a sync ------------------------------------------------------------------
    def _launch(self, p: int, due: int, saved: Optional[dict] = None) -> None:
        session, inputs = self.session, {}
        for i in self.fragments[p]:
            name = self.names[i]
            if saved is None:
                delta = (self.global_params[i] - self.params[i].detach()).reshape(-1).to(torch.float32)
                before = {k: v.clone() for k, v in session.state_for((name,)).items()}
            else:
                delta, before = saved["delta"][i], saved["state"][i]
                session.set_state(name, {k: v.clone() for k, v in before.items()})
            inputs[i] = (delta, before)
            # the exchange gets a copy: a summed payload may be the tensor itself, allreduced in
            # place, and ``delta`` must stay this rank's own for a checkpoint taken while in flight
            x = delta.clone()
            rnd = self.rounds[p]
            ex = session.start(x, (name,), key=name, step=rnd, name=exchange_name("diloco", name, f"s{rnd}"),
                               shape=tuple(self.params[i].shape), epoch=0)
            session.pending.add(i, ex, due)
        self.rounds[p] += 1
        self._in_flight = {"fragment": p, "due": due, "inputs": inputs}

    def _apply(self, mix: float) -> None:
        self._in_flight = None
        exchanges = self.session.pending.finish()
        sent = sum(ex.bytes_sent for ex in exchanges.values())
        self.bytes_sent += sent
        self.session.stats.record(sent, sum(self.params[i].numel() * 4 for i in exchanges),  # float32 deltas
                                  sum(ex.compute_seconds for ex in exchanges.values()))
        saved_grads = [p.grad for p in self.params]
        local = {}
        try:
            for p in self.params:
                p.grad = None
            for i, ex in exchanges.items():
                param = self.params[i]
                local[i] = param.detach().clone()
                param.copy_(self.global_params[i])
                param.grad = ex.result.reshape(param.shape).to(param.dtype)
            self.outer.step()
        finally:
            for p, g in zip(self.params, saved_grads):
                p.grad = g
        for i in exchanges:
            param = self.params[i]
            self.global_params[i].copy_(param)
            if mix != 0.0:  # global + mix * (local - global), two roundings as the reference
                param.copy_((local[i] - self.global_params[i]).mul_(mix).add_(self.global_params[i]))

    def _relaunch(self) -> None:
        flight = self._in_flight
        if flight is not None and "saved" in flight:  # restored from a checkpoint: launch it again
            self._in_flight = None
            self.rounds[flight["fragment"]] -= 1
            self._launch(flight["fragment"], flight["due"], flight["saved"])

    def elastic_sync(self) -> None:
        """After a Horovod Elastic reset, on every rank (module doc): drop the fragment in flight,
        follow the new world size, take rank 0's global parameters, optimizer states and counters."""
        self._in_flight = None
        self.session.drop_in_flight()
        self.world = self.transport.size()
        shared = self.transport.broadcast_object({
            "step": self.t, "rounds": list(self.rounds), "global": [g.clone() for g in self.global_params],
            "inner": copy.deepcopy(self.inner.state_dict()), "outer": copy.deepcopy(self.outer.state_dict())},
            "hvc.diloco.elastic.sync")
        self.t, self.rounds = int(shared["step"]), list(shared["rounds"])
        with torch.no_grad():
            for g, src in zip(self.global_params, shared["global"]):
                g.copy_(src)
        self.inner.load_state_dict(shared["inner"])
        self.outer.load_state_dict(shared["outer"])

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        state = self.session.param_state()
        flight = None
        if self._in_flight is not None:
            src = self._in_flight.get("saved") or {
                "delta": {i: d for i, (d, _) in self._in_flight["inputs"].items()},
                "state": {i: s for i, (_, s) in self._in_flight["inputs"].items()}}
            flight = {"fragment": self._in_flight["fragment"], "due": self._in_flight["due"],
                      "delta": {self.names[i]: d.clone() for i, d in src["delta"].items()},
                      "state": {self.names[i]: {k: v.clone() for k, v in s.items()} for i, s in src["state"].items()}}
        return {
            "inner": self.inner.state_dict(),
            "outer": self.outer.state_dict(),
            STATE_KEY: {
                "compression": self.cfg.compression.to_dict(),
                "sync_every": self.cfg.sync_every, "fragments": self.cfg.fragments,
                "overlap_steps": self.cfg.overlap_steps,
                "step": self.t, "rounds": list(self.rounds),
                "global": {n: g.clone() for n, g in zip(self.names, self.global_params)},
                "state": {n: state.get(n, {}) for n in self.names},
                "in_flight": flight,
            },
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output (checked before anything changes; ValueError)."""
        ours = sd.get(STATE_KEY) if isinstance(sd, dict) else None
        if ours is None or "inner" not in sd or "outer" not in sd:
            raise ValueError("DiLoCo.load_state_dict: not a DiLoCo state dict (keys inner, outer, "
                             f"{STATE_KEY} expected)")
        for key in ("sync_every", "fragments", "overlap_steps"):
            if ours[key] != getattr(self.cfg, key):
                raise ValueError(f"DiLoCo.load_state_dict: the checkpoint has {key}={ours[key]}, this DiLoCo "
                                 f"{getattr(self.cfg, key)}")
        if ours["compression"] != self.cfg.compression.to_dict():
            raise ValueError(f"DiLoCo.load_state_dict: the checkpoint compressed with {ours['compression']}, "
                             f"this DiLoCo with {self.cfg.compression.to_dict()}")
        index = {n: i for i, n in enumerate(self.names)}
        if set(ours["global"]) != set(index):
            raise ValueError("DiLoCo.load_state_dict: the checkpoint's parameters are not this model's")
        for n, g in ours["global"].items():
            if g.shape != self.params[index[n]].shape:
                raise ValueError(f"DiLoCo.load_state_dict: '{n}' has shape {tuple(g.shape)} in the checkpoint, "
                                 f"{tuple(self.params[index[n]].shape)} in the model")
        for n, st in ours["state"].items():
            check_state_finite(n, st)
        self.inner.load_state_dict(sd["inner"])
        self.outer.load_state_dict(sd["outer"])
        with torch.no_grad():
            for n, g in ours["global"].items():
                self.global_params[index[n]].copy_(g)
        self.session.load_param_state({n: ours["state"].get(n, {}) for n in self.names})
        self.t, self.rounds = int(ours["step"]), list(ours["rounds"])
        flight = ours["in_flight"]
        self._in_flight = None
        self.session.drop_in_flight()
        if flight is not None:
            self._in_flight = {"fragment": flight["fragment"], "due": flight["due"], "saved": {
                "delta": {index[n]: d.clone() for n, d in flight["delta"].items()},
                "state": {index[n]: {k: v.clone() for k, v in s.items()} for n, s in flight["state"].items()}}}


class DiLoCoStateHandler:
    """Horovod Elastic state handler for ``DiLoCo`` (the interface of Horovod's ``StateHandler``):
    ``save`` keeps a copy of ``state_dict()``, ``restore`` loads it, ``sync`` is ``elastic_sync``."""

    def __init__(self, value: DiLoCo):
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.elastic_sync()

    def set_value(self, value: DiLoCo) -> None:
        self.value = value
        self.save()


def _register_elastic_handler() -> None:
    """Let Horovod's ``TorchState`` (and ``hvc.elastic.TorchState``) handle ``DiLoCo`` values."""
    try:
        from horovod.torch.elastic import state as hvd_state
    except ImportError:  # no Horovod here (torch.distributed, or a transport of one's own)
        return
    registry = hvd_state.get_handler_registry()
    if not any(t is DiLoCo for t, _ in registry):
        registry.insert(0, (DiLoCo, DiLoCoStateHandler))
