"""``hvdcompress advise``: the workload it reads, its predictions, crossovers and outputs
(single process; compression timed on tiny sizes, the link emulated)."""

import json

import numpy as np
import pytest

from hvdcompress import cli
from hvdcompress.bench import advise
from hvdcompress.schedule.costmodel import ComputeFit
from scenarios.kit import load_benchmark

PROFILE = {"name": "tiny", "batch": 8, "layers": [
    {"name": "conv1", "params": {"weight": [64, 3, 3, 3]}, "forward_s": 0.010, "backward_s": 0.020},
    {"name": "relu", "params": {}, "forward_s": 0.001, "backward_s": 0.002},
    {"name": "fc1", "params": {"weight": [512, 1024], "bias": [512]}, "forward_s": 0.008, "backward_s": 0.016},
    {"name": "fc2", "params": {"weight": [10, 512], "bias": [10]}, "forward_s": 0.001, "backward_s": 0.002}]}
FITS = {"topk:ratio=0.01": ComputeFit("dlogd", 5e-9, 5e-5), "fp16": ComputeFit("linear", 1e-10, 1e-5)}


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(PROFILE))
    return str(path)


def test_profile_becomes_a_workload_in_backward_order(profile_file):
    w = advise.workload_from_profile(profile_file)
    assert w.names == ("fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias", "conv1.weight")
    assert w.sizes_bytes == (4.0 * 5120, 40.0, 4.0 * 512 * 1024, 4.0 * 512, 4.0 * 64 * 27)
    # a layer's backward precedes its first gradient; a layer without parameters, the next layer's
    assert w.t_b == pytest.approx((0.002, 0.0, 0.016, 0.0, 0.002 + 0.020))
    assert w.forward_seconds == pytest.approx(0.020)
    assert advise.workload_from_profile(profile_file, scale=4).sizes_bytes[2] == pytest.approx(4.0 * 128 * 1024)


def test_compression_pays_on_slow_links_only_and_auto_is_never_slower(profile_file):
    w = advise.workload_from_profile(profile_file)
    slow, fast = (advise.link_model(4, g, 50e-6, FITS) for g in (0.01, 100.0))
    rows_slow = [advise.predict(w, slow, s) for s in ("none", "fp16", "topk:ratio=0.01")]
    rows_fast = [advise.predict(w, fast, s) for s in ("none", "fp16", "topk:ratio=0.01")]
    assert advise.recommend(rows_slow)["label"] == "topk:ratio=0.01"
    assert advise.recommend(rows_fast)["label"] in ("none", "fp16")
    assert rows_slow[2]["bytes_per_step"] < rows_slow[1]["bytes_per_step"] == rows_slow[0]["bytes_per_step"] / 2
    for model, rows in ((slow, rows_slow), (fast, rows_fast)):
        auto = advise.predict(w, model, "topk:ratio=0.01", advise.ALTERNATIVES)
        assert auto["step_seconds"] <= min(r["step_seconds"] for r in rows) * (1 + 1e-9)
        assert len(advise.decisions(auto, w)) == len(auto["plan_groups"])
    cross = advise.crossovers(w, FITS, 4, 50e-6, "topk:ratio=0.01")
    assert cross and cross[0]["below"].startswith("topk") and 0.01 < cross[0]["gbps"] < 100
    for c in cross:  # the best fixed choice really changes there
        lo, hi = (advise.link_model(4, c["gbps"] * f, 50e-6, FITS) for f in (0.9, 1.1))
        best = [min(("topk:ratio=0.01", "fp16", "none"), key=lambda s: advise.predict(w, m, s)["step_seconds"])
                for m in (lo, hi)]
        assert best[0] != best[1] or c["below"] == c["above"]


