"""Topology profiles and the 3-axis device mesh ("pair", "node", "global").

Axes are ordered innermost-first by link speed: `pair` shares the fastest link (the two GCDs of
an MI250X), `node` is the rest of one host, `global` crosses hosts. Adjacent device ids share a
pair and a host's devices share a node, matching how runtimes number local devices.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from boost_jax.errors import ConfigError, UserError

AXES = ("pair", "node", "global")


@dataclass(frozen=True)
class Topology:
    name: str
    pair: int  # devices sharing the fastest link
    node: int  # pairs per host
    # Per-device one-direction bandwidth (bytes/s) and latency (s) of each level.
    bw_pair: float
    bw_node: float
    bw_global: float
    lat_pair: float
    lat_node: float
    lat_global: float
    peak_flops: float  # dense bf16 FLOP/s per device
    hbm_bytes: float  # memory per device
    device: str = ""

    @property
    def devices_per_node(self) -> int:
        return self.pair * self.node

    def bandwidth(self, level: str) -> float:
        return {"pair": self.bw_pair, "node": self.bw_node, "global": self.bw_global}[level]

    def latency(self, level: str) -> float:
        return {"pair": self.lat_pair, "node": self.lat_node, "global": self.lat_global}[level]


GB = 1e9
TOPOLOGIES: dict[str, Topology] = {
    # Frontier (OLCF user guide; arXiv 2501.04266 §2): 4 MI250X per node, 2 GCDs each joined by
    # 4 Infinity Fabric links (~200 GB/s each way); packages joined by 50-100 GB/s links (75 used);
    # 4 Slingshot-11 NICs x 25 GB/s per node = 12.5 GB/s per GCD; 191.5 TFLOP/s bf16, 64 GB HBM.
    "frontier": Topology("frontier", 2, 4, 200 * GB, 75 * GB, 12.5 * GB, 2e-6, 4e-6, 1e-5,
                         191.5e12, 64 * GB, "AMD MI250X GCD"),
    # Perlmutter GPU nodes (NERSC docs): 4 A100 fully connected by NVLink 3 — 12 links x 25 GB/s
    # per GPU, 4 links (100 GB/s each way) to each of the 3 peers. A pair-level collective has
    # only its direct 100 GB/s; a collective over all 4 GPUs drives all 3 peer links at once
    # (NCCL runs its rings/channels over every link): 3 x 100 = 300 GB/s per GPU each way.
    # 4 Slingshot-11 NICs x 25 GB/s per node = 25 GB/s per GPU; 312 TFLOP/s bf16, 40/80 GB.
    "perlmutter": Topology("perlmutter", 2, 2, 100 * GB, 300 * GB, 25 * GB, 2e-6, 2e-6, 1e-5,
                           312e12, 40 * GB, "NVIDIA A100-40GB"),
    "perlmutter-80": Topology("perlmutter-80", 2, 2, 100 * GB, 300 * GB, 25 * GB, 2e-6, 2e-6,
                              1e-5, 312e12, 80 * GB, "NVIDIA A100-80GB"),
    # DGX H100 (NVIDIA datasheet): 8 H100 SXM on NVSwitch, NVLink 4 450 GB/s each way per GPU;
    # 8 x 400 Gb/s InfiniBand = 50 GB/s per GPU; 989 TFLOP/s dense bf16, 80 GB HBM3.
    "dgx-h100": Topology("dgx-h100", 2, 4, 450 * GB, 450 * GB, 50 * GB, 2e-6, 2e-6, 8e-6,
                         989e12, 80 * GB, "NVIDIA H100 SXM"),
    # Simulated CPU devices for tests and laptops; bandwidths mirror Frontier's ratios so the
    # communication analysis means something, FLOP/s is a rough per-core figure.
    "cpu": Topology("cpu", 2, 2, 200 * GB, 75 * GB, 12.5 * GB, 2e-6, 4e-6, 1e-5,
                    5e10, 8 * GB, "host CPU"),
}


def get_topology(name: str) -> Topology:
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown topology {name!r}; choose one of {sorted(TOPOLOGIES)}") from None


def set_cpu_devices(n: int) -> None:
    """Simulate `n` CPU devices. Must run before JAX initialises its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # backend already initialised: the XLA flag is all we can do
        pass
    if jax.device_count() < n and jax.default_backend() == "cpu":
        raise UserError(
            f"--cpu-devices {n} came too late: JAX already started with {jax.device_count()} "
            "devices; pass it before anything imports jax")


def mesh_shape(topology: Topology, n_devices: int, shape: Optional[Sequence[int]] = None,
               nodes: Optional[int] = None) -> tuple[int, int, int]:
    """Resolve (pair, node, global) sizes for `n_devices` under `topology`."""
    if shape is not None:
        p, n, g = (int(s) for s in shape)
    else:
        per_node = topology.devices_per_node
        if nodes is not None:
            total = nodes * per_node
        else:
            total = n_devices
        p = math.gcd(topology.pair, total)
        n = math.gcd(topology.node, total // p)
        g = total // (p * n)
    total = p * n * g
    if total > n_devices:
        raise UserError(
            f"mesh (pair={p}, node={n}, global={g}) needs {total} devices but only {n_devices} "
            f"are present; use --cpu-devices {total} to simulate them, or a smaller mesh.shape")
    return p, n, g


def make_mesh(topology: str | Topology = "cpu", shape: Optional[Sequence[int]] = None,
              nodes: Optional[int] = None, devices: Optional[Sequence] = None):
    """Build a `jax.sharding.Mesh` with axes (pair, node, global) and Auto axis types."""
    import jax
    from jax.sharding import AxisType, Mesh

    topo = get_topology(topology) if isinstance(topology, str) else topology
    devs = list(devices) if devices is not None else jax.devices()
    devs.sort(key=lambda d: (d.process_index, d.id))
    p, n, g = mesh_shape(topo, len(devs), shape, nodes)
    # device k = g*(N*P) + n*P + p: pairs and nodes are contiguous runs of ids
    arr = np.array(devs[: p * n * g], dtype=object).reshape(g, n, p).transpose(2, 1, 0)
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * 3)


def mesh_from_config(cfg) -> "jax.sharding.Mesh":  # noqa: F821
    return make_mesh(cfg.mesh.topology, cfg.mesh.shape, cfg.mesh.nodes)


def axis_size(mesh, axes: Sequence[str]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
