"""check_devices: a model spread over devices is a clear ValueError before any collective; on CPU
it is checked with the "meta" device standing in for a second one."""

import pytest
import torch

from torch_ops.arguments import check_devices


def test_one_device_is_returned():
    assert check_devices("model", [torch.zeros(2), torch.ones(3)]) == torch.device("cpu")
    assert check_devices("model", []) == torch.device("cpu")
    assert check_devices("model", [torch.zeros(2, device="meta")]) == torch.device("meta")


def test_mixed_devices_name_the_parameter_and_the_devices():
    named = [("fc.weight", torch.zeros(2)), ("fc.bias", torch.zeros(2, device="meta")),
             ("out.weight", torch.zeros(2)), ("out.bias", torch.zeros(2)), ("extra", torch.zeros(1))]
    with pytest.raises(ValueError) as err:
        check_devices("named_parameters", named)
    msg = str(err.value)
    assert msg.startswith("named_parameters: every tensor must be on one device")
    assert "found 2 devices: cpu: 4 (fc.weight, out.weight, out.bias, ...); meta: 1 (fc.bias)" in msg


def test_unnamed_tensors_are_numbered():
    with pytest.raises(ValueError, match=r"model: .*cpu: 1 \(#0\); meta: 1 \(#1\)"):
        check_devices("model", [torch.zeros(1), torch.zeros(1, device="meta")])


def _half_meta_model():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[1].to("meta")
    return model


def test_the_front_ends_check_before_any_collective():
    """No process group, no Horovod: the check fires before either would be needed."""
    import hvdcompress.ddp
    import hvdcompress.torch as hvc
    from torch_ops.diloco import DiLoCo

    model = _half_meta_model()
    with pytest.raises(ValueError, match="^model: every tensor must be on one device"):
        hvdcompress.ddp.comm_hook("topk:ratio=0.5", model=model)
    with pytest.raises(ValueError, match=r"^optimizer: every tensor must be on one device.*param_groups\[0\]\[2\]"):
        hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), backend="torch")
    with pytest.raises(ValueError, match="^model: every tensor must be on one device"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")


@CUDA
def test_a_model_half_on_the_gpu_is_refused_naming_both_devices():
    import hvdcompress.ddp
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].cuda()
    with pytest.raises(ValueError, match=r"model: every tensor must be on one device.*cuda:0: 2 \(0\.weight, "
                                         r"0\.bias\); cpu: 2 \(1\.weight, 1\.bias\)"):
        hvdcompress.ddp.comm_hook("topk:ratio=0.5", model=model)
    model.cuda()
    assert check_devices("model", model.named_parameters()) == torch.device("cuda", 0)
