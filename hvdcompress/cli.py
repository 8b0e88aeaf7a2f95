"""The ``hvdcompress`` console command: ``hvdcompress <command> [options]``.

Commands are modules with a ``main(argv, prog)`` function, imported only when chosen (so that
``hvdcompress --help`` stays fast).
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

COMMANDS = {
    "bench": ("hvdcompress.bench.cli", "step time and bytes of compressors vs dense Horovod on an "
                                        "emulated network"),
    "advise": ("hvdcompress.bench.advise", "which compressor pays on this link for this model (predicted "
                                           "step time per spec, the auto mode's per-group choice)"),
    "specs": ("hvdcompress.spec_cli", "list the compression specs, or show one's parameters and ranges"),
}


def _usage() -> str:
    lines = ["usage: hvdcompress <command> [options]", "",
             "Tools of hvdcompress (compressed gradient exchange for Horovod). Training itself needs no",
             "command: wrap your optimizer (README.md) and launch with horovodrun.", "", "commands:"]
    lines += [f"  {name:<8} {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += ["", "hvdcompress <command> --help shows a command's options. Guide: docs/ (README.md links it)."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hvdcompress: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest, prog=f"hvdcompress {name}")


if __name__ == "__main__":
    sys.exit(main())
