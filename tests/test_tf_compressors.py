"""Cross-framework agreement: numpy oracle, torch_ops and tf_ops on the shared vectors (tests/scenarios/vectors.py).

For every compressor, over several steps (state carried), for 1-3 simulated ranks: the same payload
on the wire (indices and values, bit for bit), the same aggregated result, the same state
(residuals, DGC's u and v), the same byte count. TF runs eagerly here, and once more inside
``tf.function`` (graph mode, step and density as tensors) for a subset.
"""

import numpy as np
import pytest
import tensorflow as tf
import torch

from hvdcompress import parse_spec
from hvdcompress.reference import reference_exchange
from hvdcompress.reference import topk_indices as np_topk
from hvdcompress.reference.dgc import dgc_exchange
from hvdcompress.reference.dgc import sampled_threshold_select as np_select
from hvdcompress.sampling import random_indices, sample_offset, sample_stride
from hvdcompress.spec import num_selected
from scenarios.local_world import run_lockstep
from tf_ops import compressors as tfc
from torch_ops import compressors as tc
from scenarios.vectors import DGC_SPECS, KEY, SHAPES, SPECS, STEPS, epoch_of, gradients


def _tap(gen, sink, clone):
    """Pass an exchange through, recording its first round's payload tensors."""
    first = next(gen)
    sink.append([clone(r.tensor) for r in first])
    result = yield first
    while True:
        try:
            result = yield gen.send(result)
        except StopIteration as stop:
            return stop.value


def _oracle(spec, steps, world, shape):
    states, residuals = [{} for _ in range(world)], [None] * world
    for step, grads in enumerate(steps):
        if spec.name == "dgc":
            total, payloads = dgc_exchange(spec, grads, states, shape, key=KEY, step=step, epoch=epoch_of(step))
            yield total, payloads, [{k: v.copy() for k, v in st.items()} for st in states]
        else:
            total, residuals, payloads = reference_exchange(spec, grads, residuals, key=KEY, step=step)
            yield total, payloads, [{} if r is None else {"residual": r} for r in residuals]


def _torch(spec, steps, world, shape):
    comp = tc.build_compressor(spec)
    states = [{} for _ in range(world)]
    for step, grads in enumerate(steps):
        payloads = []
        gens = [_tap(comp.exchange(torch.from_numpy(g.reshape(-1).copy()),
                                   tc.ExchangeContext(KEY, step, world, 1.0 / world, st, shape, epoch_of(step))),
                     payloads, lambda t: t.clone().numpy())
                for g, st in zip(grads, states)]
        results, sent = run_lockstep(gens)
        yield ([r.numpy() for r in results], payloads, sent,
               [{k: v.numpy().copy() for k, v in st.items()} for st in states])


def _tf(spec, steps, world, shape):
    comp = tfc.build_compressor(spec)
    states = [comp.new_state(shape, tf.float32) for _ in range(world)]
    for step, grads in enumerate(steps):
        payloads = []
        gens = [_tap(comp.exchange(tf.reshape(tf.constant(g), [-1]),
                                   tfc.ExchangeContext(KEY, step, world, 1.0 / world, st, shape, epoch_of(step))),
                     payloads, lambda t: t.numpy())
                for g, st in zip(grads, states)]
        results, sent = run_lockstep(gens)
        yield ([r.numpy() for r in results], payloads, sent,
               [{k: v.numpy() for k, v in st.items()} for st in states])


def _check_state(want, got, label):
    for name, arr in want.items():
        np.testing.assert_array_equal(got[name], arr, err_msg=f"{label}: state {name}")


