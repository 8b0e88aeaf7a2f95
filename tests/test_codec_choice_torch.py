"""A group switching between its compressor and a dense / fp16 exchange (the planner's per-group
codec choice), in PyTorch, against the numpy reference ``hvdcompress.reference.fallback``: ranks
simulated in one process (tests/scenarios/local_world.py); real Horovod workers: tests/scenarios/schedules.py."""

import numpy as np
import pytest
import torch

from hvdcompress.reference.fallback import dense_result, dense_send
from hvdcompress.spec import parse_spec
from scenarios.local_world import run_lockstep
from torch_ops.codec_choice import check_codec_choice, fallback_exchange
from torch_ops.compressors import ExchangeContext, build_compressor

WORLD, SHAPE = 2, (16, 32)
CODECS = [None, None, "none", None, "fp16", "fp16", None, "none"]  # None: the compressor's own exchange
SPECS = ["topk:ratio=0.05", "dgc:ratio=0.05,momentum=0.9", "dgc:ratio=0.05,momentum=0.9,nesterov=true",
         "powersgd:rank=2", "efsignsgd", "efsignsgd:momentum=0.9", "onebit:momentum=0.9,nesterov=true",
         "sketch:ratio=0.05,momentum=0.9"]


def _np_state(st):
    return {k: v.detach().numpy().reshape(-1).copy() for k, v in st.items()}


@pytest.mark.parametrize("text", SPECS)
def test_switching_codecs_follows_the_reference_and_loses_nothing(text):
    spec = parse_spec(text)
    comp = build_compressor(spec)
    rng = np.random.default_rng(len(text))
    states = [{} for _ in range(WORLD)]
    momentum = comp.local_momentum()
    applied, given = np.zeros(np.prod(SHAPE)), np.zeros(np.prod(SHAPE))
    for step, codec in enumerate(CODECS):
        grads = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(WORLD)]
        given += np.mean(grads, axis=0).reshape(-1)
        ctxs = [ExchangeContext("w", step, WORLD, 1.0 / WORLD, st, SHAPE) for st in states]
        xs = [torch.from_numpy(g.copy()).reshape(-1) for g in grads]
        if codec is None:
            results, _ = run_lockstep([comp.exchange(x, c) for x, c in zip(xs, ctxs)])
        else:
            before = [_np_state(st) for st in states]
            results, sent = run_lockstep([fallback_exchange(comp, codec, x, c) for x, c in zip(xs, ctxs)])
            wires, after = zip(*(dense_send(g.reshape(-1), st, codec, momentum) for g, st in zip(grads, before)))
            want = dense_result(wires, 1.0 / WORLD)
            for r in range(WORLD):
                assert torch.equal(results[r], torch.from_numpy(want)), (text, step, codec, r)
                got = _np_state(states[r])
                assert sorted(got) == sorted(after[r])
                for k in got:
                    np.testing.assert_array_equal(got[k], after[r][k], err_msg=f"{text} {step} {codec} {k}")
            assert sent == [np.prod(SHAPE) * (2 if codec == "fp16" else 4)] * WORLD
            carried = "v" if momentum else "residual"
            if codec == "none" and carried in states[0]:  # what was held back went out with the group
                assert all(not st[carried].any() for st in states)
        for r in range(1, WORLD):
            assert torch.equal(results[r], results[0])
        applied += results[0].double().numpy()
    if momentum is None and spec.params.get("residual"):
        # error feedback: what was applied plus the mean residual is what was computed; the fp16
        # rounding goes back into the residual, so only the fp16 sums' own rounding remains
        held = np.mean([st["residual"].double().numpy().reshape(-1) for st in states], axis=0)
        np.testing.assert_allclose(applied + held, given, rtol=0, atol=2e-2)


def test_dense_step_sends_gradient_plus_residual_exactly():
    comp = build_compressor(parse_spec("topk:ratio=0.05"))
    rng = np.random.default_rng(0)
    states = [{} for _ in range(WORLD)]
    g0 = [torch.from_numpy(rng.standard_normal(64).astype(np.float64)) for _ in range(WORLD)]
    run_lockstep([comp.exchange(g.clone(), ExchangeContext("w", 0, WORLD, 0.5, st)) for g, st in zip(g0, states)])
    held = [st["residual"].clone() for st in states]
    assert all(h.abs().sum() > 0 for h in held)
    g1 = [torch.from_numpy(rng.standard_normal(64).astype(np.float64)) for _ in range(WORLD)]
    res, _ = run_lockstep([fallback_exchange(comp, "none", g.clone(), ExchangeContext("w", 1, WORLD, 0.5, st))
                           for g, st in zip(g1, states)])
    want = ((g1[0] + held[0]) + (g1[1] + held[1])) * 0.5
    assert torch.equal(res[0], want) and torch.equal(res[1], want)
    assert all(not st["residual"].any() for st in states)


