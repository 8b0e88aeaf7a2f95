"""The TensorFlow compressors' two CPU branches against the numpy oracle, eagerly and in tf.function.

    compiled    the shared one-pass kernels (``hvdcompress.native``) through ``tf_ops.compressors.host``
                (``tf.numpy_function`` when traced; skipped without a compiler): what a CPU run takes
    pure        kernels off (``native.set_enabled(False)``): the TF ops, the branch GPU tensors take

Each runs simulated ranks for two steps (``local_world``) against ``hvdcompress.reference``:
payload bytes of every round, results and state bit for bit, executing eagerly (``eager``) and
traced once with the step as a tensor (``graph``), at sizes 0, 1, 7, a matrix, merged groups whose
members split bytes, buckets and columns, 1,000,003 entries (the kernels' full blocks and partial
ones), NaN and inf in the gradient, the momentum taken over from an optimizer. On the compiled
branch the tests also check that the kernels ran (and on the pure branch that they did not).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from hvdcompress import native, parse_spec
from hvdcompress.native.select import NATIVE_DIRECT_BELOW
from hvdcompress.reference import Member, simulate
from scenarios.local_world import run_lockstep
from test_paths import COLUMN_MEMBERS, QUANT, SKETCHES, _grads, _tie
from tf_ops.compressors import ExchangeContext, build_compressor, host

KEY = "layer.w"
PATHS = ["compiled", "pure"]
MODES = ["eager", "graph"]
SERVED = ("signsgd", "efsignsgd", "onebit", "terngrad", "qsgd", "dgc", "sketch")  # what the kernels serve


@pytest.fixture(params=PATHS)
def path(request):
    if request.param == "compiled" and native.lib() is None:
        pytest.skip("no C++ compiler: the compiled kernels are not built")
    native.set_enabled(request.param == "compiled")
    yield request.param
    native.set_enabled(True)


@pytest.fixture
def calls(monkeypatch):
    """Counts the host calls (each one a kernel call) the exchanges make."""
    seen = []
    real = host.call
    monkeypatch.setattr(host, "call", lambda fn, inputs, outputs: seen.append(fn) or real(fn, inputs, outputs))
    return seen


def _tap(gen, sink, clone):
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


def _same(got, want, label):
    np.testing.assert_array_equal(got, want, err_msg=label)  # NaN equals NaN at the same place


def served(text: str, shape=None) -> bool:
    spec = parse_spec(text)
    if spec.name == "topk":  # tensors of at least NATIVE_DIRECT_BELOW entries
        return shape is not None and int(np.prod(shape)) >= NATIVE_DIRECT_BELOW
    return spec.name in SERVED and not spec.params.get("share_scale")


def check(text, shape, mode, members=(), nonfinite=False, world=2, tie=False, steps=2, density=False):
    """Oracle vs TF for ``steps`` steps: every round's payload, the results, the state. With
    ``density`` (graph mode) the spec's ratio is passed as a tensor, as the Keras wrappers do."""
    spec = parse_spec(text)
    grads = _grads(text, shape, world, steps=steps, nonfinite=nonfinite, tie=tie)
    comp = build_compressor(spec)
    o_states = [{} for _ in range(world)]
    t_states = [comp.new_state(shape, tf.float32) for _ in range(world)]

    def one_step(step, *xs):
        sent = []
        d = tf.constant(spec["ratio"], tf.float64) if density else None
        gens = [_tap(comp.exchange(tf.reshape(x, [-1]), ExchangeContext(KEY, step, world, 1.0 / world, st, shape, 0, r,
                                                                        members, density=d)), sent, tf.identity)
                for r, (x, st) in enumerate(zip(xs, t_states))]
        results, _ = run_lockstep(gens)
        return results, sent

    fn = tf.function(one_step) if mode == "graph" else one_step
    for step, gs in enumerate(grads):
        want, _, want_sent = simulate(spec, gs, o_states, key=KEY, step=step, shape=shape, members=members)
        results, sent = fn(tf.constant(step, tf.int64) if mode == "graph" else step, *[tf.constant(g) for g in gs])
        for r in range(world):
            label = f"{text} {shape} {mode} step={step} rank={r}"
            assert len(sent[r]) == len(want_sent[r]), label
            for w_round, g_round in zip(want_sent[r], sent[r]):
                assert len(w_round) == len(g_round), label
                for w, g in zip(w_round, g_round):
                    g = g.numpy()
                    assert g.dtype == w.dtype and g.shape == w.shape, label
                    _same(g, w, label + " payload")
            _same(results[r].numpy(), want, label + " result")
            for name, arr in o_states[r].items():
                _same(t_states[r][name].numpy().reshape(arr.shape), arr, f"{label} state {name}")
    if mode == "graph":
        assert fn.experimental_get_tracing_count() == 1


