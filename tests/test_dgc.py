"""DGC: the PyTorch implementation against the step-by-step numpy oracle, bit for bit."""

import numpy as np
import pytest
import torch

from hvdcompress import Compression, parse_spec
from hvdcompress.reference.dgc import dgc_exchange, sampled_threshold_select as np_select
from hvdcompress.sampling import sample_offset, sample_stride
from hvdcompress.warmup import density_at, warmup_densities
from scenarios.local_world import run_lockstep
from torch_ops.compressors import ExchangeContext, build_compressor, sampled_threshold_select
from torch_ops.compressors.dgc import adopt_momentum

CONFIGS = [
    "dgc:ratio=0.01,warmup_epochs=0",
    "dgc:ratio=0.01,warmup_epochs=2",
    "dgc:ratio=0.005,nesterov=true,warmup_epochs=0",
    "dgc:ratio=0.01,momentum_correction=false,warmup_epochs=0",
    "dgc:ratio=0.01,momentum_correction=false,nesterov=true,warmup_epochs=0",
    "dgc:ratio=0.01,momentum_masking=false,warmup_epochs=0",
    "dgc:ratio=0.01,clip_norm=1.0,warmup_epochs=0",
    "dgc:ratio=0.02,fp16_values=true,warmup_epochs=0,sample_ratio=0.05",
    "dgc:ratio=0.001,warmup_schedule=0.25/0.0625/0.015625/0.004",
    "dgc:ratio=0.01,min_sparse_numel=100000,warmup_epochs=0",  # everything dense
]


def _np_grads(rng, world, shape):
    # heavy-tailed like real gradients, with a few exact ties
    return [np.round(rng.standard_t(3, size=shape), 3).astype(np.float32) for _ in range(world)]


