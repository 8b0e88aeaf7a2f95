"""Single-process tests of merged-group schedules on the TF backend (``tf_ops.grouping``).

Two ranks are simulated with ``local_world.run_lockstep``: each rank has its own
``GradientCompression``; ``start_exchange`` gives one exchange generator per group and the
lockstep world answers their collectives, eagerly or while a ``tf.function`` is traced. Merged
groups must give what layerwise gives when nothing is lost (none, fp16, top-k ratio 1.0), and,
for lossy compressors, exactly what the compressor gives on the concatenated tensor, with the
group's state split back into the per-position slots.
"""

import dataclasses
import socket

import numpy as np
import pytest
import tensorflow as tf

import hvdcompress.tensorflow as hvc
from hvdcompress.schedule.costmodel import ComputeFit, CostModel
from scenarios.local_world import run_lockstep
from tf_ops.compressors import ExchangeContext, build_compressor

WORLD = 2
SHAPES = [(30, 20), (20,), (20, 10), (10,)]  # a two-layer dense model: kernel, bias, kernel, bias


class _NoTransport:
    def run(self, requests, name):  # start_exchange never needs one; exchange() is not used here
        raise AssertionError("lockstep tests drive the generators themselves")


def _grads(rank, step, shapes=SHAPES, dtypes=None):
    rng = np.random.default_rng(100 * rank + step)
    dtypes = dtypes or [np.float32] * len(shapes)
    return [tf.constant(rng.standard_normal(s).astype(d)) for s, d in zip(shapes, dtypes)]


def _comps(spec, schedule="layerwise", **kw):
    return [hvc.GradientCompression(spec, transport=_NoTransport(), schedule=schedule, **kw) for _ in range(WORLD)]


def _step_fn(comps, graph):
    def step(grads_per_rank):
        pending = [c.start_exchange(g, world_size=WORLD, scale=1.0 / WORLD) for c, g in zip(comps, grads_per_rank)]
        results, sent = [[] for _ in comps], [0] * WORLD
        for j in range(len(pending[0].generators)):
            res, nbytes = run_lockstep([p.generators[j] for p in pending])
            for r in range(WORLD):
                results[r].append(res[r])
                sent[r] += nbytes[r]
        return [p.finish(results[r], sent[r]) for r, p in enumerate(pending)]
    return tf.function(step) if graph else step


def _run(comps, steps, graph, **kw):
    fn = _step_fn(comps, graph)
    out = []
    for s in steps:
        got = fn([_grads(r, s, **kw) for r in range(WORLD)])
        out.append([[None if t is None else t.numpy() for t in rank] for rank in got])
    return out


def _assert_same(a, b):
    for step_a, step_b in zip(a, b):
        for rank_a, rank_b in zip(step_a, step_b):
            for x, y in zip(rank_a, rank_b):
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("spec", ["none", "fp16", "topk:ratio=1.0"])
@pytest.mark.parametrize("schedule, groups", [
    ("single", [[3, 2, 1, 0]]),
    ("size:0.0025", [[3, 2, 1], [0]]),  # 2.56 KiB: the last layer and the first bias (920 B), the kernel
    ([[0, 3], [1]], [[3, 0], [2], [1]]),  # explicit, not consecutive; position 2 alone
])
def test_merged_groups_give_what_layerwise_gives(spec, schedule, groups):
    graph = spec == "topk:ratio=1.0"  # one lossless spec through tf.function, the others eagerly
    layerwise = _run(_comps(spec), range(2), graph)
    comps = _comps(spec, schedule)
    merged = _run(comps, range(2), graph)
    _assert_same(layerwise, merged)
    assert comps[0].groups == groups
    assert comps[0].stats.last_dense_bytes == sum(np.prod(s) for s in SHAPES) * 4
    if spec == "none":
        assert comps[0].stats.last_bytes == comps[0].stats.last_dense_bytes


