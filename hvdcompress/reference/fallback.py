"""numpy reference of a group sent dense or in fp16 under another compressor's state (the
planner's per-group codec choice; ``torch_ops.codec_choice`` and ``tf_ops`` follow it).

Per rank, with the compressor's state (absent entries are zeros):

    error feedback (state "residual" r):   a = g + r;              r <- 0
    local momentum m (state "u", "v"):     u <- m*u + g;  a = u (Nesterov: g + m*u) + v;  v <- 0
                                           (the EF quantizers with momentum inside carry "residual" as v)
    fp16:    the wire carries fp16(a); the carried entry (r or v, where the state has it) gets
             a - fp16(a) back, so the cast loses nothing
    result:  the sum over ranks, in rank order, in the wire's dtype, times ``scale``
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np

CODECS = ("fp16", "none")


def dense_send(g: np.ndarray, state: Dict[str, np.ndarray], codec: str,
               momentum: Optional[Tuple[float, bool]] = None) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
    """(what this rank puts on the wire, its new state) for one group of gradient ``g``;
    ``momentum``: (m, nesterov) for compressors that keep the momentum (DGC, the sketch)."""
    if codec not in CODECS:
        raise ValueError(f"codec: must be one of {', '.join(CODECS)}; got {codec!r}")
    state = {k: np.array(v, copy=True) for k, v in state.items()}
    slot = None
    if momentum is not None:
        m, nesterov = momentum
        u = state.get("u", np.zeros_like(g)) * g.dtype.type(m) + g
        state["u"] = u
        a = g + u * g.dtype.type(m) if nesterov else u.copy()
        for carried in ("v", "residual"):  # DGC / the sketch keep v; the EF quantizers a residual
            if carried in state:
                a = a + state[carried]
                state[carried], slot = np.zeros_like(g), carried
                break
    elif "residual" in state:
        a = g + state["residual"]
        state["residual"], slot = np.zeros_like(g), "residual"
    else:
        a = g.copy()
    if codec == "fp16":
        wire = a.astype(np.float16)
        if slot is not None:
            state[slot] = a - wire.astype(a.dtype)
        return wire, state
    return a, state


def dense_result(wires: Sequence[np.ndarray], scale: float, dtype=np.float32) -> np.ndarray:
    """The ranks' wires summed in rank order in the wire's dtype, then cast and scaled."""
    total = wires[0].copy()
    for w in wires[1:]:
        total = total + w
    return total.astype(dtype) * dtype(scale)
