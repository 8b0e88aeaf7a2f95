"""Quantizers (terngrad, signsgd, efsignsgd, onebit, qsgd) and PowerSGD, single process.

Oracle properties (unbiasedness in expectation over seeds, error feedback conserving the sum, the
majority vote's tie rule); torch and TF against the oracle for 1-3 simulated ranks over several
steps (bit for bit; PowerSGD's matmuls within a tight tolerance); bad parameters. Bit packing and
the generator: tests/test_packing.py.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import tensorflow as tf
import torch

from hvdcompress import packing

# -- compressors vs the oracle ---------------------------------------------------------------------
from hvdcompress import parse_spec  # noqa: E402
from hvdcompress.reference import Member, simulate  # noqa: E402
from hvdcompress.reference.quantizers import payload_bytes  # noqa: E402
from local_world import run_lockstep  # noqa: E402
from tf_ops import compressors as tfc  # noqa: E402
from torch_ops import compressors as tc  # noqa: E402

QUANT_SPECS = ["signsgd", "efsignsgd", "efsignsgd:residual=false", "onebit", "onebit:scope=tensor", "terngrad",
               "terngrad:bucket=7,seed=3", "terngrad:residual=true", "qsgd", "qsgd:levels=1,bucket=0",
               "qsgd:levels=3,bucket=5,seed=11", "qsgd:levels=100,bucket=64,residual=true"]
KEY = "layer.w"
STEPS = 4
SALT = int(os.environ.get("QUANT_TEST_SALT", "0"))  # other inputs, same checks


def _grads(text, world, shape, steps=STEPS):
    g = np.random.default_rng(zlib.crc32(f"{text}|{world}|{shape}|{SALT}".encode()))
    out = []
    for _ in range(steps):
        step = [np.round(g.standard_t(3, size=shape), 3).astype(np.float32) for _ in range(world)]
        step[0].reshape(-1)[:3] = 0.0  # zeros: sign of 0, empty buckets of terngrad
        out.append(step)
    return out


def _tap(gen, sink, clone):
    """Pass an exchange through, recording every round's payload tensors."""
    rounds = []
    sink.append(rounds)
    reqs = next(gen)
    while True:
        rounds.append([clone(r.tensor) for r in reqs])
        result = yield reqs
        try:
            reqs = gen.send(result)
        except StopIteration as stop:
            return stop.value


def run_oracle(spec, steps, world, shape, members=()):
    states = [{} for _ in range(world)]
    for step, grads in enumerate(steps):
        total, _, sent = simulate(spec, grads, states, key=KEY, step=step, shape=shape, members=members)
        yield total, sent, [{k: v.copy() for k, v in st.items()} for st in states]


def run_torch(spec, steps, world, shape, members=()):
    comp = tc.build_compressor(spec)
    states = [{} for _ in range(world)]
    for step, grads in enumerate(steps):
        sent = []
        gens = [_tap(comp.exchange(torch.from_numpy(g.reshape(-1).copy()),
                                   tc.ExchangeContext(KEY, step, world, 1.0 / world, st, shape, 0, r, members)),
                     sent, lambda t: t.clone().numpy())
                for r, (g, st) in enumerate(zip(grads, states))]
        results, nbytes = run_lockstep(gens)
        yield [x.numpy() for x in results], sent, nbytes, [{k: v.numpy().copy() for k, v in st.items()} for st in states]


def run_tf(spec, steps, world, shape, members=(), graph=False):
    comp = tfc.build_compressor(spec)
    states = [comp.new_state(shape, tf.float32) for _ in range(world)]

    def one_step(step, *grads):
        sent = []
        gens = [_tap(comp.exchange(tf.reshape(g, [-1]),
                                   tfc.ExchangeContext(KEY, step, world, 1.0 / world, st, shape, 0, None, r, members)),
                     sent, tf.identity)
                for r, (g, st) in enumerate(zip(grads, states))]
        results, nbytes = run_lockstep(gens)
        return results, sent, nbytes

    fn = tf.function(one_step) if graph else one_step
    for step, grads in enumerate(steps):
        s = tf.constant(step, tf.int64) if graph else step
        results, sent, nbytes = fn(s, *[tf.constant(g) for g in grads])
        yield ([x.numpy() for x in results], [[[t.numpy() for t in rnd] for rnd in rounds] for rounds in sent],
               [int(b) for b in nbytes], [{k: v.numpy().copy() for k, v in st.items()} for st in states])


def _close(got, want, rtol, atol, label):
    """Within rtol, and atol relative to the array's largest magnitude (sums of products cancel)."""
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale, err_msg=label)


