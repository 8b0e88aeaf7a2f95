"""1-bit Adam single-process: the numpy oracle against a direct transcription of the paper's
Algorithm 1, PyTorch and TensorFlow against the oracle bit for bit in lockstep worlds of 1-3 ranks
(merged members too), the declared wire cost, the optimizer take-over rules (Adam/AdamW taken
over, what cannot be honoured refused) and DGC's rule under Adam. Real 2-worker launches:
tests/test_onebitadam_multiprocess.py."""

import warnings

import numpy as np
import pytest
import torch

from hvdcompress import parse_spec
from hvdcompress.contract import ExchangeContext, Member
from hvdcompress.momentum import check_dgc_under_adam, take_over_adam, take_over_keras_adam
from hvdcompress.reference import simulate
from hvdcompress.reference.onebitadam import adamw_step, transcription
from hvdcompress.registry import info_for
from scenarios.local_world import run_lockstep

F32 = np.float32
SPECS = ["onebitadam:warmup_steps=2", "onebitadam:warmup_steps=3,scope=column,beta1=0.8,beta2=0.95,eps=1e-6"]
TOPK_SPECS = ["topkadam:warmup_steps=2,ratio=0.2", "topkadam:warmup_steps=3,ratio=0.05,beta1=0.8,beta2=0.95,eps=1e-6"]
FAMILY = SPECS + TOPK_SPECS  # the frozen-variance Adam family: one base, the moment's codec differs
SHAPE = (7, 5)
MERGED = (Member("a", (4, 5), 0), Member("b", (15,), 20))  # two tensors in one flat group of 35


def _onebit_tensor(a):
    """1-bit with one pair of reconstruction values per tensor: the means of a's two parts."""
    pos, neg = a >= 0, a < 0
    hi = a[pos].mean() if pos.any() else 0.0
    lo = a[neg].mean() if neg.any() else 0.0
    return np.where(pos, hi, lo)


@pytest.mark.parametrize("space", ["direction", "moment"])
def test_oracle_follows_the_papers_algorithm_on_a_quadratic(space):
    rng = np.random.default_rng(1)
    workers, n, steps, warm, lr, wd = 3, 12, 14, 5, 0.05, 0.1
    A = [rng.standard_normal((n, n)) / np.sqrt(n) for _ in range(workers)]
    b = [rng.standard_normal(n) for _ in range(workers)]

    def grad(i, t, p):
        return A[i].T @ (A[i] @ p - b[i])

    p0 = rng.standard_normal(n).astype(F32)
    want = transcription(grad, p0, steps, workers, lr, wd, warm, _onebit_tensor, space=space)
    spec = parse_spec(f"onebitadam:warmup_steps={warm},space={space}")
    p, states = p0.copy(), [{} for _ in range(workers)]
    for step in range(steps):
        grads = [grad(i, step + 1, p.astype(np.float64)).astype(F32) for i in range(workers)]
        d, states, _ = simulate(spec, grads, states, key="w", step=step)
        p = adamw_step(p, d, lr, wd)
        np.testing.assert_allclose(p, want[step], rtol=2e-5, atol=2e-5, err_msg=f"step {step}")
    assert all(np.array_equal(states[0][k], states[r][k]) for r in range(workers) for k in ("m", "v"))
    assert not np.array_equal(states[0]["residual"], states[1]["residual"])  # each worker's own error


def test_variance_is_frozen_after_the_warm_up():
    spec = parse_spec("onebitadam:warmup_steps=2")
    rng = np.random.default_rng(0)
    states = [{}, {}]
    seen = []
    for step in range(5):
        _, states, sent = simulate(spec, [rng.standard_normal(9).astype(F32) for _ in range(2)], states, step=step)
        seen.append(states[0]["v"].copy())
        assert sent[0][-1][0].nbytes == (9 * 4 if step < 2 else 2 + 8)  # dense float32, then bits + 2 scales
    assert not np.array_equal(seen[0], seen[1])
    assert all(np.array_equal(seen[1], s) for s in seen[2:])


