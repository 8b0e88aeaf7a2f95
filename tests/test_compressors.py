"""Single-process tests of the PyTorch compressors against the numpy oracle.

Exchanges run in a local lockstep world (tests/scenarios/local_world.py) so payloads and results of every
simulated rank can be compared exactly with ``hvdcompress.reference``.
"""

import numpy as np
import pytest
import torch

from hvdcompress import Compression, parse_spec
from hvdcompress.reference import reference_exchange, reference_payload, topk_indices as np_topk
from hvdcompress.sampling import random_indices
from hvdcompress.spec import num_selected
from scenarios.local_world import run_lockstep
from torch_ops.compressors import ExchangeContext, build_compressor, topk_indices

SPECS = [
    "none", "fp16", "fp16:residual=true", "bf16", "bf16:residual=true",
    "topk:ratio=0.01", "topk:ratio=0.1,residual=false", "topk:ratio=1.0",
    "randomk:ratio=0.05,seed=3", "randomk:ratio=0.2,residual=false",
    "threshold:threshold=1.5", "threshold:threshold=0.5,residual=false",
]


def _exchange_torch(spec, grads, states, key, step, scale):
    comp = build_compressor(spec)
    ctxs = [ExchangeContext(key, step, len(grads), scale, st) for st in states]
    gens = [comp.exchange(torch.from_numpy(g.copy()).reshape(-1), c) for g, c in zip(grads, ctxs)]
    # capture each rank's payload as yielded (before the collective changes it in place)
    payloads = []

    def tap(gen):
        first = next(gen)
        payloads.append([r.tensor.clone() for r in first])
        result = yield first
        while True:
            try:
                result = yield gen.send(result)
            except StopIteration as stop:
                return stop.value

    results, sent = run_lockstep([tap(g) for g in gens])
    return results, payloads, sent


@pytest.mark.parametrize("text", SPECS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_torch_matches_numpy_reference_over_steps(text, world):
    spec = parse_spec(text)
    rng = np.random.default_rng(world * 100 + len(text))
    shape = (37, 11)
    states = [{} for _ in range(world)]
    np_res = [None] * world
    for step in range(4):
        grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(world)]
        want, np_res, want_payloads = reference_exchange(spec, grads, np_res, key="layer.w", step=step)
        got, payloads, sent = _exchange_torch(spec, grads, states, "layer.w", step, 1.0 / world)
        for r in range(world):
            names = list(want_payloads[r])
            assert len(payloads[r]) == len(names)
            for name, t in zip(names, payloads[r]):
                np.testing.assert_array_equal(t.numpy(), want_payloads[r][name], err_msg=f"{name} rank {r}")
            assert sent[r] == sum(a.nbytes for a in want_payloads[r].values())
            if spec.name == "fp16" and world == 3:  # 3-way half-precision sums may round differently
                np.testing.assert_allclose(got[r].numpy(), want, rtol=2e-3, atol=1e-3)
            else:
                np.testing.assert_array_equal(got[r].numpy(), want)
            if np_res[r] is None:
                assert "residual" not in states[r]
            else:
                np.testing.assert_array_equal(states[r]["residual"].numpy(), np_res[r])


@pytest.mark.parametrize("text", [s for s in SPECS if "residual=false" not in s and s not in ("none", "fp16", "bf16")])
def test_error_feedback_conserves_the_sum(text):
    """sent + new residual == gradient + old residual: nothing is dropped, only delayed."""
    spec = parse_spec(text)
    comp = build_compressor(spec)
    state = {}
    old = torch.zeros(500)
    for step in range(5):
        g = torch.randn(500)
        ctx = ExchangeContext("p", step, 1, 1.0, state)
        (sent,), _ = run_lockstep([comp.exchange(g, ctx)])
        torch.testing.assert_close(sent + state["residual"], g + old, rtol=0, atol=1e-6)
        old = state["residual"].clone()


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.37, 1.0])
@pytest.mark.parametrize("numel", [1, 7, 1000, 4099])
def test_sparsifiers_send_exactly_k(ratio, numel):
    x = torch.randn(numel)
    k = num_selected(ratio, numel)
    for name in ("topk", "randomk"):
        comp = build_compressor(parse_spec(f"{name}:ratio={ratio}"))
        payload = comp.compress(x, ExchangeContext("p", 0, 1, 1.0, {}))
        assert payload[-1].numel() == k
    idx = random_indices(numel, k, 0, 0, "p")
    assert len(np.unique(idx)) == k and idx.min() >= 0 and idx.max() < numel


