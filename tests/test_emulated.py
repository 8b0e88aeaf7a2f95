"""GPU-like compute emulation of the benchmark (hvdcompress/bench/emulated.py): single process, fast."""

import json
import math
import time

import pytest
import torch
import torch.nn.functional as F

from hvdcompress.bench import emulated
from hvdcompress.bench.emulated import EmulatedModel, StreamClock, build_emulated, load_profile, scaled_shape

PROFILE = {"name": "tiny", "batch": 8, "layers": [
    {"name": "conv1", "params": {"weight": [16, 3, 3, 3]}, "forward_s": 0.010, "backward_s": 0.020},
    {"name": "bn1", "params": {"weight": [16], "bias": [16]}, "forward_s": 0.002, "backward_s": 0.004},
    {"name": "fc", "params": {"weight": [10, 64], "bias": [10]}, "forward_s": 0.008, "backward_s": 0.016}]}


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(PROFILE))
    return str(path)


def _step(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def test_shapes_follow_the_profile(profile_file):
    model = build_emulated(profile_file)
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    assert shapes == {"layers.conv1.weight": [16, 3, 3, 3], "layers.bn1.weight": [16], "layers.bn1.bias": [16],
                      "layers.fc.weight": [10, 64], "layers.fc.bias": [10]}
    small = build_emulated(profile_file, scale=4)
    assert [list(p.shape) for p in small.parameters()] == [[4, 3, 3, 3], [4], [4], [2, 64], [2]]
    assert scaled_shape([512, 512, 3, 3], 32) == [16, 512, 3, 3]
    assert scaled_shape([64], 128) == [1]
    assert math.prod(scaled_shape([4096, 25088], 32)) == pytest.approx(4096 * 25088 / 32, rel=0.01)


def test_shipped_profiles_load_with_their_published_sizes():
    assert {"resnet50-v100", "vgg16-v100"} <= set(emulated.shipped())
    for name, params, tensors in (("resnet50-v100", 25_557_032, 161), ("vgg16-v100", 138_357_544, 32)):
        prof = load_profile(name)
        shapes = [s for l in prof["layers"] for s in l["params"].values()]
        assert sum(math.prod(s) for s in shapes) == params and len(shapes) == tensors
        assert "derived" in prof["source"] and prof["derivation"]["conv_and_linear_flops_per_s"] > 0


def test_gradients_are_deterministic(profile_file):
    x, y = _batch()
    a, b = build_emulated(profile_file, seed=5), build_emulated(profile_file, seed=5)
    ga, gb, ga2 = _step(a, x, y), _step(b, x, y), _step(a, x, y)
    for n in ga:
        assert torch.equal(ga[n], gb[n]) and torch.equal(ga[n], ga2[n])
        assert ga[n].abs().sum() > 0
    # the gradient is the layer's fixed pattern times the upstream gradient's mean |.|: proportional
    c = build_emulated(profile_file, seed=6)
    assert not torch.equal(_step(c, x, y)["layers.fc.weight"], ga["layers.fc.weight"])


def test_gradients_have_a_realistic_scale_on_every_rank():
    # every rank's batch (the harness seeds it by rank) gives gradients of a sane magnitude on a
    # cross-entropy loss; the plain mean of the upstream gradient made them 0 on some ranks and
    # ~1e-10 on others (selection then ran on its slow paths, differently per rank)
    from hvdcompress.bench.torch_models import synthetic_batch
    model = build_emulated("vgg16-v100", scale=512)
    for rank in range(4):
        x, y = synthetic_batch(8, seed=1000 * (1 + rank))
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for n, p in model.named_parameters():
            rms = float(p.grad.pow(2).mean().sqrt())
            assert 1e-5 < rms < 1.0, (rank, n, rms)


def test_time_spent_waiting_matches_the_profile(profile_file):
    model = build_emulated(profile_file)
    x, y = _batch()
    fwd, bwd = [], []
    for _ in range(6):
        model.zero_grad()
        t0 = time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        F.cross_entropy(out, y).backward()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    # never shorter than the profile (sleep never returns early: the firm check). The clock is a
    # stream: a forward that woke late has already used part of the backward's time, and the
    # backward's wait absorbs it (test_stream_clock_counts_work_between_layers_but_not_oversleep),
    # so the firm check on the backward is on the step's end: forward + backward. Longer only by
    # overhead and a loaded machine's wake-up delays, so the upper bound is loose (gross errors
    # only, not jitter: the best of 6 steps, 60 ms of slack)
    assert min(fwd) >= 0.020 * 0.97 and min(f + b for f, b in zip(fwd, bwd)) >= 0.060 * 0.97
    assert min(fwd) < 0.020 + 0.060 and min(bwd) < 0.040 + 0.060


def test_stream_clock_counts_work_between_layers_but_not_oversleep():
    clock = StreamClock()
    t0 = time.perf_counter()
    clock.run(0.010)
    spin_until = time.perf_counter() + 0.015  # CPU work between two layers (a hook compressing)
    while time.perf_counter() < spin_until:
        pass
    clock.run(0.010)
    assert time.perf_counter() - t0 >= 0.034
    # a late wake-up is absorbed by the next wait: the stream's end does not move
    clock = StreamClock()
    clock.run(0.010)
    end = clock.end
    clock.woke += 0.005  # pretend the sleep overshot by 5 ms
    clock.run(0.010)
    assert clock.end == pytest.approx(end + 0.010, abs=0.001)


def test_record_profile_round_trip(tmp_path):
    from hvdcompress.bench import torch_models
    net = torch_models.build("mlp")
    x, y = torch_models.synthetic_batch(4, seed=0)
    prof = emulated.record_profile(net, lambda: F.cross_entropy(net(x), y), iters=2, warmup=1, batch=4)
    assert [l["name"] for l in prof["layers"]] == ["1", "3", "5", "7"]
    assert all(l["forward_s"] > 0 and l["backward_s"] >= 0 for l in prof["layers"])
    path = tmp_path / "mlp.json"
    path.write_text(json.dumps(prof))
    model = build_emulated(str(path))
    assert [p.shape for p in model.parameters()] == [p.shape for p in net.parameters()]


def test_harness_options():
    from hvdcompress.bench.cli import _parse_args
    args = _parse_args(["--compute", "emulated:resnet50-v100", "--emulated-scale", "32", "--loopback"], None)
    assert args.model == "emulated:resnet50-v100" and args.batch == 64 and args.trace_steps == 1
    with pytest.raises(SystemExit):
        _parse_args(["--compute", "emulated:nonexistent", "--loopback"], None)
    with pytest.raises(SystemExit):
        _parse_args(["--compute", "gpu", "--loopback"], None)
    assert isinstance(torch.nn.Module(), torch.nn.Module) and isinstance(build_emulated("resnet50-v100", scale=64),
                                                                          EmulatedModel)
