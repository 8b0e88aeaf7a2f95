"""Horovod Elastic with the compressed optimizer (PyTorch).

Use ``hvdcompress.torch.elastic.TorchState`` where Horovod's recipe has ``hvd.elastic.TorchState``
(it is a subclass; everything else of the recipe stays)::

    state = hvc.elastic.TorchState(model=model, optimizer=opt, epoch=0)

    @hvd.elastic.run
    def train(state):
        ...                 # steps; state.commit() now and then
    train(state)

What a reset does to the optimizer (``hvd.elastic.run`` shuts Horovod down and initialises it
again on the new set of ranks):

* **In-flight exchanges are dropped** (their Horovod handles belong to the Horovod that was shut
  down), with the step's bookkeeping (gradients counted, groups waiting).
* **After a failure** (``HorovodInternalError``) the state rolls back to the last commit:
  parameters, the wrapped optimizer's state and this rank's compression state (residuals,
  momenta) as committed (``state_dict()``/``load_state_dict()``, as for any checkpoint). After a
  host update (``HostsUpdatedInterrupt``) nothing rolls back.
* **World size**: the averaging factor and the scheduler follow the new set of ranks; the
  scheduler starts over (one layerwise step to learn the backward order, then the plan is made
  for the new world size, profiled again for cost-model schedules).
* **Sync** (on every rank, new ones included, whenever Horovod syncs the state): the model and
  the wrapped optimizer's state (momenta) come from rank 0 as in Horovod; so do the exchange
  counter, the epoch and the compressor's global state (they seed random-k's indices and set the
  warm-up's density, which must agree across ranks). Each rank keeps its **own** compression state:
  it is that rank's unsent gradient. A rank that joins starts with none (it has sent everything
  it computed, which is nothing).
* **A rank that leaves takes its residuals with it: they are lost**, not flushed. Flushing
  would need a collective among the old ranks at the moment of the change, which a failed worker
  cannot join and which Horovod's removal does not wait for. What is lost is a bounded part of
  that rank's past gradients (what error feedback had delayed, not dropped), like losing part
  of some of its mini-batches; the survivors' error feedback is untouched.
* The model check (``check_same_model``, one collective) runs at each sync rather than when the
  optimizer is built: under elastic a worker that joins builds its optimizer while the others
  are not in a constructor, so a collective there would never be matched.

Delayed averaging (``delay``/``sync_every``) keeps corrections of exchanges among the old ranks:
it is refused with elastic state.
"""

from __future__ import annotations

import os

import torch

from .collectives import PendingQueue
from .scheduling import Scheduler, StepClock


def elastic_mode() -> bool:
    """Running under ``horovodrun`` elastic (Horovod sets HOROVOD_ELASTIC=1 in its workers)."""
    return os.environ.get("HOROVOD_ELASTIC", "0") == "1"


def is_compressed(optimizer) -> bool:
    return hasattr(optimizer, "_hvc_compressor")


def after_reinit(opt) -> None:
    """Local part of a reset (no collective): drop what belonged to the old Horovod, follow the
    new world size, start the scheduler over. Idempotent."""
    import horovod.torch as hvd

    opt._hvc_pending = PendingQueue()
    opt._hvc_sparse_keys = set()
    world = opt._hvc_driver.size()
    average = opt.op == hvd.Average
    opt._hvc_scale = opt.gradient_predivide_factor / world if average else 1.0
    old = opt._hvc_scheduler
    opt._hvc_scheduler = Scheduler(old.schedule if isinstance(old.schedule, list) else old.text, old.spec,
                                   old.cost_model if old.world == world else None, old.profile_steps, old.sizes,
                                   world, opt._hvc_driver, alternatives=old.alternatives)
    opt._hvc_world = world
    opt._hvc_passes_left = {p: opt._hvc_passes for p in opt._hvc_params}
    opt._synchronized = False
    opt._hvc_clock = StepClock(None)
    opt._hvc_regroup([[n] for n in opt._hvc_by_name])  # layerwise until the new plan; state carried per parameter


def sync(opt) -> None:
    """Collective part (every rank, new ones included): the same model everywhere, rank 0's exchange
    counter, epoch and compressor global state; each rank's own compression state is kept."""
    from .arguments import check_same_model

    after_reinit(opt)
    comm = opt._hvc_driver
    if opt._hvc_world > 1:
        check_same_model(comm, opt._hvc_by_name)
    shared = comm.broadcast_object({"step": opt._hvc_step, "epoch": opt._hvc_epoch,
                                    "epoch_set": opt._hvc_epoch_set,
                                    "compressor": opt._hvc_compressor.global_state()}, "hvc.elastic.sync")
    opt._hvc_step, opt._hvc_epoch, opt._hvc_epoch_set = shared["step"], shared["epoch"], shared["epoch_set"]
    opt._hvc_compressor.load_global_state(shared["compressor"])
    _broadcast_wrapped_state(opt)


def _broadcast_wrapped_state(opt) -> None:
    """The wrapped optimizer's state from rank 0, as ``hvd.broadcast_optimizer_state`` does for
    Horovod's own optimizer, without ever running an exchange: a rank with no state yet gets it
    from one step of the wrapped optimizer on zero gradients, with the parameters put back after
    (so weight decay cannot move them on that rank only)."""
    import horovod.torch as hvd

    if len(opt.state_dict()["state"]) == 0:
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        with torch.no_grad():
            saved = [(p, p.detach().clone(), p.grad) for p in params]
            for p in params:
                p.grad = torch.zeros_like(p)
            super(type(opt), opt).step()
            for p, value, grad in saved:
                p.copy_(value)
                p.grad = grad
    if len(opt.state_dict()["state"]) > 0:  # the same on every rank: the same optimizer class and settings
        hvd.broadcast_optimizer_state(opt, root_rank=0)


def make_torch_state():
    """``TorchState``: Horovod's, with a state handler for hvdcompress optimizers (see the module doc)."""
    from horovod.torch.elastic import state as hvd_state

    class CompressedOptimizerStateHandler(hvd_state.OptimizerStateHandler):
        def sync(self):
            sync(self.value)

    class TorchState(hvd_state.TorchState):
        __doc__ = hvd_state.TorchState.__doc__

        def __init__(self, model=None, optimizer=None, **kwargs):
            optimizers = [v for v in [optimizer, *kwargs.values()] if is_compressed(v)]
            for opt in optimizers:
                if opt._hvc_delayed.active:
                    raise ValueError("optimizer: delayed averaging (delay/sync_every) keeps corrections of exchanges "
                                     "among the current ranks and cannot follow an elastic reset; use delay=0, "
                                     "sync_every=1 with elastic training")
            super().__init__(model=model, optimizer=optimizer, **kwargs)
            for name, handler in list(self._handlers.items()):
                if is_compressed(handler.value):
                    self._handlers[name] = CompressedOptimizerStateHandler(handler.value)
            self.register_reset_callbacks([lambda: [after_reinit(o) for o in optimizers]])

    return TorchState
