"""benchmarks/two_level_evidence.py (issue 43's evidence on an emulated two-level network) and the
launcher it shares with the other torch.distributed benches (``hvdcompress.bench.dist_launch``):
the rows, ratios and table from given figures, the launcher's environment and failure handling on
loopback, and the quick mode end to end on network namespaces (as root with iproute2; skipped
otherwise)."""

import json
import os
import subprocess
import sys
import time

import pytest

from hvdcompress.bench import netns
from hvdcompress.bench.dist_launch import RankFailure, run_ranks
from scenarios.kit import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "two_level_evidence.py")


def _bench():
    return load_benchmark("two_level_evidence.py")


def test_rows_name_every_configuration_once():
    bench = _bench()
    rows = bench.rows_for(["dgc:ratio=0.001", "qsgd"], "dgc:ratio=0.001", "2x2")
    assert [(r["layout"], r["spec"], r["topology"], r["codec_choice"]) for r in rows] == [
        ("flat dense", "none", "flat", "off"), ("hierarchical dense", "none", "2x2", "off"),
        ("flat spec", "dgc:ratio=0.001", "flat", "off"), ("two-level spec", "dgc:ratio=0.001", "2x2", "off"),
        ("flat spec", "qsgd", "flat", "off"), ("two-level spec", "qsgd", "2x2", "off"),
        ("choice", "dgc:ratio=0.001", None, None)]  # the default: the launcher's topology, the choice on
    from hvdcompress.schedule.scaling import LAYOUT_ROUTES
    assert {r["layout"] for r in rows} - {"choice"} <= set(LAYOUT_ROUTES)  # what compare_two_level takes


def test_the_ddp_front_adds_its_own_default_row():
    bench = _bench()
    rows = bench.rows_for(["qsgd"], "qsgd", "2x2", fronts=("ddp", "optimizer"))
    assert [(r["layout"], r["spec"], r["topology"]) for r in rows[-2:]] == [
        ("choice", "qsgd", None), ("choice (ddp)", "qsgd", None)]  # the launcher's topology: buckets choose
    assert [r["layout"] for r in bench.rows_for(["qsgd"], "qsgd", "2x2", fronts=("ddp",))][-1] == "choice (ddp)"
    assert bench.is_choice(rows[-1]) and bench.is_choice(rows[-2]) and not bench.is_choice(rows[0])
    with pytest.raises(SystemExit):
        bench.main(["--front", "horovod"])


def _row(layout, spec, seconds, accuracy, predicted=None, contended=None):
    return {"link": "100mbit (tbf, emulated)", "layout": layout, "spec": spec, "median_step_s": seconds,
            "held_out_accuracy": accuracy, "predicted": {"step_seconds": predicted, "inter_bytes_per_node": 1e6}
            if predicted else None, "predicted_contended": {"step_seconds": contended} if contended else None,
            "cpu_seconds_per_step": 0.05 if contended else None, "link_bytes_per_step": 2e6, "payload_bytes_per_rank": 4e6,
            "hop_bytes_per_rank": {"local": 8e6, "cross": 1e5} if layout != "flat spec" else None,
            "identical": True, "settled_before_measure": True, "plan": {"kept": None}}


