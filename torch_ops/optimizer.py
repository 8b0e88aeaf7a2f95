"""``DistributedOptimizer``: Horovod's PyTorch optimizer wrapper, with gradient compression.

Drop-in for ``horovod.torch.DistributedOptimizer``: the same arguments keep their names and
meaning (named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
sparse_as_dense, process_set), and ``synchronize()`` / ``skip_synchronize()`` / ``step()`` /
``zero_grad()`` behave as there. The returned object is an instance of a subclass of the wrapped
optimizer's class, so schedulers and ``isinstance`` checks keep working.

How a step runs:

1. backward: when a parameter's gradient is final (``register_post_accumulate_grad_hook``, after
   ``backward_passes_per_step`` passes), the hook compresses it and launches its exchange
   (``Compressor.exchange``, a generator of collective rounds) as Horovod async ops, while the
   rest of backward still runs;
2. ``synchronize()`` launches the exchanges of parameters that got no gradient (with zeros, as
   Horovod does, so every rank takes part), drives all exchanges to completion, round-robin, and
   writes each result into ``p.grad``;
3. the wrapped optimizer's own ``step()`` then runs on the exchanged gradients.

Compressor state (residuals) is optimizer state: ``state_dict()`` holds it under the key
``"hvdcompress"`` and ``load_state_dict()`` restores it. Residuals differ per rank, so to resume
exactly every rank saves and loads its own ``state_dict()``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Dict, List, Optional

import torch

from hvdcompress.spec import CompressionSpec, resolve
from hvdcompress.stats import WireStats

from .collectives import HorovodDriver, PendingExchange, finish_all
from .compressors import ExchangeContext, build_compressor
from .compressors.dgc import adopt_momentum

STATE_KEY = "hvdcompress"
STATE_VERSION = 1


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, spec: CompressionSpec, backward_passes_per_step: int,
                 op, gradient_predivide_factor: float, sparse_as_dense: bool, process_set, driver, source):
        super(self.__class__, self).__init__(params)
        self.defaults = dict(source.defaults)
        self.state.update(source.state)

        self._hvc_spec = spec
        self._hvc_compressor = build_compressor(spec)
        self._hvc_names: Dict[torch.Tensor, str] = _parameter_names(self.param_groups, named_parameters)
        self._hvc_params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]
                                                if p.requires_grad]
        self._hvc_driver = driver if driver is not None else HorovodDriver(process_set)
        import horovod.torch as hvd

        self._hvc_world = (process_set or hvd.global_process_set).size()
        average = op == hvd.Average
        self._hvc_prescale = 1.0 / gradient_predivide_factor
        self._hvc_scale = gradient_predivide_factor / self._hvc_world if average else 1.0
        self._hvc_passes = backward_passes_per_step
        self._hvc_passes_left: Dict[torch.Tensor, int] = {p: backward_passes_per_step for p in self._hvc_params}
        self._hvc_pending: Dict[torch.Tensor, PendingExchange] = {}
        self._hvc_state: Dict[str, Dict[str, torch.Tensor]] = {self._hvc_names[p]: {} for p in self._hvc_params}
        self._hvc_step = 0
        self._hvc_epoch = 0
        self._hvc_sparse_as_dense = sparse_as_dense
        self._hvc_warned_sparse = False
        self._synchronized = False
        self._should_synchronize = True
        self.stats = WireStats()
        self._hvc_hooks = [p.register_post_accumulate_grad_hook(self._hvc_hook) for p in self._hvc_params]

    # -- public API (Horovod's) -----------------------------------------------------------------
    @property
    def compression(self) -> CompressionSpec:
        return self._hvc_spec

    def synchronize(self):
        """Finish every gradient exchange of this step and write the results into ``p.grad``."""
        for p in self._hvc_params:
            if p not in self._hvc_pending:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._hvc_launch(p)
        pending = self._hvc_pending
        with torch.no_grad():
            finish_all(list(pending.values()))
            for p, ex in pending.items():
                result = ex.result.view_as(p.grad)
                if result.data_ptr() != p.grad.data_ptr():
                    p.grad.copy_(result)
        dense = sum(p.numel() * p.element_size() for p in pending)
        self.stats.record(sum(ex.bytes_sent for ex in pending.values()), dense,
                          sum(ex.compute_seconds for ex in pending.values()))
        self._hvc_pending = {}
        self._hvc_passes_left = {p: self._hvc_passes for p in self._hvc_params}
        self._hvc_step += 1
        self._synchronized = True

    def set_epoch(self, epoch: int) -> None:
        """Tell compressors with a schedule (DGC's sparsity warm-up) which epoch is starting.
        Call it on every rank at the start of each epoch (0-based), like a sampler's set_epoch."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch: epoch must be an int >= 0; got {epoch!r}")
        self._hvc_epoch = epoch

    @property
    def epoch(self) -> int:
        return self._hvc_epoch

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use when ``synchronize()`` was called by hand (e.g. to clip gradients) before ``step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized and not self._hvc_pending:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(); the gradients were already exchanged, so "
                              "they are not exchanged (nor compressed) a second time.")
            else:
                self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._hvc_pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it "
                                 "can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)

    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        sd[STATE_KEY] = {
            "version": STATE_VERSION,
            "compression": self._hvc_spec.to_dict(),
            "step": self._hvc_step,
            "epoch": self._hvc_epoch,
            "state": {key: {k: t.detach().clone() for k, t in st.items()}
                      for key, st in self._hvc_state.items()},
        }
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        if ours is not None:
            self._hvc_check_state(ours)  # before anything is loaded: no half-restored optimizer
        super(self.__class__, self).load_state_dict(state_dict)
        if self._hvc_spec.name == "dgc":  # a loaded param_group must not bring momentum back
            for g in self.param_groups:
                if "momentum" in g:
                    g["momentum"] = 0.0
        if ours is None:
            warnings.warn("load_state_dict: the state dict has no compression state (saved by a "
                          "plain optimizer?); residuals start from zero.")
            return
        self._hvc_step = int(ours["step"])
        self._hvc_epoch = int(ours["epoch"])
        by_name = {self._hvc_names[p]: p for p in self._hvc_params}
        self._hvc_state = {key: {k: t.detach().clone().to(by_name[key].device) for k, t in st.items()}
                           for key, st in ours["state"].items()}

    # -- internals -------------------------------------------------------------------------------
    def _hvc_check_state(self, ours) -> None:
        if not isinstance(ours, dict) or ours.get("version") != STATE_VERSION:
            raise ValueError(f"load_state_dict: state_dict['{STATE_KEY}'] is not hvdcompress state "
                             f"version {STATE_VERSION}")
        saved = CompressionSpec.from_dict(ours["compression"])
        if saved != self._hvc_spec:
            raise ValueError(f"load_state_dict: the checkpoint was saved with compression '{saved}', "
                             f"this optimizer uses '{self._hvc_spec}'")
        numel = {self._hvc_names[p]: p.numel() for p in self._hvc_params}
        unknown = sorted(set(ours["state"]) - set(numel))
        if unknown:
            raise ValueError("load_state_dict: the checkpoint holds compression state for parameters this "
                             f"optimizer does not have: {', '.join(unknown[:5])}")
        for key, st in ours["state"].items():
            self._hvc_compressor.check_state(key, st, numel[key])

    def _hvc_hook(self, p: torch.Tensor) -> None:
        if p in self._hvc_pending:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                 "before call to step(). Increase backward_passes_per_step to "
                                 "accumulate gradients locally.")
        self._hvc_passes_left[p] -= 1
        if self._hvc_passes_left[p] == 0:
            self._hvc_launch(p)

    def _hvc_launch(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad.is_sparse:
            if not (self._hvc_sparse_as_dense or self._hvc_warned_sparse):
                warnings.warn("hvdcompress: sparse gradients are exchanged densified (as with "
                              "sparse_as_dense=True).")
                self._hvc_warned_sparse = True
            p.grad = grad = grad.to_dense()
        name = self._hvc_names[p]
        with torch.no_grad():
            x = grad.reshape(-1)
            if self._hvc_prescale != 1.0:
                x = x * self._hvc_prescale
            ctx = ExchangeContext(name, self._hvc_step, self._hvc_world, self._hvc_scale,
                                  self._hvc_state[name], tuple(p.shape), self._hvc_epoch)
            self._hvc_pending[p] = PendingExchange(self._hvc_compressor.exchange(x, ctx),
                                                   f"hvc.{name}", self._hvc_driver)
        self._synchronized = False


def _parameter_names(param_groups, named_parameters) -> Dict[torch.Tensor, str]:
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(param_groups)
                for j, p in enumerate(g["params"])}
    named_parameters = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named_parameters:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError("named_parameters: parameter names must be unique; found duplicates: "
                         + ", ".join(sorted(dups)))
    by_id = {id(p): name for name, p in named_parameters}
    names = {}
    for g in param_groups:
        for p in g["params"]:
            if id(p) not in by_id:
                raise ValueError("named_parameters was specified, but one or more model parameters "
                                 "were not named (the optimizer holds a parameter of shape "
                                 f"{tuple(p.shape)} that is not in named_parameters)")
            names[p] = by_id[id(p)]
    return names


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step: int = 1, op=None,
                         gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                         process_set=None, driver=None):
    """Wrap ``optimizer`` so gradients are compressed, exchanged among Horovod ranks and averaged.

    Args mirror ``horovod.torch.DistributedOptimizer``:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``; names key the collectives and the saved
            compression state (without it, names are generated from positions).
        compression: a spec string (``"topk:ratio=0.01"``), ``hvdcompress.Compression.topk(...)``,
            or Horovod's ``Compression.none`` / ``Compression.fp16``. Default: no compression.
        backward_passes_per_step: backward passes accumulated locally before each exchange (>= 1).
        op: ``hvd.Average`` (default) or ``hvd.Sum``. Adasum does not compose with compression.
        gradient_predivide_factor: with Average, gradients are divided by this factor before
            compression and the sum by size/factor after (> 0).
        sparse_as_dense: sparse gradients are always exchanged densified; this only silences the
            warning.
        process_set: a Horovod process set (default: all ranks).
        driver: the communicator that carries out collective requests (default
            ``HorovodDriver(process_set)``); benchmarks pass one that injects latency.

    Every argument is validated here, before any collective, identically on every rank.
    """
    import horovod.torch as hvd

    spec = resolve(compression)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer: expected a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("optimizer: LBFGS re-evaluates the closure several times per step and cannot "
                         "be wrapped (as in Horovod)")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step: must be an int >= 1; "
                         f"got {backward_passes_per_step!r}")
    op = hvd.Average if op is None else op
    if op == hvd.Adasum:
        raise ValueError("op: Adasum is not supported with compression; accepted: hvd.Average, hvd.Sum")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op: accepted values are hvd.Average and hvd.Sum; got {op!r}")
    try:
        factor = float(gradient_predivide_factor)
    except (TypeError, ValueError):
        factor = float("nan")
    if not factor > 0 or factor == float("inf"):
        raise ValueError("gradient_predivide_factor: must be a finite float > 0; "
                         f"got {gradient_predivide_factor!r}")
    if factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor: values other than 1.0 require op=hvd.Average")
    if spec.name == "dgc":  # DGC's momentum lives in its memory: take the optimizer's over
        spec = adopt_momentum(spec, optimizer.param_groups)
    if not hvd.is_initialized():
        raise ValueError("horovod is not initialized: call hvd.init() before DistributedOptimizer")

    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, spec, backward_passes_per_step, op, factor,
               sparse_as_dense, process_set, driver, optimizer)
