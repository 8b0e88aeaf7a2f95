"""The framework-agnostic spec: parsing, defaults, validation messages."""

import pytest

from hvdcompress import Compression, CompressionSpec, parse_spec, resolve
from hvdcompress.spec import GATHERED, SUMMED, num_selected


def test_factories_fill_defaults_and_match_strings():
    assert Compression.topk(ratio=0.01) == parse_spec("topk:ratio=0.01")
    assert Compression.topk() == parse_spec("topk")
    assert parse_spec("topk").params == {"ratio": 0.01, "residual": True}
    assert parse_spec("randomk:ratio=0.1,seed=7,residual=false").params == \
        {"ratio": 0.1, "seed": 7, "residual": False, "unbiased": False}
    assert parse_spec(" fp16 ") == Compression.fp16 == Compression.fp16()


def test_round_trips_through_string_and_dict():
    for spec in [Compression.none, Compression.bf16(residual=True), Compression.threshold(threshold=0.5),
                 Compression.randomk(ratio=0.25, seed=3)]:
        assert parse_spec(str(spec)) == spec
        assert CompressionSpec.from_dict(spec.to_dict()) == spec


def test_exchange_kinds():
    assert Compression.none.exchange == SUMMED
    assert Compression.randomk().exchange == SUMMED
    assert Compression.topk().exchange == GATHERED
    assert Compression.threshold().exchange == GATHERED


@pytest.mark.parametrize("text, needle", [
    ("topk:ratio=0", "parameter 'ratio' must be float in (0.0, 1.0]; got 0.0"),
    ("topk:ratio=1.5", "parameter 'ratio' must be float in (0.0, 1.0]"),
    ("topk:ratio=-0.1", "(0.0, 1.0]"),
    ("topk:ratio=abc", "parameter 'ratio' must be float"),
    ("topk:ratio=nan", "must be finite"),
    ("topk:k=5", "unknown parameter 'k'; accepted parameters: ratio, residual"),
    ("topk:ratio", "malformed parameter 'ratio'"),
    ("threshold:threshold=0", "parameter 'threshold' must be float in (0.0, inf)"),
    ("randomk:seed=-1", "parameter 'seed' must be int in [0, "),
    ("randomk:seed=1.5", "parameter 'seed' must be int"),
    ("fp16:residual=maybe", "parameter 'residual' must be true or false"),
    ("gzip", "unknown compressor 'gzip'; known compressors: bf16, dgc, "),
    ("", "expected a spec string"),
])
def test_bad_specs_name_the_parameter_and_range(text, needle):
    with pytest.raises(ValueError) as err:
        parse_spec(text)
    assert needle in str(err.value)


def test_factory_validates_too():
    with pytest.raises(ValueError, match="ratio"):
        Compression.topk(ratio=2)
    with pytest.raises(ValueError, match="unknown parameter 'density'"):
        Compression.topk(density=0.1)


def test_resolve_accepts_what_users_pass():
    assert resolve(None) == Compression.none
    assert resolve("topk:ratio=0.5") == Compression.topk(ratio=0.5)
    assert resolve(Compression.fp16) == Compression.fp16
    with pytest.raises(ValueError, match="compression: expected"):
        resolve(42)


def test_resolve_maps_horovods_own_compression_classes():
    import horovod.torch as hvd
    assert resolve(hvd.Compression.none) == Compression.none
    assert resolve(hvd.Compression.fp16) == Compression.fp16


@pytest.mark.parametrize("ratio, numel, k", [
    (0.01, 100, 1), (0.07, 100, 7), (0.001, 10, 1), (1.0, 10, 10), (0.5, 3, 2), (0.1, 0, 0),
    (0.001, 25_000_000, 25_000), (0.3, 10, 3),
])
def test_num_selected_is_ceil_without_float_noise(ratio, numel, k):
    assert num_selected(ratio, numel) == k
