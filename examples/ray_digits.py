"""Train a small CNN on scikit-learn's bundled digits with Ray Train's TorchTrainer and a compressing hook.

    python examples/ray_digits.py --compression dgc:ratio=0.01 --workers 2

Needs the optional ``ray[train]`` package (not in requirements/). ``TorchTrainer`` starts the
workers and their Gloo process group; inside the training function ``ray.train.torch.prepare_model``
wraps the model in ``DistributedDataParallel``, and the hook goes on that model as in plain DDP::

    model = ray.train.torch.prepare_model(DigitsCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state, hook = hvdcompress.ddp.comm_hook("dgc:ratio=0.01", model=model, optimizer=opt)
    model.register_comm_hook(state, hook)

With ``--use-gpu`` Ray gives every worker its own GPU (and an NCCL process group);
``prepare_model`` moves the model to it (``ray.train.torch.get_device()``), and the data follows.
At the end every worker prints a checksum of its parameters and whether all workers hold identical
parameters; the driver prints what rank 0 reported: test accuracy and bytes sent per step, and the
checkpoint's files: every worker saves its own (``rank<r>.pt``: model, optimizer and hook state),
since each rank's residuals are its own; ``resume`` loads a rank's file. Exit status 1 if the
parameters differ across workers or a rank's file is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F


def train_loop(config: dict) -> None:
    """Runs on every Ray worker, inside the process group TorchTrainer made."""
    import ray.train
    import ray.train.torch

    import hvdcompress.ddp
    from hvdcompress.bench.example_models import DigitsCNN
    from hvdcompress.datasets import load_digits

    torch.set_num_threads(1)  # workers share the machine's cores
    ctx = ray.train.get_context()
    rank, size = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()  # this worker's GPU under use_gpu, else the CPU
    d = load_digits(config["seed"])
    x_tr, y_tr = torch.from_numpy(d.x_train).to(device), torch.from_numpy(d.y_train).to(device)
    steps_per_epoch = len(x_tr) // size // config["batch_size"]  # the same on every rank
    x_tr, y_tr = x_tr[rank::size], y_tr[rank::size]

    torch.manual_seed(config["seed"])
    model = ray.train.torch.prepare_model(DigitsCNN())  # DDP: broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    state, hook = hvdcompress.ddp.comm_hook(config["compression"], model=model, optimizer=opt)
    model.register_comm_hook(state, hook)

    gen = torch.Generator().manual_seed(config["seed"] * 1000 + rank)
    bs = config["batch_size"]
    for epoch in range(config["epochs"]):
        state.set_epoch(epoch)  # DGC's sparsity warm-up follows the epochs
        perm = torch.randperm(len(x_tr), generator=gen).to(device)
        for i in range(steps_per_epoch):
            idx = perm[i * bs:(i + 1) * bs]
            opt.zero_grad()
            F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            opt.step()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(rows, flat)
    identical = all(torch.equal(rows[0], r) for r in rows)
    digest = hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()[:16]
    print(f"rank {rank}: parameter sha256 {digest}, identical across {size} ranks: {identical}", flush=True)
    model.eval()
    with torch.no_grad():
        acc = (model(torch.from_numpy(d.x_test).to(device)).argmax(1).cpu() == torch.from_numpy(d.y_test)
               ).float().mean().item()
    stats = state.stats.as_dict()
    metrics = {"test_accuracy": acc, "identical": identical, "steps": state.step, "spec": str(state.spec),
               "bytes_per_step": stats["bytes_per_step"], "dense_bytes_per_step": stats["dense_bytes_per_step"],
               "momentum": opt.param_groups[0]["momentum"]}
    with tempfile.TemporaryDirectory() as tmp:
        # every rank saves its own file: residuals (and the hook's momenta) differ per rank, so rank 0's
        # alone would hand its residuals to every rank on resume; Ray gathers the files of one report
        # into one checkpoint directory (and keeps rank 0's metrics)
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
                   os.path.join(tmp, f"rank{rank}.pt"))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def resume(checkpoint_dir: str, rank: int, model, opt, state) -> None:
    """Load rank ``rank``'s own file of a checkpoint this script wrote into ``model`` (the DDP model),
    ``opt`` and the hook's ``state`` (built again with ``comm_hook`` first)."""
    saved = torch.load(os.path.join(checkpoint_dir, f"rank{rank}.pt"))
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", default="dgc:ratio=0.01", help="spec, e.g. none, topk:ratio=0.01, dgc:ratio=0.01")
    p.add_argument("--workers", type=int, default=2, help="workers (CPU processes; GPUs with --use-gpu)")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per worker (Ray pins them; NCCL)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> bool:
    args = parse_args(argv)
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from hvdcompress import parse_spec

    parse_spec(args.compression)  # a bad spec fails here, before any worker starts
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the workers import hvdcompress from here
    ray.init(num_cpus=args.workers, object_store_memory=100 * 2**20,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}})
    config = {"compression": args.compression, "epochs": args.epochs, "batch_size": args.batch_size,
              "lr": args.lr, "momentum": args.momentum, "seed": args.seed}
    trainer = TorchTrainer(train_loop, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.use_gpu),
                           run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="ray_digits_")))
    result = trainer.fit()
    m = result.metrics
    with result.checkpoint.as_directory() as folder:
        saved = sorted(f for f in os.listdir(folder) if f.startswith("rank"))
    ray.shutdown()
    print(f"compression           {m['spec']}")
    print(f"test accuracy         {m['test_accuracy']:.4f} after {m['steps']} steps ({args.epochs} epochs)")
    print(f"bytes/step per rank   {m['bytes_per_step']:.0f} (dense {m['dense_bytes_per_step']:.0f})")
    print(f"optimizer momentum    {m['momentum']} (DGC takes it over)")
    print(f"identical parameters  {m['identical']}")
    print(f"checkpoint            {', '.join(saved)} (one file per rank)")
    return bool(m["identical"]) and saved == [f"rank{r}.pt" for r in range(args.workers)]


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
