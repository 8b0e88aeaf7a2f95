"""Measurements the layer-merging planner needs, taken inside a running Horovod job (PyTorch).

    time_collectives(kinds, sizes)   Horovod allreduce / allgather (and allreduce of fp16,
                                     "allreduce_half") on the live transport: (bytes per rank,
                                     seconds) samples for the alpha-beta fits
    time_sequence(), time_burst()    a collective's start-up in a training step: alone in its
                                     negotiation cycle (one after another), or queued with others
                                     (a burst)
    time_compression(spec, sizes)    a compressor's compress step (everything its exchange does
                                     before the first collective: error feedback, selection, packing)
    time_decompression(spec, sizes)  what its exchange does after the collectives (aggregation,
                                     decompression) and the copy back into the gradient
    time_launch()                    the CPU time of handing one collective to Horovod
    profile_workload(model, closure) per-parameter backward times from gradient hooks, forward and
                                     update times: a ``hvdcompress.schedule.planner.Workload``
    profile_cost_model(specs)        all of the first two, fitted into a ``CostModel`` and cached
    load_or_profile(specs)           the cached model for this world and host set, else profile

Where the work runs on a CUDA device (``device=`` of the codec timings, the model's parameters in
``profile_workload``) every reading waits for the device first (``timing.timer_for``: a
``CudaTimer``), so kernels are timed, not their launches; on the CPU the host clock is read as it
always was. The link fit's collectives (``time_collectives``, ``time_launch``, ``time_sequence``,
``time_burst``) move tensors of that device too: a CUDA gradient travels by the path CUDA tensors
take (NCCL under torch.distributed or a Horovod built with it), not by Gloo's CPU path. A cost model
timed on a CUDA device says so in its meta (``"device"``); ``load_or_profile`` uses a cached model
only for the device type it was timed on.

Every rank ends with the *same* numbers: times are averaged over ranks with an allreduce, and the
parameter order of rank 0 is broadcast, so every rank builds the same plan (a plan that differed
between ranks would pair different collectives). Call these on every rank.

From a shell: ``python -m hvdcompress.bench.profile transport`` (writes the fitted model to the
cache, and to --out).
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from dataclasses import fields, replace
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from hvdcompress.schedule.costmodel import CostModel, fit_compute, fit_cost_model, fit_half, sums_half
from hvdcompress.schedule.planner import Workload
from hvdcompress.spec import resolve

from .compressors import ExchangeContext, build_compressor
from .timing import HostTimer, timer_for

DEFAULT_COMM_BYTES = tuple(4 << (2 * i) for i in range(5, 12))    # 4 KiB .. 16 MiB, x4 steps
DEFAULT_COMPRESS_ELEMENTS = tuple(1 << i for i in range(10, 23, 2))  # 1 Ki .. 4 Mi floats


def _hvd():
    import horovod.torch as hvd
    if not hvd.is_initialized():
        raise RuntimeError("profiling: call hvd.init() first (these measurements run on every rank)")
    return hvd


def _comm(comm=None):
    """The communicator the measurements run on: the one given (the optimizer's, on its process
    set), else all ranks."""
    if comm is not None:
        return comm
    _hvd()
    from .collectives import Communicator
    return Communicator()


def _rank_mean(values: Sequence[float], name: str, comm=None) -> List[float]:
    """Element-wise mean over the process set's ranks (identical on every rank)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    return _comm(comm).allreduce_(t, name, average=True).tolist()