def compare(text, world, shape, members=(), graph=False, rtol=0.0, atol=0.0, steps=None):
    """Oracle, torch and TF over several steps: payloads, results, state, bytes. With a tolerance,
    floats agree within rtol and within atol times the array's largest magnitude."""
    spec = parse_spec(text)
    steps = steps or _grads(text, world, shape)
    impls = [("torch", run_torch(spec, steps, world, shape, members)),
             ("tf", run_tf(spec, steps, world, shape, members, graph))]
    exact = rtol == 0.0 and atol == 0.0
    for step, want in enumerate(run_oracle(spec, steps, world, shape, members)):
        total, sent, states = want
        for impl, it in impls:
            results, got_sent, nbytes, got_states = next(it)
            for r in range(world):
                label = f"{impl} {text} world={world} step={step} rank={r}"
                assert len(got_sent[r]) == len(sent[r]), label
                for want_round, got_round in zip(sent[r], got_sent[r]):
                    for w, g in zip(want_round, got_round):
                        assert g.dtype == w.dtype and g.shape == w.shape, label
                        if exact or w.dtype == np.uint8:
                            np.testing.assert_array_equal(g, w, err_msg=label)
                        else:
                            _close(g, w, rtol, atol, label)
                assert nbytes[r] == sum(w.nbytes for rnd in sent[r] for w in rnd), label
                if exact:
                    np.testing.assert_array_equal(results[r], total, err_msg=label)
                else:
                    _close(results[r], total, rtol, atol, label)
                for name, arr in states[r].items():
                    got = got_states[r][name].reshape(arr.shape)
                    if exact:
                        np.testing.assert_array_equal(got, arr, err_msg=f"{label} state {name}")
                    else:
                        _close(got, arr, rtol, atol, f"{label} state {name}")


