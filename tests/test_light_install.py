"""The light route (``pip install -e .[torch]``: torch and numpy, no Horovod, no TensorFlow): the
torch.distributed front ends import and train with horovod and tensorflow made unimportable."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

PROGRAM = textwrap.dedent("""
    import sys

    # what an environment without Horovod and TensorFlow answers: `import horovod` raises
    # ModuleNotFoundError, importlib.util.find_spec("tensorflow") is None
    for name in ("horovod", "tensorflow", "tf_keras", "keras"):
        sys.modules[name] = None

    import os, tempfile
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcompress.ddp
    import hvdcompress.torch as hvc
    from torch_ops.diloco import DiLoCo
    from torch_ops.dist_collectives import TorchDistCommunicator

    dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "s"), rank=0,
                            world_size=1)
    torch.manual_seed(0)

    def net():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def steps(model, opt, n=3):
        for _ in range(n):
            x = torch.randn(4, 8)
            opt.zero_grad()
            F.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
            opt.step()

    ddp = DDP(net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state, hook = hvdcompress.ddp.comm_hook("topk:ratio=0.25", model=ddp, optimizer=opt)
    ddp.register_comm_hook(state, hook)
    steps(ddp, opt)

    model = net()
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="qsgd", backend="torch")
    steps(model, opt)

    model = net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, inner, sync_every=2, compression="fp16", transport=TorchDistCommunicator())
    steps(model, outer, 4)

    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("horovod", "tensorflow", "tf_ops")
                    and sys.modules[m] is not None)
    print("LOADED", loaded)
    try:
        hvc.init()
    except ImportError as exc:
        print("HOROVOD-NAME", exc)
""")


def test_torch_distributed_front_ends_without_horovod_and_tensorflow():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300, env=env,
                         cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "LOADED []" in run.stdout, run.stdout
    assert "HOROVOD-NAME" in run.stdout  # Horovod's names say they need Horovod
