"""Exact top-k and DGC's selection against the numpy oracle on adversarial inputs (torch and TF).

The fast paths (a sampled threshold, block maxima, a candidate set, word-wise nonzero) must give
the oracle's indices in every case: ties at the boundary, constant and zero tensors, tiny
tensors, heavy tails, samples that miss the large entries, k in {0, 1, n-1, n}.
"""

import numpy as np
import pytest
import torch

from hvdcompress.reference import reference_exchange
from hvdcompress.reference.dgc import dgc_exchange
from hvdcompress.reference.dgc import sampled_threshold_select as np_select
from hvdcompress.reference.selection import threshold_indices as np_threshold
from hvdcompress.reference.selection import topk_indices as np_topk
from hvdcompress import parse_spec
from hvdcompress.native.select import topk_sample_stride
from scenarios.local_world import run_lockstep
from torch_ops.compressors import ExchangeContext, build_compressor
from torch_ops.compressors import dgc_selection as ds
from torch_ops.compressors import cpu_selection as cs
from torch_ops.compressors import selection as ts

SIZES = [1, 2, 7, 100, 4095, 4096, 4097, 70_001, 300_007]
KINDS = ["normal", "ties", "constant", "zeros", "few", "heavy", "spikes", "periodic", "sorted", "sampled_big"]


