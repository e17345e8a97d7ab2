"""Compile-only GPU devices: a topology profile's GPU as XLA's target config, no GPU needed.

The CUDA plugin (the gpu-compile extra) compiles for a GPU described by a GpuTargetConfigProto
(gpu_targets/*.txtpb: XLA's published specs plus the cuDNN version) on a machine without one:
`jax.experimental.topologies.get_topology_desc` returns devices that programs can be lowered
and compiled for, never run on. The compiled program is the scheduled GPU HLO (async
collectives with the compute XLA's latency-hiding scheduler put between them, fused kernels)
and its memory_analysis() is the GPU's.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from boost_jax.errors import UserError
from boost_jax.mesh import GPU_XLA_FLAGS, STAGE, Topology

TARGET_DIR = Path(__file__).parent / "gpu_targets"
# topology profile -> target config file (gpu_targets/<name>.txtpb)
TARGETS = {"perlmutter": "a100_sxm_40", "perlmutter-80": "a100_sxm_80", "dgx-h100": "h100_sxm"}
# why a profile has no target (README: "Compiling for the GPU without one")
NO_TARGET = {
    "frontier": "AMD MI250X: the ROCm plugin (jax-rocm7-plugin) cannot compile without an AMD "
                "GPU (it refuses to start when its hardware check finds none, and needs ROCm 7's "
                "system libraries that no wheel brings)",
    "cpu": "the cpu profile has no GPU; the CPU dry run (without --gpu-compile) compiles for it",
}
INSTALL_HINT = ("--gpu-compile needs the CUDA compiler plugin (about 4.4 GB): pip install -e "
                "'.[gpu-compile]', or run make gpu-compile-test for a venv with it")


def target_name(topo: Topology) -> str:
    """The target config of a profile, or a one-line error saying why there is none."""
    if topo.name in TARGETS:
        return TARGETS[topo.name]
    why = NO_TARGET.get(topo.name, "no GPU target config is known for it")
    raise UserError(f"--gpu-compile: topology {topo.name!r} has no GPU target ({why}); use one of "
                    f"{sorted(TARGETS)}")


def target_config(name: str) -> str:
    return (TARGET_DIR / f"{name}.txtpb").read_text()


def plugin_installed() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def prepare_env() -> None:
    """Before JAX starts: run JAX on the CPU (no GPU is looked for) and let the CUDA plugin load
    without a driver (it checks the CUDA libraries against the driver's otherwise)."""
    if not plugin_installed():
        raise UserError(INSTALL_HINT)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def compiler_options() -> dict:
    """The launcher's GPU_XLA_FLAGS as per-compile options (so the CPU programs of the same
    process keep their defaults)."""
    out = {}
    for flag in GPU_XLA_FLAGS:
        key, _, value = flag.lstrip("-").partition("=")
        out[key] = {"true": True, "false": False}.get(value, value)
    return out


def compile_devices(topo: Topology, sizes: dict, target: str | None = None) -> list:
    """Compile-only devices for the mesh `sizes`: hosts x (pair x node) devices per host, of
    the profile's GPU or of `target` (a gpu_targets/ name)."""
    from jax.experimental import topologies

    hosts = sizes["global"] * sizes.get(STAGE, 1)
    per_host = sizes["pair"] * sizes["node"]
    desc = topologies.get_topology_desc(
        "", "cuda", topology=f"1 x {hosts} x {per_host}",
        target_config=target_config(target or target_name(topo)))
    return list(desc.devices)
