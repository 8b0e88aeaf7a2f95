"""hvdcompress: communication-efficient distributed training on top of Horovod.

Install with ``make install`` (scripts/install.sh): it pins torch/TensorFlow and builds Horovod
with Gloo, PyTorch and TensorFlow first. Dependencies are not declared for pip to resolve on its
own, on purpose: a bare ``pip install`` that picks a torch would pull the newest (CUDA) build.
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
    extras_require={"dev": ["pytest", "tqdm", "matplotlib", "scikit-learn"]},
    entry_points={"console_scripts": ["hvdcompress = hvdcompress.cli:main"]},
)
