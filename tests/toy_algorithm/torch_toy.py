"""toysign in PyTorch (see reference_toy)."""

import torch

from hvdcompress.contract import Allreduce
from torch_ops.compressors.base import Compressor


class ToySignCompressor(Compressor):
    name = "toysign"

    def exchange(self, x, ctx):
        calls = ctx.state.get("calls")
        if calls is None:
            calls = ctx.state["calls"] = torch.zeros(1, dtype=torch.float32)
        calls += 1
        mx = x.abs().max().reshape(1).to(torch.float32) if x.numel() else torch.zeros(1)
        (mx,) = yield (Allreduce(mx),)
        (signs,) = yield (Allreduce(torch.sign(x).to(torch.float32)),)
        factor = (mx * torch.tensor(ctx.scale, dtype=torch.float32)) * torch.tensor(self.spec["gain"],
                                                                                    dtype=torch.float32)
        return signs * factor

    def check_state(self, key, state, numel):
        for name, t in state.items():
            if name != "calls" or t.numel() != 1:
                raise ValueError(f"load_state_dict: toysign state of '{key}' must be one 'calls' counter")
