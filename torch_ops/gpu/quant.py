"""The quantizers on the Triton kernels: one encode and one decode + sum per exchange.

``plan(comp, x, ctx)`` returns a ``Job`` when the kernels serve the exchange (``torch_ops.gpu.serves``
the tensor; float32 contiguous 1-D gradient; members that tile it, as ``hvdcompress.native.quant.codec``
decides for the compiled CPU kernels; not TernGrad's shared scale), else None and the caller
runs the torch ops. ``Job.encode`` writes the payload ``[float32 scales | packed codes]`` and the
new residual (the residual is added inside the kernels: ``a = x + r``, read and written in
place) in two launches (the reduction, then the codes; signsgd: the codes only);
``Job.decode_sum`` turns the gathered payloads into their sum in rank order times the average's
scale in one. No host sync, no torch op between the launches: the layout's tables and work
space are built once per compressor and layout (``_layout_of``).
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Optional, Tuple

import numpy as np
import torch

from hvdcompress.native.quant import Codec, codec
from hvdcompress.reference.quantizers import SCALE_BYTES, member_spans
from hvdcompress.rng import stream_base

from . import serves

BLOCK = 1024  # entries per program of the codes and decode passes (a multiple of 8: whole bytes)
MAX_CHUNK = 4096  # entries per program of the reduction pass
FINISH_BLOCK = 128  # partials a segment's finishing program loads at a time


def _usable(t: Optional[torch.Tensor], like: torch.Tensor) -> bool:
    return (t is not None and t.device == like.device and t.dtype == torch.float32 and t.is_contiguous()
            and not t.is_neg() and not t.requires_grad and t.numel() == like.numel())


class Tables:
    """An exchange layout's index tables on one device: the reduction's work list (chunks that
    stay inside a segment) and the member table the per-entry passes search."""

    columns = False

    def __init__(self, spans: Tuple[Tuple[int, int], ...], numel: int, bucket: int, segs: np.ndarray, device):
        lens = segs.astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        longest = int(lens.max()) if lens.size else 1
        self.chunk = min(MAX_CHUNK, 1 << max(4, (longest - 1).bit_length()))
        per = -(-lens // self.chunk)
        seg_of_work = np.repeat(np.arange(lens.size), per)
        first = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
        j = np.arange(seg_of_work.size) - first[seg_of_work]
        wstart = starts[seg_of_work] + j * self.chunk
        wlen = np.minimum(self.chunk, lens[seg_of_work] - j * self.chunk)
        moff, mfirst, at = [], [], 0
        for off, n in spans:
            if n == 0:
                continue
            moff.append(off)
            mfirst.append(at)
            at += -(-n // bucket) if bucket else 1
        self.nwork, self.nseg, self.nm = int(seg_of_work.size), int(lens.size), len(moff)
        self.log = max(0, (self.nm - 1).bit_length())
        self.bucket = int(bucket)
        as_dev = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt).to(device)  # noqa: E731
        self.wstart, self.wlen = as_dev(wstart, torch.int64), as_dev(wlen, torch.int32)
        self.wseg = as_dev(seg_of_work, torch.int64)
        self.pstart, self.count = as_dev(first, torch.int64), as_dev(lens, torch.int64)
        self.moff, self.mfirst = as_dev(moff or [0], torch.int64), as_dev(mfirst or [0], torch.int64)
        self.mcols = self.moff  # (no columns: an unused argument)
        # the reduction's work space, kept for every exchange of this layout (they run on one
        # stream, one after another): partials (3 per chunk: onebit's), the segments' counters
        # (zero between launches: the last chunk of a segment resets its counter), the factors
        self.partials = torch.empty(max(3 * self.nwork, 1), dtype=torch.float64, device=device)
        self.done = torch.zeros(max(self.nseg, 1), dtype=torch.int32, device=device)
        self.factor = torch.empty(max(self.nseg, 1), dtype=torch.float32, device=device)


class ColumnTables:
    """``onebit:scope=column``'s tables on one device: members (rows, cols) tiling the tensor in
    order; the reduction's work list (tiles of RB rows x CB columns, grouped by column block)
    and the member table the per-entry passes search (an entry's scale pair: its member's first
    column plus (i - offset) % cols)."""

    columns = True

    def __init__(self, dims: np.ndarray, numel: int, device):
        rows_cols = dims.reshape(-1, 2).astype(np.int64)
        widest = int(rows_cols[:, 1].max()) if rows_cols.size else 1
        self.cb = max(2, min(32, 1 << max(0, (widest - 1).bit_length())))
        self.rb = max(16, 4096 // self.cb)
        work = {k: [] for k in ("off", "cols", "col0", "row0", "rlen", "cb")}
        cbw, cbcol, cbrows, moff, mfirst, mcols = [], [], [], [], [], []
        off = cfirst = 0
        for rows, cols in rows_cols.tolist():
            moff.append(off)
            mfirst.append(cfirst)
            mcols.append(cols)
            for b in range(-(-cols // self.cb)):
                cbw.append(len(work["off"]))
                cbcol.append(cfirst + b * self.cb)
                cbrows.append(rows)
                for rc in range(-(-rows // self.rb)):
                    for k, v in zip(work, (off, cols, b * self.cb, rc * self.rb, min(self.rb, rows - rc * self.rb),
                                          len(cbw) - 1)):
                        work[k].append(v)
            off += rows * cols
            cfirst += cols
        cbw.append(len(work["off"]))
        self.nwork, self.ncb, self.nm = len(work["off"]), len(cbrows), len(moff)
        self.log = max(0, (self.nm - 1).bit_length())
        self.bucket = 0
        as_dev = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt).to(device)  # noqa: E731
        self.work = {k: as_dev(v or [0], torch.int64) for k, v in work.items()}
        self.cbw, self.cbcol = as_dev(cbw, torch.int64), as_dev(cbcol or [0], torch.int64)
        self.cbrows = as_dev(cbrows or [0], torch.int64)
        self.moff, self.mfirst = as_dev(moff or [0], torch.int64), as_dev(mfirst or [0], torch.int64)
        self.mcols = as_dev(mcols or [1], torch.int64)
        # work space kept for every exchange of this layout (one stream: launches in order)
        self.partials = torch.empty(max(3 * self.nwork * self.cb, 1), dtype=torch.float64, device=device)
        self.done = torch.zeros(max(self.ncb, 1), dtype=torch.int32, device=device)
        self.factor = torch.empty(1, dtype=torch.float32, device=device)


@lru_cache(maxsize=64)
def column_tables(numel: int, device: str, dims_key: bytes) -> ColumnTables:
    return ColumnTables(np.frombuffer(dims_key, dtype=np.int64), numel, torch.device(device))


@lru_cache(maxsize=64)
def tables(spans, numel: int, bucket: int, device: str, segs_key: bytes) -> Tables:
    segs = np.frombuffer(segs_key, dtype=np.int64)
    return Tables(spans, numel, bucket, segs, torch.device(device))


class Job:
    """One exchange on the Triton kernels: ``encode`` then, with the gathered buffer, ``decode_sum``."""

    def __init__(self, layout: Codec, tabs: Tables, x, rin, rout, base: int, ctx, state):
        self.layout, self.tabs, self.x, self.rin, self.rout = layout, tabs, x, rin, rout
        self.base, self.ctx, self.state = base, ctx, state
        self.name, self.part = layout.name, layout.part
        self.nsc = (self.part - (layout.numel * layout.bits + 7) // 8) // SCALE_BYTES
        self.head = SCALE_BYTES * self.nsc

    def _levels(self):
        s = float(self.layout.levels)
        return s, (float(np.float32(1.0 / s)) if s else 0.0)

    def encode(self) -> torch.Tensor:
        from . import quant_kernels as K

        lay, tabs, x, n = self.layout, self.tabs, self.x, self.layout.numel
        out = torch.empty(self.part, dtype=torch.uint8, device=x.device)  # every byte is written below
        if n:
            scales = out[:self.head].view(torch.float32) if self.head else tabs.factor
            packed = out[self.head:]
            r = self.rin if self.rin is not None else x
            rout = self.rout if self.rout is not None else x
            factor = tabs.factor
            levels, inv = self._levels()
            if tabs.columns:
                w = tabs.work
                K.col_reduce[(tabs.nwork,)](x, r, w["off"], w["cols"], w["col0"], w["row0"], w["rlen"], w["cb"],
                                            tabs.cbw, tabs.cbcol, tabs.cbrows, tabs.partials, tabs.done, scales,
                                            HAS_R=self.rin is not None, RB=tabs.rb, CB=tabs.cb, enable_fp_fusion=False)
            elif lay.kind != K.SIGN.value:
                K.seg_reduce[(tabs.nwork,)](x, r, tabs.wstart, tabs.wlen, tabs.wseg, tabs.pstart, tabs.count,
                                            tabs.partials, tabs.done, scales, factor, levels, KIND=lay.kind,
                                            HAS_R=self.rin is not None, CHUNK=tabs.chunk, FB=FINISH_BLOCK,
                                            enable_fp_fusion=False)
            K.codes[(cdiv(n, BLOCK),)](
                x, r, rout, packed, scales, factor, tabs.moff, tabs.mfirst, tabs.mcols, tabs.nm,
                max(tabs.bucket, 1), n, self.part - self.head, self.base, levels, inv, KIND=lay.kind,
                BITS=lay.bits, HAS_R=self.rin is not None, WRITE_R=self.rout is not None, LOG=tabs.log,
                BUCKETED=tabs.bucket > 0, COLUMNS=tabs.columns, BLOCK=BLOCK, enable_fp_fusion=False)
        if self.rout is not None:
            self.state["residual"] = self.rout
        return out

    def decode_sum(self, gathered: torch.Tensor) -> torch.Tensor:
        from . import quant_kernels as K

        ctx, lay, tabs, x, n = self.ctx, self.layout, self.tabs, self.x, self.layout.numel
        world = ctx.world_size
        gathered = gathered.contiguous().view(-1)
        if gathered.numel() != world * self.part:
            raise ValueError(f"{self.name}: gathered {gathered.numel()} bytes, expected {world} x {self.part}")
        out = ctx.out.view(-1) if _usable(ctx.out, x) else torch.empty(n, dtype=torch.float32, device=x.device)
        if n == 0:
            return out
        levels, inv = self._levels()
        mult = float(np.float32(ctx.scale))
        K.decode_sum[(cdiv(n, BLOCK),)](
            gathered, out, tabs.moff, tabs.mfirst, tabs.mcols, tabs.nm, max(tabs.bucket, 1), n, self.part, self.head,
            world, levels, inv, mult, KIND=lay.kind, BITS=lay.bits, SCALE=ctx.scale != 1.0, LOG=tabs.log,
            BUCKETED=tabs.bucket > 0, COLUMNS=tabs.columns, BLOCK=BLOCK, enable_fp_fusion=False)
        return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_layouts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MISS = object()


def _layout_of(comp, ctx, n: int, device) -> Optional[Tuple[Codec, Tables]]:
    """The exchange's ``Codec`` and ``Tables`` (None: the kernels do not serve the layout),
    found once per compressor and (members, shape, size, device): an exchange of a layout seen
    before does no planning on the host."""
    per = _layouts.get(comp)
    if per is None:
        per = _layouts[comp] = {}
    key = (ctx.members, tuple(ctx.shape), n, device)
    got = per.get(key, _MISS)
    if got is _MISS:
        params = comp.spec.params
        layout = codec(comp.name, params, ctx.members, ctx.shape, n)
        if layout is None:
            got = None  # scaler sharing (two rounds), members with gaps: the torch ops
        elif layout.dims is not None:  # onebit per column
            got = (layout, column_tables(n, str(device), layout.dims.astype(np.int64).tobytes()))
        else:
            bucket = int(params.get("bucket", 0))
            got = (layout, tables(member_spans(ctx.members, n), n, bucket, str(device),
                                  layout.segs.astype(np.int64).tobytes()))
        if len(per) >= 256:
            per.clear()
        per[key] = got
    return got


def plan(comp, x: torch.Tensor, ctx) -> Optional[Job]:
    """A ``Job`` when the Triton kernels serve this exchange of ``comp``, else None."""
    if not serves(x):
        return None
    from ..memory import Memory, ResidualMemory

    params = comp.spec.params
    if type(comp.memory) not in (Memory, ResidualMemory):
        return None
    n = x.numel()
    if not _usable(x, x) or x.dim() != 1:
        return None
    found = _layout_of(comp, ctx, n, x.device)
    if found is None:
        return None
    layout, tabs = found
    rin = rout = None
    if params.get("residual", False):
        r = ctx.state.get("residual")
        if r is None:
            rout = torch.empty(n, dtype=torch.float32, device=x.device)
        elif _usable(r, x) and r.shape == x.shape and r.data_ptr() != x.data_ptr():
            rin = rout = r
        else:
            return None  # the general path checks it (or adds in another dtype)
    base = stream_base(params["seed"], ctx.step, ctx.key, ctx.rank) if "seed" in params else 0
    return Job(layout, tabs, x, rin, rout, base, ctx, ctx.state)
