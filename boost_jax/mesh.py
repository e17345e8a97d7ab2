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


NCCL_COMMIT = "NVIDIA/nccl 5067397c2676d5aed50042fc39e5c8ee96eb0027"
RCCL_COMMIT = "ROCm/rccl 0cbce2a7571c907554199fad7e905f16ec0a565c"
PROTOCOLS = ("LL", "LL128", "Simple")


@dataclass(frozen=True)
class CollLibrary:
    """A collective library's own latency model, as its tuning code states it (microseconds,
    per protocol LL / LL128 / Simple; 0 bandwidth ratio: the protocol is off on that machine).

    base      per call, per algorithm (ring, tree)
    intra     per ring / tree step inside a node (NVLink, or xGMI, which RCCL types as NVLink)
    net       per step between nodes
    bw        the protocol's share of the Simple ring's bandwidth, per algorithm (ring, tree),
              for groups of more than two nodes (bw2: of one or two nodes)
    overhead  a multi-node ring's floor under every intra-node step (the CPU posting network
              requests: getNetOverhead, ×3 for Simple)
    ar_inter  inter-node steps of a ring all-reduce over m nodes: NCCL 2(m−1), RCCL 2m
    ppn1      NCCL: a ring with one rank per node pays the tree's network step latency
    ll_cap    NCCL: the LL protocol's bus bandwidth cap (llMaxBws); plateau: NCCL's ×1.4
    ll128_net NCCL enables LL128 across nodes only when GPU and NIC share a PCIe switch
    pat       NCCL: PAT all-gather / reduce-scatter for a group of one rank per node (Simple):
              (base, divisor of the tree's network step per log2 level, per rank, bandwidth
              share); () where the library has no PAT
    Read by boost_jax/plan/collectives.py; `source` names the file and commit."""

    name: str
    base: dict  # algo -> (LL, LL128, Simple) us
    intra: dict
    net: dict
    bw: dict
    bw2: dict
    overhead: float  # us
    ar_inter_extra: int  # RCCL: +1 per ring all-reduce direction (2m, not 2(m-1))
    source: str
    ppn1_tree_net: bool = False  # NCCL: a ring of one rank per node pays the tree's net latency
    ll_cap: tuple = ()  # NCCL: LL bus bandwidth cap GB/s on 1 / 2 / more nodes (llMaxBws)
    ar_plateau: float = 1.0  # NCCL (sm80+): a multi-node Simple ring all-reduce's latency ×1.4
    ll128_net: bool = True  # LL128 across nodes (NCCL: only if the GPU–NIC path is <= PXB)
    pat: tuple = ()  # NCCL: (base us, log-step divisor, us per rank, bandwidth share)


# RCCL on Frontier: src/graph/tuning.cc tuning_model_3, chosen by rome_model_74 in
# src/graph/rome_models.cc (8 MI250X GCDs at bus ids c1..de on 4 NUMA domains {3,3,1,1,0,0,2,2},
# 4 Cassini NICs: the HPE Cray EX235a node of Frontier); LL128 off there (no ll128Enabled).
# RCCL applies neither NCCL's LL cap nor its all-reduce plateau, and has no PAT at this commit.
# AMD CPU: net overhead 2 us.
RCCL_FRONTIER = CollLibrary(
    "RCCL", base={"ring": (12.0, 12.0, 17.0), "tree": (12.0, 12.0, 17.0)},
    intra={"ring": (0.8, 0.0, 3.6), "tree": (0.8, 0.0, 2.5)},
    net={"ring": (9.5, 0.0, 19.8), "tree": (12.5, 0.0, 22.4)},
    bw={"ring": (0.20, 0.0, 1.0), "tree": (0.20, 0.0, 0.96)},
    bw2={"ring": (0.20, 0.0, 1.0), "tree": (0.20, 0.0, 1.0)},  # tuner's 1.75: capped at 1
    overhead=2.0, ar_inter_extra=1,
    source=f"{RCCL_COMMIT}: src/graph/tuning.cc (baseLat, tuning_model_3, getNetOverhead, "
           "nInterSteps), src/graph/rome_models.cc rome_model_74 (tuning=3)")


