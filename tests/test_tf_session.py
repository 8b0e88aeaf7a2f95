"""Single-process tests of the TF exchange session (``tf_ops.session``) and what is built on it:
the two front ends share one session class, the saved format keeps its names, the sync policies
see a ``PolicyHost``, and the Horovod ``Communicator`` has every method of ``contract.Transport``.
Real multi-rank runs of the same code are the TF scenario tests (tests/test_tf_*.py)."""

import tempfile

import numpy as np
import pytest
import tensorflow as tf

import hvdcompress.tensorflow as hvc
from hvdcompress.contract import Transport
from tf_ops.collectives import Communicator
from tf_ops.policy import Synchronous
from tf_ops.session import ExchangeSession, exchange_name


class OneRankTransport:
    """A world of one: allreduce and allgather return the tensor itself."""

    process_set = None

    def run(self, requests, name):
        return tuple(r.tensor for r in requests)


def _saved_names(**objects):
    path = tf.train.Checkpoint(**objects).save(tempfile.mkdtemp() + "/c")
    return sorted(name for name, _ in tf.train.list_variables(path) if name != "_CHECKPOINTABLE_OBJECT_GRAPH")


def test_both_front_ends_are_adapters_over_one_session_that_builds_the_compressor_once():
    comp = hvc.GradientCompression("topk:ratio=0.5", transport=OneRankTransport())
    diloco = hvc.DiLoCo([tf.Variable(tf.ones([3]))], sync_every=2, compression="topk:ratio=0.5",
                        transport=OneRankTransport())
    assert isinstance(comp.session, ExchangeSession) and isinstance(diloco.session, ExchangeSession)
    assert comp.compressor is comp.session.compressor and diloco.compressor is diloco.session.compressor
    assert comp.step is comp.session.step and comp.epoch is comp.session.epoch
    assert exchange_name("hvc.diloco", "v0", "s3") == "hvc.diloco.v0.s3"


def test_the_saved_format_keeps_its_names():
    comp = hvc.GradientCompression("dgc:ratio=0.1,warmup_epochs=1,min_sparse_numel=4", transport=OneRankTransport())
    comp.exchange([tf.ones([8, 4]), tf.ones([4])], world_size=1, scale=1.0)
    assert _saved_names(compression=comp) == [
        "compression/_density/.ATTRIBUTES/VARIABLE_VALUE", "compression/_restored/.ATTRIBUTES/restored"] + [
        f"compression/{n}/.ATTRIBUTES/VARIABLE_VALUE"
        for n in ("epoch", "epoch_set", "slots/0/u", "slots/0/v", "slots/1/u", "spec_text", "step")
    ] + ["save_counter/.ATTRIBUTES/VARIABLE_VALUE"]
    variables = [tf.Variable(tf.ones([3]))]
    diloco = hvc.DiLoCo(variables, sync_every=2, compression="topk:ratio=0.5", transport=OneRankTransport())
    diloco.start()
    assert diloco.started
    assert _saved_names(diloco=diloco) == [
        f"diloco/{n}/.ATTRIBUTES/VARIABLE_VALUE"
        for n in ("_started", "_vars/0", "bytes_sent", "comp_state/0/residual", "global_params/0", "in_flight",
                  "momentum_buffers/0", "pending/0", "rounds", "t")
    ] + ["save_counter/.ATTRIBUTES/VARIABLE_VALUE"]


def test_sent_bytes_added_beside_the_exchange_count_in_the_stats():
    comp = hvc.GradientCompression("none", transport=OneRankTransport())
    comp.exchange([tf.ones([4])], world_size=1, scale=1.0)
    comp.add_sent(tf.constant(10, tf.int64), 40)
    s = comp.stats
    assert (s.steps, s.last_bytes, s.last_dense_bytes, s.total_bytes) == (1, 26, 56, 26)


def test_a_policy_sees_only_the_host():
    class Host:
        factor, process_set, name = 1.0, None, "hvc.flush"

        def exchange(self, grads):
            return [g * 2 for g in grads]

    out = Synchronous().step(Host(), [tf.ones([2])])
    np.testing.assert_array_equal(out[0].numpy(), [2.0, 2.0])
    assert Synchronous().pending(Host()) == []


