"""Worker code for tests/test_placement.py: every spec through the three torch.distributed front ends
on 2 real Gloo processes, checking that no tensor the library makes on the default device without
naming one reaches a collective or an exchange's result.

A CPU machine cannot put the gradients on a second device, so the check follows where tensors come
from instead (``DefaultDeviceTracer``, a ``TorchFunctionMode``): a tensor made by a factory
(``torch.zeros``, ``torch.tensor``, ...) without ``device=`` in the library's code
(``torch_ops/``, ``hvdcompress/``) or in ``benchmarks/gpu_e2e.py`` is *traced* (0-dim ones too, but
those may meet device tensors in arithmetic, as CUDA allows a CPU scalar there; ``cat`` / ``stack``
of one is traced), and so is everything computed from a traced tensor (in place included). With
CUDA gradients each of them would be on the CPU: the collectives (``torch.distributed``'s functions,
wrapped here, calling the real ones) and the results of the exchanges (the non-finite guard's
return value, which every front end goes through) must hold none. That is what NCCL demands
("No backend type associated with device type cpu") and what mixing devices in a compressor breaks.

The compressors take the branch CUDA tensors take (``HVDCOMPRESS_TORCH_ONLY=1``): torch ops, no
numpy views, no compiled kernels.
"""

from __future__ import annotations

import os
import sys
import traceback

from scenarios import kit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "eye", "rand", "randn",
             "randint", "randperm", "from_numpy", "empty_strided", "scalar_tensor"}
JOINS = {"cat", "concat", "concatenate", "stack", "hstack", "vstack"}  # a 0-dim CPU tensor here breaks on CUDA
WATCHED = (os.path.join(ROOT, "torch_ops") + os.sep, os.path.join(ROOT, "hvdcompress") + os.sep,
           os.path.join(ROOT, "benchmarks", "gpu_e2e.py"))
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single",
               "broadcast", "reduce_scatter_tensor", "all_to_all")


def _caller() -> str:
    """file:line of the first frame outside torch and this module (who called the factory)."""
    import torch
    skip = (os.path.dirname(torch.__file__), os.path.abspath(__file__))
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(skip[0]) or f.f_code.co_filename == skip[1]):
        f = f.f_back
    return "?" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


def make_tracer():
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    class DefaultDeviceTracer(TorchFunctionMode):
        """Traces tensors made without ``device=`` in watched code, and everything made from them."""

        def __init__(self):
            super().__init__()
            self.traced = {}  # id -> (tensor, where it was made): strong references keep ids unique
            self.scalars = {}  # 0-dim ones: fine as operands, not as collective data or in a join

        def origin(self, t):
            hit = self.traced.get(id(t)) or self.scalars.get(id(t))
            return None if hit is None or hit[0] is not t else hit[1]

        def _is(self, table, t):
            hit = table.get(id(t))
            return hit is not None and hit[0] is t

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if not flat_out and name != "__setitem__":
                return out
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            source = None
            if name in FACTORIES and kwargs.get("device") is None and not (args and isinstance(args[0], torch.Tensor)):
                where = _caller()
                if where.startswith(WATCHED):
                    source = f"torch.{name} without device= at {where}"
            if source is None:
                moved = name in ("to", "cuda") and (kwargs.get("device") is not None or any(
                    isinstance(a, (str, torch.device)) for a in args[1:]))
                if moved:  # on its named device now (on the CPU that may be the same object)
                    for t in flat_out:
                        self.traced.pop(id(t), None)
                        self.scalars.pop(id(t), None)
                    return out
                for t in ins:
                    if self._is(self.traced, t) or (name in JOINS and self._is(self.scalars, t)):
                        source = self.origin(t)
                        break
            if source is None:
                return out
            if name == "__setitem__":
                flat_out = [args[0]]
            for t in flat_out:
                (self.scalars if t.dim() == 0 and name in FACTORIES else self.traced)[id(t)] = (t, source)
            return out

        def offenders(self, tensors):
            return [self.origin(t) for t in tensors if isinstance(t, torch.Tensor) and self.origin(t)]

    return DefaultDeviceTracer()


def _check_collectives(tracer, found):
    """Wrap torch.distributed's collectives: each call's tensors checked, then the real collective."""
    import torch.distributed as dist
    from torch.utils._pytree import tree_flatten
    for name in COLLECTIVES:
        real = getattr(dist, name, None)
        if real is None:
            continue

        def wrapped(*args, _real=real, _name=name, **kwargs):
            for origin in tracer.offenders(tree_flatten((args, kwargs))[0]):
                found.append(f"dist.{_name}: {origin}")
            return _real(*args, **kwargs)

        setattr(dist, name, wrapped)


def _check_results(tracer, found):
    """Wrap the non-finite guard (every exchange of every front end ends in it): its result checked."""
    from torch_ops import session
    real = session.guard

    def guard(gen, x, state):
        out = yield from real(gen, x, state)
        for origin in tracer.offenders([out]):
            found.append(f"exchange result: {origin}")
        return out

    session.guard = guard


def _worker(rank, world, port, specs, out_dir):
    os.environ["HVDCOMPRESS_TORCH_ONLY"] = "1"
    kit.gloo_init(rank, world, port)
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_e2e
    tracer = make_tracer()
    out = {}
    for spec in specs:
        for front, run in (("hook", lambda s: gpu_e2e.run_hook(s, "cpu", 2)[0]),
                           ("opt", lambda s: gpu_e2e.run_opt(s, "cpu", 2)),
                           ("diloco", lambda s: gpu_e2e.run_diloco(s, "cpu", 1))):
            found = []
            saved = {n: getattr(dist, n, None) for n in COLLECTIVES}
            from torch_ops import session
            saved_guard = session.guard
            _check_collectives(tracer, found)
            _check_results(tracer, found)
            try:
                with tracer:
                    same = run(spec)
                out[f"{front} {spec}"] = {"identical": same, "found": sorted(set(found))}
            except Exception:
                out[f"{front} {spec}"] = {"error": traceback.format_exc()}
            finally:
                for n, fn in saved.items():
                    if fn is not None:
                        setattr(dist, n, fn)
                session.guard = saved_guard
                tracer.traced.clear()
                tracer.scalars.clear()
    kit.gloo_finish(out, out_dir, rank)


def launch(world: int, specs) -> list:
    """One spawn of ``world`` Gloo processes running every spec through the three front ends."""
    return kit.gloo_spawn(_worker, world, (list(specs),), prefix="hvc-placement-")