def _quiet_gradients(rng, workers, n, noise=1e-2):
    """Per-worker gradients of a tensor whose entry 0 is zero up to rounding (the attention key
    bias's pattern: softmax ignores a per-query constant), the rest of scale ``noise``."""
    g = [(rng.standard_normal(n) * noise).astype(F32) for _ in range(workers)]
    for x in g:
        x[0] = F32(rng.standard_normal() * 1e-12)
    return g


def test_a_coordinate_with_tiny_variance_is_amplified_in_moment_space_not_in_direction_space():
    """After the freeze Adam's update is d = f1 * m / den with den = sqrt(v_hat) + eps ~ eps at the
    quiet entry. space=moment: 1-bit reconstructs that entry of m at about the tensor's mean |m|,
    and the division by den turns it into a step ~1e6 times the largest exact one (the divergence of
    1-bit Adam on a transformer). space=direction: the codec's error is in the update's units, so
    d stays within the exact update's scale at every entry."""
    workers, n, warm, steps = 2, 64, 5, 25
    b1 = 0.9
    got = {}
    for space in ("direction", "moment"):
        rng = np.random.default_rng(3)
        spec = parse_spec(f"onebitadam:warmup_steps={warm},beta2=0.95,space={space}")
        states = [{} for _ in range(workers)]
        m = np.zeros(n)
        v_frozen = None
        worst_exact, worst, worst_error = 0.0, 0.0, 0.0
        for step in range(steps):
            g = _quiet_gradients(rng, workers, n)
            d, states, _ = simulate(spec, g, states, key="w", step=step)
            mean = np.mean([x.astype(np.float64) for x in g], axis=0)  # uncompressed frozen-variance Adam
            m = b1 * m + (1 - b1) * mean
            if step < warm:
                v_frozen = states[0]["v"].astype(np.float64)
                continue
            f1, f2 = 1 / (1 - b1 ** (step + 1)), 1 / np.sqrt(1 - 0.95 ** warm)
            exact = f1 * m / (np.sqrt(v_frozen) * f2 + 1e-8)
            assert np.all(np.isfinite(d))
            worst_exact = max(worst_exact, np.abs(exact).max())
            worst = max(worst, abs(float(d[0])))
            worst_error = max(worst_error, np.abs(d - exact).max())
        got[space] = (worst, worst_error, worst_exact)
    worst, error, exact = got["direction"]
    assert worst <= exact and error <= 2 * exact, got  # bounded by the update's own scale
    worst, error, exact = got["moment"]
    assert worst >= 1e4 * exact, got  # amplified by 1/den ~ 1/eps: why the default is direction


def test_direction_space_trains_a_quadratic_with_a_quiet_coordinate_moment_space_throws_it_away():
    """2 workers, f_i(p) = sum_j c_j (p_j - b_ij)^2 / 2 with c_0 = 1e-10 (entry 0's gradient is
    noise-free and ~1e-10): in direction space the loss falls and entry 0 moves at most lr per
    step, as Adam's; in moment space entry 0 is thrown orders of magnitude further."""
    rng = np.random.default_rng(5)
    workers, n, warm, steps, lr = 2, 32, 10, 120, 0.01
    c = np.ones(n)
    c[0] = 1e-10
    targets = [rng.standard_normal(n) for _ in range(workers)]
    p0 = rng.standard_normal(n).astype(F32)

    def loss(p):
        return sum(float(np.sum(c * (p - b) ** 2)) / 2 for b in targets) / workers

    moved = {}
    for space in ("direction", "moment"):
        spec = parse_spec(f"onebitadam:warmup_steps={warm},beta2=0.95,space={space}")
        p, states = p0.copy(), [{} for _ in range(workers)]
        for step in range(steps):
            g = [(c * (p.astype(np.float64) - b)).astype(F32) for b in targets]
            d, states, _ = simulate(spec, g, states, key="w", step=step)
            p = adamw_step(p, d, lr, 0.0)
        assert np.all(np.isfinite(p)), space
        moved[space] = (abs(float(p[0] - p0[0])), loss(p))
    assert moved["direction"][1] < 0.5 * loss(p0), moved
    assert moved["direction"][0] <= lr * steps, moved
    assert moved["moment"][0] >= 100 * lr * steps, moved


