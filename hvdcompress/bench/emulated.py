"""GPU-like compute emulation for the benchmark harness (``hvdcompress bench --compute emulated:<profile>``).

On a GPU machine the forward and backward passes run on the accelerator and the CPU cores are free
for compression and Horovod's background thread; on a CPU-only machine the workers' own
backward passes occupy every core, so an exchange launched from a gradient hook barely progresses
before backward ends. :class:`EmulatedModel` restores the GPU situation: its layers have *real*
parameters (so gradients, compression, selection, exchange and their bytes are real), but each
layer's forward and backward *time* is spent waiting (``time.sleep``, which leaves the core to
other threads and processes), as long as a profile says the layer takes on the accelerator.

A *profile* (JSON) lists the layers in forward order, each with its parameter shapes and its
forward and backward seconds (:func:`load_profile`; shipped ones in ``hvdcompress/bench/profiles``,
named by file stem, e.g. ``resnet50-v100``). :func:`record_profile` /
``python -m hvdcompress.bench.profile emulation record`` writes one from a user's own model, timed on the
user's machine.

Gradients are deterministic: a layer's backward returns, for every parameter, a fixed seeded
random pattern (made once per shape, seed and parameter, shared by every model built from the
same profile in a process) times the mean *absolute* value of the upstream gradient. The upstream
gradient flows through a small carrier tensor (batch x 10 "logits"); the loss the harness computes
on it is real. (Not the plain mean: a cross-entropy gradient's rows sum to zero, so its mean is 0
or rounding noise, which made every gradient 0 or ~1e-10 -- data on which selection runs on its
slow paths and whose cost differed between ranks by 8x.)

Waiting follows a stream clock, as queued GPU kernels would: a layer's wait ends at the end the
previous wait was meant to have, plus the CPU time spent between the previous layer's wake-up and
this layer's entry, plus the layer's seconds. So a sleep that wakes late (a loaded machine) does
not push the later layers back -- the next waits are shortened, by at most ``MAX_BEHIND_S`` in
all, and the clock restarts at every forward pass -- while real CPU work in between
-- the optimizer's gradient hooks compressing and launching exchanges, Python and autograd
overhead -- delays the following layers, like work queued on the compute stream (the cost model's
``shared`` overlap).

``scale`` (``--emulated-scale S``) divides every parameter tensor's size by about S (leading
dimensions shrunk, shapes otherwise kept), keeping the times: compression then does 1/S of the
full model's work on the CPU -- a stand-in for compression on an accelerator much faster than one
CPU core -- and payload bytes are 1/S of the full model's, so at a given link rate the transfer
part of an exchange takes what the full model's would take at S times that rate; per-message
start-up costs are unchanged. ``scale=1``: full-size tensors, compression at real CPU speed.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
NUM_CLASSES = 10
MAX_BEHIND_S = 0.005  # the most a late wake-up may shorten the following waits (see StreamClock)
_PATTERNS: Dict[Tuple, torch.Tensor] = {}  # (seed, layer, param, shape) -> fixed gradient pattern


# -- profiles ----------------------------------------------------------------------------------------
def profile_path(name_or_path: str) -> str:
    """A shipped profile's file (by stem, e.g. ``resnet50-v100``) or a path to a JSON file."""
    if os.path.sep in name_or_path or name_or_path.endswith(".json"):
        if not os.path.isfile(name_or_path):
            raise ValueError(f"emulated profile: no such file {name_or_path!r}")
        return name_or_path
    path = os.path.join(PROFILE_DIR, name_or_path + ".json")
    if not os.path.isfile(path):
        raise ValueError(f"emulated profile: unknown profile {name_or_path!r}; shipped: {', '.join(shipped())}")
    return path


def shipped() -> List[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def load_profile(name_or_path: str) -> dict:
    """The profile as a dict, checked: ``layers`` (forward order) of ``{name, params: {pname: shape},
    forward_s, backward_s}``, and ``batch``."""
    with open(profile_path(name_or_path)) as f:
        prof = json.load(f)
    layers = prof.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"emulated profile {name_or_path!r}: needs a non-empty 'layers' list")
    names = set()
    for layer in layers:
        for key in ("name", "params", "forward_s", "backward_s"):
            if key not in layer:
                raise ValueError(f"emulated profile {name_or_path!r}: layer {layer.get('name')!r} lacks {key!r}")
        if layer["name"] in names:
            raise ValueError(f"emulated profile {name_or_path!r}: layer {layer['name']!r} appears twice")
        names.add(layer["name"])
        if not (layer["forward_s"] >= 0 and layer["backward_s"] >= 0):
            raise ValueError(f"emulated profile {name_or_path!r}: layer {layer['name']!r}: times must be >= 0")
        for pname, shape in layer["params"].items():
            if not shape or any(int(d) < 1 for d in shape):
                raise ValueError(f"emulated profile {name_or_path!r}: {layer['name']}.{pname}: bad shape {shape}")
    prof.setdefault("batch", 32)
    prof.setdefault("name", os.path.splitext(os.path.basename(profile_path(name_or_path)))[0])
    return prof


