"""The DiLoCo / Streaming DiLoCo / SparseLoCo outer loop in numpy: the oracle the PyTorch and
TensorFlow versions are tested against. The schedule and the arguments come from
``hvdcompress.diloco`` (its module doc states the rules); this module follows them step by step
for N simulated workers.

After inner step t (every worker has taken it; ``step(local)`` is given their parameters):

1. launch: if fragment p's exchange starts after step t, each worker forms its pseudo-gradient
   ``Delta_i = theta_global - theta_i`` (GLOBAL MINUS LOCAL) for every tensor of p and exchanges
   it with the compression spec (``oracle.simulate``: the spec's own oracle, with this worker's
   compression state, so error feedback acts on the pseudo-gradient; key = the tensor's name,
   step = how many times fragment p synced before). If any worker's Delta of a tensor holds a
   NaN or inf, the result is NaN on every worker and the non-finite state entries become 0 (the
   backends' non-finite guard).
2. apply: if fragment p is due after step t, the outer optimizer steps ``theta_global`` of p with
   the exchanged mean Delta, here SGD as torch's: ``buf = g`` on the first step, else ``buf = m *
   buf + g``; Nesterov ``d = g + m * buf``, else ``d = buf``; ``theta_global += -lr * d``. Every
   worker's p becomes ``theta_global + mix * (theta_i - theta_global)`` (``theta_i`` after the
   overlap's inner steps).

``flush()`` applies the fragment in flight, then syncs every fragment at once with mix 0, so
every worker holds ``theta_global``: identical replicas (for evaluation, checkpoints, the end).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from ..diloco import OUTER_LR, OUTER_MOMENTUM, OUTER_NESTEROV, check_arguments, split_fragments
from .oracle import simulate

F32 = np.float32


class DiLoCoReference:
    """N simulated workers' outer loop. ``params``: the initial parameters (identical on every
    worker), float32 arrays in model order; ``names``: their exchange keys (default ``p0``...)."""

    def __init__(self, params: Sequence[np.ndarray], world: int, sync_every: int, fragments: int = 1,
                 overlap_steps: int = 0, mix: float = 0.0, compression=None, lr: float = OUTER_LR,
                 momentum: float = OUTER_MOMENTUM, nesterov: bool = OUTER_NESTEROV,
                 names: Optional[Sequence[str]] = None):
        self.cfg = check_arguments(len(params), sync_every, fragments, overlap_steps, mix, compression)
        self.world = int(world)
        self.names = list(names) if names is not None else [f"p{i}" for i in range(len(params))]
        self.fragments = split_fragments([np.asarray(p).size for p in params], self.cfg.fragments)
        self.lr, self.momentum, self.nesterov = F32(lr), F32(momentum), bool(nesterov)
        self.theta = [np.asarray(p, F32).copy() for p in params]  # theta_global
        self.buf: List[Optional[np.ndarray]] = [None] * len(params)
        self.state: List[List[Dict[str, np.ndarray]]] = [[{} for _ in params] for _ in range(self.world)]
        self.rounds = [0] * self.cfg.fragments
        self.t = 0
        self.in_flight = None  # (fragment, due step, {tensor index: mean Delta})
        self.bytes_sent = [0] * self.world  # payload bytes each worker put on the wire

    # -- the two halves of a sync ---------------------------------------------------------------------
    def _launch(self, p: int, local: List[List[np.ndarray]]) -> Dict[int, np.ndarray]:
        out = {}
        for i in self.fragments[p]:
            deltas = [(self.theta[i] - np.asarray(local[r][i], F32)).astype(F32) for r in range(self.world)]
            states = [self.state[r][i] for r in range(self.world)]
            bad = any(not np.isfinite(d).all() for d in deltas)
            mean, _, sent = simulate(self.cfg.compression, [d.reshape(-1) for d in deltas], states,
                                     key=self.names[i], step=self.rounds[p], shape=self.theta[i].shape)
            for r in range(self.world):
                self.bytes_sent[r] += sum(int(np.asarray(t).nbytes) for rnd in sent[r] for t in rnd)
            if bad:
                mean = np.full(mean.shape, np.nan, F32)
                for st in states:
                    for v in st.values():
                        if isinstance(v, np.ndarray) and v.dtype.kind == "f":
                            v[~np.isfinite(v)] = 0
            out[i] = np.asarray(mean, F32).reshape(self.theta[i].shape)
        self.rounds[p] += 1
        return out

    def _apply(self, means: Dict[int, np.ndarray], local: List[List[np.ndarray]], mix: float) -> None:
        m, a = self.momentum, F32(mix)
        for i, g in means.items():
            if m != 0:
                self.buf[i] = g.copy() if self.buf[i] is None else (m * self.buf[i] + g).astype(F32)
                d = (g + m * self.buf[i]).astype(F32) if self.nesterov else self.buf[i]
            else:
                d = g
            self.theta[i] = (self.theta[i] + (-self.lr) * d).astype(F32)
            for r in range(self.world):
                if a == 0:
                    local[r][i] = self.theta[i].copy()
                else:
                    local[r][i] = (self.theta[i] + a * (np.asarray(local[r][i], F32) - self.theta[i])).astype(F32)

    # -- what the training loop calls -----------------------------------------------------------------
    def step(self, local: List[List[np.ndarray]]) -> List[List[np.ndarray]]:
        """After every worker's inner step: ``local[r]`` is worker r's parameters; returns them as
        the outer loop leaves them (new lists; the arrays given are not modified)."""
        local = [[np.asarray(x, F32).copy() for x in ps] for ps in local]
        self.t += 1
        p = self.cfg.launched_at(self.t)
        if p is not None:
            self.in_flight = (p, self.cfg.due(self.t), self._launch(p, local))
        if self.in_flight is not None and self.in_flight[1] == self.t:
            self._apply(self.in_flight[2], local, self.cfg.mix)
            self.in_flight = None
        return local

    def flush(self, local: List[List[np.ndarray]]) -> List[List[np.ndarray]]:
        """Apply the fragment in flight now, then sync every fragment with mix 0 (module doc)."""
        local = [[np.asarray(x, F32).copy() for x in ps] for ps in local]
        if self.in_flight is not None:
            self._apply(self.in_flight[2], local, self.cfg.mix)
            self.in_flight = None
        for p in range(self.cfg.fragments):
            self._apply(self._launch(p, local), local, 0.0)
        return local
