"""Merged gradient groups and the scheduler's bookkeeping: pure functions, no Horovod.

torch_ops.grouping (Group, make_groups, flatten, scatter, join_state, split_state) and the parts
of torch_ops.scheduling that run before any collective (argument checks, StepClock readings,
Scheduler construction). The multi-process behaviour is in tests/test_multiprocess_schedules.py.
"""

import pytest
import torch

from hvdcompress.schedule.costmodel import ComputeFit, CostModel
from hvdcompress.schedule.planner import Schedule
from hvdcompress.spec import resolve
from torch_ops.grouping import Group, flatten, join_state, make_groups, scatter, split_state
from torch_ops.scheduling import Scheduler, StepClock, check_cost_model, check_profile_steps, check_schedule

SHAPES = {"fc.weight": (3, 4), "fc.bias": (3,), "out.weight": (2, 3), "out.bias": (2,)}


# --- Group --------------------------------------------------------------------------------------
def test_group_key_is_the_name_for_one_member_and_first_plus_rest_otherwise():
    assert Group(("fc.weight",), ((3, 4),)).key == "fc.weight"
    assert Group(("out.bias", "out.weight"), ((2,), (2, 3))).key == "out.bias+1"
    assert Group(("a", "b", "c", "d"), ((1,), (1,), (1,), (1,))).key == "a+3"


def test_group_numels():
    g = Group(("out.bias", "out.weight", "fc.bias"), ((2,), (2, 3), (3,)))
    assert g.numels == (2, 6, 3)
    assert g.numel == 11
    assert Group(("s",), ((),)).numels == (1,)  # a scalar parameter holds one element


@pytest.mark.parametrize("shapes, expected", [
    (((3, 4),), (3, 4)),                       # a group of one keeps its own shape
    (((5,),), (5,)),
    (((2, 3, 4, 5),), (2, 3, 4, 5)),
    (((2,), (3,), (4,)), (9,)),                # all 1-D (biases, norms): one 1-D tensor
    (((), (3,)), (4,)),                        # a scalar counts as 1-D
    (((2,), (2, 3)), (1, 8)),                  # a matrix among them: (1, numel)
    (((2, 3), (4, 5)), (1, 26)),
    (((1, 1, 3, 3), (4,)), (1, 13)),
])
def test_group_shape_rule(shapes, expected):
    names = tuple(f"p{i}" for i in range(len(shapes)))
    assert Group(names, shapes).shape == expected


# --- make_groups --------------------------------------------------------------------------------
def test_make_groups_builds_groups_with_their_shapes_in_the_given_order():
    groups = make_groups([["out.bias", "out.weight"], ["fc.bias"], ["fc.weight"]], SHAPES)
    assert [g.names for g in groups] == [("out.bias", "out.weight"), ("fc.bias",), ("fc.weight",)]
    assert groups[0].shapes == ((2,), (2, 3))
    assert [g.key for g in groups] == ["out.bias+1", "fc.bias", "fc.weight"]
    assert make_groups((("fc.weight", "fc.bias", "out.weight", "out.bias"),), SHAPES)[0].numel == 23


@pytest.mark.parametrize("groups, needle", [
    ([["fc.weight", "fc.bias"], ["out.weight"]], "missing: out.bias"),
    ([["fc.weight", "fc.bias"], ["out.weight", "fc.bias"], ["out.bias"]],
     "parameter 'fc.bias' is in groups 0 and 1"),
    ([["fc.weight", "fc.bias", "out.weight", "out.bias", "nope"]], "group 0 names 'nope'"),
    ([["fc.weight", "fc.bias"], [], ["out.weight", "out.bias"]], "group 1 is empty"),
    ([], "missing: fc.weight, fc.bias, out.weight, out.bias"),
])
def test_make_groups_refuses_bad_partitions_naming_schedule(groups, needle):
    with pytest.raises(ValueError) as err:
        make_groups(groups, SHAPES)
    assert str(err.value).startswith("schedule: ")
    assert needle in str(err.value)


