"""The per-group codec choice on TensorFlow (``GradientCompression(codec_choice="auto")``): the
plan's choice, and a group switching between its compressor and a dense / fp16 exchange against
the numpy reference ``hvdcompress.reference.fallback``; two ranks simulated in one process."""

import numpy as np
import pytest
import tensorflow as tf

from tf_ops.compression import GradientCompression
from hvdcompress.reference.fallback import dense_result, dense_send
from hvdcompress.schedule.costmodel import ComputeFit, CostModel
from hvdcompress.spec import parse_spec
from scenarios.local_world import run_lockstep
from tf_ops.codec_choice import check_codec_choice, fallback_exchange
from tf_ops.compressors import ExchangeContext, build_compressor

WORLD, N = 2, 384
CODECS = [None, "none", None, "fp16", None]


class _NoTransport:
    def run(self, requests, name):
        raise AssertionError("lockstep tests drive the generators themselves")


@pytest.mark.parametrize("text", ["topk:ratio=0.05", "dgc:ratio=0.05,momentum=0.9,min_sparse_numel=16"])
def test_switching_codecs_follows_the_reference(text):
    comp = build_compressor(parse_spec(text))
    shape = (12, 32)
    states = [comp.new_state(shape, tf.float32) for _ in range(WORLD)]
    momentum = comp.local_momentum()
    rng = np.random.default_rng(1)

    def step_fn(codec, grads, step):
        ctxs = [ExchangeContext("w", step, WORLD, 1.0 / WORLD, st, shape) for st in states]
        gens = [comp.exchange(g, c) if codec is None else fallback_exchange(comp, codec, g, c)
                for g, c in zip(grads, ctxs)]
        return run_lockstep(gens)[0]

    for step, codec in enumerate(CODECS):
        grads = [rng.standard_normal(N).astype(np.float32) for _ in range(WORLD)]
        before = [{k: v.numpy() for k, v in st.items()} for st in states]
        fn = tf.function(lambda gs, codec=codec, step=step: step_fn(codec, gs, step)) if step % 2 else \
            (lambda gs, codec=codec, step=step: step_fn(codec, gs, step))
        results = fn([tf.constant(g) for g in grads])
        np.testing.assert_array_equal(results[0].numpy(), results[1].numpy())
        if codec is None:
            continue
        wires, after = zip(*(dense_send(g, b, codec, momentum) for g, b in zip(grads, before)))
        np.testing.assert_array_equal(results[0].numpy(), dense_result(wires, 1.0 / WORLD))
        for st, want in zip(states, after):
            for k, v in st.items():
                np.testing.assert_array_equal(v.numpy(), want[k], err_msg=f"{step} {k}")


def _model(gbps):
    fits = {"topk:ratio=0.01": ComputeFit("dlogd", 1e-8, 1e-3), "fp16": ComputeFit("linear", 1e-10, 1e-6)}
    return CostModel.from_link(WORLD, gbps, 50e-6, fits)


def _exchange(comps, grads_per_rank):
    pending = [c.start_exchange(g, world_size=WORLD, scale=1.0 / WORLD) for c, g in zip(comps, grads_per_rank)]
    results = [[] for _ in comps]
    for j in range(len(pending[0].generators)):
        res, _ = run_lockstep([p.generators[j] for p in pending])
        for r in range(WORLD):
            results[r].append(res[r])
    return [p.finish(results[r], 0) for r, p in enumerate(pending)]


def test_auto_sends_dense_on_a_fast_link_and_compresses_on_a_slow_one():
    shapes = [(64, 32), (32,), (32, 10), (10,)]
    rng = np.random.default_rng(0)
    grads = [[tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes] for _ in range(WORLD)]
    fast = [GradientCompression("topk:ratio=0.01", transport=_NoTransport(), schedule="mgs", cost_model=_model(100.0),
                                    codec_choice="auto") for _ in range(WORLD)]
    dense = [GradientCompression("none", transport=_NoTransport(), schedule="single") for _ in range(WORLD)]
    got, want = _exchange(fast, grads), _exchange(dense, grads)
    codecs = fast[0].plan.codecs
    assert codecs and all(c in ("none", "fp16:residual=false") for c in codecs)
    if set(codecs) == {"none"}:  # dense sums of two ranks: what a dense exchange gives, bit for bit
        for a, b in zip(got[0], want[0]):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    slow = [GradientCompression("topk:ratio=0.01", transport=_NoTransport(), schedule="mgs", cost_model=_model(0.001),
                                    codec_choice="auto") for _ in range(WORLD)]
    _exchange(slow, grads)
    assert "topk:ratio=0.01,residual=true" in slow[0].plan.codecs


def test_bad_codec_choice_raises_before_any_exchange():
    topk = build_compressor(parse_spec("topk:ratio=0.01"))
    assert check_codec_choice("auto", topk) == ("fp16", "none") and check_codec_choice(None, topk) == ()
    with pytest.raises(ValueError, match=r"^codec_choice: must be one of 'auto', 'off' or None"):
        GradientCompression("topk:ratio=0.01", codec_choice=True)
    with pytest.raises(ValueError, match=r"^codec_choice: 'auto' needs synchronous training"):
        GradientCompression("topk:ratio=0.01", codec_choice="auto", delay=1)
    with pytest.raises(ValueError, match=r"^codec_choice: 'auto' plans the groups' specs"):
        GradientCompression("topk:ratio=0.01", codec_choice="auto", schedule=[[0, 1]])
    with pytest.raises(ValueError, match=r"no fit for fp16"):
        GradientCompression("topk:ratio=0.01", codec_choice="auto", schedule="mgs",
                                cost_model=CostModel.from_link(2, 1.0, 5e-5, {"topk:ratio=0.01": ComputeFit("linear", 1e-9, 0)}))


