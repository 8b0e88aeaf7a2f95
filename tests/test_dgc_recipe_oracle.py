"""DGC's weight decay and clipping scopes: PyTorch and TensorFlow against the numpy
oracle (hvdcompress/reference/dgc.py), bit for bit, in one process (simulated ranks)."""

import math

import numpy as np
import pytest
import torch

from hvdcompress import parse_spec
from hvdcompress.clipping import GlobalNorm, clip_coefficient
from hvdcompress.reference.dgc import sum_of_squares, weight_decay_step
from hvdcompress.reference.oracle import Member, simulate
from scenarios.local_world import run_lockstep
from torch_ops.compressors import ExchangeContext, build_compressor

MEMBERS = (Member("a", (30, 40), 0), Member("b", (40,), 1200), Member("c", (10, 40), 1240))
N = 1640
WORLD = 2


def _grads(rng, step):
    scale = 1.0 + 3.0 * (step % 2)  # the norms vary from step to step: the lag matters
    return [(rng.standard_t(3, size=N) * scale).astype(np.float32) for _ in range(WORLD)]


@pytest.mark.parametrize("nesterov", [False, True])
def test_torch_weight_decay_term_matches_the_oracle(nesterov):
    spec = parse_spec(f"dgc:momentum=0.9,nesterov={str(nesterov).lower()}")
    comp = build_compressor(spec)
    rng = np.random.default_rng(3)
    params = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in ((5, 4), (7,))]
    groups = [{"params": [params[0]], "hvc_weight_decay": 5e-3, "weight_decay": 0.0, "dampening": 0.0},
              {"params": [params[1]], "weight_decay": 1e-3, "dampening": 0.0}]  # set after wrapping: taken over too
    state = {p: {} for p in params}
    w = [np.zeros(p.shape, np.float32) for p in params]
    for step in range(4):
        grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g.copy())
        comp.before_step(groups, state)
        for i, (p, g, wd) in enumerate(zip(params, grads, (5e-3, 1e-3))):
            want = g + weight_decay_step(w[i], p.numpy(), wd, 0.9, nesterov)
            np.testing.assert_array_equal(p.grad.numpy(), want, err_msg=f"step {step} param {i}")
            np.testing.assert_array_equal(state[p]["hvc_weight_decay_momentum"].numpy(), w[i])
            p.data.sub_(0.1 * p.grad)
    assert groups[1]["weight_decay"] == 0.0 and groups[1]["hvc_weight_decay"] == 1e-3


def _torch_steps(spec, steps):
    comps = [build_compressor(spec) for _ in range(WORLD)]  # one compressor per rank (its own norm)
    states = [{} for _ in range(WORLD)]
    for step, grads in enumerate(steps):
        gens = [c.exchange(torch.from_numpy(g.copy()), ExchangeContext("g", step, WORLD, 1 / WORLD, st, (1, N),
                                                                       0, r, MEMBERS))
                for r, (c, g, st) in enumerate(zip(comps, grads, states))]
        results, _ = run_lockstep(gens)
        yield results[0].numpy()


def _oracle_steps(spec, steps):
    states = [{} for _ in range(WORLD)]
    norms = [None] * WORLD
    for step, grads in enumerate(steps):
        for r in range(WORLD):
            if norms[r] is not None:
                states[r]["global_norm"] = norms[r]
        total, _, _ = simulate(spec, grads, states, "g", step, None, (1, N), 0, MEMBERS)
        # the next step's global norm: this step's whole local gradient (fsum of per-tensor sums)
        norms = [math.sqrt(math.fsum(sum_of_squares(g[m.offset:m.offset + m.numel]) for m in MEMBERS))
                 for g in grads]
        yield total


@pytest.mark.parametrize("scope", ["tensor", "global"])
def test_torch_clipping_matches_the_oracle_per_member_and_one_step_late(scope):
    spec = parse_spec(f"dgc:ratio=0.05,warmup_epochs=0,clip_norm=2.0,clip_scope={scope},min_sparse_numel=10")
    rng = np.random.default_rng(11)
    steps = [_grads(rng, s) for s in range(5)]
    unclipped = list(_oracle_steps(parse_spec("dgc:ratio=0.05,warmup_epochs=0,min_sparse_numel=10"), steps))
    for step, (got, want, free) in enumerate(zip(_torch_steps(spec, steps), _oracle_steps(spec, steps), unclipped)):
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        if scope == "global" and step == 0:
            np.testing.assert_array_equal(got, free)  # no norm before the first step: not clipped
    assert not np.array_equal(got, free)  # clipping acted


def test_global_norm_is_one_step_late_and_independent_of_record_order():
    a, b = GlobalNorm(), GlobalNorm()
    sums = {"x": 1e-3, "y": 4.0, "z": 1e9}
    for name in sums:
        a.record(0, name, sums[name])
    for name in reversed(list(sums)):
        b.record(0, name, sums[name])
    assert a.norm_before(0) is None
    assert a.norm_before(1) == b.norm_before(1) == math.sqrt(math.fsum(sums.values()))
    c = GlobalNorm()
    c.load(a.state())
    assert c.norm_before(1) == a.norm
    assert clip_coefficient(None, 1.0, 2) is None and clip_coefficient(0.1, 1.0, 2) is None
    assert clip_coefficient(10.0, 1.0, 4) == pytest.approx(0.05, rel=1e-6)


def test_tensorflow_clips_each_member_as_the_oracle():
    import tensorflow as tf
    from tf_ops import compressors as tfc

    spec = parse_spec("dgc:ratio=0.05,warmup_epochs=0,clip_norm=2.0,clip_scope=tensor,min_sparse_numel=10")
    rng = np.random.default_rng(5)
    steps = [_grads(rng, s) for s in range(3)]
    comp = tfc.build_compressor(spec)
    states = [comp.new_state((1, N), tf.float32) for _ in range(WORLD)]
    for step, (grads, want) in enumerate(zip(steps, _oracle_steps(spec, steps))):
        gens = [comp.exchange(tf.constant(g), tfc.ExchangeContext("g", step, WORLD, 1 / WORLD, st, (1, N), 0,
                                                                   rank=r, members=MEMBERS))
                for r, (g, st) in enumerate(zip(grads, states))]
        results, _ = run_lockstep(gens)
        np.testing.assert_array_equal(results[0].numpy(), want, err_msg=f"step {step}")


def test_tensorflow_refuses_global_clipping():
    from tf_ops import compressors as tfc

    with pytest.raises(ValueError, match="clip_scope"):
        tfc.build_compressor(parse_spec("dgc:clip_norm=1.0,clip_scope=global"))
