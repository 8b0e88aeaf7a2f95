"""The documentation cannot rot: README.md and docs/*.md are checked against the code.

* the reference tables of docs/algorithms.md equal what ``python -m hvdcompress.docs_tables``
  writes from the compressor registry;
* every relative link and image path resolves (files, and heading anchors of .md files);
* every ```python block runs (PyTorch snippets in the session's shared 2-worker PyTorch launch,
  TensorFlow/Keras snippets in the session's shared 2-worker TF launch, the rest in one Python
  subprocess); every ```python fragment block compiles. tests/scenarios/docs_snippets.py says how blocks
  are told apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from scenarios import docs_snippets as ds
from scenarios import shared_tf_launch

# Guide pages that other branches add; until they are merged a link to one may dangle. Once a
# page exists it is checked like any other (remove its entry then).
PENDING_PAGES = set()


def test_generated_tables_are_current():
    from hvdcompress import docs_tables
    with open(docs_tables.DOCS_PAGE, encoding="utf-8") as f:
        committed = f.read()
    assert "<!-- BEGIN GENERATED specs -->" in committed and "<!-- BEGIN GENERATED unplaced -->" in committed
    fresh = docs_tables.render(committed, docs_tables.registry())
    assert fresh == committed, ("docs/algorithms.md: the generated spec/parameter tables are stale; "
                                f"regenerate them with: {docs_tables.COMMAND}")


def test_generated_tables_follow_the_registry():
    """A spec registered without a section of its own still gets its table (in 'unplaced')."""
    from hvdcompress import docs_tables, spec
    infos = docs_tables.registry()
    extra = spec.CompressorInfo("madeup", spec.SUMMED, (spec.Param("knob", int, 3, "a knob", low=1),), "a made-up spec")
    page = "<!-- BEGIN GENERATED specs -->\n<!-- END GENERATED -->\n<!-- BEGIN GENERATED unplaced -->\nSTALE-TEXT\n<!-- END GENERATED -->\n"
    out = docs_tables.render(page, {**infos, "madeup": extra})
    assert "| `madeup` |" in out and "### `madeup`" in out and "| `knob` | `3` | int in [1, inf) | a knob |" in out
    assert "STALE-TEXT" not in out
    with pytest.raises(ValueError, match="unregistered"):
        docs_tables.render("<!-- BEGIN GENERATED params:gone -->\n<!-- END GENERATED -->\n", infos)


def test_links_and_images_resolve():
    bad = [b for f in ds.doc_files() for b in ds.broken_links(f, PENDING_PAGES)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_fences_are_python_or_fragments_where_python():
    """Every fragment compiles; a block fenced python with other words is a typo."""
    errors = []
    for b in ds.all_blocks():
        words = b.info.split()
        if words[:1] == ["python"] and not (b.runnable or b.fragment):
            errors.append(f"{b.id}: unknown fence '{b.info}' (use 'python' or 'python fragment')")
        if b.fragment:
            try:
                compile(b.code, b.id, "exec")
            except SyntaxError as e:
                errors.append(f"{b.id}: {e}")
    assert not errors, "\n".join(errors)
    assert ds.python_blocks("torch") and ds.python_blocks("tf"), "the quickstarts are runnable blocks"


def _failures(results: dict, where: str) -> str:
    expected = {b.id for b in ds.python_blocks(where)}
    assert set(results) == expected, (sorted(results), sorted(expected))
    print(f"{where} snippets, seconds:", {k: v["seconds"] for k, v in results.items()})
    return "\n".join(f"--- {k}\n{v['error']}" for k, v in results.items() if v["error"])


def test_local_snippets_run():
    if not ds.python_blocks("local"):
        pytest.skip("no single-process snippet")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ds.ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "scenarios", "docs_snippets.py"), "local"],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(ds.RESULT_MARK)]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = _failures(json.loads(lines[-1][len(ds.RESULT_MARK):]), "local")
    assert not failed, failed


@pytest.mark.multiprocess
def test_torch_snippets_run_on_two_workers():
    from scenarios.launch import part
    from scenarios.shared_launch import TORCH_2
    for rank_results in part(TORCH_2.results("test_docs"), "torch"):  # in the session's shared PyTorch launch
        failed = _failures(rank_results, "torch")
        assert not failed, failed


@pytest.mark.multiprocess
def test_tf_snippets_run_on_two_workers():
    for rank_results in shared_tf_launch.results("test_docs"):
        failed = _failures(rank_results, "tf")
        assert not failed, failed


def test_command_line_help_is_reference(capsys):
    """``hvdcompress --help``, ``hvdcompress bench --help`` and ``hvdcompress specs`` answer
    without Horovod workers (bench's --help must not need Horovod's runner)."""
    from hvdcompress import cli
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "bench" in out and "specs" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for words in ("--latency-ms", "injected", "emulated", "OUT.json", "(default: 4)"):
        assert words in out, words
    assert cli.main(["specs", "dgc"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dgc: Deep Gradient Compression") and "warmup_epochs (int in [0, inf), default 4)" in out
    with pytest.raises(SystemExit):
        cli.main(["specs", "nope"])
    assert "unknown compressor 'nope'" in capsys.readouterr().err


def test_checkers_find_what_they_look_for(tmp_path, monkeypatch):
    """The link checker and the fence parser on a made-up page: every kind of breakage is found."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Title `code`\n\n## Same\n\n## Same\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n[ok](b.md#title-code) [dup](b.md#same-1) [gone](c.md) [anchor](b.md#nope) "
        "![img](../x.png) [web](https://example.com) `[code](nope.md)` [self](#a) [later](d.md)\n\n"
        "  ```python fragment\n  x = (\n  ```\n```python\nprint(1)\n```\n```bash\nnot python\n```\n")
    monkeypatch.setattr(ds, "ROOT", str(tmp_path))
    bad = ds.broken_links("docs/a.md", pending={"docs/d.md"})
    assert [b.split(": ", 1)[1].split(" ")[0] for b in bad] == ["c.md", "b.md#nope", "../x.png"], bad
    kinds = [(b.info, b.runnable, b.fragment, b.where) for b in ds.blocks("docs/a.md")]
    assert kinds == [("python fragment", False, True, "local"), ("python", True, False, "local"),
                     ("bash", False, False, "local")]
    assert ds.blocks("docs/a.md")[0].code == "x = (\n"