def test_codec_choice_argument_is_checked():
    topk = build_compressor(parse_spec("topk:ratio=0.01"))
    assert check_codec_choice("auto", topk) == ("fp16", "none")
    assert check_codec_choice(None, topk) == () == check_codec_choice("off", topk)
    with pytest.raises(ValueError, match=r"^codec_choice: must be one of 'auto', 'off' or None; got 'yes'"):
        check_codec_choice("yes", topk)
    with pytest.raises(ValueError, match=r"^codec_choice: 'auto' needs synchronous training"):
        check_codec_choice("auto", topk, delay=1)
    plain = build_compressor(parse_spec("dgc:ratio=0.01,momentum=0.9,momentum_correction=false"))
    with pytest.raises(ValueError, match=r"^codec_choice: 'auto' needs a compressor with a dense form"):
        check_codec_choice("auto", plain)
    with pytest.raises(ValueError, match="codec: must be one of"):
        next(fallback_exchange(topk, "bf16", torch.zeros(3), ExchangeContext("w", 0, 1, 1.0)))


# --- codec_choice=None: on where measured validation makes it safe, else off ----------------------
def _default(text="topk:ratio=0.01", schedule="auto", tune_steps=3, delay=0, sync_every=1, elastic=False,
             value=None):
    from torch_ops.codec_choice import resolve_codec_choice
    spec = parse_spec(text)
    return resolve_codec_choice(value, spec, build_compressor(spec), schedule, tune_steps, delay, sync_every,
                                elastic=elastic)


def test_default_codec_choice_is_on_with_a_compressing_spec_a_searched_schedule_and_validation():
    for schedule in ("auto", None, "mgs", "mgwfbp", "mgs:greedy", "mgwfbp:greedy", "mgs:dp"):
        assert _default(schedule=schedule) == ("fp16", "none"), schedule
    for text in ("dgc:ratio=0.01", "efsignsgd", "qsgd:levels=3", "sketch:ratio=0.05", "onebit"):
        assert _default(text) == ("fp16", "none"), text
    # a compressor that never merges: under "auto" and the exact searches (the choice keeps it alone)
    for schedule in ("auto", "mgs", "mgwfbp"):
        assert _default("powersgd:rank=2", schedule) == ("fp16", "none"), schedule
    assert _default(tune_steps=1) == ("fp16", "none")


@pytest.mark.parametrize("case", [
    dict(text="none"), dict(text="fp16"), dict(text="bf16"),            # nothing to choose
    dict(schedule="layerwise"), dict(schedule="single"), dict(schedule="size:4"),
    dict(schedule=[["a"], ["b"]]),                                        # fixed partitions: not searched
    dict(tune_steps=0),                                                  # no measured validation
    dict(delay=1), dict(sync_every=4),                                   # delayed averaging
    dict(text="dgc:ratio=0.01,momentum_correction=false"),               # no dense form
    dict(text="powersgd:rank=2", schedule="mgs:greedy"),                 # greedy cannot keep it alone
    dict(elastic=True),                                                  # a reset re-plans unvalidated
])
def test_default_codec_choice_is_off_otherwise_silently(case):
    assert _default(**case) == ()


def test_explicit_codec_choice_keeps_its_meaning_and_its_errors():
    # "off" turns it off where the default is on; "auto" turns it on where the default is off
    assert _default(value="off") == ()
    assert _default(tune_steps=0, value="auto") == ("fp16", "none")
    assert _default(schedule="layerwise", value="auto") == ("fp16", "none")
    assert _default(text="fp16", value="auto") == ("fp16", "none")
    with pytest.raises(ValueError, match=r"^codec_choice: 'auto' needs synchronous training"):
        _default(delay=2, value="auto")
    with pytest.raises(ValueError, match=r"^codec_choice: 'auto' needs synchronous training"):
        _default(sync_every=2, value="auto")
    with pytest.raises(ValueError, match=r"^codec_choice: 'auto' needs a compressor with a dense form"):
        _default(text="dgc:ratio=0.01,momentum_correction=false", value="auto")
    with pytest.raises(ValueError, match=r"^codec_choice: must be one of 'auto', 'off' or None; got 'on'"):
        _default(value="on")
    # the defaults that resolve to off raise nothing
    assert _default(delay=2) == () == _default(text="dgc:ratio=0.01,momentum_correction=false")
