"""What a merged group of gradient tensors looks like to a compressor (shared by both backends).

A group of several tensors is exchanged as one flat tensor. Compressors that treat tensors by
shape (DGC sends 1-D tensors dense) are told ``merged_shape``: the member's own shape for a group
of one; ``(numel,)`` when every member is 1-D (biases, norms); ``(1, numel)`` otherwise, so a group
holding a weight matrix is treated as a matrix, its biases included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ..contract import Member
from ..topology import slices


def numel(shape: Sequence[int]) -> int:
    """Number of elements of a tensor of ``shape`` (1 for a scalar)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def merged_shape(shapes: Sequence[Sequence[int]]) -> Tuple[int, ...]:
    """The shape a compressor is told for a group of tensors of ``shapes`` (module doc)."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if len(shapes) == 1:
        return shapes[0]
    total = sum(numel(s) for s in shapes)
    return (total,) if all(len(s) <= 1 for s in shapes) else (1, total)


@dataclass(frozen=True)
class MergedGroup:
    """Tensors exchanged as one flat tensor, in concatenation order: ``members`` name them
    (parameter names in PyTorch, gradient positions in TensorFlow), ``shapes`` are theirs."""

    members: Tuple
    shapes: Tuple[Tuple[int, ...], ...]

    @property
    def key(self) -> str:
        """The exchange's name, identical on all ranks (it seeds random-k and DGC's sampling): the
        member for a group of one, else ``<first>+<n-1>`` (groups are disjoint: keys are unique)."""
        if len(self.members) == 1:
            return str(self.members[0])
        return f"{self.members[0]}+{len(self.members) - 1}"

    @property
    def numels(self) -> Tuple[int, ...]:
        return tuple(numel(s) for s in self.shapes)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shape(self) -> Tuple[int, ...]:
        """What the compressor is told the tensor's shape is (``merged_shape``)."""
        return merged_shape(self.shapes)

    @property
    def layout(self):
        """The members as ``hvdcompress.contract.Member`` s (name, shape, offset): what an
        exchange is told in ``ExchangeContext.members``."""
        from ..contract import Member

        out, offset = [], 0
        for name, shape, n in zip(self.members, self.shapes, self.numels):
            out.append(Member(str(name), tuple(shape), offset))
            offset += n
        return tuple(out)


def check_mergeable(schedule_text: str, spec, choosing: bool = False) -> bool:
    """Whether ``spec`` 's tensors may be merged under a schedule (its text, "explicit" for explicit
    groups). A compressor declared ``merge=LAYERWISE`` is exchanged one tensor at a time: "auto"
    then means "layerwise" (returns False: use layerwise), any other merging schedule is a
    ValueError naming ``schedule``. With a per-group codec choice (``choosing``) "auto" and the
    exact searches "mgs" / "mgwfbp" stay: the joint search gives that compressor groups of one
    tensor only and merges the groups it sends with fp16 or dense (the greedy rule's partition
    knows no such limit). True: schedule as asked."""
    from ..contract import LAYERWISE

    if spec.info.merge != LAYERWISE or schedule_text == "layerwise":
        return True
    if choosing and schedule_text in ("auto", "mgs", "mgwfbp"):
        return True
    if schedule_text == "auto":
        return False
    raise ValueError(f"schedule: compression '{spec.name}' keeps per-tensor state that is not elementwise "
                     f"(merge policy {LAYERWISE!r}), so its tensors cannot be merged; use schedule='layerwise' "
                     f"or 'auto'; got {schedule_text!r}")


def process_set_size(process_set, timeout_s: float = 30.0) -> int:
    """``process_set.size()``, waiting for Horovod to finish registering a static process set.

    Horovod 0.28.1 registers the sets given to ``hvd.init(process_sets=...)`` in its background
    thread; ``size()`` right after ``init`` may raise "Process set does not exist or has not been
    registered" for a moment (seen with TensorFlow). Retried for up to ``timeout_s`` seconds."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return process_set.size()
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


# --- the parts of a two-level exchange ---------------------------------------------------------
shape_numel = numel  # split_layout's argument ``numel`` shadows the function

@dataclass(frozen=True)
class Part:
    """One local rank's part of a flat tensor in a two-level exchange: ``x[start:stop]``, what the
    compressor is told its shape is, and the members (pieces of the tensor's members) it holds,
    offsets relative to ``start``."""

    start: int
    stop: int
    shape: Tuple[int, ...]
    members: Tuple[Member, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start


def _piece(m: Member, start: int, stop: int) -> Optional[Member]:
    """The part of member ``m`` inside ``[start, stop)`` of the flat tensor (offset relative to
    ``start``): the member's shape when whole; its rows when cut between rows; else ``(1, n)`` for a
    piece of a matrix (still a matrix to a shape rule such as DGC's dense 1-D tensors) and ``(n,)``
    for a piece of a vector."""
    lo, hi = max(start, m.offset), min(stop, m.offset + m.numel)
    if hi <= lo:
        return None
    n = hi - lo
    if n == m.numel:
        shape = tuple(m.shape)
    elif len(m.shape) >= 2:
        row = shape_numel(m.shape[1:])
        aligned = (lo - m.offset) % row == 0 and n % row == 0
        shape = (n // row,) + tuple(m.shape[1:]) if aligned else (1, n)
    else:
        shape = (n,)
    return Member(m.name, shape, lo - start)


def split_layout(numel: int, shape: Tuple[int, ...], members: Tuple[Member, ...], parts: int) -> Tuple[Part, ...]:
    """The ``parts`` contiguous parts of a flat tensor of ``numel`` elements (told ``shape``, holding
    ``members``; one member of ``shape`` when empty) that the local ranks of a node own in a
    two-level exchange, in local rank order. A tensor of one member with 2+ dimensions and at
    least ``parts`` rows is cut between rows (``slices`` of its rows: each part a block of whole
    rows, so a low-rank compressor still sees a matrix); anything else by ``slices(numel, parts)``.
    Each part's shape follows the merged-group rule (``merged_shape``) over its
    pieces. The same on every rank: a function of sizes only."""
    shape = tuple(int(d) for d in shape) or (numel,)
    members = tuple(members) or (Member("", shape, 0),)
    if len(members) == 1 and len(members[0].shape) >= 2 and members[0].shape[0] >= parts:
        row = shape_numel(members[0].shape[1:])
        bounds = tuple((a * row, b * row) for a, b in slices(int(members[0].shape[0]), parts))
    else:
        bounds = slices(numel, parts)
    out = []
    for start, stop in bounds:
        pieces = tuple(p for p in (_piece(m, start, stop) for m in members) if p is not None)
        part_shape = merged_shape([p.shape for p in pieces]) if pieces else (0,)
        out.append(Part(start, stop, part_shape, pieces))
    return tuple(out)
