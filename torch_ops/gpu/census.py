"""What one exchange asks of the device, counted on the host: Triton launches, torch ops, host syncs.

At the sizes the codecs are judged at (a few million entries), an exchange's time on a GPU is
set by how many kernels it launches and how often the host waits for the device, not by the
bytes it moves. ``Census`` counts both while a block of code runs, on CPU as well as on CUDA
(with ``TRITON_INTERPRET=1`` the Triton launches are counted the same way), so the counts can be
checked on a machine without a GPU:

    with Census() as c:
        run_one_exchange()
    c.summary()   # {"triton": 2, "torch_ops": 1, "allocs": 1, "syncs": 0, "sync_ops": [], ...}

``triton``     Triton kernel launches (``JITFunction.run``; the interpreter's as well)
``torch_ops``  aten ops that launch work (views, metadata and allocations excluded)
``allocs``     allocations (``empty`` and friends: no launch, but the caching allocator's work)
``syncs``      ops that make the host wait for the device: ``.item()`` / ``bool()`` / ``int()``
               of a tensor (``_local_scalar_dense``), ``nonzero`` and the ops built on it, copies
               from a CUDA tensor to the host (seen on CUDA only)

Torch ops that Triton's interpreter runs to move its arguments are not counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
                      "unique_dim", "argwhere", "repeat_interleave_no_size"})
ALLOC_OPS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
                       "lift_fresh_copy"})
FREE_OPS = frozenset({"view", "_unsafe_view", "as_strided", "slice", "select", "expand", "t", "transpose", "permute",
                      "unsqueeze", "squeeze", "alias", "detach", "_reshape_alias", "reshape", "view_as", "unfold",
                      "split", "split_with_sizes", "chunk", "unbind", "diagonal", "narrow", "_neg_view", "_conj",
                      "view_as_real", "view_as_complex", "set_", "resize_", "sym_size", "sym_stride", "sym_numel",
                      "sym_storage_offset", "is_same_size", "_nested_tensor_size", "record_stream"})


class _Ops(TorchDispatchMode):
    def __init__(self, census):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.census
        if c._paused:
            return out
        name = func.overloadpacket.__name__
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            name = "repeat_interleave_no_size"
        if name in ("_to_copy", "copy_") and _to_host(args, kwargs, out):
            c.counts["syncs"] += 1
            c.sync_ops["to_host"] += 1
            c.counts["torch_ops"] += 1
        elif name in SYNC_OPS:
            c.counts["syncs"] += 1
            c.sync_ops[name] += 1
            if name != "_local_scalar_dense":
                c.counts["torch_ops"] += 1
        elif name in ALLOC_OPS:
            c.counts["allocs"] += 1
        elif name not in FREE_OPS and not getattr(func, "is_view", False):
            c.counts["torch_ops"] += 1
            c.ops[name] += 1
        return out


def _to_host(args, kwargs, out) -> bool:
    src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else (args[0] if args else None)
    dst = out if isinstance(out, torch.Tensor) else None
    return (isinstance(src, torch.Tensor) and dst is not None and src.device.type != "cpu"
            and dst.device.type == "cpu")


class Census:
    """A context manager counting Triton launches, torch ops and host syncs (module doc)."""

    def __init__(self):
        self.counts: Counter = Counter(triton=0, torch_ops=0, allocs=0, syncs=0)
        self.ops: Counter = Counter()
        self.sync_ops: Counter = Counter()
        self.kernels: Counter = Counter()
        self._paused = False
        self._mode = _Ops(self)
        self._saved = []

    def __enter__(self):
        for cls in _launch_classes():
            run = cls.run

            def counted(fn_self, *args, _run=run, **kwargs):
                if kwargs.get("warmup"):
                    return _run(fn_self, *args, **kwargs)
                self.counts["triton"] += 1
                self.kernels[getattr(fn_self, "__name__", None) or getattr(getattr(fn_self, "fn", None),
                                                                           "__name__", "?")] += 1
                was, self._paused = self._paused, True
                try:
                    return _run(fn_self, *args, **kwargs)
                finally:
                    self._paused = was

            self._saved.append((cls, run))
            cls.run = counted
        tolist = torch.Tensor.tolist

        def counted_tolist(t, _tolist=tolist):  # a copy to the host: no aten op on a CPU tensor
            if self._paused:
                return _tolist(t)
            self.counts["syncs"] += 1
            self.sync_ops["tolist"] += 1
            was, self._paused = self._paused, True
            try:
                return _tolist(t)
            finally:
                self._paused = was

        self._saved.append((torch.Tensor, tolist))
        torch.Tensor.tolist = counted_tolist
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for cls, fn in reversed(self._saved):
            setattr(cls, "tolist" if cls is torch.Tensor else "run", fn)
        self._saved.clear()
        return False

    def summary(self) -> Dict:
        return {**dict(self.counts), "launches": self.counts["triton"] + self.counts["torch_ops"],
                "sync_ops": dict(self.sync_ops), "kernels": dict(self.kernels), "ops": dict(self.ops)}


def _launch_classes():
    """The Triton classes whose ``run`` launches a kernel (none when triton is not loaded)."""
    import sys
    out = []
    jit = sys.modules.get("triton.runtime.jit")
    if jit is not None and hasattr(jit, "JITFunction"):
        out.append(jit.JITFunction)
    interp = sys.modules.get("triton.runtime.interpreter")
    if interp is not None and hasattr(interp, "InterpretedFunction"):
        out.append(interp.InterpretedFunction)
    return out
