"""α–β cost of collectives (analytic or measured from a compiled step's HLO), per device.

network   every collective is a ring over its group: per device it sends
              all-reduce 2(n−1)/n·P, all-gather / reduce-scatter (n−1)/n·P
          (P = the un-sharded buffer) at eta_net × the per-device bandwidth of the slowest level
          the group spans (topology.bw_pair / bw_node / bw_global), plus a latency α_level ·
          ⌈log2 n⌉ per call. A ring that crosses nodes is charged the per-device share of the
          node's NICs for all its bytes (the accounting the design and the analyzer use; an
          ideal hierarchical algorithm could be up to devices-per-node × faster on that level).
          An all-to-all (qgZ) sends (n−1)/n·P as n−1 messages: latency α_level · (n−1).
overlap   tensor-parallel collectives sit on the critical path (the next GEMM needs them): never
          overlapped. Data-parallel (ZeRO) gathers and reduce-scatters of a micro-batch may hide
          behind that micro-batch's compute: exposed = max(0, t_dp − dp_overlap · t_compute);
          dp_overlap = 0 (nothing hidden) by default, and the report also gives the fully
          overlapped bound. Once-per-step work (cross-node gradient reduction, weight re-gather,
          optimizer) is exposed.

The same functions turn *measured* collectives (from a compiled step's HLO, see
`boost_jax.analysis.comm`) into time, so a compiled plan and an analytic one are costed alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from boost_jax.analysis.comm import ring_bytes
from boost_jax.mesh import AXES, Topology
from boost_jax.plan.roofline import Assumptions


def level_of(axes: Sequence[str]) -> str:
    axes = set(axes)
    if not axes:
        return "none"
    if "global" in axes or "stage" in axes:  # pipeline stages are groups of hosts
        return "global"
    if "node" in axes:
        return "node"
    return "pair"


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

    @property
    def bytes_per_step(self) -> float:
        return ring_bytes(self.kind, self.n, self.payload) * self.calls


def coll_time(c: Coll, topo: Topology, a: Assumptions) -> float:
    if c.n <= 1 or c.level not in AXES:
        return 0.0
    bw = topo.bandwidth(c.level) * a.eta_net
    # an all-to-all (qgZ) sends one message to each of the n−1 peers; the rings' steps pipeline
    hops = c.n - 1 if c.kind == "all-to-all" else math.ceil(math.log2(c.n))
    return c.bytes_per_step / bw + c.calls * topo.latency(c.level) * hops


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

    @classmethod
    def of(cls, colls: Sequence[Coll], topo: Topology, a: "Assumptions") -> "CommSummary":
        ph = {p: 0.0 for p in ("tp", "dp", "step")}
        lt = {lv: 0.0 for lv in AXES}
        for c in colls:
            t = coll_time(c, topo, a)
            ph[c.phase] = ph.get(c.phase, 0.0) + t
            if c.level in lt:
                lt[c.level] += t
        return cls(ph, per_level_bytes(colls), lt)

    def combine(self, other: "CommSummary", w_self: float, w_other: float) -> "CommSummary":
        def mix(a, b):
            return {k: w_self * a.get(k, 0.0) + w_other * b.get(k, 0.0) for k in set(a) | set(b)}

        return CommSummary(mix(self.phase_time, other.phase_time),
                           mix(self.level_bytes, other.level_bytes),
                           mix(self.level_time, other.level_time))


def colls_from_report(report, tp_axes: Sequence[str], micro_batches: int) -> list[Coll]:
    """Measured collectives (CommReport) → Colls. Phase: groups inside the TP axes are TP;
    other collectives inside a loop (layers, micro-batches) are dp; the rest are "step"."""
    del micro_batches
    tp = set(tp_axes)
    out = []
    for c in report.collectives:
        axes = tuple(c.axes)
        if (tp and axes and set(axes) <= tp) or c.kind == "collective-permute":
            phase = "tp"  # on the critical path: TP collectives and the pipeline's sends
        elif c.in_loop:
            phase = "dp"
        else:
            phase = "step"
        out.append(Coll(c.name, c.kind, c.payload_bytes, c.group_size, c.level,
                        float(c.trip_count or 1), phase, axes))
    return out
