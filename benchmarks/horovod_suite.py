"""Horovod's own PyTorch optimizer tests, run against Horovod's optimizer and against ours.

Horovod's ``test/parallel/test_torch.py`` is read from a git checkout of Horovod at run time (the
tag of the installed version, ``v0.28.1`` here, else ``HEAD``) into a temporary directory, with
its ``test/utils/common.py`` beside it as in Horovod's tree; nothing of it is kept in this
repository. A ``conftest.py`` written next to it:

- makes the file importable here (``common.py`` imports ``mock``: ``unittest.mock`` stands in
  when the ``mock`` package is missing);
- with ``--variant hvdcompress``, replaces ``horovod.torch.DistributedOptimizer`` (the name the
  tests call, ``hvd.DistributedOptimizer``) with ``hvdcompress.torch.DistributedOptimizer``,
  compression none; with ``--variant horovod`` nothing is replaced (the baseline);
- writes each rank's outcome per test to a JSON file.

The tests selected are the methods of ``TorchTests`` whose source constructs
``DistributedOptimizer`` (found with ``ast``, so the list follows the file read). Each test runs in
its own ``horovodrun -np 2 -H localhost:2 --gloo python -m pytest ...``, under ``nice -n 10`` and
``timeout``, so a hang costs one test. A test passes when it passes on every rank.

    python benchmarks/horovod_suite.py --out benchmarks/results/horovod-suite/torch.json
    python benchmarks/horovod_suite.py --tests test_sparse_embeddings --variants hvdcompress

Prints a table (test, Horovod's optimizer, ours) and writes JSON. A full run starts 2 launches per
test (about 30 on 15 tests; 5-10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_REPO = "/work/.mirror/horovod+horovod/repo"
TEST_PATH = "test/parallel/test_torch.py"
COMMON_PATH = "test/utils/common.py"
VARIANTS = ("horovod", "hvdcompress")

CONFTEST = '''\
"""Written by hvdcompress's benchmarks/horovod_suite.py: environment fixes and the optimizer swap."""
import json
import os
import sys
import unittest.mock

try:
    import mock  # noqa: F401  (Horovod's test utilities import the mock package)
except ImportError:
    sys.modules["mock"] = unittest.mock

VARIANT = os.environ["HVDC_SUITE_VARIANT"]
OUT_DIR = os.environ["HVDC_SUITE_OUT"]

EXCLUDED = [n for n in os.environ.get("HVDC_SUITE_EXCLUDE", "").split(",") if n]
if EXCLUDED:  # diagnostic only: the tests that loop over torch.optim's optimizers skip these
    import torch

    def _subclasses(_all=type.__subclasses__, _base=torch.optim.Optimizer):
        return [c for c in _all(_base) if c.__name__ not in EXCLUDED]

    torch.optim.Optimizer.__subclasses__ = staticmethod(_subclasses)

if VARIANT == "hvdcompress":
    import horovod.torch as hvd
    import hvdcompress.torch as hvc

    def DistributedOptimizer(optimizer, *args, **kwargs):
        """hvdcompress's optimizer under Horovod's name, without compression unless asked."""
        kwargs.setdefault("compression", hvc.Compression.none())
        return hvc.DistributedOptimizer(optimizer, *args, **kwargs)

    hvd.DistributedOptimizer = DistributedOptimizer


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        rank = os.environ.get("HOROVOD_RANK", "0")
        name = report.nodeid.split("::")[-1]
        text = ""
        if report.outcome != "passed":
            text = str(report.longrepr)[-4000:]
        path = os.path.join(OUT_DIR, f"{name}.rank{rank}.{report.when}.json")
        with open(path, "w") as f:
            json.dump({"outcome": report.outcome, "when": report.when, "detail": text}, f)
