"""The code blocks and links of README.md and docs/*.md, for tests/test_docs.py.

Fences (also indented ones, inside list items):

* ```` ```python ````: a complete, runnable snippet. Where it runs follows from what it imports:
  ``hvdcompress.keras`` / ``hvdcompress.tensorflow`` / ``horovod.tensorflow`` -> the 2 TensorFlow
  workers of the session's shared launch (``shared_tf_launch``); ``hvdcompress.torch`` /
  ``horovod.torch`` -> the 2 PyTorch workers of the session's shared launch
  (``shared_launch.TORCH_2``); anything else -> one plain Python subprocess. Each snippet runs in a fresh namespace and a fresh temporary directory.
* ```` ```python fragment ````: part of a program; only compiled (syntax-checked).
* any other info string (``bash``, ``text``, none): not Python, left alone.

The worker functions (``torch_all``, ``tf_all``) and ``python docs_snippets.py local`` return or
print ``{block id: {"error": None | traceback, "seconds": wall time}}``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile
import traceback
from typing import Dict, List, NamedTuple, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULT_MARK = "DOCS-SNIPPETS-RESULT "
TF_MARKERS = ("hvdcompress.keras", "hvdcompress.tensorflow", "horovod.tensorflow")
TORCH_MARKERS = ("hvdcompress.torch", "horovod.torch")


class Block(NamedTuple):
    path: str      # relative to the repository root
    line: int      # 1-based line of the opening fence
    info: str      # the fence's info string, e.g. "python fragment"
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.info.split() == ["python"]

    @property
    def fragment(self) -> bool:
        words = self.info.split()
        return len(words) >= 2 and words[0] == "python" and words[1] == "fragment"

    @property
    def where(self) -> str:
        """'tf', 'torch' or 'local' (see the module docstring)."""
        if any(m in self.code for m in TF_MARKERS):
            return "tf"
        if any(m in self.code for m in TORCH_MARKERS):
            return "torch"
        return "local"


def doc_files() -> List[str]:
    """README.md and every page under docs/ (relative paths)."""
    files = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [f for f in files if os.path.exists(os.path.join(ROOT, f))]


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`]*)$")


def blocks(path: str) -> List[Block]:
    """Every fenced block of one file."""
    out = []
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).strip()
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j >= len(lines):
            raise ValueError(f"{path}:{i + 1}: unclosed code fence")
        out.append(Block(path, i + 1, info, "\n".join(body) + "\n"))
        i = j + 1
    return out


def all_blocks() -> List[Block]:
    return [b for f in doc_files() for b in blocks(f)]


def python_blocks(where: Optional[str] = None) -> List[Block]:
    return [b for b in all_blocks() if b.runnable and (where is None or b.where == where)]


def run_block(block: Block) -> Optional[str]:
    """Execute one snippet as a script (``__main__``, a fresh namespace) in a fresh working
    directory; None or the traceback. The snippet is written to a file named after its page and
    line, so tracebacks point there and ``tf.function`` (autograph) can read its source."""
    import runpy
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="hvdc-doc-snippet-") as tmp:
        script = os.path.join(tmp, re.sub(r"[^A-Za-z0-9_]", "_", block.id) + ".py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(block.code)
        os.chdir(tmp)
        try:
            runpy.run_path(script, run_name="__main__")
            return None
        except BaseException:  # SystemExit too: a snippet must run to its end
            return traceback.format_exc()
        finally:
            os.chdir(here)


def _run_all(where: str) -> Dict[str, dict]:
    """``{block id: {"error": None or the traceback, "seconds": wall time}}``, in page order."""
    import time
    out = {}
    for b in python_blocks(where):
        start = time.perf_counter()
        error = run_block(b)
        out[b.id] = {"error": error, "seconds": round(time.perf_counter() - start, 2)}
    return out


def torch_all() -> Dict[str, dict]:
    """Worker side: every PyTorch snippet, in order."""
    import torch
    torch.manual_seed(0)
    return _run_all("torch")


def tf_all() -> Dict[str, dict]:
    """Worker side (the shared TF launch): every TensorFlow/Keras snippet, in order."""
    return _run_all("tf")


# --- links -------------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_SRC = re.compile(r"<(?:img|a)\b[^>]*?(?:src|href)=\"([^\"]+)\"", re.I)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def _prose(path: str, inline_code: bool = False) -> str:
    """The file without its fenced blocks (lines blanked, so line numbers hold) and, unless
    ``inline_code``, without its inline code spans."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    fenced = set()
    for b in blocks(path):
        fenced.update(range(b.line - 1, b.line + b.code.count("\n") + 1))
    kept = "\n".join("" if i in fenced else line for i, line in enumerate(lines))
    return kept if inline_code else _INLINE_CODE.sub("", kept)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"<[^>]+>", "", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set:
    out, seen = set(), {}
    for line in _prose(path, inline_code=True).split("\n"):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: str) -> List[tuple]:
    """(line, target) of every link and image of one file, outside code."""
    out = []
    for i, line in enumerate(_prose(path).split("\n"), 1):
        for m in list(_LINK.finditer(line)) + list(_HTML_SRC.finditer(line)):
            out.append((i, m.group(1)))
    return out


def broken_links(path: str, pending=()) -> List[str]:
    """Relative links and images of ``path`` whose file (or heading anchor) does not exist.
    ``pending``: repository paths allowed to be missing (pages other branches add)."""
    bad = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(os.path.join(ROOT, dest)):
            if dest not in pending:
                bad.append(f"{path}:{line}: {target} (no such file: {dest})")
            continue
        if anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append(f"{path}:{line}: {target} (no heading with anchor #{anchor} in {dest})")
    return bad


if __name__ == "__main__" and sys.argv[1:] == ["local"]:
    sys.path.insert(0, ROOT)
    results = _run_all("local")
    print(RESULT_MARK + json.dumps(results))
