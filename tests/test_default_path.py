"""The default path costs nothing once it has decided (issue 39, item 4), on 2 real Gloo workers:
after the measured validation, a step of the user's default (codec choice, drift watch) hands the
transport what a step of codec_choice="off" does for the same groups, and no object collective;
and no step -- profiling, validation or after -- copies compression state between group layouts
inside its clock: a switch of plans lays the state out between steps (``Engine.regroup``), so the
validation measures the candidates, not the switches. With the same groups as the fixed choice
(codec_choice="off" on the default's kept groups), a steady step of the default makes the same
calls, function by function, in the front end, session, scheduler and planner, and the same
launches and waits: the only extra is the drift watch's record of the step's time (and, where
the default kept dense or fp16 on every group, the fixed choice -- that spec's own compressor --
makes a few calls per group more than the default's send of the same bytes)."""

import pytest

pytestmark = pytest.mark.multiprocess  # launches Horovod workers (conftest.py)

from scenarios import default_path as sc  # noqa: E402
from scenarios.launch import run_workers  # noqa: E402

STEPS = 40  # step 0, 1 profiled, (1 + 1) rounds of at most 8 candidates, then steps after the decision
PROFILED = 6  # steady steps profiled per optimizer (sc.same_plan)


@pytest.fixture(scope="module")
def ranks():
    out = run_workers(sc.default_and_off, 2, STEPS, PROFILED)
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


def test_after_the_decision_the_default_does_what_the_fixed_choice_with_its_plan_does(ranks):
    for r in ranks:
        default, fixed = r["same_plan"]["default"], r["same_plan"]["fixed"]
        assert default["codec_choice"] == "auto" and default["watching"]
        if fixed is None:  # the validation kept the choice's own plan, which mixes specs: no fixed choice has it
            pytest.skip(f"the default kept a plan mixing specs ({default['codecs']}), under this machine's load")
        assert fixed["codec_choice"] == "off" and not fixed["watching"]
        assert default["groups"] == fixed["groups"] and fixed["codecs"] == [None] * len(fixed["groups"])
        assert default["identical"] and fixed["identical"]
        for call in ("launch", "wait", "allreduce_", "allgather", "barrier", "allgather_object", "broadcast_object"):
            assert default["transport"].get(call, 0) == fixed["transport"].get(call, 0), (call, default, fixed)
        assert default["transport"]["launch"] == PROFILED * len(default["groups"])
        # nothing is planned in a steady step (schedule/groups.py describes the groups in use)
        assert not [k for k in default["calls"] if k.startswith("hvdcompress/schedule/")
                    and not k.startswith("hvdcompress/schedule/groups.py:")], default["calls"]
        names = set(default["calls"]) | set(fixed["calls"])
        extra = {k: default["calls"].get(k, 0) - fixed["calls"].get(k, 0) for k in names}
        # the drift watch records the step's time, once a step (its collective comes once a window),
        # and answers end_of_step before the scheduler asks whether the plan is done (which asks whether
        # routes are being measured)
        expected = {"torch_ops/scheduling.py:_watch_step": PROFILED, "torch_ops/scheduling.py:_step_seconds": PROFILED,
                    "torch_ops/scheduling.py:done": -PROFILED, "torch_ops/scheduling.py:validating_routes": -PROFILED}
        if fixed["spec"] != sc.SPEC:
            # the kept plan sends every group dense (or fp16): the default sends each by the plan's codec
            # (codec_choice.fallback_exchange over its compressor's state), the fixed choice by its own
            # compressor, "none" (or "fp16"); same wire, but only the fixed side asks the engine's merge
            # check (the compressor's merge rule: session.compressor, the group's names) and runs its
            # compressor's memory (compensate, update: a no-op), per group and step
            fewer = -PROFILED * len(fixed["groups"])
            expected.update({f"torch_ops/{k}": fewer for k in ("session.py:compressor", "grouping.py:names",
                                                               "memory.py:compensate", "memory.py:update")})
        assert {k: v for k, v in extra.items() if v} == expected, (fixed["spec"], extra)
    a, b = ranks
    assert a["same_plan"]["default"]["groups"] == b["same_plan"]["default"]["groups"]