# --- flatten / scatter --------------------------------------------------------------------------
def test_flatten_of_one_tensor_is_a_view():
    g = torch.arange(12.0).reshape(3, 4)
    flat = flatten([g])
    assert flat.shape == (12,) and flat.data_ptr() == g.data_ptr()
    flat[5] = -1.0
    assert g[1, 1] == -1.0


def test_flatten_of_several_tensors_is_a_new_concatenation():
    a, b, c = torch.arange(6.0).reshape(2, 3), torch.tensor([10.0, 11.0]), torch.arange(4.0).reshape(2, 2) + 20
    flat = flatten([a, b, c])
    assert torch.equal(flat, torch.cat([a.reshape(-1), b, c.reshape(-1)]))
    for t in (a, b, c):
        assert flat.data_ptr() != t.data_ptr()
    flat.zero_()
    assert a.sum() == 15.0 and b.sum() == 21.0  # the members are untouched


def test_scatter_round_trip_over_several_tensors():
    torch.manual_seed(0)
    grads = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2, 2), torch.randn(())]
    want = [g * 3 for g in grads]
    result = flatten(grads) * 3
    scatter(result, grads)
    for g, w in zip(grads, want):
        assert torch.equal(g, w)
    assert [tuple(g.shape) for g in grads] == [(2, 3), (4,), (1, 1, 2, 2), ()]


def test_scatter_of_one_tensor_copies_a_new_result_and_skips_its_own_view():
    g = torch.arange(6.0).reshape(2, 3)
    scatter(flatten([g]), [g])  # the result is the gradient itself: nothing to do
    assert torch.equal(g, torch.arange(6.0).reshape(2, 3))
    scatter(torch.full((6,), 7.0), [g])
    assert torch.equal(g, torch.full((2, 3), 7.0))


# --- join_state / split_state -------------------------------------------------------------------
def test_join_then_split_is_the_identity_with_absent_entries_as_zeros():
    a = {"u": torch.tensor([1.0, 2.0]), "v": torch.tensor([3.0, 4.0])}
    b = {"u": torch.tensor([5.0, 6.0, 7.0])}  # no "v" yet (e.g. a 1-D tensor DGC sent dense)
    c = {}                                    # no state at all yet
    joined = join_state([a, b, c], [2, 3, 1])
    assert sorted(joined) == ["u", "v"]
    assert torch.equal(joined["u"], torch.tensor([1.0, 2.0, 5.0, 6.0, 7.0, 0.0]))
    assert torch.equal(joined["v"], torch.tensor([3.0, 4.0, 0.0, 0.0, 0.0, 0.0]))
    parts = split_state(joined, [2, 3, 1])
    assert [sorted(p) for p in parts] == [["u", "v"]] * 3
    assert torch.equal(parts[0]["u"], a["u"]) and torch.equal(parts[0]["v"], a["v"])
    assert torch.equal(parts[1]["u"], b["u"]) and torch.equal(parts[1]["v"], torch.zeros(3))
    assert torch.equal(parts[2]["u"], torch.zeros(1)) and torch.equal(parts[2]["v"], torch.zeros(1))
    assert join_state([{}, {}], [2, 3]) == {}


def test_join_state_keeps_dtype_and_flattens_members():
    a = {"r": torch.ones(2, 2, dtype=torch.float64)}
    joined = join_state([a, {}], [4, 2])
    assert joined["r"].dtype == torch.float64 and joined["r"].shape == (6,)
    assert torch.equal(joined["r"], torch.tensor([1.0, 1, 1, 1, 0, 0], dtype=torch.float64))


def test_split_state_returns_copies_that_never_alias_live_state():
    live = {"residual": torch.arange(5.0)}
    parts = split_state(live, [2, 3])
    live["residual"].add_(100.0)
    assert torch.equal(parts[0]["residual"], torch.tensor([0.0, 1.0]))
    assert torch.equal(parts[1]["residual"], torch.tensor([2.0, 3.0, 4.0]))
    one = split_state(live, [5])
    live["residual"].zero_()
    assert torch.equal(one[0]["residual"], torch.arange(5.0) + 100)


def test_join_state_of_one_member_is_its_state():
    st = {"residual": torch.arange(3.0)}
    joined = join_state([st], [3])
    assert joined == st and joined is not st