def scaled_shape(shape: Sequence[int], scale: float) -> List[int]:
    """``shape`` with about 1/scale of its elements: the leading dimensions are divided in turn
    (each down to >= 1) until the remaining factor is used up."""
    shape = [int(d) for d in shape]
    left = float(scale)
    for i, d in enumerate(shape):
        if left <= 1.0 + 1e-9:
            break
        new = max(1, int(round(d / left)))
        left *= new / d
        shape[i] = new
    return shape


# -- the waiting layer -------------------------------------------------------------------------------
class StreamClock:
    """Where the emulated compute stream is (see the module doc): ``end`` is where the last wait
    was meant to end, ``woke`` when it really did. The CPU time between ``woke`` and the next
    layer's entry (hooks, Python, the loss) is added to the stream; a sleep's overshoot is not."""

    def __init__(self):
        self.end = 0.0
        self.woke = 0.0
        self.waited = 0.0  # seconds asked of time.sleep, for tests and reports

    def reset(self) -> None:
        """A new step: the stream starts now."""
        self.end = self.woke = time.perf_counter()

    def run(self, seconds: float) -> None:
        entry = time.perf_counter()
        start = max(self.end + max(0.0, entry - self.woke), entry - MAX_BEHIND_S)
        self.end = start + seconds
        remaining = self.end - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
            self.waited += remaining
        self.woke = time.perf_counter()


class _Wait(torch.autograd.Function):
    """Forward: wait the layer's forward time, pass the carrier on. Backward: the fixed gradient
    patterns times the upstream gradient's mean absolute value, then wait out the layer's
    backward time."""

    @staticmethod
    def forward(ctx, carrier, layer, *params):
        ctx.layer = layer
        layer.clock.run(layer.forward_s)
        return carrier.clone()

    @staticmethod
    def backward(ctx, grad_out):
        layer = ctx.layer
        s = grad_out.abs().mean()  # > 0: a cross-entropy gradient's plain mean is ~0 (module doc)
        grads = tuple(pat * s for pat in layer.patterns)  # before the wait: counted in its time
        layer.clock.run(layer.backward_s)
        return (grad_out, None) + grads