def test_command_prints_writes_json_and_a_plot(profile_file, tmp_path, capsys):
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    assert cli.main(["advise", "--profile", profile_file, "--gbps", "0.1", "--quick", "--spec", "none",
                     "--spec", "fp16", "--spec", "topk:ratio=0.01", "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "PREDICTIONS" in text and "recommendation:" in text and 'codec_choice="auto" with topk' in text
    result = json.loads(out.read_text())
    assert [r["label"] for r in result["rows"]] == ["none", "fp16", "topk:ratio=0.01"]
    assert result["auto"]["decisions"] and png.stat().st_size > 0
    assert np.isfinite(result["compute_seconds"]) and "crossovers" in result
    with pytest.raises(SystemExit):
        advise.main(["--profile", profile_file, "--workers", "1"])
    with pytest.raises(SystemExit):
        advise.main(["--profile", profile_file, "--spec", "topk:ratio=2"])


def test_acceptance_table_from_bench_json(tmp_path):
    mod = load_benchmark("codec_choice.py")
    assert any("auto+tune+choice" in c for c in mod.commands())
    # dense wins on fast links, dgc on slow ones; the choice is never worse and wins at the crossover
    times = {"10mbit": (1.0, 5.0, 9.0, 0.8), "100mbit": (0.5, 0.6, 1.2, 0.45), "1gbit": (0.4, 0.3, 0.25, 0.25),
             "10gbit": (0.4, 0.25, 0.2, 0.2), "unlimited": (0.4, 0.22, 0.2, 0.2)}
    results, dense = [], []
    off = {"10gbit": 1.3}  # advise's in-launch prediction: 10% above the measured step, 30% on one link

    def row(c, sched, link, t):
        return {"compression": c, "schedule": sched, "bandwidth": link, "status": "ok", "step_time_s": t,
                "advise_predicted_s": t * off.get(link, 1.1)}
    for link, (dgc, fp16, none, choice) in times.items():
        results += [row("dgc:ratio=0.001", "auto+tune", link, dgc),
                    row("dgc:ratio=0.001", "auto+tune+choice", link, choice)]
        dense += [row(c, "auto", link, t) for c, t in (("fp16", fp16), ("none", none))]
    files = []
    for name, rows in (("a", results), ("b", dense)):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"meta": {"model": "mlp"}, "results": rows}))
        files.append(str(f))
    out = mod.table(files, str(tmp_path / "t"))
    assert len(out["cells"]) == 5 and out["all_within_5pct"]
    assert out["crossovers_measured"] == [{"model": "mlp", "spec": "dgc:ratio=0.001", "between": ["100mbit", "1gbit"],
                                           "below": "dgc:ratio=0.001", "above": "none"}]
    assert not out["crossover_cells_beat_by_10pct"]  # at 1gbit the choice only ties dense
    md = (tmp_path / "t.md").read_text()
    assert md.count("| mlp |") == 5
    # advise's in-launch predictions: per cell each fixed choice's and the choice's error, the verdict
    cell = out["cells"][0]
    for name in ("dgc:ratio=0.001", "fp16", "none", "choice"):
        assert cell[f"{name}_prediction_error"] == pytest.approx(0.1)
    assert out["advise_within_15pct"] is False and out["advise_worst_error"] == pytest.approx(0.3)
    assert out["crossovers_predicted"] == [dict(out["crossovers_measured"][0])]  # the predictions keep the order
    assert "all within 15%: NO" in md and "- predicted mlp dgc:ratio=0.001: between 100mbit and 1gbit" in md
    for r in results + dense:  # files without --advise: no verdict, no predicted crossover
        r.pop("advise_predicted_s")
    for name, rows in (("a", results), ("b", dense)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": {"model": "mlp"}, "results": rows}))
    out = mod.table(files, str(tmp_path / "t"))
    assert out["advise_within_15pct"] is None and out["crossovers_predicted"] == []
    assert "run the bench with --advise" in (tmp_path / "t.md").read_text()


def test_emulated_model_is_timed_like_any_model(profile_file):
    """``emulated:<profile>`` is built and run as the bench runs it: the workload holds its real
    tensors (scaled) and its measured times, at least the profile's nominal ones."""
    nominal = advise.workload_from_profile(profile_file, scale=4)
    w = advise.workload_from_model("emulated:" + profile_file, scale=4)
    assert [n.split(".", 1)[1] for n in w.names] == list(nominal.names)  # "layers.<layer>.<param>"
    assert w.sizes_bytes == nominal.sizes_bytes
    assert w.compute_seconds >= 0.9 * nominal.compute_seconds and w.forward_seconds > 0
    assert advise.default_input_shape("emulated:" + profile_file) == (8, 3, 32, 32)  # the profile's batch
    assert advise.default_input_shape("mlp") == (32, 3, 32, 32)
    with pytest.raises(ValueError, match="emulated scale"):
        advise.workload_from_model("mlp", scale=2)


def test_link_pieces_and_schedules(profile_file):
    w = advise.workload_from_profile(profile_file)
    ring = advise.link_model(4, 1.0, 50e-6, {"fp16": FITS["fp16"]})
    model = advise.with_compression_fits(ring, FITS)
    assert set(model.compress) == {str(advise.resolve(s)) for s in FITS}
    assert model.compress[str(advise.resolve("topk:ratio=0.01"))] == FITS["topk:ratio=0.01"]
    assert model.allreduce == ring.allreduce and model.world_size == 4
    every = advise.every_spec(["topk:ratio=0.01", "none"], "dgc:ratio=0.001")  # each once, candidates first
    assert [s.name for s in every] == ["topk", "none", "fp16", "dgc"]
    # a spec that cannot merge runs layerwise under "auto"; another schedule is taken as asked
    assert advise.schedule_for("powersgd:rank=4") == "layerwise" and advise.schedule_for("topk:ratio=0.01") == "auto"
    assert advise.schedule_for("topk:ratio=0.01", "size:1") == "size:1"
    assert advise.schedule_for("powersgd:rank=4", choosing=True) == "auto"  # fp16 / dense groups merge
    with pytest.raises(ValueError, match="cannot be merged"):
        advise.schedule_for("powersgd:rank=4", "mgs")
    single = advise.predict(w, model, "topk:ratio=0.01", schedule="single")
    assert single["groups"] == 1 and single["schedule"] == "single"
    assert advise.predict(w, model, "topk:ratio=0.01", schedule="layerwise")["groups"] == len(w.names)
    chosen = advise.predict(w, model, "topk:ratio=0.01", advise.ALTERNATIVES, schedule="layerwise")
    assert len(chosen["codecs"]) == len(w.names)


def test_model_arguments_are_checked(capsys):
    for argv, msg in ((["--model", "mlp", "--emulated-scale", "4"], "--emulated-scale: applies to --profile"),
                      (["--model", "emulated:nope"], "unknown profile 'nope'"),
                      (["--model", "emulated:resnet50-v100", "--emulated-scale", "0.5"], "--emulated-scale >= 1")):
        with pytest.raises(SystemExit) as e:
            advise.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv


def test_replay_recomputes_advise_from_the_saved_launch(tmp_path):
    from hvdcompress.schedule.costmodel import CostModel, LinearFit
    from hvdcompress.schedule.planner import Workload
    mod = load_benchmark("advise_replay.py")
    workload = Workload(("a", "b", "c"), (4e5, 4e5, 4e5), (0.01, 0.01, 0.01), 0.02, 0.001)
    samples = [[4096, 0.005], [65536, 0.006], [1048576, 0.015], [4194304, 0.045]]
    link = CostModel(2, LinearFit(5e-3, 1e-8), LinearFit(3e-3, 1e-8),
                     meta={"samples": {"allreduce": samples, "allgather": samples}})
    launch = {"bandwidth": "1gbit", "workload": workload.to_dict(), "link": link.to_dict()}
    rows = [{"compression": "none", "schedule": "auto", "bandwidth": "1gbit", "status": "ok", "step_time_s": 0.1},
            {"compression": "fp16", "schedule": "auto", "bandwidth": "1gbit", "status": "ok", "step_time_s": 0.1}]
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"meta": {"model": "m"}, "results": rows, "advise": [launch]}))
    plain = mod.replay_rows(str(f))
    want = advise.predict(workload, link, "none")["step_seconds"]
    assert plain[0]["predicted_s"] == pytest.approx(want) and plain[0]["error"] == pytest.approx(want / 0.1 - 1)
    slow_sums = mod.replay_rows(str(f), mod.link_patch(["half_sum_ns=1000"]))  # fp16 slower, dense unchanged
    assert slow_sums[1]["predicted_s"] > plain[1]["predicted_s"]
    assert slow_sums[0]["predicted_s"] == pytest.approx(plain[0]["predicted_s"])
    assert mod.replay_rows(str(f), mod.link_patch(["refit=1"]))[0]["predicted_s"] > 0
    with pytest.raises(ValueError, match="no step_start_ups"):
        mod.replay_rows(str(f), mod.link_patch(["start_ups=1"]))
    step = mod.replay_rows(str(f), mod.link_patch(["alone_alpha_ms=50", "queued_alpha_ms=50"]))
    assert step[0]["predicted_s"] > plain[0]["predicted_s"]
    with pytest.raises(ValueError, match="unknown setting"):
        mod.link_patch(["nope=1"])
    f.write_text(json.dumps({"meta": {}, "results": rows}))
    with pytest.raises(ValueError, match="no advise measurements"):
        mod.replay_rows(str(f))
    assert mod.main([str(tmp_path / "missing.json")]) == 2