def test_ratios_and_table_compare_like_with_like():
    bench = _bench()
    rows = [_row("flat dense", "none", 1.0, 0.95, 0.8), _row("hierarchical dense", "none", 0.8, 0.95),
            _row("flat spec", "dgc", 0.3, 0.90), _row("two-level spec", "dgc", 0.1, 0.93, 0.05, 0.11),
            _row("choice", "dgc", 0.104, 0.93)]
    (summary,) = bench.add_ratios(rows)
    assert rows[1]["speedup_vs_flat"] == pytest.approx(1.25) and rows[3]["speedup_vs_flat"] == pytest.approx(3.0)
    assert rows[3]["accuracy_vs_flat"] == pytest.approx(0.03)
    assert rows[3]["measured_over_predicted"] == pytest.approx(2.0) and rows[2]["measured_over_predicted"] is None
    assert rows[3]["measured_over_contended"] == pytest.approx(0.1 / 0.11) and rows[0]["measured_over_contended"] is None
    assert summary["best_flat"] == "flat spec dgc" and summary["best_fixed"] == "two-level spec dgc"
    assert summary["choice_over_best_flat"] == pytest.approx(0.104 / 0.3) and summary["choice_within_target"]
    assert summary["choice_over_best_fixed"] == pytest.approx(1.04)
    table = bench.markdown({"workers": 4, "topology": "2x2", "steps": 10, "measure": 4, "rows": rows,
                            "summary": [summary], "model": {"parameters": 1000, "gradient_bytes": 4000}})
    assert "EMULATED" in table and table.count("(tbf, emulated)") == len(rows) + 1
    assert "| 3.00x |" in table and "+3.00 pt" in table and "within the 1.05x target" in table
    assert "| 50.0 | 2.00 | 110.0 | 0.91 | 50.0 |" in table  # predicted, ratio, contended, ratio, CPU ms
    ddp = _row("choice (ddp)", "dgc", 0.12, 0.92)
    ddp["plan"] = {"kept": "all flat", "routes": {"a": "flat dgc", "b": "flat dgc"}}
    (summary,) = bench.add_ratios(rows + [ddp])
    assert summary["best_fixed"] == "two-level spec dgc"  # a default row is no fixed configuration
    assert summary["ddp_choice_over_best_flat"] == pytest.approx(0.4) and summary["ddp_choice_settled"]
    table = bench.markdown({"workers": 4, "topology": "2x2", "steps": 10, "measure": 4, "rows": rows + [ddp],
                            "summary": [summary], "model": {"parameters": 1000, "gradient_bytes": 4000}})
    assert "`dgc (all flat); 2x flat dgc`" in table and "the DDP hook's default takes 0.400x" in table


def test_recheck_puts_a_stored_run_through_the_contention_term(tmp_path):
    bench = _bench()
    link = "100mbit (tbf, emulated)"
    old = {"rows": [_row("flat dense", "none", 1.0, 0.95, 0.8), _row("two-level spec", "dgc", 0.1, 0.93, 0.05),
                    _row("choice", "dgc:ratio=0.001", 0.06, 0.93, 0.05), _row("flat spec", "qsgd", 0.3, 0.9, 0.2)]}
    old["rows"][2]["plan"] = {"kept": "all flat", "routes": {"g0": "flat dgc:ratio=0.001"}}
    cpu = {"compute": {link: {"ranks": 4, "cores": 2, "cpu_seconds": 0.01}},
           "rows": [dict(_row("flat dense", "none", 1.1, 0.95), cpu_seconds_per_step=0.3),
                    dict(_row("two-level spec", "dgc", 0.1, 0.93), cpu_seconds_per_step=0.04),
                    dict(_row("flat spec", "dgc:ratio=0.001", 0.05, 0.9), cpu_seconds_per_step=0.02),
                    dict(_row("choice", "qsgd", 0.3, 0.9), cpu_seconds_per_step=0.5)]}
    rows = bench.recheck(old, cpu)
    by = {(r["layout"], r["spec"]): r for r in rows}
    assert by[("flat dense", "none")]["contended_s"] == pytest.approx(0.8)  # the wire dominates: unchanged
    assert by[("two-level spec", "dgc")]["contended_s"] == pytest.approx(0.08)  # 2 x 40 ms of CPU
    assert by[("two-level spec", "dgc")]["measured_over_contended"] == pytest.approx(1.25)
    choice = by[("choice", "dgc:ratio=0.001")]  # its kept plan is the flat dgc row's: that row's CPU
    assert choice["cpu_seconds_per_step"] == 0.02 and "flat spec dgc:ratio=0.001" in choice["cpu_of"]
    assert choice["contended_s"] == pytest.approx(0.05)
    assert by[("flat spec", "qsgd")]["contended_s"] is None and by[("flat spec", "qsgd")]["cpu_of"] is None
    table = bench.recheck_markdown(rows, "note")
    assert "measured/contended 1.20-1.25 over 3 rows; 0 within 15%" in table
    old_path, cpu_path = tmp_path / "old.json", tmp_path / "cpu.json"
    old_path.write_text(json.dumps(old))
    cpu_path.write_text(json.dumps(cpu))
    assert bench.main(["--recheck", str(old_path), "--cpu-from", str(cpu_path), "--out", str(tmp_path / "r")]) == 0
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == 4
    with pytest.raises(SystemExit, match="no CPU clocked"):
        bench.main(["--recheck", str(old_path), "--out", str(tmp_path / "r")])


def test_refuses_bad_arguments_before_launching():
    bench = _bench()
    for argv in (["--measure", "0"], ["--measure", "100", "--steps", "100"], ["--topology", "4x1"],
                 ["--topology", "two"], ["--links", "fast"], ["--spec", "topk:ratio=2"], ["--cores", "0"]):
        with pytest.raises(SystemExit):
            bench.main(argv)