class EmulatedLayer(nn.Module):
    def __init__(self, spec: dict, scale: float, clock: StreamClock, seed: int, index: int):
        super().__init__()
        self.forward_s = float(spec["forward_s"])
        self.backward_s = float(spec["backward_s"])
        self.clock = clock
        patterns = []
        for j, (pname, shape) in enumerate(spec["params"].items()):
            shape = scaled_shape(shape, scale)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index * 101 + j)
            self.register_parameter(pname, nn.Parameter(torch.randn(shape, generator=gen) * 0.01))
            key = (seed, index, j, tuple(shape))
            if key not in _PATTERNS:
                _PATTERNS[key] = torch.randn(shape, generator=torch.Generator().manual_seed(
                    seed * 7_000_003 + index * 101 + j + 1))
            patterns.append(_PATTERNS[key])
        self.patterns = patterns

    def forward(self, carrier: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(carrier, self, *self.parameters(recurse=False))


class EmulatedModel(nn.Module):
    """The profile's layers in forward order (module names: the profile's, dots as '__')."""

    def __init__(self, profile: dict, scale: float = 1.0, seed: int = 0):
        super().__init__()
        if not scale >= 1:
            raise ValueError(f"emulated scale: must be >= 1; got {scale!r}")
        self.profile_name = profile.get("name", "?")
        self.scale = float(scale)
        self.clock = StreamClock()
        self.layers = nn.ModuleDict()
        for i, spec in enumerate(profile["layers"]):
            self.layers[spec["name"].replace(".", "__")] = EmulatedLayer(spec, scale, self.clock, seed, i)
        self.forward_s = sum(l.forward_s for l in self.layers.values())
        self.backward_s = sum(l.backward_s for l in self.layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.reset()
        carrier = x.reshape(x.shape[0], -1)[:, :NUM_CLASSES].detach()
        for layer in self.layers.values():
            carrier = layer(carrier)
        return carrier


def build_emulated(name_or_path: str, seed: int = 0, scale: float = 1.0) -> EmulatedModel:
    return EmulatedModel(load_profile(name_or_path), scale=scale, seed=seed)


# -- recording a profile from a real model -----------------------------------------------------------
def record_profile(model: nn.Module, closure, iters: int = 5, warmup: int = 2, name: str = "recorded",
                   batch: Optional[int] = None, note: str = "") -> dict:
    """A profile of ``model`` as it runs on this machine: ``closure()`` runs the forward pass and
    returns the loss. Backward seconds per layer (a layer: the module that owns parameters) are the
    sums of its parameters' hook-to-hook times from ``torch_ops.profiling.profile_workload``
    (single process, no Horovod); forward seconds per layer from forward pre/post hooks on the same
    modules (time in modules without parameters is not counted). Medians over ``iters``."""
    from torch_ops.profiling import profile_workload

    owners = [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    fwd: Dict[str, List[float]] = {n: [] for n, _ in owners}
    starts: Dict[str, float] = {}
    handles = []
    for n, m in owners:
        handles.append(m.register_forward_pre_hook(lambda _m, _i, n=n: starts.__setitem__(n, time.perf_counter())))
        handles.append(m.register_forward_hook(
            lambda _m, _i, _o, n=n: fwd[n].append(time.perf_counter() - starts[n])))
    try:
        workload = profile_workload(model, closure, iters=iters, warmup=warmup, average=False)
    finally:
        for h in handles:
            h.remove()
    t_b = dict(zip(workload.names, workload.t_b))
    named = dict(model.named_parameters())
    layers = []
    for n, m in owners:
        params = {pn: list(p.shape) for pn, p in m.named_parameters(recurse=False) if p.requires_grad}
        if not params:
            continue
        full = [f"{n}.{pn}" if n else pn for pn in params]
        times = fwd[n][warmup:] or fwd[n]
        layers.append({"name": n or "root", "params": params,
                       "forward_s": statistics.median(times) if times else 0.0,
                       "backward_s": sum(t_b.get(f, 0.0) for f in full if f in named)})
    return {"name": name, "batch": batch, "device": "recorded on this machine (" + os.uname().machine + ")",
            "source": "record_profile: forward hooks per module, backward from gradient hooks "
                      "(torch_ops.profiling.profile_workload); " + note,
            "parameters": sum(math.prod(s) for l in layers for s in l["params"].values()),
            "forward_s_total": sum(l["forward_s"] for l in layers),
            "backward_s_total": sum(l["backward_s"] for l in layers), "layers": layers}


# -- measured per-group timeline (bench side) --------------------------------------------------------
class TracingCommunicator:
    """Mixin for a ``torch_ops.collectives.Communicator``: while ``tracing`` is on, records when
    every round of collectives was launched and (a polling thread, every ``poll_s``) when it
    completed, by round name. Off, it adds one attribute check per launch."""

    poll_s = 0.0002

    def _trace_init(self):
        self.tracing = False
        self.trace: Dict[str, List[float]] = {}
        self._live: List[Tuple[str, list]] = []
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def launch(self, requests, name):
        handles = super().launch(requests, name)
        if self.tracing:
            with self._lock:
                self.trace[name] = [time.perf_counter(), None]
                self._live.append((name, handles))
        return handles

    def start_trace(self) -> None:
        self.trace, self._live, self.tracing = {}, [], True
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def stop_trace(self) -> Dict[str, List[float]]:
        self.tracing = False
        if self._thread is not None:
            self._thread.join()
        return dict(self.trace)

    def _poll(self) -> None:
        while self.tracing or self._live:
            with self._lock:
                live = list(self._live)
            done = []
            for name, handles in live:
                try:
                    if all(self._hvd.poll(h) for h in handles):
                        self.trace[name][1] = time.perf_counter()
                        done.append(name)
                except Exception:  # a handle already synchronized and released: completed earlier
                    if self.trace[name][1] is None:
                        self.trace[name][1] = time.perf_counter()
                    done.append(name)
            if done:
                with self._lock:
                    self._live = [(n, h) for n, h in self._live if n not in done]
            time.sleep(self.poll_s)


def tracing_transport(base_cls):
    """A subclass of ``base_cls`` (a Communicator) with :class:`TracingCommunicator`'s tracing."""
    class Traced(TracingCommunicator, base_cls):
        def __init__(self, *a, **kw):
            base_cls.__init__(self, *a, **kw)
            self._trace_init()
    Traced.__name__ = "Tracing" + base_cls.__name__
    return Traced
