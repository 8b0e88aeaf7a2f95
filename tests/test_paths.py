"""Every compressor's three CPU branches against the numpy oracle, single process.

    compiled    the one-pass C++ kernels (``torch_ops/compressors/native.py``; skipped without a
                compiler), numpy views where a path has them: what a CPU run takes
    pure        kernels off (``native.set_enabled(False)``), numpy views kept
    torch       the torch-only branch (``native.set_torch_only(True)``): no kernel and no numpy
                view of a tensor, the branch CUDA tensors take

Each runs two simulated ranks for two steps (``local_world``) against ``hvdcompress.reference``:
payload bytes of every round, results and state bit for bit (PowerSGD's matmuls within a tight
tolerance), at sizes 0, 1, 7, a merged group whose members split bytes and buckets, and
1,000,003 entries for the quantizers on the compiled branch (every branch with
``-m extended``). Non-finite inputs: the
quantizers' payloads and results match the oracle's with NaN and inf in the gradient (the
optimizer's guard then makes the step NaN; what a compressor sends must still be the oracle's).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from hvdcompress import parse_spec
from hvdcompress.reference import Member, simulate
from scenarios.local_world import run_lockstep
from torch_ops.compressors import ExchangeContext, build_compressor, native

KEY = "layer.w"
QUANT = ["signsgd", "efsignsgd", "efsignsgd:residual=false", "onebit", "onebit:scope=tensor", "terngrad", "terngrad:bucket=7,seed=3",
         "terngrad:residual=true", "terngrad:share_scale=true", "qsgd", "qsgd:levels=1,bucket=0",
         "qsgd:levels=3,bucket=5,seed=11", "qsgd:levels=127,bucket=512,residual=true", "qsgd:levels=20,bucket=9",
         "efsignsgd:momentum=0.9", "onebit:scope=tensor,momentum=0.9,nesterov=true"]
OTHERS = ["none", "fp16", "bf16:residual=true", "topk:ratio=0.01", "topk:ratio=0.3,residual=false",
          "randomk:ratio=0.05,seed=3", "threshold:threshold=0.5", "dgc:ratio=0.01", "sketch:ratio=0.01",
          "powersgd:rank=2"]
PATHS = ["compiled", "pure", "torch"]


@pytest.fixture(params=PATHS)
def path(request):
    if request.param == "compiled" and native.lib() is None:
        pytest.skip("no C++ compiler: the compiled kernels are not built")
    native.set_enabled(request.param == "compiled")
    native.set_torch_only(request.param == "torch")
    yield request.param
    native.set_enabled(True)
    native.set_torch_only(False)


def _grads(text, shape, world=2, steps=2, nonfinite=False, tie=False):
    g = np.random.default_rng(zlib.crc32(f"{text}|{shape}".encode()))
    out = []
    for _ in range(steps):
        if tie:
            step = [_tie(shape, g) for _ in range(world)]
        else:
            step = [np.round(g.standard_t(3, size=shape), 3).astype(np.float32) for _ in range(world)]
        flat = step[0].reshape(-1)
        flat[:3] = 0.0
        if nonfinite and flat.size > 9:
            flat[[4, 7]] = np.nan
            flat[8] = np.inf
            step[1].reshape(-1)[-1] = -np.inf
        out.append(step)
    return out


def _tie(shape, g):
    """Columns whose float32 mean depends on the float64 order of summation: 1 and 2**-24 (a tie
    in float32) among entries of 2**-54 (a quarter of 1's float64 spacing, lost one by one, kept
    when several are added first); every 8,192 entries of a single column repeat the pattern;
    signs flip by column (the negative part's sum), a few entries shuffled by the seed."""
    flat = np.full(int(np.prod(shape)), 2.0 ** -54)
    rows = shape[0] if len(shape) >= 2 else flat.size
    a = flat.reshape(rows, -1)
    for r0 in range(0, rows, 8192):
        a[r0] = 1.0
        if r0 + 1 < rows:
            a[r0 + 1] = 2.0 ** -24
    a[:, 1::2] *= -1.0
    if rows > 20:
        a[g.integers(2, rows, 3)] = 2.0 ** -24
    return flat.astype(np.float32).reshape(shape)


def _tap(gen, sink):
    rounds = []
    sink.append(rounds)
    reqs = next(gen)
    while True:
        rounds.append([r.tensor.clone().numpy() for r in reqs])
        result = yield reqs
        try:
            reqs = gen.send(result)
        except StopIteration as stop:
            return stop.value


def _same(got, want, label, tol):
    if tol and got.dtype != np.uint8:
        scale = max(1.0, float(np.nanmax(np.abs(want)))) if want.size else 1.0
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=label)
    else:  # NaN equals NaN at the same place
        np.testing.assert_array_equal(got, want, err_msg=label)


