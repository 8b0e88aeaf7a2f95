"""Top-k Adam single-process: the numpy oracle against the paper's Algorithm 1 (1-bit Adam's
transcription with C = top-k), the sparse averaged moment (the union of the ranks' kept indices;
the rest stays in each rank's residual), PyTorch and TensorFlow against the oracle bit for bit in
lockstep worlds of 1-3 ranks (merged members too), the declared wire cost, bad parameters and the
optimizer take-over shared with onebitadam. Real 2-worker launches: tests/test_topkadam_multiprocess.py."""

import numpy as np
import pytest
import torch

from hvdcompress import parse_spec
from hvdcompress.contract import Member
from hvdcompress.momentum import take_over_adam
from hvdcompress.reference import simulate
from hvdcompress.reference.onebitadam import adamw_step, bias_corrections, denominator, transcription
from hvdcompress.registry import info_for
from hvdcompress.spec import num_selected

F32 = np.float32
SPECS = ["topkadam:warmup_steps=2,ratio=0.2", "topkadam:warmup_steps=3,ratio=0.05,beta1=0.8,beta2=0.95,eps=1e-6"]
SHAPE = (7, 5)
MERGED = (Member("a", (4, 5), 0), Member("b", (15,), 20))  # two tensors in one flat group of 35


def _topk_dense(ratio):
    """D(C(a)) for top-k: the k largest |a| kept (ties to the lower index), the rest zero."""
    def compress(a):
        k = num_selected(ratio, a.size)
        keep = np.argsort(-np.abs(a), kind="stable")[:k]
        out = np.zeros_like(a)
        out[keep] = a[keep]
        return out
    return compress


@pytest.mark.parametrize("space", ["direction", "moment"])
def test_oracle_follows_the_papers_algorithm_with_topk_on_a_quadratic(space):
    rng = np.random.default_rng(1)
    workers, n, steps, warm, lr, wd, ratio = 3, 12, 14, 5, 0.05, 0.1, 0.25
    A = [rng.standard_normal((n, n)) / np.sqrt(n) for _ in range(workers)]
    b = [rng.standard_normal(n) for _ in range(workers)]

    def grad(i, t, p):
        return A[i].T @ (A[i] @ p - b[i])

    p0 = rng.standard_normal(n).astype(F32)
    want = transcription(grad, p0, steps, workers, lr, wd, warm, _topk_dense(ratio), space=space)
    spec = parse_spec(f"topkadam:warmup_steps={warm},ratio={ratio},space={space}")
    p, states = p0.copy(), [{} for _ in range(workers)]
    for step in range(steps):
        grads = [grad(i, step + 1, p.astype(np.float64)).astype(F32) for i in range(workers)]
        d, states, _ = simulate(spec, grads, states, key="w", step=step)
        p = adamw_step(p, d, lr, wd)
        np.testing.assert_allclose(p, want[step], rtol=2e-5, atol=2e-5, err_msg=f"step {step}")
    assert all(np.array_equal(states[0][k], states[r][k]) for r in range(workers) for k in ("m", "v"))
    assert not np.array_equal(states[0]["residual"], states[1]["residual"])  # each worker's own error


@pytest.mark.parametrize("space", ["direction", "moment"])
def test_the_averaged_moment_is_the_union_of_the_kept_indices_and_the_rest_stays_in_the_residual(space):
    spec = parse_spec(f"topkadam:warmup_steps=1,ratio=0.1,space={space}")
    rng = np.random.default_rng(0)
    n, k = 50, 5
    states = [{}, {}]
    _, states, _ = simulate(spec, [rng.standard_normal(n).astype(F32) for _ in range(2)], states, step=0)
    m0, v0 = states[0]["m"].copy(), states[0]["v"].copy()
    g = [rng.standard_normal(n).astype(F32) for _ in range(2)]
    _, states, sent = simulate(spec, g, states, step=1)
    kept = [set(sent[r][-1][0].tolist()) for r in range(2)]  # each rank's indices, as gathered
    assert all(len(s) == k for s in kept)
    assert set(np.flatnonzero(states[0]["m"]).tolist()) <= kept[0] | kept[1]
    assert np.array_equal(states[0]["v"], v0)  # frozen
    for r in range(2):
        a = (m0 * F32(0.9) + g[r] * F32(1.0 - 0.9)).astype(F32)  # m_i + e_i, with e_i = 0 before
        if space == "direction":  # u_i = m_i / den + e_i
            a = (a / denominator(v0, bias_corrections(spec, 1)[1], F32(1e-8))).astype(F32)
        unsent = np.setdiff1d(np.arange(n), sorted(kept[r]))
        assert np.array_equal(states[r]["residual"][unsent], a[unsent])
        assert not states[r]["residual"][sorted(kept[r])].any()
        assert np.array_equal(np.sort(np.abs(a))[-k:], np.sort(np.abs(a[sorted(kept[r])])))  # the k largest
    assert sent[0][-1][0].nbytes + sent[0][-1][1].nbytes == k * (4 + 4)  # int32 indices, float32 values


@pytest.mark.parametrize("ratio, d", [(0.01, 1000), (0.2, 35), (1.0, 9)])
def test_declared_wire_is_the_payload_after_the_warm_up(ratio, d):
    spec = parse_spec(f"topkadam:warmup_steps=1,ratio={ratio}")
    k = num_selected(ratio, d)
    (rnd,) = info_for("topkadam").rounds(spec.params, d, 2)  # float32 moments whatever the gradient's dtype
    assert float(rnd.nbytes) == k * 8
    g = [np.ones(d, F32), -np.ones(d, F32)]
    _, states, sent = simulate(spec, g, step=0)
    assert sum(t.nbytes for t in sent[0][0]) == d * 4  # the dense warm-up
    _, _, sent = simulate(spec, g, states, step=1)
    assert sum(t.nbytes for t in sent[0][0]) == k * 8


def test_bad_parameters_name_the_parameter_and_range():
    for bad in ("0", "-0.1", "1.5"):
        with pytest.raises(ValueError, match=r"topkadam: parameter 'ratio' must be float in \(0.0, 1.0\]"):
            parse_spec(f"topkadam:ratio={bad}")
    with pytest.raises(ValueError, match=r"topkadam: parameter 'warmup_steps' must be int in \[1, "):
        parse_spec("topkadam:warmup_steps=0")
    with pytest.raises(ValueError, match=r"parameter 'beta2' must be float in \[0.0, 1.0\) or none"):
        parse_spec("topkadam:beta2=1.0")


def test_adamw_is_taken_over_and_what_cannot_be_honoured_refused():
    from torch_ops.compressors import compressor_class
    spec = parse_spec("topkadam:ratio=0.1")
    p = torch.nn.Parameter(torch.zeros(3))
    adamw = {"params": [p], "lr": 0.001, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.01, "amsgrad": False,
             "maximize": False, "decoupled_weight_decay": True}
    new = compressor_class(spec).adapt_optimizer(spec, [adamw])
    assert (new.name, new["ratio"], new["beta1"], new["beta2"], new["eps"]) == ("topkadam", 0.1, 0.8, 0.9, 1e-6)
    assert compressor_class(spec).returns_update  # the refusals of delay / sync_every, DiLoCo, DDP without optimizer=
    sgd = {"params": [p], "lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}
    with pytest.raises(ValueError, match="compression 'topkadam'.*would apply a second momentum"):
        take_over_adam(spec, [sgd])
    with pytest.raises(ValueError, match="compression 'topkadam'.*amsgrad=True"):
        take_over_adam(spec, [dict(adamw, amsgrad=True)])
