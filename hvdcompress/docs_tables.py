"""Reference tables of docs/algorithms.md, generated from the compressor registry.

The registry (``hvdcompress.spec``: every algorithm's name, exchange, merge policy, one-line doc
and validated parameters) is the single source of truth; the tables in the guide are written
from it between marker comments, never by hand::

    python -m hvdcompress.docs_tables            # rewrite the tables in docs/algorithms.md
    python -m hvdcompress.docs_tables --check    # exit 1 if the committed tables are stale

Markers (each block is replaced whole, the text around it is kept):

* ``<!-- BEGIN GENERATED specs -->`` ... ``<!-- END GENERATED -->``: one row per registered spec;
* ``<!-- BEGIN GENERATED params:<name> -->`` ... ``<!-- END GENERATED -->``: the parameter table
  of spec ``<name>`` (name, default, accepted range, meaning);
* ``<!-- BEGIN GENERATED unplaced -->`` ... ``<!-- END GENERATED -->``: a short section for every
  registered spec that has no ``params:<name>`` block elsewhere in the page, so a newly
  registered algorithm is documented by regenerating, before anyone writes its prose.

A ``params:<name>`` block for a name the registry does not know is an error (a renamed or removed
spec must not leave a stale table behind).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List

from . import spec

DOCS_PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "algorithms.md")
COMMAND = "python -m hvdcompress.docs_tables"
END = "<!-- END GENERATED -->"
_BLOCK = re.compile(r"(<!-- BEGIN GENERATED ([a-z0-9_:\-]+) -->\n)(.*?)(" + re.escape(END) + ")", re.S)


def _cell(text: str) -> str:
    """Text made safe for one markdown table cell."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _default(p: spec.Param) -> str:
    if p.default is None:
        return "none"
    return f"`{spec.format_value(p.default)}`" if spec.format_value(p.default) != "" else "(empty)"


def registry() -> Dict[str, spec.CompressorInfo]:
    """The built-in algorithms: those declared by a module of ``hvdcompress/reference`` (an
    algorithm a program registered from elsewhere, e.g. a test's toy, is not documented here)."""
    from hvdcompress.reference.oracle import ORACLES

    return {name: info for name, info in spec.REGISTRY.items()
            if name in ORACLES and ORACLES[name].__module__.startswith("hvdcompress.reference.")}


def specs_table(infos: Dict[str, spec.CompressorInfo]) -> str:
    rows = ["| spec | exchange (first round) | merging | parameters | what it does |", "|---|---|---|---|---|"]
    for name, info in infos.items():
        params = ", ".join(f"`{p.name}`" for p in info.params) or "—"
        rows.append(f"| `{name}` | {info.exchange} | {info.merge} | {params} | {_cell(info.doc)} |")
    return "\n".join(rows) + "\n"


def params_table(info: spec.CompressorInfo) -> str:
    if not info.params:
        return f"`{info.name}` takes no parameters.\n"
    rows = ["| parameter | default | accepted | meaning |", "|---|---|---|---|"]
    for p in info.params:
        rows.append(f"| `{p.name}` | {_default(p)} | {_cell(p.range_text())} | {_cell(p.doc)} |")
    return "\n".join(rows) + "\n"


def unplaced_sections(infos: Dict[str, spec.CompressorInfo], placed: List[str]) -> str:
    missing = [n for n in infos if n not in placed]
    if not missing:
        return "Every registered spec has its own section above.\n"
    out = []
    for name in missing:
        info = infos[name]
        out.append(f"### `{name}`\n\n{_cell(info.doc)} Exchange: {info.exchange}; merging: {info.merge}.\n\n"
                   + params_table(info))
    return "\n".join(out)


def render(text: str, infos: Dict[str, spec.CompressorInfo]) -> str:
    """``text`` with every generated block rewritten from ``infos``."""
    kinds = [m.group(2) for m in _BLOCK.finditer(text)]
    placed = [k.split(":", 1)[1] for k in kinds if k.startswith("params:")]
    unknown = [n for n in placed if n not in infos]
    if unknown:
        raise ValueError(f"{DOCS_PAGE}: params block(s) for unregistered spec(s) {unknown}; "
                         f"registered: {', '.join(infos)}")

    def body(kind: str) -> str:
        if kind == "specs":
            return specs_table(infos)
        if kind == "unplaced":
            return unplaced_sections(infos, placed)
        if kind.startswith("params:"):
            return params_table(infos[kind.split(":", 1)[1]])
        raise ValueError(f"{DOCS_PAGE}: unknown generated block {kind!r}")

    return _BLOCK.sub(lambda m: m.group(1) + body(m.group(2)) + m.group(4), text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 (and change nothing) if the page is stale")
    ap.add_argument("--page", default=DOCS_PAGE, help="the page holding the markers (default: docs/algorithms.md)")
    args = ap.parse_args(argv)
    with open(args.page, encoding="utf-8") as f:
        old = f.read()
    new = render(old, registry())
    if args.check:
        if new != old:
            print(f"{args.page}: generated tables are stale; regenerate with: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    if new != old:
        with open(args.page, "w", encoding="utf-8") as f:
            f.write(new)
        print(f"rewrote the generated tables of {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
