"""A single-process stand-in for N ranks, for unit tests of exchange *semantics* only.

It drives N exchange generators in lockstep and answers their requests the way the collectives
define them (Allreduce: sum in rank order, written into every rank's tensor; Allgather: concatenate
in rank order). The tests that matter for distributed behaviour run real Horovod processes
(tests/test_multiprocess.py); this one lets the numpy oracle be compared quickly and exactly.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from torch_ops.collectives import Allgather, Allreduce, request_bytes


def run_lockstep(gens: Sequence) -> tuple:
    """Returns (result per rank, bytes sent per rank)."""
    n = len(gens)
    sent = [0] * n
    results: List = [None] * n
    inbox: List = [None] * n
    live = list(range(n))
    while live:
        requests = {}
        for r in live:
            try:
                requests[r] = gens[r].send(inbox[r]) if inbox[r] is not None else next(gens[r])
            except StopIteration as stop:
                results[r] = stop.value
        live = [r for r in live if results[r] is None]
        if not live:
            break
        assert len(live) == n, "ranks disagree on the number of rounds"
        rounds = [requests[r] for r in range(n)]
        assert len({len(x) for x in rounds}) == 1, "ranks disagree on the number of requests"
        for r in range(n):
            sent[r] += request_bytes(rounds[r])
        answers = [[] for _ in range(n)]
        for i in range(len(rounds[0])):
            kinds = {type(rounds[r][i]) for r in range(n)}
            assert len(kinds) == 1, "ranks disagree on the collective"
            if kinds == {Allreduce}:
                total = rounds[0][i].tensor.clone()
                for r in range(1, n):
                    total += rounds[r][i].tensor
                for r in range(n):
                    rounds[r][i].tensor.copy_(total)
                    answers[r].append(rounds[r][i].tensor)
            elif kinds == {Allgather}:
                cat = torch.cat([rounds[r][i].tensor for r in range(n)])
                for r in range(n):
                    answers[r].append(cat.clone())
            else:
                raise TypeError(kinds)
        inbox = [tuple(a) for a in answers]
    return results, sent
