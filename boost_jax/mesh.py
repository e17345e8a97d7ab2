"""Topology profiles and the 3-axis device mesh ("pair", "node", "global").

Axes are ordered innermost-first by link speed: `pair` shares the fastest link (the two GCDs of
an MI250X), `node` is the rest of one host, `global` crosses hosts. Adjacent device ids share a
pair and a host's devices share a node, matching how runtimes number local devices.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from boost_jax.errors import ConfigError, UserError
from boost_jax.names import MESH_AXES as AXES, STAGE_AXIS as STAGE


def level_of(axes: Sequence[str]) -> str:
    """The slowest link a group over `axes` crosses: global (pipeline stages are groups of
    hosts, so `stage` counts as global) > node > pair; "none" for a group of no axes."""
    axes = set(axes)
    if not axes:
        return "none"
    if "global" in axes or STAGE in axes:
        return "global"
    return "node" if "node" in axes else "pair"


@dataclass(frozen=True)
class JobProfile:
    """How a cluster runs a job: what `python -m boost_jax.launch slurm` writes into a script.

    One process per GPU, every process seeing all of its node's GPUs (`--gpu-bind=none`): JAX's
    SLURM detection (train/distributed.py, mode auto) then gives local rank i the node's GPU i,
    so ranks 2k and 2k+1 drive one MI250X's two GCDs (the `pair` axis). CPU profiles run one
    process per node that simulates the node's devices.
    """

    platform: str  # JAX_PLATFORMS: a missing GPU backend fails at start instead of using CPUs
    processes_per_node: int
    gpus_per_node: int = 0  # 0: no GPUs requested (CPU profile)
    cpus_per_task: int = 0  # 0: the scheduler's default
    partition: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    # Shell expression of the scratch file system where out_dir goes; {account} is the project
    # id in lower case. Empty: out_dir stays relative to the submit directory.
    scratch: str = ""
    modules: tuple = ()  # `module load` in order, after `env` (a site module's settings win)
    env: tuple = ()  # (NAME, value) pairs
    xla_flags: tuple = ()
    # Seconds before the time limit when SLURM sends SIGTERM: train.py saves and the job requeues.
    save_margin_s: int = 300

    @property
    def needs_account(self) -> bool:
        return "{account}" in self.scratch


# HPE Slingshot settings for NCCL/RCCL over libfabric (HPE Slingshot CCL documentation, shs-ccl-docs): the cxi
# provider's memory-registration cache and queue sizes (hangs and failures without them), GPUDirect
# RDMA up to the PCIe host bridge, rings over all four NICs (hsn0-3).
SLINGSHOT_CCL_ENV = (
    ("FI_MR_CACHE_MONITOR", "userfaultfd"),
    ("FI_CXI_DISABLE_HOST_REGISTER", "1"),
    ("FI_CXI_DEFAULT_CQ_SIZE", "131072"),
    ("NCCL_NET_GDR_LEVEL", "PHB"),
    ("NCCL_CROSS_NIC", "1"),
    ("NCCL_SOCKET_IFNAME", "hsn0,hsn1,hsn2,hsn3"),
)
# XLA:GPU scheduling of the step's collectives, each flag with what the cost model
# (boost_jax/plan/costmodel.py, `overlap_exposed`) assumes because of it: one list, read by
# the launcher (the flags) and the planner (the assumptions). Each flag is present in the
# 0.10.2 jax-cuda12-pjrt and jax-rocm7-pjrt plugins (an unknown XLA flag aborts the process).
GPU_XLA_SCHEDULE = (
    ("--xla_gpu_enable_latency_hiding_scheduler=true",
     "async collectives are scheduled to run behind independent compute"),
    ("--xla_gpu_enable_highest_priority_async_stream=true",
     "collectives run on their own stream, next to the compute kernels"),
    ("--xla_gpu_enable_pipelined_all_gather=true",
     "a layer's weight gather runs behind the previous layer's compute (scanned layers)"),
    ("--xla_gpu_enable_pipelined_reduce_scatter=true",
     "a layer's gradient reduce-scatter runs behind the next backward layer"),
    ("--xla_gpu_enable_pipelined_all_reduce=true",
     "a layer's gradient all-reduce (DDP) runs behind the next backward layer"),
    ("--xla_gpu_enable_while_loop_double_buffering=true",
     "the scanned layers are double-buffered, so the next layer's gathered weights exist"),
)
GPU_XLA_FLAGS = tuple(flag for flag, _ in GPU_XLA_SCHEDULE)
# Frontier (OLCF user guide): ROCm 7 for the jax-rocm7 plugin (it links libamdhip64.so.7), the
# rccl-net-plugin module (aws-ofi plugin and OLCF's RCCL settings for Slingshot), 56 usable cores
# = 7 per GCD (low-noise mode), the batch partition, Orion scratch $MEMBERWORK/<project>.
FRONTIER_JOB = JobProfile(
    "rocm", 8, gpus_per_node=8, cpus_per_task=7, partition="batch",
    scratch="$MEMBERWORK/{account}", modules=("rocm/7.0.2", "rccl-net-plugin"),
    env=SLINGSHOT_CCL_ENV + (("HSA_FORCE_FINE_GRAIN_PCIE", "1"),), xla_flags=GPU_XLA_FLAGS)
# Perlmutter GPU nodes (NERSC docs): -C gpu (hbm80g for the 80 GB nodes), the regular QOS,
# 64 cores x 2 threads = 32 CPUs per GPU, the nccl module (aws-ofi-nccl for Slingshot),
# scratch $PSCRATCH.
PERLMUTTER_JOB = JobProfile(
    "cuda", 4, gpus_per_node=4, cpus_per_task=32, qos="regular", constraint="gpu",
    scratch="$PSCRATCH", modules=("nccl",), env=SLINGSHOT_CCL_ENV, xla_flags=GPU_XLA_FLAGS)


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
    # Dense bf16 FLOP/s per device; None: measured on this machine (see `peak_flops`).
    nominal_peak_flops: Optional[float]
    hbm_bytes: float  # memory per device
    device: str = ""
    job: Optional[JobProfile] = None  # how a batch job runs on it (boost_jax.launch)

    @property
    def peak_flops(self) -> float:
        if self.nominal_peak_flops is not None:
            return self.nominal_peak_flops
        from boost_jax.backends.cpu_peak import cpu_peak_flops  # lazy: probes on first use

        return cpu_peak_flops()

    @property
    def devices_per_node(self) -> int:
        return self.pair * self.node

    @property
    def nic_node(self) -> float:
        """One host's NIC bandwidth, one direction (bytes/s); bw_global is a device's share."""
        return self.bw_global * self.devices_per_node

    def bandwidth(self, level: str) -> float:
        return {"pair": self.bw_pair, "node": self.bw_node, "global": self.bw_global}[level]

    def latency(self, level: str) -> float:
        return {"pair": self.lat_pair, "node": self.lat_node, "global": self.lat_global}[level]


GB = 1e9
TOPOLOGIES: dict[str, Topology] = {
    # Frontier. Node: 4 MI250X = 8 GCDs; the two GCDs of a package share 4 Infinity Fabric
    # links = 200 GB/s each way (pair); packages are joined by 1-2 IF links of 50 GB/s (node
    # level 75 GB/s per GCD, the mean of the 50/100 GB/s package pairs); 4 HPE Slingshot-11
    # NICs of 200 Gb/s = 25 GB/s each way, 100 GB/s per node (nic_node), one per package
    # (OLCF Frontier user guide, "Node Types" figure; arXiv 2501.04266 §2). 191.5 TFLOP/s
    # dense bf16 and 64 GB HBM2e per GCD (AMD MI250X datasheet: 383 TFLOP/s per package).
    # Latency per algorithm step: 2 us inside a node, 10 us across nodes — an assumption, not
    # a measurement (of the order of NCCL/RCCL's per-step base latency; it matters only for
    # small messages).
    "frontier": Topology("frontier", 2, 4, 200 * GB, 75 * GB, 12.5 * GB, 2e-6, 4e-6, 1e-5,
                         191.5e12, 64 * GB, "AMD MI250X GCD", FRONTIER_JOB),
    # Perlmutter GPU nodes (NERSC "Perlmutter Architecture"): 4 A100 fully connected by
    # NVLink 3 — 12 links x 25 GB/s per GPU, 4 links (100 GB/s each way) to each of the 3
    # peers (NVIDIA A100 datasheet: 600 GB/s bidirectional per GPU). A pair-level collective
    # has only its direct 100 GB/s; a collective over all 4 GPUs drives all 3 peer links at
    # once (NCCL runs its rings/channels over every link): 3 x 100 = 300 GB/s per GPU each
    # way. 4 Slingshot-11 NICs x 25 GB/s = 100 GB/s per node (nic_node). 312 TFLOP/s dense
    # bf16 (A100 datasheet), 40/80 GB HBM2e.
    "perlmutter": Topology("perlmutter", 2, 2, 100 * GB, 300 * GB, 25 * GB, 2e-6, 2e-6, 1e-5,
                           312e12, 40 * GB, "NVIDIA A100-40GB", PERLMUTTER_JOB),
    "perlmutter-80": Topology("perlmutter-80", 2, 2, 100 * GB, 300 * GB, 25 * GB, 2e-6, 2e-6,
                              1e-5, 312e12, 80 * GB, "NVIDIA A100-80GB",
                              dataclasses.replace(PERLMUTTER_JOB, constraint="gpu&hbm80g")),
    # DGX H100 (NVIDIA datasheet): 8 H100 SXM on NVSwitch, NVLink 4 450 GB/s each way per GPU;
    # 8 x 400 Gb/s InfiniBand = 50 GB/s per GPU; 989 TFLOP/s dense bf16, 80 GB HBM3.
    # Job: a generic SLURM cluster of DGX nodes (NCCL's InfiniBand defaults, no site modules).
    "dgx-h100": Topology("dgx-h100", 2, 4, 450 * GB, 450 * GB, 50 * GB, 2e-6, 2e-6, 8e-6,
                         989e12, 80 * GB, "NVIDIA H100 SXM",
                         JobProfile("cuda", 8, gpus_per_node=8, xla_flags=GPU_XLA_FLAGS)),
    # DGX A100 (NVIDIA DGX A100 datasheet; Selene, where Megatron-LM's published runs ran):
    # 8 A100-80GB on NVSwitch, NVLink 3 600 GB/s bidirectional = 300 GB/s each way per GPU;
    # 8 x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU (200 GB/s per node); 312 TFLOP/s bf16.
    "dgx-a100": Topology("dgx-a100", 2, 4, 300 * GB, 300 * GB, 25 * GB, 2e-6, 2e-6, 1e-5,
                         312e12, 80 * GB, "NVIDIA A100-80GB SXM",
                         JobProfile("cuda", 8, gpus_per_node=8, xla_flags=GPU_XLA_FLAGS)),
    # Simulated CPU devices for tests and laptops; bandwidths mirror Frontier's ratios so the
    # communication analysis means something; peak FLOP/s is this machine's measured fp32 GEMM
    # rate shared by its simulated devices (boost_jax.backends.cpu_peak).
    # Job: one process per node simulating its 4 devices (the local SLURM stand-in's dry run).
    "cpu": Topology("cpu", 2, 2, 200 * GB, 75 * GB, 12.5 * GB, 2e-6, 4e-6, 1e-5,
                    None, 8 * GB, "host CPU", JobProfile("cpu", 1)),
}


def get_topology(name: str) -> Topology:
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown topology {name!r}; choose one of {sorted(TOPOLOGIES)}") from None


MAX_CPU_DEVICES = 4096  # simulated on one machine: more only stalls it (the planner uses 512)


def set_cpu_devices(n: int, flag: str = "--cpu-devices") -> None:
    """Simulate `n` CPU devices. Must run before JAX initialises its backends.

    The simulated devices share one thread pool, and a device inside a collective blocks a
    thread until every peer arrives: with the default pool (max(cores, n) threads) the peers'
    work can queue behind the blocked threads and the run stalls (TP all-reduces next to
    pipeline sends do). The pool is sized for two blocked collectives per device plus the
    cores (PJRT_NPROC, read when the CPU client starts; a user's own value wins)."""
    if not 1 <= n <= MAX_CPU_DEVICES:
        sep = "" if flag.endswith("=") else " "
        raise UserError(f"{flag}{sep}{n} must be between 1 and {MAX_CPU_DEVICES} (devices "
                        "simulated on this machine)")
    os.environ.setdefault("PJRT_NPROC", str(2 * n + (os.cpu_count() or 1)))
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
            f"{'is' if n_devices == 1 else 'are'} present; use --cpu-devices {total} to simulate "
            "them, or a smaller mesh.shape")
    return p, n, g


