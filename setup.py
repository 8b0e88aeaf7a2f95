"""hvdcompress: communication-efficient distributed training on top of Horovod.

Install with ``make install`` (scripts/install.sh): it keeps a supported torch already installed
(installs the pinned one otherwise), TensorFlow, and builds Horovod with Gloo (NCCL with a CUDA
torch) for both. Dependencies are not declared for a bare ``pip install`` on purpose: one that
picks a torch would pull the newest (CUDA) build. ``pip install -e .[torch]`` is the light route
for torchrun / DDP users (the DDP hook, DiLoCo on torch.distributed): torch and numpy, no Horovod,
no TensorFlow; it accepts the torch the user has when its version is supported (docs/gpu.md).
"""

from setuptools import find_packages, setup

setup(
    name="hvdcompress",
    version="0.1.0",
    description="Gradient compression (sparsification, quantization, sketching) for Horovod",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvdcompress", "hvdcompress.*", "torch_ops", "torch_ops.*",
                                    "tf_ops", "tf_ops.*"]),
    package_data={"hvdcompress.native": ["kernels.cpp"]},  # compiled at install or first use
    python_requires=">=3.9",
    install_requires=["numpy"],
    # "torch": the torch versions scripts/install_plan.py accepts (TORCH_LOWEST .. TORCH_HIGHEST)
    extras_require={"dev": ["pytest", "tqdm", "matplotlib", "scikit-learn"],
                    "torch": ["torch>=2.1,<2.14", "numpy"]},
    entry_points={"console_scripts": ["hvdcompress = hvdcompress.cli:main"]},
)
