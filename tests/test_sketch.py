"""Sketched-SGD ("sketch"): the numpy oracle's properties, and PyTorch / TensorFlow against it.

Single process. The ranks are simulated: ``hvdcompress.reference.simulate`` for the oracle,
``local_world.run_lockstep`` for torch and TF (sums in rank order, as the oracle). On CPU every
implementation adds each sketch cell's entries in index order, so tables, candidates, selected
indices, results and state are compared bit for bit.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

from hvdcompress import hashing  # noqa: E402
from hvdcompress.reference import simulate  # noqa: E402
from hvdcompress.reference import sketch as ref  # noqa: E402
from hvdcompress.spec import Compression, CompressionSpec, parse_spec  # noqa: E402
from scenarios.local_world import run_lockstep  # noqa: E402
from tf_ops import compressors as tfc  # noqa: E402
from tf_ops.compressors import sketch as tf_sketch  # noqa: E402
from torch_ops import compressors as tc  # noqa: E402
from torch_ops.compressors import sketch as torch_sketch  # noqa: E402

KEY = "block.0.weight"
SPECS = ["sketch:ratio=0.01",
         "sketch:ratio=0.02,rows=4,cols_ratio=0.03,p2=2,momentum=0.5,seed=7",
         "sketch:k=9,rows=3,cols=80,p2=3,momentum=0.0,seed=123456789012,min_sketch_numel=16",
         "sketch:ratio=0.05,rows=1,cols_ratio=0.1,p2=1"]


def _grads(world, d, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(d) * rng.lognormal(0, 1.5, d)).astype(np.float32) for _ in range(world)]
            for _ in range(steps)]


# --- parameters -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, name", [
    ("sketch:rows=0", "rows"), ("sketch:rows=33", "rows"), ("sketch:p2=0", "p2"), ("sketch:ratio=0", "ratio"),
    ("sketch:ratio=1.5", "ratio"), ("sketch:k=0", "k"), ("sketch:k=2.5", "k"), ("sketch:cols=0", "cols"),
    ("sketch:cols_ratio=0", "cols_ratio"), ("sketch:momentum=1.0", "momentum"), ("sketch:momentum=-0.1", "momentum"),
    ("sketch:seed=-1", "seed"), ("sketch:min_sketch_numel=0", "min_sketch_numel"), ("sketch:rows=x", "rows"),
    ("sketch:cols=4294967296", "cols"), ("sketch:cols=1073741825", "cols")])
def test_bad_parameters_raise_naming_the_parameter(text, name):
    with pytest.raises(ValueError, match=f"sketch: parameter '{name}'"):
        parse_spec(text)


def test_unknown_parameter_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="unknown parameter 'colums'.*cols_ratio"):
        parse_spec("sketch:colums=3")


def test_defaults_and_factory():
    spec = Compression.sketch(k=100, cols=2000)
    assert spec.params == parse_spec("sketch:k=100,cols=2000").params
    p = parse_spec("sketch").params
    assert (p["ratio"], p["k"], p["rows"], p["cols"], p["cols_ratio"], p["p2"], p["momentum"], p["seed"],
            p["min_sketch_numel"]) == (0.01, None, 5, None, 0.02, 4, 0.9, 0, 1024)


def test_geometry_and_the_dense_rule():
    p = parse_spec("sketch").params
    g = ref.geometry(p, 1_000_000)
    assert (g.k, g.rows, g.cols, g.candidates, g.dense) == (10_000, 5, 20_000, 40_000, False)
    assert ref.geometry(p, 1023).dense  # under min_sketch_numel
    q = parse_spec("sketch:k=10,cols=100,min_sketch_numel=1").params
    assert ref.geometry(q, 540).dense and not ref.geometry(q, 541).dense  # 5*100 + 4*10 >= d
    assert ref.geometry(parse_spec("sketch:k=50").params, 2000).k == 50
    assert ref.geometry(parse_spec("sketch:k=5000,min_sketch_numel=1").params, 2000).k == 2000


def test_wire_rule_matches_what_the_oracle_sends():
    for text in SPECS + ["sketch"]:
        spec = parse_spec(text)
        for d in (10, 100, 600, 2000, 30_000):
            _, _, sent = simulate(spec, _grads(2, d, 1)[0], key=KEY)
            r1, r2 = spec.info.rounds(spec.params, np.array([d]))
            got = [sum(t.nbytes for t in rnd) for rnd in sent[0]]
            assert got[0] == r1.nbytes[0], (text, d)
            assert (got[1] if len(got) > 1 else 0) == r2.nbytes[0] and r2.collectives[0] == len(got) - 1
            g = ref.geometry(spec.params, d)
            assert len(got) == (1 if g.dense else 2)
            if not g.dense:
                assert got == [4 * g.rows * g.cols, 4 * g.candidates] and sum(got) < 4 * d


# --- hashing ----------------------------------------------------------------------------------
def test_hash_is_the_same_in_numpy_torch_and_tensorflow():
    """Signed cells y_j(i) over whole tensors (block by block, as the ports compute them) equal the
    definition HIGH[i >> 16] xor LOW[i & 0xFFFF] by gathers, in numpy, torch and TF."""
    for seed, key, cols, d in ((0, "a", 1, 10), (3, KEY, 1000, 200_001), (2**63 - 1, "x" * 50, hashing.MAX_COLS, 65_536),
                               (5, "é", 7, 131_073)):
        keys = hashing.row_keys(seed, key, 3)
        assert len(set(keys)) == 3
        idx = np.arange(d, dtype=np.int64)
        h = torch_sketch.Hashes(keys, d, cols, chunk=2 * hashing.BLOCK)
        for j, rk in enumerate(keys):
            y = hashing.cells(rk, d, cols)
            assert y.min() >= 0 and y.max() < 2 * cols
            x = hashing.hash32(idx, rk)
            low, high = hashing.tables(rk, d)
            assert np.array_equal(low[:50], [hashing.mix32(i ^ rk) for i in range(min(d, 50))])
            assert high[0] == hashing.mix32(hashing.high_key(rk))
            assert np.array_equal(y, (((x * hashing.C3) & hashing.M32) * (2 * cols)) >> 32)
            b, s = hashing.bucket_sign(idx, rk, cols)
            assert np.array_equal(b, y >> 1) and np.array_equal(s, np.where(y % 2 == 0, 1.0, -1.0))
            got = np.concatenate([h.cells(j, b0, b1, stop - start).numpy().copy()
                                  for start, stop, b0, b1 in h.chunks()])
            assert np.array_equal(got, y)
            assert np.array_equal(tf_sketch.cells(rk, d, cols).numpy(), y)
        far = np.array([0, 65_535, 65_536, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5], np.int64)
        fb, fs = tf_sketch.bucket_sign(tf.constant(far), keys[0], cols, tf.float32)
        nb, ns = hashing.bucket_sign(far, keys[0], cols)
        assert np.array_equal(fb.numpy(), nb) and np.array_equal(fs.numpy(), ns)
    with pytest.raises(ValueError, match="cols"):
        hashing.cells(keys[0], 10, hashing.MAX_COLS + 1)


def test_hashes_are_spread_and_rows_keys_differ():
    idx = np.arange(200_000, dtype=np.int64)  # spans 4 blocks of the tabulation
    b0, s0 = hashing.bucket_sign(idx, hashing.row_key(0, KEY, 0), 100)
    b1, _ = hashing.bucket_sign(idx, hashing.row_key(0, KEY, 1), 100)
    b2, _ = hashing.bucket_sign(idx, hashing.row_key(0, "other", 0), 100)
    b3, _ = hashing.bucket_sign(idx, hashing.row_key(1, KEY, 0), 100)
    counts = np.bincount(b0, minlength=100)
    assert counts.min() > 1800 and counts.max() < 2200  # 2000 expected per bucket
    assert abs(s0.mean()) < 0.01
    for other in (b1, b2, b3):
        assert np.mean(other == b0) < 0.015  # independent rows/keys/seeds collide ~1/100
    # pairs of indices (neighbours; the same offset in two blocks, where plain tabulation would map
    # one block onto the other by a fixed permutation): buckets collide ~1/c, signs agree ~1/2
    idx = np.arange(8 * hashing.BLOCK, dtype=np.int64)
    for cols in (100, 128):
        b, s = hashing.bucket_sign(idx, hashing.row_key(2, KEY, 0), cols)
        for shift in (1, hashing.BLOCK, 3 * hashing.BLOCK):
            assert abs(np.mean(b[:-shift] == b[shift:]) * cols - 1) < 0.15, (cols, shift)
            assert abs(np.mean(s[:-shift] == s[shift:]) - 0.5) < 0.01, (cols, shift)
    # sign and bucket are independent: each bucket's signs are balanced
    per_bucket = np.bincount(b0, weights=s0, minlength=100) / counts
    assert np.abs(per_bucket).max() < 0.1


# --- oracle properties ------------------------------------------------------------------------
def test_the_sketch_is_linear():
    rng = np.random.default_rng(0)
    keys = hashing.row_keys(0, KEY, 5)
    a, b = rng.standard_normal((2, 50_000)).astype(np.float32)
    sa, sb, sab = (ref.sketch_table(x, keys, 700) for x in (a, b, a + b))
    np.testing.assert_allclose(sa + sb, sab, rtol=0, atol=1e-4)
    ia, ib = rng.integers(-1000, 1000, (2, 50_000)).astype(np.float32)  # integers: exact
    assert np.array_equal(ref.sketch_table(ia, keys, 700) + ref.sketch_table(ib, keys, 700),
                          ref.sketch_table(ia + ib, keys, 700))


def test_estimates_are_exact_without_collisions_and_median_is_the_lower_one():
    keys = hashing.row_keys(0, KEY, 4)
    v = np.zeros(5000, np.float32)
    v[[7, 4000]] = [3.0, -5.0]
    est = ref.estimates(ref.sketch_table(v, keys, 1000), keys, v.size)
    assert est[7] == 3.0 and est[4000] == -5.0
    assert np.array_equal(ref.lower_median(np.array([[4.0, 1], [1, 2], [3, 3], [2, 9]], np.float32)), [2.0, 2.0])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_planted_heavy_hitters_are_recovered(world):
    rng = np.random.default_rng(world)
    d, k = 100_000, 50
    heavy = np.sort(rng.choice(d, k, replace=False))
    spec = parse_spec(f"sketch:k={k},momentum=0.0,cols=2000")
    signs = np.where(rng.random(k) < 0.5, -1, 1)  # the same direction on every rank
    grads = []
    for _ in range(world):
        g = (0.01 * rng.standard_normal(d)).astype(np.float32)
        g[heavy] += signs * (5 + rng.random(k)).astype(np.float32)
        grads.append(g)
    states = [{} for _ in range(world)]
    total, states, sent = simulate(spec, grads, states, key=KEY)
    assert np.array_equal(np.flatnonzero(total), heavy)
    want = np.sum(np.stack(grads), axis=0, dtype=np.float32)[heavy] / world
    np.testing.assert_allclose(total[heavy], want, rtol=1e-5)
    for st in states:  # selected coordinates zeroed, the rest kept
        assert not st["v"][heavy].any() and not st["u"][heavy].any() and st["v"].any()
    assert sum(t.nbytes for rnd in sent[0] for t in rnd) == 4 * (5 * 2000 + 4 * k)


def test_nothing_is_lost_error_accumulates_until_sent():
    """With momentum 0: what was applied plus what every rank still holds in v is the sum of all
    gradients (up to float rounding)."""
    spec = parse_spec("sketch:ratio=0.01,momentum=0.0,min_sketch_numel=1")
    world, d = 2, 5000
    steps = _grads(world, d, 6, seed=3)
    states = [{} for _ in range(world)]
    applied = np.zeros(d, np.float64)
    for grads in steps:
        total, states, _ = simulate(spec, grads, states, key=KEY, scale=1.0)
        applied += total
    held = sum(st["v"].astype(np.float64) for st in states)
    np.testing.assert_allclose(applied + held, np.sum([g for s in steps for g in s], axis=0, dtype=np.float64),
                               atol=1e-3)


def test_tiny_tensors_are_sent_dense_as_momentum_sgd():
    spec = parse_spec("sketch:momentum=0.5")
    grads = [np.arange(10, dtype=np.float32), np.ones(10, np.float32)]
    states = [{}, {}]
    total, states, sent = simulate(spec, grads, states, key="b", shape=(10,))
    np.testing.assert_array_equal(total, (grads[0] + grads[1]) / 2)
    assert [[t.size for t in rnd] for rnd in sent[0]] == [[10]]
    total2, states, _ = simulate(spec, grads, states, key="b", shape=(10,))
    np.testing.assert_array_equal(total2, (grads[0] * np.float32(1.5) + grads[1] * np.float32(1.5)) / 2)
    assert not states[0]["v"].any()


# --- PyTorch and TensorFlow against the oracle -------------------------------------------------
def _oracle_run(spec, steps, shape):
    world = len(steps[0])
    states = [{} for _ in range(world)]
    for step, grads in enumerate(steps):
        total, states, sent = simulate(spec, grads, states, key=KEY, step=step, shape=shape)
        yield total, [{k: v.copy() for k, v in st.items()} for st in states], sent


def _torch_run(spec, steps, shape):
    comp = tc.build_compressor(spec)
    world = len(steps[0])
    states = [{} for _ in range(world)]
    for step, grads in enumerate(steps):
        gens = [comp.exchange(torch.from_numpy(g.copy()), tc.ExchangeContext(KEY, step, world, 1.0 / world, st, shape))
                for g, st in zip(grads, states)]
        results, sent = run_lockstep(gens)
        yield [r.numpy() for r in results], [{k: v.numpy().copy() for k, v in st.items()} for st in states], sent


def _tf_run(spec, steps, shape, graph):
    comp = tfc.build_compressor(spec)
    world = len(steps[0])
    states = [comp.new_state(shape, tf.float32) for _ in range(world)]

    def exchange(grads, step):
        return run_lockstep([comp.exchange(g, tfc.ExchangeContext(KEY, step, world, 1.0 / world, st, shape))
                             for g, st in zip(grads, states)])

    fn = tf.function(exchange) if graph else exchange
    for step, grads in enumerate(steps):
        results, sent = fn([tf.constant(g) for g in grads], tf.constant(step, tf.int64) if graph else step)
        yield [r.numpy() for r in results], [{k: v.numpy() for k, v in st.items()} for st in states], sent
    if graph:
        assert fn.experimental_get_tracing_count() == 1


def _compare(want_iter, got_iter, label):
    for step, ((total, states, sent), (results, got_states, got_sent)) in enumerate(zip(want_iter, got_iter)):
        for r, res in enumerate(results):
            np.testing.assert_array_equal(res, total, err_msg=f"{label} step {step} rank {r}")
            for name in ("u", "v"):
                want = states[r].get(name, np.zeros_like(total))
                np.testing.assert_array_equal(got_states[r][name], want, err_msg=f"{label} {name} step {step} rank {r}")
            assert int(got_sent[r]) == sum(t.nbytes for rnd in sent[r] for t in rnd)


@pytest.mark.parametrize("shape", [(60, 100), (3000,), (20,)], ids=["2d", "1d", "tiny"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("text", SPECS)
def test_torch_matches_the_oracle_bit_for_bit(text, world, shape):
    spec = parse_spec(text)
    steps = _grads(world, int(np.prod(shape)), 4, seed=world)
    _compare(_oracle_run(spec, steps, shape), _torch_run(spec, steps, shape), f"torch {text} world={world}")


# Tracing the sketch costs seconds per case: every case runs eagerly, and through tf.function on
# 3 ranks (the odd world); the other tf.function cases are in the extended tier.
_TF_CASES = [pytest.param(text, world, graph, id=f"{text}-{world}-{'tf.function' if graph else 'eager'}",
                          marks=[pytest.mark.extended] if graph and world != 3 else [])
             for text in SPECS for world in (1, 2, 3) for graph in (False, True)]


@pytest.mark.parametrize("text, world, graph", _TF_CASES)
def test_tensorflow_matches_the_oracle_bit_for_bit(text, world, graph):
    spec, shape = parse_spec(text), (60, 100)
    steps = _grads(world, 6000, 3, seed=world)
    _compare(_oracle_run(spec, steps, shape), _tf_run(spec, steps, shape, graph), f"tf {text} world={world}")


def test_tensorflow_dense_path_matches_the_oracle():
    spec, shape = parse_spec(SPECS[0]), (20,)
    steps = _grads(2, 20, 3)
    for graph in (False, True):
        _compare(_oracle_run(spec, steps, shape), _tf_run(spec, steps, shape, graph), f"tf dense graph={graph}")


def test_tables_and_estimates_agree_across_chunks_and_frameworks():
    """The torch port hashes in chunks of whole 65536-entry blocks; chunk boundaries (and the
    number of threads) must not change a bit."""
    rng = np.random.default_rng(5)
    d = 3 * hashing.BLOCK + 1001
    v = (rng.standard_normal(d) * rng.lognormal(0, 2, d)).astype(np.float32)
    keys = hashing.row_keys(11, KEY, 5)
    table = ref.sketch_table(v, keys, 997)
    est = ref.estimates(table, keys, v.size)
    threads = torch.get_num_threads()
    try:
        for chunk, nthreads in ((1, 1), (2 * hashing.BLOCK, 2), (torch_sketch.CHUNK, 1), (1 << 22, 2)):
            torch.set_num_threads(nthreads)
            t = torch_sketch.sketch_table(torch.from_numpy(v), keys, 997, chunk=chunk)
            assert np.array_equal(t.numpy(), table), chunk
            e = torch_sketch.estimates(torch.from_numpy(table), keys, v.size, chunk=chunk)
            assert np.array_equal(np.abs(e.numpy()), np.abs(est)), chunk
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(tf_sketch.sketch_table(tf.constant(v), keys, 997).numpy(), table)
    assert np.array_equal(np.abs(tf_sketch.estimates(tf.constant(table), keys, v.size).numpy()), np.abs(est))


def test_merged_group_is_sketched_as_one_vector():
    """ELEMENTWISE merge: a group's state is its members' state joined; the group is sketched as
    one vector (its own k, c, and hashes of the group key), not member by member."""
    spec = parse_spec("sketch:ratio=0.02,min_sketch_numel=1")
    assert spec.info.merge == "elementwise"
    grads = _grads(2, 3000, 1)[0]
    from hvdcompress.reference import Member
    members = (Member("a", (1000,), 0), Member("b", (2000,), 1000))
    merged, _, _ = simulate(spec, grads, key="group", shape=(3000,), members=members)
    flat, _, _ = simulate(spec, grads, key="group", shape=(3000,))
    assert np.array_equal(merged, flat) and np.count_nonzero(merged) == 60


# --- the optimizer hooks ----------------------------------------------------------------------
def test_torch_takes_the_sgd_momentum_over():
    spec = parse_spec("sketch")
    groups = [{"momentum": 0.8, "nesterov": False}, {"momentum": 0.8}]
    with pytest.warns(UserWarning, match="taking over"):
        out = tc.compressor_class(spec).adapt_optimizer(spec, groups)
    assert out["momentum"] == 0.8 and all(g["momentum"] == 0.0 for g in groups)
    assert tc.compressor_class(spec).adapt_optimizer(spec, [{"momentum": 0.0}]) is spec
    with pytest.raises(ValueError, match="Nesterov"):
        tc.compressor_class(spec).adapt_optimizer(spec, [{"momentum": 0.9, "nesterov": True}])
    with pytest.raises(ValueError, match="different momenta"):
        tc.compressor_class(spec).adapt_optimizer(spec, [{"momentum": 0.9}, {"momentum": 0.5}])


def test_tensorflow_takes_the_sgd_momentum_over():
    spec = parse_spec("sketch")
    new, config = tfc.compressor_class(spec).adapt_optimizer(spec, {"momentum": 0.9, "nesterov": False})
    assert new["momentum"] == 0.9 and config["momentum"] == 0.0
    assert tfc.compressor_class(spec).adapt_optimizer(spec, {"momentum": 0.0})[0] is spec
    with pytest.raises(ValueError, match="Nesterov"):
        tfc.compressor_class(spec).adapt_optimizer(spec, {"momentum": 0.9, "nesterov": True})
    comp = tfc.build_compressor(spec)
    assert comp.state_slots((10, 10)) == ("u", "v") and not comp.has_density and comp.stateful


def test_spec_round_trips():
    spec = parse_spec("sketch:k=12,cols=300,seed=4")
    assert CompressionSpec.from_dict(spec.to_dict()) == spec == parse_spec(str(spec))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13])
def test_sorting_network_median_equals_the_oracle(rows):
    rng = np.random.default_rng(rows)
    x = np.round(rng.standard_normal((rows, 5000)), 1).astype(np.float32)  # many ties
    want = ref.lower_median(x)
    got_torch = torch_sketch.lower_median_rows(torch.from_numpy(x.copy()), torch.empty(5000))
    got_tf = tf_sketch.lower_median([tf.constant(r) for r in x])
    np.testing.assert_array_equal(np.abs(got_torch.numpy()), np.abs(want))
    np.testing.assert_array_equal(np.abs(got_tf.numpy()), np.abs(want))


# --- the compiled kernels at the numpy level ------------------------------------------------------
def _kernels(keys, d, cols):
    from hvdcompress import native
    from hvdcompress.native.sketch import Kernels

    lib = native.lib()
    if lib is None:
        pytest.skip("no C++ compiler: the compiled kernels are not built")
    return Kernels(lib, keys, d, cols)


def _vector(rng, d, kind):
    v = (rng.standard_normal(d) * rng.lognormal(0, 1.5, d)).astype(np.float32)
    if kind == "ties":  # many equal values, so many equal estimates at the boundary
        v = np.round(v).astype(np.float32)
    elif kind == "sparse":  # mostly zeros
        v[rng.random(d) < 0.97] = 0
    elif kind == "nonfinite":
        v[rng.choice(d, 40, replace=False)] = np.nan
        v[rng.choice(d, 20, replace=False)] = np.inf
        v[rng.choice(d, 20, replace=False)] = -np.inf
    return v


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's NaN arithmetic in the oracle
@pytest.mark.parametrize("rows, cols, kind", [
    (5, 2000, "plain"), (5, 150_000, "plain"),  # a row's cells past the kernels' row group: a sweep per row
    (3, 700, "ties"), (4, 1500, "plain"), (1, 900, "plain"), (2, 3000, "sparse"), (7, 1200, "nonfinite"),
    (5, 2500, "nonfinite"), (6, 40_000, "ties")])
def test_kernels_table_and_candidates_are_the_oracle(rows, cols, kind):
    """``update_sketch`` (in place and into other buffers) gives the oracle's state and table, and
    ``candidates`` (a threshold from a sample, a bitmask of the cells, the estimates of the few that
    pass) the oracle's top P*k of the estimates, over several hash blocks and every fallback."""
    rng = np.random.default_rng(rows * 1000 + cols)
    d = 2 * hashing.BLOCK + 4099
    keys = hashing.row_keys(3, KEY, rows)
    kern = _kernels(keys, d, cols)
    g, u0, v0 = _vector(rng, d, kind), _vector(rng, d, "plain"), _vector(rng, d, kind)
    m = np.float32(0.9)
    u_want = u0 * m + g
    v_want = v0 + u_want
    table_want = ref.sketch_table(v_want, keys, cols)
    est = ref.estimates(table_want, keys, d)
    a = lambda x: x.ctypes.data  # noqa: E731
    u, v, table = u0.copy(), v0.copy(), np.empty(rows * cols, np.float32)
    kern.update_sketch(a(g), a(u), a(v), float(m), a(table))
    u2, v2, table2 = np.empty(d, np.float32), np.empty(d, np.float32), np.empty(rows * cols, np.float32)
    kern.update_sketch(a(g), a(u2), a(v2), float(m), a(table2), a(u0), a(v0))
    for got in ((u, v, table), (u2, v2, table2)):
        np.testing.assert_array_equal(got[0], u_want)
        np.testing.assert_array_equal(got[1], v_want)
        np.testing.assert_array_equal(got[2].reshape(rows, cols), table_want)
    table_want = np.ascontiguousarray(table_want)
    for count in (2, 17, 560, 4000, d // 8, d - 1):
        got = kern.candidates(a(table_want), count)
        np.testing.assert_array_equal(got, ref.topk_indices(est, count), err_msg=f"count={count}")


@pytest.mark.parametrize("rows, t", [(5, 1.0), (5, 3.5), (5, 40.0), (4, 20.0), (3, 12.0)])
def test_kernels_entries_above_a_threshold_are_every_such_entry(rows, t):
    """``estimates_ge``: exactly the entries with |estimate| >= t, ascending, with their |estimate|
    (also when the list outgrows the first buffer), or None when a quarter of the cells pass."""
    rng = np.random.default_rng(int(t * 10))
    d, cols = hashing.BLOCK + 777, 3000
    keys = hashing.row_keys(9, KEY, rows)
    kern = _kernels(keys, d, cols)
    table = np.ascontiguousarray(ref.sketch_table(_vector(rng, d, "plain"), keys, cols))
    est = np.abs(ref.estimates(table, keys, d))
    want = np.flatnonzero(est >= np.float32(t))
    found = kern.estimates_ge(table.ctypes.data, t, 8)
    assert (found is None) == (np.count_nonzero(np.abs(table) >= np.float32(t)) * 4 > rows * 2 * cols)
    if found is not None:
        np.testing.assert_array_equal(found[0], want)
        np.testing.assert_array_equal(found[1], est[want])
    sample = kern.estimates_abs_at(table.ctypes.data, 5, 97, (d - 6) // 97 + 1)
    np.testing.assert_array_equal(sample, est[5::97])


# --- parameter dtypes narrower than float32 ------------------------------------------------------
_NP_DTYPES = {"float16": np.float16, "bfloat16": tf.bfloat16.as_numpy_dtype, "float64": np.float64}
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@pytest.mark.parametrize("dtype", sorted(_NP_DTYPES))
def test_torch_table_rounds_every_addition_in_the_tensor_dtype(dtype):
    """A cell's partial sums are rounded to the dtype after every addition, as the oracle's
    ``np.add.at`` (and TF's segment sum) round them; a cell accumulated in float32 and rounded once
    is a different table where many equal values share a cell."""
    v = np.full(154, 1.1, np.float32)
    v[[3, 40, 77, 120]] = [-7.5, 1000.0, 0.3, -2.25]
    x = v.astype(_NP_DTYPES[dtype])
    keys = hashing.row_keys(0, KEY, 5)
    want = ref.sketch_table(x, keys, 8)
    got = torch_sketch.sketch_table(torch.from_numpy(x.astype(np.float32)).to(_TORCH_DTYPES[dtype]), keys, 8)
    np.testing.assert_array_equal(got.to(torch.float64).numpy(), want.astype(np.float64))


def _filled(fill, at):
    """154 entries equal to ``fill`` but at the positions of ``at`` (a dict position -> value)."""
    g = np.full(154, fill, np.float32)
    g[list(at)] = list(at.values())
    return g


def test_bfloat16_ties_select_the_oracles_entries_in_torch_and_tensorflow():
    """A bfloat16 gradient that is mostly one huge repeated value: sketch cells collect many
    equal entries and the estimates tie, so a table that rounds differently from the oracle's
    selects other entries. Torch and TF must select the oracle's (run in bfloat16)."""
    spec, shape, bf16 = parse_spec("sketch:ratio=0.05,min_sketch_numel=1"), (11, 14), _NP_DTYPES["bfloat16"]
    key = "layer.w"  # the hashes that put these entries in the same cells
    big = 1.0002555517425873e30
    steps = [[_filled(8.715097876569077e29, {42: -big, 89: 0.0, 100: 0.0, 117: 0.0, 140: 0.0, 116: 9.968061931431293e-10,
                                             47: 0.5, 108: 998244352.0, 141: 1.9421773393035264e16,
                                             49: 4.67248461339689e16}),
              _filled(-1.0, {1: -6.93246421999813e29, 26: 0.0, 136: 1.0, 140: 9.061721087568984e29})],
             [_filled(-6.473924464345088e16, {127: -1.9064276604994856e29, 101: -1680053767241728.0, 79: 0.0,
                                              100: 0.0, 103: 0.0, 109: 1.0, 26: 1.829587348619264e16,
                                              84: 3.0680772461461504e16, 31: 5.910974510923776e16, 9: big}),
              _filled(1.0, {9: -big, 106: -big, 130: -1.2750782404639417e29, 120: -4.797017652230849e28,
                            140: -1.0030417090079569e20, 49: -4.756927106410086e16, 75: -1.0625680370827264e16,
                            135: -7916483719987200.0, 100: -1.0, 38: -0.5, 88: -0.5, 113: -0.333984375, 11: 0.0,
                            33: 0.0, 90: 0.0, 144: 0.0, 50: 0.5, 79: 0.5, 127: 0.5, 47: 1.9984723346456576e16,
                            107: 4.362862139015168e16, 128: 4.644337115725824e16, 67: 8.36847466556917e29,
                            1: big, 55: big})]]
    steps = [[g.astype(bf16).astype(np.float32) for g in s] for s in steps]  # values bfloat16 holds
    th, tf_ = tc.build_compressor(spec), tfc.build_compressor(spec)
    states = [{}, {}]
    th_states = [{}, {}]
    tf_states = [tf_.new_state(shape, tf.bfloat16) for _ in range(2)]
    for step, grads in enumerate(steps):
        want, states, _ = simulate(spec, [g.astype(bf16) for g in grads], states, key=key, step=step,
                                   scale=bf16(0.5), shape=shape)
        want = np.asarray(want, np.float64)
        got_th, _ = run_lockstep([th.exchange(torch.from_numpy(g).to(torch.bfloat16),
                                              tc.ExchangeContext(key, step, 2, 0.5, st, shape))
                                  for g, st in zip(grads, th_states)])
        got_tf, _ = run_lockstep([tf_.exchange(tf.cast(tf.constant(g), tf.bfloat16),
                                               tfc.ExchangeContext(key, step, 2, 0.5, st, shape))
                                  for g, st in zip(grads, tf_states)])
        assert np.count_nonzero(want) == 8
        for r in range(2):
            np.testing.assert_array_equal(got_th[r].to(torch.float64).numpy(), want, err_msg=f"torch step {step}")
            np.testing.assert_array_equal(tf.cast(got_tf[r], tf.float64).numpy(), want, err_msg=f"tf step {step}")
