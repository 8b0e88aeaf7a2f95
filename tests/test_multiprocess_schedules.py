"""Layer merging (``DistributedOptimizer(schedule=...)``) on real Horovod: Gloo CPU workers.

Two launches: every scenario of tests/scenarios/schedules.py on 2 workers (a module fixture;
each test checks one part of what it returned), and every compressor under merged schedules on
3 workers.
"""

import math

import pytest

from hvdcompress.schedule import planner, search

pytestmark = pytest.mark.multiprocess  # every test here launches Horovod workers (conftest.py)

from scenarios import schedules as sc  # noqa: E402
from scenarios.torch_core import TRAIN_SPECS  # noqa: E402
from scenarios.launch import part as _part  # noqa: E402
from scenarios.shared_launch import TORCH_2, TORCH_3  # noqa: E402

WORLD = 2
SIZES = {"0.weight": 2560, "0.bias": 128, "2.weight": 4096, "2.bias": 128, "4.weight": 512, "4.bias": 16}
TIMING_KEYS = ("iteration_seconds", "forward_seconds", "backward_seconds", "hook_seconds",
               "synchronize_seconds", "update_seconds")


@pytest.fixture(scope="module")
def results():
    # sc.everything(2, an empty cache: "auto" without a model must profile) in the shared launch
    out = _part(TORCH_2.results("test_multiprocess_schedules"), "everything")
    assert len(out) == WORLD
    return out


def _merged(groups):
    return any(len(g) > 1 for g in groups)


def _check_timings(run, planned_from):
    """Every step's timings are sane; the prediction appears once the plan exists."""
    for i, rec in enumerate(run["log"]):
        t = rec["timings"]
        assert t["step"] == i
        for key in TIMING_KEYS:
            if i == 0 and key in ("iteration_seconds", "forward_seconds"):
                assert t[key] is None  # no previous step to measure from
            else:
                assert isinstance(t[key], float) and 0.0 <= t[key] < 60.0, (i, key, t[key])
        assert t["iteration_seconds"] is None or t["iteration_seconds"] >= t["update_seconds"]
        if planned_from is not None:
            if i >= planned_from:
                assert isinstance(t["predicted_seconds"], float) and t["predicted_seconds"] > 0, (i, t)
            else:
                assert t["predicted_seconds"] is None, (i, t)


# --- merged schedules give the layerwise parameters bit for bit -----------------------------------
@pytest.mark.parametrize("spec", sc.EXACT_SPECS)
def test_merged_schedules_are_bit_identical_to_layerwise(results, spec):
    for r in _part(results, "equivalence"):
        res = r[spec]
        assert all(len(g) == 1 for g in res["layerwise"]["groups"])
        for label in ("single", sc.SIZE, "explicit", "auto", "mgs"):
            run = res[label]
            assert run["equal"], f"{spec} under {label} differs from layerwise"
            assert run["identical"], label
            assert _merged(run["groups"]), (label, run["groups"])
            assert sorted(n for g in run["groups"] for n in g) == sorted(res["order"])


def test_fixed_schedules_make_the_groups_they_name(results):
    for r in _part(results, "equivalence"):
        for spec in sc.EXACT_SPECS:
            res, order = r[spec], r[spec]["order"]
            assert res["single"]["groups"] == [order]
            by_size = search.by_size([SIZES[n] for n in order], 0.004 * planner.MIB)
            assert res[sc.SIZE]["groups"] == [[order[i] for i in g] for g in by_size]
            assert res["explicit"]["groups"] == [order[:2], order[2:5], order[5:]]
            assert res["single"]["plan"] == {"schedule": "single", "groups": [list(range(6))], "predicted": None}
            assert res["explicit"]["plan"]["schedule"] == "explicit"
            for label in ("single", sc.SIZE):  # fixed, no cost model: regrouped after step 0, nothing measured
                assert [rec["groups_after"] for rec in res[label]["log"]] == [len(res[label]["groups"])] * sc.STEPS
                assert res[label]["workload"] is None and res[label]["cost_model_world"] is None