def test_two_link_classes_add_per_hop_columns_and_route_choices(profile_file, tmp_path, capsys):
    """``--nodes --gpus-per-node --intra-gbps --inter-gbps``: the flat table as with ``--workers N*L
    --gbps inter``, then per spec the best two-level route, its hops and the bytes a node sends
    across, and the route per group the planner would choose."""
    from hvdcompress.schedule.twolevel import TwoLevelCostModel
    common = ["--profile", profile_file, "--quick", "--spec", "none", "--spec", "topk:ratio=0.01"]
    out = tmp_path / "two.json"
    assert advise.main(common + ["--nodes", "4", "--gpus-per-node", "4", "--intra-gbps", "400", "--inter-gbps", "0.1",
                                 "--gtopk", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "two levels: 4 nodes x 4 ranks" in text and "best two-level route" in text and "two-level choice" in text
    result = json.loads(out.read_text())
    two = result["two_level"]
    assert two["topology"] == "4x4" and [r["label"] for r in two["rows"]] == ["none", "topk:ratio=0.01"]
    flat = {r["label"]: r["step_seconds"] for r in result["rows"]}
    for r in two["rows"]:
        assert r["flat_step_seconds"] == flat[r["label"]]  # the flat table is today's prediction at 16 workers
    topk = two["rows"][1]
    assert topk["route"].startswith("two-level topk") and topk["step_seconds"] < topk["flat_step_seconds"]
    assert topk["inter_bytes_per_node"] < topk["flat_inter_bytes_per_node"] / 2
    assert two["rows"][0]["route"].startswith("hierarchical dense")
    choice = two["choice"]
    assert sum(choice["counts"].values()) == len(choice["decisions"]) and choice["step_seconds"] > 0
    # the same flat table as --workers 16 --gbps 0.1 (fits timed anew: compare the dense row, no codec)
    assert advise.main(common + ["--workers", "16", "--gbps", "0.1", "--json", str(tmp_path / "flat.json")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "flat.json").read_text())["rows"][0]["step_seconds"] == flat["none"]
    model = TwoLevelCostModel.from_links(4, 4, 400.0, 0.1, compress=FITS)
    w = advise.workload_from_profile(profile_file)
    row = advise.two_level_row(w, model, "topk:ratio=0.01", gtopk=True)
    assert row["step_seconds"] <= advise.predict(w, model.flat, "topk:ratio=0.01")["step_seconds"]
    for argv, msg in ((["--nodes", "4"], "go together"),
                      (["--nodes", "4", "--gpus-per-node", "4", "--intra-gbps", "400", "--workers", "8"],
                       "--workers 8 is not --nodes x --gpus-per-node = 16"),
                      (["--nodes", "4", "--gpus-per-node", "4", "--intra-gbps", "0"], "--intra-gbps > 0"),
                      (["--nodes", "4", "--gpus-per-node", "4", "--intra-gbps", "400", "--measure-link"],
                       "--measure-link measures one link")):
        with pytest.raises(SystemExit) as e:
            advise.main(common + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv
