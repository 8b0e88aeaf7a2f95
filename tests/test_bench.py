"""The benchmark harness (``hvdcompress bench``): figures, outputs, refusal, and two real runs --
loopback (always) and network namespaces (as root with iproute2; skipped otherwise), each checked
for a complete JSON and, for namespaces, for nothing left behind."""

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from hvdcompress.bench import cli, netns
from hvdcompress.bench.figures import DEFINITIONS, add_relative, summarize, wire_factor
from hvdcompress.bench.report import markdown_table, write_chart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RESULT_FIELDS = {"compression", "bandwidth", "workers", "status", "steps", "step_time_s", "step_time_min_s",
                 "step_time_max_s", "step_times_s", "samples_per_s", "bytes_per_step", "dense_bytes_per_step",
                 "compression_ratio", "compute_seconds_per_step", "wire_tx_bytes_per_step",
                 "wire_rx_bytes_per_step", "expected_wire_tx_bytes_per_step", "wire_over_expected",
                 "x_compute_only", "speedup_vs_dense", "latency_ms_injected", "schedule", "plan", "timings",
                 "predicted_step_time_s", "prediction_error", "after_forward_s", "predicted_after_forward_s",
                 "after_forward_prediction_error", "back_to_back_step_time_s", "back_to_back_prediction_error",
                 "memory_pass_s", "wire_time_s", "limit_s", "x_of_limit", "advise_predicted_s",
                 "advise_prediction_error"}
COMPUTE_ONLY_FIELDS = {"compression", "workers", "steps", "step_time_s", "step_times_s", "samples_per_s",
                       "wire_tx_bytes_per_step", "wire_tx_bytes_per_s_idle", "bandwidth"}
META_FIELDS = {"command", "mode", "network", "model", "parameters", "parameter_tensors", "batch", "steps",
               "warmup", "threads_per_worker", "latency_ms_injected", "latency_note", "compression",
               "bandwidths", "workers", "versions", "epoch", "phase_budget_s", "load_average_1_5_15_at_start",
               "load_average_1_5_15_at_end"}


# -- pieces, no processes ---------------------------------------------------------------------------
def test_bandwidths_parse_and_print():
    assert netns.parse_bandwidth("100mbit") == 10**8
    assert netns.parse_bandwidth("1.5Gbit") == 1_500_000_000
    assert netns.parse_bandwidth("unlimited") is None
    assert netns.format_bandwidth(10**10) == "10 Gbit/s"
    assert netns.format_bandwidth(None) == "unlimited"
    for bad in ("100", "fast", "0mbit", "10kbit"):
        with pytest.raises(ValueError, match="bandwidth"):
            netns.parse_bandwidth(bad)


def _fake_rank(rank, compute, dense_time, wire=True):
    def phase(name, times, payload=None):
        p = {"compression": name, "step_times_s": times}
        if payload is not None:
            p.update(bytes_per_step=payload, dense_bytes_per_step=4000.0, compute_seconds_per_step=0.01)
        if wire:
            p.update(iface_tx_bytes=3 * (payload or 10) * 1.5, iface_rx_bytes=3 * (payload or 10) * 1.5)
        return p
    return {"rank": rank, "memory_pass_s": 0.01 * (rank + 1), "phases": [phase("compute-only", [compute] * 3),
                                     phase("none", [dense_time, dense_time + rank, dense_time], 4000.0),
                                     phase("topk:ratio=0.01", [compute * 1.1] * 3, 80.0)]}


def test_figures_from_worker_results():
    ranks = [_fake_rank(r, 0.5, 2.0) for r in range(4)]
    s = summarize(ranks, batch=8)
    assert s["compute_only"]["step_time_s"] == 0.5
    none, topk = s["phases"]
    assert none["step_times_s"] == [2.0, 5.0, 2.0]  # slowest rank per step
    assert none["step_time_s"] == 2.0 and none["samples_per_s"] == 16.0
    assert none["expected_wire_tx_bytes_per_step"] == 4000.0 * wire_factor("none", 4) == 6000.0
    assert none["wire_over_expected"] == pytest.approx(1.0)
    assert topk["compression_ratio"] == 50.0 and wire_factor("topk:ratio=0.01", 4) == 3.0
    results = [dict(f, workers=4, bandwidth="100mbit", status="ok") for f in s["phases"]]
    add_relative(results, [dict(s["compute_only"], workers=4, bandwidth="100mbit")])
    assert results[1]["x_compute_only"] == pytest.approx(1.1)
    assert results[1]["speedup_vs_dense"] == pytest.approx(2.0 / 0.55)
    # x of limit: compute-only + the slowest rank's memory pass + max(tx, rx) bytes at 100 Mbit/s
    assert results[1]["memory_pass_s"] == 0.04
    assert results[1]["wire_time_s"] == pytest.approx(80.0 * 1.5 * 8 / 1e8)
    assert results[1]["x_of_limit"] == pytest.approx(0.55 / (0.5 + 0.04 + 80.0 * 1.5 * 8 / 1e8))
    assert set(DEFINITIONS) <= set(RESULT_FIELDS) | {"step_time_s"}