def test_cost_model_schedules_plan_after_profile_steps_with_a_prediction(results):
    for r in _part(results, "equivalence"):
        for spec in sc.EXACT_SPECS:
            res = r[spec]
            for label in ("auto", "mgs", "explicit"):
                run = res[label]
                plan = run["plan"]
                assert isinstance(plan["predicted"], float) and math.isfinite(plan["predicted"]), (label, plan)
                assert 0 < plan["predicted"] < 60, (label, plan)
                assert run["workload"] == res["order"] and run["cost_model_world"] == WORLD
                _check_timings(run, planned_from=sc.PROFILE_STEPS + 1)
                if label != "explicit":  # step 0 layerwise, one group while measuring, then the plan
                    counts = [rec["groups_after"] for rec in run["log"]]
                    assert counts[:sc.PROFILE_STEPS] == [1] * sc.PROFILE_STEPS, counts
                    assert all(c < 6 for c in counts[sc.PROFILE_STEPS:]), counts
            assert res["auto"]["plan"]["schedule"] == ("mgs" if spec.startswith("topk") else "mgwfbp")
            assert res["mgs"]["plan"]["schedule"] == "mgs"
            for label in ("single", sc.SIZE):
                _check_timings(res[label], planned_from=None)


def test_auto_without_a_cost_model_profiles_once_and_still_matches_layerwise(results):
    ranks = _part(results, "profiled")
    for r in ranks:
        assert r["equal"] and r["identical"]
        assert r["cache_before"] == []
        assert len(r["cache_after"]) == 1 and r["cache_after"][0].startswith(f"costmodel-n{WORLD}-")
        assert r["cost_model_world"] == WORLD and r["model_has_none"]
        assert r["plan"]["schedule"] == "mgwfbp" and r["plan"]["predicted"] > 0
        assert r["workload"] is not None and len(r["workload"]) == 6
        _check_timings(r, planned_from=2)  # profile_steps=1: planned at the end of step 1
    assert ranks[0]["plan"] == ranks[1]["plan"]  # rank 0 plans, every rank uses its plan


# --- every compressor -----------------------------------------------------------------------------
def _check_all_specs(out):
    for spec in TRAIN_SPECS + ["dgc/auto"]:
        run = out[spec]
        assert all(run["each_step"]), (spec, run["each_step"])
        assert run["moved"] > 0, f"{spec} did not train"
        assert _merged(run["groups"]), (spec, run["groups"])
    assert out["dgc/auto"]["plan"]["schedule"] == "mgs" and out["dgc/auto"]["plan"]["predicted"] > 0


def test_every_compressor_keeps_ranks_identical_after_every_step_under_merged_groups(results):
    for out in _part(results, "all_specs"):
        _check_all_specs(out)


def test_every_compressor_under_merged_groups_on_3_workers():
    out = _part(TORCH_3.results("test_multiprocess_schedules"), "merged")  # sc.merged_training(3)
    assert len(out) == 3
    for r in out:
        assert "error" not in r, r.get("error")
        _check_all_specs(r)


# --- checkpoints ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["topk/auto", "topk/size", "dgc/single"])
def test_checkpoint_resume_under_a_merged_plan_is_bit_identical(results, case):
    for r in _part(results, "resume"):
        res = r[case]
        assert res["equal"] and res["identical"], case
        assert _merged(res["groups_at_save"])
        assert res["groups_after_load"] == res["groups_at_save"] == res["groups_end"]  # the plan came back
        saved = res["saved_plan"]
        assert res["plan_after"] == res["plan_at_save"]  # the plan came back as it was, "auto" resolved
        assert (saved["groups"], saved["predicted_seconds"]) == (res["plan_at_save"]["groups"],
                                                                 res["plan_at_save"]["predicted"])
        assert res["state_keys"] == res["names"]  # per parameter, whatever the grouping
        assert "residual" in res["state_entries"] or "u" in res["state_entries"]
        assert not res["workload_after"]  # nothing measured again after loading a finished plan
    auto = results[0]["resume"]["topk/auto"]
    assert auto["saved_plan"]["schedule"] == "auto" and auto["saved_plan"]["predicted_seconds"] > 0


