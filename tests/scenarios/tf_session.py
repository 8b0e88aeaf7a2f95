"""Worker code for tests/test_tf_session.py: the TF ``Communicator`` as a ``contract.Transport``
on real Horovod workers (who, a round launched and waited, the blocking and object collectives),
and a ``GradientCompression`` exchange run on its session's transport."""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


def everything() -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf
    import hvdcompress.keras as hvc
    from hvdcompress.contract import Allgather, Allreduce, Alltoall
    from tf_ops.collectives import Communicator

    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    comm = Communicator()
    out = {"who": [comm.rank(), comm.size(), comm.included(), sorted(comm.versions())]}
    handles = comm.launch([Allreduce(tf.constant([1.0, 2.0]) * (rank + 1)),
                           Allgather(tf.fill([rank + 1], float(rank))),
                           Alltoall(tf.constant([10.0 * rank, 10.0 * rank + 1]), (1, 1))], "hvc.test.round")
    out["poll"] = comm.poll(handles)
    out["round"] = [t.numpy().tolist() for t in comm.wait(handles)]
    with comm.batch():
        out["run"] = [t.numpy().tolist() for t in comm.run([Allreduce(tf.constant([float(rank)]))], "hvc.test.run")]
    var = tf.Variable([float(rank), 4.0])
    comm.allreduce_(var, "hvc.test.average", average=True)
    out["average"] = var.numpy().tolist()
    out["allgather"] = comm.allgather(tf.constant([[rank, rank]]), "hvc.test.gather").numpy().tolist()
    comm.barrier()
    out["objects"] = comm.allgather_object({"rank": rank}, "hvc.test.objects")
    out["broadcast"] = comm.broadcast_object(f"from {rank}", "hvc.test.broadcast", root=1)
    comp = hvc.GradientCompression("topk:ratio=0.5")
    got = comp.exchange([tf.constant([1.0, -4.0, 2.0, 8.0]) * (rank + 1)], world_size=size, scale=1.0 / size)
    out["exchange"] = got[0].numpy().tolist()
    out["transport"] = type(comp.session.transport(None)).__name__
    return out
