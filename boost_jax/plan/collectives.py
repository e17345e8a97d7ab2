"""Collectives as NCCL / RCCL run them: bytes on the links they cross, latency per call.

bytes     per device: all-reduce 2(n−1)/n·P, all-gather / reduce-scatter (n−1)/n·P (P = the
          un-sharded buffer), at eta_net × the slowest link of the ring (boost_jax/mesh.py). A
          ring spanning hosts keeps its k members on a host contiguous and leaves the host
          once; the host's NICs are shared by the groups leaving it at once:
              β = max(groups · ring_bytes / nic_node, ring_bytes / intra-host link) / eta_net
          An all-to-all sends k·(n−k)/n·P of a group off the host; a send moves P.
latency   the library's own tuning model (topology.library, src/graph/tuning.cc), microseconds
          per call for n ranks on m nodes, protocol p ∈ {LL, LL128, Simple}:
            ring   base + (S − S_net)·max(intra, overhead) + S_net·net, S = n−1 steps
                   (all-reduce 2(n−1)), S_net = m−1 (all-reduce 2(m−1), RCCL 2m)
            tree   base + 2((n/m − 1)·intra + ⌊log2 m⌋·net)          (all-reduce only)
            pat    base + ⌊log2 m⌋·net_tree/3.5 + 2.8·n, bytes at 0.75 of the bus bandwidth
                   (NCCL's all-gather / reduce-scatter over one rank per node, m = n)
          all-gather / reduce-scatter run as rings (or PAT); an all-reduce as ring or tree;
          each call takes the (algorithm, protocol) of least latency + β / (protocol's
          bandwidth share), as the library's tuner picks. An all-to-all is n−1 Simple
          messages (k−1 in the host, n−k across); a pipeline send or a log_step exchange
          (sharding/bucket.py) one.
overhead  applied by boost_jax.plan.costmodel (see its docstring and GPU_XLA_FLAGS).

The same functions cost *measured* collectives (a compiled step's HLO, boost_jax.analysis.comm),
so a compiled plan and an analytic one are costed alike. Derivation: benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from boost_jax.analysis.comm import egress_bytes
from boost_jax.mesh import AXES, PROTOCOLS, Topology
from boost_jax.names import STAGE_AXIS
from boost_jax.sharding.step_collectives import combined, combined_bytes, ring_bytes
from boost_jax.plan.overlap import XLA_COMBINED
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
    runs: str = ""  # the pass it runs in (step_collectives.RUNS); "" unknown (measured)
    where: str = ""  # measured: the HLO computation it runs in (a loop body, the entry)

    @property
    def bytes_per_step(self) -> float:
        return ring_bytes(self.kind, self.n, self.payload) * self.calls

    def egress_per_call(self, topo: Topology) -> float:
        """Bytes that leave one host through its NICs per call (0 inside a host)."""
        if self.level != "global" or self.n <= 1:
            return 0.0
        k = self.host_members or 1
        groups = self.host_groups or max(topo.devices_per_node // k, 1)
        return egress_bytes(self.kind, self.n, self.payload, k, groups)

    def egress_per_step(self, topo: Topology) -> float:
        return self.egress_per_call(topo) * self.calls


def _intra_level(c: Coll) -> str:
    return "node" if "node" in c.axes else "pair"


def nodes_spanned(c: Coll) -> int:
    """m: hosts a group spans (its k members on a host are contiguous)."""
    if c.level != "global":
        return 1
    return max(c.n // (c.host_members or 1), 1)


def bytes_seconds(c: Coll, topo: Topology, a: Assumptions) -> float:
    """Seconds per call for the bytes alone (a ring at its slowest link, the NICs shared)."""
    per_call = ring_bytes(c.kind, c.n, c.payload)
    if c.level != "global":
        return per_call / (topo.bandwidth(c.level) * a.eta_net)
    t_nic = c.egress_per_call(topo) / (topo.nic_node * a.eta_net)
    t_in = 0.0
    if (c.host_members or 1) > 1:  # k−1 of the k members on a host pass bytes inside it
        t_in = per_call / (topo.bandwidth(_intra_level(c)) * a.eta_net)
    return max(t_nic, t_in)


def ring_latency(lib, kind: str, n: int, m: int, p: int) -> float:
    """Microseconds per call of a ring over n ranks on m nodes, protocol index p."""
    ar = kind == "all-reduce"
    steps = 2 * (n - 1) if ar else n - 1
    inter = 0 if m == 1 else (2 * (m - 1 + lib.ar_inter_extra) if ar else m - 1)
    intra = lib.intra["ring"][p]
    simple = PROTOCOLS[p] == "Simple"
    if m > 1:  # the CPU posts every step's network request
        intra = max(intra, lib.overhead * (3 if simple else 1))
    net = lib.net["tree" if lib.ppn1_tree_net and n == m else "ring"][p]
    lat = lib.base["ring"][p] + (steps - inter) * intra + inter * net
    return lat * (lib.ar_plateau if ar and simple and m > 1 else 1.0)


def tree_latency(lib, n: int, m: int, p: int) -> float:
    """Microseconds per call of a tree all-reduce over n ranks on m nodes."""
    return lib.base["tree"][p] + 2 * ((n // m - 1) * lib.intra["tree"][p]
                                      + int(math.log2(m)) * lib.net["tree"][p])


def pat_latency(lib, n: int, m: int) -> float:
    """Microseconds per call of NCCL's PAT all-gather / reduce-scatter over n ranks, one per
    node: a logarithmic part at the tree's network step (ppn = 1) and a part linear in n."""
    base, div, per_rank, _ = lib.pat
    return base + int(math.log2(m)) * lib.net["tree"][2] / div + n * per_rank


