"""``hvdcompress specs [NAME ...]``: the registered compression specs, or the parameters of some.

The same registry the optimizers validate against (``hvdcompress.spec``), so what it prints is
what ``compression="name:key=value"`` accepts; docs/algorithms.md carries the same tables.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from .spec import REGISTRY, describe


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("names", nargs="*", metavar="NAME", help="spec names to describe (default: list them all)")
    args = ap.parse_args(argv)
    if not args.names:
        width = max(len(n) for n in REGISTRY)
        for name, info in REGISTRY.items():
            print(f"{name:<{width}}  {info.exchange:<9}  {info.doc}")
        print(f"\n{prog or 'hvdcompress specs'} NAME shows a spec's parameters, defaults and accepted ranges.")
        return 0
    for i, name in enumerate(args.names):
        try:
            text = describe(name)
        except ValueError as e:
            ap.error(str(e))
        print(("\n" if i else "") + f"{name}: {text}")
    return 0