def _kernels_ran(path, text, calls, shape=None):
    if path == "compiled" and served(text, shape):
        assert calls, f"{text}: the compiled branch did not call the kernels"
    elif path == "pure":
        assert not calls, f"{text}: the pure branch called the kernels"


# -- quantizers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, mode", [((0,), "eager"), ((1,), "eager"), ((7,), "eager"), ((37, 11), "eager"),
                                         ((7,), "graph"), ((37, 11), "graph")],
                         ids=["0-eager", "1-eager", "7-eager", "2d-eager", "7-graph", "2d-graph"])
@pytest.mark.parametrize("text", QUANT)
def test_quantizers_on_both_branches_are_the_oracle(path, calls, text, shape, mode):
    check(text, shape, mode)
    _kernels_ran(path, text, calls)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", ["signsgd", "efsignsgd", "onebit", "onebit:scope=tensor", "terngrad:residual=true",
                                  "qsgd:levels=127,bucket=512,residual=true", "qsgd:levels=20,bucket=9"])
def test_large_quantized_tensors_on_the_compiled_branch_are_the_oracle(calls, text, mode):
    """1,000,003 entries: the kernels' full blocks, a partial last block and byte."""
    if native.lib() is None:
        pytest.skip("no C++ compiler: the compiled kernels are not built")
    check(text, (1_000_003,), mode)
    _kernels_ran("compiled", text, calls)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", ["signsgd", "efsignsgd", "onebit", "onebit:scope=tensor", "terngrad:bucket=6",
                                  "qsgd:levels=5,bucket=10", "efsignsgd:momentum=0.9,nesterov=true"])
def test_quantized_merged_groups_on_both_branches_are_the_oracle(path, calls, text, mode):
    """Members of 13, 1 and 4110 entries: scales per member and bucket, codes across byte edges."""
    members = (Member("a", (13,), 0), Member("b", (1,), 13), Member("c", (3, 1370), 14))
    check(text, (1, 4124), mode, members=members)
    _kernels_ran(path, text, calls)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's NaN arithmetic in the oracle
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", ["signsgd", "efsignsgd", "onebit", "onebit:scope=tensor,momentum=0.9", "terngrad",
                                  "terngrad:bucket=4", "qsgd:bucket=8", "qsgd:levels=2,bucket=0,residual=true"])
def test_quantizers_with_nonfinite_inputs_on_both_branches_are_the_oracle(path, text, mode):
    check(text, (1003,), mode, nonfinite=True)


@pytest.mark.parametrize("shape", [(4, 3, 2), (5, 1), (1, 9), (130, 3), (20001,)], ids=str)
@pytest.mark.parametrize("text", ["onebit", "onebit:momentum=0.9,nesterov=true", "onebit:residual=false"])
def test_onebit_columns_on_both_branches_are_the_oracle(path, calls, text, shape):
    check(text, shape, "graph")
    _kernels_ran(path, text, calls)


def test_onebit_columns_in_merged_groups_on_both_branches_are_the_oracle(path):
    """Seven members (1-D ones, an empty one, matrices, a 3-D one) on three ranks, eager and traced."""
    for mode in MODES:
        check("onebit:momentum=0.9", (1, 13186), mode, members=COLUMN_MEMBERS, world=3)


@pytest.mark.parametrize("shape", [(20001,), (301, 7)], ids=str)
def test_onebit_column_sums_follow_the_oracles_order_on_both_branches(path, shape):
    """Sums whose float32 mean changes with the float64 order of summation (``test_paths._tie``)."""
    check("onebit", shape, "graph", tie=True)