def _oracle_run(spec, world, steps, rng, members=()):
    grads = [[rng.standard_normal(SHAPE).astype(F32) for _ in range(world)] for _ in range(steps)]
    states = [{} for _ in range(world)]
    want = []
    for step, g in enumerate(grads):
        res, states, _ = simulate(spec, g, states, key="w", step=step, members=members)
        want.append((res.reshape(-1), [{k: v.reshape(-1).copy() for k, v in st.items()} for st in states]))
    return grads, want


@pytest.mark.parametrize("text", FAMILY)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("merged", [False, True], ids=["one", "merged"])
@pytest.mark.parametrize("space", ["direction", "moment"])
def test_torch_matches_the_oracle_bit_for_bit(text, world, merged, space):
    from torch_ops.compressors import build_compressor
    spec = parse_spec(f"{text},space={space}")
    members = MERGED if merged else ()
    grads, want = _oracle_run(spec, world, 6, np.random.default_rng(world), members)
    comp = build_compressor(spec)
    states = [{} for _ in range(world)]
    for step, g in enumerate(grads):
        ctxs = [ExchangeContext("w", step, world, 1.0 / world, st, SHAPE, 0, r, members or (Member("w", SHAPE, 0),))
                for r, st in enumerate(states)]
        got, _ = run_lockstep([comp.exchange(torch.from_numpy(x.reshape(-1).copy()), c) for x, c in zip(g, ctxs)])
        res, st_want = want[step]
        for r in range(world):
            assert np.array_equal(got[r].numpy(), res), (step, r)
            for k, v in st_want[r].items():
                assert np.array_equal(states[r][k].numpy().reshape(-1), v), (step, r, k)


@pytest.mark.parametrize("text", FAMILY)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("merged", [False, True], ids=["one", "merged"])
@pytest.mark.parametrize("space", ["direction", "moment"])
def test_tf_matches_the_oracle_bit_for_bit(text, world, merged, space):
    tf = pytest.importorskip("tensorflow")
    from tf_ops.compressors import build_compressor
    spec = parse_spec(f"{text},space={space}")
    members = MERGED if merged else ()
    grads, want = _oracle_run(spec, world, 6, np.random.default_rng(world), members)
    comp = build_compressor(spec)
    states = [comp.new_state((35,), tf.float32) for _ in range(world)]
    for step, g in enumerate(grads):
        ctxs = [ExchangeContext("w", tf.constant(step, tf.int64), world, 1.0 / world, st, SHAPE, 0, r,
                                members or (Member("w", SHAPE, 0),)) for r, st in enumerate(states)]
        got, _ = run_lockstep([comp.exchange(tf.constant(x.reshape(-1)), c) for x, c in zip(g, ctxs)])
        res, st_want = want[step]
        for r in range(world):
            assert np.array_equal(got[r].numpy(), res), (step, r)
            for k, v in st_want[r].items():
                assert np.array_equal(states[r][k].numpy(), v), (step, r, k)


def test_tf_traced_topkadam_follows_the_oracle():
    """Under tf.function the step is a tensor: both phases in one graph (the warm-up's dense bytes
    and top-k's buffer through one allgather, tf.cond picking). Graph mode rewrites some float32
    arithmetic (the last bit may differ), so within float32 rounding; the sent entries are the
    oracle's (the same sparsity pattern)."""
    tf = pytest.importorskip("tensorflow")
    from tf_ops.compressors import build_compressor
    spec = parse_spec(TOPK_SPECS[0])
    world = 2
    grads, want = _oracle_run(spec, world, 5, np.random.default_rng(7))
    comp = build_compressor(spec)
    states = [comp.new_state((35,), tf.float32) for _ in range(world)]

    @tf.function
    def step_fn(step, x0, x1):
        ctxs = [ExchangeContext("w", step, world, 1.0 / world, st, SHAPE, 0, r, (Member("w", SHAPE, 0),))
                for r, st in enumerate(states)]
        got, _ = run_lockstep([comp.exchange(x, c) for x, c in zip((x0, x1), ctxs)])
        return got

    for step, g in enumerate(grads):
        got = step_fn(tf.constant(step, tf.int64), *(tf.constant(x.reshape(-1)) for x in g))
        res, st_want = want[step]
        for r in range(world):
            np.testing.assert_allclose(got[r].numpy(), res, rtol=1e-5, atol=1e-6, err_msg=f"{step} {r}")
            assert np.array_equal(got[r].numpy() != 0, res != 0), (step, r)
            for k, v in st_want[r].items():
                np.testing.assert_allclose(states[r][k].numpy(), v, rtol=1e-5, atol=1e-6, err_msg=f"{step} {r} {k}")




