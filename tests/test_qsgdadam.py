"""QSGD Adam and the 16-bit warm-up single-process: the numpy oracle against the paper's Algorithm 1
(1-bit Adam's transcription with C = QSGD's stochastic rounding, written here from Alistarh et al.
in float64 with the same uniforms), the averaged moment and each rank's residual, the declared wire,
the warm-up's fp16/bf16 average (``warmup_codec``) for every frozen-variance Adam, bad parameters.
PyTorch and TensorFlow bit for bit against the oracle: tests/test_properties.py; real 2-worker
launches: tests/test_topkadam_multiprocess.py."""

import numpy as np
import pytest

from hvdcompress import parse_spec
from hvdcompress.reference import simulate
from hvdcompress.reference.onebitadam import adamw_step, bias_corrections, denominator, transcription
from hvdcompress.registry import info_for
from hvdcompress.rng import uniform

F32 = np.float32


def _qsgd_dense(levels, bucket, seed, workers, warm, key):
    """D(C(a)) for QSGD in float64: per bucket w = ||a||_2, r = |a| s / w, level floor(r) + [xi < frac(r)];
    the transcription calls it rank by rank, step by step, so the call count gives (step, rank)."""
    calls = [0]

    def compress(a):
        step, rank = warm + calls[0] // workers, calls[0] % workers
        calls[0] += 1
        xi = uniform(a.size, seed, step, key, rank).astype(np.float64)
        out = np.zeros_like(a)
        for lo in range(0, a.size, bucket or a.size):
            part = a[lo:lo + (bucket or a.size)]
            w = np.sqrt(np.sum(part * part))
            if w == 0:
                continue
            r = np.abs(part) * levels / w
            level = np.minimum(np.floor(r) + (xi[lo:lo + part.size] < r - np.floor(r)), levels)
            out[lo:lo + part.size] = np.sign(part) * level * w / levels
        return out
    return compress