'''


def read_from_git(repo: str, ref: str, path: str) -> str:
    return subprocess.run(["git", "-C", repo, "show", f"{ref}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def pick_ref(repo: str, ref: Optional[str]) -> str:
    """``ref`` if given, else the tag of the installed Horovod, else HEAD."""
    if ref:
        return ref
    try:
        import horovod
        tag = f"v{horovod.__version__}"
    except ImportError:
        return "HEAD"
    tags = subprocess.run(["git", "-C", repo, "tag", "--list", tag], capture_output=True, text=True).stdout.split()
    return tag if tag in tags else "HEAD"


def optimizer_tests(source: str) -> List[str]:
    """Names of ``TorchTests``' test methods whose body mentions ``DistributedOptimizer``."""
    tree = ast.parse(source)
    out = []
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name == "TorchTests":
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
                    names = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
                    names |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
                    if "DistributedOptimizer" in names:
                        out.append(fn.name)
    return out


def prepare(repo: str, ref: str) -> Dict[str, str]:
    """A temporary tree ``parallel/test_torch.py``, ``utils/common.py``, ``parallel/conftest.py``."""
    tmp = tempfile.mkdtemp(prefix="hvdc-horovod-suite-")
    os.makedirs(os.path.join(tmp, "parallel"))
    os.makedirs(os.path.join(tmp, "utils"))
    source = read_from_git(repo, ref, TEST_PATH)
    with open(os.path.join(tmp, "parallel", "test_torch.py"), "w") as f:
        f.write(source)
    with open(os.path.join(tmp, "utils", "common.py"), "w") as f:
        f.write(read_from_git(repo, ref, COMMON_PATH))
    with open(os.path.join(tmp, "parallel", "conftest.py"), "w") as f:
        f.write(CONFTEST)
    with open(os.path.join(tmp, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")
    return {"dir": tmp, "source": source}


def run_one(tmp: str, test: str, variant: str, timeout: int, np_: int, exclude=()) -> dict:
    """One test, one variant, in its own horovodrun; the outcome over the ranks."""
    out_dir = os.path.join(tmp, "results", variant)
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        if f.startswith(test + ".rank"):
            os.remove(os.path.join(out_dir, f))
    env = dict(os.environ, HVDC_SUITE_VARIANT=variant, HVDC_SUITE_OUT=out_dir, HVDC_SUITE_EXCLUDE=",".join(exclude),
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = ["nice", "-n", "10", "timeout", str(timeout), "horovodrun", "-np", str(np_), "-H", f"localhost:{np_}",
           "--gloo", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"parallel/test_torch.py::TorchTests::{test}"]
    start = time.time()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    seconds = round(time.time() - start, 1)
    ranks = {}
    for f in sorted(os.listdir(out_dir)):
        if f.startswith(test + ".rank"):
            rank = int(f[len(test) + 5:].split(".")[0])
            with open(os.path.join(out_dir, f)) as fh:
                rep = json.load(fh)
            if rep["outcome"] != "passed" or rank not in ranks:
                ranks[rank] = rep
    outcomes = {r["outcome"] for r in ranks.values()}
    if proc.returncode == 124:
        outcome = "timeout"
    elif len(ranks) < np_:
        outcome = "error"  # a rank reported nothing: the launch or the worker died
    elif "failed" in outcomes:
        outcome = "failed"
    elif outcomes == {"skipped"}:
        outcome = "skipped"
    elif outcomes == {"passed"}:
        outcome = "passed"
    else:
        outcome = "error"
    detail = next((r["detail"] for r in ranks.values() if r["outcome"] == "failed"), "")
    if outcome == "skipped":
        detail = next(iter(ranks.values()))["detail"]
    if outcome in ("error", "timeout") and not detail:
        detail = (proc.stdout + proc.stderr)[-4000:]
    return {"outcome": outcome, "seconds": seconds, "returncode": proc.returncode, "detail": detail}


def short(detail: str) -> str:
    """The last line of a failure that says what went wrong."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("E ") or "Error" in ln or "Skipped" in ln or "assert" in ln:
            return ln[:160]
    return lines[-1][:160] if lines else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--horovod-repo", default=os.environ.get("HVDC_HOROVOD_REPO", DEFAULT_REPO),
                    help="a git checkout (bare or not) of Horovod's repository")
    ap.add_argument("--ref", default=None, help="git ref to read the tests from (default: v<installed>, else HEAD)")
    ap.add_argument("--tests", nargs="*", default=None, help="run only these (default: every optimizer test)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per test launch (default 300)")
    ap.add_argument("-n", "--np", type=int, default=2, help="workers (default 2)")
    ap.add_argument("--exclude-optimizers", nargs="*", default=[], metavar="NAME",
                    help="diagnostic, not Horovod's tests as written: the tests that loop over every "
                         "torch.optim optimizer leave these out (e.g. Muon, which takes 2-D parameters only)")
    ap.add_argument("--list", action="store_true", help="print the selected tests and stop")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    args = ap.parse_args(argv)

    ref = pick_ref(args.horovod_repo, args.ref)
    prep = prepare(args.horovod_repo, ref)
    tmp = prep["dir"]
    try:
        selected = optimizer_tests(prep["source"])
        if args.list:
            print("\n".join(selected))
            return 0
        tests = selected if args.tests is None else args.tests
        unknown = [t for t in tests if t not in selected]
        if unknown:
            raise SystemExit(f"--tests: not optimizer tests of {TEST_PATH}@{ref}: {unknown}; --list shows them")
        import horovod
        import torch
        results: Dict[str, Dict[str, dict]] = {}
        for test in tests:
            results[test] = {}
            for variant in args.variants:
                r = run_one(tmp, test, variant, args.timeout, args.np, args.exclude_optimizers)
                results[test][variant] = r
                print(f"{test:34s} {variant:12s} {r['outcome']:8s} {r['seconds']:6.1f} s  {short(r['detail'])}",
                      flush=True)
        print()
        cols = list(args.variants)
        head = {"horovod": "Horovod's optimizer", "hvdcompress": "hvdcompress (none)"}
        print("| test | " + " | ".join(head[c] for c in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for test in tests:
            print(f"| {test} | " + " | ".join(results[test][c]["outcome"] for c in cols) + " |")
        totals = {c: sum(results[t][c]["outcome"] == "passed" for t in tests) for c in cols}
        print("| passed | " + " | ".join(f"{totals[c]} of {len(tests)}" for c in cols) + " |")
        for test in tests:
            for c in cols:
                if results[test][c]["outcome"] not in ("passed",):
                    print(f"\n{test} ({c}, {results[test][c]['outcome']}): {short(results[test][c]['detail'])}")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"horovod_ref": ref, "test_file": TEST_PATH, "horovod": horovod.__version__,
                           "torch": torch.__version__, "workers": args.np, "tests": tests,
                           "excluded_optimizers": args.exclude_optimizers,
                           "selected": selected, "passed": totals, "results": results,
                           "command": " ".join(["python", "benchmarks/horovod_suite.py"] + (argv or sys.argv[1:])),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, f, indent=1)
        return 0
    finally:
        if args.keep:
            print("kept", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
