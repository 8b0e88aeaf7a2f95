"""The exchange session: what every PyTorch front end shares, owned once.

A front end (the optimizer's ``Engine``, the DDP hook, ``DiLoCo``) translates its framework's
events (autograd hooks, DDP buckets, outer steps) into calls on one ``ExchangeSession``, which owns

* the compressor, built once from the spec;
* compression state per parameter name (residuals, momenta, ...), joined into a merged group's
  layout when the group is first exchanged and split back per name when the groups change or a
  checkpoint is taken (``state_for`` / ``param_state``): state never depends on the grouping;
* the step and epoch clock (``step``, ``set_epoch``, ``current_epoch``: warm-ups);
* starting an exchange (``start``): its context, the compressor's exchange (or a per-group
  codec's), made two-level when the transport is (``torch_ops.twolevel``: dense inside a node,
  that exchange across nodes), the non-finite guard (``torch_ops.nonfinite``), its ``PendingExchange`` on the
  transport, named by ``exchange_name`` (names key Horovod's matching of collectives, so they
  are the same on every rank and unique among the exchanges in flight);
* the exchanges in flight (``pending``, a ``PendingQueue``);
* the wire statistics (``stats``, counted at ``end_step``) and the saved format (``pack`` /
  ``check`` / ``load``, ``torch_ops.checkpoint``).

The transport is any ``hvdcompress.contract.Transport``; a front end may set it after the session
is made (the DDP hook makes its own at the first bucket).
"""

from __future__ import annotations

import functools
import warnings
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple

import torch

from hvdcompress.spec import CompressionSpec
from hvdcompress.stats import WireStats
from hvdcompress.warmup import auto_epoch

from . import checkpoint
from .codec_choice import fallback_exchange
from .collectives import PendingExchange, PendingQueue
from .compressors import ExchangeContext, build_compressor
from .grouping import join_state, split_state
from .nonfinite import guard
from .streams import SideStreams

State = Dict[str, torch.Tensor]


def exchange_name(*parts) -> str:
    """The name of an exchange: ``hvc.<part>.<part>...`` (the transport appends round and request)."""
    return ".".join(["hvc", *map(str, parts)])


