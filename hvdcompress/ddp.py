"""``hvdcompress.ddp``: any of our compressors in torch's ``DistributedDataParallel``, in two lines::

    state, hook = hvdcompress.ddp.comm_hook("dgc:ratio=0.001", model=ddp_model, optimizer=opt)
    ddp_model.register_comm_hook(state, hook)

Launched with ``torchrun``; Horovod is not needed. ``torch_ops.ddp_hook`` says how buckets map to
merged groups, where state lives and how DGC takes the optimizer's momentum over; docs/torch-distributed.md
has the recipe. Where the launcher's ``LOCAL_WORLD_SIZE`` makes nodes of several ranks, each bucket
goes flat or two-level (dense inside a node, the compressor across), as predicted and measured
(``routes=``; docs/two-level.md).
"""

from torch_ops.ddp_hook import CommHookState, comm_hook, hook

__all__ = ["CommHookState", "comm_hook", "hook"]
