"""A training script for tests/test_elastic.py, run by ``horovodrun --gloo`` elastic on localhost.

Rank 0 edits the host file the discovery script prints: after a few steps it adds a host
(127.0.0.1, one slot: a third worker joins), a few steps after the third worker took part it
removes it again. Every process appends one JSON line per step to OUTDIR/<pid>.jsonl: the world
size, whether every rank holds identical parameters, the optimizer's exchange counter on every
rank, and the residual norm of this rank."""

import json
import os
import sys
import time

import torch
import torch.nn as nn

import horovod.torch as hvd
import hvdcompress.torch as hvc

OUT = sys.argv[1]
SPEC = sys.argv[2] if len(sys.argv) > 2 else "topk:ratio=0.1"
ADD_AT, STEPS_AT_THREE, STEPS_AFTER, CAP = 3, 3, 3, 300


def write_hosts(text):
    tmp = os.path.join(OUT, "hosts.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(OUT, "hosts"))


hvd.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=SPEC, schedule="layerwise")
state = hvc.elastic.TorchState(model=model, optimizer=opt, step=0, phase="two", at_three=0, after=0)
log = open(os.path.join(OUT, f"{os.getpid()}.jsonl"), "a")


@hvc.elastic.run
def train(state):
    while state.step < CAP and not (state.phase == "back" and state.after >= STEPS_AFTER):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + state.step)
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        size = hvd.size()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        rows = hvd.allgather(flat.unsqueeze(0), name=f"check.{state.step}")
        steps = hvd.allgather(torch.tensor([opt.engine.step]), name=f"steps.{state.step}")
        residual = sum(float(st["residual"].norm()) for st in opt.state_dict()["hvdcompress"]["state"].values()
                       if "residual" in st)
        log.write(json.dumps({"step": state.step, "rank": hvd.rank(), "size": size, "phase": state.phase,
                              "identical": all(torch.equal(rows[0], r) for r in rows),
                              "opt_steps": steps.tolist(), "residual_norm": residual}) + "\n")
        log.flush()
        state.step += 1
        if state.phase == "two" and state.step >= ADD_AT:
            state.phase = "adding"
            if hvd.rank() == 0:
                write_hosts("localhost:2\n127.0.0.1:1\n")
        elif state.phase == "adding" and size == 3:
            state.phase = "three"
        elif state.phase == "three":
            state.at_three += 1
            if state.at_three >= STEPS_AT_THREE:
                state.phase = "removing"
                if hvd.rank() == 0:
                    write_hosts("localhost:2\n")
        elif state.phase == "removing" and size == 2:
            state.phase = "back"
        elif state.phase == "back":
            state.after += 1
        if state.phase in ("adding", "removing"):
            time.sleep(0.2)  # give the driver time to notice the host change
        state.commit()


train(state)
log.write(json.dumps({"done": True, "rank": hvd.rank(), "step": state.step, "phase": state.phase}) + "\n")
log.close()