def test_split_state_refuses_state_that_is_not_elementwise():
    with pytest.raises(ValueError, match="'q' of a merged group has 4 elements; the group has 5"):
        split_state({"q": torch.zeros(4)}, [2, 3])


# --- StepClock ----------------------------------------------------------------------------------
def _clock():
    c = StepClock(prev_end=10.0)
    c.hooks = [("out.bias", 11.0, 11.5), ("out.weight", 12.0, 12.25), ("fc.bias", 12.25, 13.0),
               ("fc.weight", 12.875, 13.25)]  # entered before the previous hook left: gap 0
    c.sync = (13.5, 14.0)
    c.update = (14.0, 14.5)
    return c


def test_step_clock_backward_gaps_run_from_the_previous_hook_exit():
    assert _clock().backward_gaps() == {"out.bias": 0.0, "out.weight": 0.5, "fc.bias": 0.0, "fc.weight": 0.0}
    assert StepClock(None).backward_gaps() == {}


def test_step_clock_timings_from_hand_made_readings():
    t = _clock().timings(7, 0.25)
    assert t == {"step": 7, "iteration_seconds": 4.5, "forward_seconds": 1.0, "backward_seconds": 2.25,
                 "hook_seconds": 0.5 + 0.25 + 0.75 + 0.375, "synchronize_seconds": 0.5,
                 "update_seconds": 0.5, "predicted_seconds": 0.25}


def test_step_clock_timings_without_a_previous_step_hooks_or_update():
    c = StepClock(None)
    c.sync = (1.0, 1.5)
    t = c.timings(0, None)
    assert t["iteration_seconds"] is None and t["forward_seconds"] is None and t["backward_seconds"] is None
    assert t["hook_seconds"] == 0 and t["synchronize_seconds"] == 0.5 and t["update_seconds"] == 0.0
    assert t["predicted_seconds"] is None and t["step"] == 0
    c.prev_end = 0.25  # no update recorded: the step ends when synchronize does
    assert c.timings(0, None)["iteration_seconds"] == 1.25


# --- argument checks ----------------------------------------------------------------------------
def test_check_schedule_accepts_strings_and_explicit_groups():
    assert check_schedule("layerwise") == Schedule("layerwise")
    assert check_schedule(None) == Schedule("auto")
    assert check_schedule(" Size:4 ") == Schedule("size", threshold_mb=4.0)
    assert check_schedule("mgs:greedy") == Schedule("mgs", search="greedy")
    assert check_schedule((("a", "b"), ["c"])) == [["a", "b"], ["c"]]


@pytest.mark.parametrize("bad, needle", [
    ("bogus", "unknown schedule 'bogus'"),
    ("size:-1", "'size:<MB>' needs a finite number of MiB >= 0"),
    ("size:abc", "'size:<MB>' needs a finite number"),
    ("mgs:fast", "unknown schedule"),
    (42, "expected a string; got 42"),
    ([], "expected a string"),
    (["a", "b"], "expected a string"),
    ([["a", 1]], "explicit groups must be lists of parameter names (str)"),
])
def test_check_schedule_errors_name_the_parameter(bad, needle):
    with pytest.raises(ValueError) as err:
        check_schedule(bad)
    assert str(err.value).startswith("schedule: ") and needle in str(err.value)


@pytest.mark.parametrize("good", [1, 5, 1000])
def test_check_profile_steps_accepts_ints_in_range(good):
    assert check_profile_steps(good) == good


@pytest.mark.parametrize("bad", [0, -1, 1001, True, 2.0, "5", None])
def test_check_profile_steps_errors_name_the_parameter(bad):
    with pytest.raises(ValueError, match=r"^profile_steps: must be an int in \[1, 1000\]; got "):
        check_profile_steps(bad)


def test_check_cost_model():
    model = CostModel.from_link(2, gbit_per_s=1.0, latency_s=1e-4)
    assert check_cost_model(model) is model
    assert check_cost_model(None) is None
    for bad in ({"world_size": 2}, "cached", model.to_dict()):
        with pytest.raises(ValueError, match=r"^cost_model: expected an hvdcompress.schedule.costmodel.CostModel or None.*"
                                             + type(bad).__name__):
            check_cost_model(bad)