class ExchangeSession:
    """Compressor, per-name state, clock, exchanges in flight, stats and checkpoints of one front end.

    ``params``: name -> parameter (sizes and devices of the state); ``compressor``: the one built
    from ``spec`` when the caller already has it (built here otherwise); ``who`` / ``owner``: how
    warnings name the front end and the object whose ``set_epoch`` the user calls.
    """

    def __init__(self, spec: CompressionSpec, params: Mapping[str, torch.Tensor], transport=None, *,
                 compressor=None, who: str = "hvdcompress", owner: str = "optimizer"):
        self.spec = spec
        self.compressor = compressor if compressor is not None else build_compressor(spec)
        self.transport = transport
        self.params: Dict[str, torch.Tensor] = dict(params)
        self.step = 0
        self.epoch = 0
        self.epoch_set = False  # set_epoch() called: warm-ups follow it, else count steps
        self.stats = WireStats()
        self.pending = PendingQueue()
        self.streams = SideStreams()  # CUDA exchanges run on a side stream (torch_ops.streams)
        self._who, self._owner = who, owner
        self._warned_epoch = False
        self._groups: Dict[Tuple[str, ...], State] = {}  # state of the groups in use, in their layout
        self._per_name: Dict[str, State] = {}  # state of names in no group in use

    # -- the clock ---------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch: epoch must be an int >= 0; got {epoch!r}")
        self.epoch = epoch
        self.epoch_set = True

    def current_epoch(self) -> int:
        """The last ``set_epoch``, else (for a compressor with a warm-up) ``step // warmup_epoch_steps``."""
        steps = self.compressor.warmup_epoch_steps
        if self.epoch_set or steps is None:
            return self.epoch
        if not self._warned_epoch:
            self._warned_epoch = True
            warnings.warn(f"{self._who}: compression '{self.spec.name}' warms its density up over epochs, and "
                          f"set_epoch() was not called: counting epochs of {steps} steps (the spec's "
                          f"warmup_epoch_steps). Call {self._owner}.set_epoch(epoch) at the start of every epoch to "
                          "follow your epochs instead.")
        return auto_epoch(self.step, steps)

    # -- compression state per name ------------------------------------------------------------------
    def state_for(self, names: Sequence[str]) -> State:
        """The state of the group ``names`` in its layout (the same dict from exchange to exchange
        while the group is in use); groups overlapping it are split back per name first."""
        names = tuple(names)
        st = self._groups.get(names)
        if st is not None:
            return st
        wanted = set(names)
        for other in [g for g in self._groups if wanted.intersection(g)]:
            self._per_name.update(zip(other, split_state(self._groups.pop(other), self._numels(other))))
        st = self._groups[names] = join_state([self._per_name.pop(n, {}) for n in names], self._numels(names))
        return st

    def set_state(self, name: str, state: State) -> None:
        """Replace the state of ``name`` (exchanged alone) by ``state``."""
        self.state_for((name,))
        self._groups[(name,)] = state

    def param_state(self) -> Dict[str, State]:
        """Compression state per parameter name (copies), whatever the grouping."""
        out = {n: {k: t.detach().clone() for k, t in st.items()} for n, st in self._per_name.items()}
        for names, st in self._groups.items():
            out.update(zip(names, split_state(st, self._numels(names))))
        return out

    def load_param_state(self, per_name: Mapping[str, State]) -> None:
        """Start over from ``per_name`` (copied onto each parameter's device)."""
        self._groups = {}
        self._per_name = {n: {k: t.detach().clone().to(self.params[n].device) for k, t in st.items()}
                          for n, st in per_name.items()}

    def _numels(self, names: Iterable[str]):
        return [self.params[n].numel() for n in names]

    # -- exchanges -----------------------------------------------------------------------------------
    def start(self, x: torch.Tensor, names: Sequence[str], *, key: str, step, name: str, scale: Optional[float] = None,
              shape: Tuple[int, ...] = (), members=(), epoch: Optional[int] = None, out=None,
              codec: Optional[str] = None, state: Optional[State] = None) -> PendingExchange:
        """Start the exchange of ``x`` (the flat tensor of the group ``names``) on the transport:
        the compressor's exchange (or, with ``codec``, the group sent "none" / "fp16" by it),
        guarded against non-finite values, its first round launched. ``scale`` defaults to the
        average's 1 / world, ``epoch`` to ``current_epoch()``, ``state`` to ``state_for(names)``."""
        world = self.transport.size()
        state = self.state_for(names) if state is None else state
        ctx = ExchangeContext(key, step, world, 1.0 / world if scale is None else scale, state, shape,
                              self.current_epoch() if epoch is None else epoch, self.transport.rank(), members,
                              out=out)
        make = (self.compressor.exchange if codec is None
                else functools.partial(fallback_exchange, self.compressor, codec))
        compose = getattr(self.transport, "compose", None)  # a two-level transport (torch_ops.twolevel)
        exchange = make(x, ctx) if compose is None else compose(make, x, ctx)
        gen, transport = self.streams.route(guard(exchange, x, ctx.state), x, self.transport)
        return PendingExchange(gen, name, transport)

    def end_step(self, exchanges: Iterable[PendingExchange], dense_bytes: int) -> None:
        """A step is over: its completed exchanges counted in ``stats`` against ``dense_bytes``
        uncompressed, and the clock moved on."""
        exchanges = list(exchanges)
        hops = getattr(self.transport, "take_hop_bytes", None)
        routes = getattr(self.transport, "take_routes", None)  # a two-level transport's routes per group
        self.stats.record(sum(ex.bytes_sent for ex in exchanges), dense_bytes,
                          sum(ex.compute_seconds for ex in exchanges), self.compressor.density(self.current_epoch()),
                          hops=hops() if hops is not None else None, routes=routes() if routes is not None else None)
        self.step += 1

    def drop_in_flight(self) -> None:
        """Forget the exchanges in flight (after an elastic reset: their handles belonged to the
        transport that was shut down)."""
        self.pending = PendingQueue()

    # -- checkpoints ---------------------------------------------------------------------------------
    def pack(self, plan: Optional[dict] = None, policy: Optional[dict] = None) -> dict:
        """The saved form (``torch_ops.checkpoint``): clock, state per name, compressor-wide state."""
        return checkpoint.pack(spec=self.spec, step=self.step, epoch=self.epoch, epoch_set=self.epoch_set,
                               state=self.param_state(), plan=plan, policy=policy,
                               compressor=self.compressor.global_state())

    def check(self, saved: dict) -> None:
        """ValueError, before anything is loaded, if ``saved`` does not fit this session."""
        checkpoint.check(saved, self.spec, self.compressor, {n: p.numel() for n, p in self.params.items()})

    def load(self, saved: dict) -> None:
        """Restore ``pack()`` 's output (checked already): clock, compressor-wide and per-name state;
        nothing in flight."""
        self.step = int(saved["step"])
        self.epoch = int(saved["epoch"])
        self.epoch_set = bool(saved.get("epoch_set", True))
        self.compressor.load_global_state(saved.get("compressor"))
        self.load_param_state(saved["state"])
        self.drop_in_flight()


class SessionFront:
    """Base of a front end over an ``ExchangeSession`` (``self.session``): what it reads through."""

    session: ExchangeSession

    @property
    def spec(self) -> CompressionSpec:
        return self.session.spec

    @property
    def compressor(self):
        return self.session.compressor

    @property
    def stats(self) -> WireStats:
        """Bytes this rank sent per step vs dense, compression time (``hvdcompress.stats``)."""
        return self.session.stats

    @property
    def step(self) -> int:
        """Steps completed so far (the session's clock)."""
        return self.session.step
