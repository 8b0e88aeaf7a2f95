"""The default path costs nothing once it has decided (issue 39, item 4), on 2 real Gloo workers:
after the measured validation, a step of the user's default (codec choice, drift watch) hands the
transport what a step of codec_choice="off" does for the same groups, and no object collective;
and no step -- profiling, validation or after -- copies compression state between group layouts
inside its clock: a switch of plans lays the state out between steps (``Engine.regroup``), so the
validation measures the candidates, not the switches."""

import pytest

pytestmark = pytest.mark.multiprocess  # launches Horovod workers (conftest.py)

from scenarios import default_path as sc  # noqa: E402
from scenarios.launch import run_workers  # noqa: E402

STEPS = 40  # step 0, 1 profiled, (1 + 1) rounds of at most 8 candidates, then steps after the decision


@pytest.fixture(scope="module")
def ranks():
    out = run_workers(sc.default_and_off, 2, STEPS)
    for r in out:
        assert "error" not in r, r
    return out


def _steady(run):
    steady = [x for x in run["log"] if x["decided"] and not x["tuning"]][1:]  # after the switch to the kept plan
    assert len(steady) >= 5, run["log"]
    return steady


def test_after_the_decision_the_default_sends_what_off_sends_per_group(ranks):
    for r in ranks:
        default, off = r["default"], r["off"]
        assert default["codec_choice"] == "auto" and off["codec_choice"] == "off"
        assert default["watching"] and default["revalidate_every"] == 100 and not off["watching"]
        assert default["noise_z"] > 0 and off["noise_z"] == 0
        for run in (default, off):
            for x in _steady(run):
                # one round per group launched and waited for; no object collective, no barrier
                calls = x["calls"]
                assert calls.get("launch") == x["groups"] and calls.get("wait") == x["groups"], x
                assert not {"allgather_object", "broadcast_object", "barrier", "allreduce_", "allgather"} & set(calls), x
                assert x["identical"]
    a, b = ranks
    for key in ("default", "off"):  # every rank decided alike
        assert a[key]["kept"] == b[key]["kept"]
        assert [x["groups"] for x in a[key]["log"]] == [x["groups"] for x in b[key]["log"]]


def test_no_step_copies_state_between_layouts_inside_its_clock(ranks):
    for r in ranks:
        for run in (r["default"], r["off"]):
            assert all(x["identical"] for x in run["log"])
            assert all(x["copied_in_step"] == 0 for x in run["log"]), [x["copied_in_step"] for x in run["log"]]
            # the switches did copy state (the validation changed layouts), between the steps
            switched = [x["copied_between"] for x in run["log"] if x["copied_between"]]
            assert switched and max(switched) <= 2 * run["state_bytes"], switched