def _device(device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


# A GPU codec's first calls at a new size compile Triton variants (30 ms to 1 s each on an H200,
# more than one per size where an integer argument's specialisation changes); one warm-up call
# left such compiles in the timed calls and the fits extrapolated them (benchmarks/codec_fits.py).
CUDA_WARMUP, CUDA_REPEATS = 4, 5


def _calls(x: torch.Tensor, repeats: int, warmup: int) -> Tuple[int, int]:
    """(repeats, warmup) for codec timings on ``x``'s device: at least CUDA_REPEATS and CUDA_WARMUP on a GPU."""
    if x.device.type == "cuda":
        return max(repeats, CUDA_REPEATS), max(warmup, CUDA_WARMUP)
    return repeats, warmup


def _median_seconds(fn: Callable[[], None], repeats: int, warmup: int,
                    before: Optional[Callable[[], None]] = None, timer: HostTimer = HostTimer()) -> float:
    for _ in range(warmup):
        if before:
            before()
        fn()
    times = []
    for _ in range(repeats):
        if before:
            before()
        start = timer.now()
        fn()
        times.append(timer.now() - start)
    return statistics.median(times)


def time_collectives(kinds: Iterable[str] = ("allreduce", "allgather"),
                     sizes_bytes: Sequence[int] = DEFAULT_COMM_BYTES, repeats: int = 5,
                     warmup: int = 2, comm=None, device=None) -> Dict[str, List[Tuple[int, float]]]:
    """{kind: [(bytes each rank sends, median seconds over repeats, mean over ranks)]} for float32
    tensors ("allreduce_half": float16, summed by the transport at its own rate) on ``device``
    (default the CPU; on a GPU each reading waits for it); a barrier before each timed call lines
    the ranks up."""
    comm = _comm(comm)
    device = _device(device)
    timer = timer_for(device)
    out: Dict[str, List[Tuple[int, float]]] = {}
    for kind in kinds:
        if kind not in ("allreduce", "allgather", "allreduce_half"):
            raise ValueError(f"profiling: kind must be 'allreduce', 'allgather' or 'allreduce_half'; got {kind!r}")
        medians = []
        for nbytes in sizes_bytes:
            if kind == "allreduce_half":
                x = torch.ones(max(1, int(nbytes) // 2), dtype=torch.float16, device=device)
            else:
                x = torch.ones(max(1, int(nbytes) // 4), device=device)
            # one name per size, reused: Horovod's response cache then serves the repeats, as it
            # serves a training loop's exchanges (same names every step)
            if kind == "allreduce_half":
                def call():
                    comm.allreduce_(x, f"hvc.profile.arh.{nbytes}")
            elif kind == "allreduce":
                def call():
                    comm.allreduce_(x, f"hvc.profile.ar.{nbytes}")
            else:
                def call():
                    comm.allgather(x, f"hvc.profile.ag.{nbytes}")
            medians.append(_median_seconds(call, repeats, warmup, before=comm.barrier, timer=timer))
        out[kind] = list(zip((int(b) for b in sizes_bytes), _rank_mean(medians, f"hvc.profile.{kind}", comm)))
    return out


def _context(numel: int, world_size: int) -> ExchangeContext:
    ctx = ExchangeContext(key="hvc.profile", step=1, world_size=world_size, scale=1.0 / world_size)
    names = {f.name for f in fields(ExchangeContext)}
    if "shape" in names:  # a 2-D shape: compressors that send 1-D tensors dense take their sparse path
        ctx.shape = (1, numel)
    if "epoch" in names:  # past any warm-up: the target density
        ctx.epoch = 1 << 20
    return ctx


def compress_seconds(spec, numel: int, world_size: int = 1, repeats: int = 5, warmup: int = 1,
                     device=None) -> float:
    """Median seconds of one compress step of ``spec`` on ``numel`` random float32 entries on
    ``device`` (default the CPU): the exchange generator run up to its first round of collectives
    (then abandoned)."""
    comp = build_compressor(resolve(spec))
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen).to(_device(device))
    ctx = _context(numel, world_size)

    def call():
        exchange = comp.exchange(x, ctx)
        try:
            next(exchange)
        except StopIteration:
            pass
        exchange.close()

    repeats, warmup = _calls(x, repeats, warmup)
    with torch.no_grad():
        return _median_seconds(call, repeats, warmup, timer=timer_for(x))


def _local_results(requests, world_size: int):
    """What the collectives would return if every rank sent this rank's payload."""
    from .collectives import Allgather
    return tuple(torch.cat([r.tensor] * world_size) if isinstance(r, Allgather) else r.tensor * world_size
                 for r in requests)


def decompress_seconds(spec, numel: int, world_size: int = 1, repeats: int = 5, warmup: int = 1,
                       device=None) -> float:
    """Median seconds of what follows the collectives of ``spec``'s exchange on ``numel`` random
    float32 entries on ``device`` (default the CPU) -- decompression, aggregation, scaling, later
    rounds' own code -- plus the copy of the result into a gradient (the optimizer's scatter), with
    every rank's payload taken equal to this one's. The collectives themselves are not timed."""
    comp = build_compressor(resolve(spec))
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen).to(_device(device))
    grad = torch.empty(numel, device=x.device)
    ctx = _context(numel, world_size)
    timer = timer_for(x)
    repeats, warmup = _calls(x, repeats, warmup)
    times = []
    with torch.no_grad():
        for i in range(warmup + repeats):
            exchange = comp.exchange(x, ctx)
            requests, elapsed = next(exchange), 0.0
            while True:
                results = _local_results(requests, world_size)
                start = timer.now()
                try:
                    requests = exchange.send(results)
                except StopIteration as stop:
                    grad.copy_(stop.value)
                    elapsed += timer.now() - start
                    break
                elapsed += timer.now() - start
            if i >= warmup:
                times.append(elapsed)
    return statistics.median(times)


def time_decompression(spec, sizes: Sequence[int] = DEFAULT_COMPRESS_ELEMENTS, repeats: int = 5,
                       warmup: int = 1, average: bool = True, comm=None, device=None) -> List[Tuple[int, float]]:
    """[(elements, median seconds)] of ``decompress_seconds`` on ``device``; averaged over ranks if ``average``."""
    world = _comm(comm).size() if average else 1
    secs = [decompress_seconds(spec, int(d), world, repeats, warmup, device) for d in sizes]
    if average:
        secs = _rank_mean(secs, f"hvc.profile.decompress.{resolve(spec)}", comm)
    return list(zip((int(d) for d in sizes), secs))


def time_launch(repeats: int = 20, warmup: int = 3, comm=None, device=None) -> float:
    """Median CPU seconds of handing one small collective to Horovod (the ``*_async`` call alone,
    which runs on the training thread), over allreduce and allgather, of a tensor on ``device``
    (default the CPU), mean over ranks."""
    from .collectives import Allgather, Allreduce

    comm = _comm(comm)
    x = torch.ones(256, device=_device(device))
    times = []
    for i in range(warmup + repeats):
        for kind, req in (("ar", Allreduce(x)), ("ag", Allgather(x))):
            start = time.perf_counter()
            handles = comm.launch((req,), f"hvc.profile.launch.{kind}")
            elapsed = time.perf_counter() - start
            comm.wait(handles)
            if i >= warmup:
                times.append(elapsed)
    return _rank_mean([statistics.median(times)], "hvc.profile.launch", comm)[0]


BURST = 16  # collectives timed by time_burst and time_sequence


def time_sequence(count: int = BURST, repeats: int = 5, warmup: int = 2, comm=None, device=None) -> float:
    """Seconds per collective of ``count`` small allreduces run one after another, each launched
    when the previous one completed (median over ``repeats`` after a barrier, mean over ranks):
    each is alone in Horovod's negotiation cycle and the ranks are not lined up by a barrier, as a
    group launched on its own during a step is (``CostModel.alone_alpha``). A single collective
    right after a barrier, which the alpha-beta fits time, pays less: the barrier lines the ranks
    up with each other and with the cycle. Tensors on ``device`` (default the CPU)."""
    from .collectives import Allreduce

    if count < 1:
        raise ValueError(f"time_sequence: count must be >= 1; got {count}")
    comm = _comm(comm)
    device = _device(device)
    xs = [torch.ones(256, device=device) for _ in range(count)]

    def call():
        for i in range(count):
            comm.wait(comm.launch((Allreduce(xs[i]),), f"hvc.profile.seq.{i}"))

    seconds = _median_seconds(call, repeats, warmup, before=comm.barrier, timer=timer_for(device))
    return _rank_mean([seconds / count], "hvc.profile.seq", comm)[0]


def time_burst(count: int = BURST, repeats: int = 5, warmup: int = 2, comm=None, device=None) -> float:
    """Seconds per further collective of a burst: ``count`` small allreduces launched at once (one
    negotiation cycle), timed to the last completion, against one alone; (burst - one) / (count -
    1), medians over ``repeats`` after a barrier, mean over ranks. What a collective costs beyond
    its transfer when it is queued with others, as a layerwise exchange's backlog is
    (``CostModel.queued_alpha``). Tensors on ``device`` (default the CPU)."""
    from .collectives import Allreduce

    if count < 2:
        raise ValueError(f"time_burst: count must be >= 2; got {count}")
    comm = _comm(comm)
    device = _device(device)
    timer = timer_for(device)
    xs = [torch.ones(256, device=device) for _ in range(count)]

    def burst(k):
        def call():
            handles = [comm.launch((Allreduce(xs[i]),), f"hvc.profile.burst.{i}") for i in range(k)]
            for h in handles:
                comm.wait(h)
        return call

    one = _median_seconds(burst(1), repeats, warmup, before=comm.barrier, timer=timer)
    many = _median_seconds(burst(count), repeats, warmup, before=comm.barrier, timer=timer)
    return max(0.0, _rank_mean([(many - one) / (count - 1)], "hvc.profile.burst", comm)[0])


def time_compression(spec, sizes: Sequence[int] = DEFAULT_COMPRESS_ELEMENTS, repeats: int = 5,
                     warmup: int = 1, average: bool = True, comm=None, device=None) -> List[Tuple[int, float]]:
    """[(elements, median seconds)] of ``spec``'s compress step on ``device``; averaged over ranks
    if ``average`` (needs Horovod), else this process's own times."""
    world = _comm(comm).size() if average else 1
    secs = [compress_seconds(spec, int(d), world, repeats, warmup, device) for d in sizes]
    if average:
        secs = _rank_mean(secs, f"hvc.profile.compress.{resolve(spec)}", comm)
    return list(zip((int(d) for d in sizes), secs))


def profile_workload(model: torch.nn.Module, closure: Callable[[], torch.Tensor], iters: int = 5,
                     warmup: int = 2, optimizer: Optional[torch.optim.Optimizer] = None,
                     average: bool = True, comm=None) -> Workload:
    """Per-parameter backward times of ``model``: ``closure()`` runs the forward pass and returns
    the loss; its ``backward()`` is timed with a hook on every parameter (called when the
    parameter's gradient is complete). t_b[i] is the time from the previous hook (or from the
    start of backward) to the i-th, medians over ``iters`` runs after ``warmup``; the order of
    the hooks is the backward order. ``optimizer.step()``, if given, is timed as the update.
    Parameters that get no gradient come last with t_b = 0. With ``average`` (Horovod running),
    times are averaged over ranks and rank 0's order is used everywhere. On a CUDA model every
    reading waits for the device (``timing.CudaTimer``)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    timer = timer_for(p for _, p in named)
    stamps: Dict[str, float] = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda _p, n=n: stamps.__setitem__(n, timer.now()))
             for n, p in named]
    runs: List[Tuple[List[str], Dict[str, float], float, float]] = []
    try:
        for it in range(warmup + iters):
            for _, p in named:
                p.grad = None
            stamps.clear()
            t0 = timer.now()
            loss = closure()
            t1 = timer.now()
            loss.backward()
            t2 = timer.now()
            if optimizer is not None:
                optimizer.step()
            t3 = timer.now()
            order = sorted(stamps, key=stamps.get)
            gaps, prev = {}, t1
            for n in order:
                gaps[n], prev = stamps[n] - prev, stamps[n]
            if it >= warmup:
                runs.append((order, gaps, t1 - t0, t3 - t2))
    finally:
        for h in hooks:
            h.remove()
    order = runs[0][0]
    order = order + [n for n, _ in named if n not in order]
    if average:
        order = _comm(comm).broadcast_object(order, "hvc.profile.order")
    t_b = [statistics.median(r[1].get(n, 0.0) for r in runs) for n in order]
    forward = statistics.median(r[2] for r in runs)
    update = statistics.median(r[3] for r in runs)
    if average:
        *t_b, forward, update = _rank_mean(t_b + [forward, update], "hvc.profile.workload", comm)
    by_name = dict(named)
    sizes = [float(by_name[n].numel() * by_name[n].element_size()) for n in order]
    shapes = tuple(tuple(int(x) for x in by_name[n].shape) for n in order)
    return Workload(tuple(order), tuple(sizes), tuple(max(0.0, t) for t in t_b), forward, update, shapes)


def hosts(comm=None) -> Tuple[str, ...]:
    """Every rank's host name (the host set a cached model is keyed by), in process-set order."""
    return tuple(_comm(comm).allgather_object(socket.gethostname(), "hvc.profile.hosts"))


def _host_leader(names: Sequence[str], comm) -> bool:
    """Whether this rank is the first of the process set on its host (the one that writes the
    host's cache file)."""
    return names.index(socket.gethostname()) == comm.rank() if socket.gethostname() in names else False


def profile_cost_model(specs: Iterable = ("none",), comm_bytes: Sequence[int] = DEFAULT_COMM_BYTES,
                       compress_elements: Sequence[int] = DEFAULT_COMPRESS_ELEMENTS, repeats: int = 5,
                       save: bool = True, path: Optional[str] = None, comm=None, device=None) -> CostModel:
    """Time the collectives and every spec's compression (on ``device``, default the CPU: the
    collectives' tensors and the codecs' both), fit a
    ``CostModel`` (identical on all ranks) and, with ``save``, write it to the cache (the first rank
    of each host) and to ``path`` (rank 0 of the process set)."""
    com = _comm(comm)
    specs = [resolve(s) for s in specs]
    started = time.perf_counter()
    kinds = ("allreduce", "allgather") + (("allreduce_half",) if any(sums_half(s) for s in specs) else ())
    comm = time_collectives(kinds, sizes_bytes=comm_bytes, repeats=repeats, comm=com, device=device)
    launch = time_launch(comm=com, device=device)
    compress = {str(resolve(s)): time_compression(s, compress_elements, repeats, comm=com, device=device)
                for s in specs}
    decompress = {str(resolve(s)): time_decompression(s, compress_elements, repeats, comm=com, device=device)
                  for s in specs}
    elapsed = _rank_mean([time.perf_counter() - started], "hvc.profile.elapsed", com)[0]
    meta = {"source": "torch_ops.profiling", "torch": torch.__version__,
            **com.versions(), "profile_seconds": round(elapsed, 3),
            "samples": {"allreduce": comm["allreduce"], "allgather": comm["allgather"], "compress": compress,
                        "decompress": decompress, **({"allreduce_half": comm["allreduce_half"]}
                                                     if "allreduce_half" in comm else {})},
            **({"device": _device(device).type} if _device(device).type != "cpu" else {})}
    names = hosts(com)
    model = fit_cost_model(com.size(), comm["allreduce"], comm["allgather"], compress, names,
                           meta=json.loads(json.dumps(meta)),  # as it reads back from the cache
                           decompress_samples=decompress, launch_seconds=launch,
                           allreduce_half_samples=comm.get("allreduce_half"))
    if save and _host_leader(names, com):
        model.save()
    if save and path and com.rank() == 0:
        model.save(path)
    return model


def comm_sizes_up_to(max_bytes: Optional[float], sizes: Sequence[int] = DEFAULT_COMM_BYTES) -> List[int]:
    """The sample sizes up to the first one >= ``max_bytes`` (all of them for None): no need to
    time collectives larger than the whole gradient."""
    out = []
    for b in sizes:
        out.append(int(b))
        if max_bytes is not None and b >= max_bytes:
            break
    return out if len(out) >= 3 else list(sizes[:3])


def load_or_profile(specs: Iterable = ("none",), max_bytes: Optional[float] = None, **kwargs) -> CostModel:
    """The cached model of this world size and host set, with a compression fit for every spec
    (fits missing from the cache are timed and added); else profile (a few seconds), timing
    collectives up to ``max_bytes`` per rank. Rank 0 decides and its model is broadcast, so
    all ranks agree. Call on every rank of the process set (``comm``; default all ranks).
    ``transport=True``: a cached model also gets the transport terms it lacks (``with_fits``)."""
    comm = _comm(kwargs.pop("comm", None))
    transport = bool(kwargs.pop("transport", False))
    device = _device(kwargs.pop("device", None))
    specs = [resolve(s) for s in specs]
    names = hosts(comm)
    cached = None
    if comm.rank() == 0:
        model = CostModel.cached(comm.size(), names)
        if model is not None and model.meta.get("device", "cpu") != device.type:
            model = None  # its codecs were timed on another kind of device
        cached = model.to_dict() if model is not None else None
    cached = comm.broadcast_object(cached, "hvc.profile.cached")
    if cached is None:
        kwargs.setdefault("comm_bytes", comm_sizes_up_to(max_bytes))
        return profile_cost_model(specs, comm=comm, device=device, **kwargs)
    model = CostModel.from_dict(cached)
    completed = with_fits(model, specs, comm=comm, compress_elements=kwargs.get("compress_elements"),
                          comm_bytes=comm_sizes_up_to(max_bytes), transport=transport, device=device)
    if completed is not model and kwargs.get("save", True) and _host_leader(names, comm):
        completed.save()
    return completed


def with_fits(model: CostModel, specs: Iterable, comm=None, compress_elements=None,
              comm_bytes: Optional[Sequence[int]] = None, transport: bool = False, device=None) -> CostModel:
    """``model`` with a compression and decompression fit for every spec of ``specs``: the missing
    ones are timed on this machine (on ``device``, default the CPU) and added (``model`` itself when none is missing). With
    ``transport``, also the transport terms a model fitted before them lacks: the fp16 allreduce
    fit if a spec sums halves (timed at ``comm_bytes``); and the start-ups of a training step
    (``time_sequence``, ``time_burst``) are recorded in its meta (``step_start_ups``), not set:
    whether these idle timings stand for what a step pays is to be checked against measured steps
    (``benchmarks/advise_replay.py --link-patch start_ups=1``) before predictions use them.
    Call on every rank of the process set (``comm``): the timings are agreed across ranks."""
    comm = _comm(comm)
    specs = [resolve(s) for s in specs]
    missing = [s for s in specs if not (model.has_compress_fit(s) and model.has_decompress_fit(s))]
    extra = {}
    if transport and model.allreduce_half is None and any(sums_half(s) for s in specs):
        samples = time_collectives(("allreduce_half",), comm_bytes or DEFAULT_COMM_BYTES[:6], comm=comm, device=device)
        extra["allreduce_half"] = fit_half(samples["allreduce_half"])
        extra["meta"] = dict(model.meta, samples={**dict(model.meta.get("samples", {})), **samples})
    if transport and "step_start_ups" not in model.meta:
        timed = {"alone_s": time_sequence(comm=comm, device=device), "queued_s": time_burst(comm=comm, device=device)}
        extra["meta"] = dict(extra.get("meta", model.meta), step_start_ups=timed)
    if extra:
        model = replace(model, **extra)
    if not missing:
        return model
    compress, decompress = dict(model.compress), dict(model.decompress)
    sizes = compress_elements or DEFAULT_COMPRESS_ELEMENTS
    for s in missing:
        for table, timer in ((compress, time_compression), (decompress, time_decompression)):
            samples = timer(s, sizes, comm=comm, device=device)
            table[str(s)] = fit_compute([d for d, _ in samples], [t for _, t in samples])
    return replace(model, compress=compress, decompress=decompress)


def profile_hops(local, cross, topology, max_bytes: Optional[float] = None, repeats: int = 3,
                 world=None, device=None) -> Dict[str, CostModel]:
    """A ``CostModel`` of each hop of a two-level topology: ``intra`` timed on ``local`` (the node's
    ranks, every node at once) and ``inter`` on ``cross`` (the ranks at one local position, every
    position at once: the node's links shared as a two-level exchange shares them), collectives up
    to ``max_bytes``. Each node times its own link, so the fits of rank 0 are broadcast on
    ``world`` (every rank of it calls this at the same point) and every rank decides alike. Tensors
    on ``device`` (default the CPU), as the gradients the hops will carry."""
    sizes = comm_sizes_up_to(max_bytes)
    fits = {}
    for name, comm, ranks in (("intra", local, topology.local_size), ("inter", cross, topology.nodes)):
        timed = time_collectives(("allreduce", "allgather"), sizes, repeats=repeats, comm=comm, device=device)
        fits[name] = fit_cost_model(ranks, timed["allreduce"], timed["allgather"],
                                    meta={"timed_on": f"{name} groups, all at once"}).to_dict()
    if world is not None:
        fits = world.broadcast_object(fits, "hvc.profile.hops")
    return {name: CostModel.from_dict(d) for name, d in fits.items()}
