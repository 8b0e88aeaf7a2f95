"""Derive the shipped emulation profiles (``resnet50-v100.json``, ``vgg16-v100.json``) from the
models' published layer shapes and an ASSUMED V100-class throughput. Nothing here was measured
on a GPU: every time is arithmetic on the assumptions below, written into each JSON's
``derivation``. Run ``python -m hvdcompress.bench.profiles.derive`` to rewrite them.

Per layer (batch B, 224x224 ImageNet inputs):
- convolution / fully connected: forward FLOPs = 2 * C_in * C_out * k * k * H_out * W_out * B,
  at ``FLOPS`` effective; backward = 2x forward (input and weight gradients), 1x for the first
  layer (no input gradient);
- batch norm (+ the ReLU after it), and VGG's ReLU folded into its conv: memory-bound, forward
  ``BN_PASSES_FWD`` and backward ``BN_PASSES_BWD`` passes over the output activation (fp32) at
  ``MEM_BW`` bytes/s;
- every layer pays ``KERNEL_S`` per kernel (1 forward, 2 backward).
Pooling, the residual additions and the loss are left out (they are small).
"""

from __future__ import annotations

import json
import os

FLOPS = 10e12       # effective fp32 FLOP/s assumed for cuDNN convolutions and GEMMs (V100 peak: 15.7e12)
MEM_BW = 700e9      # effective bytes/s for memory-bound layers (V100 HBM2 peak: 900e9)
BN_PASSES_FWD = 4   # read + write for BN, read + write for the ReLU
BN_PASSES_BWD = 6
KERNEL_S = 10e-6
HERE = os.path.dirname(os.path.abspath(__file__))


def _conv(name, cin, cout, k, hout, batch, first=False, bias=False):
    flops = 2.0 * cin * cout * k * k * hout * hout * batch
    params = {"weight": [cout, cin, k, k] if k > 0 else [cout, cin]}
    if bias:
        params["bias"] = [cout]
    fwd = flops / FLOPS + KERNEL_S
    bwd = (1.0 if first else 2.0) * flops / FLOPS + 2 * KERNEL_S
    return {"name": name, "kind": "conv" if k > 0 else "linear", "params": params,
            "forward_s": fwd, "backward_s": bwd, "out_elements": cout * hout * hout}


def _linear(name, cin, cout, batch, relu_after=False):
    layer = _conv(name, cin, cout, 1, 1, batch, bias=True)
    layer["params"]["weight"] = [cout, cin]
    layer["kind"] = "linear"
    return layer


def _bn(name, c, hout, batch):
    bytes_ = 4.0 * c * hout * hout * batch
    return {"name": name, "kind": "batchnorm", "params": {"weight": [c], "bias": [c]},
            "forward_s": BN_PASSES_FWD * bytes_ / MEM_BW + KERNEL_S,
            "backward_s": BN_PASSES_BWD * bytes_ / MEM_BW + 2 * KERNEL_S, "out_elements": c * hout * hout}


def _relu_into(layer, batch):
    """VGG has no BN: its ReLU (2 passes forward, 3 backward) is folded into the layer before."""
    bytes_ = 4.0 * layer["out_elements"] * batch
    layer["forward_s"] += 2 * bytes_ / MEM_BW
    layer["backward_s"] += 3 * bytes_ / MEM_BW
    return layer


def resnet50(batch=64):
    layers = [_conv("conv1", 3, 64, 7, 112, batch, first=True), _bn("bn1", 64, 112, batch)]
    cin, size = 64, 56  # after the stride-2 max-pool
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(blocks):
            stride = 2 if (b == 0 and stage > 1) else 1
            out = size // stride
            p = f"layer{stage}.{b}"
            layers += [_conv(f"{p}.conv1", cin, width, 1, size, batch), _bn(f"{p}.bn1", width, size, batch),
                       _conv(f"{p}.conv2", width, width, 3, out, batch), _bn(f"{p}.bn2", width, out, batch),
                       _conv(f"{p}.conv3", width, 4 * width, 1, out, batch), _bn(f"{p}.bn3", 4 * width, out, batch)]
            if b == 0:
                layers += [_conv(f"{p}.downsample.0", cin, 4 * width, 1, out, batch),
                           _bn(f"{p}.downsample.1", 4 * width, out, batch)]
            cin, size = 4 * width, out
    layers.append(_linear("fc", 2048, 1000, batch))
    return layers


def vgg16(batch=32):
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    layers, cin, size, i = [], 3, 224, 0
    for v in cfg:
        if v == "M":
            size //= 2
            i += 1
            continue
        layers.append(_relu_into(_conv(f"features.{i}", cin, v, 3, size, batch, first=not layers, bias=True), batch))
        cin = v
        i += 2
    layers += [_relu_into(_linear("classifier.0", 512 * 7 * 7, 4096, batch), batch),
               _relu_into(_linear("classifier.3", 4096, 4096, batch), batch),
               _linear("classifier.6", 4096, 1000, batch)]
    return layers


def profile(name, model, batch, layers):
    for layer in layers:
        layer.pop("out_elements", None)
    n = sum(_numel(s) for layer in layers for s in layer["params"].values())
    return {
        "name": name, "model": model, "batch": batch, "device": "V100-class GPU (assumed throughput, not measured)",
        "source": "derived: published layer shapes (torchvision " + model + ", 224x224 inputs) and assumed "
                  "throughput; no GPU was used",
        "derivation": {"conv_and_linear_flops_per_s": FLOPS, "memory_bytes_per_s": MEM_BW,
                       "batchnorm_relu_passes_forward_backward": [BN_PASSES_FWD, BN_PASSES_BWD],
                       "kernel_overhead_s": KERNEL_S,
                       "rule": "conv/linear: 2*Cin*Cout*k*k*Hout*Wout*B FLOPs forward, 2x that backward (1x for "
                               "the first layer); batch norm + ReLU (VGG: ReLU folded into its conv) memory-bound "
                               "passes over the fp32 output; pooling, residual adds and loss left out",
                       "script": "python -m hvdcompress.bench.profiles.derive"},
        "parameters": n,
        "forward_s_total": sum(l["forward_s"] for l in layers),
        "backward_s_total": sum(l["backward_s"] for l in layers),
        "layers": [dict(l, forward_s=round(l["forward_s"], 9), backward_s=round(l["backward_s"], 9))
                   for l in layers],
    }


def _numel(shape):
    out = 1
    for d in shape:
        out *= d
    return out


def main():
    for fname, prof in (("resnet50-v100.json", profile("resnet50-v100", "resnet50", 64, resnet50(64))),
                        ("vgg16-v100.json", profile("vgg16-v100", "vgg16", 32, vgg16(32)))):
        with open(os.path.join(HERE, fname), "w") as f:
            json.dump(prof, f, indent=1)
            f.write("\n")
        print(f"{fname}: {prof['parameters'] / 1e6:.2f}M parameters, {len(prof['layers'])} layers, forward "
              f"{prof['forward_s_total'] * 1e3:.1f} ms, backward {prof['backward_s_total'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
