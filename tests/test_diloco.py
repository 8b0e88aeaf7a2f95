"""DiLoCo / Streaming DiLoCo / SparseLoCo: the numpy reference's rules (single process), then the
PyTorch ``DiLoCo`` against it on real Horovod workers (tests/scenarios/diloco.py, in the session's shared 2-worker PyTorch launch).

Reference rules checked here by hand-computed cases: the pseudo-gradient's sign (global MINUS
local: with outer SGD lr 1 and no momentum, one sync is exactly model averaging), the fragment
schedule (each fragment at its offset, every H steps), the overlap (the exchange carries the
pseudo-gradient of its launch step, the merge uses the local parameters of its apply step), the
mix, Nesterov momentum, error feedback on the pseudo-gradient, non-finite values and bad arguments.
"""

from __future__ import annotations

import numpy as np
import pytest

from hvdcompress.diloco import check_arguments, split_fragments
from hvdcompress.reference.diloco import DiLoCoReference
from scenarios.diloco import CKPT, TORCH_CONFIGS

F32 = np.float32


def _locals(world, values):
    return [[np.asarray(v, F32) for v in values[r]] for r in range(world)]


def test_the_pseudo_gradient_is_global_minus_local_one_sync_is_model_averaging():
    ref = DiLoCoReference([np.zeros(3, F32)], world=2, sync_every=2, lr=1.0, momentum=0.0)
    local = _locals(2, [[[1, 2, 3]], [[3, 2, 1]]])
    out = ref.step(local)  # t = 1: no sync
    assert np.array_equal(out[0][0], [1, 2, 3]) and np.array_equal(out[1][0], [3, 2, 1])
    out = ref.step(_locals(2, [[[2, 4, 6]], [[4, 0, 2]]]))  # t = 2: sync
    # Delta = mean(global - local) = -(3, 2, 4); global - lr * Delta = (3, 2, 4): the mean of the locals.
    # The reversed sign (local - global) would move the global parameters to (-3, -2, -4).
    for r in range(2):
        assert np.array_equal(out[r][0], [3, 2, 4])
    assert np.array_equal(ref.theta[0], [3, 2, 4])


def test_outer_nesterov_momentum_two_syncs():
    lr, m = 0.7, 0.9
    ref = DiLoCoReference([np.zeros(1, F32)], world=1, sync_every=1, lr=lr, momentum=m, nesterov=True)
    g1 = F32(0) - F32(1)  # local moved to 1: Delta = -1
    out = ref.step([[np.ones(1, F32)]])
    buf = g1
    theta = F32(0) + F32(-lr) * (g1 + F32(m) * buf)
    assert np.array_equal(out[0][0], [theta])
    local = theta + F32(0.5)
    out = ref.step([[np.array([local], F32)]])
    g2 = F32(theta - local)
    buf = F32(m) * buf + g2
    theta2 = theta + F32(-lr) * F32(g2 + F32(m) * buf)
    assert np.array_equal(out[0][0], [theta2])


def test_fragments_sync_in_turn_at_their_offsets_with_overlap_and_mix():
    # 4 tensors, P = 2 fragments ([0, 1], [2, 3]), H = 4: interval 2; tau = 1; mix 0.5
    params = [np.zeros(2, F32) for _ in range(4)]
    ref = DiLoCoReference(params, world=2, sync_every=4, fragments=2, overlap_steps=1, mix=0.5, lr=1.0, momentum=0.0)
    assert ref.fragments == [[0, 1], [2, 3]]
    for t in range(1, 9):
        local = [[np.full(2, 10 * t + r, F32) for _ in range(4)] for r in range(2)]
        before = ref.in_flight
        out = ref.step(local)
        p_launched = ref.cfg.launched_at(t)
        if p_launched is not None:
            assert ref.in_flight is not None and ref.in_flight[0] == p_launched
            for i in ref.fragments[p_launched]:  # the mean of (global - local) at the launch step
                want = np.mean([ref.theta[i] - local[r][i] for r in range(2)], axis=0)
                assert np.array_equal(ref.in_flight[2][i], want.astype(F32))
        p_applied = ref.cfg.applied_at(t)
        if p_applied is None:
            for r in range(2):
                for i in range(4):
                    assert np.array_equal(out[r][i], local[r][i])  # nothing touched between syncs
        else:
            assert before is not None and before[0] == p_applied and t == before[1]
            for i in ref.fragments[p_applied]:
                g = ref.theta[i]
                for r in range(2):
                    assert np.array_equal(out[r][i], (g + F32(0.5) * (local[r][i] - g)).astype(F32))
            for i in ref.fragments[1 - p_applied]:
                for r in range(2):
                    assert np.array_equal(out[r][i], local[r][i])
    # schedule: fragment 0 applied at t = 2, 6; fragment 1 at t = 4, 8; each launched one step early
    assert [ref.cfg.applied_at(t) for t in range(1, 9)] == [None, 0, None, 1, None, 0, None, 1]
    assert [ref.cfg.launched_at(t) for t in range(1, 9)] == [0, None, 1, None, 0, None, 1, None]
    assert ref.rounds == [2, 2]


