"""What scripts/install.sh does on this machine: which torch to keep or install, whether Horovod is
built with NCCL, whether TensorFlow is installed, and the constraints pip gets.

The decision is a pure function (``plan``) of facts gathered once (``gather``), so it is tested
with made-up machines (tests/test_install_plan.py). The shell reads the plan as ``KEY=value``
lines (``python3 scripts/install_plan.py --constraints-out FILE``) and prints its ``NOTE`` lines.

Rules:
- a torch already installed is never replaced when its version is supported (CUDA or CPU build);
  pip then gets a constraints file pinning *that* torch, so no dependency can swap it;
- no torch: the pinned version (requirements/constraints.txt) is installed;
- an unsupported torch stops the install with a message naming the installed and accepted versions;
- Horovod is built with NCCL (``HOROVOD_GPU_OPERATIONS=NCCL``) when the torch is a CUDA build and
  a CUDA toolkit (nvcc) is found; a CUDA torch without a toolkit gets a Gloo-only Horovod, said so;
- TensorFlow (``tensorflow-cpu`` with ``tf-keras`` installed without its dependencies, so the full
  ``tensorflow`` package is not pulled in beside it) unless ``HVDCOMPRESS_TENSORFLOW=0``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

# torch versions hvdcompress runs on: register_post_accumulate_grad_hook (profiling) needs 2.1;
# the newest tested is the pinned one.
TORCH_LOWEST = (2, 1)
TORCH_HIGHEST = (2, 13)


@dataclass(frozen=True)
class Facts:
    """What the machine has (``gather`` reads it; tests make it up)."""

    torch_version: Optional[str]  # installed torch distribution's version, e.g. "2.13.0+cu128"; None: none
    torch_cuda: Optional[str]     # torch.version.cuda of that torch ("12.8"); None: a CPU build
    nvcc: Optional[str]           # path of a CUDA compiler, None when there is none
    pinned_torch: str             # the version requirements/constraints.txt pins, e.g. "2.13.0"
    with_tensorflow: bool = True  # HVDCOMPRESS_TENSORFLOW != "0"


@dataclass
class Plan:
    torch_action: str             # "keep" or "install"
    torch_pin: str                # the version pip is constrained to (installed one, or the pinned one)
    cuda: Optional[str]           # the torch's CUDA version, None for a CPU torch
    nccl: bool                    # build Horovod with HOROVOD_GPU_OPERATIONS=NCCL
    tensorflow: bool
    wheel_tag: str                # the Horovod wheel cache folder for this build ("wheels" for Gloo-only)
    notes: List[str] = field(default_factory=list)

    def shell(self) -> str:
        """``KEY=value`` lines for the shell (values are simple words)."""
        return "\n".join([f"TORCH_ACTION={self.torch_action}", f"TORCH_PIN={self.torch_pin}",
                          f"TORCH_CUDA={self.cuda or ''}", f"WITH_NCCL={int(self.nccl)}",
                          f"WITH_TF={int(self.tensorflow)}", f"WHEEL_DIR={self.wheel_tag}"])


class Unsupported(ValueError):
    """The installed torch is one hvdcompress does not run on (the message says which it accepts)."""


def parse_version(text: str) -> Tuple[int, int, int]:
    """(major, minor, patch) of a version string such as '2.13.0+cu128' or '2.6.0a0+git1234'."""
    m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not m:
        raise Unsupported(f"torch: cannot read the installed version {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def supported(version: str) -> bool:
    return TORCH_LOWEST <= parse_version(version)[:2] <= TORCH_HIGHEST


def accepted_range() -> str:
    return (f"torch {TORCH_LOWEST[0]}.{TORCH_LOWEST[1]} to {TORCH_HIGHEST[0]}.{TORCH_HIGHEST[1]}.x "
            "(CPU or CUDA build)")


def plan(facts: Facts) -> Plan:
    """The install decision for ``facts`` (pure). Raises ``Unsupported`` for a torch outside the
    accepted range, before anything is installed."""
    notes = []
    if facts.torch_version is None:
        action, pin, cuda = "install", facts.pinned_torch, None
        notes.append(f"no torch installed: installing torch=={facts.pinned_torch} (CPU wheel where pip finds one; "
                     "install your CUDA torch first to keep it)")
    else:
        if not supported(facts.torch_version):
            raise Unsupported(f"torch: {facts.torch_version} is installed; hvdcompress accepts {accepted_range()}. "
                              f"Install a supported torch (e.g. torch=={facts.pinned_torch}) or use a fresh "
                              "environment; the install does not replace a torch you have")
        action, pin, cuda = "keep", facts.torch_version, facts.torch_cuda
        build = f"CUDA {cuda}" if cuda else "CPU"
        notes.append(f"keeping the installed torch {facts.torch_version} ({build} build)")
    nccl = bool(cuda) and facts.nvcc is not None
    if cuda and not nccl:
        notes.append("CUDA torch but no CUDA toolkit (nvcc) found: Horovod is built with Gloo only (set CUDA_HOME "
                     "to a toolkit and run again for NCCL); torch.distributed with NCCL works regardless")
    elif nccl:
        notes.append(f"CUDA {cuda} and nvcc at {facts.nvcc}: Horovod is built with HOROVOD_GPU_OPERATIONS=NCCL")
    else:
        notes.append("CPU torch: Horovod is built with Gloo")
    if facts.with_tensorflow:
        notes.append("TensorFlow: tensorflow-cpu, and tf-keras without its dependencies (no second TensorFlow)")
    else:
        notes.append("HVDCOMPRESS_TENSORFLOW=0: no TensorFlow; Horovod is built for PyTorch only")
    tag = "wheels"  # the Gloo-only wheel with both frameworks keeps the cache folder it always had
    if nccl:
        tag += "-nccl-cu" + re.sub(r"\D", "", cuda)
    if not facts.with_tensorflow:
        tag += "-notf"
    return Plan(action, pin, cuda, nccl, facts.with_tensorflow, tag, notes)


def constraints_for(text: str, p: Plan) -> str:
    """The pinned constraints with the torch line replaced by the torch the plan keeps."""
    out = []
    for line in text.splitlines():
        name = line.split("#")[0].split("==")[0].strip()
        if name == "torch":
            line = f"torch=={p.torch_pin}"
        out.append(line)
    return "\n".join(out) + "\n"


def pinned_version(constraints: str, name: str) -> str:
    for line in constraints.splitlines():
        left = line.split("#")[0].strip()
        if left.startswith(name + "=="):
            return left.split("==", 1)[1].strip()
    raise ValueError(f"constraints: no '{name}==' line")


def find_nvcc() -> Optional[str]:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def gather(constraints: str) -> Facts:
    """The facts of this interpreter's environment (imports torch when one is installed)."""
    import importlib.metadata as md
    try:
        version = md.version("torch")
    except md.PackageNotFoundError:
        version = None
    cuda = None
    if version is not None:
        try:
            import torch
            cuda = torch.version.cuda
        except Exception:  # a broken torch: treated as a CPU build, the version check still applies
            cuda = None
    return Facts(version, cuda, find_nvcc(), pinned_version(constraints, "torch"),
                 os.environ.get("HVDCOMPRESS_TENSORFLOW", "1") != "0")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--constraints", required=True, help="requirements/constraints.txt")
    ap.add_argument("--constraints-out", help="write the constraints pip is to use here")
    args = ap.parse_args(argv)
    text = open(args.constraints).read()
    try:
        p = plan(gather(text))
    except Unsupported as exc:
        print(f"NOTE=error: {exc}")
        return 2
    if args.constraints_out:
        with open(args.constraints_out, "w") as f:
            f.write(constraints_for(text, p))
    print(p.shell())
    for note in p.notes:
        print(f"NOTE={note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
