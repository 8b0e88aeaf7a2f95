"""The two-level exchange in numpy: dense inside a node, the spec's own exchange across nodes (the oracle).

P ranks as N nodes of L ranks (``hvdcompress.topology.Topology``; node ``n`` holds ranks
``n*L .. n*L+L-1``). One exchange of a flat tensor of ``numel`` elements:

1. **Reduce-scatter inside each node** (dense, exact): the tensor is cut into L contiguous parts
   (``schedule.groups.split_layout``: ``slices(numel, L)``, or blocks of whole rows for one matrix), and
   local rank l ends with its node's sum of part l, added in local rank order
   ``((g_0 + g_1) + g_2) ...`` in float32.
2. **The spec's exchange across nodes**: local rank l of every node runs the spec's unchanged
   exchange (its oracle, ``oracle.simulate``) on its node's part l, with the N ranks at local
   position l (its cross group) as the world: ``world_size`` N, ``rank`` the node, ``shape`` and
   ``members`` the part's, ``key``, ``step``, ``epoch`` the exchange's, and ``scale`` the flat
   exchange's (1/P for an average): the cross exchange sums node sums, so the result is the mean
   over all P ranks exactly where the flat exchange returns the mean.
3. **Allgather inside each node**: the exchanged parts, concatenated in local rank order, are the
   result on every rank.

**State.** What the cross exchange keeps (residuals, DGC's momenta, PowerSGD's ``q``, ...) is the
state of (local rank l, part l): it lives on that rank only, and is computed from node sums, not
from one rank's gradient (error feedback compensates what the cross hop did not send of the node's
part). It is kept in the flat exchange's layout so checkpoints and merged groups keep working: an
entry as large as the part is stored in a tensor as large as the whole (the part at its place,
zeros elsewhere); any other entry (PowerSGD's ``q``: one per matrix, the columns are whole) as it
is. Every rank keeps the same keys, so a checkpoint's per-name sizes are the flat ones; its values
belong to the topology it was saved under.

**Non-finite values** are caught as in the flat exchange (any rank's non-finite entry makes the
result NaN on every rank; the backends' guard), not modelled here.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..contract import Member
from ..spec import resolve
from ..schedule.groups import Part, split_layout
from ..topology import Topology
from .oracle import simulate

State = Dict[str, np.ndarray]


def part_state(full: State, part: Part, numel: int) -> State:
    """The cross exchange's view of a rank's state: entries as large as the whole tensor cut to the
    part, others as they are (module doc)."""
    return {k: (v.reshape(-1)[part.start:part.stop].copy() if v.size == numel else v) for k, v in full.items()}


def store_state(full: State, inner: State, part: Part, numel: int) -> None:
    """Write the cross exchange's state back into the rank's flat-layout state (module doc)."""
    for k, v in inner.items():
        v = np.asarray(v)
        if v.size == part.numel and part.numel != numel:
            whole = full.get(k)
            if whole is None or whole.size != numel:
                whole = np.zeros(numel, dtype=v.dtype)
            whole = whole.reshape(-1).copy()
            whole[part.start:part.stop] = v.reshape(-1)
            full[k] = whole
        else:
            full[k] = v


def simulate_two_level(spec, grads: Sequence[np.ndarray], topology: Topology,
                       states: Optional[List[State]] = None, key: str = "", step: int = 0,
                       scale: Optional[float] = None, shape: Optional[Tuple[int, ...]] = None, epoch: int = 0,
                       members: Sequence[Member] = ()) -> Tuple[np.ndarray, List[State], Dict[str, List[int]]]:
    """One two-level exchange of ``spec`` among ``len(grads)`` ranks laid out as ``topology``.

    ``states[r]``: rank r's state (flat layout, updated in place). Returns (the result, the same
    on every rank; the states; the payload bytes each rank sent on each hop: ``{"local": [...],
    "cross": [...]}``, rank order). ``scale`` defaults to 1/P."""
    spec = resolve(spec)
    world, L = len(grads), topology.local_size
    if topology.world != world:
        raise ValueError(f"simulate_two_level: topology of {topology.world} ranks for {world} gradients")
    flat = [np.asarray(g, dtype=np.float32).reshape(-1) for g in grads]
    numel = flat[0].size
    scale = 1.0 / world if scale is None else scale
    states = states if states is not None else [{} for _ in range(world)]
    shape = tuple(shape) if shape is not None else tuple(np.asarray(grads[0]).shape)
    members = tuple(members) or (Member(key, shape, 0),)
    parts = split_layout(numel, shape, members, L)
    sent = {"local": [0] * world, "cross": [0] * world}
    out = np.empty(numel, dtype=np.float32)
    for lr, part in enumerate(parts):
        ranks = topology.cross_groups()[lr]  # local rank lr of every node, node order
        node_sums = []
        for r in ranks:
            node = topology.local_group(r)
            total = flat[node[0]][part.start:part.stop].copy()
            for q in node[1:]:
                total = (total + flat[q][part.start:part.stop]).astype(np.float32)
            node_sums.append(total)
        for r in ranks:  # what a rank hands the local hop: its whole tensor (the reduce-scatter's
            sent["local"][r] += (numel + part.numel) * 4  # all-to-all) and its exchanged part (the gather)
        if part.numel == 0:
            out[part.start:part.stop] = 0
            continue
        inner = [part_state(states[r], part, numel) for r in ranks]
        result, inner, payload = simulate(spec, node_sums, inner, key, step, scale, part.shape, epoch, part.members)
        for r, st, rounds in zip(ranks, inner, payload):
            store_state(states[r], st, part, numel)
            sent["cross"][r] += sum(int(t.nbytes) for rnd in rounds for t in rnd)
        out[part.start:part.stop] = np.asarray(result, dtype=np.float32).reshape(-1)
    return out, states, sent
