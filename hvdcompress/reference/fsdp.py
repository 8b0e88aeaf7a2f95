"""Reference for a reduce-scatter through a compressor (sharded data parallelism, FSDP2).

A reduce-scatter over W ranks takes from every rank r a flat input of W equal chunks
``x_r = [x_r^0 | x_r^1 | ... | x_r^(W-1)]`` and leaves rank j with ``sum_r x_r^j`` (times the
average's 1/W where asked). Through a compressor, chunk j is an exchange of its own, keyed by its
name (``names[j]``): every rank r encodes ``x_r^j`` with its state for that name (residual, ...),
sends the payload to rank j only, and rank j decodes the W payloads and sums them in rank order,
exactly as the compressor's all-reduce of that chunk would (``oracle.simulate``). Rank j's output
is therefore the all-reduce result of chunk j, and every rank's state for name j is what that
all-reduce leaves behind.

This holds only for compressors whose exchange is one round of payloads that the owner of a chunk
can decode alone, and whose state is settled before the payload leaves (the sender never sees the
other ranks' payloads of a chunk it does not own): ``refusal`` names the ones that are not.

Non-finite values are never hidden: when any rank's input holds a NaN or inf, every rank's output
is NaN and every non-finite entry of the compression state is set to 0 (the rule of the optimizers'
guard, ``torch_ops.nonfinite``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..contract import LAYERWISE, Member
from ..spec import CompressionSpec, resolve
from ..topology import Topology
from .oracle import simulate

State = Dict[str, np.ndarray]

RESIDUAL_MODES = ("none", "full", "int8")
INT8_BLOCK = 256  # entries per fp32 scale of an 8-bit residual


def refusal(spec) -> Optional[str]:
    """Why ``spec`` cannot run as a reduce-scatter (None when it can)."""
    spec = resolve(spec)
    multi = {"powersgd": "its P and Q factors are two all-reduce rounds, and the second needs the first's sum "
                         "on every rank",
             "sketch": "its exact values at the candidates are a second round chosen from the summed sketch"}
    if spec.name in multi:
        return f"compression '{spec.name}' cannot be a reduce-scatter: {multi[spec.name]}"
    if spec.name == "terngrad" and spec["share_scale"]:
        return ("compression 'terngrad' with share_scale=true cannot be a reduce-scatter: every rank quantizes "
                "with the max of the gathered scales, a round before the codes (use share_scale=false)")
    if spec.name == "dgc" and not spec["momentum_correction"]:
        return ("compression 'dgc' with momentum_correction=false cannot be a reduce-scatter: its momentum is "
                "applied to the exchanged average, which only the chunk's owner sees (use momentum_correction=true)")
    wire = spec.info.wire
    rounds = len(wire(spec.params, np.array([4096.0]), 4, 2, 1.0)) if wire is not None else 1
    if rounds > 1:  # any other algorithm declared with more than one round
        return (f"compression '{spec.name}' cannot be a reduce-scatter: it exchanges in {rounds} rounds, and a "
                "reduce-scatter carries one round whose payloads the chunk's owner decodes alone")
    return None


def with_residual(spec, residual: Optional[str]) -> CompressionSpec:
    """The spec a residual mode runs: ``None`` keeps the spec; "none" turns error feedback off,
    "full" and "int8" on (the spec's ``residual`` parameter). ValueError when the mode is unknown
    or the spec cannot honour it."""
    spec = resolve(spec)
    if residual is None:
        return spec
    if residual not in RESIDUAL_MODES:
        raise ValueError(f"residual must be one of {', '.join(map(repr, RESIDUAL_MODES))} or None (the spec's own "
                         f"setting); got {residual!r}")
    has = "residual" in spec.params
    if residual == "none":
        if has:
            return spec(residual=False)
        if spec.name in ("dgc", "sparseloco"):
            raise ValueError(f"residual='none': compression '{spec.name}' keeps its accumulator as part of the "
                             "algorithm; use residual='full' or 'int8', or an unbiased quantizer (qsgd, terngrad)")
        return spec
    if has:
        return spec(residual=True)
    if spec.name in ("dgc", "sparseloco"):
        return spec
    raise ValueError(f"residual={residual!r}: compression '{spec.name}' keeps no residual (nothing to store); "
                     "use residual='none' or None")


def shard_names(prefix: str, world: int) -> List[str]:
    """The state names of one sharded module's W chunks: ``<prefix>#shard<j>``."""
    return [f"{prefix}#shard{j}" for j in range(world)]


def chunk_layout(params: Sequence[Tuple[str, Tuple[int, ...]]], world: int):
    """(shape, members, numel) of one chunk of a sharded module's reduce-scatter input.

    FSDP2 pads each parameter's dim 0 to a multiple of the world size and puts rows
    ``[j * rows, (j + 1) * rows)`` of every parameter, in order, into chunk j, so every chunk holds
    one piece of each parameter: a member (name, (rows, *rest), offset). The chunk's shape follows
    the merged groups' rule (``torch_ops.grouping``): a piece's own shape for one member, ``(numel,)``
    when every member is 1-D, else ``(1, numel)``."""
    members, offset = [], 0
    for name, shape in params:
        shape = tuple(shape) or (1,)
        rows = -(-shape[0] // world)
        piece = (rows, *shape[1:])
        members.append(Member(name, piece, offset))
        offset += int(np.prod(piece))
    if len(members) == 1:
        shape = members[0].shape
    else:
        shape = (offset,) if all(len(m.shape) == 1 for m in members) else (1, offset)
    return shape, tuple(members), offset


def int8_encode(t: np.ndarray, block: int = INT8_BLOCK) -> Tuple[np.ndarray, np.ndarray]:
    """An 8-bit residual (an error buffer in 8 bits, as LoCo keeps one): per block of ``block``
    entries the scale s = max|t| / 127 (fp32) and codes round(t / s) in [-127, 127] (half to even)."""
    t = np.asarray(t, dtype=np.float32).reshape(-1)
    n = t.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:n] = t
    amax = np.abs(padded.reshape(blocks, block)).max(axis=1) if n else np.zeros(0, np.float32)
    scales = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
    codes = np.rint(padded.reshape(blocks, block) / safe[:, None]).clip(-127, 127).astype(np.int8)
    return codes.reshape(-1)[:n], scales


def int8_decode(codes: np.ndarray, scales: np.ndarray, block: int = INT8_BLOCK) -> np.ndarray:
    n = codes.size
    expanded = np.repeat(scales, block)[:n]
    return (codes.astype(np.float32) * expanded).astype(np.float32)


def _compact(st: State) -> State:
    """The at-rest form of a state under residual='int8': its residual in 8 bits."""
    if "residual" not in st:
        return st
    codes, scales = int8_encode(st.pop("residual"))
    st["residual_q8"], st["residual_scale"] = codes, scales
    return st


def _expand(st: State) -> State:
    if "residual_q8" in st:
        st["residual"] = int8_decode(st.pop("residual_q8"), st.pop("residual_scale"))
    return st


def reduce_scatter(spec, inputs: Sequence[np.ndarray], states: Optional[List[Dict[str, State]]] = None, *,
                   names: Sequence[str], step: int = 0, scale: float = 1.0, epoch: int = 0,
                   residual: Optional[str] = None, shape: Optional[Tuple[int, ...]] = None,
                   members: Sequence[Member] = ()):
    """One reduce-scatter of ``inputs`` (rank r's flat input, W equal chunks) through ``spec``.

    ``states[r][names[j]]``: rank r's state for chunk j (updated in place). Returns (outputs, the
    states, sent) where ``outputs[j]`` is rank j's shard and ``sent[r]`` the payload bytes rank r
    put on the wire to other ranks."""
    spec = with_residual(spec, residual)
    why = refusal(spec)
    if why:
        raise ValueError(why)
    world = len(inputs)
    flat = [np.asarray(x).reshape(-1) for x in inputs]
    if any(x.size != flat[0].size for x in flat) or flat[0].size % world:
        raise ValueError("reduce_scatter: every rank's input must have the same size, a multiple of the world size")
    size = flat[0].size // world
    states = states if states is not None else [{} for _ in range(world)]
    shape = tuple(shape) if shape is not None else (size,)
    outputs, sent = [], [0] * world
    for j, name in enumerate(names):
        per_rank = [_expand(st.setdefault(name, {})) for st in states]
        chunks = [x[j * size:(j + 1) * size] for x in flat]
        out, _, wire = simulate(spec, chunks, per_rank, key=name, step=step, scale=scale, shape=shape,
                                epoch=epoch, members=tuple(members) or (Member(name, (size,), 0),))
        for r in range(world):
            if r != j:
                sent[r] += sum(np.asarray(t).nbytes for rnd in wire[r] for t in rnd)
        outputs.append(np.asarray(out))
    if any(not np.isfinite(x).all() for x in flat):
        outputs = [np.full_like(o, np.nan) for o in outputs]
        for st in states:
            for per in st.values():
                for k, t in per.items():
                    if np.issubdtype(np.asarray(t).dtype, np.floating):
                        t[~np.isfinite(t)] = 0
    if residual == "int8":
        for st in states:
            for name in names:
                _compact(st[name])
    return outputs, states, sent


def state_bytes(spec, world: int, numel: int, residual: Optional[str] = None) -> float:
    """Bytes of compression state one rank keeps per parameter of a model of ``numel`` parameters
    sharded over ``world`` ranks, measured on the oracle's state after two reduce-scatters."""
    rng = np.random.default_rng(0)
    rows = 100  # one weight matrix of numel entries, 100 columns
    shape, members, size = chunk_layout((("w", (-(-numel // rows), rows)),), world)
    names = shard_names("m", world)
    states = None
    for step in range(2):
        inputs = [rng.standard_normal(size * world).astype(np.float32) for _ in range(world)]
        _, states, _ = reduce_scatter(spec, inputs, states, names=names, step=step, residual=residual, shape=shape,
                                      members=members)
    held = sum(np.asarray(t).nbytes for per in states[0].values() for t in per.values())
    return held / (size * world)


def across_units(prefix: str, position: int, shape: Tuple[int, ...], members: Sequence[Member], layerwise: bool):
    """The exchanges across nodes of the shard at local position ``position`` of a sharded module
    (two-level layout): (name, start, stop, shape, members) of each. The shard is one exchange,
    ``<prefix>#shard<position>``, with the chunk's shape and members; a layerwise compressor
    (PowerSGD) is never merged, so it exchanges each member's piece alone, ``<member>#shard<position>``."""
    if not layerwise:
        numel = sum(int(np.prod(m.shape)) for m in members)
        return [(f"{prefix}#shard{position}", 0, numel, tuple(shape), tuple(members))]
    out = []
    for m in members:
        name = f"{m.name}#shard{position}"
        piece = tuple(m.shape)
        out.append((name, m.offset, m.offset + int(np.prod(piece)), piece, (Member(name, piece, 0),)))
    return out


def _zero_nonfinite(per: State) -> None:
    for t in per.values():
        if np.issubdtype(np.asarray(t).dtype, np.floating):
            t[~np.isfinite(t)] = 0


def hybrid_reduce_scatter(spec, inputs: Sequence[np.ndarray], topology: Topology,
                          states: Optional[List[Dict[str, State]]] = None,
                          inside_states: Optional[List[Dict[str, State]]] = None, *, prefix: str, step: int = 0,
                          inside=None, inside_scale: Optional[float] = None, residual: Optional[str] = None,
                          shape: Optional[Tuple[int, ...]] = None, members: Sequence[Member] = (), epoch: int = 0):
    """One sharded module's gradient reduction in the two-level layout: shard inside a node,
    replicate across nodes, compress only the hop across.

    ``inputs[r]``: rank r's flat reduce-scatter input over its node (``topology.local_size`` equal
    chunks, FSDP's layout). Inside each node, chunk l goes to the node's rank at local position l:
    summed densely in local rank order (``inside`` None: FSDP's own reduce-scatter) or through the
    compressor ``inside`` (``reduce_scatter``, with ``inside_states``), times ``inside_scale``
    (default the node's average, 1/L). When a rank's input held a NaN or inf, all its node's
    shards are NaN (a 4-byte flag inside the node; ``reduce_scatter`` has its own). Across nodes,
    the shards at each local position l (one per node, node order) are all-reduced through
    ``spec`` (``across_units``: ``oracle.simulate``, the average over the nodes, each rank's state
    ``states[r][name]``) and the result replaces every one of them; the non-finite guard of every
    exchange holds (NaN result, non-finite state set to 0).

    Returns (outputs, shards, states, inside_states, sent): rank r's final shard, its shard after the
    inside hop, the states (updated in place) and the payload bytes rank r sent across nodes."""
    spec = with_residual(spec, residual)
    inside = resolve(inside) if inside is not None else None
    if inside is not None and refusal(inside):
        raise ValueError(refusal(inside))
    world, local, nodes = topology.world, topology.local_size, topology.nodes
    flat = [np.asarray(x).reshape(-1) for x in inputs]
    if len(flat) != world or any(x.size != flat[0].size for x in flat) or flat[0].size % local:
        raise ValueError("hybrid_reduce_scatter: one input per rank, all of one size, a multiple of local_size")
    size = flat[0].size // local
    shape = tuple(shape) if shape is not None else (size,)
    members = tuple(members) or (Member(prefix, (size,), 0),)
    scale = 1.0 / local if inside_scale is None else inside_scale
    states = states if states is not None else [{} for _ in range(world)]
    inside_states = inside_states if inside_states is not None else [{} for _ in range(world)]
    shards: List[Optional[np.ndarray]] = [None] * world
    flagged = [False] * nodes  # dense inside: a node-mate's non-finite input makes the node's shards NaN
    for node in range(nodes):
        ranks = topology.local_group(node * local)
        xs = [flat[r] for r in ranks]
        if inside is None:
            for j, r in enumerate(ranks):
                total = xs[0][j * size:(j + 1) * size].astype(np.float32)
                for x in xs[1:]:
                    total = total + x[j * size:(j + 1) * size]
                shards[r] = (total * np.float32(scale)).astype(np.float32)
            flagged[node] = any(not np.isfinite(x).all() for x in xs)
        else:
            outs, _, _ = reduce_scatter(inside, xs, [inside_states[r] for r in ranks], names=shard_names(prefix, local),
                                        step=step, scale=scale, shape=shape, members=members, epoch=epoch)
            for j, r in enumerate(ranks):
                shards[r] = np.asarray(outs[j], dtype=np.float32).reshape(-1)
    sent_in = [np.full(size, np.nan, np.float32) if flagged[topology.node_of(r)] else shards[r] for r in range(world)]
    layerwise = spec.info.merge == LAYERWISE
    outputs = [s.copy() for s in sent_in]
    sent = [0] * world
    for position in range(local):
        ranks = topology.cross_group(position)
        for name, start, stop, piece, mem in across_units(prefix, position, shape, members, layerwise):
            per = [_expand(states[r].setdefault(name, {})) for r in ranks]
            chunks = [sent_in[r][start:stop] for r in ranks]
            out, _, wire = simulate(spec, chunks, per, key=name, step=step, scale=1.0 / nodes, shape=piece,
                                    epoch=epoch, members=mem)
            out = np.asarray(out).reshape(-1)
            if any(not np.isfinite(c).all() for c in chunks):
                out = np.full_like(out, np.nan)
                for st in per:
                    _zero_nonfinite(st)
            for i, (r, st) in enumerate(zip(ranks, per)):
                outputs[r][start:stop] = out
                sent[r] += sum(np.asarray(t).nbytes for rnd in wire[i] for t in rnd)
                if residual == "int8":
                    _compact(st)
    return outputs, shards, states, inside_states, sent


# the rows of docs/fsdp.md's state table: (spec, residual mode)
STATE_TABLE = (("qsgd:levels=7,bucket=128", "none"), ("qsgd:levels=7,bucket=128", "full"),
               ("qsgd:levels=7,bucket=128", "int8"), ("topk:ratio=0.01", "full"), ("topk:ratio=0.01", "int8"),
               ("dgc:ratio=0.01", None), ("fp16", None))


def state_table(world: int = 4, numel: int = 10_000) -> str:
    """docs/fsdp.md's table: compression state per parameter and rank next to plain FSDP2's
    sharded parameter, gradient and AdamW moments (4 + 4 + 8 bytes of fp32 per parameter, split
    over the ranks)."""
    plain = 16.0 / world
    rows = [f"| plain FSDP2 (fp32 parameter, gradient, AdamW's 2 moments) | | {plain:.2f} |"]
    for spec, residual in STATE_TABLE:
        rows.append(f"| `{spec}` | {residual or '(spec)'} | {state_bytes(spec, world, numel, residual):.2f} |")
    return "\n".join(["| per rank, bytes per model parameter | residual | bytes |", "|---|---|---|", *rows])
