"""The PyTorch exchange session (``torch_ops.session``) and the transport protocol
(``hvdcompress.contract.Transport``), in one process: the transports are peers with the whole
protocol, the session keeps state per name whatever the grouping, its exchanges equal the numpy
oracle's on a world of one, its saved form round-trips with the checks, and the optimizer builds
its compressor once. The front ends over it run on real processes in test_multiprocess.py,
test_torch_distributed.py and test_diloco.py."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from hvdcompress import parse_spec
from hvdcompress.contract import Transport
from hvdcompress.reference import simulate
from torch_ops.collectives import Communicator, finish_all
from torch_ops.dist_collectives import TorchDistCommunicator
from torch_ops.session import ExchangeSession, exchange_name


class OneRank:
    """A transport of one rank: a sum or a gather of one tensor is the tensor."""

    process_set = None

    def rank(self):
        return 0

    def size(self):
        return 1

    def included(self):
        return True

    def launch(self, requests, name):
        return [r.tensor.clone() for r in requests]

    def wait(self, handles):
        return tuple(handles)

    def poll(self, handles):
        return True


def _protocol_methods():
    return [n for n, v in vars(Transport).items() if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("cls", [Communicator, TorchDistCommunicator])
def test_transports_are_peers_with_the_whole_protocol(cls):
    other = TorchDistCommunicator if cls is Communicator else Communicator
    assert not issubclass(cls, other)
    for name in _protocol_methods():
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
        want = list(inspect.signature(getattr(Transport, name)).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == want, name


def _params():
    torch.manual_seed(0)
    return {"a": torch.zeros(6), "b": torch.zeros(2, 3), "c": torch.zeros(4)}


def test_state_is_kept_per_name_across_groupings():
    s = ExchangeSession(parse_spec("topk:ratio=0.5"), _params(), OneRank())
    s.state_for(("a",))["residual"] = torch.arange(6.0)
    s.state_for(("c",))["residual"] = torch.full((4,), 7.0)
    merged = s.state_for(("a", "b", "c"))  # b had none: zeros in its place
    assert torch.equal(merged["residual"], torch.cat([torch.arange(6.0), torch.zeros(6), torch.full((4,), 7.0)]))
    assert s.state_for(("a", "b", "c")) is merged  # the same dict while the group is in use
    merged["residual"].add_(1.0)
    s.state_for(("b",))  # an overlapping group: the merged one is split back per name first
    per = s.param_state()
    assert torch.equal(per["a"]["residual"], torch.arange(6.0) + 1)
    assert torch.equal(per["b"]["residual"], torch.ones(6))
    assert torch.equal(per["c"]["residual"], torch.full((4,), 8.0))
    per["a"]["residual"].zero_()  # copies: the live state is untouched
    assert torch.equal(s.param_state()["a"]["residual"], torch.arange(6.0) + 1)


def test_exchange_equals_the_oracle_on_one_rank_and_the_step_ends():
    spec = parse_spec("topk:ratio=0.5")
    s = ExchangeSession(spec, _params(), OneRank())
    rng = np.random.default_rng(1)
    state: dict = {}
    for step in range(3):
        g = rng.standard_normal(6).astype(np.float32)
        ex = s.start(torch.from_numpy(g.copy()), ("a",), key="a", step=step, name=exchange_name("a"), shape=(6,))
        s.pending.add(("a", step), ex, step)
        done = s.pending.finish(step)
        result, states, _ = simulate(spec, [g], key="a", step=step, states=[state], shape=(6,))
        assert np.array_equal(done[("a", step)].result.numpy(), result)
        for k, v in states[0].items():
            assert np.array_equal(s.state_for(("a",))[k].numpy(), v), k
        s.end_step(done.values(), 6 * 4)
    assert s.step == 3 and s.stats.steps == 3


def test_a_nonfinite_input_gives_nan_and_leaves_no_nan_in_the_state():
    s = ExchangeSession(parse_spec("topk:ratio=0.5"), _params(), OneRank())
    x = torch.tensor([1.0, float("nan"), 3.0, -4.0, 0.5, 2.0])
    ex = s.start(x, ("a",), key="a", step=0, name=exchange_name("a"), shape=(6,))
    finish_all([ex])
    assert torch.isnan(ex.result).all()
    assert torch.isfinite(s.state_for(("a",))["residual"]).all()


def test_saved_form_round_trips_with_its_checks():
    spec = parse_spec("topk:ratio=0.5")
    s = ExchangeSession(spec, _params(), OneRank())
    s.state_for(("a", "b"))["residual"] = torch.arange(12.0)
    s.set_epoch(2)
    s.step = 5
    saved = s.pack()
    other = ExchangeSession(spec, _params(), OneRank())
    other.check(saved)
    other.load(saved)
    assert (other.step, other.epoch, other.epoch_set) == (5, 2, True)
    assert torch.equal(other.state_for(("a", "b"))["residual"], torch.arange(12.0))
    with pytest.raises(ValueError, match="compression"):
        ExchangeSession(parse_spec("topk:ratio=0.25"), _params(), OneRank()).check(saved)
    bad = dict(saved, state={"a": {"residual": torch.full((6,), float("inf"))}})
    with pytest.raises(ValueError, match="non-finite"):
        other.check(bad)


def test_set_epoch_checks_its_argument():
    s = ExchangeSession(parse_spec("none"), _params(), OneRank())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="epoch must be an int >= 0"):
            s.set_epoch(bad)


def test_the_optimizer_builds_its_compressor_once(monkeypatch):
    import torch_ops.optimizer as optimizer_module
    import torch_ops.session as session_module
    from torch_ops.optimizer import DistributedOptimizer

    built = []
    real = optimizer_module.build_compressor

    def counting(spec):
        built.append(str(spec))
        return real(spec)

    monkeypatch.setattr(optimizer_module, "build_compressor", counting)
    monkeypatch.setattr(session_module, "build_compressor", counting)
    model = torch.nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                               compression="dgc:ratio=0.5,warmup_epochs=0", transport=OneRank(), schedule="layerwise")
    assert len(built) == 1 and opt.engine.compressor.spec == opt.compression
    assert opt.compression["momentum"] == 0.9 and opt.param_groups[0]["momentum"] == 0.0  # taken over


def test_driver_is_the_deprecated_name_of_transport():
    """``transport=`` is the keyword; ``driver=`` (its former name) still works for one release,
    with a DeprecationWarning naming ``transport=``; both at once is refused before any collective."""
    from torch_ops.diloco import DiLoCo
    from torch_ops.optimizer import DistributedOptimizer

    def make(which, **kw):
        model = torch.nn.Linear(4, 2)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        if which == "optimizer":
            return DistributedOptimizer(sgd, named_parameters=model.named_parameters(), schedule="layerwise", **kw)
        return DiLoCo(model, sgd, sync_every=2, **kw)

    for which in ("optimizer", "diloco"):
        transport = OneRank()
        with pytest.warns(DeprecationWarning, match="driver= is deprecated.*transport=") as caught:
            opt = make(which, driver=transport)
        assert caught[0].filename == __file__  # points at the caller's line
        assert (opt.engine if which == "optimizer" else opt).transport is transport
        with pytest.raises(ValueError, match="transport= and driver= name the same argument"):
            make(which, transport=OneRank(), driver=OneRank())
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the new keyword warns nothing
            assert (make(which, transport=transport).engine if which == "optimizer"
                    else make(which, transport=transport)).transport is transport
