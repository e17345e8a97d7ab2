"""An α–β + roofline cost model of one training step, per device.

Everything is per device and per optimizer step unless a name says otherwise. One set of
assumptions (`Assumptions`) is used for every prediction the planner and the validation make:

compute   every kernel of a block is listed with its FLOPs and HBM bytes (GEMMs by their
          M·K·N, attention, the elementwise ops between them) and costs a roofline
              t = max(FLOPs / (eta_flops · peak), bytes / (eta_hbm · HBM bandwidth)) + launch
          backward = 2× a GEMM's forward (dX and dW), 2× an elementwise op's bytes; attention
          backward 2.5× (flash: recomputes the scores) or 2× (dense). remat=full replays the
          whole forward of a block; remat=lowrank replays it minus the down-projections whose
          (reduced) outputs are saved.
network   every collective is a ring over its group: per device it sends
              all-reduce 2(n−1)/n·P, all-gather / reduce-scatter (n−1)/n·P
          (P = the un-sharded buffer) at eta_net × the per-device bandwidth of the slowest level
          the group spans (topology.bw_pair / bw_node / bw_global), plus a latency α_level ·
          ⌈log2 n⌉ per call. A ring that crosses nodes is charged the per-device share of the
          node's NICs for all its bytes (the accounting the design and the analyzer use; an
          ideal hierarchical algorithm could be up to devices-per-node × faster on that level).
overlap   tensor-parallel collectives sit on the critical path (the next GEMM needs them): never
          overlapped. Data-parallel (ZeRO) gathers and reduce-scatters of a micro-batch may hide
          behind that micro-batch's compute: exposed = max(0, t_dp − dp_overlap · t_compute);
          dp_overlap = 0 (nothing hidden) by default, and the report also gives the fully
          overlapped bound. Once-per-step work (cross-node gradient reduction, weight re-gather,
          optimizer) is exposed.
memory    persistent state from the placement's layouts (exact, padding included) + gradient
          accumulator + gathered weights + saved activations by remat policy + one block's
          working set + logits; "fits" when it is ≤ `hbm_usable` × the device's HBM.

The same functions also turn *measured* collectives (from a compiled step's HLO, see
`boost_jax.analysis.comm`) into time, so a compiled plan and an analytic one are costed alike.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from boost_jax.analysis.comm import ring_bytes
from boost_jax.analysis.flops import flops_per_token, param_count
from boost_jax.mesh import AXES, Topology

# HBM bandwidth per device (bytes/s): vendor datasheets. MI250X 3.2 TB/s per package = 1.6 per
# GCD; A100-40GB 1.555 TB/s, A100-80GB 2.039 TB/s; H100 SXM 3.35 TB/s; a CPU socket ~50 GB/s.
HBM_BW = {"frontier": 1.6e12, "perlmutter": 1.555e12, "perlmutter-80": 2.039e12,
          "dgx-h100": 3.35e12, "cpu": 5e10}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


@dataclass(frozen=True)
class Assumptions:
    eta_flops: float = 0.7  # achievable fraction of peak FLOP/s (GEMMs and attention)
    eta_hbm: float = 0.8  # achievable fraction of HBM bandwidth (elementwise, skinny GEMMs)
    eta_net: float = 0.8  # achievable fraction of link bandwidth (collectives)
    launch_s: float = 4e-6  # per-kernel launch/sync overhead
    dp_overlap: float = 0.0  # fraction of compute that hides data-parallel collectives
    attention: str = "dense"  # dense (what our XLA step compiles) | flash (causal, fused)
    hbm_usable: float = 0.9  # usable fraction of HBM (allocator, runtime, fragmentation)

    def describe(self) -> list[str]:
        return [
            f"compute: roofline per kernel, {self.eta_flops:.0%} of peak FLOP/s, "
            f"{self.eta_hbm:.0%} of HBM bandwidth, {self.launch_s * 1e6:.0f} us launch per kernel",
            f"attention: {self.attention}" + (" (causal half of the scores, no [s,s] in HBM)"
                                               if self.attention == "flash" else
                                               " (full [s,s] fp32 scores through HBM, as compiled)"),
            f"network: ring collectives at {self.eta_net:.0%} of the slowest spanned level's "
            "per-device bandwidth + alpha*ceil(log2 n) per call",
            "overlap: tensor-parallel collectives never overlap compute; data-parallel "
            f"collectives hide behind {self.dp_overlap:.0%} of the micro-batch compute; "
            "once-per-step reduction, weight re-gather and optimizer are exposed",
            f"memory: fits when the estimate is <= {self.hbm_usable:.0%} of device HBM",
        ]


# --------------------------------------------------------------------------- kernels


@dataclass
class Op:
    name: str
    kind: str  # gemm | attn | elem
    flops: float
    bytes: float
    out_bytes: float  # bytes of its output (saved for backward without remat)
    lowrank_saved: bool = False  # output kept by remat=lowrank (not recomputed)


def _gemm(name, M, K, N, e, saved=False) -> Op:
    return Op(name, "gemm", 2.0 * M * K * N, e * (M * K + K * N + M * N), e * M * N, saved)


def _elem(name, read, write) -> Op:
    return Op(name, "elem", 0.0, float(read + write), float(write))


def _attn(b, s, hl, kvl, hd, e, mode) -> Op:
    flops = 4.0 * b * s * s * hl * hd
    io = e * b * s * (2 * hl + 2 * kvl) * hd
    if mode == "flash":
        return Op("attention", "attn", flops * 0.5, io, e * b * s * hl * hd + 4 * b * hl * s)
    scores = b * hl * s * s
    # scores fp32 written, read by softmax, probs written (compute dtype) and read by p·v
    return Op("attention", "attn", flops, io + scores * (4 + 4 + e + e), e * b * s * hl * hd
              + scores * (4 + e))


@dataclass
class TPColl:
    name: str
    kind: str
    payload: float  # bytes


@dataclass
class BlockModel:
    """One block's forward kernels and TP collectives for one micro-batch on one device."""

    ops: list[Op]
    fwd: list[TPColl]
    bwd: list[TPColl]
    residual_bytes: float  # block input kept by remat=full/lowrank
    latent_bytes: float  # extra kept by remat=lowrank
    replays_collectives_lowrank: bool