def test_the_communicator_implements_every_method_of_the_transport_protocol():
    wanted = {n for n in vars(Transport) if not n.startswith("_")} | set(Transport.__annotations__)
    missing = [n for n in sorted(wanted) if not hasattr(Communicator, n) and n != "process_set"]
    assert missing == []


@pytest.fixture(scope="module")
def workers():
    from scenarios import shared_tf_launch
    return shared_tf_launch.results("test_tf_session")


@pytest.mark.multiprocess
def test_the_communicator_carries_the_transport_protocol_on_two_workers(workers):
    for rank, out in enumerate(workers):
        assert out["who"] == [rank, 2, True, ["horovod"]]
        assert out["poll"] is True
        assert out["round"] == [[3.0, 6.0], [0.0, 1.0, 1.0], [float(rank), 10.0 + rank]]
        assert out["run"] == [[1.0]]
        assert out["average"] == [0.5, 4.0]
        assert out["allgather"] == [[0, 0], [1, 1]]
        assert out["objects"] == [{"rank": 0}, {"rank": 1}]
        assert out["broadcast"] == "from 1"
        assert out["transport"] == "Communicator"
    # top-k 0.5 of g * (rank + 1): both ranks send 8.0 * r and -4.0 * r; the average of the sums
    assert workers[0]["exchange"] == workers[1]["exchange"] == [0.0, -6.0, 0.0, 12.0]


class RecordingTransport(OneRankTransport):
    """A world of one that records the name of every round it runs."""

    def __init__(self):
        self.names = []

    def run(self, requests, name):
        self.names.append(name)
        return super().run(requests, name)


def test_sparse_gradients_go_through_the_session_transport_and_stats():
    """An ``IndexedSlices`` gradient is exchanged on the GradientCompression's session (its
    transport, its stats), not on a communicator of its own; the result is Horovod's (values / N)."""
    from tf_ops.exchanger import Exchanger

    transport = RecordingTransport()
    comp = hvc.GradientCompression("none", transport=transport)
    ex = Exchanger(comp, world_size=1, scale=1.0, prescale=1.0, process_set=None, sparse_as_dense=False,
                   who="test")
    values, indices = tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([3, 0], tf.int32)
    sparse = tf.IndexedSlices(values, indices, tf.constant([5, 2]))
    out = ex.exchange([tf.ones([4]), sparse])
    assert transport.names[-1] == "hvc.sparse.1.r0" and len(transport.names) == 2  # the dense group, then it
    assert isinstance(out[1], tf.IndexedSlices)
    np.testing.assert_array_equal(out[1].values.numpy(), values.numpy())
    np.testing.assert_array_equal(out[1].indices.numpy(), indices.numpy())
    s = comp.stats
    assert s.steps == 1 and s.last_bytes == 4 * 4 + 4 * 4 + 2 * 4  # dense 4 floats; 4 values; 2 indices
    assert s.last_dense_bytes == 4 * 4 + 5 * 2 * 4


def test_tf_driver_is_the_deprecated_name_of_transport():
    """As on PyTorch: ``transport=`` is the keyword of both TF front ends; ``driver=`` warns
    (DeprecationWarning naming ``transport=``) and still works; both at once is refused."""
    import warnings

    def make(which, **kw):
        if which == "compression":
            return hvc.GradientCompression("none", **kw)
        return hvc.DiLoCo([tf.Variable(tf.ones([3]))], sync_every=2, **kw)

    for which in ("compression", "diloco"):
        transport = OneRankTransport()
        with pytest.warns(DeprecationWarning, match="driver= is deprecated.*transport="):
            front = make(which, driver=transport)
        assert front.session.transport() is transport
        with pytest.raises(ValueError, match="transport= and driver= name the same argument"):
            make(which, transport=transport, driver=transport)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert make(which, transport=transport).session.transport() is transport
    diloco = make("diloco", transport=transport)
    assert diloco.transport is transport
    with pytest.warns(DeprecationWarning, match="DiLoCo.transport"):
        assert diloco.driver is transport