def test_the_kernels_serve_tiling_members_and_one_round_only():
    """``hvdcompress.native.quant.codec``: no layout for members with gaps, nor for TernGrad's
    shared scale (two rounds); the backends then run their own ops."""
    from hvdcompress.native.quant import codec

    tiling = (Member("a", (5,), 0), Member("b", (3, 5), 5))
    gaps = (Member("a", (5,), 0), Member("b", (6,), 9))
    params = parse_spec("efsignsgd").params
    assert codec("efsignsgd", params, tiling, (1, 20), 20).part == 4 * 2 + 3
    assert codec("efsignsgd", params, gaps, (1, 20), 20) is None
    assert codec("onebit", parse_spec("onebit").params, gaps, (1, 20), 20) is None
    assert codec("terngrad", parse_spec("terngrad:share_scale=true").params, (), (20,), 20) is None
    assert codec("topk", parse_spec("topk:ratio=0.1").params, (), (20,), 20) is None


def test_the_switches_select_the_tf_ops(calls):
    """``set_enabled(False)`` and the torch-only switch (``HVDCOMPRESS_NATIVE=0`` at start) both
    run the TF ops; float64 gradients always do."""
    if native.lib() is None:
        pytest.skip("no C++ compiler: the compiled kernels are not built")
    x = tf.ones([8])
    assert host.kernels(x) is not None and host.kernels(tf.ones([8], tf.float64)) is None
    for switch in (native.set_enabled, lambda on: native.set_torch_only(not on)):
        switch(False)
        try:
            assert host.kernels(x) is None
            check("efsignsgd", (9,), "eager")
        finally:
            switch(True)
    assert not calls
    check("efsignsgd", (9,), "eager")
    assert calls


# -- DGC, top-k, the count sketch ------------------------------------------------------------------
DGC = ["dgc:ratio=0.01,warmup_epochs=0,min_sparse_numel=256",
       "dgc:ratio=0.02,nesterov=true,clip_norm=1.0,warmup_epochs=0,min_sparse_numel=256",
       "dgc:ratio=0.02,momentum_correction=false,warmup_epochs=0,min_sparse_numel=256",
       "dgc:ratio=0.05,momentum_masking=false,fp16_values=true,sample_ratio=0.05,warmup_epochs=0,min_sparse_numel=256"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(37, 11), (300, 407)], ids=str)
@pytest.mark.parametrize("text", DGC)
def test_dgc_on_both_branches_is_the_oracle(path, calls, text, shape, mode):
    """Momentum correction, Nesterov with clipping, no correction, no masking with fp16 values;
    a tensor whose list of candidates the compiled pass keeps (122,100 entries)."""
    check(text, shape, mode, steps=3)
    _kernels_ran(path, text, calls)


def test_dgc_with_the_density_as_a_tensor_on_both_branches_is_the_oracle(path, calls):
    check(DGC[0], (300, 407), "graph", density=True)
    _kernels_ran(path, DGC[0], calls)


TOPK = ["topk:ratio=0.001", "topk:ratio=0.01,residual=false", "topk:ratio=0.00001", "topk:ratio=1.0"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(7,), (300, 200), (100_003,)], ids=str)
@pytest.mark.parametrize("text", TOPK)
def test_topk_on_both_branches_is_the_oracle(path, calls, text, shape, mode):
    """Error feedback fused with the scan and without a residual; k = 1 and k = n at the edges;
    tensors below and above the compiled branch's size."""
    check(text, shape, mode)
    _kernels_ran(path, text, calls, shape)


def test_topk_with_the_density_as_a_tensor_on_both_branches_is_the_oracle(path, calls):
    check(TOPK[0], (100_003,), "graph", density=True)
    _kernels_ran(path, TOPK[0], calls, (100_003,))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(3001,), (67, 45)], ids=str)
@pytest.mark.parametrize("text", SKETCHES)
def test_sketches_on_both_branches_are_the_oracle(path, calls, text, shape, mode):
    check(text, shape, mode)
    _kernels_ran(path, text, calls)


def test_sketch_of_a_merged_group_across_hash_blocks_on_both_branches_is_the_oracle(path):
    members = (Member("a", (13,), 0), Member("b", (400, 170), 13), Member("c", (3001,), 68013))
    check("sketch:ratio=0.002,rows=5", (1, 71014), "graph", members=members)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's NaN arithmetic in the oracle
@pytest.mark.parametrize("text", ["sketch:ratio=0.01", DGC[0], "topk:ratio=0.001"])
def test_sparsifiers_with_nonfinite_inputs_on_the_compiled_branch_are_the_oracle(calls, text):
    if native.lib() is None:
        pytest.skip("no C++ compiler: the compiled kernels are not built")
    shape = (300, 200)
    check(text, shape, "graph", nonfinite=True)
    _kernels_ran("compiled", text, calls, shape)
