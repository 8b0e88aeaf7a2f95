"""Our compressors inside FSDP2 (``torch.distributed.fsdp.fully_shard``): a compressing reduce-scatter.

    model = fully_shard(...)                       # as usual, on a 1-D device mesh
    fsdp = hvdcompress.fsdp.compress(model, "qsgd:levels=7,bucket=128")

FSDP2 reduce-scatters each sharded module's gradients once per backward: every rank hands over a
flat input of W equal chunks (chunk j: the gradient entries rank j owns, padded), and rank j keeps
the sum of the ranks' chunks j. ``compress`` installs a ``ReduceScatter`` (FSDP2's
``set_custom_reduce_scatter``) on every sharded module of the model that does this through a
compressor (the numpy reference ``hvdcompress.reference.fsdp`` defines the result):

* every rank encodes each chunk j with its state for that chunk (residual, ...), named
  ``<module>#shard<j>``: chunk j is the compressor's exchange of that name, and its state is kept
  per name by the front end's ``ExchangeSession`` (``torch_ops.session``), as every front end's;
* the payloads travel by all-to-all (``Alltoall`` requests on a ``TorchDistCommunicator``: gloo and
  NCCL both have ``all_to_all_single``; payloads of varying size send their sizes first): rank j
  receives the payloads of chunk j only;
* rank j decodes them and sums them in rank order: the result is the compressor's all-reduce of
  chunk j, written into FSDP's output shard; ``op`` is honoured (SUM: the sum; AVG: times 1/W;
  FSDP's pre- and post-division happen around the call as without us).

Only compressors with one round of payloads that a chunk's owner can decode alone, and with their
state settled before the payload leaves, fit (``hvdcompress.reference.fsdp.refusal``: PowerSGD and
the sketch are refused, on every rank, before any collective). The non-finite rule of the other
front ends holds (``torch_ops.nonfinite``): one 4-byte flag per reduce-scatter, summed with the
payloads; when any rank's gradient held a NaN or inf, every rank's shard is NaN and non-finite
compression state is zeroed.

Error feedback and sharding's memory budget (``residual=``): a rank's compression error is made on
what it sends, i.e. on every chunk of the flat gradient, so its residual is as large as the
unsharded gradient: "full" keeps it in fp32, "int8" between steps in 8 bits with one fp32 scale per
256 entries (an 8-bit error buffer as LoCo keeps one), "none" keeps none (unbiased quantizers such as
qsgd and terngrad need none). docs/fsdp.md has the bytes per parameter of each.

The two-level layout (``topology=``, "compress only the slow hop", as ZeRO++'s hpZ and SDP4Bit
lay it out): the model is sharded inside each node (``fully_shard(m, mesh=hybrid_mesh(topology)
["shard"])``: 1-D FSDP over the node's ranks), and each shard is all-reduced across the nodes
through the compressor, the average over the nodes, in FSDP's all-reduce hook
(``set_all_reduce_hook``: FSDP2's native HSDP runs its own dense ``all_reduce`` over the replicate
dimension, which no public hook replaces, so a 2-D mesh is refused with this recipe in the
message). The shard at local position l is the exchange ``<module>#shard<l>`` (a layerwise
compressor, PowerSGD: one exchange per parameter piece, ``<parameter>#shard<l>``) on the session
of the cross group (the ranks at position l on every node); its state is the size of the shard
only. Inside the node the reduce-scatter is FSDP's own (dense) or, with ``inside=``, ours through
that spec with a session of its own. ``hvdcompress.reference.fsdp.hybrid_reduce_scatter`` is the
oracle.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from hvdcompress.contract import Allgather, Allreduce, Alltoall, Flag
from hvdcompress.reference.fsdp import (INT8_BLOCK, across_units, chunk_layout, refusal, shard_names,
                                        with_residual)
from hvdcompress.spec import LAYERWISE, resolve
from hvdcompress.topology import Topology, parse_topology

from .collectives import finish_all
from .compressors import ExchangeContext, build_compressor
from .nonfinite import count_nonfinite
from .session import ExchangeSession, SessionFront, exchange_name
from .transport import make_transport

try:  # FSDP2's public names (torch >= 2.6)
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - an older torch
    FSDPModule = None


def int8_encode(t: torch.Tensor, block: int = INT8_BLOCK):
    """(int8 codes, fp32 scale per ``block`` entries): the oracle's ``int8_encode`` in torch ops."""
    t = t.detach().reshape(-1).to(torch.float32)
    n = t.numel()
    blocks = -(-n // block)
    padded = t.new_zeros(blocks * block)
    padded[:n] = t
    amax = padded.view(blocks, block).abs().amax(dim=1) if n else padded.new_zeros(0)
    scales = amax / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded.view(blocks, block) / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(-1)[:n].clone(), scales


def int8_decode(codes: torch.Tensor, scales: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    n = codes.numel()
    return codes.to(torch.float32) * scales.repeat_interleave(block)[:n]


class _Sent:
    """What one reduce-scatter put on the wire (the session's ``end_step`` counts these)."""

    __slots__ = ("bytes_sent", "compute_seconds")

    def __init__(self, nbytes: int, seconds: float):
        self.bytes_sent, self.compute_seconds = nbytes, seconds


class _Hop:
    """One hop's session (the reduce-scatter, or the all-reduce across nodes), whether its residual
    rests in 8 bits, and what it sent in the current step."""

    def __init__(self, session: ExchangeSession, int8: bool):
        self.session, self.int8 = session, int8
        self.sent: list = []
        self.dense = 0

    def close(self) -> None:
        self.session.end_step(self.sent, self.dense)
        self.sent, self.dense = [], 0


class ReduceScatterWork:
    """What the reduce-scatter returns when asked for ``async_op=True``: the payloads are on their
    way; ``wait()`` receives, decodes and writes the output shard (as ``torch.distributed.Work``)."""

    def __init__(self, finish):
        self._finish = finish

    def wait(self, timeout=None) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


class CompressedReduceScatter:
    """FSDP2's ``ReduceScatter`` comm (``allocate`` + ``__call__``) of one sharded module."""

    def __init__(self, front: "FSDPCompression", prefix: str):
        self.front, self.prefix = front, prefix

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        """The reduce-scatter. Synchronous (None) as FSDP2 calls it (torch 2.13 never asks for
        ``async_op`` on its reduce-scatter, only on its all-gathers); with ``async_op=True`` the
        payloads are launched and a ``ReduceScatterWork`` is returned, whose ``wait()`` completes it
        (callers must wait in the same order on every rank: torch.distributed matches by issue order)."""
        if async_op:
            return self.front.start_reduce_scatter(self.prefix, output_tensor, input_tensor, group, op)
        self.front.reduce_scatter(self.prefix, output_tensor, input_tensor, group, op)
        return None


def _on_dim0(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor sharded on its dim 0 over a 1-D mesh (FSDP2's default)."""
    from torch.distributed.tensor import Shard
    placements = tuple(getattr(p, "placements", ()))
    return len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0


def _sharded_modules(model: torch.nn.Module):
    """(name, module, own parameters as (name, parameter)) of every module ``fully_shard`` was
    applied to: a module's own parameters are those no sharded module below it holds (FSDP2's
    rule), in registration order (the order of FSDP2's reduce-scatter input)."""
    found = [(name, m) for name, m in model.named_modules() if FSDPModule is not None and isinstance(m, FSDPModule)]
    out = []
    for name, m in found:
        below = set()
        for sub_name, sub in m.named_modules():
            if sub is not m and isinstance(sub, FSDPModule):
                below.update(id(p) for p in sub.parameters())
        own = [(f"{name}.{n}" if name else n, p) for n, p in m.named_parameters() if id(p) not in below]
        out.append((name or "<root>", m, own))
    return out


class FSDPCompression(SessionFront):
    """The compressing reduce-scatter of a model sharded by ``fully_shard`` (module doc), or, with
    ``topology``, the two-level layout: FSDP inside each node, the compressor across nodes.

    ``stats``, ``step``, ``spec`` come from the session (in the two-level layout: the hop across
    nodes; ``inside_stats`` counts the hop inside); ``state_dict()`` / ``load_state_dict()`` save
    and restore this rank's compression state and clock (each rank its own)."""

    def __init__(self, model: torch.nn.Module, compression, *, residual: Optional[str] = None,
                 topology=None, inside=None):
        spec = with_residual(resolve(compression), residual)  # ValueError, every rank, no collective yet
        topo = self._topology(topology)
        inside_spec = None
        if topo is None:
            if inside is not None:
                raise ValueError("inside= is the reduce-scatter inside a node of the two-level layout; it needs "
                                 "topology= (e.g. topology='2x4'); without one, the spec is the reduce-scatter's")
            why = refusal(spec)
            if why:
                raise ValueError(why)
        else:
            if inside is not None:
                inside_spec = resolve(inside)
                why = refusal(inside_spec)
                if why:
                    raise ValueError(f"inside: {why}")
            if topo.nodes == 1:
                raise ValueError(f"topology={topo} is one node: nothing crosses nodes; leave topology= out (the "
                                 "spec then compresses the reduce-scatter)")
            across = build_compressor(spec)
            if across.returns_update:
                raise ValueError(f"compression '{spec.name}' applies the optimizer's update itself; it cannot be the "
                                 "all-reduce of a sharded gradient across nodes")
        if FSDPModule is None:
            raise ValueError("hvdcompress.fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)")
        modules = _sharded_modules(model)
        if not modules:
            raise ValueError("hvdcompress.fsdp.compress: no module of the model is sharded; call "
                             "fully_shard(module) on its blocks and on the model first")
        meshes = {id(p.device_mesh): p.device_mesh for _, _, own in modules for _, p in own
                  if hasattr(p, "device_mesh")}
        if len(meshes) != 1:
            raise ValueError(f"hvdcompress.fsdp.compress: the sharded parameters must live on one device mesh; "
                             f"found {len(meshes)}")
        mesh = next(iter(meshes.values()))
        if mesh.ndim != 1:
            raise ValueError(f"hvdcompress.fsdp.compress: only a 1-D device mesh (FSDP) is supported; this model "
                             f"is sharded on a {mesh.ndim}-D mesh (native HSDP, whose all-reduce across the "
                             "replicate dimension FSDP2 runs itself). For the two-level layout shard inside each "
                             "node, fully_shard(module, mesh=hvdcompress.fsdp.hybrid_mesh(topology)['shard']), "
                             "and pass topology=")
        other = [(n, p) for _, _, own in modules for n, p in own if not _on_dim0(p)]
        if other:
            name, p = other[0]
            raise ValueError(f"hvdcompress.fsdp.compress: only parameters sharded on dim 0 (FSDP2's default) are "
                             f"supported; '{name}' is placed {tuple(getattr(p, 'placements', ()))}")
        if topo is not None:
            ranks = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
            node = topo.local_group(dist.get_rank())
            if ranks != node:
                raise ValueError(f"hvdcompress.fsdp.compress: topology={topo} shards inside each node (ranks {node} "
                                 f"here), but this model is sharded over ranks {ranks}; shard with "
                                 "fully_shard(module, mesh=hvdcompress.fsdp.hybrid_mesh(topology)['shard'])")
        self.residual = residual
        self.topology = topo
        self.group = mesh.get_group()
        transport = make_transport("torch", self.group)
        self.world, self.rank = transport.size(), transport.rank()
        self._names: Dict[str, List[str]] = {}
        self._layout: Dict[str, tuple] = {}
        params = {}
        for prefix, module, own in modules:
            if not own:
                continue
            shape, members, numel = chunk_layout([(n, tuple(p.shape)) for n, p in own], self.world)
            self._names[prefix] = shard_names(prefix, self.world)
            self._layout[prefix] = (shape, members, numel)
            device = own[0][1].device
            for name in self._names[prefix]:
                params[name] = torch.zeros((), device=device).expand(numel)  # size and device, no memory
        self._seen: List[str] = []  # modules reduced in the current step
        self._scatter: Optional[_Hop] = None  # our reduce-scatter (None: FSDP's own, dense)
        self._across: Optional[_Hop] = None  # the all-reduce across nodes (two-level layout)
        if topo is None:
            self.session = ExchangeSession(spec, params, transport, who="hvdcompress.fsdp", owner="fsdp")
            self._scatter = _Hop(self.session, residual == "int8")
        else:
            if inside_spec is not None:
                self._scatter = _Hop(ExchangeSession(inside_spec, params, transport, who="hvdcompress.fsdp (inside)",
                                                     owner="fsdp"), False)
            self._local = transport
            self._across = self._across_hop(across, topo, modules, residual == "int8")
            self.session = self._across.session
        for prefix, module, own in modules:
            if not own:
                continue
            if self._scatter is not None:
                module.set_custom_reduce_scatter(CompressedReduceScatter(self, prefix))
            if self._across is not None:
                module.set_all_reduce_hook(lambda output, prefix=prefix: self.all_reduce(prefix, output))

    @staticmethod
    def _topology(topology) -> Optional[Topology]:
        if topology is None:
            return None
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("topology=: torch.distributed is not initialized; call init_process_group first")
        world = dist.get_world_size()
        topo = topology if isinstance(topology, Topology) else parse_topology(topology, world)
        if topo.world != world:
            raise ValueError(f"topology={topo}: {topo.world} ranks, but the world has {world}")
        return topo

    def _across_hop(self, compressor, topo: Topology, modules, int8: bool) -> _Hop:
        """The session of the all-reduce across nodes, on this rank's cross group (the groups are
        made here, every rank making all of them in the same order, after every check)."""
        groups = [dist.new_group(list(ranks)) for ranks in topo.cross_groups()]
        position = topo.local_rank(dist.get_rank())
        layerwise = compressor.merge == LAYERWISE
        self._units: Dict[str, list] = {}
        params = {}
        for prefix, _, own in modules:
            if not own:
                continue
            shape, members, _ = self._layout[prefix]
            self._units[prefix] = across_units(prefix, position, shape, members, layerwise)
            device = own[0][1].device
            for name, start, stop, _, _ in self._units[prefix]:
                params[name] = torch.zeros((), device=device).expand(stop - start)
        session = ExchangeSession(compressor.spec, params, make_transport("torch", groups[position]),
                                  compressor=compressor,
                                  who="hvdcompress.fsdp (across)", owner="fsdp")
        return _Hop(session, int8)

    @property
    def inside_stats(self):
        """The hop inside a node (two-level layout with ``inside=``): its ``stats``; None otherwise."""
        return self._scatter.session.stats if self._scatter is not None and self._across is not None else None

    @property
    def inside_session(self) -> Optional[ExchangeSession]:
        return self._scatter.session if self._scatter is not None and self._across is not None else None

    # -- FSDP's calls ------------------------------------------------------------------------------
    def reduce_scatter(self, prefix: str, output: torch.Tensor, input: torch.Tensor, group, op) -> None:
        self.start_reduce_scatter(prefix, output, input, group, op).wait()

    def start_reduce_scatter(self, prefix: str, output: torch.Tensor, input: torch.Tensor, group,
                             op) -> ReduceScatterWork:
        """Encode every chunk and launch the payloads; the returned work's ``wait()`` decodes this
        rank's chunk into ``output``."""
        world, rank = self.world, self.rank
        if group.size() != world:
            raise RuntimeError(f"hvdcompress.fsdp: module '{prefix}' reduce-scatters over {group.size()} ranks; "
                               f"compress() was set up for {world}")
        shape, members, size = self._layout[prefix]
        if input.numel() != world * size or output.numel() != size:
            raise RuntimeError(f"hvdcompress.fsdp: module '{prefix}' reduce-scatters {input.numel()} entries; "
                               f"expected {world} x {size} (a parameter sharded on another dim?)")
        if op == dist.ReduceOp.SUM:
            scale = 1.0
        elif op == dist.ReduceOp.AVG:
            scale = 1.0 / world
        else:
            raise ValueError(f"hvdcompress.fsdp: reduce op {op!r} is not supported (SUM or AVG; a custom "
                             "gradient divide factor makes FSDP ask for PREMUL_SUM)")
        hop = self._scatter
        if self._across is None:  # the reduce-scatter is the step's only hop: it keeps the clock
            if prefix in self._seen:
                self._close_step()
            self._seen.append(prefix)
        session, names = hop.session, self._names[prefix]
        started = time.perf_counter()
        x = input.detach().reshape(world, size)
        epoch, step = session.current_epoch(), session.step
        own_gen, requests, states = None, [], []
        for j, name in enumerate(names):
            state = session.state_for((name,))
            if hop.int8:
                _expand(state)
            states.append(state)
            ctx = ExchangeContext(name, step, world, scale, state, shape, epoch, rank, members)
            gen = session.compressor.exchange(x[j], ctx)
            requests.append(tuple(next(gen)))
            if j == rank:
                own_gen = gen
            else:
                gen.close()  # its state is settled; only rank j decodes chunk j
        bad = torch.tensor([float(count_nonfinite(input))], dtype=torch.float32, device=input.device)
        receive, nbytes = self._route(session, requests, bad, exchange_name("fsdp", prefix, step))
        compute = time.perf_counter() - started

        def finish():
            again = time.perf_counter()
            answers = receive()
            flagged = float(answers[-1][0]) > 0
            try:
                own_gen.send(tuple(answers[:-1]))
            except StopIteration as stop:
                result = stop.value
            else:
                raise RuntimeError(f"hvdcompress.fsdp: compression '{session.spec.name}' asked for a second round")
            if flagged:
                result = torch.full_like(result, float("nan"))
                for state in states:
                    for t in state.values():
                        if torch.is_tensor(t) and t.is_floating_point():
                            t.masked_fill_(~torch.isfinite(t), 0.0)
            if hop.int8:
                for state in states:
                    _compact(state)
            output.copy_(result.reshape(output.shape))
            hop.sent.append(_Sent(nbytes, compute + time.perf_counter() - again))
            hop.dense += input.numel() * input.element_size() * (world - 1) // world
            if self._across is None and len(self._seen) == len(self._names):
                self._close_step()

        return ReduceScatterWork(finish)

    def _route(self, session: ExchangeSession, requests: List[tuple], bad: torch.Tensor, name: str):
        """Each rank's request i for chunk j goes to rank j (one ``Alltoall`` per request), launched
        here; returns a function that waits and gives the answers of this rank's chunk (as the
        all-reduce of that chunk would give them) with the summed non-finite flag last, and the
        payload bytes sent to other ranks."""
        world, rank = self.world, self.rank
        transport = session.transport
        kinds = [type(q) for q in requests[0]]
        if any(type(q) not in (Allreduce, Allgather) or isinstance(q, Flag) for q in requests[0]) or \
                any([type(q) for q in reqs] != kinds for reqs in requests):
            raise RuntimeError(f"hvdcompress.fsdp: compression '{session.spec.name}' yielded requests a "
                               "reduce-scatter cannot carry")
        flat = [[q.tensor.contiguous().reshape(-1) for q in reqs] for reqs in requests]  # [dest][i]
        nbytes = sum(t.numel() * t.element_size() for j, ts in enumerate(flat) if j != rank for t in ts)
        varying = [i for i, q in enumerate(requests[rank]) if isinstance(q, Allgather) and not q.same_shape]
        counts = None
        if varying:  # sizes first: rank j learns how many entries each rank sends it
            sizes = torch.tensor([flat[j][i].numel() for j in range(world) for i in varying], dtype=torch.int64,
                                 device=bad.device)
            (got,) = transport.wait(transport.launch((Alltoall(sizes, (len(varying),) * world),), f"{name}.sizes"))
            counts = got.view(world, len(varying))
        launches = []
        for i in range(len(kinds)):
            pieces = [flat[j][i] for j in range(world)]
            launches.append(Alltoall(torch.cat(pieces), tuple(p.numel() for p in pieces)))
        with transport.batch():
            handles = transport.launch(tuple(launches) + (Flag(bad),), name)

        def receive():
            got = transport.wait(handles)
            answers = []
            for i, req in enumerate(requests[rank]):
                mine = req.tensor
                if counts is not None and i in varying:
                    split = [int(c) for c in counts[:, varying.index(i)]]
                else:
                    split = [mine.numel()] * world
                parts = torch.split(got[i].reshape(-1), split)
                if isinstance(req, Allreduce):
                    total = parts[0].clone()
                    for p in parts[1:]:  # rank order, as the oracle sums
                        total += p
                    answers.append(total.view(mine.shape))
                else:
                    answers.append(torch.cat(parts).view(-1, *mine.shape[1:]) if mine.dim() > 1 else torch.cat(parts))
            answers.append(got[-1])
            return answers

        return receive, nbytes

    def all_reduce(self, prefix: str, shard: torch.Tensor) -> None:
        """The hop across nodes of one module's shard (two-level layout; FSDP's all-reduce hook,
        called with the reduce-scatter's output inside the node): the compressor's all-reduce of
        the shard among the ranks at this local position on every node, the average over the
        nodes, written back in place. With FSDP's own (dense) reduce-scatter inside, a 4-byte flag
        inside the node first makes every shard of the node NaN when any rank's gradient held a
        NaN or inf, so the guard across nodes sees it (non-finite values are never hidden)."""
        if prefix in self._seen:
            self._close_step()
        self._seen.append(prefix)
        hop, session = self._across, self._across.session
        step, epoch = session.step, session.current_epoch()
        flat = shard.detach().reshape(-1)
        if self._scatter is None:
            bad = torch.tensor([float(count_nonfinite(flat))], dtype=torch.float32, device=flat.device)
            (got,) = self._local.wait(self._local.launch((Flag(bad),), exchange_name("fsdp", prefix, step, "inside")))
            if float(got[0]) > 0:
                flat.fill_(float("nan"))
        nodes = session.transport.size()
        started = []
        with session.transport.batch():  # the first rounds of a split shard go out together
            for name, start, stop, shape, members in self._units[prefix]:
                state = session.state_for((name,))
                if hop.int8:
                    _expand(state)
                ex = session.start(flat[start:stop], (name,), key=name, step=step,
                                   name=exchange_name("fsdp", name, step), scale=1.0 / nodes, shape=shape,
                                   members=members, epoch=epoch)
                started.append((ex, start, stop, state))
        finish_all([ex for ex, _, _, _ in started])
        for ex, start, stop, state in started:
            flat[start:stop].copy_(ex.result.reshape(-1))
            if hop.int8:
                _compact(state)
            hop.sent.append(ex)
        hop.dense += flat.numel() * flat.element_size()
        if len(self._seen) == len(self._names):
            self._close_step()

    def _hops(self) -> List[_Hop]:
        return [h for h in (self._scatter, self._across) if h is not None]

    def _close_step(self) -> None:
        for hop in self._hops():
            hop.close()
        self._seen = []

    def layout(self, prefix: str) -> tuple:
        """(shape, members, numel) of each chunk of the sharded module ``prefix`` (``chunk_layout``)."""
        return self._layout[prefix]

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's compression state and clock (``torch_ops.checkpoint``'s saved form, and the
        residual mode; in the two-level layout, of the hop across nodes, with the topology and the
        hop inside's saved form under ``inside``)."""
        if self._seen:
            self._close_step()
        saved = dict(self.session.pack(), residual=self.residual)
        if self.topology is not None:
            inside = self.inside_session
            saved.update(topology=str(self.topology), inside=inside.pack() if inside is not None else None)
        return saved

    def load_state_dict(self, saved: dict) -> None:
        """Restore ``state_dict()`` (ValueError, before anything is loaded, if it does not fit)."""
        if isinstance(saved, dict) and saved.get("residual", self.residual) != self.residual:
            raise ValueError(f"load_state_dict: the checkpoint was saved with residual={saved['residual']!r}, this "
                             f"reduce-scatter keeps residual={self.residual!r}")
        mine = str(self.topology) if self.topology is not None else None
        if isinstance(saved, dict) and saved.get("topology") != mine:
            raise ValueError(f"load_state_dict: the checkpoint was saved with topology={saved.get('topology')!r}, "
                             f"this front end has topology={mine!r}")
        inside = self.inside_session
        if self.topology is not None and (saved.get("inside") is None) != (inside is None):
            raise ValueError("load_state_dict: the checkpoint's hop inside the node is "
                             f"{'dense' if saved.get('inside') is None else 'compressed'}, this front end's is "
                             f"{'dense' if inside is None else 'compressed'} (inside=)")
        checked = saved
        if self.residual == "int8":  # the session checks the fp32 form; the 8-bit form is what is kept
            checked = dict(saved, state={n: _expand({k: t.clone() for k, t in st.items()})
                                         for n, st in saved.get("state", {}).items()})
        self.session.check(checked)
        if inside is not None:
            inside.check(saved["inside"])
        self.session.load(saved)
        if inside is not None:
            inside.load(saved["inside"])
        self._seen = []
        for hop in self._hops():
            hop.sent, hop.dense = [], 0

    def set_epoch(self, epoch: int) -> None:
        """Warm-ups (DGC) follow the caller's epochs (see ``ExchangeSession.set_epoch``)."""
        for hop in self._hops():
            hop.session.set_epoch(epoch)


def _compact(state: dict) -> None:
    """The at-rest form of a state under residual='int8': its residual in 8 bits (in place)."""
    if "residual" in state:
        codes, scales = int8_encode(state.pop("residual"))
        state["residual_q8"], state["residual_scale"] = codes, scales


def _expand(state: dict) -> dict:
    if "residual_q8" in state:
        state["residual"] = int8_decode(state.pop("residual_q8"), state.pop("residual_scale"))
    return state


def compress(model: torch.nn.Module, compression, *, residual: Optional[str] = None, topology=None,
             inside=None) -> FSDPCompression:
    """Install a compressing reduce-scatter on every module of ``model`` that ``fully_shard`` sharded
    (module doc); returns the front end (``stats``, ``state_dict``, ``load_state_dict``).

    ``topology`` ("NxL", "L" or a ``hvdcompress.topology.Topology``): the two-level layout; the
    model is sharded inside each node (``fully_shard(module, mesh=hybrid_mesh(topology)["shard"])``)
    and ``compression`` is the all-reduce of each shard across nodes (``residual`` is its residual);
    ``inside``: the reduce-scatter inside a node, None for FSDP's own (dense), or a spec (e.g.
    "fp16", "qsgd:levels=127,bucket=128")."""
    return FSDPCompression(model, compression, residual=residual, topology=topology, inside=inside)


def hybrid_mesh(topology, device_type: str = "cpu"):
    """The 2-D device mesh of the two-level layout, dims ("replicate", "shard"): shard over the
    ranks of a node (``mesh["shard"]``, what ``fully_shard`` takes), replicate across nodes. Ranks
    are numbered node by node, as launchers do (``hvdcompress.topology``). Call on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    topo = topology if isinstance(topology, Topology) else parse_topology(topology, dist.get_world_size())
    return init_device_mesh(device_type, (topo.nodes, topo.local_size), mesh_dim_names=("replicate", "shard"))
