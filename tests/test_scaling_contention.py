"""The simulator's contention term (``hvdcompress.schedule.scaling.contended_step``: ranks sharing a
host's cores) and the fits' estimate of an exchange's CPU work: pure functions on made-up costs, no
Horovod, no processes."""

import numpy as np
import pytest

from hvdcompress.schedule import scaling
from hvdcompress.schedule.costmodel import ComputeFit
from hvdcompress.schedule.planner import Workload
from hvdcompress.schedule.scaling import Host, contended_step, exchange_cpu_estimate
from hvdcompress.schedule.twolevel import HIERARCHICAL, TWO_LEVEL, Candidate, Route, TwoLevelCostModel
from hvdcompress.spec import resolve

QSGD = "qsgd"
FITS = {QSGD: ComputeFit("linear", 3e-11, 1e-4), "none": ComputeFit("linear", 0.0, 0.0)}


def workload(compute_ms=100.0, mb=40.0, tensors=12):
    return scaling.synthetic_workload(tensors, mb, compute_ms * 0.7, compute_ms * 0.3)


def two_level(nodes=2, local=2, intra=20.0, inter=1.0):
    return TwoLevelCostModel.from_links(nodes, local, intra, inter, 20e-6, 50e-6, local, FITS)


def test_host_checks_its_parameters_and_says_the_share():
    assert Host(4, 2).share == 2.0 and Host(4, 2).oversubscribed
    assert Host(8, 8).share == 1.0 and not Host(8, 8).oversubscribed
    assert Host(2, 16).share == 1.0  # more cores than ranks: each rank has its own
    for bad, name in (({"ranks": 0, "cores": 2}, "ranks"), ({"ranks": 4, "cores": 0}, "cores"),
                      ({"ranks": 4, "cores": 2.5}, "cores"), ({"ranks": True, "cores": 2}, "ranks"),
                      ({"ranks": 4, "cores": 2, "cpu_per_byte": -1e-9}, "cpu_per_byte"),
                      ({"ranks": 4, "cores": 2, "cpu_per_byte": float("nan")}, "cpu_per_byte")):
        with pytest.raises(ValueError, match=name):
            Host(**bad)


def test_contended_step_is_the_host_cpu_work_where_ranks_outnumber_cores():
    # 4 ranks on 2 cores, 30 ms of CPU each: the host does 120 ms of work 2 at a time
    assert contended_step(0.040, 0.030, Host(4, 2)) == pytest.approx(0.060)
    # the timeline longer than the CPU work (the wire dominates): unchanged
    assert contended_step(0.500, 0.030, Host(4, 2)) == 0.500
    # each rank its own core, or no host said: the timeline's step, whatever the CPU
    assert contended_step(0.040, 0.030, Host(2, 2)) == 0.040
    assert contended_step(0.040, 0.030, None) == 0.040
    for step, cpu, name in ((-1.0, 0.0, "step_seconds"), (0.1, float("inf"), "cpu_seconds"),
                            (0.1, -0.01, "cpu_seconds")):
        with pytest.raises(ValueError, match=name):
            contended_step(step, cpu, Host(4, 2))


def test_exchange_cpu_estimate_adds_codecs_and_every_byte_sent():
    m = two_level()
    b = 4e6
    for route, spec in ((Route(), QSGD), (Route(TWO_LEVEL), QSGD), (HIERARCHICAL, "none")):
        h = m.hops(route, spec, np.array([b]))
        want = float(h.cpu[0] + h.decompress[0]) + 2e-9 * float(h.intra_bytes[0] + h.inter_bytes[0])
        got = exchange_cpu_estimate(m, [b], [Candidate(route, resolve(spec))], Host(4, 2, 2e-9))
        assert got == pytest.approx(want)
    # two groups: the sum of each alone; no per-byte cost: the codecs only
    two = exchange_cpu_estimate(m, [b, b / 2], [Candidate(Route(TWO_LEVEL), resolve(QSGD))] * 2, Host(4, 2, 2e-9))
    one = [exchange_cpu_estimate(m, [x], [Candidate(Route(TWO_LEVEL), resolve(QSGD))], Host(4, 2, 2e-9))
           for x in (b, b / 2)]
    assert two == pytest.approx(sum(one))
    h = m.hops(Route(TWO_LEVEL), QSGD, np.array([b]))
    assert exchange_cpu_estimate(m, [b], [Candidate(Route(TWO_LEVEL), resolve(QSGD))], Host(4, 2)) == \
        pytest.approx(float(h.cpu[0] + h.decompress[0]))


def test_rows_gain_the_contended_step_only_with_a_host():
    w, m = workload(), two_level()
    plain = scaling.predict_route(w, m, QSGD, Route(TWO_LEVEL))
    assert "contended_step_seconds" not in plain
    shared = scaling.predict_route(w, m, QSGD, Route(TWO_LEVEL), host=Host(4, 2, 2e-9))
    assert {k: shared[k] for k in plain} == plain  # the timeline's figures unchanged
    # the workload and fits are as timed with every rank busy: CPU = seconds / share
    want_cpu = w.compute_seconds / 2 + shared["exchange_cpu_seconds"]
    assert shared["cpu_seconds"] == pytest.approx(want_cpu)
    assert shared["contended_step_seconds"] == pytest.approx(max(shared["step_seconds"], 2 * want_cpu))
    assert shared["contended_step_seconds"] >= shared["step_seconds"]
    own = scaling.predict_route(w, m, QSGD, Route(TWO_LEVEL), host=Host(4, 4, 2e-9))
    assert own["contended_step_seconds"] == own["step_seconds"]  # a core per rank: nothing charged
    choice = scaling.predict_choice_row(w, m, QSGD, host=Host(4, 2, 2e-9))
    assert choice["contended_step_seconds"] >= choice["step_seconds"]


