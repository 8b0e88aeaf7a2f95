"""A training script for tests/test_elastic.py, run by ``horovodrun --gloo`` elastic on localhost.

Rank 0 edits the host file the discovery script prints: after a few steps it adds a host
(127.0.0.1, one slot: a third worker joins), a few steps after the third worker took part it
removes it again. Every process appends one JSON line per step to OUTDIR/<pid>.jsonl: the world
size, whether every rank holds identical parameters, the optimizer's exchange counter on every
rank, and the residual norm of this rank."""

import json
import os
import sys

import torch

import horovod.torch as hvd
import hvdcompress.torch as hvc
from scenarios import kit

OUT = sys.argv[1]
SPEC = sys.argv[2] if len(sys.argv) > 2 else "topk:ratio=0.1"

hvd.init()
model = kit.torch_mlp((16, 32, 4), ("tanh",))
opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=SPEC, schedule="layerwise")
state = hvc.elastic.TorchState(model=model, optimizer=opt, step=0, phase="two", at_three=0, after=0)
log = open(os.path.join(OUT, f"{os.getpid()}.jsonl"), "a")


@hvc.elastic.run
def train(state):
    while not kit.elastic_finished(state):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + state.step)
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        size = hvd.size()
        identical = kit.torch_identical(model, f"check.{state.step}")
        steps = hvd.allgather(torch.tensor([opt.engine.step]), name=f"steps.{state.step}")
        residual = sum(float(st["residual"].norm()) for st in opt.state_dict()["hvdcompress"]["state"].values()
                       if "residual" in st)
        log.write(json.dumps({"step": state.step, "rank": hvd.rank(), "size": size, "phase": state.phase,
                              "identical": identical,
                              "opt_steps": steps.tolist(), "residual_norm": residual}) + "\n")
        log.flush()
        state.step += 1
        kit.elastic_advance(state, size, hvd.rank(), OUT)
        state.commit()


train(state)
log.write(json.dumps({"done": True, "rank": hvd.rank(), "step": state.step, "phase": state.phase}) + "\n")
log.close()
