"""The quantizers' compiled kernels at the numpy level, shared by both backends.

``kernels.cpp``'s ``q_encode`` reads the gradient (and the error-feedback residual) and writes the
whole payload, ``[float32 scales | packed codes]``, and the new residual; ``q_decode_sum`` turns
the gathered payloads of every rank into their sum in rank order, times the average's scale,
writing each output entry once. ``onebit:scope=column`` takes its own pair (``q1c_encode``,
``q1c_decode_sum``): the members as (rows, columns), a (pos, neg) pair per column. Both follow
``hvdcompress.reference.quantizers`` operation for operation, so the bytes and results are the
oracle's bit for bit.

``codec(...)`` says, from what is known before any tensor is read (the spec, the members, the
size), whether the kernels serve an exchange: one round (not TernGrad's shared scale), members
that tile the flat tensor in order. Its ``encode`` / ``decode_sum`` take raw addresses of float32
buffers, so the PyTorch backend passes its tensors' ``data_ptr()`` and the TensorFlow backend the
numpy arrays ``tf.numpy_function`` hands it; the residual is read from ``rin`` and written to
``rout``, the same buffer (in place) or another one.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence, Tuple

import numpy as np

from ..packing import bits_for_levels, packed_size
from ..reference.quantizers import SCALE_BYTES, column_spans, member_spans

KINDS = {"signsgd": 0, "efsignsgd": 1, "onebit": 2, "terngrad": 3, "qsgd": 4}
SCALES = {"signsgd": 0, "efsignsgd": 1, "onebit": 2, "terngrad": 1, "qsgd": 1}


@lru_cache(maxsize=64)
def column_dims(cols: Tuple[Tuple[int, int, int], ...], numel: int) -> Optional[np.ndarray]:
    """(rows, columns) per member (int64, flat) when the members tile [0, numel) in order, else None."""
    at, out = 0, []
    for off, rows, c in cols:
        if off != at:
            return None
        at += rows * c
        out += [rows, c]
    if at != numel:
        return None
    return np.array(out, dtype=np.int64)


@lru_cache(maxsize=64)
def segments(spans: Tuple[Tuple[int, int], ...], numel: int, bucket: int) -> Optional[np.ndarray]:
    """The segment lengths (int64) when the members tile [0, numel) in order, else None."""
    at, out = 0, []
    for off, n in spans:
        if off != at:
            return None
        at += n
        if n == 0:
            continue
        if bucket:
            full, rest = divmod(n, bucket)
            out.append(np.full(full, bucket, np.int64))
            if rest:
                out.append(np.array([rest], np.int64))
        else:
            out.append(np.array([n], np.int64))
    if at != numel:
        return None
    return np.concatenate(out) if out else np.zeros(0, np.int64)


class Codec:
    """One exchange's layout on the kernels: ``part`` payload bytes per rank, then ``encode`` and
    ``decode_sum`` on raw addresses (the arrays ``segs`` / ``dims`` are kept alive here)."""

    def __init__(self, name: str, numel: int, levels: int, segs: Optional[np.ndarray], dims: Optional[np.ndarray]):
        self.name, self.kind, self.numel, self.levels = name, KINDS[name], int(numel), int(levels)
        self.segs, self.dims = segs, dims
        self.bits = 1 if self.kind <= 2 else (2 if self.kind == 3 else bits_for_levels(2 * levels + 1))
        if dims is not None:
            self.part = SCALE_BYTES * 2 * int(dims[1::2].sum()) + packed_size(self.numel, 1)
        else:
            self.part = SCALE_BYTES * SCALES[name] * segs.size + packed_size(self.numel, self.bits)

    def encode(self, lib, x: int, rin: Optional[int], rout: Optional[int], base: int, out: int) -> None:
        """Payload of the float32 gradient at ``x`` (plus the residual at ``rin``) into ``out``
        (``part`` bytes); the new residual into ``rout`` (None: no error feedback)."""
        n = self.numel
        if self.dims is not None:
            rc = lib.hvdc_q1c_encode(x, rin, rout, n, self.dims.ctypes.data, self.dims.size // 2, out, self.part)
        else:
            rc = lib.hvdc_q_encode(self.kind, x, rin, rout, n, self.segs.ctypes.data, self.segs.size, self.levels,
                                   base, out, self.part)
        if rc != 0:
            raise RuntimeError(f"{self.name}: the compiled encoder refused its arguments")

    def decode_sum(self, lib, gathered: int, world: int, scale: float, out: int) -> None:
        """The sum over ``world`` payloads (``part`` bytes each, rank order) times ``scale``
        (rounded to float32), into the float32 buffer at ``out``."""
        n = self.numel
        scale = float(np.float32(scale))
        if self.dims is not None:
            rc = lib.hvdc_q1c_decode_sum(gathered, self.part, world, n, self.dims.ctypes.data, self.dims.size // 2,
                                         scale, out)
        else:
            rc = lib.hvdc_q_decode_sum(self.kind, gathered, self.part, world, n, self.segs.ctypes.data,
                                       self.segs.size, self.levels, scale, out)
        if rc != 0:
            raise RuntimeError(f"{self.name}: the compiled decoder refused its arguments")


def codec(name: str, params, members: Sequence, shape: Sequence[int], numel: int) -> Optional[Codec]:
    """The kernels' layout of this exchange, or None where they do not serve it (another
    algorithm, TernGrad's shared scale -- two rounds --, members that do not tile the tensor)."""
    if name not in KINDS or params.get("share_scale"):
        return None
    if name == "onebit" and params.get("scope", "tensor") == "column":
        dims = column_dims(column_spans(members, numel, shape), numel)
        return None if dims is None else Codec(name, numel, 0, None, dims)
    segs = segments(member_spans(members, numel), numel, int(params.get("bucket", 0)))
    return None if segs is None else Codec(name, numel, int(params.get("levels", 0)), segs, None)