def test_schedule_plan_and_prediction_error_are_reported():
    ranks = [_fake_rank(r, 0.5, 2.0) for r in range(2)]
    for r in ranks:
        for p in r["phases"][1:]:
            p["schedule"] = "auto"
            p["forward_times_s"] = [0.25, 0.5, 0.25]
            p["plan"] = {"schedule": "mgs", "groups": 3, "tensors_per_group": [2, 1, 1],
                         "predicted_seconds": 2.2, "predicted_after_forward_seconds": 1.9}
            p["timings"] = {"backward_seconds": 0.1}
    none, _ = summarize(ranks, batch=8)["phases"]
    assert none["schedule"] == "auto" and none["plan"]["groups"] == 3
    assert none["prediction_error"] == pytest.approx(2.2 / 2.0 - 1)
    # per step, the slowest rank's step minus its forward: [1.75, 2.5 (rank 1: 3.0 - 0.5), 1.75]
    assert none["after_forward_s"] == pytest.approx(1.75)
    assert none["after_forward_prediction_error"] == pytest.approx(1.9 / 1.75 - 1)
    table = markdown_table({"meta": cli._new_report(cli._parse_args(["--loopback", "-n", "2"], None), [])["meta"],
                            "compute_only": [], "results": [dict(none, workers=2, bandwidth="unlimited", status="ok",
                                                                 x_compute_only=None, speedup_vs_dense=None)]})
    assert "auto→mgs (3)" in table and "2.2 (+10%)" in table


def test_advise_predictions_are_reported():
    """Rank 0's advise prediction per phase becomes the row's advise_predicted_s and its error;
    the table gains the column only when some row has one."""
    ranks = [_fake_rank(r, 0.5, 2.0, wire=False) for r in range(2)]
    for p, advised in zip(ranks[0]["phases"], (0.45, 2.4, None)):
        p["advise_predicted_s"] = advised
    s = summarize(ranks, batch=8)
    none, topk = s["phases"]
    assert s["compute_only"]["advise_predicted_s"] == 0.45
    assert s["compute_only"]["advise_prediction_error"] == pytest.approx(0.45 / 0.5 - 1)
    assert none["advise_prediction_error"] == pytest.approx(2.4 / 2.0 - 1)
    assert topk["advise_predicted_s"] is None and topk["advise_prediction_error"] is None
    report = cli._new_report(cli._parse_args(["--loopback", "-n", "2", "--advise"], None), [])
    report["meta"].update(parameters=1000, parameter_tensors=4)
    report["compute_only"] = [dict(s["compute_only"], workers=2, bandwidth="unlimited")]
    report["results"] = [dict(f, workers=2, bandwidth="unlimited", status="ok") for f in s["phases"]]
    report["results"].append({"compression": "fp16", "bandwidth": "unlimited", "workers": 2, "status": "failed: x"})
    add_relative(report["results"], report["compute_only"])
    table = markdown_table(report)
    assert "| advise predicted (s) (error) |" in table and "| 0.45 (-10%) |" in table and "| 2.4 (+20%) |" in table
    assert len({line.count("|") for line in table.splitlines() if line.startswith("|")}) == 1  # one width
    report["meta"]["advise"] = False
    for r in report["results"] + report["compute_only"]:
        r["advise_predicted_s"] = None
    assert "advise predicted" not in markdown_table(report)


