"""The CUDA plugin (the gpu-compile extra, or .[cuda]) on a machine without an NVIDIA GPU.

When JAX starts, the plugin checks its CUDA libraries against the driver (cuInit) unless
JAX_PLATFORMS leaves CUDA out or JAX_SKIP_CUDA_CONSTRAINTS_CHECK is set; with no driver that
check fails and JAX logs a traceback before every command, although it then skips CUDA anyway
(it uses CUDA only where an NVIDIA device node exists). So where no such node exists and the
user set neither variable, we skip the check: the platform JAX picks does not change.
"""

from __future__ import annotations

import importlib.util
import os

# the device nodes whose presence makes JAX try CUDA (jax/_src/hardware_utils.py, 0.10.2)
NVIDIA_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def plugin_installed() -> bool:
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None
                   for v in (12, 13))
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def quiet_without_gpu() -> None:
    """Before JAX starts: no CUDA version check where JAX will not use CUDA."""
    if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
        return
    if any(os.path.exists(d) for d in NVIDIA_DEVICE_NODES) or not plugin_installed():
        return
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
