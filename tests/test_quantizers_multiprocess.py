"""Quantizers and PowerSGD on real Horovod: 2 Gloo workers, PyTorch and TF/Keras (one launch each).

For every new compressor: parameters identical on every rank after every step, the bytes per step
``opt.stats`` measured equal to the declared packed layout, training moves the parameters; resume
bit-identical for PowerSGD (Q and the residual are state) and efsignsgd; bad parameters raise on
every rank before any collective, and a collective still works afterwards.
"""

import pytest

pytest.importorskip("horovod.runner")

import mp_quantizer_scenarios as sc  # noqa: E402
from launch import run_workers  # noqa: E402

NEEDLES = {"levels": "qsgd: parameter 'levels' must be int in [1, 127]",
           "bucket": "terngrad: parameter 'bucket' must be int in [0, 2147483647]",
           "rank": "powersgd: parameter 'rank' must be int in [1, 65536]"}


@pytest.fixture(scope="module", params=["torch", "tf"])
def launched(request):
    fn = sc.torch_everything if request.param == "torch" else sc.tf_everything
    return request.param, run_workers(fn, 2)


def _ok(r):
    assert "error" not in r, r.get("error")
    return r


def test_identical_parameters_after_every_step_and_declared_bytes(launched):
    backend, results = launched
    assert [r["world"] for r in results] == [2, 2]
    for spec in sc.SPECS:
        per_rank = [_ok(r["train"][spec]) for r in results]
        for r in per_rank:
            assert r["identical"] == [True] * sc.STEPS, (backend, spec, r["identical"])
            assert r["moved"] > 0, (backend, spec)
            assert r["sent"] == [r["expected"]] * sc.STEPS, (backend, spec, r["sent"], r["expected"])


def test_default_schedule_keeps_ranks_identical(launched):
    backend, results = launched
    if backend != "torch":
        pytest.skip("TF's default schedule is layerwise, covered above")
    for spec in ("qsgd:levels=3,bucket=64", "powersgd:rank=2"):
        for r in results:
            got = _ok(r["auto"][spec])
            assert got["identical"] == [True] * sc.STEPS, (spec, got)
    assert results[0]["auto"]["powersgd:rank=2"]["schedule"] in ("layerwise", "auto")


def test_resume_is_bit_identical(launched):
    backend, results = launched
    for spec, state in (("powersgd:rank=2", ["q", "residual"]), ("efsignsgd", ["residual"])):
        for r in results:
            got = _ok(r["resume"][spec])
            assert got["equal"], (backend, spec)
            assert all(got["identical"]), (backend, spec)
            assert got["state"] == state, (backend, spec, got["state"])


def test_bad_parameters_raise_on_every_rank(launched):
    _, results = launched
    for r in results:
        assert r["after"] == 2.0
        for label, needle in NEEDLES.items():
            assert r["bad"][label] is not None and needle in r["bad"][label], (label, r["bad"][label])
