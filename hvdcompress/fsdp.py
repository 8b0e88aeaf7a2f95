"""``hvdcompress.fsdp``: any of our compressors that fit a reduce-scatter, in FSDP2, in one line::

    fully_shard(block) for each block; fully_shard(model)        # as usual
    fsdp = hvdcompress.fsdp.compress(model, "qsgd:levels=7,bucket=128")

Across nodes, only the slow hop compressed (shard inside a node, replicate across)::

    mesh = hvdcompress.fsdp.hybrid_mesh("2x4")                  # 2 nodes of 4 ranks
    fully_shard(block, mesh=mesh["shard"]) for each block; fully_shard(model, mesh=mesh["shard"])
    fsdp = hvdcompress.fsdp.compress(model, "qsgd:levels=7,bucket=128", topology="2x4")

Launched with ``torchrun``; Horovod is not needed. ``torch_ops.fsdp`` says how chunks travel, where
state lives and what ``residual=`` costs; docs/fsdp.md has the recipe and what is supported.
"""

from torch_ops.fsdp import CompressedReduceScatter, FSDPCompression, ReduceScatterWork, compress, hybrid_mesh

__all__ = ["CompressedReduceScatter", "FSDPCompression", "ReduceScatterWork", "compress", "hybrid_mesh"]