def _reference(spec, group_positions, steps, **kw):
    """The compressor on the concatenated group, with state of its own, told the group's members
    (the oracle for merging: per-member rules such as DGC's per-tensor clipping apply inside)."""
    from hvdcompress.contract import Member

    comp = build_compressor(hvc.parse_spec(spec) if isinstance(spec, str) else spec)
    shapes = [SHAPES[p] for p in group_positions]
    numel = sum(int(np.prod(s)) for s in shapes)
    shape = (numel,) if all(len(s) <= 1 for s in shapes) else (1, numel)
    states = [comp.new_state(shape, tf.float32) for _ in range(WORLD)]
    key = f"{group_positions[0]}+{len(group_positions) - 1}"
    offsets = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    members = tuple(Member(str(p), tuple(s), int(o)) for p, s, o in zip(group_positions, shapes, offsets))
    density = comp.scheduled_density(0) if comp.has_density else None
    out = []
    for step in steps:
        flats = [tf.concat([tf.reshape(_grads(r, step)[p], [-1]) for p in group_positions], 0) for r in range(WORLD)]
        gens = [comp.exchange(flats[r], ExchangeContext(key, step, WORLD, 1.0 / WORLD, states[r], shape, 0, density=density,
                                                         rank=r, members=members))
                for r in range(WORLD)]
        results, _ = run_lockstep(gens)
        out.append([r.numpy() for r in results])
    return out, [{k: v.numpy() for k, v in st.items()} for st in states]


@pytest.mark.parametrize("spec, graph", [
    ("topk:ratio=0.1", False),
    ("threshold:threshold=1.0", False),
    ("bf16", True),
    ("randomk:ratio=0.2,seed=3", True),
    ("dgc:ratio=0.05,warmup_epochs=0,min_sparse_numel=64,clip_norm=5.0", True),
])
def test_a_merged_group_is_the_compressor_on_the_concatenation_and_its_state_splits_back(spec, graph):
    comps = _comps(spec, "single")
    got = _run(comps, range(3), graph)
    want, states = _reference(spec, [3, 2, 1, 0], range(3))
    numels = [int(np.prod(SHAPES[p])) for p in (3, 2, 1, 0)]
    for step in range(3):
        for r in range(WORLD):
            flat = np.concatenate([got[step][r][p].ravel() for p in (3, 2, 1, 0)])
            np.testing.assert_array_equal(flat, want[step][r])
        np.testing.assert_array_equal(got[step][0][0], got[step][1][0])  # the ranks agree
    for r in range(WORLD):
        for name, value in states[r].items():
            parts = np.split(value, np.cumsum(numels)[:-1])
            for p, part in zip((3, 2, 1, 0), parts):
                np.testing.assert_array_equal(comps[r].slots[p][name].numpy(), part)
    if spec.startswith("dgc"):  # the biases joined a sparsified group: they keep a v as well
        assert all(set(s) == {"u", "v"} for s in comps[0].slots)


def test_checkpoints_are_per_position_and_restore_under_another_schedule(tmp_path):
    spec = "topk:ratio=0.1"
    comps = _comps(spec, "layerwise")
    _run(comps, range(2), False)
    path = tf.train.Checkpoint(compression=comps[0]).save(str(tmp_path / "ckpt"))
    merged = hvc.GradientCompression(spec, transport=_NoTransport(), schedule="single")
    status = tf.train.Checkpoint(compression=merged).restore(path)
    _run([merged, hvc.GradientCompression(spec, transport=_NoTransport(), schedule="single")], [2], False)
    status.assert_existing_objects_matched()
    assert int(merged.step.numpy()) == 3
    assert [sorted(s) for s in merged.slots] == [["residual"]] * len(SHAPES)


def test_none_gradients_are_skipped_and_dtypes_split_a_group():
    shapes, dtypes = [(4, 3), (3,), (3, 2)], [np.float32, np.float64, np.float32]
    comps = _comps("none", "single")
    fn = _step_fn(comps, graph=True)
    got = fn([[g if i != 1 else None for i, g in enumerate(_grads(r, 0, shapes, dtypes))] for r in range(WORLD)])
    assert got[0][1] is None and comps[0].groups == [[2, 0]]
    got = fn([_grads(r, 0, shapes, dtypes) for r in range(WORLD)])
    assert comps[0].groups == [[2], [1], [0]]  # float32, float64, float32: three runs
    want = [(_grads(0, 0, shapes, dtypes)[i] + _grads(1, 0, shapes, dtypes)[i]) / 2 for i in range(3)]
    for w, g in zip(want, got[1]):
        np.testing.assert_array_equal(w.numpy(), g.numpy())


