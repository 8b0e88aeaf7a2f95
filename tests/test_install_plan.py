"""scripts/install_plan.py: the install's decisions on made-up machines (no pip, no network)."""

import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import install_plan as ip  # noqa: E402

PINNED = "2.13.0"
CONSTRAINTS = "# pins\ntorch==2.13.0\ntensorflow-cpu==2.18.1\ntf-keras==2.18.0\nnumpy>=1.26,<2.1\n"


def facts(version, cuda=None, nvcc=None, tf=True):
    return ip.Facts(version, cuda, nvcc, PINNED, tf)


def test_cpu_torch_is_kept_and_horovod_gets_gloo():
    p = ip.plan(facts("2.13.0+cpu"))
    assert (p.torch_action, p.torch_pin, p.cuda, p.nccl, p.tensorflow) == ("keep", "2.13.0+cpu", None, False, True)
    assert p.wheel_tag == "wheels"  # the cache folder a Gloo-only build always had
    assert any("keeping the installed torch 2.13.0+cpu (CPU build)" in n for n in p.notes)


def test_cuda_torch_is_kept_and_horovod_gets_nccl():
    p = ip.plan(facts("2.13.0+cu128", cuda="12.8", nvcc="/usr/local/cuda/bin/nvcc"))
    assert (p.torch_action, p.torch_pin, p.cuda, p.nccl) == ("keep", "2.13.0+cu128", "12.8", True)
    assert p.wheel_tag == "wheels-nccl-cu128"
    assert "WITH_NCCL=1" in p.shell().splitlines()
    # pip is constrained to the kept CUDA torch, never to the pinned CPU one
    assert "torch==2.13.0+cu128" in ip.constraints_for(CONSTRAINTS, p).splitlines()
    assert "torch==2.13.0" not in ip.constraints_for(CONSTRAINTS, p).splitlines()


def test_cuda_torch_without_toolkit_builds_gloo_only_and_says_so():
    p = ip.plan(facts("2.13.0", cuda="12.6", nvcc=None))
    assert p.torch_action == "keep" and p.cuda == "12.6" and not p.nccl
    assert any("no CUDA toolkit" in n for n in p.notes)


def test_an_older_supported_cuda_torch_is_not_swapped():
    p = ip.plan(facts("2.5.1", cuda="12.4", nvcc="/opt/cuda/bin/nvcc"))
    assert (p.torch_action, p.torch_pin, p.nccl) == ("keep", "2.5.1", True)


def test_no_torch_installs_the_pinned_one():
    p = ip.plan(facts(None))
    assert (p.torch_action, p.torch_pin, p.cuda, p.nccl) == ("install", PINNED, None, False)
    assert "torch==2.13.0" in ip.constraints_for(CONSTRAINTS, p).splitlines()


@pytest.mark.parametrize("version", ["1.13.1+cu117", "2.0.1", "2.14.0", "3.0.0"])
def test_unsupported_torch_is_a_clear_error(version):
    with pytest.raises(ip.Unsupported, match=rf"torch: {re.escape(version)} is installed; hvdcompress accepts torch 2\.1 to 2\.13"):
        ip.plan(facts(version, cuda="12.1"))


def test_unreadable_version_is_a_clear_error():
    with pytest.raises(ip.Unsupported, match="cannot read the installed version"):
        ip.plan(facts("nightly"))


def test_without_tensorflow():
    p = ip.plan(facts("2.13.0+cpu", tf=False))
    assert not p.tensorflow and p.wheel_tag == "wheels-notf" and "WITH_TF=0" in p.shell().splitlines()


def test_constraints_keep_every_other_line():
    p = ip.plan(facts("2.13.0+cu126", cuda="12.6"))
    out = ip.constraints_for(CONSTRAINTS, p).splitlines()
    assert out == ["# pins", "torch==2.13.0+cu126", "tensorflow-cpu==2.18.1", "tf-keras==2.18.0", "numpy>=1.26,<2.1"]
    assert ip.pinned_version(CONSTRAINTS, "tf-keras") == "2.18.0"


def test_the_script_on_this_machine(tmp_path):
    """The command line the shell runs: KEY=value lines it parses, and the constraints it writes."""
    root = os.path.join(os.path.dirname(__file__), "..")
    out = tmp_path / "c.txt"
    run = subprocess.run([sys.executable, os.path.join(root, "scripts", "install_plan.py"), "--constraints",
                          os.path.join(root, "requirements", "constraints.txt"), "--constraints-out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    keys = dict(line.split("=", 1) for line in run.stdout.splitlines() if not line.startswith("NOTE="))
    assert set(keys) == {"TORCH_ACTION", "TORCH_PIN", "TORCH_CUDA", "WITH_NCCL", "WITH_TF", "WHEEL_DIR"}
    import importlib.metadata as md
    import torch
    from packaging.specifiers import SpecifierSet
    # the pin is the installed distribution's version, the one pip compares: a CUDA wheel from PyPI
    # is "2.11.0" there while torch.__version__ says "2.11.0+cu130"
    assert keys["TORCH_ACTION"] == "keep" and keys["TORCH_PIN"] == md.version("torch")
    assert f"torch=={md.version('torch')}" in out.read_text().splitlines()
    assert torch.__version__ in SpecifierSet(f"=={keys['TORCH_PIN']}")  # the torch that imports is the one pinned


def test_a_pypi_cuda_wheel_is_pinned_as_pip_sees_it():
    """PyPI's CUDA torch reports "2.11.0" as its distribution's version and "2.11.0+cu130" as
    torch.__version__. pip checks an installed distribution against a constraint by the former:
    "torch==2.11.0" keeps that torch (a public-version pin matches any local build of it), whereas
    "torch==2.11.0+cu130" would not match the installed "2.11.0" and pip would look for another torch."""
    from packaging.specifiers import SpecifierSet
    p = ip.plan(ip.Facts("2.11.0", "13.0", "/usr/local/cuda/bin/nvcc", PINNED, False))
    assert (p.torch_action, p.torch_pin, p.nccl) == ("keep", "2.11.0", True)
    assert "torch==2.11.0" in ip.constraints_for(CONSTRAINTS, p).splitlines()
    assert "2.11.0" in SpecifierSet("==2.11.0") and "2.11.0+cu130" in SpecifierSet("==2.11.0")
    assert "2.11.0" not in SpecifierSet("==2.11.0+cu130")


def test_tf_keras_comes_without_its_dependencies():
    """tf-keras declares the full ``tensorflow``: the install adds it with --no-deps after tensorflow-cpu."""
    root = os.path.join(os.path.dirname(__file__), "..")
    base = open(os.path.join(root, "requirements", "base.txt")).read().split()
    assert "tf-keras" not in base and "tensorflow-cpu" not in base
    script = open(os.path.join(root, "scripts", "install.sh")).read()
    assert '--no-deps "tf-keras==$TF_KERAS_VERSION"' in script
