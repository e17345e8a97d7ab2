"""α–β cost of collectives on the links they cross (analytic or measured from a compiled step).

links     a collective is a ring over its group; per device it sends
              all-reduce 2(n−1)/n·P, all-gather / reduce-scatter (n−1)/n·P
          (P = the un-sharded buffer). Three link classes carry it (boost_jax/mesh.py gives each
          bandwidth with its source):
            pair    the fastest link (MI250X: the two GCDs of a package; A100: one NVLink peer)
            node    the other links inside a host
            NIC     the host's network cards, shared by the whole node (topology.nic_node)
          A group inside a host runs at eta_net × its level's per-device bandwidth. A ring that
          spans hosts is ordered so that its k members on one host are contiguous (NCCL/RCCL
          build rings that way): it leaves each host once, so a host's NICs carry one
          device's ring bytes per group, and every group of the same collective that leaves
          the host at the same time (devices_on_host / k of them) shares the NICs:
              t = max(groups · ring_bytes / nic_node, ring_bytes / intra-host link) / eta_net
          With k = 1 (a group with one member per host) this is the per-device share of the
          NICs. An all-to-all (qgZ) sends (n−1)/n·P as n−1 messages, k·(n−k)/n·P of a group's
          leaving the host; a pipeline send moves P per device.
latency   α_level per step of the algorithm: ⌈log2 n⌉ per call (n−1 for an all-to-all).
overlap   applied by boost_jax.plan.costmodel (see its docstring and boost_jax/mesh.py
          GPU_XLA_FLAGS).

The same functions turn *measured* collectives (from a compiled step's HLO, see
`boost_jax.analysis.comm`) into time, so a compiled plan and an analytic one are costed alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from boost_jax.analysis.comm import egress_bytes
from boost_jax.mesh import AXES, Topology
from boost_jax.sharding.step_collectives import ring_bytes
from boost_jax.plan.roofline import Assumptions

HOST_AXES = ("pair", "node")  # mesh axes inside one host; global and stage cross hosts


def host_split(axes: Sequence[str], sizes: Optional[dict]) -> tuple[int, int]:
    """(k, groups): a group's members on one host, and the groups of the same collective that
    share that host. (0, 0) when the mesh sizes are unknown (then k = 1 is assumed)."""
    if not sizes:
        return 0, 0
    k = math.prod(int(sizes.get(a, 1)) for a in axes if a in HOST_AXES)
    on_host = math.prod(int(sizes.get(a, 1)) for a in HOST_AXES)
    return k, max(on_host // max(k, 1), 1)


@dataclass
class Coll:
    """A collective as the cost model sees it (analytic or measured)."""

    name: str
    kind: str
    payload: float  # bytes of the un-sharded buffer (ring formula's P)
    n: int  # group size
    level: str  # pair | node | global | none
    calls: float  # executions per optimizer step
    phase: str  # tp (critical path) | dp (per micro-batch, may overlap) | step (once per step)
    axes: tuple = ()
    host_members: int = 0  # k: members of one group on one host (0: unknown, taken as 1)
    host_groups: int = 0  # groups sharing a host's NICs (0: unknown, every device's own)

    @property
    def bytes_per_step(self) -> float:
        return ring_bytes(self.kind, self.n, self.payload) * self.calls

    def egress_per_step(self, topo: Topology) -> float:
        """Bytes that leave one host through its NICs per step (0 inside a host)."""
        if self.level != "global" or self.n <= 1:
            return 0.0
        k = self.host_members or 1
        groups = self.host_groups or max(topo.devices_per_node // k, 1)
        return egress_bytes(self.kind, self.n, self.payload, k, groups) * self.calls


def _intra_level(c: Coll) -> str:
    return "node" if "node" in c.axes else "pair"


def coll_latency(c: Coll, topo: Topology) -> float:
    """The per-call latency part of coll_time: α per step of the algorithm, every call."""
    if c.n <= 1 or c.level not in AXES:
        return 0.0
    # an all-to-all (qgZ) sends one message to each of the n−1 peers; the rings' steps pipeline
    hops = c.n - 1 if c.kind == "all-to-all" else math.ceil(math.log2(c.n))
    return c.calls * topo.latency(c.level) * hops


def coll_time(c: Coll, topo: Topology, a: Assumptions) -> float:
    if c.n <= 1 or c.level not in AXES:
        return 0.0
    lat = coll_latency(c, topo)
    if c.level != "global":
        return c.bytes_per_step / (topo.bandwidth(c.level) * a.eta_net) + lat
    t_nic = c.egress_per_step(topo) / (topo.nic_node * a.eta_net)
    k = c.host_members or 1
    t_in = 0.0
    if k > 1:  # k−1 of the k members on a host pass their ring bytes over the host's links
        t_in = c.bytes_per_step / (topo.bandwidth(_intra_level(c)) * a.eta_net)
    return max(t_nic, t_in) + lat


def per_level_bytes(colls: Sequence[Coll]) -> dict[str, float]:
    out = {lv: 0.0 for lv in AXES}
    for c in colls:
        if c.level in out:
            out[c.level] += c.bytes_per_step
    return out


@dataclass
class CommSummary:
    """Collective cost aggregated per phase and per level (linear: can be extrapolated)."""

    phase_time: dict  # tp | dp | step → seconds per optimizer step
    level_bytes: dict  # pair | node | global → bytes per device per step
    level_time: dict  # pair | node | global → seconds per step
    egress: dict = None  # tp | dp | step → bytes leaving one host through its NICs per step
    latency: dict = None  # tp | dp | step → of phase_time, the per-call latency (α) part

    @classmethod
    def of(cls, colls: Sequence[Coll], topo: Topology, a: "Assumptions") -> "CommSummary":
        ph = {p: 0.0 for p in ("tp", "dp", "step")}
        eg, lat = dict(ph), dict(ph)
        lt = {lv: 0.0 for lv in AXES}
        for c in colls:
            t = coll_time(c, topo, a)
            ph[c.phase] = ph.get(c.phase, 0.0) + t
            eg[c.phase] = eg.get(c.phase, 0.0) + c.egress_per_step(topo)
            lat[c.phase] = lat.get(c.phase, 0.0) + coll_latency(c, topo)
            if c.level in lt:
                lt[c.level] += t
        return cls(ph, per_level_bytes(colls), lt, eg, lat)

    @property
    def dp_latency(self) -> float:
        return (self.latency or {}).get("dp", 0.0)

    @property
    def node_egress(self) -> float:
        return sum((self.egress or {}).values())

    def nic_seconds(self, topo: Topology, a: "Assumptions") -> float:
        """What a node's NICs need for its egress: no overlap takes a step below it."""
        return self.node_egress / (topo.nic_node * a.eta_net) if topo.nic_node else 0.0

    def combine(self, other: "CommSummary", w_self: float, w_other: float) -> "CommSummary":
        def mix(a, b):
            a, b = a or {}, b or {}
            return {k: w_self * a.get(k, 0.0) + w_other * b.get(k, 0.0) for k in set(a) | set(b)}

        return CommSummary(mix(self.phase_time, other.phase_time),
                           mix(self.level_bytes, other.level_bytes),
                           mix(self.level_time, other.level_time), mix(self.egress, other.egress),
                           mix(self.latency, other.latency))


def colls_from_report(report, tp_axes: Sequence[str], micro_batches: int) -> list[Coll]:
    """Measured collectives (CommReport) → Colls. Phase: groups inside the TP axes are TP;
    other collectives inside a loop (layers, micro-batches) are dp; the rest are "step"."""
    del micro_batches
    tp = set(tp_axes)
    sizes = dict(getattr(report, "mesh_shape", {}) or {})
    out = []
    for c in report.collectives:
        axes = tuple(c.axes)
        if (tp and axes and set(axes) <= tp) or c.kind == "collective-permute":
            phase = "tp"  # on the critical path: TP collectives and the pipeline's sends
        elif c.in_loop:
            phase = "dp"
        else:
            phase = "step"
        k, groups = host_split(axes, sizes)
        out.append(Coll(c.name, c.kind, c.payload_bytes, c.group_size, c.level,
                        float(c.trip_count or 1), phase, axes, k, groups))
    return out