def test_overlap_exchanges_the_launch_steps_pseudo_gradient():
    ref = DiLoCoReference([np.zeros(1, F32)], world=1, sync_every=3, overlap_steps=2, lr=1.0, momentum=0.0)
    ref.step([[np.array([5.0], F32)]])        # t=1: launch with Delta = 0 - 5
    out = ref.step([[np.array([7.0], F32)]])  # t=2
    assert np.array_equal(out[0][0], [7.0])
    out = ref.step([[np.array([9.0], F32)]])  # t=3: apply: global = 0 - (-5) = 5, mix 0
    assert np.array_equal(out[0][0], [5.0]) and np.array_equal(ref.theta[0], [5.0])


def test_error_feedback_acts_on_the_pseudo_gradient():
    # topk with ratio 1/4 of 4 entries: one entry sent per sync; the rest stays in the residual
    ref = DiLoCoReference([np.zeros(4, F32)], world=1, sync_every=1, lr=1.0, momentum=0.0,
                          compression="topk:ratio=0.25")
    out = ref.step([[np.array([4, 3, 2, 1], F32)]])  # Delta = -(4,3,2,1); sent: index 0
    assert np.array_equal(out[0][0], [4, 0, 0, 0])
    assert np.array_equal(ref.state[0][0]["residual"], [0, -3, -2, -1])
    out = ref.step([[out[0][0]]])  # Delta = 0; e = residual; sends index 1
    assert np.array_equal(out[0][0], [4, 3, 0, 0])


def test_sparseloco_decays_the_residual_and_sends_low_bit_values():
    ref = DiLoCoReference([np.zeros(100, F32)], world=2, sync_every=1, lr=1.0, momentum=0.0,
                          compression="sparseloco:ratio=0.05,bits=2,beta=0.5")
    rng = np.random.default_rng(0)
    local = [[rng.standard_normal(100).astype(F32)] for _ in range(2)]
    ref.step(local)
    for r in range(2):
        e = -local[r][0]
        res = ref.state[r][0]["residual"]
        sent = e - res
        assert np.count_nonzero(sent) == 5  # ceil(0.05 * 100) entries
        assert len(np.unique(np.abs(sent[sent != 0]))) <= 2  # 2 bits: a sign and two magnitudes
    r0 = ref.state[0][0]["residual"].copy()
    theta = ref.theta[0].copy()
    ref.step([[theta.copy()], [theta.copy()]])  # Delta = 0: e = 0.5 * residual
    sent = F32(0.5) * r0 - ref.state[0][0]["residual"]
    assert np.count_nonzero(sent) == 5
    # 2 workers, per sync: 5 int32 indices + 8 bytes of scales + ceil(5 * 2 / 8) bytes of codes
    assert ref.bytes_sent == [2 * (5 * 4 + 8 + 2)] * 2


def test_non_finite_pseudo_gradient_reaches_every_worker_and_leaves_no_state():
    ref = DiLoCoReference([np.zeros(4, F32)], world=2, sync_every=1, compression="topk:ratio=0.5")
    bad = np.array([np.nan, 1, 2, 3], F32)
    out = ref.step([[bad], [np.ones(4, F32)]])
    for r in range(2):
        assert np.isnan(out[r][0]).all()
        assert np.isfinite(ref.state[r][0]["residual"]).all()