def test_topk_breaks_ties_toward_lower_index():
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0, 0.0, -2.0])
    # |x| sorted: 3 (1), 3 (3), 2 (2), 2 (4), 2 (5), 2 (7), 1, 0
    assert topk_indices(x, 3).tolist() == [1, 2, 3]
    assert topk_indices(x, 5).tolist() == [1, 2, 3, 4, 5]
    assert np_topk(x.numpy(), 5).tolist() == [1, 2, 3, 4, 5]
    const = torch.full((50,), 0.5)
    assert topk_indices(const, 4).tolist() == [0, 1, 2, 3]


def test_topk_matches_reference_on_large_tensor_with_ties():
    rng = np.random.default_rng(0)
    x = np.round(rng.standard_normal(200_000), 2).astype(np.float32)  # many ties
    for k in (1, 200, 5000):
        np.testing.assert_array_equal(topk_indices(torch.from_numpy(x), k).numpy(), np_topk(x, k))


@pytest.mark.parametrize("text", ["none", "fp16", "bf16", "topk:ratio=0.3", "randomk:ratio=0.3",
                                  "threshold:threshold=0.5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_result_keeps_dtype_and_size(text, dtype):
    comp = build_compressor(parse_spec(text))
    x = torch.randn(64, dtype=dtype)
    (out,), _ = run_lockstep([comp.exchange(x, ExchangeContext("p", 0, 1, 1.0, {}))])
    assert out.dtype == dtype and out.shape == x.shape


def test_round_trip_of_lossless_settings():
    x = torch.randn(300)
    for text in ("none", "topk:ratio=1.0", "randomk:ratio=1.0"):
        comp = build_compressor(parse_spec(text))
        (out,), _ = run_lockstep([comp.exchange(x, ExchangeContext("p", 0, 1, 1.0, {}))])
        torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_codecs_round_trip_within_precision():
    x = torch.randn(1000) * 10
    for text, rtol in (("fp16", 2 ** -11), ("bf16", 2 ** -8)):
        comp = build_compressor(parse_spec(text))
        (out,), _ = run_lockstep([comp.exchange(x, ExchangeContext("p", 0, 1, 1.0, {}))])
        torch.testing.assert_close(out, x, rtol=rtol, atol=1e-6)


def test_bf16_reference_rounds_like_torch_including_ties_and_specials():
    from hvdcompress.reference import bf16_decode, bf16_encode
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x80000000,
                     0x7F800000, 0xFF800000, 0x7FC00000], dtype=np.uint32)
    x = np.concatenate([bits.view(np.float32), np.random.default_rng(1).standard_normal(10000).astype(np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()
    got = bf16_encode(x)
    nan = np.isnan(x)  # a NaN becomes some NaN code; which one is not specified (torch's vector path differs)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(bf16_decode(got[nan])).all()


def test_threshold_may_send_nothing():
    comp = build_compressor(Compression.threshold(threshold=10.0))
    grads = [torch.zeros(20), torch.full((20,), 11.0)]
    results, sent = run_lockstep([comp.exchange(g, ExchangeContext("p", 0, 2, 0.5, {})) for g in grads])
    assert sent[0] == 0
    torch.testing.assert_close(results[0], torch.full((20,), 5.5))
    torch.testing.assert_close(results[1], results[0])


def test_randomk_indices_change_with_step_and_key_but_not_rank():
    a = random_indices(1000, 10, 0, 0, "w")
    assert np.array_equal(a, random_indices(1000, 10, 0, 0, "w"))
    assert not np.array_equal(a, random_indices(1000, 10, 0, 1, "w"))
    assert not np.array_equal(a, random_indices(1000, 10, 0, 0, "b"))
    assert not np.array_equal(a, random_indices(1000, 10, 1, 0, "w"))


def test_reference_payload_of_randomk_uses_shared_indices():
    x = np.arange(100, dtype=np.float32)
    spec = Compression.randomk(ratio=0.1, seed=5)
    p = reference_payload(spec, x, key="k", step=2)
    np.testing.assert_array_equal(p["values"], x[random_indices(100, 10, 5, 2, "k")])
