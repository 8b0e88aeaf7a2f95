"""Train a small CNN on scikit-learn's bundled digits with PyTorch Lightning's DDP and a compressing hook.

    python examples/lightning_digits.py --compression dgc:ratio=0.01 --devices 2

Needs the optional ``lightning`` package (not in requirements/). Lightning launches the other
processes itself (``DDPStrategy``'s default ``start_method="popen"`` runs this script again per
rank), wraps the LightningModule in ``DistributedDataParallel`` and creates the optimizer from
``configure_optimizers``. The hook is registered by the ``CompressedDDP`` callback below::

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(),
                        callbacks=[CompressedDDP("dgc:ratio=0.01")])

Why a callback rather than ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``: Lightning 2.x
registers those only when the root device is CUDA (on CPU they are silently ignored), and it builds
the optimizer after registering them, so DGC and the count sketch could not take its momentum over.
``on_fit_start`` runs after the strategy wrapped the model and built the optimizers and before the
first backward pass, on every device type, so the callback hands the hook both.

At the end every rank prints a checksum of its parameters and whether all ranks hold identical
parameters; rank 0 prints the test accuracy and the bytes each rank sent per step. Exit status 1
if the parameters differ across ranks.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import hvdcompress.ddp
from hvdcompress import parse_spec
from hvdcompress.bench.example_models import DigitsCNN
from hvdcompress.datasets import load_digits


class CompressedDDP(L.Callback):
    """Registers an hvdcompress communication hook on the DDP model Lightning built.

    spec: a compression spec (``"topk:ratio=0.01"``, ``"dgc:ratio=0.001"``).

    The hook gets the first optimizer of ``configure_optimizers``, so DGC and the sketch take its
    momentum over (its ``momentum`` becomes 0). The optimizer's ``weight_decay`` must then be 0:
    the hook would move it into the compressor and add it in a step pre-hook, but Lightning runs
    forward and backward inside ``optimizer.step(closure)``, after that pre-hook, so the term would
    be lost; a ValueError says so instead. ``state`` (the hook's ``CommHookState``: wire statistics,
    ``state_dict()``) is set from ``on_fit_start`` on.
    """

    def __init__(self, spec):
        self.spec = parse_spec(spec) if isinstance(spec, str) else spec  # a bad spec fails here
        self.state = None

    def on_fit_start(self, trainer, pl_module):
        ddp_model = trainer.strategy.model  # DistributedDataParallel once the strategy is set up
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(f"CompressedDDP needs a DDP strategy; the model is a {type(ddp_model).__name__}")
        opt = trainer.optimizers[0] if trainer.optimizers else None
        decays = [g.get("weight_decay", 0.0) for g in opt.param_groups] if opt is not None else []
        self.state, hook = hvdcompress.ddp.comm_hook(self.spec, model=ddp_model, optimizer=opt)
        if opt is not None and any(wd and not g.get("weight_decay", 0.0) for wd, g in zip(decays, opt.param_groups)):
            raise ValueError(f"CompressedDDP: '{self.state.spec.name}' takes the optimizer's weight decay over, which "
                             "Lightning's closure-based optimizer step would drop; use weight_decay=0")
        ddp_model.register_comm_hook(self.state, hook)

    def on_train_epoch_start(self, trainer, pl_module):
        self.state.set_epoch(trainer.current_epoch)  # DGC's sparsity warm-up follows the epochs


class DigitsModule(L.LightningModule):
    def __init__(self, lr: float, momentum: float):
        super().__init__()
        self.net, self.lr, self.momentum = DigitsCNN(), lr, momentum

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", default="dgc:ratio=0.01", help="spec, e.g. none, topk:ratio=0.01, dgc:ratio=0.01")
    p.add_argument("--devices", type=int, default=2, help="processes: CPU ones, or GPUs with --accelerator gpu")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: Lightning pins each rank to its own GPU (LOCAL_RANK) and uses NCCL")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> bool:
    args = parse_args(argv)
    torch.set_num_threads(1)  # ranks share the machine's cores
    L.seed_everything(args.seed, verbose=False)
    d = load_digits(args.seed)
    train = DataLoader(TensorDataset(torch.from_numpy(d.x_train), torch.from_numpy(d.y_train)),
                       batch_size=args.batch_size, shuffle=True)  # Lightning adds a DistributedSampler
    module = DigitsModule(args.lr, args.momentum)
    compressed = CompressedDDP(args.compression)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=DDPStrategy(), max_epochs=args.epochs,
                        callbacks=[compressed], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train)

    rank, size = dist.get_rank(), dist.get_world_size()
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    rows = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(rows, flat)
    identical = all(torch.equal(rows[0], r) for r in rows)
    digest = hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()[:16]
    print(f"rank {rank}: parameter sha256 {digest}, identical across {size} ranks: {identical}", flush=True)
    if rank == 0:
        module.eval()
        with torch.no_grad():
            x_test = torch.from_numpy(d.x_test).to(module.device)
            acc = (module(x_test).argmax(1).cpu() == torch.from_numpy(d.y_test)).float().mean().item()
        stats = compressed.state.stats.as_dict()
        print(f"compression           {compressed.state.spec}")
        print(f"test accuracy         {acc:.4f} after {trainer.global_step} steps ({args.epochs} epochs)")
        print(f"bytes/step per rank   {stats['bytes_per_step']:.0f} (dense {stats['dense_bytes_per_step']:.0f}, "
              f"{stats['ratio']:.1f}x smaller)")
        print(f"optimizer momentum    {trainer.optimizers[0].param_groups[0]['momentum']} (DGC takes it over)")
    return identical


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