def check(text, shape, members=(), nonfinite=False, world=2, tol=0.0, tie=False):
    spec = parse_spec(text)
    steps = _grads(text, shape, world, nonfinite=nonfinite, tie=tie)
    comp = build_compressor(spec)
    o_states = [{} for _ in range(world)]
    t_states = [{} for _ in range(world)]
    for step, grads in enumerate(steps):
        want, _, want_sent = simulate(spec, grads, o_states, key=KEY, step=step, shape=shape, members=members)
        sent = []
        gens = [_tap(comp.exchange(torch.from_numpy(g.reshape(-1).copy()),
                                   ExchangeContext(KEY, step, world, 1.0 / world, st, shape, 0, r, members)), sent)
                for r, (g, st) in enumerate(zip(grads, t_states))]
        results, _ = run_lockstep(gens)
        for r in range(world):
            label = f"{text} {shape} step={step} rank={r}"
            assert len(sent[r]) == len(want_sent[r]), label
            for w_round, g_round in zip(want_sent[r], sent[r]):
                assert len(w_round) == len(g_round), label
                for w, g in zip(w_round, g_round):
                    assert g.dtype == w.dtype and g.shape == w.shape, label
                    _same(g, w, label + " payload", tol)
            _same(results[r].numpy(), want, label + " result", tol)
            for name, arr in o_states[r].items():
                _same(t_states[r][name].numpy().reshape(arr.shape), arr, f"{label} state {name}", tol)


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (37, 11)], ids=["0", "1", "7", "2d"])
@pytest.mark.parametrize("text", QUANT + OTHERS)
def test_every_compressor_on_every_branch_is_the_oracle(path, text, shape):
    check(text, shape, tol=1e-6 if text.startswith("powersgd") else 0.0)


LARGE = ["signsgd", "efsignsgd", "onebit", "terngrad:residual=true", "qsgd:levels=127,bucket=512,residual=true",
         "qsgd:levels=20,bucket=9"]


@pytest.mark.parametrize("text", LARGE)
def test_large_tensors_on_the_compiled_branch_are_the_oracle(text):
    """1,000,003 entries: the kernels' full blocks, a partial last block and byte."""
    if native.lib() is None:
        pytest.skip("no C++ compiler: the compiled kernels are not built")
    check(text, (1_000_003,))


@pytest.mark.extended
@pytest.mark.parametrize("text", QUANT + ["topk:ratio=0.001", "dgc:ratio=0.001"])
def test_large_tensors_on_every_branch_are_the_oracle(path, text):
    check(text, (1_000_003,))


@pytest.mark.parametrize("text", ["signsgd", "efsignsgd", "onebit", "terngrad:bucket=6", "qsgd:levels=5,bucket=10"])
def test_merged_groups_on_every_branch_are_the_oracle(path, text):
    """Members of 13, 1 and 4110 entries: scales per member and bucket, codes across byte edges."""
    members = (Member("a", (13,), 0), Member("b", (1,), 13), Member("c", (3, 1370), 14))
    check(text, (4124,), members=members)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's NaN arithmetic in the oracle
@pytest.mark.parametrize("text", ["signsgd", "efsignsgd", "onebit", "onebit:scope=tensor,momentum=0.9", "terngrad", "terngrad:bucket=4", "qsgd:bucket=8",
                                  "qsgd:levels=2,bucket=0,residual=true"])
def test_nonfinite_inputs_on_every_branch_are_the_oracle(path, text):
    check(text, (1003,), nonfinite=True)


def test_torch_only_switch_takes_neither_kernels_nor_numpy():
    from torch_ops.compressors import cpu_selection
    x = torch.ones(10)
    native.set_torch_only(True)
    try:
        assert native.lib() is None and cpu_selection.numpy_view(x) is None
    finally:
        native.set_torch_only(False)
    assert cpu_selection.numpy_view(x) is not None


# -- 1-bit SGD per column (the default scope): the compiled kernel's shapes and summation order ----
COLUMN_MEMBERS = (Member("a", (13,), 0), Member("b", (1,), 13), Member("e", (0, 5), 14), Member("c", (3, 1370), 14),
                  Member("d", (9000,), 4124), Member("f", (5, 4, 3), 13124), Member("g", (2, 1), 13184))