@pytest.mark.parametrize("scope, d, nbytes", [("tensor", 35, 5 + 8), ("tensor", 1000, 125 + 8),
                                              ("column", 36, 5 + 8 * 6)])
def test_declared_wire_is_the_payload_after_the_warm_up(scope, d, nbytes):
    spec = parse_spec(f"onebitadam:warmup_steps=1,scope={scope}")
    (rnd,) = info_for("onebitadam").rounds(spec.params, d)
    assert float(rnd.nbytes) == nbytes
    shape = (6, 6) if d == 36 else (d,)
    g = [np.ones(shape, F32), -np.ones(shape, F32)]
    _, states, sent = simulate(spec, g, step=0)
    _, _, sent = simulate(spec, g, states, step=1)
    assert sent[0][0][0].nbytes == nbytes


def test_bad_parameters_name_the_parameter_and_range():
    with pytest.raises(ValueError, match=r"onebitadam: parameter 'warmup_steps' must be int in \[1, "):
        parse_spec("onebitadam:warmup_steps=0")
    with pytest.raises(ValueError, match=r"parameter 'beta1' must be float in \[0.0, 1.0\) or none"):
        parse_spec("onebitadam:beta1=1.0")
    with pytest.raises(ValueError, match="parameter 'scope' must be one of tensor, column"):
        parse_spec("onebitadam:scope=row")


# -- take-over rules ---------------------------------------------------------------------------------
# Parameter groups as torch's optimizers make them (keys of torch 2.13). Written out rather than
# built: an optimizer's constructor imports torch._dynamo, and with Triton installed that import crashes a
# process that loaded horovod.tensorflow first (as conftest.py does); the real optimizers run in
# the 2-worker launches.
def _adam(decoupled=True, **kw):
    group = {"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8,
             "weight_decay": 0.01 if decoupled else 0.0, "amsgrad": False, "maximize": False, "foreach": None,
             "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": decoupled}
    return dict(group, **kw)


def _sgd(**kw):
    group = {"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.1, "momentum": 0.0, "dampening": 0.0,
             "weight_decay": 0.0, "nesterov": False, "maximize": False, "foreach": None, "differentiable": False,
             "fused": None}
    return dict(group, **kw)


def test_adamw_betas_and_eps_are_taken_over():
    spec = parse_spec("onebitadam")
    groups = [_adam(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)]
    new = take_over_adam(spec, groups)
    assert (new["beta1"], new["beta2"], new["eps"]) == (0.8, 0.9, 1e-6)
    with pytest.warns(UserWarning, match="taking over the optimizer's betas"):
        take_over_adam(parse_spec("onebitadam:beta1=0.5"), groups)
    assert take_over_adam(spec, [_sgd(weight_decay=0.1)]) is spec  # no momentum: its step on d is AdamW's
    assert take_over_adam(spec, [_adam(decoupled=False)])["beta1"] == 0.9  # Adam without weight decay


