"""Merged groups of gradient tensors: one flat buffer per group, and per-parameter state.

A plan (``hvdcompress.schedule.planner``) partitions the parameters, in backward order, into consecutive
groups. The optimizer compresses and exchanges each group as one flat tensor::

    x      = cat(g_1.flatten(), ..., g_n.flatten())     (a view of g_1 when n == 1)
    result = exchange(x)                               the compressor sees one tensor
    g_i   <- result[offset_i : offset_i + numel_i]     scattered back into each .grad

Compressor state (residuals, DGC's momenta) is *elementwise*: a state tensor of a group is the
concatenation of its members' state tensors, in the same layout as ``x``. The optimizer keeps
state per group while it runs and splits it per parameter for ``state_dict()``, so a checkpoint
does not depend on the grouping and loads under any plan (``join_state`` / ``split_state``); an
absent state entry stands for zeros, as every memory starts from zeros.

The shape a compressor is told (``ExchangeContext.shape``) is the parameter's own for a group of
one; a merged group is one tensor of ``(numel,)`` when all its members are 1-D (biases, norms) and
``(1, numel)`` otherwise, so a rule such as DGC's "1-D tensors are sent dense" applies to the
group as a whole: a merged group holding a weight matrix is sparsified, biases included.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from hvdcompress.schedule.groups import MergedGroup

State = Dict[str, torch.Tensor]


class Group(MergedGroup):
    """Consecutive parameters (backward order) exchanged as one flat tensor; ``key`` is the
    parameter's name for a group of one, else ``<first name>+<n-1>``."""

    @property
    def names(self) -> Tuple[str, ...]:
        return self.members


def make_groups(groups: Sequence[Sequence[str]], shapes: Mapping[str, Tuple[int, ...]]) -> List[Group]:
    """Groups of parameter names -> ``Group``s; ValueError unless every name in ``shapes``
    appears exactly once and every group is non-empty."""
    seen: Dict[str, int] = {}
    out = []
    for gi, names in enumerate(groups):
        names = tuple(names)
        if not names:
            raise ValueError(f"schedule: group {gi} is empty; every group needs at least one parameter")
        for n in names:
            if n not in shapes:
                raise ValueError(f"schedule: group {gi} names '{n}', which is not a parameter of this "
                                 "optimizer (names come from named_parameters)")
            if n in seen:
                raise ValueError(f"schedule: parameter '{n}' is in groups {seen[n]} and {gi}; each "
                                 "parameter must be in exactly one group")
            seen[n] = gi
        out.append(Group(names, tuple(tuple(shapes[n]) for n in names)))
    missing = [n for n in shapes if n not in seen]
    if missing:
        raise ValueError("schedule: every parameter must be in a group; missing: " + ", ".join(missing[:5]))
    return out


def flatten(grads: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The group's flat gradient: a view for one tensor, else the concatenation, written into
    ``out`` when given (a 1-D tensor of the total size, dtype and device), else a new buffer."""
    if len(grads) == 1:
        return grads[0].reshape(-1)
    return torch.cat([g.reshape(-1) for g in grads], out=out)


class FlatBuffers:
    """Where merged groups' flat gradients are written: one arena per dtype and device, kept from step
    to step, each group a slice of it. A fresh large tensor costs more in page faults than the copy
    into it, so the memory is kept, as Horovod keeps its fusion buffer. The groups partition the
    parameters, so the slices never overlap and the arena never outgrows one copy of the gradients.
    For exchanges that end within the step they began in (the synchronous path): a slice is written
    again at the next step. ``reset`` when the groups change (nothing in flight): the slices are
    handed out afresh, the memory is kept, so trying other plans (measured validation) allocates
    nothing."""

    def __init__(self):
        self._arenas: Dict[tuple, torch.Tensor] = {}
        self._slices: Dict[tuple, Tuple[int, int]] = {}  # (key, dtype, device) -> (start, numel)
        self._used: Dict[tuple, int] = {}

    def reset(self) -> None:
        self._slices.clear()
        self._used.clear()

    def flatten(self, key: str, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(grads) == 1:
            return flatten(grads)
        n = sum(g.numel() for g in grads)
        kind = (grads[0].dtype, grads[0].device)
        start, size = self._slices.get((key,) + kind, (0, -1))
        if size != n:
            start = self._used.get(kind, 0)
            self._slices[(key,) + kind], self._used[kind] = (start, n), start + n
        arena = self._arenas.get(kind)
        if arena is None or arena.numel() < start + n:  # slices already handed out keep the old storage
            arena = self._arenas[kind] = torch.empty(start + n, dtype=kind[0], device=kind[1])
        return flatten(grads, out=arena[start:start + n])


def scatter(result: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
    """Copy the flat ``result`` into each gradient (skipped where it already is that gradient)."""
    if len(grads) == 1:
        g = grads[0]
        if result.data_ptr() != g.data_ptr() or result.numel() != g.numel():
            g.copy_(result.view_as(g))
        return
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(result[offset:offset + n].view_as(g))
        offset += n


HELD = "held:"  # key prefix of a member's entry kept aside in a merged group: "held:<member>:<name>"


def join_state(states: Sequence[Mapping[str, torch.Tensor]], numels: Sequence[int]) -> State:
    """Member states -> the group's (each elementwise entry concatenated; absent entries as zeros).

    An entry that is not elementwise (its size is not its member's, e.g. PowerSGD's ``q``) cannot
    be concatenated; it belongs to a compressor that sends only groups of one tensor, so a merged
    group holding it is sent with fp16 or dense (per-group codec choice) and never reads it. It is
    kept aside under ``held:<member>:<name>`` and given back, unchanged, by ``split_state``."""
    if len(states) == 1:
        return dict(states[0])
    out: State = {}
    for i, (st, n) in enumerate(zip(states, numels)):
        out.update({f"{HELD}{i}:{k}": t for k, t in st.items() if t.numel() != n})
    keys = sorted({k for st, n in zip(states, numels) for k, t in st.items() if t.numel() == n})
    for k in keys:
        like = next(st[k] for st, n in zip(states, numels) if k in st and st[k].numel() == n)
        parts = [st[k].reshape(-1) if k in st and st[k].numel() == n else like.new_zeros(n)
                 for st, n in zip(states, numels)]
        out[k] = torch.cat(parts)
    return out


def split_state(state: Mapping[str, torch.Tensor], numels: Sequence[int]) -> List[State]:
    """The group's state -> one dict per member (copies, so a checkpoint never aliases live state)."""
    if len(numels) == 1:
        return [{k: t.detach().clone() for k, t in state.items()}]
    out: List[State] = [{} for _ in numels]
    held = [(k, t) for k, t in state.items() if k.startswith(HELD)]
    for k, t in state.items():
        if k.startswith(HELD):
            continue
        if t.numel() != sum(numels):
            raise ValueError(f"compression state '{k}' of a merged group has {t.numel()} elements; the "
                             f"group has {sum(numels)} (state must be elementwise to be merged)")
        offset = 0
        for st, n in zip(out, numels):
            st[k] = t.detach().reshape(-1)[offset:offset + n].clone()
            offset += n
    for k, t in held:  # last: a member's own entry wins over the zeros the concatenation padded it with
        member, _, name = k[len(HELD):].partition(":")
        out[int(member)][name] = t.detach().clone()
    return out