def test_flush_leaves_identical_replicas_at_theta_global():
    ref = DiLoCoReference([np.zeros(3, F32), np.zeros(2, F32)], world=2, sync_every=4, fragments=2,
                          overlap_steps=1, mix=0.5)
    rng = np.random.default_rng(1)
    local = [[np.zeros(3, F32), np.zeros(2, F32)] for _ in range(2)]
    for _ in range(3):
        local = ref.step([[x + rng.standard_normal(x.shape).astype(F32) for x in ps] for ps in local])
    assert ref.in_flight is not None
    out = ref.flush(local)
    assert ref.in_flight is None
    for i in range(2):
        assert np.array_equal(out[0][i], out[1][i]) and np.array_equal(out[0][i], ref.theta[i])


def test_split_fragments_balances_consecutive_tensors():
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([1, 100, 1, 1], 3) == [[0], [1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_fragments([1, 1, 1], 3) == [[0], [1], [2]]
    for sizes in ([5, 1, 9, 2, 2, 7], [1] * 7, [50, 1, 1, 1, 1, 1, 50]):
        for P in range(1, len(sizes) + 1):
            frags = split_fragments(sizes, P)
            assert sum(frags, []) == list(range(len(sizes))) and all(frags)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sync_every=0), "sync_every must be an int in \\[1, inf\\]"),
    (dict(sync_every=2.5), "sync_every must be an int"),
    (dict(sync_every=6, fragments=4), "sync_every \\(6\\) must be divisible by fragments \\(4\\)"),
    (dict(sync_every=8, fragments=5), "fragments must be an int in \\[1, 4\\]"),
    (dict(sync_every=8, fragments=2, overlap_steps=4), "overlap_steps must be an int in \\[0, 3\\]"),
    (dict(sync_every=8, overlap_steps=-1), "overlap_steps must be an int in \\[0, 7\\]"),
    (dict(sync_every=8, mix=-0.1), "mix must be a float in \\[0.0, 1.0\\]"),
    (dict(sync_every=8, mix=float("nan")), "mix must be a float"),
    (dict(sync_every=8, compression="topk:ratio=2"), "parameter 'ratio' must be float in \\(0.0, 1.0\\]"),
    (dict(sync_every=8, compression="dgc:momentum=0.9"), "outer optimizer holds the momentum"),
])
def test_bad_arguments_name_the_parameter_and_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_arguments(4, **kwargs)
    with pytest.raises(ValueError, match=match):
        DiLoCoReference([np.zeros(1, F32)] * 4, world=2, **kwargs)


# -- PyTorch on real Horovod workers -------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch_runs():
    """``scenarios/diloco.py``'s runs in the session's shared 2-worker PyTorch launch (shared_launch.TORCH_2)."""
    from scenarios.shared_launch import TORCH_2
    return TORCH_2.results("test_diloco")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(TORCH_CONFIGS))
def test_torch_diloco_matches_the_reference_on_two_workers(torch_runs, name):
    from scenarios.diloco import assert_matches_reference
    from scenarios.launch import part
    assert_matches_reference([r[name] for r in part(torch_runs, "reference")], TORCH_CONFIGS[name])


@pytest.mark.multiprocess
@pytest.mark.parametrize("which", ["checkpoint", "checkpoint_dense"])  # gathered / summed in place
def test_torch_checkpoint_with_a_fragment_in_flight_resumes_exactly(torch_runs, which):
    from scenarios.launch import part
    for r in part(torch_runs, which):
        assert r["in_flight"]
        for a, b in zip(r["straight"], r["resumed"]):
            assert np.array_equal(a, b)


@pytest.mark.multiprocess
def test_torch_elastic_state_restores_exactly_and_syncs_from_rank_0(torch_runs):
    from scenarios.launch import part
    runs = part(torch_runs, "elastic")
    for r in runs:
        for a, b in zip(r["straight"], r["restored"]):
            assert np.array_equal(a, b)
    assert runs[0]["step"] == runs[1]["step"] == 9
    for i in range(len(runs[0]["synced"])):
        assert np.array_equal(runs[0]["synced"][i], runs[1]["synced"][i])
    for i in range(len(runs[0]["global"])):
        assert np.array_equal(runs[0]["global"][i], runs[1]["global"][i])


