"""Worker code for tests/test_reliability.py: sparse gradients, models that differ across ranks."""

from __future__ import annotations

import traceback


class _EmbedNet:
    @staticmethod
    def make():
        import torch
        import torch.nn as nn
        torch.manual_seed(0)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(50, 8, sparse=True)
                self.head = nn.Linear(8, 3)

            def forward(self, idx):
                return self.head(self.emb(idx).mean(1))
        return Net()


def _batch(rank, step):
    import torch
    g = torch.Generator().manual_seed(31 * rank + step)
    idx = torch.randint(0, 50, (6, 4), generator=g)
    return idx, idx[:, 0] % 3


def _train(make_opt, steps=5):
    import horovod.torch as hvd
    import torch.nn as nn
    model = _EmbedNet.make()
    opts = make_opt(model)
    for step in range(steps):
        for o in opts:
            o.zero_grad()
        x, y = _batch(hvd.rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        for o in opts:
            o.step()
    return model, opts


def _flat(model):
    import torch
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def sparse_gradients() -> dict:
    """SparseAdam on an embedding with sparse gradients (and dense Adam on the head), through our
    optimizer with its default schedule, next to Horovod's own DistributedOptimizer."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc
    hvd.init()
    out = {}
    try:
        def ours(model, **kw):
            sparse = hvc.DistributedOptimizer(torch.optim.SparseAdam([model.emb.weight], lr=0.05),
                                              named_parameters=[("emb.weight", model.emb.weight)], **kw)
            dense = hvc.DistributedOptimizer(torch.optim.Adam(model.head.parameters(), lr=0.05),
                                             named_parameters=list(model.head.named_parameters()),
                                             compression="none")  # as Horovod: parity is checked below
            return [sparse, dense]

        def horovods(model):
            sparse = hvd.DistributedOptimizer(torch.optim.SparseAdam([model.emb.weight], lr=0.05),
                                              named_parameters=[("emb.weight", model.emb.weight)])
            dense = hvd.DistributedOptimizer(torch.optim.Adam(model.head.parameters(), lr=0.05),
                                             named_parameters=list(model.head.named_parameters()))
            return [sparse, dense]

        model, opts = _train(ours, steps=8)
        rows = hvd.allgather(_flat(model).unsqueeze(0), name="check.sparse")
        out["identical"] = bool(torch.equal(rows[0], rows[1]))
        out["groups"] = opts[0].groups
        out["bytes"] = opts[0].stats.as_dict()["bytes_per_step"]
        ref, _ = _train(horovods, steps=8)
        out["max_diff_vs_horovod_emb"] = float((model.emb.weight - ref.emb.weight).abs().max())
        # SGD with sparse gradients, sparse_as_dense=True: densified and compressed
        model2 = _EmbedNet.make()
        opt2 = hvc.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                        named_parameters=model2.named_parameters(), compression="topk:ratio=0.3",
                                        sparse_as_dense=True, schedule="single")
        for step in range(4):
            opt2.zero_grad()
            x, y = _batch(hvd.rank(), step)
            torch.nn.CrossEntropyLoss()(model2(x), y).backward()
            opt2.step()
        rows = hvd.allgather(_flat(model2).unsqueeze(0), name="check.dense")
        out["dense_identical"] = bool(torch.equal(rows[0], rows[1]))
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


def different_models() -> dict:
    """Rank 1's model has a differently shaped layer: a clear error on every rank, naming it."""
    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    import hvdcompress.torch as hvc
    hvd.init()
    out = {}
    try:
        width = 16 if hvd.rank() == 0 else 17
        model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
        try:
            hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression="topk:ratio=0.1")
            out["raised"] = None
        except ValueError as e:
            out["raised"] = str(e)
        out["after"] = float(hvd.allreduce(torch.ones(1), name="still.works").item())
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out
