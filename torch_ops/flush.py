"""``opt.flush()`` for delayed averaging and temporal sparsity: make the replicas identical.

With ``delay=D`` each rank's parameters hold its own last D local terms, and the exchanges launched
at those steps are still in flight; with ``sync_every=K`` up to K-1 steps of local gradients are
applied but not yet exchanged. Flushing, on every rank between steps:

1. waits for every exchange in flight (their corrections ``R - L`` become due);
2. temporal sparsity: exchanges the accumulated local gradients (zero gradients, so the launch's
   local term is what was accumulated) and waits for that too;
3. applies all the due corrections as one step of the wrapped optimizer (the compressor's
   ``before_step`` first, as in any step);
4. averages the parameters and the optimizer's per-parameter state over the ranks
   (``torch_ops.delayed.average_over_ranks``): what the corrections cannot make equal (the
   optimizer's own nonlinear state, rounding) is equal afterwards, bit for bit.
"""

from __future__ import annotations

import torch

from .delayed import average_over_ranks


def flush(opt, wrapped_step) -> None:
    """Flush ``opt`` (our DistributedOptimizer); ``wrapped_step`` is the wrapped optimizer's own
    ``step``. Nothing to do when training is synchronous."""
    delayed = opt._hvc_delayed
    if not delayed.active:
        return
    if opt._hvc_launched_now():
        raise AssertionError("optimizer.flush() was called between backward() and step(); call it between steps")
    by_name = opt._hvc_by_name
    with torch.no_grad():
        opt._hvc_complete_in_flight()
        if delayed.accumulated:  # temporal sparsity: exchange what was only applied locally
            delayed.flushing = True
            for gi, group in enumerate(opt._hvc_groups):
                for name in group.names:
                    if by_name[name].grad is None:
                        by_name[name].grad = torch.zeros_like(by_name[name])
                    by_name[name].grad.zero_()
                opt._hvc_launch(gi)
            delayed.flushing = False
            for (s, gi), ex in opt._hvc_pending.finish(None).items():
                delayed.completed((s, gi), ex.result, due_step=s)
        corrections = delayed.pending_corrections()
        for name, p in by_name.items():
            c = corrections.get(name)
            p.grad = c.view_as(p).clone() if c is not None else torch.zeros_like(p)
        opt._hvc_compressor.before_step(opt.param_groups, opt.state)
    wrapped_step()
    average_over_ranks(opt._hvc_driver, opt._hvc_params, opt.state, "hvc.flush")
    for p in opt._hvc_params:
        p.grad = None