@pytest.mark.parametrize("shape", [(37, 11), (64,), (1,)], ids=["2d", "1d", "one"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("text", QUANT_SPECS)
def test_quantizers_torch_and_tf_match_the_oracle_bit_for_bit(text, world, shape):
    compare(text, world, shape)


@pytest.mark.parametrize("text", ["signsgd", "efsignsgd", "onebit", "terngrad:bucket=7", "qsgd:levels=3,bucket=5"])
def test_quantizers_in_tf_function_match_the_oracle(text):
    compare(text, 2, (37, 11), graph=True)


MEMBERS = (Member("a", (5, 7), 0), Member("b", (7,), 35), Member("c", (2, 3), 42))


@pytest.mark.parametrize("text", ["signsgd", "efsignsgd", "onebit", "terngrad", "terngrad:bucket=4", "qsgd:bucket=6"])
def test_merged_group_keeps_per_member_scales(text):
    """PER_MEMBER: a merged group's scales (and buckets) are those of each member alone; for the
    deterministic quantizers the whole result equals the members exchanged alone."""
    spec = parse_spec(text)
    compare(text, 2, (1, 48), members=MEMBERS)
    steps = _grads(text, 2, (48,), steps=2)
    for step, grads in enumerate(steps):
        merged, _, sent = simulate(spec, grads, key=KEY, step=step, shape=(1, 48), members=MEMBERS)
        # scales per member, the codes of the whole group packed back to back
        bits = {"signsgd": 1, "efsignsgd": 1, "onebit": 1, "terngrad": 2}.get(spec.name) or \
            packing.bits_for_levels(2 * spec.params.get("levels", 0) + 1)
        merged_bytes = payload_bytes(spec.name, spec.params, 48, MEMBERS)
        assert sent[0][0][0].nbytes == merged_bytes
        assert merged_bytes - packing.packed_size(48, bits) == sum(
            payload_bytes(spec.name, spec.params, m.numel, shape=m.shape) - packing.packed_size(m.numel, bits)
            for m in MEMBERS)
        alone = [simulate(spec, [g[m.offset:m.offset + m.numel] for g in grads], key=m.name, step=step,
                          shape=m.shape) for m in MEMBERS]
        head = {"efsignsgd": 1, "onebit": 2}.get(spec.name, 0)  # onebit: 2 per column of each member
        if head:
            np.testing.assert_array_equal(merged, np.concatenate([a[0] for a in alone]))
        if spec.name in ("terngrad", "qsgd"):
            from hvdcompress.reference.quantizers import layout_for
            nseg = layout_for(MEMBERS, 48, spec["bucket"]).segments
            scales = sent[0][0][0][:4 * nseg].view(np.float32)
            want = np.concatenate([a[2][0][0][0][:4 * layout_for((), m.numel, spec["bucket"]).segments].view(np.float32)
                                   for a, m in zip(alone, MEMBERS)])
            np.testing.assert_array_equal(scales, want)
        if spec.name == "signsgd":
            np.testing.assert_array_equal(merged, np.concatenate([a[0] for a in alone]))


# -- oracle properties ------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["terngrad", "terngrad:bucket=16", "qsgd:levels=1,bucket=0", "qsgd:levels=4,bucket=32"])
def test_stochastic_quantizers_are_unbiased_over_seeds(text):
    """E[decoded] = g: the mean over K seeds is within 6 standard errors of g, entry by entry, with
    the variance the algorithm implies (TernGrad: s|g| - g^2; QSGD: (v/s)^2 p(1-p))."""
    base = parse_spec(text)
    g = np.random.default_rng(0).standard_normal(200).astype(np.float32)
    g[:5] = 0.0
    K = 300
    outs = np.stack([simulate(base(seed=k), [g], key=KEY, step=3)[0] for k in range(K)])
    mean = outs.mean(axis=0, dtype=np.float64)
    a = np.abs(g.astype(np.float64))
    bucket = base.params["bucket"] or g.size
    seg = np.repeat(np.arange(-(-g.size // bucket)), bucket)[:g.size]
    if base.name == "terngrad":
        s = np.array([a[seg == i].max() for i in range(seg.max() + 1)])[seg]
        var = s * a - a ** 2
        step = s
    else:
        lv = base["levels"]
        v = np.array([np.sqrt((a[seg == i] ** 2).sum()) for i in range(seg.max() + 1)])[seg]
        r = a * lv / v
        p = r - np.floor(r)
        step = v / lv
        var = step ** 2 * p * (1 - p)
    err = np.abs(mean - g)
    assert (err <= 6 * np.sqrt(var / K) + step / K + 1e-6).all(), (err.max(), text)
    assert np.array_equal(outs[:, :5], np.zeros((K, 5)))  # zeros stay zeros
    assert len({o.tobytes() for o in outs[:10]}) == 10  # seeds draw differently


@pytest.mark.parametrize("text", ["efsignsgd", "onebit", "terngrad:residual=true", "qsgd:levels=2,residual=true",
                                  "terngrad:share_scale=true,bucket=8,residual=true"])
def test_error_feedback_conserves_the_sum(text):
    """Over T steps on every rank: what was delivered plus what the residuals still hold is what
    the workers computed (a = g + e, e' = a - decoded)."""
    spec = parse_spec(text)
    world, T = 3, 5
    steps = _grads(text, world, (50,), steps=T)
    states = [{} for _ in range(world)]
    delivered = np.zeros(50, np.float64)
    for step, grads in enumerate(steps):
        total, _, _ = simulate(spec, grads, states, key=KEY, step=step, scale=1.0)
        delivered += total
    computed = sum(g.astype(np.float64) for grads in steps for g in grads)
    held = sum(st["residual"].astype(np.float64) for st in states)
    np.testing.assert_allclose(delivered + held, computed, rtol=0, atol=1e-4)
    assert np.abs(held).max() > 0


def test_signsgd_majority_vote_and_its_tie_rule():
    """The result is sign(sum of the ranks' signs) (times world*scale, so +-1 for op=Average); a
    tie -- an even number of ranks split evenly -- gives 0; a zero gradient votes +1."""
    spec = parse_spec("signsgd")
    x = lambda *v: np.array(v, np.float32)  # noqa: E731
    total, _, sent = simulate(spec, [x(1, -1, 0, -2, 3), x(-1, -1, 5, 2, 1)], key=KEY)
    np.testing.assert_array_equal(total, x(0, -1, 1, 0, 1))  # ties -> 0; 0 votes +1
    assert sent[0][0][0].tolist() == [0b10101] and sent[0][0][0].dtype == np.uint8
    four = [x(1, 1, -1), x(1, -1, -1), x(-1, 1, -1), x(-1, -1, 1)]
    np.testing.assert_array_equal(simulate(spec, four, key=KEY)[0], x(0, 0, -1))
    np.testing.assert_array_equal(simulate(spec, four[:3], key=KEY)[0], x(1, 1, -1))
    np.testing.assert_array_equal(simulate(spec, four[:3], key=KEY, scale=1.0)[0], x(3, 3, -3))
    for impl in (run_torch, run_tf):
        results = next(impl(spec, [[x(1, -1, 0, -2, 3), x(-1, -1, 5, 2, 1)]], 2, (5,)))[0]
        np.testing.assert_array_equal(results[1], x(0, -1, 1, 0, 1))


def test_declared_wire_bytes_are_the_packed_bytes():
    """spec.info.rounds(...) (the cost model's view) equals what the oracle puts on the wire."""
    for text in QUANT_SPECS:
        spec = parse_spec(text)
        for n in (1, 7, 64, 1000, 4097):
            _, _, sent = simulate(spec, [np.linspace(-1, 1, n, dtype=np.float32)], key=KEY)
            (rnd,) = spec.info.rounds(spec.params, [n])
            assert rnd.kind == "allgather" and rnd.collectives == 1
            if spec.name == "onebit" and spec["scope"] == "column":  # the rule counts a square matrix's
                # columns (it sees sizes only; test_onebit_column_scope_sends_the_means_of_each_column)
                assert sent[0][0][0].nbytes == payload_bytes(spec.name, spec.params, n, shape=(n,)), (text, n)
                continue
            assert float(rnd.nbytes[0]) == sent[0][0][0].nbytes == payload_bytes(spec.name, spec.params, n), (text, n)
    bits = {t: parse_spec(t).info.rounds(parse_spec(t).params, [8 * 10 ** 6])[0].nbytes[0] * 8 / 8e6
            for t in ("signsgd", "terngrad", "qsgd:levels=1", "qsgd:levels=2", "qsgd:levels=7", "qsgd:levels=127")}
    assert [round(b) for b in bits.values()] == [1, 2, 2, 3, 4, 8]


# -- TernGrad's scaler sharing ----------------------------------------------------------------------
SHARED_SPECS = ["terngrad:share_scale=true", "terngrad:share_scale=true,bucket=7,seed=3",
                "terngrad:share_scale=true,bucket=5,residual=true"]


@pytest.mark.parametrize("shape", [(37, 11), (64,), (1,)], ids=["2d", "1d", "one"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("text", SHARED_SPECS)
def test_terngrad_shared_scale_torch_and_tf_match_the_oracle(text, world, shape):
    compare(text, world, shape)


def test_terngrad_shared_scale_in_tf_function_and_merged_groups_match_the_oracle():
    compare("terngrad:share_scale=true,bucket=7", 2, (37, 11), graph=True)
    compare("terngrad:share_scale=true,bucket=4", 3, (1, 48), members=MEMBERS)


def test_terngrad_shared_scale_sends_scales_then_codes_with_the_max_over_ranks():
    """Wen et al.'s scaler sharing: round 1 gathers each rank's float32 max |a| per bucket, every
    rank quantizes with the max over ranks, round 2 gathers the packed codes alone; the result is
    s * (sum of the ranks' -1/0/+1) * scale; the bytes are those of the one-round layout, split
    over the two rounds as the wire rule declares; unbiased over seeds."""
    spec = parse_spec("terngrad:share_scale=true,bucket=16")
    rng = np.random.default_rng(1)
    g = [rng.standard_normal(40).astype(np.float32) * w for w in (1.0, 3.0, 0.5)]
    total, _, sent = simulate(spec, g, key=KEY, step=2)
    s = np.maximum.reduce([np.array([np.abs(x[i:i + 16]).max() for i in range(0, 40, 16)], np.float32) for x in g])
    for r, rounds in enumerate(sent):
        (scales,), (codes,) = rounds
        np.testing.assert_array_equal(scales, [np.abs(g[r][i:i + 16]).max() for i in range(0, 40, 16)])
        assert codes.dtype == np.uint8 and codes.nbytes == packing.packed_size(40, 2)
        assert scales.nbytes + codes.nbytes == payload_bytes("terngrad", spec.params, 40)
        assert [float(x.nbytes[0]) for x in spec.info.rounds(spec.params, [40])] == [scales.nbytes, codes.nbytes]
    per_entry = np.repeat(s, 16)[:40] / 3
    units = total / per_entry
    np.testing.assert_allclose(units, np.round(units), atol=1e-5)  # multiples of s / world
    assert np.abs(units).max() <= 3
    K = 300
    outs = np.stack([simulate(spec(seed=k), g, key=KEY, step=2)[0] for k in range(K)]).astype(np.float64)
    want = sum(x.astype(np.float64) for x in g) / 3
    se = np.repeat(s, 16)[:40].astype(np.float64)
    var = sum(se * np.abs(x) - x.astype(np.float64) ** 2 for x in g) / 9
    assert (np.abs(outs.mean(axis=0) - want) <= 6 * np.sqrt(var / K) + 1e-6).all()
    alone = simulate(parse_spec("terngrad:bucket=16"), g, key=KEY, step=2)[2]
    assert all(len(r) == 1 for r in alone)  # without sharing: one round, scales with the codes


@pytest.mark.parametrize("text,needle", [
    ("qsgd:levels=0", "qsgd: parameter 'levels' must be int in [1, 127]"),
    ("qsgd:levels=128", "qsgd: parameter 'levels' must be int in [1, 127]"),
    ("qsgd:bucket=-1", "qsgd: parameter 'bucket' must be int in [0, 2147483647]"),
    ("terngrad:seed=-1", "terngrad: parameter 'seed' must be int in [0, 4294967295]"),
    ("terngrad:bucket=1.5", "terngrad: parameter 'bucket' must be int"),
    ("terngrad:share_scale=2", "terngrad: parameter 'share_scale' must be true or false"),
    ("efsignsgd:residual=maybe", "efsignsgd: parameter 'residual' must be true or false"),
    ("signsgd:residual=true", "signsgd: unknown parameter 'residual'"),
    ("onebit:levels=2", "onebit: unknown parameter 'levels'"),
    ("efsignsgd:momentum=1.0", "efsignsgd: parameter 'momentum' must be float in [0.0, 1.0) or none"),
    ("onebit:momentum=-0.1", "onebit: parameter 'momentum' must be float in [0.0, 1.0) or none"),
    ("onebit:nesterov=2", "onebit: parameter 'nesterov' must be true or false"),
    ("efsignsgd:momentum_correction=false,momentum=0.9",
     "efsignsgd: parameter 'momentum' must be none or 0 and 'nesterov' false with momentum_correction=false"),
    ("onebit:scope=row", "onebit: parameter 'scope' must be one of column, tensor"),
    ("randomk:unbiased=true", "randomk: parameter 'unbiased' must be false with residual=true"),
    ("randomk:unbiased=yes please", "randomk: parameter 'unbiased' must be true or false"),
])
def test_bad_parameters_raise_naming_the_parameter(text, needle):
    with pytest.raises(ValueError) as err:
        parse_spec(text)
    assert needle in str(err.value)


# -- momentum inside (efsignsgd, onebit), 1-bit per column, unbiased random-k -----------------------
@pytest.mark.parametrize("text,shape", [
    ("efsignsgd:momentum=0.9", (37, 11)), ("efsignsgd:momentum=0.5,nesterov=true,residual=false", (1,)),
    ("onebit:scope=tensor,momentum=0.9", (37, 11)), ("onebit:scope=column", (4, 3, 2)), ("onebit:scope=column", (1,)),
    ("onebit:scope=column,momentum=0.9,nesterov=true", (37, 11)),
    ("randomk:ratio=0.3,unbiased=true,residual=false", (37, 11))])
def test_momentum_column_and_unbiased_variants_match_the_oracle_bit_for_bit(text, shape):
    """Payloads, results and state (residual and the velocity u) on 3 ranks over 4 steps."""
    compare(text, 3, shape)


@pytest.mark.parametrize("text", ["efsignsgd:momentum=0.9,nesterov=true", "onebit:scope=column,momentum=0.9"])
def test_momentum_and_columns_in_tf_function_and_merged_groups_match_the_oracle(text):
    compare(text, 2, (37, 11), graph=True)
    compare(text, 2, (1, 48), members=MEMBERS)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("name", ["efsignsgd", "onebit:scope=tensor", "onebit:scope=column"])
def test_momentum_is_applied_before_compression(name, nesterov):
    """With momentum m the exchange is the momentum-free one applied to the velocity: u = m*u + g,
    v = u (Nesterov: g + m*u), error feedback on v; momentum none or 0 is the plain spec, bit for bit."""
    spec = parse_spec(name)
    m = np.float32(0.9)
    with_m = spec(momentum=0.9, nesterov=nesterov)
    world, shape = 2, (6, 5)
    steps = _grads(name, world, shape, steps=4)
    s_m, s_plain = [{} for _ in range(world)], [{} for _ in range(world)]
    u = [np.zeros(30, np.float32) for _ in range(world)]
    for step, grads in enumerate(steps):
        velocities = []
        for r, g in enumerate(grads):
            u[r] = u[r] * m + g.reshape(-1)
            velocities.append(g.reshape(-1) + u[r] * m if nesterov else u[r].copy())
        got, _, _ = simulate(with_m, grads, s_m, key=KEY, step=step, shape=shape)
        want, _, _ = simulate(spec, velocities, s_plain, key=KEY, step=step, shape=shape)
        np.testing.assert_array_equal(got, want)
        for r in range(world):
            np.testing.assert_array_equal(s_m[r]["u"], u[r])
            np.testing.assert_array_equal(s_m[r]["residual"], s_plain[r]["residual"])
    for off in ("", ",momentum=0", ",momentum=none", ",momentum_correction=false"):
        zero = parse_spec(str(spec) + off)
        states = [{}, {}]
        got, _, _ = simulate(zero, steps[0], states, key=KEY, shape=shape)
        np.testing.assert_array_equal(got, simulate(spec, steps[0], key=KEY, shape=shape)[0])
        assert sorted(states[0]) == ["residual"]


def test_onebit_column_scope_sends_the_means_of_each_column():
    """Seide et al.: two values per column of the tensor viewed as (shape[0], -1), the means of its
    entries >= 0 and < 0 (0 for an empty part); a 1-D tensor is one column (= scope tensor); the
    bytes are 8 per column plus the packed bits; merged groups keep each member's columns; the
    default scope."""
    spec = parse_spec("onebit:scope=column,residual=false")
    assert parse_spec("onebit")["scope"] == "column"
    x = np.array([[1.0, -2.0, 0.0], [3.0, -4.0, -1.0], [-5.0, -6.0, 2.0], [7.0, -8.0, 4.0]], np.float32)
    total, _, sent = simulate(spec, [x], key=KEY, scale=1.0)
    pos = np.array([11 / 3, 0.0, 2.0], np.float32)
    neg = np.array([-5.0, -5.0, -1.0], np.float32)
    np.testing.assert_array_equal(total.reshape(4, 3), np.where(x >= 0, pos, neg))
    scales = sent[0][0][0][:24].view(np.float32)
    np.testing.assert_array_equal(scales, np.stack([pos, neg], 1).reshape(-1))
    assert sent[0][0][0].nbytes == 24 + 2 == payload_bytes("onebit", spec.params, 12, shape=(4, 3))
    conv = np.random.default_rng(0).standard_normal((4, 2, 3)).astype(np.float32)  # 6 columns of 4
    got = simulate(spec, [conv], key=KEY, scale=1.0)[0].reshape(4, 6)
    want = simulate(spec, [conv.reshape(4, 6)], key=KEY, scale=1.0)[0].reshape(4, 6)
    np.testing.assert_array_equal(got, want)
    for c in range(6):
        col = conv.reshape(4, 6)[:, c]
        for part in (col >= 0, col < 0):
            if part.any():
                np.testing.assert_allclose(got[part, c], col[part].mean(), rtol=1e-6)
    v = np.linspace(-1, 2, 9, dtype=np.float32)
    np.testing.assert_array_equal(simulate(spec, [v], key=KEY)[0],
                                  simulate(parse_spec("onebit:scope=tensor,residual=false"), [v], key=KEY)[0])
    grads = _grads("columns", 2, (48,), steps=1)[0]
    merged, _, sent = simulate(spec, grads, key=KEY, shape=(1, 48), members=MEMBERS)
    alone = [simulate(spec, [g[m.offset:m.offset + m.numel].reshape(m.shape) for g in grads], key=m.name)
             for m in MEMBERS]
    np.testing.assert_array_equal(merged, np.concatenate([a[0] for a in alone]))
    assert sent[0][0][0].nbytes == payload_bytes("onebit", spec.params, 48, MEMBERS) == 8 * (7 + 1 + 3) + 6
    # the wire rule sees sizes only: a square matrix's columns
    (rnd,) = spec.info.rounds(spec.params, [400])
    assert float(rnd.nbytes[0]) == payload_bytes("onebit", spec.params, 400, shape=(20, 20)) == 8 * 20 + 50


def test_randomk_unbiased_scales_the_sent_values_by_n_over_k():
    """E[D(C(a))] = a: the k drawn entries are sent times float32(n / k), the rest is 0."""
    from hvdcompress.sampling import random_indices
    spec = parse_spec("randomk:ratio=0.1,unbiased=true,residual=false")
    g = np.random.default_rng(3).standard_normal(50).astype(np.float32)
    total, _, sent = simulate(spec, [g], key=KEY, step=2, scale=1.0)
    idx = random_indices(50, 5, 0, 2, KEY)
    want = np.zeros(50, np.float32)
    want[idx] = g[idx] * np.float32(10.0)
    np.testing.assert_array_equal(total, want)
    assert sent[0][0][0].nbytes == 5 * 4
    mean = np.mean([simulate(spec, [g], key=KEY, step=s, scale=1.0)[0] for s in range(2000)], axis=0)
    np.testing.assert_allclose(mean, g, atol=6 * np.sqrt(9 * g.astype(np.float64) ** 2 / 2000).max())


def test_momentum_is_taken_over_from_the_optimizer_on_both_backends():
    """efsignsgd and onebit take SGD's momentum (and Nesterov flag) over as DGC does: the spec gets
    it, the optimizer runs with 0, the delayed-averaging contract (local_momentum) reports it; a
    momentum given in the spec that differs warns; momentum_correction=false leaves the optimizer
    alone; random-k warns that it wants no momentum."""
    import warnings
    w = torch.nn.Parameter(torch.zeros(3))
    for name in ("efsignsgd", "onebit:scope=column"):
        spec = parse_spec(name)
        sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9, nesterov=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # momentum none: nothing to warn
            new = tc.COMPRESSORS[spec.name].adapt_optimizer(spec, sgd.param_groups)
        assert (new["momentum"], new["nesterov"]) == (0.9, True)
        assert (sgd.param_groups[0]["momentum"], sgd.param_groups[0]["nesterov"]) == (0.0, False)
        assert tc.build_compressor(new).local_momentum() == (0.9, True)
        assert tc.build_compressor(spec).local_momentum() is None
        with pytest.warns(UserWarning, match="taking over the optimizer's momentum=0.9"):
            tc.COMPRESSORS[spec.name].adapt_optimizer(spec(momentum=0.5),
                                                       torch.optim.SGD([w], lr=0.1, momentum=0.9).param_groups)
        off = spec(momentum_correction=False)
        sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        assert tc.COMPRESSORS[spec.name].adapt_optimizer(off, sgd.param_groups) is off
        assert sgd.param_groups[0]["momentum"] == 0.9 and tc.build_compressor(off).local_momentum() is None
        config = tf.keras.optimizers.SGD(0.1, momentum=0.9).get_config()
        tnew, tconfig = tfc.COMPRESSORS[spec.name].adapt_optimizer(spec, config)
        assert tnew["momentum"] == pytest.approx(0.9) and tconfig["momentum"] == 0.0
        assert tfc.build_compressor(tnew).state_slots((3,)) == ("residual", "u")
        assert tfc.build_compressor(spec).state_slots((3,)) == ("residual",)
        assert tfc.COMPRESSORS[spec.name].adapt_optimizer(off, config) == (off, config)
    rk = parse_spec("randomk")
    with pytest.warns(UserWarning, match="random-k needs no momentum"):
        sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        assert tc.COMPRESSORS["randomk"].adapt_optimizer(rk, sgd.param_groups) is rk
    with pytest.warns(UserWarning, match="random-k needs no momentum"):
        tfc.COMPRESSORS["randomk"].adapt_optimizer(rk, tf.keras.optimizers.SGD(0.1, momentum=0.9).get_config())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tc.COMPRESSORS["randomk"].adapt_optimizer(rk, torch.optim.SGD([w], lr=0.1).param_groups)


# -- PowerSGD ---------------------------------------------------------------------------------------
from hvdcompress.reference.powersgd import orthogonalize  # noqa: E402

PSGD_SPECS = ["powersgd", "powersgd:rank=1,seed=5", "powersgd:rank=4,residual=false"]


@pytest.mark.parametrize("shape", [(37, 11), (4, 3, 3, 3), (64,), (3, 2)], ids=["2d", "conv", "1d", "tiny"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("text", PSGD_SPECS)
def test_powersgd_torch_and_tf_match_the_oracle(text, world, shape):
    """Matmuls and dot products sum in each framework's own order, and Gram-Schmidt amplifies the
    difference by the ratio of P's singular values: within rtol 1e-4 and 1e-4 of the array's
    largest magnitude on compressed matrices (over 4 steps of residuals and warm starts), exact on
    the dense ones (1-D, or factors no smaller than the matrix)."""
    from hvdcompress.reference.powersgd import is_compressed
    exact = not is_compressed(shape, parse_spec(text)["rank"])
    compare(text, world, shape, rtol=0.0 if exact else 1e-4, atol=0.0 if exact else 1e-4)


def test_powersgd_in_tf_function_matches_the_oracle():
    compare("powersgd", 2, (37, 11), graph=True, rtol=1e-4, atol=1e-4)


def test_powersgd_oracle_rounds_state_and_properties():
    spec = parse_spec("powersgd:rank=2")
    n, m, r, world = 20, 12, 2, 3
    g = np.random.default_rng(1)
    states = [{} for _ in range(world)]
    delivered = np.zeros(n * m)
    computed = np.zeros(n * m)
    for step in range(4):
        grads = [g.standard_normal((n, m)).astype(np.float32) for _ in range(world)]
        total, _, sent = simulate(spec, grads, states, key=KEY, step=step, scale=1.0)
        assert [[a.shape for a in rnd] for rnd in sent[0]] == [[(n, r)], [(m, r)]]  # P then Q
        assert sum(a.nbytes for rnd in sent[0] for a in rnd) == (n + m) * r * 4
        q = states[0]["q"]
        assert q.shape == (m * r,) and all(np.array_equal(st["q"], q) for st in states)
        delivered += total
        computed += sum(x.reshape(-1).astype(np.float64) for x in grads)
    held = sum(st["residual"].astype(np.float64) for st in states)
    np.testing.assert_allclose(delivered + held, computed, atol=2e-4)  # error feedback conserves the sum
    # an exactly rank-r gradient, the same on every rank, is recovered once Q has warmed up
    low = (g.standard_normal((n, r)) @ g.standard_normal((r, m))).astype(np.float32)
    st = [{}]
    for step in range(3):
        out, _, _ = simulate(parse_spec("powersgd:rank=2,residual=false"), [low], st, key=KEY, step=step, scale=1.0)
    np.testing.assert_allclose(out.reshape(n, m), low, atol=1e-4)
    # Gram-Schmidt: orthonormal columns, a zero column stays zero
    p = orthogonalize(np.c_[g.standard_normal((9, 3)), np.zeros(9)].astype(np.float32))
    np.testing.assert_allclose(p[:, :3].T @ p[:, :3], np.eye(3), atol=1e-5)
    assert not p[:, 3].any()
    # declared wire cost: square matrices, two rounds; dense when the factors are not smaller
    r1, r2 = spec.info.rounds(spec.params, [400, 9])
    assert (r1.kind, r2.kind) == ("allreduce", "allreduce")
    assert list(r1.nbytes) == [20 * 2 * 4, 36] and list(r2.nbytes) == [20 * 2 * 4, 0]


def test_powersgd_state_checks():
    spec = parse_spec("powersgd:rank=2")
    comp = tc.build_compressor(spec)
    comp.check_state("w", {"residual": torch.zeros(407), "q": torch.zeros(22)}, 407)  # 37 x 11, r=2
    with pytest.raises(ValueError, match="compression state 'q' of 'w' has 21 elements"):
        comp.check_state("w", {"q": torch.zeros(21)}, 407)
    with pytest.raises(ValueError, match="state 'residual' of 'w' has 400 elements"):
        comp.check_state("w", {"residual": torch.zeros(400)}, 407)
    tcomp = tfc.build_compressor(spec)
    assert tcomp.state_slots((37, 11)) == ("residual", "q") and tcomp.state_slots((64,)) == ()
    assert tcomp.slot_numel("q", (37, 11)) == 22 and tcomp.slot_numel("residual", (4, 3, 3, 3)) == 108
    assert tcomp.slot_numel("q", (4, 3, 3, 3)) == 54
    assert spec.info.merge == "layerwise"
    for bad, needle in (("powersgd:rank=0", "powersgd: parameter 'rank' must be int in [1, 65536]"),
                        ("powersgd:seed=x", "powersgd: parameter 'seed' must be int")):
        with pytest.raises(ValueError) as err:
            parse_spec(bad)
        assert needle in str(err.value)


# -- Horovod's own Compression protocol (hvdcompress.horovod_interop) --------------------------------
def test_specs_follow_horovods_compression_protocol_on_torch_and_tf():
    """compress -> (payload, ctx), decompress(payload, ctx): none passes through, fp16 is IEEE half
    (as hvd.Compression.fp16), bf16 rounds as our bf16 codec and travels as float32; integer tensors
    pass through; specs are hashable (Horovod's TF optimizers cache on them)."""
    from hvdcompress import Compression
    from hvdcompress.reference.codecs import bf16_decode, bf16_encode
    x = np.array([1.0, 1.00390625, 3.14159, -2e-3, 65519.0, 1e-8], np.float32)
    want = {"none": (x, np.float32), "fp16": (x.astype(np.float16).astype(np.float32), np.float16),
            "bf16": (bf16_decode(bf16_encode(x)), np.float32)}
    for name, (values, wire) in want.items():
        spec = getattr(Compression, name)
        assert hash(spec) == hash(parse_spec(name)) and spec == parse_spec(name)
        for to, back in ((torch.from_numpy, lambda t: t.numpy()), (tf.constant, lambda t: t.numpy())):
            payload, ctx = spec.compress(to(x.copy()))
            assert back(payload).dtype == wire, (name, payload)
            out = back(spec.decompress(payload, ctx))
            assert out.dtype == np.float32
            np.testing.assert_array_equal(out, values)
            ints, ictx = spec.compress(to(np.arange(3, dtype=np.int32)))
            assert back(spec.decompress(ints, ictx)).tolist() == [0, 1, 2]


@pytest.mark.parametrize("text", ["topk", "randomk", "threshold", "dgc", "signsgd", "efsignsgd", "onebit", "terngrad",
                                  "qsgd", "powersgd", "sketch", "fp16:residual=true", "bf16:residual=true"])
def test_specs_horovods_protocol_cannot_carry_raise_saying_why(text):
    with pytest.raises(ValueError, match="cannot run inside Horovod's own DistributedOptimizer"):
        parse_spec(text).compress(torch.ones(4))
    with pytest.raises(ValueError, match="cannot run inside Horovod's own DistributedOptimizer"):
        parse_spec(text).compress(tf.ones([4]))