@pytest.mark.multiprocess
def test_torch_non_finite_pseudo_gradient_reaches_every_rank(torch_runs):
    from scenarios.launch import part
    runs = part(torch_runs, "nan")
    # rank 1's gradient is NaN at inner step 3 (t = 2, 0-based): only rank 1 is NaN until the sync
    # after step 4, when the exchanged pseudo-gradient makes every parameter NaN on every rank
    assert not any(runs[0][2]) and any(runs[1][2])
    for r in range(2):
        assert all(runs[r][3])


@pytest.mark.multiprocess
def test_torch_flush_and_bad_arguments(torch_runs):
    from scenarios.launch import part
    runs = part(torch_runs, "flush")
    for i in range(len(runs[0]["flushed"])):
        assert np.array_equal(runs[0]["flushed"][i], runs[1]["flushed"][i])
        assert np.array_equal(runs[0]["flushed"][i], runs[0]["global"][i])
    for r in runs:
        e = r["errors"]
        assert "sync_every must be an int in [1, inf]" in e[0]
        assert "divisible by fragments" in e[1]
        assert "overlap_steps must be an int in [0, 3]" in e[2]
        assert "mix must be a float in [0.0, 1.0]" in e[3]
        assert "parameter 'ratio'" in e[4]
        assert "not parameters of the model" in e[5]


# -- PyTorch in one process (a one-rank transport without Horovod): the outer loop's bookkeeping -----------
class OneRankTransport:
    """A ``Communicator`` stand-in for a world of one: a sum or a gather of one tensor is the tensor."""

    process_set = None

    def rank(self):
        return 0

    def size(self):
        return 1

    def launch(self, requests, name):
        return [r.tensor.clone() for r in requests]

    def wait(self, handles):
        return tuple(handles)

    def poll(self, handles):
        return True


def _one_rank_run(kw, steps, state=None, start=0):
    import torch
    from scenarios import diloco as sc
    from torch_ops.diloco import DiLoCo

    model = sc._model()
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    seen = sc._record(model, inner)
    opt = DiLoCo(model, inner, transport=OneRankTransport(), **kw)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    after = []
    for t in range(start, start + steps):
        sc._train(model, opt, 0, 1, start=t)
        after.append([p.detach().numpy().copy() for p in model.parameters()])
    return model, opt, seen, after


@pytest.mark.parametrize("kw", [dict(sync_every=3), CKPT, TORCH_CONFIGS["streaming_qsgd"]])
def test_torch_one_rank_matches_the_reference(kw):
    from scenarios import diloco as sc
    init = [p.detach().numpy().copy() for p in sc._model().parameters()]
    model, opt, seen, after = _one_rank_run(kw, 10)
    ref = DiLoCoReference(init, world=1, names=opt.names, **kw)
    for t in range(10):
        out = ref.step([seen[t]])
        for got, want in zip(after[t], out[0]):
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7)
    assert opt.bytes_sent == ref.bytes_sent[0]
    # stats: one record per fragment exchange applied, its payload next to its float32 deltas
    applied = [opt.cfg.launched_at(t) for t in range(1, 11)
               if opt.cfg.launched_at(t) is not None and opt.cfg.due(t) <= 10]
    s = opt.stats
    assert s.steps == len(applied) > 0 and s.total_bytes == opt.bytes_sent
    assert s.total_dense_bytes == sum(opt.params[i].numel() * 4 for p in applied for i in opt.fragments[p])


def test_torch_one_rank_checkpoint_with_a_fragment_in_flight_is_exact():
    import copy
    model, opt, _, straight = _one_rank_run(CKPT, 9)
    model, opt, _, _ = _one_rank_run(CKPT, 5)
    state = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    assert state["opt"]["hvdcompress_diloco"]["in_flight"] is not None
    _, _, _, resumed = _one_rank_run(CKPT, 4, state=state, start=5)
    for a, b in zip(straight[-1], resumed[-1]):
        assert np.array_equal(a, b)
