"""The codec timings the planner fits, shown with their samples: for each spec, the compress and
decompress seconds that ``torch_ops.profiling`` measures at each size on a device (the first call
timed apart, so a compile or a lazy initialisation shows), the ``fit_compute`` fit of them, and the
fit's prediction at each measured size and at 4x the largest (the extrapolation the planner makes
for a larger tensor).

    python benchmarks/codec_fits.py --device cuda --json /tmp/codec_fits.json
    python benchmarks/codec_fits.py --specs topk:ratio=0.01 --sizes 1024 65536 4194304

Writes JSON when ``--json`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvdcompress.schedule.costmodel import fit_compute  # noqa: E402
from hvdcompress.spec import resolve  # noqa: E402
from torch_ops.profiling import compress_seconds, decompress_seconds  # noqa: E402

SPECS = ["fp16", "topk:ratio=0.01", "dgc:ratio=0.001", "signsgd", "onebit", "qsgd:levels=7", "powersgd:rank=4",
         "sketch:ratio=0.01"]


def first_call_seconds(spec, numel: int, device) -> float:
    """One compress call on a fresh compressor, timed with the device synchronised (compile included)."""
    t0 = time.perf_counter()
    compress_seconds(spec, numel, repeats=1, warmup=0, device=device)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--specs", nargs="+", default=SPECS)
    p.add_argument("--sizes", type=int, nargs="+", default=[1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = args.device
    out = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "sizes": args.sizes, "specs": {}}
    print(f"device {out['device']}; sizes {args.sizes}; repeats {args.repeats}")
    for text in args.specs:
        spec = resolve(text)
        row = {"first_call_s": first_call_seconds(spec, args.sizes[-1], device), "compress": [], "decompress": []}
        for d in args.sizes:
            row["compress"].append(compress_seconds(spec, d, repeats=args.repeats, warmup=1, device=device))
            row["decompress"].append(decompress_seconds(spec, d, repeats=args.repeats, warmup=1, device=device))
        for what in ("compress", "decompress"):
            fit = fit_compute(args.sizes, row[what])
            pred = [float(fit(d)) for d in args.sizes]
            row[what + "_fit"] = fit.to_dict()
            row[what + "_predicted"] = pred
            row[what + "_at_4x_largest"] = float(fit(4 * args.sizes[-1]))
            print(f"{text:24s} {what:10s} " + " ".join(f"{t * 1e3:8.3f}" for t in row[what]) + " ms | fit "
                  f"{fit.form} a={fit.a:.3g} b={fit.b:.3g} err={fit.rel_rmse:.2f}; predicted "
                  + " ".join(f"{t * 1e3:.3f}" for t in pred) + f"; at 4x largest {row[what + '_at_4x_largest'] * 1e3:.3f} ms")
        print(f"{text:24s} first call at {args.sizes[-1]}: {row['first_call_s'] * 1e3:.1f} ms")
        out["specs"][text] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
