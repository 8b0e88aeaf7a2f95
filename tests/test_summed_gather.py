"""A same-shape gather between two ranks travels as a sum of its bytes (``SummedGather``,
``summed_gather``): every dtype and shape round-trips bit for bit, the promise is checked by the
oracle, declared by the algorithms whose payload shapes depend only on the tensor's size, and
priced by the cost model as the allreduce it is. The real collectives run in the multiprocess
suites (2-worker Horovod, TF and torch.distributed scenarios against the oracle)."""

import numpy as np
import pytest
import torch

from hvdcompress.contract import Allgather
from hvdcompress.reference.oracle import answer_round
from hvdcompress.registry import GATHERED, registered
from hvdcompress.schedule.costmodel import CostModel, LinearFit, payload
from torch_ops.collectives import SummedGather, sums_gathers

DTYPES = [torch.uint8, torch.int8, torch.bool, torch.float16, torch.bfloat16, torch.int32, torch.float32,
          torch.int64, torch.float64]
SHAPES = [(0,), (1,), (3,), (7,), (13, 3), (5, 2, 2), ()]


def _payload(rng, dtype, shape):
    n = int(np.prod(shape))
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n).astype(bool)).reshape(shape)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(rng.integers(0, 256, n * size, dtype=np.uint8))
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def _as_bits(t):
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.reshape(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_summed_gather_returns_the_allgather_bit_for_bit(dtype, shape):
    rng = np.random.default_rng(7)
    tensors = [_payload(rng, dtype, shape) for _ in range(2)]
    gathers = [SummedGather(t, rank) for rank, t in enumerate(tensors)]
    if gathers[0].words is not None:  # the transport's sum, wrapping as int32 addition does
        total = gathers[0].words + gathers[1].words
        for g in gathers:
            g.words.copy_(total)
    else:
        assert gathers[1].words is None  # nothing to send: no collective on either rank
    want = torch.cat([t.reshape(1) if t.dim() == 0 else t for t in tensors])
    for g in gathers:
        got = g.result()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(_as_bits(got), _as_bits(want))


def test_the_sum_overflows_and_still_separates_the_payloads():
    a = torch.tensor([2**31 - 1, -2**31, -1], dtype=torch.int32)
    b = torch.tensor([2**31 - 1, -2**31, 2**31 - 1], dtype=torch.int32)
    ga, gb = SummedGather(a, 0), SummedGather(b, 1)
    total = ga.words + gb.words
    ga.words.copy_(total), gb.words.copy_(total)
    assert torch.equal(ga.result(), torch.cat([a, b])) and torch.equal(gb.result(), torch.cat([a, b]))


@pytest.mark.parametrize("dtype", ["uint8", "int8", "bool", "float16", "int32", "float32", "int64", "float64"])
@pytest.mark.parametrize("shape", [(0,), (1,), (3,), (7,), (13, 3)], ids=str)
def test_tf_summed_gather_returns_the_allgather_bit_for_bit(dtype, shape):
    tf = pytest.importorskip("tensorflow")
    from tf_ops.collectives import summed_gather

    rng = np.random.default_rng(3)
    n = int(np.prod(shape))
    arrays = []
    for _ in range(2):
        if dtype == "bool":
            arrays.append(rng.integers(0, 2, n).astype(bool).reshape(shape))
        else:
            arrays.append(rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype).reshape(shape))
    words = []

    def capture(w):  # rank 0's pass records its words; rank 1's returns the sum of both
        words.append(w)
        return w if len(words) == 1 else words[0] + w

    tf.random.set_seed(0)
    summed_gather(tf.constant(arrays[0]), 0, capture)
    total = [None]

    def fixed(w):
        total[0] = words[0] + w
        return total[0]

    got1 = summed_gather(tf.constant(arrays[1]), 1, fixed)
    got0 = summed_gather(tf.constant(arrays[0]), 0, lambda w: total[0])
    want = np.concatenate(arrays)
    for got in (got0, got1):
        assert got.dtype.name == want.dtype.name and tuple(got.shape) == want.shape
        assert got.numpy().tobytes() == want.tobytes()


def test_only_same_shape_gathers_of_two_ranks_are_summed():
    t = torch.ones(4)
    assert sums_gathers(Allgather(t, same_shape=True), 2)
    assert not sums_gathers(Allgather(t), 2)
    assert not sums_gathers(Allgather(t, same_shape=True), 3)


def test_the_oracle_refuses_a_broken_same_shape_promise():
    ok = answer_round([(Allgather(np.ones(3), True),), (Allgather(np.zeros(3), True),)])
    assert [a[0].tolist() for a in ok] == [[1, 1, 1, 0, 0, 0]] * 2
    with pytest.raises(ValueError, match="same_shape"):
        answer_round([(Allgather(np.ones(3), True),), (Allgather(np.ones(2), True),)])


def test_same_shape_algorithms_are_the_fixed_size_gathered_ones():
    same = {name for name, info in registered().items() if info.same_shape}
    assert {"topk", "bf16", "signsgd", "efsignsgd", "onebit", "terngrad", "qsgd", "sparseloco"} <= same
    assert not same & {"dgc", "threshold"}  # value-dependent sizes
    assert all(registered()[name].exchange == GATHERED for name in same)


def test_the_cost_model_prices_a_two_rank_same_shape_gather_as_an_allreduce():
    ar, ag = LinearFit(1e-3, 1e-8, 0.0, 4), LinearFit(2e-3, 1.6e-8, 0.0, 4)
    d = np.array([1e6])
    two, three = CostModel(2, ar, ag), CostModel(3, ar, ag)
    (kind, collectives, nbytes) = payload("signsgd", d)  # one gathered round of the sign bits
    assert (kind, collectives) == (GATHERED, 1)
    sign_bytes = float(nbytes[0])
    assert two.comm_seconds("signsgd", 4 * d)[0] == pytest.approx(1e-3 + 1e-8 * sign_bytes)
    assert three.comm_seconds("signsgd", 4 * d)[0] == pytest.approx(2e-3 + 1.6e-8 * 3 * sign_bytes)
    # DGC's sizes depend on the values: the allgather fit at two ranks too
    k = 1000
    assert two.comm_seconds("dgc:ratio=0.001", 4 * d)[0] == pytest.approx(2 * 2e-3 + 1.6e-8 * 2 * k * 8, rel=1e-3)