RESULTS_LIMIT_BYTES = 5 * 1000 * 1000


def test_results_stay_under_five_megabytes():
    """benchmarks/results/ holds what the docs cite, not raw traces: its tracked files stay under
    5 MB (summarise a large run, or give the command that regenerates it)."""
    root = os.path.join(ds.ROOT, "benchmarks", "results")
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "benchmarks/results"], cwd=ds.ROOT, capture_output=True,
                                check=True).stdout.decode().split("\0")
        files = [os.path.join(ds.ROOT, f) for f in listed if f]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file there
        files = [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]
    sizes = sorted(((os.path.getsize(f), os.path.relpath(f, ds.ROOT)) for f in files if os.path.isfile(f)),
                   reverse=True)
    total = sum(s for s, _ in sizes)
    largest = ", ".join(f"{p} {s / 1e6:.2f} MB" for s, p in sizes[:5])
    assert total < RESULTS_LIMIT_BYTES, (f"benchmarks/results/ holds {total / 1e6:.2f} MB (limit "
                                         f"{RESULTS_LIMIT_BYTES / 1e6:.0f} MB); largest: {largest}")


def _argument_tables():
    """``{(page, target): [argument names]}`` of every table that follows an
    ``<!-- arguments: module.callable -->`` marker in README.md or docs/."""
    import re
    out = {}
    for page in ds.doc_files():
        with open(os.path.join(ds.ROOT, page), encoding="utf-8") as f:
            lines = f.read().split("\n")
        for i, line in enumerate(lines):
            m = re.match(r"^<!-- arguments: ([\w.]+) -->$", line.strip())
            if not m:
                continue
            names, j = [], i + 1
            while j < len(lines) and lines[j].startswith("|"):
                cell = lines[j].split("|")[1].strip()
                if cell.startswith("`") and cell.endswith("`"):
                    names.append(cell.strip("`"))
                j += 1
            out[(page, m.group(1))] = names
    return out


def test_argument_tables_follow_the_signatures():
    """The argument tables of DistributedOptimizer, the DDP hook and DiLoCo list exactly the
    callable's parameters (a new argument needs its row; a removed one loses it)."""
    import importlib
    import inspect
    tables = _argument_tables()
    targets = {t for _, t in tables}
    assert {"torch_ops.optimizer.DistributedOptimizer", "torch_ops.ddp_hook.comm_hook",
            "torch_ops.diloco.DiLoCo"} <= targets, sorted(targets)
    stale = []
    for (page, target), names in tables.items():
        module, _, name = target.rpartition(".")
        params = list(inspect.signature(getattr(importlib.import_module(module), name)).parameters)
        missing, extra = [p for p in params if p not in names], [n for n in names if n not in params]
        if missing or extra or len(set(names)) != len(names):
            stale.append(f"{page} ({target}): not in the table {missing}, not in the signature {extra}")
    assert not stale, "argument tables out of step with the code:\n" + "\n".join(stale)