def test_checkpoints_move_between_layerwise_and_merged_optimizers(results):
    for r in _part(results, "resume"):
        cross = r["cross"]
        for label, res in cross.items():
            assert res["loaded"], f"{label}: the state did not come back per parameter"
            assert res["identical"] and res["step"] == 6, label
        assert len(cross["layerwise->single"]["groups"]) == 1
        assert all(len(g) == 1 for g in cross["single->layerwise"]["groups"])
        assert len(cross["layerwise->size"]["groups"]) == 3


def test_a_checkpoint_of_other_explicit_groups_does_not_impose_its_groups(results):
    for r in _part(results, "resume"):
        res = r["explicit_other_groups"]
        assert res["loaded"]
        assert res["saved"] != res["asked"]
        assert res["groups"] == res["asked"]


# --- no gradient, accumulation --------------------------------------------------------------------
def test_parameters_without_gradient_in_merged_groups_do_not_hang(results):
    for r in _part(results, "no_gradient"):
        for spec in ("none", "topk:ratio=0.5"):
            for schedule in ("layerwise", "single", sc.SIZE):
                run = r[f"{spec}/{schedule}"]
                assert run["identical"] and run["unused_unchanged"], (spec, schedule)
                assert sorted(run["order"][:2]) == ["head.bias", "head.weight"]  # rank 0's backward order
                assert sorted(run["order"][-2:]) == ["unused.bias", "unused.weight"]  # no gradient: last
            assert len(r[f"{spec}/single"]["groups"]) == 1
            size_groups = r[f"{spec}/{sc.SIZE}"]["groups"]
            assert any("head.weight" in g and len(g) > 2 for g in size_groups)  # rank 1 never computes it
            assert any("unused.weight" in g and len(g) > 2 for g in size_groups)
            if spec == "none":
                assert r["none/single"]["equal_to_layerwise"] and r[f"none/{sc.SIZE}"]["equal_to_layerwise"]


def test_backward_passes_per_step_and_predivide_with_merged_groups(results):
    for r in _part(results, "accumulation"):
        for spec in ("none", "fp16"):
            for schedule in ("single", sc.SIZE):
                run = r[f"{spec}/{schedule}"]
                assert run["equal"] and run["identical"] and _merged(run["groups"]), (spec, schedule)
                _check_timings(run, planned_from=None)
        run = r["none/single/predivide"]
        assert run["equal"] and run["identical"] and _merged(run["groups"])


# --- bad arguments --------------------------------------------------------------------------------
def test_bad_schedule_arguments_raise_on_every_rank(results):
    expected = {
        "unknown": "schedule: unknown schedule 'fastest'",
        "type": "schedule: expected a string; got 3",
        "size": "schedule: 'size:<MB>' needs a finite number of MiB >= 0",
        "explicit_type": "schedule: explicit groups must be lists of parameter names",
        "explicit_unknown": "schedule: group 0 names 'nope', which is not a parameter",
        "explicit_missing": "schedule: every parameter must be in a group; missing: 4.bias",
        "explicit_twice": "schedule: parameter '0.weight' is in groups 0 and 1",
        "explicit_empty": "schedule: group 1 is empty",
        "profile_steps": "profile_steps: must be an int in [1, 1000]; got 0",
        "profile_steps_type": "profile_steps: must be an int in [1, 1000]; got 2.5",
        "cost_model": "cost_model: expected an hvdcompress.schedule.costmodel.CostModel or None",
        "revalidate_every": "revalidate_every: must be None (default: 100 with codec_choice='auto', else 0), "
                            "0 (no re-validation on drift) or an int in [3, 1000000] (steps per window); got 2",
        "not_consecutive": "schedule: explicit groups must hold parameters that are consecutive in backward order",
        "mgs_without_fit": "schedule 'mgs' needs the compression time of 'topk:ratio=0.1",
    }
    ranks = _part(results, "bad")
    for r in ranks:
        assert r["after"] == float(WORLD)  # a collective still works: no rank was left inside one
        for label, needle in expected.items():
            assert r["errors"][label] is not None and needle in r["errors"][label], (label, r["errors"][label])
        assert r["raised_at"] == {"not_consecutive": 1, "mgs_without_fit": 2}  # end of step 0 / of profiling
    assert ranks[0]["errors"] == ranks[1]["errors"]  # the same error on every rank