def test_run_ranks_gives_each_rank_its_environment(tmp_path):
    code = ("import json, os, sys; json.dump({k: os.environ.get(k) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
            "'MASTER_ADDR', 'MASTER_PORT', 'GLOO_SOCKET_IFNAME', 'OMP_NUM_THREADS')}, "
            "open(os.path.join(sys.argv[1], os.environ['RANK'] + '.json'), 'w'))")
    seen = []

    def command(iface):
        seen.append(iface)
        return [sys.executable, "-c", code, str(tmp_path)]
    run_ranks(command, 3)
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert seen == [None] * 3  # loopback: no limited interface to count on
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] == [e["LOCAL_RANK"] for e in envs]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"} and {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and {e["GLOO_SOCKET_IFNAME"] for e in envs} == {"lo"}
    with pytest.raises(ValueError, match="local_size"):
        run_ranks(command, 3, local_size=2)


def test_run_ranks_stops_the_others_when_one_fails():
    def command(iface):  # rank 1 fails at once; the others would wait a minute for it
        return [sys.executable, "-c", "import os, sys, time; os.environ['RANK'] == '1' and sys.exit(3); time.sleep(60)"]
    began = time.monotonic()
    with pytest.raises(RankFailure, match=r"\[-15, 3\]|\[-9, 3\]"):
        run_ranks(command, 2)
    with pytest.raises(RankFailure, match="time limit"):
        run_ranks(lambda iface: [sys.executable, "-c", "import time; time.sleep(60)"], 2, timeout_s=1)
    assert time.monotonic() - began < 30


# The exchanges it runs are test_twolevel's and the namespace launch test_bench's: a costly repeat
# (about 30 CPU-s) of covered paths, in the extended tier (make test-full).
@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.skipif(netns.missing_prerequisites() is not None,
                    reason=f"network namespaces unavailable: {netns.missing_prerequisites()}")
def test_quick_mode_on_an_emulated_two_level_network(tmp_path):
    before = set(netns.list_namespaces())
    out = str(tmp_path / "quick")
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", out], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(open(out + ".json").read())
    rows = result["rows"]
    assert "EMULATED" in result["label"] and all("emulated" in r["link"] for r in rows)
    assert [r["layout"] for r in rows] == [r["layout"] for r in _bench().rows_for(
        _bench().SPECS, _bench().SPECS[0], "2x2")]
    for r in rows:
        assert r["identical"], r  # every rank ends with the same parameters
        assert r["median_step_s"] > 0 and 0 <= r["held_out_accuracy"] <= 1 and r["link_bytes_per_step"] > 0
        assert r["predicted"]["step_seconds"] > 0 and r["measured_over_predicted"] > 0
        assert r["workload_of"] == "compute only"  # the simulator's check: no exchange's contention in it
        c = r["predicted_contended"]  # the contention term, with the CPU the ranks' clocks measured
        assert r["cpu_seconds_per_step"] > 0 and c["cpu_seconds"] == r["cpu_seconds_per_step"]
        assert c["step_seconds"] >= r["predicted"]["step_seconds"] and r["measured_over_contended"] > 0
        assert r["predicted"]["contended_step_seconds"] >= r["predicted"]["step_seconds"]  # the fits' estimate
        two_level = r["topology_used"] != "flat"
        assert two_level == (r["layout"] not in ("flat dense", "flat spec")), r
        if two_level:  # payload per hop: inside the node the whole gradient, across a part of it
            assert r["hop_bytes_per_rank"]["local"] > r["hop_bytes_per_rank"]["cross"] > 0
        else:
            assert r["hop_bytes_per_rank"] is None
    assert {r["codec_choice_used"] for r in rows if r["layout"] != "choice"} == {"off"}
    assert set(result["fits"]["1gbit (tbf, emulated)"]) == {"flat", "intra", "inter"}
    compute = result["compute"]["1gbit (tbf, emulated)"]
    assert compute["cpu_seconds"] > 0 and compute["ranks"] == 4 and compute["cpu_per_byte"] > 0
    assert compute["workload"]["t_b"] and compute["cores"] >= 1
    assert open(out + ".md").read().startswith("**EMULATED two-level network**")
    assert not set(netns.list_namespaces()) - before  # nothing left behind (other runs' may have gone)