LOWRANK = "powersgd:rank=2"
MLP = [(20, 32), (32,), (32, 32), (32,), (32, 4), (4,)]  # kernels and biases, as tests/scenarios/kit.keras_mlp


def _lowrank_model():
    """A 0.1 Mbit/s link with 5 ms per hop and cheap compression: PowerSGD pays on the two large
    kernels, the rest is better merged into fp16 groups."""
    fit = ComputeFit("linear", 1e-10, 1e-6)
    return CostModel.from_link(WORLD, gbit_per_s=1e-4, latency_s=5e-3,
                               compress={LOWRANK: fit, "fp16": fit, "none": ComputeFit("linear", 1e-12, 1e-7)})


@pytest.mark.parametrize("schedule", ["auto", "mgwfbp", "mgs"])
def test_a_layerwise_compressor_is_planned_on_single_gradients_beside_merged_fp16_groups(schedule):
    """PowerSGD never merges (its q is shaped by the tensor): with the codec choice a searched
    schedule gives it groups of one gradient only and merges the others into fp16 / dense groups."""
    from tf_ops.grouping import check_schedule, make_groups
    grads = [tf.zeros(s) for s in MLP]
    groups, plan = make_groups(check_schedule(schedule), grads, parse_spec(LOWRANK), WORLD, _lowrank_model(),
                               ("fp16", "none"))
    assert [g.positions for g in groups] == [(5, 4, 3), (2,), (1,), (0,)]
    assert [g.codec for g in groups] == ["fp16:residual=false", None, "fp16:residual=false", None]
    assert plan.codecs[1] == plan.codecs[3] and plan.codecs[1].startswith("powersgd")
    alone, _ = make_groups(check_schedule("auto"), grads, parse_spec(LOWRANK), WORLD, _lowrank_model())
    assert [g.positions for g in alone] == [(i,) for i in range(5, -1, -1)]  # without the choice: layerwise
    comp = GradientCompression(LOWRANK, schedule=schedule, cost_model=_lowrank_model(), codec_choice="auto")
    assert comp.schedule == schedule
    assert GradientCompression(LOWRANK, schedule="auto").schedule == "layerwise"
    for other in ("size:1", "mgs:greedy"):  # a partition made without the choice
        with pytest.raises(ValueError, match="cannot be merged"):
            GradientCompression(LOWRANK, schedule=other, cost_model=_lowrank_model(), codec_choice="auto")
    with pytest.raises(ValueError, match="cannot be merged"):
        GradientCompression(LOWRANK, schedule="mgs", cost_model=_lowrank_model())


def test_a_merged_fp16_group_sends_the_residuals_and_leaves_q_alone():
    """Two simulated ranks, PowerSGD with the codec choice: the merged fp16 group (a kernel and two
    biases) sends the kernel's residual with its gradient and keeps the cast's rounding in it, as
    the numpy reference does; the biases, which have no residual, get no slot; the kernel's q is
    not touched; the kernels sent alone run PowerSGD on their own q and residual."""
    comps = [GradientCompression(LOWRANK, transport=_NoTransport(), schedule="auto", cost_model=_lowrank_model(),
                                 codec_choice="auto") for _ in range(WORLD)]
    rng = np.random.default_rng(3)

    def draw():
        return [[rng.standard_normal(s).astype(np.float32) for s in MLP] for _ in range(WORLD)]

    _exchange(comps, [[tf.constant(g) for g in gs] for gs in draw()])  # creates the slots
    assert [sorted(s) for s in comps[0].slots] == [["q", "residual"], [], ["q", "residual"], [], ["q", "residual"], []]
    for c in comps:  # a residual and a warm q of their own (as left by PowerSGD before a switch)
        for s in c.slots:
            for v in s.values():
                v.assign(rng.standard_normal(v.shape).astype(np.float32))
    before = [[{k: v.numpy().copy() for k, v in s.items()} for s in c.slots] for c in comps]
    grads = draw()
    out = _exchange(comps, [[tf.constant(g) for g in gs] for gs in grads])
    merged = (5, 4, 3)  # concatenated in that order
    wires, after = [], []
    for r in range(WORLD):
        flat = np.concatenate([grads[r][p].reshape(-1) for p in merged])
        state = {"residual": np.concatenate([before[r][p].get("residual", np.zeros(grads[r][p].size, np.float32))
                                             for p in merged])}
        wire, st = dense_send(flat, state, "fp16")
        wires.append(wire)
        after.append(st["residual"])
    want = dense_result(wires, 1.0 / WORLD)
    offsets = np.cumsum([0] + [grads[0][p].size for p in merged])
    for r in range(WORLD):
        got = np.concatenate([out[r][p].numpy().reshape(-1) for p in merged])
        np.testing.assert_array_equal(got, want)
        slots = comps[r].slots
        np.testing.assert_array_equal(slots[4]["residual"].numpy(), after[r][offsets[1]:offsets[2]])
        assert np.abs(slots[4]["residual"].numpy()).max() < 1e-2 * np.abs(before[r][4]["residual"]).max()
        np.testing.assert_array_equal(slots[4]["q"].numpy(), before[r][4]["q"])  # q: untouched
        assert not slots[3] and not slots[5]
        for p in (0, 2):  # PowerSGD alone: its q and residual moved on
            assert not np.array_equal(slots[p]["q"].numpy(), before[r][p]["q"])
            assert not np.array_equal(slots[p]["residual"].numpy(), before[r][p]["residual"])
        for p in range(len(MLP)):
            np.testing.assert_array_equal(out[r][p].numpy(), out[0][p].numpy())
