"""Launches and host syncs per exchange, counted on CPU: the GPU codecs' cost proxy without a GPU.

    python benchmarks/kernel_launches.py                    # every spec of cuda_check, 64,000 entries
    python benchmarks/kernel_launches.py --specs topk:ratio=0.001 --numel 1000000 --json /tmp/l.json

At the sizes issue 40 judges the codecs at (10M float32 entries: one memory pass is ~0.035 ms on
an H200) an exchange's time is set by its kernel launches (a Triton launch from Python costs
~10-30 us, a torch op ~5-10 us) and host syncs, not by its bytes. This runs each spec down the
branch a CUDA tensor takes -- the Triton kernels of ``torch_ops/gpu`` under Triton's interpreter
(``TRITON_INTERPRET=1``, ``set_triton(force=True)``) and the torch ops, the compiled CPU kernels
off -- one rank (world of one, as cuda_check times it), and counts with
``torch_ops.gpu.census.Census`` what the third exchange does (the first two warm the state and
the caches): Triton launches, torch ops that launch work, allocations, host syncs (and which).
Triton is found as the tests find it (``HVDCOMPRESS_TRITON_PATH``, else
``~/.cache/hvdcompress/triton-3.9.0``, else the interpreter's path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["TRITON_INTERPRET"] = "1"
_folder = os.environ.get("HVDCOMPRESS_TRITON_PATH",
                         os.path.join(os.path.expanduser("~"), ".cache", "hvdcompress", "triton-3.9.0"))
if os.path.isfile(os.path.join(_folder, "triton", "__init__.py")):
    sys.path.insert(1, _folder)
import triton  # noqa: E402,F401  -- before any other native library (docs/gpu-kernels.md)

import torch  # noqa: E402

from hvdcompress import parse_spec  # noqa: E402
from torch_ops import gpu  # noqa: E402
from torch_ops.compressors import build_compressor, native  # noqa: E402
from torch_ops.gpu.census import Census  # noqa: E402

from cuda_check import run_exchange  # noqa: E402  (the exchange cuda_check times, world of one)

SPECS = ["fp16", "bf16", "topk:ratio=0.001", "threshold:threshold=2.0", "dgc:ratio=0.001", "signsgd", "efsignsgd",
         "onebit", "onebit:scope=tensor", "terngrad", "qsgd:levels=127,bucket=512", "qsgd", "sketch:ratio=0.001",
         "powersgd:rank=4"]


def count(spec_text, numel, steps=3, device="cpu"):
    """The census of the last of ``steps`` exchanges of ``spec_text`` (a dict)."""
    comp = build_compressor(parse_spec(spec_text))
    gen = torch.Generator().manual_seed(0)
    state = {}
    for step in range(steps):
        x = (torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen)).to(device)
        if step == steps - 1:
            with Census() as c:
                run_exchange(comp, x, state, step)
            return c.summary()
        run_exchange(comp, x, state, step)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--specs", nargs="+", default=SPECS)
    p.add_argument("--numel", type=int, default=64000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    native.set_torch_only(True)
    gpu.set_triton(True, force=True)
    rows = []
    print(f"one exchange, world of one, {args.numel:,} float32 entries, the branch a CUDA tensor takes "
          f"(triton {triton.__version__}, interpreted)")
    print(f"{'spec':30s} {'triton':>6s} {'torch':>6s} {'allocs':>6s} {'syncs':>5s}  sync ops; kernels")
    for s in args.specs:
        try:
            row = {"spec": s, **count(s, args.numel)}
        except Exception as e:  # reported per spec
            row = {"spec": s, "error": f"{type(e).__name__}: {e}"}
            print(f"{s:30s} FAILED: {row['error']}")
            rows.append(row)
            continue
        rows.append(row)
        print(f"{s:30s} {row['triton']:6d} {row['torch_ops']:6d} {row['allocs']:6d} {row['syncs']:5d}  "
              f"{row['sync_ops'] or ''}; {row['kernels'] or ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "triton": triton.__version__, "rows": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