def test_the_sweep_is_unchanged_unless_the_host_says_ranks_share_cores():
    w = workload()
    base = two_level().flat
    kw = dict(local_size=8, workers=(16, 128), gbps=(1.0, 10.0), intra_gbps=2400.0, intra_latency_s=2e-6,
              gtopk=True)
    before = scaling.two_level_sweep(w, base, [QSGD], **kw)
    assert scaling.two_level_sweep(w, base, [QSGD], host=None, **kw) == before
    own = scaling.two_level_sweep(w, base, [QSGD], host=Host(8, 8, 1e-9), **kw)  # a core (device) per rank
    assert [{k: r[k] for k in b} for r, b in zip(own, before)] == before
    assert all(r["contended_step_seconds"] == r["step_seconds"] for r in own)
    shared = scaling.two_level_sweep(w, base, [QSGD], host=Host(8, 2, 1e-9), **kw)
    assert [{k: r[k] for k in b} for r, b in zip(shared, before)] == before
    assert all(r["contended_step_seconds"] >= r["step_seconds"] for r in shared)
    assert any(r["contended_step_seconds"] > r["step_seconds"] for r in shared)


def test_compare_two_level_takes_a_measured_cpu_clock_over_the_estimate():
    w = workload(compute_ms=40.0)
    base = two_level().flat
    records = [{"workers": 4, "layout": "two-level spec", "compression": QSGD, "seconds": 0.2, "gbps": 1.0},
               {"workers": 4, "layout": "flat dense", "seconds": 0.3, "gbps": 1.0, "cpu_seconds": 0.2}]
    kw = dict(local_size=2, intra_gbps=20.0, intra_latency_s=20e-6)
    plain = scaling.compare_two_level(records, w, base, **kw)
    assert all("rel_error_contended" not in r for r in plain)
    rows = scaling.compare_two_level(records, w, base, host=Host(4, 2, 2e-9), **kw)
    assert "cpu_measured" not in rows[0] and rows[0]["contended_step_seconds"] >= rows[0]["step_seconds"]
    assert rows[1]["cpu_measured"] and rows[1]["cpu_seconds"] == 0.2
    assert rows[1]["contended_step_seconds"] == pytest.approx(max(rows[1]["step_seconds"], 0.4))
    assert rows[1]["rel_error_contended"] == pytest.approx(rows[1]["contended_step_seconds"] / 0.3 - 1)


def test_the_command_line_takes_cores(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--link", "1,50", "--synthetic", "12,40,70,30", "--gpus-per-node", "2", "--intra-gbps", "20",
            "--workers", "4", "--gbps", "1", "--compression", QSGD, "--codec-fit", f"{QSGD}=linear,3e-11,1e-4",
            "--out", str(out)]
    assert scaling.main(argv) == 0
    import json
    plain = json.loads(out.read_text())
    assert plain["two_level"]["cores"] is None and all("contended_step_seconds" not in r for r in plain["rows"])
    assert scaling.main(argv + ["--cores", "1", "--cpu-per-byte", "2e-9"]) == 0
    shared = json.loads(out.read_text())
    assert shared["two_level"]["cores"] == 1 and all("contended_step_seconds" in r for r in shared["rows"])
    with pytest.raises(SystemExit):
        scaling.main(argv + ["--cores", "0"])


def test_the_projection_changes_only_where_cores_say_ranks_share(tmp_path):
    """benchmarks/two_level_projection.py: GPUs (no --cores) as before; --cores adds a column."""
    import json
    from scenarios.kit import load_benchmark
    mod = load_benchmark("two_level_projection.py")
    base = ["--workers", "16", "--gbps", "10", "--spec", QSGD]
    runs = {}
    for name, extra in (("gpus", []), ("own", ["--cores", "8"]), ("shared", ["--cores", "2", "--cpu-per-byte", "1e-9"])):
        out = tmp_path / f"{name}.json"
        assert mod.main(base + extra + ["--out", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    assert runs["gpus"]["columns"] == list(mod.COLUMNS) and "cores_per_node" not in runs["gpus"]["assumed"]
    plain = runs["gpus"]["rows"]
    for name in ("own", "shared"):
        assert runs[name]["columns"] == list(mod.COLUMNS) + [mod.CONTENDED]
        assert [r[:-1] for r in runs[name]["rows"]] == plain  # the timeline's figures unchanged
    step = mod.COLUMNS.index("step_seconds")
    assert all(r[-1] == r[step] for r in runs["own"]["rows"])  # a core per rank: nothing charged
    assert all(r[-1] >= r[step] for r in runs["shared"]["rows"])
    with pytest.raises(SystemExit):
        mod.main(base + ["--cores", "0", "--out", str(tmp_path / "x.json")])