def test_groups_switch_between_compressed_and_dense_losing_nothing(results):
    for r in _part(results, "codec_switch"):
        codecs = r["codecs"]  # per step: the specs of the groups in use after it (None: top-k everywhere)
        sent_dense = [c is not None and any(x is not None and x.startswith(("none", "fp16")) for x in c)
                      for c in codecs]
        compressed = [c is None for c in codecs]
        # the candidates take turns: the choice (dense groups), top-k everywhere, ...: switches both ways
        assert any(sent_dense[i] and compressed[i + 1] for i in range(len(codecs) - 1)), codecs
        assert any(compressed[i] and sent_dense[i + 1] for i in range(len(codecs) - 1)), codecs
        assert r["identical"]
        for key in ("resumed_during_tuning", "resumed_after_tuning"):  # bit for bit, codecs restored
            assert r[key]["equal"] and r[key]["codecs_equal"] and r[key]["identical"] and r[key]["steps"] >= 2, r[key]
        assert len(codecs) > r["decided_at"] and r["plan_codecs"]  # the kept plan carries its codecs
        assert r["untimed_alternatives"] == {"planned": True, "identical": True}, r["untimed_alternatives"]
        assert r["lost"] <= 3e-3 * max(1.0, r["scale"]), r  # fp16 sums round; a lost residual is O(scale)
        assert r["tuning"] and any("(all topk)" in label for label in r["tuning"])
        # the fixed choices ran beside the choice (or the choice is one of them, measured once)
        choice = r["candidates"][0]
        for name, prefix in (("topk", "topk"), ("fp16", "fp16"), ("dense", "none")):
            assert any(f"(all {name})" in c["label"] for c in r["candidates"]) or \
                all(x.startswith(prefix) for x in choice["codecs"]), (name, r["candidates"])


def test_a_layerwise_compressor_is_chosen_per_tensor_beside_merged_dense_groups(results):
    """PowerSGD (state shaped by the tensor) with codec_choice="auto": its groups hold one tensor,
    the others merge into fp16 / dense groups; its q survives the merged groups."""
    for r in _part(results, "lowrank_switch"):
        groups, codecs = r["choice"]["groups"], r["choice"]["codecs"]
        low = [g for g, c in zip(groups, codecs) if c.startswith("powersgd")]
        assert low and all(len(g) == 1 for g in low), r["choice"]
        assert any(len(g) > 1 for g, c in zip(groups, codecs) if not c.startswith("powersgd")), r["choice"]
        assert any("(all powersgd)" in label for label in r["labels"]), r["labels"]
        assert any("(all fp16)" in label or "(all dense)" in label for label in r["labels"]), r["labels"]
        assert r["identical"] and r["steps"] > r["decided_at"]
        assert r["q_kept"], "PowerSGD's warm start was dropped"
        assert r["lost"] <= 3e-3 * max(1.0, r["scale"]), r
        assert r["resumed"]["equal"] and r["resumed"]["identical"] and r["resumed"]["steps"] == 2, r["resumed"]