def test_table_and_chart(tmp_path):
    ranks = [_fake_rank(r, 0.5, 2.0, wire=False) for r in range(2)]
    s = summarize(ranks, batch=8)
    report = cli._new_report(cli._parse_args(["--loopback", "-n", "2"], None), ["--loopback"])
    report["meta"].update(parameters=1000, parameter_tensors=4)
    report["compute_only"] = [dict(s["compute_only"], workers=2, bandwidth="unlimited")]
    report["results"] = [dict(f, workers=2, bandwidth="unlimited", status="ok", latency_ms_injected=0.0)
                         for f in s["phases"]]
    report["results"].append({"compression": "fp16", "bandwidth": "unlimited", "workers": 2,
                              "status": "failed: worker 1 exited with status 1"})
    add_relative(report["results"], report["compute_only"])
    table = markdown_table(report)
    assert "| 2 | unlimited | compute-only | – | 3 | 0.5 | – |" in table
    assert "`topk:ratio=0.01`" in table and "failed: worker 1" in table
    assert "torch threads per worker: 1" in table
    write_chart(report, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_refuses_without_root_and_offers_loopback(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["-n", "2", "-b", "100mbit", "--model", "deep"]) == 2
    err = capsys.readouterr().err
    assert "must run as root" in err
    assert "hvdcompress bench --loopback -n 2 --model deep" in err


def test_bad_arguments_are_refused(capsys):
    for argv, msg in ((["--loopback", "-b", "100mbit"], "--loopback has no rate limit"),
                      (["-c", "zip"], "unknown compressor 'zip'"),
                      (["-n", "1"], "worker count must be >= 2"),
                      (["-b", "fast"], "bandwidth"),
                      (["-s", "fastest"], "schedule: unknown schedule 'fastest'"),
                      (["--warmup", "3", "--profile-steps", "3"], "warmup: must exceed --profile-steps"),
                      (["--loopback", "--advise", "--latency-ms", "5"],
                       "advise: its link measurement does not see")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


def test_tf_framework_defaults_and_refusals(capsys):
    args = cli._parse_args(["--framework", "tf", "--loopback", "-n", "2"], None)
    assert args.schedule_list == ["layerwise"] and args.profile is False and args.tf_graph_optimizer == "on"
    meta = cli._new_report(args, [])["meta"]
    assert meta["framework"] == "tf" and meta["cost_model_profiled_per_launch"] is False
    assert cli._parse_args(["--loopback"], None).schedule_list == ["auto"]  # torch keeps its default
    tf = ["--framework", "tf", "--loopback"]
    for argv, msg in ((tf + ["--compute", "emulated:vgg16-v100"],
                       "compute: 'emulated:vgg16-v100' needs --framework torch"),
                      (tf + ["-s", "layerwise,mgs"], "schedules: 'mgs' needs a cost model"),
                      (tf + ["-s", "auto"], "schedules: 'auto' needs a cost model"),
                      (tf + ["-s", "single+choice"], "schedules: 'single+choice' needs a cost model"),
                      (tf + ["--latency-ms", "5"], "latency-ms: latency injection needs --framework torch"),
                      (tf + ["--trace-steps", "1"], "trace-steps: per-group tracing needs --framework torch"),
                      (tf + ["--advise"], "advise: advise's measurement (workload, link fit) needs --framework torch"),
                      (tf + ["--warmup", "0"], "warmup: --framework tf needs >= 1 warm-up step"),
                      (["--loopback", "--tf-graph-optimizer", "off"], "tf-graph-optimizer: applies to --framework tf"),
                      (["--framework", "jax"], "argument --framework: invalid choice: 'jax'")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


def test_replicas_that_differ_fail_the_worker():
    import numpy as np

    from hvdcompress.bench.worker_common import ReplicasDiffer, check_identical, digest

    class World:  # allgather_object over 2 ranks; rank 1's second digest is another one
        def __init__(self, differ):
            self.differ = differ

        def allgather_object(self, obj):
            other = list(obj)
            if self.differ:
                other[1] = digest([np.ones(3, np.float32)])
            return [obj, other]

    same = digest([np.zeros(3, np.float32)])
    check_identical(["a", "b @ single"], [same, same], World(differ=False))
    with pytest.raises(ReplicasDiffer, match=r"phase\(s\): b @ single;"):
        check_identical(["a", "b @ single"], [same, same], World(differ=True))


def test_ranks_meet_after_the_compute_only_step_and_only_there():
    """The workers time a round through worker_common.timed_round (tf_worker too; importing it
    here would load TensorFlow): the ranks meet right after the compute-only step (which exchanges
    nothing), before the next phase's timed step."""
    from hvdcompress.bench import torch_worker
    from hvdcompress.bench.worker_common import timed_round

    assert torch_worker.timed_round is timed_round
    events = []

    class Phase:
        def __init__(self, spec):
            self.spec = spec

        def timed_step(self):
            events.append(self.spec or "compute-only")

    timed_round([Phase(None), Phase("dgc"), Phase("topk")], lambda: events.append("meet"))
    assert events == ["compute-only", "meet", "dgc", "topk"]
    events.clear()
    timed_round([Phase("dgc"), Phase("topk")], lambda: events.append("meet"))
    assert events == ["dgc", "topk"]


def test_latency_transport_delays_completion(monkeypatch):
    from torch_ops.collectives import Communicator
    from hvdcompress.bench.injected_latency import LatencyTransport

    monkeypatch.setattr(Communicator, "launch", lambda self, reqs, name: ["handle"])
    monkeypatch.setattr(Communicator, "wait", lambda self, handles: ("result",))
    monkeypatch.setattr(Communicator, "poll", lambda self, handles: True)
    transport = LatencyTransport(0.2)
    start = time.perf_counter()
    handles = transport.launch([], "x")
    assert not transport.poll(handles)
    assert transport.wait(handles) == ("result",)
    assert time.perf_counter() - start >= 0.2
    assert transport.poll(handles)
    with pytest.raises(ValueError, match="latency_s"):
        LatencyTransport(-1.0)


# -- real runs ----------------------------------------------------------------------------------------
def _bench(tmp_path, *argv, timeout=150, model="deep"):
    """Run the harness as a subprocess with a marker in its environment (inherited by everything
    it starts), so the test can look for processes left behind."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, HVC_BENCH_TEST_MARKER=marker, TMPDIR=str(tmp_path))
    out = str(tmp_path / "bench")
    proc = subprocess.run([sys.executable, "-m", "hvdcompress.bench", *argv, "--out", out, "--model", model,
                           "--batch", "8", "--steps", "2", "--warmup", "3", "--profile-steps", "1",
                           "--profile-max-mib", "0.1", "--launch-timeout", "120"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out + ".json") as f:
        report = json.load(f)
    for ext in (".png", ".md"):
        assert os.path.getsize(out + ext) > 0
    assert "| compression |" in proc.stdout  # the markdown table is printed
    return report, marker, proc


def _processes_with(marker):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _check_complete(report, workers, specs, bandwidths):
    assert META_FIELDS <= set(report["meta"]), META_FIELDS - set(report["meta"])
    assert report["meta"]["threads_per_worker"] == 1
    assert [c["workers"] for c in report["compute_only"]] == [workers]
    assert COMPUTE_ONLY_FIELDS <= set(report["compute_only"][0])
    got = {(r["compression"], r["bandwidth"]) for r in report["results"]}
    assert got == {(s, b) for s in specs for b in bandwidths}
    for r in report["results"]:
        assert r["status"] == "ok"
        assert RESULT_FIELDS <= set(r), RESULT_FIELDS - set(r)
        assert r["workers"] == workers and len(r["step_times_s"]) == 2 and r["step_time_s"] > 0
        assert r["dense_bytes_per_step"] == 332490 * 4
        assert r["schedule"] == "auto" and r["plan"]["schedule"] in ("mgs", "mgwfbp")  # the default
        assert r["plan"]["predicted_seconds"] > 0 and len(r["plan"]["profiled"]["t_b"]) == 100
        assert r["timings"]["backward_seconds"] >= 0
        assert r["back_to_back_step_time_s"] > 0  # warm-up step 2 ran with the plan
    by = {r["compression"]: r for r in report["results"]}
    assert by["none"]["bytes_per_step"] == by["none"]["dense_bytes_per_step"]
    assert by["none"]["speedup_vs_dense"] == 1.0
    return by


@pytest.mark.multiprocess
@pytest.mark.extended  # every field is checked by the namespace run below; the advise and TF runs cover loopback
def test_loopback_run_has_every_field(tmp_path):
    specs = ["none", "topk:ratio=0.01"]
    report, marker, _ = _bench(tmp_path, "--loopback", "-n", "2", "--phase-budget-s", "600", "-c", *specs)
    by = _check_complete(report, 2, specs, ["unlimited"])
    assert by["topk:ratio=0.01"]["compression_ratio"] > 40
    assert by["none"]["wire_tx_bytes_per_step"] is None  # lo is shared: no per-worker counters
    assert not _processes_with(marker)


@pytest.mark.multiprocess
def test_tf_loopback_run(tmp_path):
    """--framework tf: the Keras mlp (the torch mlp's tensors, so the same bytes), one merged group,
    two specs and compute-only; every rank ends with the same parameters (the worker checks)."""
    specs = ["none", "topk:ratio=0.01"]
    report, marker, proc = _bench(tmp_path, "--framework", "tf", "--tf-graph-optimizer", "off", "--loopback",
                                  "-n", "2", "-s", "single", "-c", *specs, model="mlp")
    meta = report["meta"]
    assert META_FIELDS <= set(meta), META_FIELDS - set(meta)
    assert meta["framework"] == "tf" and meta["tf_graph_optimizer"] == "off" and meta["threads_per_worker"] == 1
    assert meta["parameters"] == 12598282 and meta["parameter_tensors"] == 8
    assert "tensorflow" in meta["versions"] and "bit-identical" in meta["parameter_check"]
    assert [c["workers"] for c in report["compute_only"]] == [2]
    assert COMPUTE_ONLY_FIELDS <= set(report["compute_only"][0])
    not_predicted = {"after_forward_s", "predicted_after_forward_s", "after_forward_prediction_error"}
    by = {r["compression"]: r for r in report["results"]}
    assert set(by) == set(specs)
    for r in by.values():
        assert r["status"] == "ok" and RESULT_FIELDS - not_predicted <= set(r), RESULT_FIELDS - set(r)
        assert r["workers"] == 2 and len(r["step_times_s"]) == 2 and r["step_time_s"] > 0
        assert r["dense_bytes_per_step"] == 12598282 * 4  # as --framework torch's mlp
        assert r["schedule"] == "single" and r["plan"]["groups"] == 1 and r["plan"]["predicted_seconds"] is None
        assert r["compute_seconds_per_step"] is None and r["x_compute_only"] > 0
    assert by["none"]["bytes_per_step"] == by["none"]["dense_bytes_per_step"]
    assert by["topk:ratio=0.01"]["compression_ratio"] > 40
    assert by["none"]["speedup_vs_dense"] == 1.0
    title = "TensorFlow/Keras: model `mlp` (13M parameters, 8 tensors)"
    assert title in proc.stdout and title in (tmp_path / "bench.md").read_text()
    assert "TensorFlow inter-op and intra-op threads per worker: 1 each" in proc.stdout
    assert not _processes_with(marker)


@pytest.mark.multiprocess
def test_loopback_run_with_advise_predicts_every_phase(tmp_path):
    """--advise: advise's measurement runs in the launch (the emulated model timed, the link fitted)
    and every row, compute-only included, carries its prediction."""
    report, marker, proc = _bench(tmp_path, "--loopback", "-n", "2", "--compute", "emulated:resnet50-v100",
                                  "--emulated-scale", "64", "--trace-steps", "0", "-c", "topk:ratio=0.01",
                                  "-s", "layerwise,auto+choice", "--advise")
    rows = report["results"] + report["compute_only"]
    assert len(rows) == 3 and report["meta"]["advise"] is True
    for r in rows:
        assert r["advise_predicted_s"] > 0 and abs(r["advise_prediction_error"]) < 10, r["compression"]
    [advice] = report["advise"]
    assert advice["bandwidth"] == "unlimited" and advice["link"]["world_size"] == 2
    assert len(advice["workload"]["names"]) == report["meta"]["parameter_tensors"] == 161
    assert {(p["compression"], p["schedule"]) for p in advice["predicted"]} == \
        {("topk:ratio=0.01", "layerwise"), ("topk:ratio=0.01", "auto+choice")}
    assert "advise predicted (s) (error)" in proc.stdout
    ref = advice["reference"]  # the workload calibrated to real training steps (slowest rank, hooks)
    assert ref["steps"] > 0 and ref["ranks"] == 2 and ref["compute_seconds"] > 0 and ref["hook_seconds"] >= 0
    assert advice["compute_seconds"] == ref["compute_seconds"]  # compute-only: the slowest rank's, no hooks
    calibrated = sum(advice["workload"]["t_b"]) + advice["workload"]["forward_seconds"]
    assert calibrated + advice["workload"]["update_seconds"] >= ref["compute_seconds"] * (1 - 1e-9)  # + the hooks
    assert len(advice["isolated_workload"]["t_b"]) == 161
    assert not _processes_with(marker)


@pytest.mark.multiprocess
@pytest.mark.extended  # advise on loopback is run by test_loopback_run_with_advise_predicts_every_phase
def test_loopback_run_with_advise_without_profile_fits_its_own_link(tmp_path):
    """--advise --no-profile: the launch fits no cost model for its phases, so advise fits the link
    itself (not cached) and still predicts every phase; the phases' plans carry no prediction."""
    report, marker, _ = _bench(tmp_path, "--loopback", "-n", "2", "--no-profile", "-c", "none", "-s", "single",
                               "--advise")
    [row] = report["results"]
    assert row["plan"]["predicted_seconds"] is None and not report.get("cost_models")
    [advice] = report["advise"]
    assert advice["link"]["world_size"] == 2 and advice["link"]["allreduce"]["samples"] >= 2
    assert {"fp16:residual=false", "none"} <= set(advice["link"]["compress"])  # completed with fp16 and dense fits
    for r in (row, *report["compute_only"]):
        assert r["advise_predicted_s"] > 0 and abs(r["advise_prediction_error"]) < 10
    assert not _processes_with(marker)


@pytest.mark.multiprocess
@pytest.mark.skipif(netns.missing_prerequisites() is not None,
                    reason=f"network namespaces unavailable: {netns.missing_prerequisites()}")
def test_namespace_run_counts_wire_bytes_and_leaves_nothing_behind(tmp_path):
    before = set(netns.list_namespaces())
    etc_before = set(os.listdir(netns.NETNS_ETC)) if os.path.isdir(netns.NETNS_ETC) else set()
    report, marker, proc = _bench(tmp_path, "-n", "2", "-b", "100mbit", "-c", "none")
    by = _check_complete(report, 2, ["none"], ["100mbit"])
    # the interface counters agree with the payload accounting: a 2-rank ring allreduce sends the
    # payload once, plus Ethernet/IP/TCP headers and Horovod's coordination traffic
    assert 0.9 < by["none"]["wire_over_expected"] < 2.0, by["none"]
    assert report["compute_only"][0]["wire_tx_bytes_per_s_idle"] >= 0
    assert "tbf rate 100 Mbit/s" in proc.stdout
    assert set(netns.list_namespaces()) == before
    etc_after = set(os.listdir(netns.NETNS_ETC)) if os.path.isdir(netns.NETNS_ETC) else set()
    assert etc_after == etc_before
    assert not _processes_with(marker)


@pytest.mark.skipif(netns.missing_prerequisites() is not None,
                    reason=f"network namespaces unavailable: {netns.missing_prerequisites()}")
def test_emulated_network_tears_down_after_a_failure_inside():
    with pytest.raises(RuntimeError, match="inside"):
        with netns.EmulatedNetwork(2, 10**8, tag="t") as net:
            assert set(net.namespaces) <= set(netns.list_namespaces())
            assert os.path.exists(os.path.join(netns.NETNS_ETC, net.namespaces[0], "hosts"))
            raise RuntimeError("inside")
    assert not set(net.namespaces + [net.bridge_namespace]) & set(netns.list_namespaces())
    assert not os.path.exists(os.path.join(netns.NETNS_ETC, net.namespaces[0]))


@pytest.mark.multiprocess
@pytest.mark.skipif(netns.missing_prerequisites() is not None,
                    reason=f"network namespaces unavailable: {netns.missing_prerequisites()}")
def test_sigterm_mid_run_stops_workers_and_removes_the_network(tmp_path):
    marker = uuid.uuid4().hex
    env = dict(os.environ, HVC_BENCH_TEST_MARKER=marker, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "hvdcompress.bench", "-n", "2", "-b", "10mbit", "-c", "none",
                             "--model", "deep", "--steps", "100000", "--out", str(tmp_path / "bench")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_processes_with(marker)) < 4 and time.monotonic() < deadline:  # harness, rdv, 2 workers
            time.sleep(0.2)
        assert netns.leftovers(proc.pid), "the harness built no namespaces"
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted (received SIGTERM)" in out
    assert not netns.leftovers(proc.pid)
    etc = os.listdir(netns.NETNS_ETC) if os.path.isdir(netns.NETNS_ETC) else []
    assert not [d for d in etc if d.startswith(f"{netns.PREFIX}{proc.pid}-")]
    assert not _processes_with(marker)