def make_mesh(topology: str | Topology = "cpu", shape: Optional[Sequence[int]] = None,
              nodes: Optional[int] = None, devices: Optional[Sequence] = None, stages: int = 1):
    """Build a `jax.sharding.Mesh` with axes (pair, node, global) and Auto axis types.

    With `stages` > 1 pipeline stages the hosts split into `stage` × `global`: a 4th axis
    STAGE (major: each stage is a contiguous run of hosts) and `global` left with the
    data-parallel host groups, so pair/node/global keep their meaning for every plan."""
    import jax
    from jax.sharding import AxisType, Mesh

    topo = get_topology(topology) if isinstance(topology, str) else topology
    devs = list(devices) if devices is not None else jax.devices()
    devs.sort(key=lambda d: (d.process_index, d.id))
    p, n, g = mesh_shape(topo, len(devs), shape, nodes)
    # device k = g*(N*P) + n*P + p: pairs and nodes are contiguous runs of ids
    arr = np.array(devs[: p * n * g], dtype=object)
    if stages == 1:
        return Mesh(arr.reshape(g, n, p).transpose(2, 1, 0), AXES,
                    axis_types=(AxisType.Auto,) * 3)
    if g % stages:
        raise ConfigError(
            f"parallel.pp_stages={stages} does not divide the {g} host groups of the global "
            f"axis (mesh {p}x{n}x{g}); choose stages that divide {g}, or more nodes")
    arr = arr.reshape(stages, g // stages, n, p).transpose(3, 2, 1, 0)
    return Mesh(arr, AXES + (STAGE,), axis_types=(AxisType.Auto,) * 4)


def mesh_from_config(cfg) -> "jax.sharding.Mesh":  # noqa: F821
    return make_mesh(cfg.mesh.topology, cfg.mesh.shape, cfg.mesh.nodes,
                     stages=cfg.parallel.pp_stages)


def axis_size(mesh, axes: Sequence[str]) -> int:
    """Devices in the group over `axes` of a mesh, or of a {axis: size} dict."""
    shape = mesh if isinstance(mesh, dict) else mesh.shape
    return int(np.prod([shape[a] for a in axes])) if axes else 1
