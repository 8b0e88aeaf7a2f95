"""Bit packing round trips (odd sizes, 0 and 1 codes) and the counter-based generator the
stochastic quantizers draw from, in numpy, torch and TF: single process."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import torch

from hvdcompress import packing, rng
from tf_ops.compressors import packing as tf_packing
from torch_ops.compressors import packing as torch_packing

SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1001]


# -- packing and the generator ---------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_packing_round_trips_in_numpy_torch_and_tf(bits):
    g = np.random.default_rng(bits)
    for n in SIZES:
        codes = g.integers(0, 2 ** bits, n).astype(np.uint8)
        packed = packing.pack(codes, bits)
        assert packed.dtype == np.uint8 and packed.size == (n * bits + 7) // 8 == packing.packed_size(n, bits)
        np.testing.assert_array_equal(packing.unpack(packed, bits, n), codes)
        t = torch_packing.pack(torch.from_numpy(codes), bits)
        assert t.dtype == torch.uint8
        np.testing.assert_array_equal(t.numpy(), packed, err_msg=f"torch bits={bits} n={n}")
        np.testing.assert_array_equal(torch_packing.unpack(t, bits, n).numpy(), codes)
        f = tf_packing.pack(tf.constant(codes), bits)
        assert f.dtype == tf.uint8
        np.testing.assert_array_equal(f.numpy(), packed, err_msg=f"tf bits={bits} n={n}")
        np.testing.assert_array_equal(tf_packing.unpack(f, bits, n).numpy(), codes)


def test_packing_layout_is_a_little_endian_bit_stream():
    # code i occupies stream bits [b*i, b*(i+1)), LSB first; stream bit k is bit k%8 of byte k//8
    for bits in range(1, 9):
        codes = np.random.default_rng(bits).integers(0, 2 ** bits, 29).astype(np.uint8)
        stream = [(int(c) >> j) & 1 for c in codes for j in range(bits)]
        stream += [0] * (-len(stream) % 8)
        want = [sum(stream[8 * k + j] << j for j in range(8)) for k in range(len(stream) // 8)]
        np.testing.assert_array_equal(packing.pack(codes, bits), np.array(want, np.uint8))
    assert packing.pack(np.array([1, 0, 1, 1, 0, 0, 0, 0, 1], np.uint8), 1).tolist() == [0b1101, 1]


def test_packing_rejects_bad_widths_and_short_buffers():
    with pytest.raises(ValueError, match="bits must be an int in \\[1, 8\\]"):
        packing.pack(np.zeros(3, np.uint8), 9)
    with pytest.raises(ValueError, match="cannot hold"):
        packing.unpack(np.zeros(1, np.uint8), 3, 5)
    assert [packing.bits_for_levels(v) for v in (2, 3, 4, 5, 9, 255, 256)] == [1, 2, 2, 3, 4, 8, 8]


def _mix32_reference(x: int) -> int:
    """mix32 in plain 32-bit unsigned arithmetic, as C would compute it."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) % 2 ** 32
    x ^= x >> 15
    x = (x * 0x735A2D97) % 2 ** 32
    return x ^ (x >> 15)


def test_generator_is_the_documented_hash_in_numpy_torch_and_tf():
    for x in (0, 1, 12345, 2 ** 31, 2 ** 32 - 1):
        assert rng.mix32(x) == _mix32_reference(x)
    base = rng.stream_base(7, 3, "layer.w", 1)
    u = rng.uniform(50, 7, 3, "layer.w", 1)
    want = [(_mix32_reference((i * 0x61C88647 + base) % 2 ** 32) >> 8) * 2.0 ** -24 for i in range(50)]
    np.testing.assert_array_equal(u, np.array(want, np.float32))
    for n in (0, 1, 1000):
        for args in ((0, 0, "a", 0), (2 ** 32 - 1, 10 ** 6, "layer.w", 2)):
            want = rng.uniform(n, *args)
            assert want.dtype == np.float32 and ((want >= 0) & (want < 1)).all()
            np.testing.assert_array_equal(torch_packing.uniform(n, *args).numpy(), want)
            np.testing.assert_array_equal(tf_packing.uniform(n, *args).numpy(), want)
    # the step as a tensor, inside tf.function
    fn = tf.function(lambda s: tf_packing.uniform(64, 5, s, "k", 1))
    for step in (0, 9, 2 ** 33 + 4):
        np.testing.assert_array_equal(fn(tf.constant(step, tf.int64)).numpy(), rng.uniform(64, 5, step, "k", 1))


def test_generator_streams_differ_and_look_uniform():
    a = rng.uniform(200_000, 0, 0, "w")
    assert abs(a.mean() - 0.5) < 0.005 and abs(a.var() - 1 / 12) < 0.002
    hist = np.bincount((a * 16).astype(int), minlength=16) / a.size
    assert np.abs(hist - 1 / 16).max() < 0.005
    for other in (rng.uniform(a.size, 1, 0, "w"), rng.uniform(a.size, 0, 1, "w"),
                  rng.uniform(a.size, 0, 0, "v"), rng.uniform(a.size, 0, 0, "w", 1)):
        assert abs(np.corrcoef(a, other)[0, 1]) < 0.01
        assert (a != other).mean() > 0.99