def _link(**kw):
    return CostModel.from_link(WORLD, gbit_per_s=10.0, latency_s=5e-3, **kw)


def test_cost_model_schedules_plan_with_zero_backward_times_and_merge_under_high_latency():
    comps = _comps("none", "mgwfbp", cost_model=_link())
    layerwise = _run(_comps("none"), [0], False)
    _assert_same(layerwise, _run(comps, [0], False))
    assert comps[0].groups == [[3, 2, 1, 0]]  # 5 ms per start-up: one exchange is fastest
    plan = comps[0].plan
    assert plan.schedule == "mgwfbp" and plan.predicted_seconds > 0
    fit = {"topk:ratio=0.1": ComputeFit("linear", 1e-9, 1e-5)}
    topk = _comps("topk:ratio=0.1", "mgs:greedy", cost_model=_link(compress=fit))
    _run(topk, [0], True)
    assert sorted(p for g in topk[0].groups for p in g) == [0, 1, 2, 3]


def test_a_cached_cost_model_is_found_and_a_missing_one_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDCOMPRESS_CACHE", str(tmp_path))
    comp = hvc.GradientCompression("none", transport=_NoTransport(), schedule="auto")
    with pytest.raises(ValueError, match=r"(?s)cost_model: the schedule needs a cost model.*"
                                         r"CostModel.from_link.*hvdcompress.bench.profile transport"):
        comp.prepare(WORLD)
    with pytest.raises(ValueError, match="cost_model: the schedule needs a cost model"):  # at the first exchange
        comp.start_exchange(_grads(0, 0), world_size=WORLD, scale=0.5)
    model = _link()
    dataclasses.replace(model, hosts=(socket.gethostname(),)).save()
    assert comp.prepare(WORLD).world_size == WORLD
    assert comp.cost_model.allreduce == model.allreduce


@pytest.mark.parametrize("bad", ["bogus", "size:-1", "mgs:fast", "size", 5, [[0], [0]], [[]], [[-1]],
                                 [["a"]], [[1.5]], [[True]]])
def test_bad_schedules_raise_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"^schedule: "):
        hvc.GradientCompression("none", schedule=bad)


def test_schedule_errors_found_before_any_collective():
    with pytest.raises(ValueError, match="needs the compression time"):  # mgs needs a compression fit
        hvc.GradientCompression("topk:ratio=0.1", schedule="mgs", cost_model=_link())
    with pytest.raises(ValueError, match="cost_model: expected an hvdcompress.schedule.costmodel.CostModel"):
        hvc.GradientCompression("none", schedule="mgs", cost_model="fast")
    comp = hvc.GradientCompression("none", transport=_NoTransport(), schedule=[[0, 7]])
    with pytest.raises(ValueError, match="gradient position 7, but the exchange got 4 gradients"):
        comp.start_exchange(_grads(0, 0), world_size=WORLD, scale=0.5)


def test_wrappers_check_schedule_arguments_before_horovod_is_needed():
    sgd = tf.keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="^schedule: unknown schedule 'fastest'"):
        hvc.DistributedOptimizer(sgd, compression="none", schedule="fastest")
    with pytest.raises(ValueError, match="explicit grouping is not supported.*schedule="):
        hvc.DistributedOptimizer(sgd, num_groups=2)
    comp = hvc.GradientCompression("topk:ratio=0.1", schedule="single")
    with pytest.raises(ValueError, match="schedule: the GradientCompression given as compression= has schedule"):
        hvc.DistributedGradientTape(tf.GradientTape(), compression=comp, schedule="size:4")
    with pytest.raises(ValueError, match=r"GradientCompression\('topk:ratio=0.1,residual=true', schedule='single'\)"):
        hvc.DistributedGradientTape(tf.GradientTape(), compression="topk:ratio=0.1", schedule="single")