def _p2p_latency(c: Coll, lib, m: int) -> float:
    """An all-to-all: n−1 Simple messages (k−1 inside the host); a send: one."""
    k = c.n // m
    if c.kind == "all-to-all":
        return lib.base["ring"][2] + (k - 1) * lib.intra["ring"][2] + (c.n - k) * lib.net[
            "ring"][2]
    return lib.base["ring"][2] + (lib.net if m > 1 else lib.intra)["ring"][2]


def call_cost(c: Coll, topo: Topology, a: Assumptions,
              algorithms: Sequence[str] = ("ring", "tree", "pat")) -> tuple[float, float, str]:
    """(latency s, bytes s, "algorithm/protocol") of one call, as the library's tuner picks:
    ring (all-reduce: or tree) per protocol, and NCCL's PAT for an all-gather or a
    reduce-scatter whose ranks are each on their own node (its bytes at 0.75 of the bus
    bandwidth, not n/(n−1) of it: src/graph/tuning.cc). `algorithms` narrows the choice of
    a collective as NCCL_ALGO does (the tuner still picks the protocol; an all-to-all or a send
    has no choice); an unknown name, or none that runs the call: ValueError."""
    if isinstance(algorithms, str) or not set(algorithms) <= {"ring", "tree", "pat"}:
        raise ValueError(f"algorithms must be a tuple of ring, tree, pat: {algorithms!r}")
    lib, m, beta = topo.library, nodes_spanned(c), bytes_seconds(c, topo, a)
    if c.kind not in ("all-gather", "reduce-scatter", "all-reduce"):
        return _p2p_latency(c, lib, m) * 1e-6, beta, "p2p/Simple"
    best = None
    ratios = lib.bw if m > 2 else lib.bw2
    for algo in ("ring", "tree") if c.kind == "all-reduce" else ("ring",):
        for p, proto in enumerate(PROTOCOLS):
            if (algo not in algorithms or ratios[algo][p] <= 0
                    or (proto == "LL128" and m > 1 and not lib.ll128_net)):
                continue
            lat = (ring_latency(lib, c.kind, c.n, m, p) if algo == "ring"
                   else tree_latency(lib, c.n, m, p)) * 1e-6
            b = beta / ratios[algo][p] * (c.n / (c.n - 1) if algo == "tree" else 1.0)
            if proto == "LL" and lib.ll_cap:  # the LL bus bandwidth cap
                cap = lib.ll_cap[min(m, 3) - 1] * 1e9
                b = max(b, ring_bytes(c.kind, c.n, c.payload) / cap)
            if best is None or lat + b < best[0] + best[1]:
                best = (lat, b, f"{algo}/{proto}")
    if "pat" in algorithms and lib.pat and c.kind != "all-reduce" and m == c.n > 1:
        lat, b = pat_latency(lib, c.n, m) * 1e-6, beta * c.n / (c.n - 1) / lib.pat[3]
        if best is None or lat + b < best[0] + best[1]:
            best = (lat, b, "pat/Simple")
    if best is None:
        raise ValueError(f"{lib.name} cannot run a {c.kind} over {c.n} ranks on {m} nodes "
                         f"with {'/'.join(algorithms)}")
    return best