@pytest.mark.parametrize("space, levels, bucket", [("direction", 15, 4), ("moment", 7, 16)])
def test_oracle_follows_the_papers_algorithm_with_qsgd_on_a_quadratic(space, levels, bucket):
    rng = np.random.default_rng(3)
    workers, n, steps, warm, lr, wd = 3, 12, 12, 5, 0.05, 0.1
    A = [rng.standard_normal((n, n)) / np.sqrt(n) for _ in range(workers)]
    b = [rng.standard_normal(n) for _ in range(workers)]

    def grad(i, t, p):
        return A[i].T @ (A[i] @ p - b[i])

    p0 = rng.standard_normal(n).astype(F32)
    want = transcription(grad, p0, steps, workers, lr, wd, warm, _qsgd_dense(levels, bucket, 5, workers, warm, "w"),
                         space=space)
    spec = parse_spec(f"qsgdadam:warmup_steps={warm},levels={levels},bucket={bucket},seed=5,space={space}")
    p, states = p0.copy(), [{} for _ in range(workers)]
    for step in range(steps):
        grads = [grad(i, step + 1, p.astype(np.float64)).astype(F32) for i in range(workers)]
        d, states, _ = simulate(spec, grads, states, key="w", step=step)
        p = adamw_step(p, d, lr, wd)
        np.testing.assert_allclose(p, want[step], rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
    assert all(np.array_equal(states[0][k], states[r][k]) for r in range(workers) for k in ("m", "v"))


def test_the_averaged_moment_is_the_mean_of_the_decoded_codes_and_the_rest_stays_in_the_residual():
    spec = parse_spec("qsgdadam:warmup_steps=1,levels=3,bucket=4")
    rng = np.random.default_rng(0)
    n = 40
    _, states, _ = simulate(spec, [rng.standard_normal(n).astype(F32) for _ in range(2)], [{}, {}], step=0)
    m0, v0 = states[0]["m"].copy(), states[0]["v"].copy()
    g = [rng.standard_normal(n).astype(F32) for _ in range(2)]
    _, states, sent = simulate(spec, g, states, step=1)
    den = denominator(v0, bias_corrections(spec, 1)[1], F32(1e-8))
    decoded = []
    for r in range(2):
        u = ((m0 * F32(0.9) + g[r] * F32(1.0 - 0.9)).astype(F32) / den).astype(F32)  # e_i = 0 before
        decoded.append((u - states[r]["residual"]).astype(F32))
        norms = np.sqrt((u.astype(np.float64) ** 2).reshape(-1, 4).sum(1))
        level = np.abs(decoded[-1]).reshape(-1, 4) * 3 / norms[:, None]  # |code| in {0, 1, 2, 3}: l * w / s
        assert np.allclose(level, np.round(level), atol=1e-5) and level.max() <= 3 + 1e-5
    assert np.allclose(states[0]["m"], (decoded[0] + decoded[1]) / 2 * den, rtol=1e-5, atol=1e-12)
    assert np.array_equal(states[0]["v"], v0)  # frozen
    assert sent[0][-1][0].nbytes == n * 3 // 8 + 4 * (n // 4)  # 3-bit codes, one float32 norm per 4 entries


@pytest.mark.parametrize("levels, bucket, d, nbytes", [(31, 512, 1000, 750 + 8), (7, 16, 100, 50 + 28), (3, 4, 35, 14 + 36)])
def test_declared_wire_is_qsgds_payload_after_the_warm_up(levels, bucket, d, nbytes):
    spec = parse_spec(f"qsgdadam:warmup_steps=1,levels={levels},bucket={bucket}")
    (rnd,) = info_for("qsgdadam").rounds(spec.params, d, 2)
    assert float(rnd.nbytes) == nbytes
    g = [np.linspace(-1, 1, d).astype(F32), np.linspace(1, -1, d).astype(F32)]
    _, states, sent = simulate(spec, g, step=0)
    assert sum(t.nbytes for t in sent[0][0]) == d * 4  # the dense warm-up
    _, _, sent = simulate(spec, g, states, step=1)
    assert sum(t.nbytes for t in sent[0][0]) == nbytes


@pytest.mark.parametrize("name", ["onebitadam", "topkadam:ratio=0.5", "qsgdadam"])
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_a_16_bit_warm_up_averages_as_its_codec_and_sends_half(name, codec):
    from hvdcompress.reference.codecs import bf16_decode, bf16_encode
    sep = "," if ":" in name else ":"
    spec = parse_spec(f"{name}{sep}warmup_steps=2,warmup_codec={codec}")
    plain = parse_spec(f"{name}{sep}warmup_steps=2")
    rng = np.random.default_rng(1)
    g = [rng.standard_normal(33).astype(F32) * F32(1e-3) for _ in range(3)]
    d, states, sent = simulate(spec, g, [{}, {}, {}], step=0)
    d0, states0, sent0 = simulate(plain, g, [{}, {}, {}], step=0)
    assert sum(t.nbytes for t in sent[0][0]) * 2 == sum(t.nbytes for t in sent0[0][0]) == 33 * 4
    if codec == "fp16":  # fp16's allreduce: summed in half, rank by rank
        total = g[0].astype(np.float16)
        for x in g[1:]:
            total = (total + x.astype(np.float16)).astype(np.float16)
        mean = (total.astype(F32) * F32(1 / 3)).astype(F32)
    else:  # bf16's gather: decoded, summed in float32 in rank order
        total = np.zeros(33, F32)
        for x in g:
            total = (total + bf16_decode(bf16_encode(x))).astype(F32)
        mean = (total * F32(1 / 3)).astype(F32)
    assert np.array_equal(states[0]["m"], (mean * F32(1.0 - 0.9)).astype(F32))
    assert np.array_equal(states[0]["v"], ((mean * mean) * F32(1.0 - 0.999)).astype(F32))
    assert not np.array_equal(states[0]["m"], states0[0]["m"])  # not the float32 average
    assert np.allclose(d, d0, rtol=1e-2)


def test_bad_parameters_name_the_parameter_and_range():
    with pytest.raises(ValueError, match=r"qsgdadam: parameter 'levels' must be int in \[1, 127\]; got 0"):
        parse_spec("qsgdadam:levels=0")
    with pytest.raises(ValueError, match=r"qsgdadam: parameter 'bucket' must be int in \[0, "):
        parse_spec("qsgdadam:bucket=-1")
    for name in ("onebitadam", "topkadam", "qsgdadam"):
        with pytest.raises(ValueError, match=rf"{name}: parameter 'warmup_codec' must be one of none, fp16, bf16"):
            parse_spec(f"{name}:warmup_codec=int8")
    assert parse_spec("qsgdadam")["space"] == "direction" and parse_spec("onebitadam")["warmup_codec"] == "none"


@pytest.mark.parametrize("text, hint", [("qsgdadam:levels=7,bucket=512", "bound 3.23). Accepted e.g.: bucket <= 16 at levels=7"),
                                        ("qsgdadam:levels=1,bucket=512", "bound 22.6). Accepted e.g.: levels >= 31 at bucket=512"),
                                        ("qsgdadam:bucket=0", "bucket=0. Accepted e.g.: bucket <= 128 at levels=15")])
def test_settings_where_error_feedback_diverges_are_refused(text, hint):
    """Error feedback around QSGD's unbiased codes diverges once their variance bound reaches 1 (it did on the
    char LM at levels 1 and 7 on 512-entry buckets): refused at parse time, naming both parameters."""
    with pytest.raises(ValueError, match="qsgdadam: parameters 'levels' and 'bucket' must keep QSGD's variance bound") as got:
        parse_spec(text)
    assert hint in str(got.value)
    assert parse_spec("qsgdadam:levels=31,bucket=512")["levels"] == 31  # bound 0.53
