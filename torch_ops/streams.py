"""Compression off the compute stream: each exchange of CUDA tensors runs on a side CUDA stream.

The backward pass queues its kernels on the current (compute) stream. An exchange started there
would queue its encode, its collectives and its decode behind and between them, delaying the rest
of the backward pass by the compression's time. Here (``SideStreams.route``) an exchange of a CUDA
tensor instead runs every step of its generator (encode, decode) and every call on its transport
(launch, wait, batch) on one side stream per device, ordered as follows:

* the side stream first waits for the work queued so far on the caller's stream (the gradient is
  ready: ``side.wait_stream(caller)``), and the input is marked as used there (``record_stream``),
  so the caching allocator does not hand its memory out while the side stream still reads it;
* collectives are issued from the side stream, so NCCL (and Horovod's ready event) order them
  after the encode that produced their tensors, and waits order the decode after them;
* when the exchange returns its result, the stream of whoever drove it to the end waits for the
  side stream, and the result is marked as used there.

The caller's stream is never made to wait for an encode while the backward pass is running; it
waits once, for the result, where the result is consumed. On the CPU (and with
``HVDCOMPRESS_SIDE_STREAM=0``) ``route`` returns the generator and the transport unchanged.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict

import torch


def enabled() -> bool:
    """False with ``HVDCOMPRESS_SIDE_STREAM=0`` (every exchange then runs on the caller's stream)."""
    return os.environ.get("HVDCOMPRESS_SIDE_STREAM", "1") != "0"


class OnStream:
    """A transport whose every call runs with ``stream`` current (launch, wait, poll, ``batch`` and
    the blocking collectives); everything else is the wrapped transport's."""

    def __init__(self, transport, stream):
        self.inner, self.stream = transport, stream

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name == "batch":
            return attr
        stream = self.stream

        def on_stream(*args, **kwargs):
            with torch.cuda.stream(stream):
                return attr(*args, **kwargs)

        return on_stream

    @contextlib.contextmanager
    def batch(self):
        """The wrapped transport's ``batch`` with the side stream current: what is issued at its
        end is issued from the side stream. The side stream first waits for the caller's."""
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        inner = getattr(self.inner, "batch", None)
        with torch.cuda.stream(self.stream), (inner() if inner is not None else contextlib.nullcontext()):
            yield self


def on_side(gen, x: torch.Tensor, side):
    """The exchange generator ``gen`` of ``x`` with every step run on ``side`` (module doc)."""
    caller = torch.cuda.current_stream(x.device)
    side.wait_stream(caller)
    x.record_stream(side)
    results = None
    while True:
        caller = torch.cuda.current_stream(x.device)
        try:
            with torch.cuda.stream(side):
                requests = next(gen) if results is None else gen.send(results)
        except StopIteration as stop:
            out = stop.value
            caller.wait_stream(side)
            if torch.is_tensor(out) and out.is_cuda:
                out.record_stream(caller)
            return out
        results = yield requests


class SideStreams:
    """One side stream per CUDA device, made at first use, and the transports wrapped on them."""

    def __init__(self):
        self._streams: Dict[torch.device, object] = {}
        self._wrapped: Dict[tuple, OnStream] = {}

    def side(self, device: torch.device):
        """The side stream of ``device`` (a CUDA device), made once."""
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def transport(self, transport, device):
        """``transport`` on the side stream of ``device``; ``transport`` itself off CUDA or when
        side streams are off."""
        if torch.device(device).type != "cuda" or not enabled():
            return transport
        side = self.side(device)
        key = (id(transport), side)
        wrapped = self._wrapped.get(key)
        if wrapped is None or wrapped.inner is not transport:
            wrapped = self._wrapped[key] = OnStream(transport, side)
        return wrapped

    def route(self, gen, x: torch.Tensor, transport):
        """(generator, transport) an exchange of ``x`` runs on: both on ``x``'s side stream when
        ``x`` is a CUDA tensor, else ``gen`` and ``transport`` unchanged."""
        if not x.is_cuda or not enabled():
            return gen, transport
        return on_side(gen, x, self.side(x.device)), self.transport(transport, x.device)