def block_model(m, b: int, s: int, mode: str, t: int, attention: str = "dense") -> BlockModel:
    """Kernels of one decoder block. mode: none | megatron | vanilla | btp (t = TP degree)."""
    e = DTYPE_BYTES[m.dtype]
    T = b * s
    d, hd, H, K, dff, r = m.d_model, m.head_dim, m.n_heads, m.kv_heads, m.d_ff, m.r
    full = m.arch == "full"
    if mode == "none":
        mode, t = ("megatron" if full else "btp"), 1
    ops: list[Op] = []
    fwd: list[TPColl] = []
    bwd: list[TPColl] = []
    if mode == "megatron":
        qn, kn = H * hd // t, K * hd // t
        ops += [_elem("attn_norm", e * T * d, e * T * d),
                _gemm("qkv", T, d, qn + 2 * kn, e),
                _elem("rope", 2 * e * T * (qn + kn), e * T * (qn + kn)),
                _attn(b, s, H // t, K // t, hd, e, attention),
                _gemm("o", T, qn, d, e),
                _elem("residual", 2 * e * T * d, e * T * d),
                _elem("mlp_norm", e * T * d, e * T * d),
                _gemm("gate_up", T, d, 2 * dff // t, e),
                _elem("silu_mul", 2 * e * T * dff // t, e * T * dff // t),
                _gemm("down", T, dff // t, d, e),
                _elem("residual", 2 * e * T * d, e * T * d)]
        if t > 1:
            fwd = [TPColl("o", "all-reduce", e * T * d), TPColl("down", "all-reduce", e * T * d)]
            bwd = [TPColl("qkv_in", "all-reduce", e * T * d),
                   TPColl("gate_up_in", "all-reduce", e * T * d)]
        return BlockModel(ops, fwd, bwd, e * T * d, 0.0, True)
    if mode == "vanilla":
        rl = r // t
        projs = [("q", d, H * hd), ("k", d, K * hd), ("v", d, K * hd), ("o", H * hd, d),
                 ("gate", d, dff), ("up", d, dff), ("down", dff, d)]

        def proj(name, din, dout):
            return [_gemm(f"A_{name}", T, din, rl, e, saved=True),
                    _elem(f"silu_{name}", e * T * rl, e * T * rl),
                    _gemm(f"B_{name}", T, rl, dout, e)]

        pm = {p[0]: p for p in projs}
        ops += [_elem("attn_norm", e * T * d, e * T * d)]
        for n in ("q", "k", "v"):
            ops += proj(*pm[n])
        ops += [_elem("rope", 2 * e * T * (H + K) * hd, e * T * (H + K) * hd),
                _attn(b, s, H, K, hd, e, attention)]  # replicated: every rank, all heads
        ops += proj(*pm["o"])
        ops += [_elem("residual", 2 * e * T * d, e * T * d),
                _elem("mlp_norm", e * T * d, e * T * d)]
        ops += proj(*pm["gate"]) + proj(*pm["up"])
        ops += [_elem("silu_mul", 2 * e * T * dff, e * T * dff)]
        ops += proj(*pm["down"])
        ops += [_elem("residual", 2 * e * T * d, e * T * d)]
        if t > 1:
            fwd = [TPColl(n, "all-reduce", e * T * dout) for n, _, dout in projs]
            bwd = [TPColl(f"{n}_in", "all-reduce", e * T * din) for n, din, _ in projs]
        return BlockModel(ops, fwd, bwd, e * T * d, 7 * e * T * rl, True)
    if mode == "btp":
        dl, ql, kl, fl = d // t, H * hd // t, K * hd // t, dff // t
        ops += [_elem("online_norm", e * T * dl, e * T * dl),
                _gemm("A_qkv", T, dl, 3 * r, e, saved=True),
                _elem("silu_qkv", e * T * 3 * r, e * T * 3 * r),
                _gemm("B_q", T, r, ql, e), _gemm("B_k", T, r, kl, e), _gemm("B_v", T, r, kl, e),
                _elem("rope", 2 * e * T * (ql + kl), e * T * (ql + kl)),
                _attn(b, s, H // t, K // t, hd, e, attention),
                _gemm("A_o", T, ql, r, e, saved=True),
                _elem("silu_o", e * T * r, e * T * r),
                _gemm("B_o", T, r, dl, e),
                _elem("residual", 2 * e * T * dl, e * T * dl),
                _elem("online_norm", e * T * dl, e * T * dl),
                _gemm("A_gate_up", T, dl, 2 * r, e, saved=True),
                _elem("silu_gu", e * T * 2 * r, e * T * 2 * r),
                _gemm("B_gate", T, r, fl, e), _gemm("B_up", T, r, fl, e),
                _elem("silu_mul", 2 * e * T * fl, e * T * fl),
                _gemm("A_down", T, fl, r, e, saved=True),
                _elem("silu_down", e * T * r, e * T * r),
                _gemm("B_down", T, r, dl, e),
                _elem("residual", 2 * e * T * dl, e * T * dl)]
        if t > 1:
            stats = 4 * T  # the fp32 Σx² riding in the qkv and gate|up all-reduces
            fwd = [TPColl("z_qkv", "all-reduce", e * T * 3 * r + stats),
                   TPColl("z_o", "all-reduce", e * T * r),
                   TPColl("z_gu", "all-reduce", e * T * 2 * r + stats),
                   TPColl("z_down", "all-reduce", e * T * r)]
            bwd = [TPColl("dz_qkv", "all-reduce", e * T * 3 * r),
                   TPColl("dz_o", "all-reduce", e * T * r),
                   TPColl("dz_gu", "all-reduce", e * T * 2 * r),
                   TPColl("dz_down", "all-reduce", e * T * r)]
        return BlockModel(ops, fwd, bwd, e * T * dl, e * T * 7 * r, False)
    raise ValueError(f"unknown tp mode {mode!r}")


def head_model(m, b: int, s: int, mode: str, t: int) -> BlockModel:
    """Embedding lookup, final norm, LM head and softmax cross-entropy (logits in fp32)."""
    e = DTYPE_BYTES[m.dtype]
    T, d, V = b * s, m.d_model, m.vocab_size
    vl = V // t if t > 1 else V
    ops = [_elem("embed", e * T * d // max(t, 1), e * T * d // max(t, 1)),
           _elem("final_norm", e * T * d, e * T * d),
           _gemm("lm_head", T, d, vl, e),
           _elem("cross_entropy", 4 * T * vl * 2, 4 * T * vl)]
    fwd, bwd = [], []
    if t > 1:
        if mode == "btp":
            fwd = [TPColl("gather_h", "all-gather", e * T * d)]
            bwd = [TPColl("scatter_dh", "reduce-scatter", e * T * d)]
        else:
            fwd = [TPColl("embed", "all-reduce", e * T * d)]
            bwd = [TPColl("head_dh", "all-reduce", e * T * d)]
        fwd += [TPColl("ce_max", "all-reduce", 4 * T), TPColl("ce_sum", "all-reduce", 8 * T)]
    return BlockModel(ops, fwd, bwd, 0.0, 0.0, True)


def op_time(op: Op, peak: float, hbm: float, a: Assumptions, backward: bool = False) -> float:
    f = op.flops
    by = op.bytes
    n = 1
    if backward:
        if op.kind == "gemm":
            f, by, n = 2 * f, 2 * by, 2
        elif op.kind == "attn":
            f, by, n = f * (2.5 if a.attention == "flash" else 2.0), 2 * by, 1
        else:
            by, n = 2 * by, 1
    return max(f / (a.eta_flops * peak), by / (a.eta_hbm * hbm)) + n * a.launch_s


# --------------------------------------------------------------------------- collectives


def level_of(axes: Sequence[str]) -> str:
    axes = set(axes)
    if not axes:
        return "none"
    if "global" in axes:
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
    return c.bytes_per_step / bw + c.calls * topo.latency(c.level) * math.ceil(math.log2(c.n))


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
        if tp and axes and set(axes) <= tp:
            phase = "tp"
        elif c.in_loop:
            phase = "dp"
        else:
            phase = "step"
        out.append(Coll(c.name, c.kind, c.payload_bytes, c.group_size, c.level,
                        float(c.trip_count or 1), phase, axes))
    return out


# --------------------------------------------------------------------------- layouts


class SizesMesh:
    """A stand-in for jax.sharding.Mesh carrying only axis sizes (for analytic placement)."""

    def __init__(self, sizes: dict[str, int]):
        self.shape = {a: int(sizes[a]) for a in AXES}
        self.axis_names = AXES
        self.size = int(math.prod(self.shape.values()))


def _size(sizes, axes) -> int:
    return int(math.prod(sizes[a] for a in axes)) if axes else 1


_ABSTRACT_CACHE: dict = {}


def abstract_param_shapes(cfg):
    """Pure dict of ShapeDtypeStructs of the model's params (cached per model config)."""
    key = repr(cfg.model) + str(cfg.train.scan_layers)
    if key not in _ABSTRACT_CACHE:
        from boost_jax.train.step import abstract_params

        _ABSTRACT_CACHE[key] = abstract_params(cfg)[1]
    return _ABSTRACT_CACHE[key]


@dataclass
class StateSizes:
    """Per-device element counts of the state, by role, from the placement layouts."""

    tp_local: float  # Σ TP-local elements (unpadded): what one TP rank's weights hold
    tp_local_padded: float
    params: float  # stored elements per device (params sharding, padded)
    grads: float
    opt: float
    secondary: float
    replicated_dp: float  # elements no DP role could shard
    per_layer_tp_local: float  # one block's TP-local elements
    n_leaves: int
    n_block_leaves: int


def state_sizes(cfg, sizes: dict[str, int]) -> tuple[StateSizes, Any]:
    """Exact per-device element counts (padding included) via the plan's own layouts."""
    from boost_jax.sharding.plans import is_layout, make_placement
    import jax

    mesh = SizesMesh(sizes)
    pl = make_placement(cfg, mesh, abstract_param_shapes(cfg))
    lays = jax.tree_util.tree_flatten_with_path(pl.layouts, is_leaf=is_layout)[0]
    acc = dict(tp=0.0, tpp=0.0, params=0.0, grads=0.0, opt=0.0, sec=0.0, rep=0.0, layer=0.0)
    nb = 0
    for path, lay in lays:
        tp = math.prod(_size(sizes, t) for t in lay.tp)
        local = lay.padded_numel / tp
        acc["tp"] += lay.numel / tp
        acc["tpp"] += local

        def role(axes):
            return local / _size(sizes, axes) if lay.dim is not None else local

        acc["params"] += role(pl.params_axes)
        acc["grads"] += role(pl.grads_axes)
        acc["opt"] += role(pl.opt_state_axes)
        if pl.secondary_axes is not None:
            acc["sec"] += role(pl.secondary_axes)
        if lay.dim is None:
            acc["rep"] += local
        if lay.layer_axis:
            acc["layer"] += lay.numel / tp / lay.shape[0]
            nb += 1
    return StateSizes(acc["tp"], acc["tpp"], acc["params"], acc["grads"], acc["opt"],
                      acc["sec"], acc["rep"], acc["layer"], len(lays), nb), pl


# --------------------------------------------------------------------------- the model


@dataclass
class Prediction:
    layout: dict
    sizes: dict
    devices: int
    tokens_per_step: int
    micro_batch_per_device: int
    micro_batches: int
    flops_per_device: float  # model FLOPs (3x forward, no recompute) per device per step
    executed_flops_per_device: float  # with recompute
    time: dict  # compute / tp / dp / dp_exposed / step_comm / optimizer / total / total_overlapped
    comm_bytes: dict  # per level, bytes per device per step
    comm_time: dict  # per level seconds (unoverlapped)
    memory: dict  # bytes per device by component, total, hbm, fits
    step_time: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    assumptions: Assumptions
    collectives: list = field(default_factory=list, repr=False)
    notes: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return bool(self.memory["fits"])

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["assumptions"] = dataclasses.asdict(self.assumptions)
        d["collectives"] = [dataclasses.asdict(c) for c in self.collectives]
        return d


def tp_info(cfg, sizes) -> tuple[str, int]:
    mode = cfg.parallel.tp_mode
    t = _size(sizes, cfg.parallel.tp_axes) if mode != "none" else 1
    return mode, t


def dp_collectives(cfg, sizes, st: StateSizes, pl) -> list[Coll]:
    """Data-parallel / ZeRO collectives of the step (what boost_jax.train.step compiles)."""
    m, par = cfg.model, cfg.parallel
    pb = DTYPE_BYTES[m.param_dtype]
    gb = DTYPE_BYTES[par.grad_accum_dtype]
    micro = cfg.train.micro_batches
    L = m.n_layers
    q8 = 1.0 + 4.0 / par.quant_block  # int8 + one fp32 scale per block
    A, G, O = pl.params_axes, pl.grads_axes, pl.opt_state_axes
    S, R = pl.secondary_axes, pl.deferred_axes
    nA, nG, nO = _size(sizes, A), _size(sizes, G), _size(sizes, O)
    W = st.tp_local_padded  # TP-local elements of the whole model
    out: list[Coll] = []

    leaves = max(st.n_leaves, 1)

    def add(name, kind, payload, axes, times, phase):
        """`payload`: the whole model's buffer, moved `times` per step in one call per leaf."""
        n = _size(sizes, axes)
        if n > 1:
            out.append(Coll(name, kind, payload / leaves, n, level_of(axes), times * leaves,
                            phase, tuple(axes)))

    if par.tp_mode != "none":
        # TP: every weight gathered over the params axes once per micro-batch, kept for backward
        add("gather_weights", "all-gather", W * (q8 if pl.quantize_gather else pb), A,
            micro, "dp" if micro > 1 else "step")
    elif A:
        calls = micro
        prim = q8 if pl.quantize_gather else pb
        if S is not None:
            sb = q8 if (pl.secondary_int8 or pl.quantize_gather) else pb
            if not set(A) <= set(S):  # ZeRO++: flat gather over A, then the secondary's gather
                add("gather_fwd", "all-gather", W * prim, A, calls, "dp")
            add("gather_secondary", "all-gather", W * sb, S, calls, "dp")
            add("regather_bwd", "all-gather", W * sb, S, calls, "dp")
        else:
            add("gather_fwd", "all-gather", W * prim, A, calls, "dp")
            add("regather_bwd", "all-gather", W * prim, A, calls, "dp")
    # gradients: reduce-scatter into the grads sharding inside each deferred group, per micro-batch
    # (TP modes reduce the gathered tree once per micro-batch, outside the layer loop)
    add("grad_reduce_scatter", "reduce-scatter", W * gb, G, micro,
        "dp" if (micro > 1 or par.tp_mode == "none") else "step")
    # once per step: sum the deferred axes R straight into the opt_state sharding
    if R:
        kind = "reduce-scatter" if set(R) <= set(O) else "all-reduce"
        add("grad_reduce_deferred", kind, W / nG * gb, R, 1, "step")
    # updated weights back: opt_state → grads sharding → params sharding (in param dtype)
    stage = set(A) <= set(G) <= set(O)
    if stage:
        add("gather_update_opt_to_grads", "all-gather", W / nG * pb,
            [a for a in O if a not in G], 1, "step")
        add("gather_update_grads_to_params", "all-gather", W / nA * pb,
            [a for a in G if a not in A], 1, "step")
    else:
        add("gather_update", "all-gather", W / nA * pb, [a for a in O if a not in A], 1, "step")
    n_all = [a for a in AXES if sizes[a] > 1]
    if n_all:
        out.append(Coll("grad_norm", "all-reduce", 4.0 * leaves, _size(sizes, n_all),
                        level_of(n_all), 1, "step", tuple(n_all)))
    del L, nO
    return out


def memory_estimate(cfg, sizes, st: StateSizes, pl, bm: BlockModel, hm: BlockModel,
                    b: int) -> dict:
    m, par = cfg.model, cfg.parallel
    pb = DTYPE_BYTES[m.param_dtype]
    mixed = m.param_dtype != "float32"
    L = m.n_layers
    mem = {"weights": st.params * pb, "master": st.opt * 4 if mixed else 0.0,
           "adam": st.opt * 8, "batch": 2 * 4 * b * cfg.data.seq_len * cfg.train.micro_batches}
    mem["arguments"] = mem["weights"] + mem["master"] + mem["adam"] + mem["batch"]
    n_r = _size(sizes, pl.deferred_axes)
    del n_r
    mem["grads"] = st.grads * DTYPE_BYTES[par.grad_accum_dtype]
    q8 = 1.0 + 4.0 / par.quant_block
    if par.tp_mode != "none":
        mem["gathered_weights"] = st.tp_local_padded * pb if pl.params_axes else 0.0
    else:
        mem["gathered_weights"] = 2 * st.per_layer_tp_local * pb if pl.params_axes else 0.0
    if pl.secondary_axes is not None:
        mem["secondary"] = st.secondary * (q8 if pl.secondary_int8 or pl.quantize_gather else pb)
    working = sum(o.out_bytes for o in bm.ops)
    remat = cfg.train.remat
    if remat == "none":
        acts = L * working
    elif remat == "full":
        acts = L * bm.residual_bytes + working
    else:
        acts = L * (bm.residual_bytes + bm.latent_bytes) + working
    mem["activations"] = acts
    mem["logits"] = sum(o.out_bytes for o in hm.ops) * 2
    mem["layer_grads"] = st.per_layer_tp_local * 4
    mem["total"] = sum(v for k, v in mem.items() if k not in ("arguments",))
    return mem


def predict(cfg, topo: Topology, sizes: dict[str, int],
            assumptions: Optional[Assumptions] = None, measured: Optional[CommSummary] = None,
            pipeline_stages: int = 1) -> Prediction:
    """Analytic (or measured-collective) prediction of one optimizer step on `sizes`.

    `measured`: collective cost of a compiled step (CommSummary of colls_from_report, possibly
    extrapolated), used instead of the analytic collective list. `pipeline_stages` > 1 models 1F1B pipelining analytically (validation only:
    the step does not implement pipelines): each stage holds L/p blocks, the micro-batches run
    through p stages with a (p−1)-slot bubble and a point-to-point activation send per slot.
    """
    a = assumptions or Assumptions()
    m = cfg.model
    mode, t = tp_info(cfg, sizes)
    st, pl = state_sizes(cfg, sizes)
    n_dev = _size(sizes, AXES)
    n_batch = _size(sizes, pl.batch_axes)
    micro = cfg.train.micro_batches
    s = cfg.data.seq_len
    b = cfg.train.global_batch // micro // n_batch  # sequences per device per micro-batch
    peak, hbm = topo.peak_flops, HBM_BW.get(topo.name, 1.6e12)
    pp = pipeline_stages
    L = m.n_layers // pp
    bm = block_model(m, b, s, mode, t, a.attention)
    hm = head_model(m, b, s, mode, t)

    def block_times(model: BlockModel, layers: int):
        fwd = sum(op_time(o, peak, hbm, a) for o in model.ops)
        bwd = sum(op_time(o, peak, hbm, a, backward=True) for o in model.ops)
        if cfg.train.remat == "full" or (cfg.train.remat == "lowrank" and m.arch == "full"):
            rec = fwd
        elif cfg.train.remat == "lowrank":
            rec = sum(op_time(o, peak, hbm, a) for o in model.ops if not o.lowrank_saved)
        else:
            rec = 0.0
        return layers * (fwd + bwd + rec)

    remat_replays = cfg.train.remat == "full" or (cfg.train.remat == "lowrank"
                                                  and bm.replays_collectives_lowrank)
    t_comp_micro = block_times(bm, L) + (block_times(hm, 1) if pp == 1 else
                                         block_times(hm, 1) / pp)
    # TP collectives of one micro-batch (analytic; measured ones replace them below)
    tp_axes = cfg.parallel.tp_axes
    colls: list[Coll] = []
    if t > 1:
        lv = level_of(tp_axes)
        for c in bm.fwd:
            colls.append(Coll(f"tp_fwd_{c.name}", c.kind, c.payload, t, lv,
                              micro * L * (2 if remat_replays else 1), "tp", tuple(tp_axes)))
        for c in bm.bwd:
            colls.append(Coll(f"tp_bwd_{c.name}", c.kind, c.payload, t, lv, micro * L, "tp",
                              tuple(tp_axes)))
        for c in hm.fwd + hm.bwd:
            colls.append(Coll(f"tp_head_{c.name}", c.kind, c.payload, t, lv,
                              micro / (pp if pp > 1 else 1), "tp", tuple(tp_axes)))
    colls += dp_collectives(cfg, sizes, st, pl)
    notes = []
    if measured is not None:
        comm = measured
        notes.append("collectives: measured from the compiled step's HLO")
    else:
        comm = CommSummary.of(colls, topo, a)
        notes.append("collectives: analytic (the step's placement, not compiled)")
    t_tp = comm.phase_time.get("tp", 0.0)
    t_dp = comm.phase_time.get("dp", 0.0)
    t_stepc = comm.phase_time.get("step", 0.0)
    # optimizer: fp32 master/m/v/grad read+written on the opt_state shard (memory bound)
    opt_bytes = st.opt * (4 + 4 + 4 + 4) * 2 + st.params * DTYPE_BYTES[m.param_dtype]
    t_opt = opt_bytes / (a.eta_hbm * hbm) + 40 * a.launch_s
    t_compute = micro * t_comp_micro
    p2p = 0.0
    if pp > 1:
        # 1F1B: (micro + p − 1) slots of one stage's fwd+bwd; an activation send per slot
        e = DTYPE_BYTES[m.dtype]
        act = e * b * s * m.d_model / max(t, 1)
        p2p = 2 * (micro + pp - 1) * (act / (topo.bw_global * a.eta_net) + topo.lat_global)
        t_compute = (micro + pp - 1) * t_comp_micro
        t_tp = t_tp * (micro + pp - 1) / micro
        notes.append(f"pipeline: {pp} stages, 1F1B with {micro} micro-batches modelled "
                     "analytically (not implemented in the step)")
    exposed_dp = max(0.0, t_dp - a.dp_overlap * t_compute)
    total = t_compute + t_tp + exposed_dp + t_stepc + t_opt + p2p
    total_overlap = t_compute + t_tp + max(0.0, t_dp - t_compute) + t_stepc + t_opt + p2p
    tokens = cfg.train.global_batch * s
    fpt = flops_per_token(m, s)
    model_flops = fpt["train"] * tokens / (n_dev * pp)
    rec_factor = 4 / 3 if cfg.train.remat != "none" else 1.0
    mem = memory_estimate(cfg, sizes, st, pl, bm, hm, b)
    if pp > 1:
        for k in ("weights", "master", "adam", "grads", "gathered_weights", "activations",
                  "secondary", "arguments"):
            if k in mem:
                mem[k] /= pp
        mem["activations"] *= min(pp, micro)  # 1F1B keeps up to p micro-batches in flight
        mem["total"] = sum(v for k, v in mem.items() if k not in ("arguments", "total"))
    mem["hbm"] = topo.hbm_bytes
    mem["fits"] = mem["total"] <= a.hbm_usable * topo.hbm_bytes
    per_level = {lv: comm.level_bytes.get(lv, 0.0) for lv in AXES}
    lvl_time = {lv: comm.level_time.get(lv, 0.0) for lv in AXES}
    tflops = model_flops / total / 1e12
    return Prediction(
        layout=dict(plan=cfg.parallel.plan, tp_mode=mode, tp_axes=list(tp_axes), tp=t,
                    remat=cfg.train.remat, micro_batches=micro, pipeline_stages=pp,
                    placement=pl.describe()),
        sizes=dict(sizes), devices=n_dev, tokens_per_step=tokens, micro_batch_per_device=b,
        micro_batches=micro, flops_per_device=model_flops,
        executed_flops_per_device=model_flops * rec_factor,
        time=dict(compute=t_compute, tp=t_tp, dp=t_dp, dp_exposed=exposed_dp, step_comm=t_stepc,
                  optimizer=t_opt, p2p=p2p, total=total, total_overlapped=total_overlap),
        comm_bytes=per_level, comm_time=lvl_time, memory=mem, step_time=total,
        tokens_per_s=tokens / total, tflops_per_device=tflops, mfu=tflops * 1e12 / peak,
        assumptions=a, collectives=colls if measured is None else [], notes=notes)


def with_overrides(cfg, **kw):
    """A copy of cfg with dotted-key overrides, e.g. with_overrides(cfg, **{"train.remat": "full"})."""
    cfg = dataclasses.replace(cfg)
    for key, value in kw.items():
        sec, name = key.split(".")
        setattr(cfg, sec, dataclasses.replace(getattr(cfg, sec), **{name: value}))
    return cfg


def params_total(cfg) -> int:
    return param_count(cfg.model)
