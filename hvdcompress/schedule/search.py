"""Searching the partitions of tensors (backward order) into consecutive groups.

Every function here takes per-tensor ``sizes`` (bytes) and backward times ``t_b``, the cost
functions ``t_s(bytes)`` (compress a group) and ``t_c(bytes)`` (exchange it), and the overlap
model of ``hvdcompress.schedule.timeline``; it returns a ``Search``: the groups, their modelled
backward/exchange end time, and ``gap`` (an upper bound on how far that time may be above the
optimum: 0 when the optimum is certified, None when unknown).

``optimal``: dynamic programming over the end of the last group. Write ``R_k`` for the backward
time of tensors 0..k-1. After a prefix the state is (S, C): compression time spent on the compute
stream (``shared`` overlap; always 0 with ``parallel``) and the end of the last exchange. Adding
the group [b, k)::

    S' = S + t_s(b, k)                     (shared)         S' = 0         (parallel)
    C' = max(C, R_k + S') + t_c(b, k)      (shared)         C' = max(C, R_k + t_s(b, k)) + t_c(b, k)

Both are non-decreasing in (S, C), so a state that another one matches or beats in both
coordinates can be dropped without losing the optimum; the answer is the smallest C at k = L.
``parallel``: one state per prefix (the smallest C), O(L^2) evaluations. ``shared``: a Pareto
front of (S, C) per prefix, O(L^2 * F) for fronts of F points. Fronts are kept small exactly by
branch and bound: a state whose lower bound ``max(C + minTC(k), R_L + S + minTS(k) + minLast(k))``
(minTC / minTS: the least total exchange / compression time of any partition of the tensors left,
themselves 1-D DPs; minLast: the cheapest last exchange) exceeds the best plan known (greedy,
the ``parallel`` optimum, layerwise, single, timed in the shared model) cannot lead to the optimum.
Should a front still exceed ``max_front`` points (default: ``default_max_front``, which keeps the
search near 1e7 state updates) it is thinned: a state is dropped when a kept one has C no larger
and S at most eps larger, eps = (S range) / max_front. The result is then certified within
``gap`` = min(sum of the eps used, result - least lower bound of a dropped state): the end time is
1-Lipschitz in S, and an optimal path that lost a state is no shorter than that state's bound.

``t_close(bytes)`` (optional, ``hvdcompress.schedule.timeline``): extra exchange time of the last group
only. ``optimal`` adds it on the transitions that close the partition (k = L), and to the
cheapest-last-exchange bound; the other bounds stay valid without it (it is >= 0).

``optimal_choice``: the same DP where each group is also sent by one of several ``Option`` s
(compression and exchange cost functions; the planner's per-group codec choice): one transition
per (boundary, option), each non-decreasing in (S, C), so the dominance and the bounds (taken as
the least over the options) carry over unchanged; ``cuts`` fixes the partition. An option that
does not merge (``Option.merges``) only makes the transitions of one-tensor groups, so a layerwise
compressor can be chosen for some tensors while fp16 or dense groups merge the others; the bounds
stay valid (they relax that restriction). ``optimal`` is its one-option case. ``brute_force_choice`` tries every partition and option (tests).

``greedy``: the rule of MGS (Shi et al., INFOCOM 2020) and MG-WFBP: walking in backward order,
the next tensor joins the open group when the extra time the group's data would wait for it is
less than the start-up cost saved, t_c(a) + t_c(b) - t_c(a + b). ``brute_force``: every partition.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .timeline import (as_cost_fn, check_inputs, check_overlap, check_partition, group_bytes, groups_from_ends,
                       predict, predict_costs)

MAX_FRONT = 512


class Search(NamedTuple):
    groups: List[List[int]]
    seconds: float          # modelled end of backward + exchanges (timeline.predict(...).end)
    gap: Optional[float]    # seconds the result may be above the optimum (0: optimal; None: unknown)


def layerwise(n: int) -> List[List[int]]:
    return [[i] for i in range(n)]


def single(n: int) -> List[List[int]]:
    return [list(range(n))] if n else []


def by_size(sizes_bytes: Sequence[float], threshold_bytes: float) -> List[List[int]]:
    """Fusion by size: a tensor joins the open group while the group stays <= threshold bytes;
    otherwise it starts a new one (a tensor larger than the threshold is a group of its own)."""
    groups: List[List[int]] = []
    total = 0.0
    for i, s in enumerate(sizes_bytes):
        if groups and total + s <= threshold_bytes:
            groups[-1].append(i)
            total += s
        else:
            groups.append([i])
            total = s
    return groups


class _Pool:
    """Append-only DP states: compression spent S, exchange end C, boundary k, parent state."""

    def __init__(self, capacity: int):
        self.spent, self.comm = np.zeros(capacity), np.zeros(capacity)
        self.boundary = np.zeros(capacity, dtype=np.int64)
        self.parent = np.full(capacity, -1, dtype=np.int64)
        self.size = 1  # state 0: nothing sent yet, boundary 0

    def append(self, spent, comm, boundary: int, parent) -> None:
        m, add = self.size, len(spent)
        if m + add > len(self.spent):
            grow = max(2 * len(self.spent), m + add)
            for name in ("spent", "comm", "boundary", "parent"):
                old = getattr(self, name)
                new = np.zeros(grow, dtype=old.dtype)
                new[:m] = old[:m]
                setattr(self, name, new)
        self.spent[m:m + add], self.comm[m:m + add] = spent, comm
        self.boundary[m:m + add], self.parent[m:m + add] = boundary, parent
        self.size = m + add

    def ends(self, state: int) -> List[int]:
        ends = []
        while state > 0:
            ends.append(int(self.boundary[state]))
            state = int(self.parent[state])
        return ends[::-1]


def _min_sum_suffix(cum: np.ndarray, fn) -> np.ndarray:
    """m[k] = least sum of fn(group bytes) over all partitions of tensors k..L-1 (m[L] = 0)."""
    n = len(cum) - 1
    m = np.zeros(n + 1)
    for b in range(n - 1, -1, -1):
        m[b] = np.min(fn(cum[b + 1:] - cum[b]) + m[b + 1:])
    return m


def _pareto(spent: np.ndarray, comm: np.ndarray) -> np.ndarray:
    """Indices of the states no other state matches or beats in both S and C, by S ascending."""
    order = np.lexsort((comm, spent))
    c = comm[order]
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = c[1:] < np.minimum.accumulate(c)[:-1]
    return order[keep]


def _thin(front: np.ndarray, spent: np.ndarray, max_front: int):
    """Thin a Pareto front (S ascending, C descending) to about max_front points; returns the
    kept indices, the dropped ones and the eps used (0 when nothing was dropped)."""
    if len(front) <= max_front:
        return front, front[:0], 0.0
    s = spent[front]
    eps = (s[-1] - s[0]) / max_front
    keep = np.zeros(len(front), dtype=bool)
    keep[-1], last = True, s[-1]  # walking down in S: a point within eps of the last kept one is covered
    for i in range(len(front) - 2, -1, -1):
        if s[i] < last - eps:
            keep[i], last = True, s[i]
    return front[keep], front[~keep], float(eps)


def default_max_front(n: int) -> int:
    """Front size allowed for n tensors: the whole search stays around 1e7 state updates."""
    return int(min(MAX_FRONT, max(16, 2e7 / max(n, 1) ** 2)))


def optimal(sizes, t_b, t_s: Callable, t_c: Callable, overlap: str = "shared",
            max_front: Optional[int] = None, t_close: Optional[Callable] = None) -> Search:
    """The partition with the least modelled end time (module doc)."""
    found = optimal_choice(sizes, t_b, [(t_s, t_c, t_close)], overlap, max_front)
    return Search(found.groups, found.seconds, found.gap)


class Option(NamedTuple):
    """One way to send a group: ``t_s(bytes)``, ``t_c(bytes)`` and the closing term (or None).
    ``merges=False``: it sends groups of one tensor only (a compressor whose state is shaped by the
    tensor, ``merge=LAYERWISE``); the search never gives it a larger group. ``t_step``: the
    exchange times (alone, queued) of a training step, for predictions only (``timeline``), or None."""

    t_s: Callable
    t_c: Callable
    t_close: Optional[Callable] = None
    merges: bool = True
    t_step: Optional[Tuple[Callable, Callable]] = None


class ChoiceSearch(NamedTuple):
    groups: List[List[int]]
    choices: List[int]      # per group: the index of its option
    seconds: float
    gap: Optional[float]


def predict_choice(groups, choices: Sequence[int], sizes, t_b, options: Sequence,
                   overlap: str = "shared", t_d: Optional[Sequence[Optional[Callable]]] = None,
                   tensor_comm: Optional[Sequence[Optional[Callable]]] = None):
    """``timeline.predict`` where group g is sent by ``options[choices[g]]`` (``t_d``: one
    decompression cost function or None per option, for the prediction). ``tensor_comm``: per
    option None or a function of a tensor's index giving (t_c, (t_alone, t_queued) or None) of
    that tensor sent alone (its shape's wire cost), used for that option's groups of one tensor."""
    check_overlap(overlap)
    sizes, t_b = check_inputs(sizes, t_b)
    groups = check_partition(groups, len(sizes))
    options = [Option(*o) for o in options]
    if len(choices) != len(groups) or any(not 0 <= int(c) < len(options) for c in choices):
        raise ValueError(f"choices: one option index in [0, {len(options)}) per group; got {list(choices)}")
    for g, c in zip(groups, choices):
        if len(g) > 1 and not options[int(c)].merges:
            raise ValueError(f"choices: option {int(c)} sends groups of one tensor only (merges=False); "
                             f"group {list(g)} has {len(g)}")
    nbytes = group_bytes(groups, sizes)

    def cost(fn, g):
        return 0.0 if fn is None else float(as_cost_fn(fn)(nbytes[g:g + 1])[0])

    ts = [cost(options[c].t_s, g) for g, c in enumerate(choices)]
    tc = [cost(options[c].t_c, g) for g, c in enumerate(choices)]
    td = None if t_d is None or all(f is None for f in t_d) else [cost(t_d[c], g) for g, c in enumerate(choices)]
    close = cost(options[choices[-1]].t_close, len(groups) - 1) if len(groups) else None
    step = None
    if any(o.t_step is not None for o in options):
        both = [options[c].t_step or (options[c].t_c, options[c].t_c) for c in choices]
        step = ([cost(f[0], g) for g, f in enumerate(both)], [cost(f[1], g) for g, f in enumerate(both)])
    for g, c in enumerate(choices):
        fn = tensor_comm[int(c)] if tensor_comm is not None else None
        if fn is None or len(groups[g]) != 1:
            continue
        tc[g], per_step = fn(groups[g][0])
        if step is not None:
            alone, queued = per_step if per_step is not None else (tc[g], tc[g])
            step[0][g], step[1][g] = alone, queued
    return predict_costs(groups, t_b, ts, tc, overlap, td, close, step)


def optimal_choice(sizes, t_b, options: Sequence, overlap: str = "shared", max_front: Optional[int] = None,
                   cuts: Optional[Sequence[int]] = None) -> ChoiceSearch:
    """The partition into consecutive groups and, per group, the ``Option`` to send it with, of the
    least modelled end time: the DP of the module doc with one transition per (boundary, option).
    The state (S, C) and the dominance argument are unchanged: each option's transition is
    non-decreasing in (S, C). ``cuts``: the allowed group ends (a fixed partition; None: any)."""
    check_overlap(overlap)
    sizes, t_b = check_inputs(sizes, t_b)
    options = [Option(*o) for o in options]
    if not options:
        raise ValueError("options: at least one way to send a group is needed")
    n = len(sizes)
    if n == 0:
        return ChoiceSearch([], [], 0.0, 0.0)
    allowed = np.ones(n + 1, dtype=bool)
    if cuts is not None:
        allowed[:] = False
        allowed[[int(c) for c in cuts]] = True
        if not allowed[n]:
            raise ValueError(f"cuts: must end with the number of tensors ({n}); got {list(cuts)}")
        allowed[0] = True
    if not any(o.merges for o in options) and cuts is not None and np.any(np.diff([0, *map(int, cuts)]) > 1):
        raise ValueError("cuts: a group of several tensors needs an option that merges; no option does")
    ts_fns = [as_cost_fn(o.t_s) for o in options]
    tc_fns = [as_cost_fn(o.t_c) for o in options]
    close_fns = [as_cost_fn(o.t_close) if o.t_close is not None else (lambda b: np.zeros_like(b))
                 for o in options]
    shared = overlap == "shared"
    cum = np.concatenate([[0.0], np.cumsum(sizes)])
    ready = np.concatenate([[0.0], np.cumsum(t_b)])
    upper, upper_plan = math.inf, None
    if shared:  # bounds for branch and bound: the least over the options of every cost
        def least(fns):
            return lambda b: np.min([f(b) for f in fns], axis=0)

        if cuts is None:
            for c, o in enumerate(options):
                plans = ((greedy(sizes, t_b, o.t_s, o.t_c, overlap, o.t_close).groups, layerwise(n), single(n),
                          optimal_choice(sizes, t_b, [o], "parallel").groups) if o.merges else (layerwise(n),))
                for g in plans:
                    end = predict(g, sizes, t_b, ts_fns[c], tc_fns[c], overlap, t_close=o.t_close).end
                    if end < upper:
                        upper, upper_plan = end, (g, [c] * len(g))
        min_tc, min_ts = _min_sum_suffix(cum, least(tc_fns)), _min_sum_suffix(cum, least(ts_fns))
        last_bytes = cum[-1] - cum[:-1]
        min_last = np.append(np.minimum.accumulate(
            np.min([tc(last_bytes) + cl(last_bytes) for tc, cl in zip(tc_fns, close_fns)], axis=0)[::-1])[::-1], 0.0)
        slack = 1e-12 * max(upper, 1e-300) if math.isfinite(upper) else 0.0
    pool = _Pool(4 * n + 16)
    choice = [0]  # per state: the option of its last group
    eps_sum, dropped_bound = 0.0, math.inf
    max_front = default_max_front(n) if max_front is None else max(1, int(max_front))
    prev_cut = 0
    for k in range(1, n + 1):
        if not allowed[k]:
            continue
        states = np.arange(pool.size)
        if cuts is not None:  # a fixed partition: the group is [previous cut, k)
            states = states[pool.boundary[:pool.size] == prev_cut]
            prev_cut = k
        m = len(states)
        spent, comm, boundary = pool.spent[states], pool.comm[states], pool.boundary[states]
        group_bytes = cum[k] - cum[:k]  # the group [b, k) for every boundary b < k
        all_spent, all_comm, all_parent, all_choice = [], [], [], []
        for c in range(len(options)):
            sel = slice(None) if options[c].merges else np.flatnonzero(boundary == k - 1)  # groups of one only
            b_c = boundary[sel]
            ts, tc = ts_fns[c](group_bytes)[b_c], tc_fns[c](group_bytes)[b_c]
            if k == n:  # the closing exchange
                tc = tc + close_fns[c](group_bytes)[b_c]
            if shared:
                new_spent = spent[sel] + ts
                new_comm = np.maximum(comm[sel], ready[k] + new_spent) + tc
            else:
                new_spent = np.zeros(len(b_c))
                new_comm = np.maximum(comm[sel], ready[k] + ts) + tc
            all_spent.append(new_spent)
            all_comm.append(new_comm)
            all_parent.append(states[sel])
            all_choice.append(np.full(len(b_c), c))
        new_spent, new_comm = np.concatenate(all_spent), np.concatenate(all_comm)
        parent, chosen = np.concatenate(all_parent), np.concatenate(all_choice)
        if shared:
            lower = np.maximum(new_comm + min_tc[k], ready[n] + new_spent + min_ts[k] + min_last[k])
            alive = np.flatnonzero(lower <= upper + slack)
            front = alive[_pareto(new_spent[alive], new_comm[alive])]
            front, dropped, eps = _thin(front, new_spent, max_front)
            eps_sum += eps
            if len(dropped):
                dropped_bound = min(dropped_bound, float(lower[dropped].min()))
        else:
            front = np.array([int(np.argmin(new_comm))]) if len(new_comm) else np.array([], dtype=int)
        pool.append(new_spent[front], new_comm[front], k, parent[front])
        choice.extend(int(c) for c in chosen[front])
    last = np.flatnonzero(pool.boundary[:pool.size] == n)
    if len(last) == 0:  # every path was cut by the bound: the known plan is optimal
        groups, picks = upper_plan
        return ChoiceSearch([list(g) for g in groups], list(picks), float(upper), 0.0)
    state = int(last[np.argmin(pool.comm[last])])
    found = float(pool.comm[state])
    # the optimum is found, or a thinned state lies on an optimal path (>= its lower bound), or
    # the path got within eps of each thinning it passed through
    gap = max(0.0, min(eps_sum, found - dropped_bound)) if eps_sum else 0.0
    if shared and upper < found:
        groups, picks = upper_plan
        return ChoiceSearch([list(g) for g in groups], list(picks), float(upper), max(0.0, gap - (found - upper)))
    picks, s = [], state
    while s > 0:
        picks.append(choice[s])
        s = int(pool.parent[s])
    return ChoiceSearch(groups_from_ends(pool.ends(state)), picks[::-1], found, gap)


def greedy(sizes, t_b, t_s: Callable, t_c: Callable, overlap: str = "shared",
           t_close: Optional[Callable] = None) -> Search:
    """The MGS / MG-WFBP greedy rule (module doc); ``t_close`` only enters the returned time."""
    check_overlap(overlap)
    sizes, t_b = check_inputs(sizes, t_b)
    n = len(sizes)
    if n == 0:
        return Search([], 0.0, 0.0)
    ts_fn, tc_fn = as_cost_fn(t_s), as_cost_fn(t_c)

    def ts(b):
        return float(ts_fn(np.array([b]))[0])

    def tc(b):
        return float(tc_fn(np.array([b]))[0])

    groups, start, open_bytes = [], 0, float(sizes[0])
    now = float(t_b[0])  # when the open group's last gradient is ready on the compute stream
    comm_free = 0.0
    for x in range(1, n):
        alone_ready = now + ts(open_bytes)           # close the open group: compressed at ...
        alone_start = max(comm_free, alone_ready)    # ... and on the wire at
        merged = open_bytes + float(sizes[x])
        wait = now + float(t_b[x]) + ts(merged) - alone_start  # extra wait of the group's data
        saved = tc(open_bytes) + tc(float(sizes[x])) - tc(merged)
        if wait < saved:
            open_bytes = merged
            now += float(t_b[x])
        else:
            groups.append(list(range(start, x)))
            comm_free = alone_start + tc(open_bytes)
            now = (alone_ready if overlap == "shared" else now) + float(t_b[x])
            start, open_bytes = x, float(sizes[x])
    groups.append(list(range(start, n)))
    return Search(groups, predict(groups, sizes, t_b, ts_fn, tc_fn, overlap, t_close=t_close).end, None)


def brute_force_choice(sizes, t_b, options: Sequence, overlap: str = "shared",
                       max_tensors: int = 10) -> ChoiceSearch:
    """Every partition and every option per group, timed by ``predict_choice`` (for tests)."""
    sizes, t_b = check_inputs(sizes, t_b)
    n = len(sizes)
    if n > max_tensors:
        raise ValueError(f"brute_force_choice: {n} tensors; at most {max_tensors}")
    options = [Option(*o) for o in options]
    best = ChoiceSearch([], [], math.inf, 0.0)
    for cuts in itertools.product((False, True), repeat=max(n - 1, 0)):
        groups = groups_from_ends([i + 1 for i, cut in enumerate(cuts) if cut] + [n])
        for picks in itertools.product(range(len(options)), repeat=len(groups)):
            if any(len(g) > 1 and not options[c].merges for g, c in zip(groups, picks)):
                continue
            end = predict_choice(groups, picks, sizes, t_b, options, overlap).end
            if end < best.seconds:
                best = ChoiceSearch(groups, list(picks), end, 0.0)
    return best


def brute_force(sizes, t_b, t_s: Callable, t_c: Callable, overlap: str = "shared",
                max_tensors: int = 16, t_close: Optional[Callable] = None) -> Search:
    """Every one of the 2^(L-1) partitions, timed by ``timeline.predict`` (for tests)."""
    sizes, t_b = check_inputs(sizes, t_b)
    n = len(sizes)
    if n > max_tensors:
        raise ValueError(f"brute_force: {n} tensors means 2^{n - 1} partitions; at most {max_tensors}")
    if n == 0:
        return Search([], 0.0, 0.0)
    best, best_groups = math.inf, None
    for cuts in itertools.product((False, True), repeat=n - 1):
        groups = groups_from_ends([i + 1 for i, cut in enumerate(cuts) if cut] + [n])
        end = predict(groups, sizes, t_b, t_s, t_c, overlap, t_close=t_close).end
        if end < best:
            best, best_groups = end, groups
    return Search(best_groups, best, 0.0)