def coll_times(c: Coll, topo: Topology, a: Assumptions) -> tuple[float, float]:
    """(seconds, of them the per-call latency part) of every call of the step."""
    if c.n <= 1 or c.level not in AXES:
        return 0.0, 0.0
    lat, beta, _ = call_cost(c, topo, a)
    return c.calls * (lat + beta), c.calls * lat


def coll_latency(c: Coll, topo: Topology, a: Optional[Assumptions] = None) -> float:
    """The per-call latency part of coll_time, every call of the step."""
    return coll_times(c, topo, a or Assumptions())[1]


def coll_time(c: Coll, topo: Topology, a: Assumptions) -> float:
    return coll_times(c, topo, a)[0]


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
    pass_time: dict = None  # of phase_time["dp"], by the pass it runs in (Coll.runs)

    @classmethod
    def of(cls, colls: Sequence[Coll], topo: Topology, a: "Assumptions") -> "CommSummary":
        ph = {p: 0.0 for p in ("tp", "dp", "step")}
        eg, lat, runs = dict(ph), dict(ph), {}
        lt = {lv: 0.0 for lv in AXES}
        for c in colls:
            t, alpha = coll_times(c, topo, a)
            ph[c.phase] = ph.get(c.phase, 0.0) + t
            eg[c.phase] = eg.get(c.phase, 0.0) + c.egress_per_step(topo)
            lat[c.phase] = lat.get(c.phase, 0.0) + alpha
            if c.level in lt:
                lt[c.level] += t
            if c.phase == "dp":
                runs[c.runs] = runs.get(c.runs, 0.0) + t
        return cls(ph, per_level_bytes(colls), lt, eg, lat, runs)

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
                           mix(self.latency, other.latency), mix(self.pass_time, other.pass_time))


def colls_from_report(report, tp_axes: Sequence[str], micro_batches: int) -> list[Coll]:
    """Measured collectives (CommReport) → Colls, the calls as compiled. Phase: groups inside
    the TP axes and the pipeline's sends (permutes over `stage`) are TP; other collectives
    inside a loop (layers, micro-batches; log_step's exchanges among them) are dp; the rest
    are "step"."""
    del micro_batches
    tp = set(tp_axes)
    sizes = dict(getattr(report, "mesh_shape", {}) or {})
    out = []
    for c in report.collectives:
        axes = tuple(c.axes)
        if (tp and axes and set(axes) <= tp) or (c.kind == "collective-permute"
                                                 and STAGE_AXIS in axes):
            phase = "tp"  # on the critical path: TP collectives and the pipeline's sends
        elif c.in_loop:
            phase = "dp"
        else:
            phase = "step"
        k, groups = host_split(axes, sizes)
        out.append(Coll(c.name, c.kind, c.payload_bytes, c.group_size, c.level,
                        float(c.trip_count or 1), phase, axes, k, groups, where=c.computation))
    return out


def gpu_combined(colls: list[Coll], limit: float) -> list[Coll]:
    """A CPU program's collectives as the GPU program issues them. XLA:CPU merges no
    all-gathers or reduce-scatters (the engine leaves them one per weight, sharding/bucket.py);
    XLA's GPU combiners merge a loop body's independent ones of one kind and group (a layer's
    weights) into calls of results up to `limit` bytes, in order (step_collectives.combined,
    the rule the analytic list follows). The bytes are unchanged; the calls, and so the
    per-call latencies, are the GPU's. Outside loops (the embedding's, the head's, the step's
    end) and TP collectives (each waits on the one before) stay as compiled, as a GPU program
    compiled for an A100 issues them (benchmarks/README.md)."""
    out: list[Coll] = []
    groups: dict[tuple, list[Coll]] = {}
    for c in colls:
        if c.phase != "dp" or c.kind not in XLA_COMBINED:
            out.append(c)
        else:
            groups.setdefault((c.where, c.kind, c.axes, c.n, c.calls), []).append(c)
    for members in groups.values():
        per_run = combined([combined_bytes(c) for c in members], limit)
        first = members[0]
        out.append(dataclasses.replace(
            first, name=first.name + (f" +{len(members) - 1} merged" if len(members) > 1 else ""),
            payload=sum(c.payload for c in members) / per_run, calls=first.calls * per_run))
    return out