@pytest.mark.parametrize("shape", [(4, 3, 2), (5, 1), (1, 9), (130, 3), (20001,)], ids=str)
@pytest.mark.parametrize("text", ["onebit", "onebit:momentum=0.9,nesterov=true", "onebit:residual=false"])
def test_onebit_columns_on_every_branch_are_the_oracle(path, text, shape):
    """Odd shapes (a column of one row, a row, a single column past numpy's 8,192-entry chunk),
    with the momentum taken over from the optimizer and without error feedback."""
    check(text, shape)


def test_onebit_columns_in_merged_groups_on_every_branch_are_the_oracle(path):
    """Seven members: 1-D ones (one column each, one past 8,192 entries), an empty one, a matrix
    of 1,370 columns, a 3-D one (12 columns) and a (2, 1) one; the rank order of the sum."""
    check("onebit:momentum=0.9", (13186,), members=COLUMN_MEMBERS, world=3)


@pytest.mark.parametrize("shape", [(20001,), (16,), (301, 7), (16, 5)], ids=str)
def test_onebit_column_sums_follow_the_oracles_order_on_the_compiled_branch(shape):
    """Sums whose float32 mean changes with the float64 order (``_tie``): the kernel adds a
    matrix's rows in turn and a single column pairwise in chunks of 8,192, as numpy does."""
    if native.lib() is None:
        pytest.skip("no C++ compiler: the compiled kernels are not built")
    col = _tie(shape, np.random.default_rng(0)).astype(np.float64).reshape(shape[0], -1)[:, 0]
    assert sum(col.tolist()) != np.sum(col)  # the order of summation matters for this data
    check("onebit:residual=false", shape, tie=True)
    check("onebit", shape, tie=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's NaN arithmetic in the oracle
def test_onebit_columns_with_nonfinite_inputs_on_every_branch_are_the_oracle(path):
    """NaN and inf in a matrix: only their columns' values turn non-finite, as the oracle's."""
    check("onebit", (59, 17), nonfinite=True)


# -- the count sketch's compiled kernels (update + sketch in one pass, |estimates|) ---------------
SKETCHES = ["sketch:ratio=0.01", "sketch:ratio=0.02,rows=4,cols_ratio=0.03,p2=2,momentum=0.0,seed=7",
            "sketch:k=9,rows=3,cols=80,p2=3,seed=123456789012", "sketch:ratio=0.05,rows=1,cols_ratio=0.1,p2=1"]


@pytest.mark.parametrize("shape", [(3001,), (67, 45)], ids=str)
@pytest.mark.parametrize("text", SKETCHES)
def test_sketches_on_every_branch_are_the_oracle(path, text, shape):
    """Shapes big enough for the sketch (not the dense rule); rows 5, 4, 3 and 1 (the median's
    networks), no momentum, a 64-bit seed."""
    check(text, shape)


def test_sketch_across_hash_blocks_and_chunks_on_every_branch_is_the_oracle(path):
    """A 65,536-entry hash block and a partial second one, whose last chunk of the kernels is cut
    short."""
    check("sketch:ratio=0.002,rows=5", (65536 + 4099,))


def test_sketch_of_a_merged_group_on_every_branch_is_the_oracle(path):
    members = (Member("a", (13,), 0), Member("b", (40, 50), 13), Member("c", (3001,), 2013))
    check("sketch:ratio=0.01", (5014,), members=members)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's NaN arithmetic in the oracle
def test_sketch_with_nonfinite_inputs_on_the_cpu_branches_is_the_oracle(path):
    """NaN and inf in the gradient: the estimates' median sorts NaN last, as np.sort. Not on the
    torch-only branch: its ``topk_indices`` finds no candidates among NaN magnitudes (selection.py)."""
    if path == "torch":
        pytest.skip("the torch-only topk_indices does not rank NaN magnitudes as the oracle does")
    check("sketch:ratio=0.01", (3001,), nonfinite=True)


def test_sketch_takes_the_compiled_kernels_on_the_compiled_branch(monkeypatch):
    if native.lib() is None:
        pytest.skip("no C++ compiler: the compiled kernels are not built")
    from torch_ops.compressors import sketch as torch_sketch
    calls = []
    real = torch_sketch.Native.candidates
    monkeypatch.setattr(torch_sketch.Native, "candidates", lambda self, *a: calls.append(1) or real(self, *a))
    check("sketch:ratio=0.01", (3001,))
    assert len(calls) == 4  # two ranks, two steps