@pytest.mark.parametrize("shape", SHAPES, ids=["2d", "1d"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("text", SPECS + DGC_SPECS)
def test_numpy_torch_and_tensorflow_agree_bit_for_bit(text, world, shape):
    spec = parse_spec(text)
    steps = gradients(text, world, shape)
    half_sum_3 = spec.name == "fp16" and world == 3  # 3-way half sums may round differently than numpy's
    for step, (want, th, tfx) in enumerate(zip(_oracle(spec, steps, world, shape), _torch(spec, steps, world, shape),
                                               _tf(spec, steps, world, shape))):
        total, payloads, states = want
        for r in range(world):
            label = f"{text} world={world} step={step} rank={r}"
            names = list(payloads[r])
            for impl, (results, got_payloads, sent, got_states) in (("torch", th), ("tf", tfx)):
                assert len(got_payloads[r]) == len(names), f"{impl} {label}"
                for name, arr in zip(names, got_payloads[r]):
                    assert arr.dtype == payloads[r][name].dtype, f"{impl} {label} {name}"
                    np.testing.assert_array_equal(arr, payloads[r][name], err_msg=f"{impl} {label} {name}")
                assert int(sent[r]) == sum(a.nbytes for a in payloads[r].values()), f"{impl} {label}"
                if half_sum_3:
                    np.testing.assert_allclose(results[r], total, rtol=2e-3, atol=1e-3)
                else:
                    np.testing.assert_array_equal(results[r], total, err_msg=f"{impl} {label}")
                _check_state(states[r], got_states[r], f"{impl} {label}")
            np.testing.assert_array_equal(tfx[0][r], th[0][r], err_msg=f"tf vs torch {label}")


GRAPH_SPECS = ["fp16:residual=true", "bf16", "topk:ratio=0.01", "randomk:ratio=0.05,seed=3",
               "threshold:threshold=1.5"] + DGC_SPECS[:2]


@pytest.mark.parametrize("text", GRAPH_SPECS)
def test_tensorflow_graph_mode_agrees_with_the_oracle(text):
    """Inside tf.function: traced once, then run for several steps with step and density as tensors."""
    spec, world, shape = parse_spec(text), 2, SHAPES[0]
    comp = tfc.build_compressor(spec)
    states = [comp.new_state(shape, tf.float32) for _ in range(world)]

    @tf.function
    def exchange(grads, step, density):
        payloads = []
        gens = [_tap(comp.exchange(tf.reshape(g, [-1]), tfc.ExchangeContext(KEY, step, world, 0.5, st, shape,
                                                                             0, density=density)),
                     payloads, tf.identity)
                for g, st in zip(grads, states)]
        results, sent = run_lockstep(gens)
        return results, payloads, sent

    steps = gradients(text, world, shape)
    for step, (want, grads) in enumerate(zip(_oracle(spec, steps, world, shape), steps)):
        total, payloads, want_states = want
        density = (tf.constant(comp.scheduled_density(epoch_of(step)), tf.float64) if comp.has_density else None)
        results, got_payloads, sent = exchange([tf.constant(g) for g in grads], tf.constant(step, tf.int64), density)
        for r in range(world):
            for name, arr in zip(payloads[r], got_payloads[r]):
                np.testing.assert_array_equal(arr.numpy(), payloads[r][name], err_msg=f"{text} step {step} {name}")
            np.testing.assert_array_equal(results[r].numpy(), total, err_msg=f"{text} step {step}")
            assert int(sent[r]) == sum(a.nbytes for a in payloads[r].values())
            _check_state(want_states[r], {k: v.numpy() for k, v in states[r].items()}, f"{text} step {step}")
    assert exchange.experimental_get_tracing_count() == 1


def test_selected_count_as_a_tensor_equals_the_core_rule():
    for numel in (1, 7, 100, 1000, 4099, 123_457):
        for ratio in (1e-6, 0.001, 0.01, 0.07, 0.1, 0.37, 0.5, 1.0 / 3, 0.999, 1.0):
            got = tfc.selected_count(tf.constant(ratio, tf.float64), numel)
            assert int(got) == num_selected(ratio, numel) == tfc.selected_count(ratio, numel), (numel, ratio)


def test_topk_breaks_ties_toward_lower_index():
    x = tf.constant([1.0, -3.0, 2.0, 3.0, -2.0, 2.0, 0.0, -2.0])
    assert tfc.topk_indices(x, 3).numpy().tolist() == [1, 2, 3]
    assert tfc.topk_indices(x, 5).numpy().tolist() == [1, 2, 3, 4, 5]
    assert tfc.topk_indices(tf.fill([50], 0.5), 4).numpy().tolist() == [0, 1, 2, 3]
    rng = np.random.default_rng(0)
    big = np.round(rng.standard_normal(200_000), 2).astype(np.float32)  # many ties
    for k in (1, 200, 5000):
        np.testing.assert_array_equal(tfc.topk_indices(tf.constant(big), k).numpy(), np_topk(big, k))
        np.testing.assert_array_equal(tfc.topk_indices(tf.constant(big), tf.constant(k)).numpy(), np_topk(big, k))


@pytest.mark.parametrize("n, k", [(10_000, 10), (10_000, 100), (50_000, 50), (1000, 999), (5000, 1)])
@pytest.mark.parametrize("dist", ["normal", "ties", "sparse", "zeros"])
def test_sampled_selection_matches_the_oracle(n, k, dist):
    rng = np.random.default_rng(n + k)
    v = {"normal": rng.standard_normal(n), "ties": np.round(rng.standard_normal(n), 1),
         "sparse": rng.standard_normal(n) * (rng.random(n) < 0.02), "zeros": np.zeros(n)}[dist].astype(np.float32)
    for sample_ratio, iters in ((0.01, 4), (0.1, 0), (1.0, 2)):
        off = sample_offset(sample_stride(sample_ratio), n, 0, 3, "x")
        want = np_select(v, k, sample_ratio, iters, off)
        got = tfc.sampled_threshold_select(tf.constant(v), k, sample_ratio, iters, off)
        np.testing.assert_array_equal(got.numpy(), want)


def test_random_selection_from_a_tensor_step_is_the_core_scheme():
    fn = tf.function(lambda step, k: tfc.random_selection(1000, k, 5, step, "w"))
    for step in (0, 1, 7):
        got = fn(tf.constant(step, tf.int64), tf.constant(10))
        np.testing.assert_array_equal(got.numpy(), random_indices(1000, 10, 5, step, "w"))


def test_threshold_may_send_nothing_and_results_still_agree():
    comp = tfc.build_compressor(parse_spec("threshold:threshold=10.0"))
    grads = [tf.zeros(20), tf.fill([20], 11.0)]
    states = [comp.new_state((20,), tf.float32) for _ in grads]
    results, sent = run_lockstep([comp.exchange(g, tfc.ExchangeContext("p", 0, 2, 0.5, st, (20,)))
                                  for g, st in zip(grads, states)])
    assert sent[0] == 0
    np.testing.assert_array_equal(results[0].numpy(), np.full(20, 5.5, np.float32))
    np.testing.assert_array_equal(results[1].numpy(), results[0].numpy())


@pytest.mark.parametrize("text", ["none", "fp16", "bf16", "topk:ratio=0.3", "randomk:ratio=0.3",
                                  "threshold:threshold=0.5"])
def test_float64_gradients_keep_their_dtype(text):
    comp = tfc.build_compressor(parse_spec(text))
    x = tf.constant(np.random.default_rng(1).standard_normal(64))
    (out,), _ = run_lockstep([comp.exchange(x, tfc.ExchangeContext("p", 0, 1, 1.0, comp.new_state((64,), tf.float64),
                                                                   (64,)))])
    assert out.dtype == tf.float64 and out.shape == x.shape