def _vector(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + n)
    if kind == "normal":
        x = rng.standard_normal(n)
    elif kind == "ties":  # a handful of distinct magnitudes: ties at every boundary
        x = rng.integers(-3, 4, n) * 0.5
    elif kind == "constant":
        x = np.full(n, -0.75)
    elif kind == "zeros":
        x = np.zeros(n)
        x[n // 2:] = -0.0
    elif kind == "few":  # mostly zeros (a frozen part of a model): 37 nonzeros, some tied
        x = np.zeros(n)
        x[n // 3:] = -0.0
        where = rng.permutation(n)[:37]
        x[where] = rng.integers(-2, 3, where.size) * 0.25 + np.where(rng.random(where.size) < 0.5, 1e-3, 0)
    elif kind == "heavy":  # Cauchy: a few huge values, most tiny
        x = rng.standard_cauchy(n)
    elif kind == "spikes":  # a few equal spikes above a sea of small values
        x = rng.standard_normal(n) * 1e-4
        x[rng.integers(0, n, 7)] = 3.0
    elif kind == "periodic":  # nonzero only at multiples of 16: strided samples may see none
        x = np.zeros(n)
        x[::16] = rng.standard_normal(len(x[::16]))
    elif kind == "sorted":
        x = np.sort(rng.standard_normal(n))
    else:  # "sampled_big": large values exactly where top-k's threshold sample looks
        x = rng.standard_normal(n) * 1e-3
        stride = topk_sample_stride(n)
        x[stride // 2::stride] = 10.0 + rng.random(len(x[stride // 2::stride]))
        x[rng.integers(0, n, max(1, n // 50))] = 5.0
    return x.astype(np.float32)


def _ks(n):
    return sorted({k for k in (0, 1, 2, 65, n // 1000, n // 100, n // 7, n - 1, n) if 0 <= k <= n})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_torch_topk_is_the_oracle(kind, n):
    x = _vector(kind, n)
    for k in _ks(n):
        got = ts.topk_indices(torch.from_numpy(x), k)
        assert got.dtype == torch.int64
        np.testing.assert_array_equal(got.numpy(), np_topk(x, k), err_msg=f"k={k}")


def test_torch_topk_mostly_zero_tensors_with_a_nan_take_the_general_path():
    x = np.zeros(300_007, dtype=np.float32)
    x[[5, 70_000, 123_456]] = [1.0, np.nan, -2.0]
    assert cs._np_mostly_zero(x, 2) is None  # a NaN among the nonzeros: not the zero shortcut
    got = ts.topk_indices(torch.from_numpy(x), 2).numpy()
    np.testing.assert_array_equal(got, np_topk(x, 2))  # the two numbers; the NaN never wins a place


def _with_nans(n: int, count: int, seed: int = 3) -> np.ndarray:
    x = _vector("ties", n, seed=seed)
    x[np.random.default_rng(seed).permutation(n)[:count]] = np.nan
    return x


@pytest.mark.parametrize("mode", ["pure", "compiled", "torch_only"])
def test_nan_ranks_below_every_number_on_every_path(request, mode, monkeypatch):
    """NaN ranks last, as in the oracle: with a few NaN (fewer than k), with more NaN than k and
    with more NaN than numbers, on small tensors (direct path), mid-size and large ones (sampled
    candidates, whose sample may hold NaN), and the dense fallback (k near n)."""
    if mode == "torch_only":
        monkeypatch.setattr(ts, "numpy_view", lambda a: None)
    else:
        request.getfixturevalue(mode)
    for n in (7, 100, 5003, 100_003):
        for count in sorted({1, 3, n // 10, n // 2, n - 2}):
            x = _with_nans(n, count)
            for k in sorted({1, 2, 5, n // 100 + 1, n // 3, n - count, n - count + 1, n - 1} & set(range(1, n))):
                np.testing.assert_array_equal(ts.topk_indices(torch.from_numpy(x), k).numpy(), np_topk(x, k),
                                              err_msg=f"{mode} n={n} nan={count} k={k}")


def test_shared_positions_rank_nan_last():
    """``hvdcompress.native.select.positions`` (both frameworks' numpy level) on magnitudes with NaN."""
    from hvdcompress.native import select
    for y, k in ((np.array([3, 2, 1, np.nan], np.float32), 2), (np.array([np.nan] * 5 + [1, 2], np.float32), 2),
                 (np.array([np.nan] * 5 + [1, 2], np.float32), 4), (np.array([2, 2, np.nan, 2], np.float32), 2)):
        np.testing.assert_array_equal(select.positions(y, k), np_topk(y, k), err_msg=f"{y} {k}")


@pytest.mark.parametrize("size", [None, 32, 64])  # the word-wise scan, or block filters of either size
def test_torch_candidate_scans(monkeypatch, size):
    monkeypatch.setattr(ts, "block_size", lambda fraction: size)
    monkeypatch.setattr(ts, "BLOCKS_UNTIL", 1.0)
    for kind in ("normal", "ties", "heavy", "sampled_big", "periodic"):
        x = _vector(kind, 100_003, seed=1)
        t = torch.from_numpy(x)
        for k in (100, 1000, 5000):
            np.testing.assert_array_equal(ts.topk_indices(t, k).numpy(), np_topk(x, k))
            want = np_select(x, k, 0.01, 4, 7)
            np.testing.assert_array_equal(ds.sampled_threshold_select(t, k, 0.01, 4, 7).numpy(), want)
            u, v = torch.zeros_like(t), torch.zeros_like(t)
            np.testing.assert_array_equal(ds.accumulate_and_select(t, u, v, 0.9, False, k, 0.01, 4, 7).numpy(),
                                          want)


def test_torch_topk_other_dtypes_and_views():
    x = _vector("ties", 50_000)
    for dtype in (torch.float64, torch.float16):
        t = torch.from_numpy(x).to(dtype)
        for k in (1, 50, 500):
            np.testing.assert_array_equal(ts.topk_indices(t, k).numpy(), np_topk(t.numpy(), k))
    two = torch.from_numpy(x).view(100, 500).t()  # not contiguous
    np.testing.assert_array_equal(ts.topk_indices(two, 321).numpy(),
                                  np_topk(two.contiguous().view(-1).numpy(), 321))


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "heavy", "periodic"])
@pytest.mark.parametrize("n", [100, 4096, 300_007])
def test_torch_threshold_and_dgc_selection_are_the_oracle(kind, n):
    x = _vector(kind, n, seed=2)
    t = torch.from_numpy(x)
    for thr in (0.0, 0.5, float(np.abs(x).max())):
        np.testing.assert_array_equal(ts.threshold_indices(t, thr).numpy(), np_threshold(x, thr))
    for k in (1, max(1, n // 1000), n // 100 + 1, n // 4 + 1):
        for sample_ratio, iters, off in ((0.01, 4, 3), (0.1, 0, 1), (1.0, 2, 0)):
            want = np_select(x, k, sample_ratio, iters, off)
            np.testing.assert_array_equal(ds.sampled_threshold_select(t, k, sample_ratio, iters, off).numpy(),
                                          want, err_msg=f"k={k} ratio={sample_ratio}")


@pytest.mark.parametrize("text", ["dgc:ratio=0.002,warmup_epochs=0",
                                  "dgc:ratio=0.01,nesterov=true,warmup_epochs=0",
                                  "dgc:ratio=0.01,momentum_correction=false,warmup_epochs=0",
                                  "dgc:ratio=0.001,warmup_schedule=0.25/0.01"])
def test_torch_fused_dgc_step_over_several_chunks_is_the_oracle(text):
    """The fused update-and-select loop, on a tensor of several chunks with a ragged end."""
    spec = parse_spec(text)
    comp = build_compressor(spec)
    shape = (ts.CHUNK // 500 * 2 + 3, 501)
    rng = np.random.default_rng(5)
    np_states, t_states = [{}, {}], [{}, {}]
    for step in range(3):
        grads = [np.round(rng.standard_t(3, size=shape), 2).astype(np.float32) for _ in range(2)]
        want, _ = dgc_exchange(spec, grads, np_states, shape, key="w", step=step, epoch=step)
        gens = [comp.exchange(torch.from_numpy(g.reshape(-1).copy()),
                              ExchangeContext("w", step, 2, 0.5, st, shape, step))
                for g, st in zip(grads, t_states)]
        got, _ = run_lockstep(gens)
        for r in range(2):
            np.testing.assert_array_equal(got[r].numpy(), want)
            for name, arr in np_states[r].items():
                np.testing.assert_array_equal(t_states[r][name].numpy(), arr, err_msg=name)


def test_torch_paths_without_numpy(monkeypatch):
    """The torch-only scans (block maxima, word-wise nonzero) used off CPU or for dtypes numpy lacks."""
    monkeypatch.setattr(ts, "numpy_view", lambda a: None)
    for kind in ("normal", "ties", "constant", "heavy", "periodic", "sampled_big"):
        for n in (100, 4097, 300_007):
            x = _vector(kind, n, seed=4)
            t = torch.from_numpy(x)
            for k in _ks(n):
                np.testing.assert_array_equal(ts.topk_indices(t, k).numpy(), np_topk(x, k), err_msg=f"{kind} {n} {k}")
            for k in (1, n // 100 + 1, n // 4 + 1):
                want = np_select(x, k, 0.01, 4, 3)
                np.testing.assert_array_equal(ds.sampled_threshold_select(t, k, 0.01, 4, 3).numpy(), want)
                u, v = torch.zeros_like(t), torch.zeros_like(t)
                np.testing.assert_array_equal(ds.accumulate_and_select(t, u, v, 0.5, True, k, 0.01, 4, 3).numpy(),
                                              np_select(x + x * np.float32(0.5), k, 0.01, 4, 3))  # v = 0 + (g + m*u)


@pytest.mark.parametrize("text", ["topk:ratio=0.001", "topk:ratio=0.02", "threshold:threshold=2.0",
                                  "randomk:ratio=0.01"])
def test_torch_error_feedback_in_place_residual_is_the_oracle(text):
    """a = g + r computed in the residual's buffer, the sent entries zeroed there: the oracle's
    payloads and residuals, over steps, on a tensor of several scan chunks."""
    spec = parse_spec(text)
    comp = build_compressor(spec)
    n = cs.NP_CHUNK * 2 + 17
    rng = np.random.default_rng(9)
    states, np_res = [{}, {}], [None, None]
    for step in range(3):
        grads = [rng.standard_t(3, n).astype(np.float32) for _ in range(2)]
        want, np_res, _ = reference_exchange(spec, grads, np_res, key="w", step=step)
        gens = [comp.exchange(torch.from_numpy(g.copy()), ExchangeContext("w", step, 2, 0.5, st))
                for g, st in zip(grads, states)]
        got, _ = run_lockstep(gens)
        for r in range(2):
            np.testing.assert_array_equal(got[r].numpy(), want)
            np.testing.assert_array_equal(states[r]["residual"].numpy(), np_res[r])


# -- TensorFlow --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tf_sel():
    import tensorflow as tf
    from tf_ops.compressors import selection
    return tf, selection


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 7, 4095, 4097, 70_001])
def test_tf_topk_is_the_oracle_eager_and_traced(tf_sel, kind, n):
    tf, sel = tf_sel
    x = _vector(kind, n)
    traced = tf.function(lambda a, k: sel.topk_indices(a, k))
    for k in _ks(n):
        want = np_topk(x, k)
        np.testing.assert_array_equal(sel.topk_indices(tf.constant(x), k).numpy(), want, err_msg=f"k={k}")
        got = traced(tf.constant(x), tf.constant(k, tf.int32))
        assert got.dtype == tf.int32
        np.testing.assert_array_equal(got.numpy(), want, err_msg=f"k={k} traced")


def test_tf_topk_ranks_nan_last(tf_sel):
    """TF's ops (the branch a GPU takes): NaN below every number, as in the oracle, on the direct
    path and the candidate paths."""
    tf, sel = tf_sel
    for n in (7, 5003, 70_001):
        for count in sorted({1, 3, n // 10, n - 2}):
            x = _with_nans(n, count)
            for k in sorted({1, 2, n // 100 + 1, n // 3, n - count, n - count + 1, n - 1} & set(range(1, n))):
                np.testing.assert_array_equal(sel.topk_indices(tf.constant(x), k).numpy(), np_topk(x, k),
                                              err_msg=f"n={n} nan={count} k={k}")


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "heavy", "periodic"])
def test_tf_dgc_selection_is_the_oracle(tf_sel, kind):
    tf, sel = tf_sel
    n = 70_001
    x = _vector(kind, n, seed=3)
    traced = tf.function(lambda v, k, off: sel.sampled_threshold_select(v, k, 0.01, 4, off))
    for k in (1, 70, 701, n // 4):
        want = np_select(x, k, 0.01, 4, 5)
        np.testing.assert_array_equal(sel.sampled_threshold_select(tf.constant(x), k, 0.01, 4, 5).numpy(), want)
        np.testing.assert_array_equal(traced(tf.constant(x), tf.constant(k), tf.constant(5, tf.int64)).numpy(),
                                      want)


# -- the compiled kernels (torch_ops/compressors/native.py) and the pure paths -----------------
@pytest.fixture
def pure(monkeypatch):
    """The pure numpy/torch paths: the compiled kernels switched off for one test."""
    from torch_ops.compressors import native
    native.set_enabled(False)
    yield
    native.set_enabled(True)


@pytest.fixture
def compiled():
    from torch_ops.compressors import native
    native.set_enabled(True)
    if native.lib() is None:
        pytest.skip("no C++ compiler: the pure paths are the only ones")


@pytest.mark.parametrize("mode", ["pure", "compiled"])
def test_both_paths_topk_and_error_feedback_are_the_oracle(request, mode):
    """The same answers with and without the compiled kernels: top-k (direct path for small
    tensors, candidate scans), and error feedback's fused r <- r + g with its selection, including
    samples that mislead (too few candidates) and ties (too many)."""
    request.getfixturevalue(mode)
    for kind in ("normal", "ties", "constant", "heavy", "spikes", "sampled_big"):
        for n in (1000, 5003, 100_003):
            x = _vector(kind, n, seed=6)
            for k in sorted({2, 10, n // 1000 + 2, n // 100 + 1, n // 7}):
                np.testing.assert_array_equal(ts.topk_indices(torch.from_numpy(x), k).numpy(), np_topk(x, k),
                                              err_msg=f"{kind} {n} {k}")
                r0 = _vector("normal", n, seed=7) * np.float32(0.5)
                r = torch.from_numpy(r0.copy())
                got = ts.add_and_topk(r, torch.from_numpy(x), k)
                want_r = x + r0
                np.testing.assert_array_equal(r.numpy(), want_r)
                np.testing.assert_array_equal(got.numpy(), np_topk(want_r, k), err_msg=f"EF {kind} {n} {k}")
    for dtype in (torch.float64, torch.float16):
        t = torch.from_numpy(_vector("ties", 50_000)).to(dtype)
        np.testing.assert_array_equal(ts.topk_indices(t, 77).numpy(), np_topk(t.numpy(), 77))
    nan = _vector("normal", 3000)
    nan[[5, 700]] = np.nan  # NaN never wins a place: left to the general path
    np.testing.assert_array_equal(ts.topk_indices(torch.from_numpy(nan), 30).numpy(), np_topk(nan, 30))


@pytest.mark.parametrize("mode", ["pure", "compiled"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_both_paths_dgc_step_is_the_oracle(request, mode, dtype, monkeypatch):
    """DGC's fused update and selection with and without the compiled kernels: u, v and the
    indices bit for bit (momentum, Nesterov, none), over steps; and the rule's later adaptations,
    which lower the threshold below the one-pass candidates' (a full scan then runs)."""
    request.getfixturevalue(mode)
    rng = np.random.default_rng(11)
    n = ts.CHUNK + 12_345
    for momentum, nesterov in ((0.9, False), (0.75, True), (None, False)):
        u, v = np.zeros(n, dtype), np.zeros(n, dtype)
        tu, tv = torch.zeros(n, dtype=torch.from_numpy(u).dtype), torch.zeros(n, dtype=torch.from_numpy(v).dtype)
        for step in range(3):
            g = (rng.standard_t(3, n) * 0.1).astype(dtype)
            k = n // 1000 if step != 1 else n // 100
            if momentum is None:
                v = v + g
            else:
                u = u * dtype(momentum) + g
                v = v + ((g + u * dtype(momentum)) if nesterov else u)
            want = np_select(v, k, 0.01, 4, step + 3)
            got = ds.accumulate_and_select(torch.from_numpy(g), tu, tv, momentum, nesterov, k, 0.01, 4, step + 3)
            np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{momentum} {nesterov} {step}")
            np.testing.assert_array_equal(tv.numpy(), v)
            np.testing.assert_array_equal(tu.numpy(), u)
            tv.index_fill_(0, got, 0)
            v[want] = 0
    scans = []
    from hvdcompress.native import select as shared  # the numpy-level scans both backends share
    real = shared.ge
    monkeypatch.setattr(shared, "ge", lambda *a, **kw: scans.append(1) or real(*a, **kw))
    g = np.full(100_000, 1.0, dtype)
    g[5::100] = 10.0  # the sample sees only the 1,000 large entries: 4 adaptations, still 1,000 pass
    for k in (5000, 900):
        want = np_select(g, k, 0.01, 4, 5)
        got = ds.accumulate_and_select(torch.from_numpy(g), torch.zeros(g.size, dtype=torch.from_numpy(g).dtype),
                                       torch.zeros(g.size, dtype=torch.from_numpy(g).dtype), 0.9, False, k,
                                       0.01, 4, 5)
        np.testing.assert_array_equal(got.numpy(), want)
    if mode == "compiled":
        assert scans, "the adaptation below the candidates' threshold was not exercised"


@pytest.mark.parametrize("mode", ["pure", "compiled"])
def test_both_paths_dgc_candidate_list_edge_cases(request, mode):
    """The compiled DGC pass keeps a candidate list that tightens itself when it would overflow and
    starts from last step's threshold: the oracle's indices, u and v in the cases that stress it --
    DGC's flat steady state (a constant gradient, many entries just under the threshold), a state
    whose scale drops by 1000x between steps (the remembered threshold is far too high: a rescan),
    all-equal magnitudes (the list cannot be cut at a value: ties), zeros, NaNs and infs."""
    request.getfixturevalue(mode)
    n = 200_003
    rng = np.random.default_rng(5)
    m = np.float32(0.9)
    cases = {
        "steady": [(rng.standard_normal(n) * rng.random(n)).astype(np.float32)] * 15,
        "scale_drop": [(rng.standard_normal(n) * s).astype(np.float32) for s in (1e3, 1e3, 1.0, 1.0, 1e-3)],
        "ties": [np.full(n, 0.5, np.float32)] * 3,
        "zeros": [np.zeros(n, np.float32)] * 2,
        "nan": [np.where(np.arange(n) % 9973 == 0, np.nan, rng.standard_normal(n)).astype(np.float32)] * 2,
        # every |v| the maximum (inf): no threshold can make room in the list (it once overflowed)
        "inf": [np.full(n, np.inf, np.float32), np.where(np.arange(n) % 2 == 0, np.inf, 1.0).astype(np.float32)],
    }
    for name, grads in cases.items():
        for k in (1, 200, n // 50, n // 4):  # n // 4: a dense selection, no candidate list
            u, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
            tu, tv = torch.zeros(n), torch.zeros(n)
            for step, g in enumerate(grads):
                if name == "scale_drop":  # a fresh state each step, in the same tensors
                    u[:], v[:] = 0, 0
                    tu.zero_(), tv.zero_()
                u = u * m + g
                v = v + u
                want = np_select(v, k, 0.01, 4, step % 100)
                got = ds.accumulate_and_select(torch.from_numpy(g), tu, tv, 0.9, False, k, 0.01, 4, step % 100)
                msg = f"{name} k={k} step {step}"
                np.testing.assert_array_equal(got.numpy(), want, err_msg=msg)
                np.testing.assert_array_equal(tv.numpy(), v, err_msg=msg)
                np.testing.assert_array_equal(tu.numpy(), u, err_msg=msg)
                sent = ds.take_and_zero(tv, tu, got)
                np.testing.assert_array_equal(sent.numpy(), v[want], err_msg=msg)
                v[want], u[want] = 0, 0
                np.testing.assert_array_equal(tv.numpy(), v, err_msg=msg)
                np.testing.assert_array_equal(tu.numpy(), u, err_msg=msg)


@pytest.mark.parametrize("mode", ["pure", "compiled"])
def test_both_paths_dgc_small_tensor_start_threshold(request, mode):
    """Tensors too small for the compiled pass to estimate its start threshold from an eighth of
    DGC's sample (it takes the whole sample then): the oracle's indices, u and v over steps."""
    request.getfixturevalue(mode)
    rng = np.random.default_rng(8)
    n = 20_011
    for k in (1, 3, 40):
        u, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
        tu, tv = torch.zeros(n), torch.zeros(n)
        for step in range(4):
            g = (rng.standard_t(3, n) * 0.1).astype(np.float32)
            u = u * np.float32(0.9) + g
            v = v + u
            want = np_select(v, k, 0.01, 4, step + 1)
            got = ds.accumulate_and_select(torch.from_numpy(g), tu, tv, 0.9, False, k, 0.01, 4, step + 1)
            np.testing.assert_array_equal(got.numpy(), want, err_msg=f"k={k} step {step}")
            np.testing.assert_array_equal(tv.numpy(), v)
            np.testing.assert_array_equal(tu.numpy(), u)
            ds.take_and_zero(tv, tu, got)
            v[want], u[want] = 0, 0
