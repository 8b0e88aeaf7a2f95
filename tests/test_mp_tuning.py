"""Measured validation of cost-model plans (``tune_steps``) on 2 real Gloo workers: every rank
keeps the same plan and switches at the same step, parameters stay identical across ranks every
step, compression state survives every plan switch, and a checkpoint taken while candidates run
resumes the validation where it was."""

import pytest

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios import tuning as sc  # noqa: E402
from scenarios.launch import part  # noqa: E402
from scenarios.shared_launch import TORCH_2  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def ranks():
    out = part(TORCH_2.results("test_mp_tuning"), "everything")  # sc.everything(2), the shared launch
    return part(out, "tuned")


def test_every_rank_keeps_the_same_plan_and_switches_at_the_same_step(ranks):
    a, b = ranks
    assert a["plan"] == b["plan"] and a["groups"] == b["groups"]
    assert [r["groups"] for r in a["log"]] == [r["groups"] for r in b["log"]]
    tuned = a["plan"]["tuning"]
    assert tuned is not None and len(tuned["candidates"]) >= 2 and tuned["tune_steps"] == sc.TUNE_STEPS
    kept = tuned["candidates"][tuned["kept"]]
    assert a["plan"]["groups"] == kept["groups"] and tuned["kept_label"] == kept["label"]
    assert a["groups"] == [[a["order"][i] for i in g] for g in kept["groups"]]
    assert a["plan"]["schedule"] == "mgs" and a["plan"]["predicted"] == kept["predicted_seconds"]
    medians = tuned["medians_seconds"]
    assert all(m > 0 for m in medians) and medians[tuned["kept"]] <= min(medians) * 1.02 + 1e-12
    # step 0 layerwise, step 1 profiles, then (1 + tune_steps) rounds of the candidates, then done
    n = len(tuned["candidates"])
    flags = [r["tuning"] for r in a["log"]]
    assert flags == [False] + [True] * ((1 + sc.TUNE_STEPS) * n) + [False] * (len(flags) - 1 - (1 + sc.TUNE_STEPS) * n)
    switches = sum(r["switched"] for r in a["log"])
    assert switches >= (1 + sc.TUNE_STEPS) * n - 1  # the candidates in turn, every step (the last may be kept)


def test_parameters_identical_every_step_and_state_survives_switches(ranks):
    for r in ranks:
        for log in (r["log"], r["resumed_log"]):
            assert all(x["identical"] for x in log)
            assert all(x["state_kept"] for x in log)
        assert any(x["switched"] and x["residual"] > 0 for x in r["log"])  # switches with live residuals


def test_a_checkpoint_taken_while_candidates_run_resumes_them(ranks):
    a, b = ranks
    for r in ranks:
        assert r["tuning_at_save"] and r["saved_progress"]["in_progress"]["index"] >= 0
        assert r["resumed_at_load"] == {"tuning": True, "groups": r["groups_at_save"]}
        assert r["resumed_plan"]["tuning"] is not None  # finished after the resume
        # the resumed run steps through the same candidates at the same steps
        assert [x["tuning"] for x in r["resumed_log"]] == [x["tuning"] for x in r["log"][6:]]
        cands = r["resumed_plan"]["tuning"]["candidates"]
        assert cands == r["plan"]["tuning"]["candidates"]
    assert a["resumed_plan"] == b["resumed_plan"] and a["resumed_groups"] == b["resumed_groups"]
