"""The compiled kernels' loader and switches, as the PyTorch compressors use them: the shared
module ``hvdcompress.native`` (one library and one set of switches for both backends)."""

from hvdcompress.native import build, lib, library_path, main, set_enabled, set_torch_only, torch_only  # noqa: F401