@pytest.mark.parametrize("text", CONFIGS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shape", [(120, 50), (64,)])
def test_torch_dgc_matches_numpy_oracle_over_steps(text, world, shape):
    spec = parse_spec(text)
    comp = build_compressor(spec)
    rng = np.random.default_rng(7 * world + len(text))
    np_states = [{} for _ in range(world)]
    t_states = [{} for _ in range(world)]
    for step in range(6):
        epoch = step // 2
        grads = _np_grads(rng, world, shape)
        want, payloads = dgc_exchange(spec, grads, np_states, shape, key="w", step=step, epoch=epoch)
        gens = [comp.exchange(torch.from_numpy(g.reshape(-1).copy()),
                              ExchangeContext("w", step, world, 1.0 / world, st, shape, epoch))
                for g, st in zip(grads, t_states)]
        got, sent = run_lockstep(gens)
        for r in range(world):
            np.testing.assert_array_equal(got[r].numpy(), want, err_msg=f"step {step} rank {r}")
            assert sent[r] == sum(a.nbytes for a in payloads[r].values())
            for name, arr in np_states[r].items():
                np.testing.assert_array_equal(t_states[r][name].numpy(), arr, err_msg=name)


@pytest.mark.parametrize("n, k", [(10_000, 10), (10_000, 100), (50_000, 50), (1000, 999), (5000, 1)])
@pytest.mark.parametrize("dist", ["normal", "ties", "sparse", "zeros"])
def test_sampled_selection_matches_oracle_and_bounds(n, k, dist):
    rng = np.random.default_rng(n + k)
    v = {"normal": rng.standard_normal(n), "ties": np.round(rng.standard_normal(n), 1),
         "sparse": rng.standard_normal(n) * (rng.random(n) < 0.02), "zeros": np.zeros(n)}[dist]
    v = v.astype(np.float32)
    for sample_ratio, iters in ((0.01, 4), (0.1, 0), (1.0, 2)):
        off = sample_offset(sample_stride(sample_ratio), n, 0, 3, "x")
        want = np_select(v, k, sample_ratio, iters, off)
        got = sampled_threshold_select(torch.from_numpy(v), k, sample_ratio, iters, off)
        np.testing.assert_array_equal(got.numpy(), want)
        assert len(got) >= 1 and len(got) * 10 <= 13 * k + 10
        assert torch.all(got[1:] > got[:-1])  # ascending, distinct


def test_selected_entries_are_the_large_ones():
    v = torch.randn(100_000)
    idx = sampled_threshold_select(v, 100, 0.01, 4, 0)
    assert 80 <= len(idx) <= 130
    exact = torch.topk(v.abs(), 100).values
    assert v.abs()[idx].min() >= exact[-1] * 0.5  # nothing small sneaks in


def test_warmup_default_follows_the_paper():
    d = warmup_densities(0.001, 4)
    assert [round(x, 4) for x in d] == [0.2512, 0.0631, 0.0158, 0.004]
    assert density_at(10, 0.001, 4) == 0.001
    assert density_at(1, 0.001, 4, (0.25, 0.0625, 0.015625, 0.004)) == 0.0625
    assert warmup_densities(0.01, 0) == ()


def test_warmup_changes_how_much_is_sent():
    comp = build_compressor(Compression.dgc(ratio=0.001, warmup_epochs=4))
    sizes = []
    for epoch in (0, 1, 4):
        st = {}
        gen = comp.exchange(torch.randn(100_000), ExchangeContext("w", 0, 1, 1.0, st, (100, 1000), epoch))
        requests = next(gen)
        sizes.append(requests[0].tensor.numel())
    assert sizes[0] > sizes[1] > sizes[2]
    assert 0.8 * 25_119 <= sizes[0] <= 1.3 * 25_119 and 80 <= sizes[2] <= 130


@pytest.mark.parametrize("text, needle", [
    ("dgc:ratio=0", "parameter 'ratio' must be float in (0.0, 1.0]"),
    ("dgc:ratio=1.01", "parameter 'ratio' must be float in (0.0, 1.0]"),
    ("dgc:momentum=-0.5", "parameter 'momentum' must be float in [0.0, 1.0)"),
    ("dgc:warmup_schedule=0.25/0.3", "warmup_schedule must decrease strictly"),
    ("dgc:warmup_schedule=0.25/0.0001", "must be above the target ratio"),
    ("dgc:warmup_schedule=0.25/1.5", "warmup_schedule[1] must be in (0, 1]"),
    ("dgc:warmup_epochs=-1", "parameter 'warmup_epochs' must be int in [0, inf)"),
    ("dgc:clip_norm=-1", "parameter 'clip_norm' must be float in (0.0, inf) or none"),
    ("dgc:sample_ratio=0", "parameter 'sample_ratio'"),
])
def test_bad_dgc_settings_are_refused(text, needle):
    with pytest.raises(ValueError) as err:
        parse_spec(text)
    assert needle in str(err.value)


def test_optimizer_momentum_is_taken_over_once():
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.SGD(p, lr=0.1, momentum=0.8, nesterov=True)
    with pytest.warns(UserWarning, match="taking over the optimizer's momentum=0.8"):
        spec = adopt_momentum(Compression.dgc(), opt.param_groups)
    assert spec["momentum"] == 0.8 and spec["nesterov"] is True
    assert opt.param_groups[0]["momentum"] == 0.0 and opt.param_groups[0]["nesterov"] is False
    plain = torch.optim.SGD(p, lr=0.1)
    assert adopt_momentum(Compression.dgc(), plain.param_groups) == Compression.dgc()


def test_groups_with_different_momenta_are_refused():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([{"params": [a], "momentum": 0.9}, {"params": [b], "momentum": 0.5}], lr=0.1)
    with pytest.raises(ValueError, match="different momenta"):
        adopt_momentum(Compression.dgc(), opt.param_groups)


@pytest.mark.parametrize("spec", ["dgc:ratio=0.01,warmup_epochs=0", "topk:ratio=0.01"])
def test_a_result_built_in_the_offered_buffer_is_the_same_result(spec):
    """``ExchangeContext.out``: DGC's and top-k's sparse sum is built in the buffer the optimizer
    offers (its gradient buffer), bit for bit the result of a fresh tensor, on every rank and step."""
    import torch
    from hvdcompress.spec import resolve
    from scenarios.local_world import run_lockstep
    from torch_ops.compressors import ExchangeContext, build_compressor

    world, n = 3, 5000  # a matrix (DGC sends vectors dense)
    gen = torch.Generator().manual_seed(7)
    grads = [[torch.randn(n, generator=gen) for _ in range(world)] for _ in range(4)]
    results = {}
    for offer in (False, True):
        comps = [build_compressor(resolve(spec)) for _ in range(world)]
        states = [{} for _ in range(world)]
        results[offer] = []
        for step, gs in enumerate(grads):
            xs = [g.clone() for g in gs]
            ctxs = [ExchangeContext("w", step, world, 1.0 / world, states[r], (50, 100), 0, r,
                                    out=xs[r] if offer else None) for r in range(world)]
            outs, _ = run_lockstep([comps[r].exchange(xs[r], ctxs[r]) for r in range(world)])
            if offer and step > 0:  # from the second step on (top-k's first has no residual yet)
                assert all(o.data_ptr() == x.data_ptr() for o, x in zip(outs, xs))
            results[offer].append([o.clone() for o in outs])
    for fresh, built in zip(results[False], results[True]):
        for a, b in zip(fresh, built):
            assert torch.equal(a, b)