def test_a_drifting_step_time_reruns_the_validation_on_every_rank_alike(results):
    ranks = _part(results, "codec_drift")
    for r in ranks:
        log = r["log"]
        assert r["identical"], [x["step"] for x in log if not x["identical"]]
        # validations start after profiling (step 1), at the window that saw the slowdown (the step
        # after slow_from: the window is one step before it and two slowed), at the first window
        # after the slowdown was lifted (its reference was set on the step before lifted_from)
        started = [x["step"] for prev, x in zip(log, log[1:]) if x["tuning"] and not prev["tuning"]]
        assert started == [1, r["slow_from"] + 1, r["lifted_from"] + 2], (started, r["slow_from"], r["lifted_from"])
        slowed, final = r["after_slow"], r["final"]
        assert slowed["revalidations"] == 1 and final["revalidations"] == 2
        assert slowed["drift"]["window_seconds"] > 1.25 * slowed["drift"]["reference_seconds"]  # slower
        assert slowed["drift"]["window_seconds"] >= sc.DRIFT_SLEEP_S
        assert final["drift"]["window_seconds"] < 0.75 * final["drift"]["reference_seconds"]  # faster
        assert final["drift"]["reference_seconds"] == r["slowed_reference"] >= sc.DRIFT_SLEEP_S
        # while the candidates run again, groups switch between top-k and dense both ways
        again = [x["codecs"] for x in log if x["step"] > r["slow_from"] and x["tuning"]]
        dense = [c is not None and any(s is not None and s.startswith(("none", "fp16")) for s in c) for c in again]
        assert any(dense) and not all(dense), again
        assert r["lost"] <= 3e-3 * max(1.0, r["scale"]), r  # the residual went out with the dense groups
        resumed = r["resumed"]  # inside a window: the same checks, bit for bit up to the decision
        assert all(resumed[k] for k in ("equal", "same_windows", "same_tuning", "same_codecs", "identical")), resumed
        assert resumed["steps"] >= 4
    decisions = [[(x["step"], x["tuning"], x["window"], x["codecs"], x["revalidations"]) for x in r["log"]]
                 for r in ranks]
    assert decisions[0] == decisions[1]  # every rank decided at the same step, the same way
    assert ranks[0]["final"] == ranks[1]["final"]


def test_the_codec_choice_runs_by_default_and_off_sends_the_spec_everywhere(results):
    """A default-constructed optimizer with a compressing spec under "auto" runs the codec choice
    (measured against the spec, fp16 and dense on every group); codec_choice="off" keeps the spec
    on every group. Parameters are identical on every rank after every step either way."""
    ranks = _part(results, "default_choice")
    for r in ranks:
        on, off = r["default"], r["off"]
        for run in (on, off):
            assert all(x["identical"] for x in run["log"]), [i for i, x in enumerate(run["log"]) if not x["identical"]]
            assert not run["tuning_now"]  # the measured validation has decided
        spec = on["spec"]
        # on: the choice first (top-k is dear in the given model: its groups go fp16 / dense), the
        # spec, fp16 and dense each on every group beside it; the drift watch on by default
        assert on["codec_choice"] == "auto" and on["revalidate_every"] == 100
        assert on["plan_codecs"] is not None
        choice = on["candidates"][0]
        assert any(not c.startswith("topk") for c in choice["codecs"]), choice
        for name, prefix in (("topk", "topk"), ("fp16", "fp16"), ("dense", "none")):
            assert any(f"(all {name})" in c["label"] and all(x.startswith(prefix) for x in c["codecs"])
                       for c in on["candidates"]) or all(x.startswith(prefix) for x in choice["codecs"]), name
        sent_otherwise = [x["codecs"] for x in on["log"] if x["codecs"] and any(c is not None for c in x["codecs"])]
        assert sent_otherwise, "no step sent a group with fp16 or dense"
        assert max(x["bytes"] / x["dense_bytes"] for x in on["log"]) >= 0.5  # fp16 or dense went out
        # off: the spec on every group at every step, and its own partitions measured
        assert off["codec_choice"] == "off" and off["revalidate_every"] == 0 and off["plan_codecs"] is None
        assert all(c["codecs"] is None for c in off["candidates"]) and len(off["candidates"]) >= 2
        assert all(x["codecs"] is None for x in off["log"])
        assert all(x["bytes"] < 0.5 * x["dense_bytes"] for x in off["log"]), [x["bytes"] for x in off["log"]]
    for key in ("default", "off"):  # every rank decided the same way
        assert ranks[0][key]["candidates"] == ranks[1][key]["candidates"]
        assert ranks[0][key]["kept"] == ranks[1][key]["kept"]
        assert [x["codecs"] for x in ranks[0][key]["log"]] == [x["codecs"] for x in ranks[1][key]["log"]]
