"""Top-k and threshold scans over CPU memory: numpy reading the tensor in place, and the optional
compiled kernels. ``selection.py`` calls these first for contiguous CPU float tensors and keeps
the torch-only paths (other devices and dtypes); every function here gives the same answer as
``hvdcompress.reference.selection`` (ties toward the lower index). The numpy-level functions are
``hvdcompress.native.select``'s, shared with TensorFlow; PyTorch gives them its k-th largest
(``torch.topk`` on large arrays) and reads tiny tensors through its own pointers.

``np_topk``          exact top-k from a candidate set {|x| >= t}, t from a strided sample a few
                     standard deviations below the k-th largest (see ``selection``'s module doc)
``_np_mostly_zero``  the shortcut for a tensor that is mostly zeros
``ge_numpy``         every |x| >= t, chunk by chunk (or one compiled pass)
``add_and_topk``     error feedback's r += g fused with the candidate scan (compiled kernels)
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from hvdcompress.native import select as shared
from hvdcompress.native.select import NATIVE_DIRECT_BELOW, NP_CHUNK, NP_DIRECT_BELOW, SAMPLE_EVERY, SAMPLE_SIZE  # noqa: F401

from . import native

NP_PARTITION_UPTO = 4096  # k-th largest by numpy's partition up to this size, torch's topk above

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def numpy_view(a: torch.Tensor) -> Optional[np.ndarray]:
    """The tensor's memory as a numpy array (no copy), where numpy can read it: CPU, a float
    dtype numpy has, contiguous. Numpy's compare and nonzero are several times faster than
    torch's on CPU, and a numpy call costs a fraction of a torch call. None under
    ``native.torch_only()`` (the branch CUDA tensors take)."""
    if native.torch_only() or not a.is_cpu or a.dtype not in _NUMPY_DTYPES or not a.is_contiguous() or a.is_neg():
        return None
    return (a.detach() if a.requires_grad else a).numpy()


_work = {}
KERNEL_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def native_topk_small(a: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """The k largest |a| (ties to the lower index), ascending, by the compiled kernel (a min-heap
    of k or an nth_element, then one scan), for a contiguous CPU float32/float64 tensor with
    0 < k < a.numel(); None where the kernel does not apply (other tensors, no library, a NaN).
    Pointers come from torch (numpy's are several times dearer to read on a tiny tensor)."""
    suffix = KERNEL_SUFFIX.get(a.dtype)
    if suffix is None or not a.is_cpu or not a.is_contiguous():
        return None
    lib = native.lib()
    if lib is None:
        return None
    n = a.numel()
    work = _work.get(a.dtype)
    if work is None or work[0].numel() < n:
        buf = torch.empty(max(n, NATIVE_DIRECT_BELOW), dtype=a.dtype)
        work = _work[a.dtype] = (buf, buf.data_ptr())
    out = torch.empty(k, dtype=torch.int64)
    c = getattr(lib, "hvdc_topk_small_" + suffix)(a.data_ptr(), n, k, out.data_ptr(), work[1])
    return out if c == k else None


def ge_numpy(x: np.ndarray, t, cap: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(indices ascending, their |x|) of every |x_i| >= t (``hvdcompress.native.select.ge``)."""
    return shared.ge(x, t, cap)



def np_kth_largest(y: np.ndarray, k: int):
    """The k-th largest entry of y (0 < k <= y.size), as y's scalar type."""
    c = y.size
    if c <= NP_PARTITION_UPTO:
        return np.partition(y, c - k)[c - k]
    t = torch.from_numpy(y)
    if 2 * k <= c:
        w = torch.topk(t, k, sorted=False).values.min()
    else:
        w = torch.topk(t, c - k + 1, largest=False, sorted=False).values.max()
    return y.dtype.type(w.item())


def np_positions(y: np.ndarray, k: int) -> np.ndarray:
    """Positions (ascending) of the k largest entries of y, ties toward the lower position."""
    return shared.positions(y, k, np_kth_largest)


def np_topk(x: np.ndarray, k: int) -> np.ndarray:
    """``topk_indices`` in numpy (1 < k < x.size): ``hvdcompress.native.select.topk``."""
    return shared.topk(x, k, np_kth_largest)


def _np_mostly_zero(x: np.ndarray, k: int) -> Optional[np.ndarray]:
    """``hvdcompress.native.select.mostly_zero``: the nonzeros of a mostly-zero tensor (then the
    lowest-index zeros), or None when a NaN is among them."""
    return shared.mostly_zero(x, k, np_kth_largest)


def add_and_topk(r: torch.Tensor, g: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """Error feedback's compensation and selection in one pass: r <- r + g in place, then the
    k largest |r| (ascending), for contiguous 1-D CPU float32/float64 r and g of one dtype
    (``hvdcompress.native.select.add_topk``). None, with r untouched, where it does not apply."""
    if (KERNEL_SUFFIX.get(r.dtype) is None or g.dtype != r.dtype or not (r.is_cpu and g.is_cpu)
            or r.numel() < NATIVE_DIRECT_BELOW or not (1 < k < r.numel())
            or not (r.is_contiguous() and g.is_contiguous()) or r.dim() != 1):
        return None
    x, gx = numpy_view(r), numpy_view(g)
    if x is None or gx is None:
        return None
    idx = shared.add_topk(gx, x, x, k, np_kth_largest)
    return None if idx is None else torch.from_numpy(idx)