@pytest.mark.parametrize("groups, needle", [
    ([_sgd(momentum=0.9)], "would apply a second momentum"),
    ([_adam(amsgrad=True)], "amsgrad=True"),
    ([_adam(maximize=True)], "maximize=True"),
    ([_adam(decoupled=False, weight_decay=0.1)], "use torch.optim.AdamW"),
    ([{"params": [], "lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "momentum_decay": 0.004}],  # NAdam
     "neither Adam/AdamW nor SGD"),
    ([_adam(), _adam(betas=(0.5, 0.9))], "different betas/eps"),
    ([_adam(), _sgd()], "mix Adam with SGD"),
])
def test_what_cannot_be_honoured_is_refused(groups, needle):
    with pytest.raises(ValueError, match=needle):
        take_over_adam(parse_spec("onebitadam"), groups)


def test_before_step_applies_adamw_and_clears_the_gradient():
    from torch_ops.compressors import build_compressor
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    q = torch.nn.Parameter(torch.tensor([4.0]))
    groups = [_adam(params=[p], lr=0.1, weight_decay=0.5), _sgd(params=[q])]
    d = torch.tensor([0.5, 0.25, -1.0])
    p.grad, q.grad = d.clone(), torch.tensor([1.0])
    build_compressor(parse_spec("onebitadam")).before_step(groups, {})
    want = adamw_step(np.array([1.0, -2.0, 3.0], F32), d.numpy(), 0.1, 0.5)
    assert np.array_equal(p.detach().numpy(), want)
    assert p.grad is None  # the wrapped Adam's step then skips it
    assert float(q.detach()) == 4.0 and float(q.grad) == 1.0  # SGD's groups apply the direction themselves


def test_keras_rules():
    spec = parse_spec("onebitadam")
    assert take_over_keras_adam(spec, {"name": "SGD", "momentum": 0.0, "weight_decay": 0.1}) is spec
    with pytest.raises(ValueError, match=r"wrap tf.keras.optimizers.SGD\(learning_rate, momentum=0.0"):
        take_over_keras_adam(spec, {"name": "Adam", "beta_1": 0.9, "beta_2": 0.999})
    with pytest.raises(ValueError, match="momentum=0.9 would apply a second momentum"):
        take_over_keras_adam(spec, {"name": "SGD", "momentum": 0.9})
    with pytest.raises(ValueError, match="would rescale the direction"):
        take_over_keras_adam(spec, {"name": "RMSprop", "rho": 0.9})


# -- DGC under Adam ------------------------------------------------------------------------------------
def test_dgc_under_adam_is_refused_with_momentum_and_warned_about_without():
    from torch_ops.compressors import compressor_class
    adamw = [_adam()]
    spec = parse_spec("dgc:ratio=0.01")
    with pytest.raises(ValueError, match="use 'onebitadam'"):
        compressor_class(spec).adapt_optimizer(spec, adamw)
    zero = parse_spec("dgc:ratio=0.01,momentum=0")
    with pytest.warns(UserWarning, match="use 'onebitadam'"):
        compressor_class(zero).adapt_optimizer(zero, adamw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sgd = [_sgd(momentum=0.9)]
        assert compressor_class(spec).adapt_optimizer(spec, sgd)["momentum"] == 0.9
        check_dgc_under_adam(spec, False)


def test_dgc_under_keras_adam_is_refused():
    tf = pytest.importorskip("tensorflow")
    from tf_ops.compressors import compressor_class
    spec = parse_spec("dgc:ratio=0.01")
    with pytest.raises(ValueError, match="use 'onebitadam'"):
        compressor_class(spec).adapt_optimizer(spec, tf.keras.optimizers.Adam(0.1).get_config())


def test_update_exchanging_spec_is_refused_where_a_gradient_is_expected():
    """onebitadam's result is Adam's update: no delayed averaging, no DiLoCo outer gradient, no DDP hook
    without the optimizer it takes over; each refused before any collective (no transport is made)."""
    import hvdcompress.ddp as ddp
    import hvdcompress.torch as hvc

    model = torch.nn.Linear(4, 2)
    for kwargs in ({"delay": 1}, {"sync_every": 2}):
        with pytest.raises(ValueError, match="delay / sync_every"):
            hvc.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                     named_parameters=model.named_parameters(), compression="onebitadam", **kwargs)
    with pytest.raises(ValueError, match="outer gradient"):
        hvc.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-3), compression="onebitadam", backend="torch")
    with pytest.raises(ValueError, match="optimizer="):
        ddp.comm_hook("onebitadam", model=model)