# --- Scheduler construction (no collective before step 0 ends) ----------------------------------
SIZES = {n: 4.0 * torch.Size(s).numel() for n, s in SHAPES.items()}


def _scheduler(schedule, cost_model=None, profile_steps=5, spec="topk:ratio=0.5"):
    return Scheduler(schedule, resolve(spec), cost_model, profile_steps, SIZES, 2)


def test_scheduler_text_and_whether_it_needs_a_model():
    assert _scheduler("layerwise").text == "layerwise" and not _scheduler("layerwise").needs_model
    assert _scheduler("size:0.5").text == "size:0.5" and not _scheduler("single").needs_model
    assert _scheduler([list(SHAPES)]).text == "explicit" and not _scheduler([list(SHAPES)]).needs_model
    for s in ("auto", "mgs", "mgwfbp:greedy"):
        assert _scheduler(s).needs_model
    fresh = _scheduler("auto")
    assert fresh.plan is None and fresh.order is None and not fresh.done


def test_scheduler_checks_explicit_names_at_construction():
    with pytest.raises(ValueError, match="schedule: group 1 names 'fc.weigth'"):
        _scheduler([["out.bias", "out.weight"], ["fc.weigth", "fc.bias"]])
    with pytest.raises(ValueError, match="schedule: every parameter must be in a group; missing: fc.bias"):
        _scheduler([["out.bias", "out.weight", "fc.weight"]])


def test_scheduler_refuses_merging_state_that_is_not_elementwise():
    import toy_algorithm.reference_toy  # noqa: F401  (declares "toysign", merge=LAYERWISE)

    with pytest.raises(ValueError, match="schedule: compression .* not elementwise.*schedule='layerwise'"):
        _scheduler("single", spec="toysign")
    assert _scheduler("layerwise", spec="toysign").text == "layerwise"
    assert _scheduler("auto", spec="toysign").text == "layerwise"  # auto respects the merge policy


def test_scheduler_checks_its_other_arguments():
    with pytest.raises(ValueError, match="^profile_steps: "):
        _scheduler("auto", profile_steps=0)
    with pytest.raises(ValueError, match="^cost_model: "):
        _scheduler("auto", cost_model="a model")
    fit = ComputeFit("linear", 1e-9, 1e-5)
    model = CostModel.from_link(2, 1.0, 1e-4, compress={"topk:ratio=0.5": fit})
    assert _scheduler("mgs", cost_model=model).cost_model is model


def test_flat_buffers_are_reused_from_step_to_step():
    from torch_ops.grouping import FlatBuffers
    bufs = FlatBuffers()
    grads = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.tensor([7.0, 8.0])]
    x = bufs.flatten("g", grads)
    torch.testing.assert_close(x, torch.tensor([0.0, 1, 2, 3, 4, 5, 7, 8]))
    grads[0].mul_(2)
    y = bufs.flatten("g", grads)
    assert y.data_ptr() == x.data_ptr()  # the same memory, written again
    torch.testing.assert_close(y, torch.tensor([0.0, 2, 4, 6, 8, 10, 7, 8]))
    lone = bufs.flatten("p", grads[:1])  # a group of one is a view of its gradient, no buffer
    assert lone.data_ptr() == grads[0].data_ptr()
    z = bufs.flatten("g", grads + [torch.ones(1)])  # another size: a new buffer
    assert z.numel() == 9 and z.data_ptr() != x.data_ptr()
    w = bufs.flatten("g", [g.double() for g in grads])  # another dtype: a new buffer
    assert w.dtype == torch.float64
    bufs.reset()  # the groups changed: the same memory is handed out again, nothing allocated
    again = bufs.flatten("h", grads)
    assert again.untyped_storage().data_ptr() == z.untyped_storage().data_ptr()  # z's arena, from its start
    assert again.data_ptr() == z.untyped_storage().data_ptr()
    torch.testing.assert_close(again, y)