def _nccl(overhead: float, cpu: str, ll_cap: tuple) -> CollLibrary:
    """NCCL's default tuner constants (ncclTunerConstantsDefaults) and refinements: ring LL
    ×0.5, LL128 ×0.92 (120/128), tree all-reduce ×0.92 (LL ×0.92/3.8, LL128 ×0.92·120/128),
    LL capped at llMaxBws (Ampere/Hopper one node; AMD or Intel host CPU on 2 / more nodes);
    PAT where every rank is on its own node (ncclPatEnable; baseLat 8, log2(m)·net/3.5 +
    2.8 us per rank, busBw × 0.75)."""
    return CollLibrary(
        "NCCL", base={"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 8.4)},
        intra={"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 4.0)},
        net={"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 14.0)},
        bw={"ring": (0.5, 0.92, 1.0), "tree": (0.92 / 3.8, 0.92 * 120 / 128, 0.92)},
        bw2={"ring": (0.5, 0.92, 1.0), "tree": (0.92 / 3.8, 0.92 * 120 / 128, 0.92)},
        overhead=overhead, ar_inter_extra=0, ppn1_tree_net=True, ll_cap=ll_cap,
        ar_plateau=1.4, pat=(8.0, 3.5, 2.8, 0.75),
        source=f"{NCCL_COMMIT}: src/graph/tuning.cc (ncclTunerConstantsDefaults, "
               f"ncclTopoTuneModel, ncclPatEnable, getNetOverhead: {cpu} CPU {overhead:g} us)")


NCCL_AMD_CPU = _nccl(2.0, "AMD", (87.7, 22.5, 19.0))  # DGX A100: A100, EPYC host
# Perlmutter: the NICs hang off the CPU's PCIe root (NERSC sets NCCL_NET_GDR_LEVEL=PHB, see
# SLINGSHOT_CCL_ENV): GPU-NIC path PHB > PXB, so NCCL turns LL128 off across nodes.
NCCL_PERLMUTTER = dataclasses.replace(NCCL_AMD_CPU, ll128_net=False)
NCCL_INTEL_CPU = _nccl(1.0, "Intel", (141.0, 39.0, 20.4))  # DGX H100: H100, Xeon


@dataclass(frozen=True)
class Topology:
    name: str
    pair: int  # devices sharing the fastest link
    node: int  # pairs per host
    # Per-device one-direction bandwidth (bytes/s) of each level; a ring runs at its slowest link
    bw_pair: float
    bw_node: float
    bw_global: float
    # Dense bf16 FLOP/s per device; None: measured on this machine (see `peak_flops`).
    nominal_peak_flops: Optional[float]
    hbm_bytes: float  # memory per device
    device: str = ""
    job: Optional[JobProfile] = None  # how a batch job runs on it (boost_jax.launch)
    library: CollLibrary = NCCL_AMD_CPU  # whose collectives run on it (latency per step)

    @property
    def peak_flops(self) -> float:
        """One device's peak; for `cpu`, this host's rate shared by this process's devices."""
        return self.device_peak()

    def device_peak(self, devices: Optional[int] = None) -> float:
        """One device's dense FLOP/s when `devices` share the host (`cpu` only: a plan of N
        simulated devices runs them all on this machine, whatever this process holds)."""
        if self.nominal_peak_flops is not None:
            return self.nominal_peak_flops
        from boost_jax.backends.cpu_peak import cpu_peak_flops  # lazy: probes on first use

        return cpu_peak_flops(devices)

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
        """Seconds per ring step (Simple protocol) on a level's link: the library's hardware
        latency inside a node, or between nodes (boost_jax/plan/collectives.py composes them)."""
        lib = self.library
        return (lib.net if level == "global" else lib.intra)["ring"][2] * 1e-6


GB = 1e9
TOPOLOGIES: dict[str, Topology] = {
    # Frontier. Node: 4 MI250X = 8 GCDs; the two GCDs of a package share 4 Infinity Fabric
    # links = 200 GB/s each way (pair); GCDs of different packages are joined by 1 or 2 IF
    # links of 50 GB/s each way (OLCF Frontier user guide, "Node Types" figure; the link
    # counts of RCCL's tools/topo_expl/models/topo_8p1h_3.xml). One ring through the 4
    # packages runs at its slowest link, 50 GB/s; RCCL runs 4 ring orders at once over
    # disjoint cross-package links (rome_model_74's ringBase), 200 GB/s at most. Measured:
    # 90 GB/s bus bandwidth for RCCL's 8-GCD all-gather of 1 GiB (VALIDATION_SOURCE in
    # benchmarks/published.py): node = 100 GB/s, two links, which eta_net brings to 80.
    # 4 HPE Slingshot-11 NICs of 200 Gb/s = 25 GB/s each way, one per package: a GCD's ring
    # leaves by its package's NIC, 100 GB/s per node (nic_node; arXiv 2501.04266 §2).
    # 191.5 TFLOP/s dense bf16 and 64 GB HBM2e per GCD (AMD MI250X datasheet: 383 TFLOP/s
    # per package). Collectives: RCCL (RCCL_FRONTIER).
    "frontier": Topology("frontier", 2, 4, 200 * GB, 100 * GB, 12.5 * GB,
                         191.5e12, 64 * GB, "AMD MI250X GCD", FRONTIER_JOB, RCCL_FRONTIER),
    # Perlmutter GPU nodes (NERSC "Perlmutter Architecture"): 4 A100 fully connected by
    # NVLink 3 — 12 links x 25 GB/s per GPU, 4 links (100 GB/s each way) to each of the 3
    # peers (NVIDIA A100 datasheet: 600 GB/s bidirectional per GPU). A pair-level collective
    # has only its direct 100 GB/s; a collective over all 4 GPUs drives all 3 peer links at
    # once (NCCL runs its rings/channels over every link): 3 x 100 = 300 GB/s per GPU each
    # way. 4 Slingshot-11 NICs x 25 GB/s = 100 GB/s per node (nic_node). 312 TFLOP/s dense
    # bf16 (A100 datasheet), 40/80 GB HBM2e. AMD EPYC 7763 host: NCCL_PERLMUTTER.
    "perlmutter": Topology("perlmutter", 2, 2, 100 * GB, 300 * GB, 25 * GB,
                           312e12, 40 * GB, "NVIDIA A100-40GB", PERLMUTTER_JOB, NCCL_PERLMUTTER),
    "perlmutter-80": Topology("perlmutter-80", 2, 2, 100 * GB, 300 * GB, 25 * GB,
                              312e12, 80 * GB, "NVIDIA A100-80GB",
                              dataclasses.replace(PERLMUTTER_JOB, constraint="gpu&hbm80g"),
                              NCCL_PERLMUTTER),
    # DGX H100 (NVIDIA datasheet): 8 H100 SXM on NVSwitch, NVLink 4 450 GB/s each way per GPU;
    # 8 x 400 Gb/s InfiniBand = 50 GB/s per GPU; 989 TFLOP/s dense bf16, 80 GB HBM3; Intel
    # Xeon hosts. Job: a generic SLURM cluster of DGX nodes (NCCL's InfiniBand defaults).
    "dgx-h100": Topology("dgx-h100", 2, 4, 450 * GB, 450 * GB, 50 * GB,
                         989e12, 80 * GB, "NVIDIA H100 SXM",
                         JobProfile("cuda", 8, gpus_per_node=8, xla_flags=GPU_XLA_FLAGS),
                         NCCL_INTEL_CPU),
    # DGX A100 (NVIDIA DGX A100 datasheet; Selene, where Megatron-LM's published runs ran):
    # 8 A100-80GB on NVSwitch, NVLink 3 600 GB/s bidirectional = 300 GB/s each way per GPU;
    # 8 x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU (200 GB/s per node); 312 TFLOP/s bf16;
    # AMD EPYC hosts.
    "dgx-a100": Topology("dgx-a100", 2, 4, 300 * GB, 300 * GB, 25 * GB,
                         312e12, 80 * GB, "NVIDIA A100-80GB SXM",
                         JobProfile("cuda", 8, gpus_per_node=8, xla_flags=GPU_XLA_FLAGS)),
    # Simulated CPU devices for tests and laptops; bandwidths and collective library mirror
    # Frontier's so the communication analysis means something; peak FLOP/s is this machine's
    # measured fp32 GEMM rate shared by its simulated devices (boost_jax.backends.cpu_peak).
    # Job: one process per node simulating its 4 devices (the local SLURM stand-in's dry run).
    "cpu": Topology("cpu", 2, 2, 200 * GB, 100 * GB, 12.5 * GB,
                    None, 8 * GB, "host CPU", JobProfile("cpu", 1), RCCL_FRONTIER),
}


OLCF = "OLCF Frontier user guide (olcf/olcf-user-docs@2745903 systems/frontier_user_guide.rst)"
_A100 = "NVIDIA A100 datasheet"
# Where each number of each profile comes from (the README's constants table is built from it;
# tests/unit/test_network_model.py checks every field of every profile has one).
TOPOLOGY_SOURCES = {
    "frontier": {
        "pair": f"{OLCF}: 2 GCDs per MI250X", "node": f"{OLCF}: 4 MI250X per node",
        "bw_pair": f"{OLCF}: the two GCDs of an MI250X, 4 Infinity Fabric links, 200+200 GB/s",
        "bw_node": "RCCL's measured 8-GCD all-gather, 90 GB/s bus bandwidth at 1 GiB (benchmarks/"
                   "published.py COLLECTIVE_CALIBRATION), read as 2 IF links of 50 GB/s (80 at "
                   "eta_net); one ring's slowest hop is 1 link, RCCL's 4 rings reach 200 at most "
                   f"({OLCF}; RCCL tools/topo_expl/models/topo_8p1h_3.xml)",
        "bw_global": f"{OLCF}: 4 Slingshot-11 NICs of 25 GB/s, one per MI250X: 12.5 per GCD",
        "nominal_peak_flops": "AMD MI250X datasheet: 383 TFLOP/s bf16 per package, 2 GCDs",
        "hbm_bytes": f"{OLCF}: 64 GB HBM2e per GCD",
        "library": RCCL_FRONTIER.source,
    },
    "perlmutter": {
        "pair": "NERSC Perlmutter architecture: 4 A100 per node (2 pairs)",
        "node": "NERSC Perlmutter architecture: 4 A100 per node",
        "bw_pair": f"{_A100}: 12 NVLink-3 links of 25 GB/s; 4 to each of 3 peers = 100 GB/s",
        "bw_node": f"{_A100}: all 12 NVLink-3 links, 300 GB/s each way (NCCL drives every link)",
        "bw_global": "NERSC: 4 Slingshot-11 NICs of 25 GB/s per node, 25 per GPU",
        "nominal_peak_flops": f"{_A100}: 312 TFLOP/s dense bf16",
        "hbm_bytes": f"{_A100}: 40 GB HBM2e",
        "library": NCCL_PERLMUTTER.source + "; LL128 off across nodes (GPU-NIC path PHB)",
    },
    "dgx-h100": {
        "pair": "NVIDIA DGX H100 datasheet: 8 GPUs", "node": "NVIDIA DGX H100 datasheet: 8 GPUs",
        "bw_pair": "NVIDIA H100 datasheet: NVLink 4, 900 GB/s bidirectional per GPU",
        "bw_node": "NVIDIA DGX H100 datasheet: NVSwitch, 450 GB/s each way per GPU",
        "bw_global": "NVIDIA DGX H100 datasheet: 8 x 400 Gb/s InfiniBand, 50 GB/s per GPU",
        "nominal_peak_flops": "NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16",
        "hbm_bytes": "NVIDIA H100 SXM datasheet: 80 GB HBM3", "library": NCCL_INTEL_CPU.source,
    },
    "dgx-a100": {
        "pair": "NVIDIA DGX A100 datasheet: 8 GPUs", "node": "NVIDIA DGX A100 datasheet: 8 GPUs",
        "bw_pair": f"{_A100}: NVLink 3, 600 GB/s bidirectional per GPU",
        "bw_node": "NVIDIA DGX A100 datasheet: NVSwitch, 300 GB/s each way per GPU",
        "bw_global": "NVIDIA DGX A100 datasheet: 8 x 200 Gb/s HDR InfiniBand, 25 GB/s per GPU",
        "nominal_peak_flops": f"{_A100}: 312 TFLOP/s dense bf16",
        "hbm_bytes": f"{_A100}: 80 GB HBM2e", "library": NCCL_AMD_CPU.source,
    },
    "cpu": {k: "simulated devices for tests: Frontier's links and library mirrored; peak FLOP/s "
               "measured on this machine (boost_jax.backends.cpu_peak)"
            for k in ("pair", "node", "bw_pair", "bw_node", "bw_global", "nominal_peak_flops",
                      "hbm_bytes", "library")},
}
TOPOLOGY_SOURCES["perlmutter-80"] = dict(TOPOLOGY_SOURCES["perlmutter"],
                                         hbm_bytes=f"{_A100}: 80 GB HBM2e")
SOURCED_FIELDS = ("pair", "node", "bw_pair", "bw_node", "bw_global", "nominal_peak_flops",
                  "hbm_bytes", "library")


def check_node_shape(shape: Optional[Sequence[int]], topo: Topology, nodes: int) -> None:
    """mesh.shape's pair x node must be the devices one node of `topo` holds."""
    if shape is None:
        return
    p, n, _ = shape
    if p * n != topo.devices_per_node:
        raise UserError(
            f"mesh.shape={list(shape)} puts pair {p} x node {n} = {p * n} devices on each node "
            f"but a {topo.name} node has {topo.devices_per_node} ({topo.device}); use "
            f"mesh.shape=[{topo.pair},{topo.node},{nodes}] or drop mesh.shape")


def get_topology(name: str) -> Topology:
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown topology {name!r}; choose one of {sorted(TOPOLOGIES)}") from None


CPU_SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
CPU_SCHEDULER_OURS = "BOOST_JAX_CPU_SCHEDULER_SET"  # the flag in XLA_FLAGS is set_cpu_devices'
MAX_CPU_DEVICES = 4096  # simulated on one machine: more only stalls it (the planner uses 512)


def set_cpu_devices(n: int, flag: str = "--cpu-devices", compile_only: bool = False) -> None:
    """Simulate `n` CPU devices. Must run before JAX initialises its backends.

    The simulated devices share one thread pool, and a device inside a collective blocks a
    thread until every peer arrives: with the default pool (max(cores, n) threads) the peers'
    work can queue behind the blocked threads and the run stalls (TP all-reduces next to
    pipeline sends do). The pool is sized for two blocked collectives per device plus the
    cores (PJRT_NPROC, read when the CPU client starts; a user's own value wins). Where the
    JAX release needs it (compat.cpu_collectives_need_one_order), several devices that run
    collectives get XLA:CPU's concurrency-optimized scheduler turned off, unless the user set
    it; `compile_only` (the planner, tools that report compiled memory) keeps XLA's schedule,
    also in a child process of a run that turned it off."""
    if not 1 <= n <= MAX_CPU_DEVICES:
        sep = "" if flag.endswith("=") else " "
        raise UserError(f"{flag}{sep}{n} must be between 1 and {MAX_CPU_DEVICES} (devices "
                        "simulated on this machine)")
    os.environ.setdefault("PJRT_NPROC", str(2 * n + (os.cpu_count() or 1)))
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
    from boost_jax.compat import cpu_collectives_need_one_order

    ours = os.environ.pop(CPU_SCHEDULER_OURS, None) == "1"  # not the user's: an earlier call's
    if ours:
        flags = " ".join(f for f in flags.split() if CPU_SCHEDULER_FLAG not in f)
    if n > 1 and not compile_only and cpu_collectives_need_one_order() \
            and CPU_SCHEDULER_FLAG not in flags:
        flags = f"{flags} --{CPU_SCHEDULER_FLAG}=false"
        os.environ[CPU_SCHEDULER_OURS] = "1"  # children inherit XLA_FLAGS and this
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
    n = 1
    for a in axes:  # not np.prod: the planner's search calls this a million times
        n *= int(shape[a])
    return n
