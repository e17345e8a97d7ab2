"""Roofline of one decoder block: the hardware assumptions and every kernel's cost, per device.

Everything is per device and per micro-batch unless a name says otherwise. `Assumptions` is the
one set of assumptions every prediction (boost_jax.plan.costmodel) uses; its network and overlap
terms are applied in boost_jax.plan.collectives, its memory term in boost_jax.plan.costmodel.

compute   every kernel of a block is listed with its FLOPs and HBM bytes (GEMMs by their
          M·K·N, attention, the elementwise ops between them) and costs a roofline
              t = max(FLOPs / (eta_flops · peak), bytes / (eta_hbm · HBM bandwidth)) + launch
          backward = 2× a GEMM's forward (dX and dW), 2× an elementwise op's bytes; attention
          backward 2.5× (flash: recomputes the scores) or 2× (dense). Launches are counted as
          XLA fuses: one per GEMM and attention, `elem_kernels` per block for the elementwise
          ops (their HBM bytes stay). remat=full replays the
          whole forward of a block; remat=lowrank replays it minus the down-projections whose
          (reduced) outputs are saved.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from boost_jax.mesh import Topology
from boost_jax.sharding.tp import btp, megatron, vanilla
from boost_jax.sharding.tp.common import TPColl, head_collectives


# HBM bandwidth per device (bytes/s): vendor datasheets. MI250X 3.2 TB/s per package = 1.6 per
# GCD; A100-40GB 1.555 TB/s, A100-80GB 2.039 TB/s; H100 SXM 3.35 TB/s; a CPU socket ~50 GB/s.
HBM_BW = {"frontier": 1.6e12, "perlmutter": 1.555e12, "perlmutter-80": 2.039e12,
          "dgx-a100": 2.039e12, "dgx-h100": 3.35e12, "cpu": 5e10}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


_NOT_FOUND = "no published measurement found: an assumption"
# Where each assumption comes from (the README's constants table is built from it;
# tests/unit/test_network_model.py checks every field has one). "optimizer_launches": the 40
# kernel launches boost_jax/plan/costmodel.py charges the optimizer step.
ASSUMPTION_SOURCES = {
    "eta_flops": f"{_NOT_FOUND} for MI250X GEMMs; A100's best-shape bf16 matmul reaches 0.87 of "
                 "peak, H100's 0.80 (stas00/ml-engineering@744d01e, compute/accelerator/"
                 "README.md, maximum achievable matmul FLOPS); 0.7 allows for smaller shapes "
                 "(sensitivity table: 0.5)",
    "eta_hbm": f"{_NOT_FOUND} (no stream-bandwidth figure for MI250X or A100)",
    "eta_net": "NCCL's effective NVLink bandwidth, 20 of a link's 25 GB/s (NVIDIA/nccl@5067397 "
               "src/graph/topo.h SM80_NVLINK_BW; its maintainer in NVIDIA/nccl-tests#149: "
               "~230 of 300 GB/s bus bandwidth on DGX A100); checked by the measured collectives",
    "launch_s": f"{_NOT_FOUND} (no kernel-launch latency for MI250X or A100)",
    "elem_kernels": f"{_NOT_FOUND}: counted from XLA's fusion of a block (norm, rope, "
                    "activation, residual + norm)",
    "combine_bytes": "XLA's GPU combiners' default threshold, 30 MiB "
                     "(kDefaultAllGatherCombineThreshold and its reduce-scatter and all-reduce "
                     "twins, xla/service/collective_utils.h; the launcher leaves them as they "
                     "are)",
    "overlap": "the launcher's XLA flags (boost_jax/mesh.py GPU_XLA_SCHEDULE)",
    "attention": "the configuration (model.attention), not a measured constant",
    "hbm_usable": f"{_NOT_FOUND}: allocator, runtime and fragmentation reserve",
    "optimizer_launches": f"{_NOT_FOUND}: 40 kernels for the optimizer step",
    "memory_margin": f"{_NOT_FOUND}: what the memory model cannot count, how XLA packs "
                     "buffers into its heap (the A100 programs of benchmarks/gpu_compile.py: "
                     "CoLA-1B DDP allocates 5.35 GiB of temporaries for 4.2 GiB live)",
}


@dataclass(frozen=True)
class Assumptions:
    eta_flops: float = 0.7  # achievable fraction of peak FLOP/s (GEMMs and attention)
    eta_hbm: float = 0.8  # achievable fraction of HBM bandwidth (elementwise, skinny GEMMs)
    eta_net: float = 0.8  # achievable fraction of link bandwidth (collectives)
    launch_s: float = 4e-6  # per-kernel launch/sync overhead
    # elementwise kernels per block and pass once XLA has fused the elementwise ops (norm,
    # rope, activation, residual+norm); GEMMs and attention are a kernel each
    elem_kernels: int = 4
    # the most one combined collective's result holds: XLA's GPU combiners merge a layer's
    # independent all-gathers, reduce-scatters and all-reduces up to it (a reduce-scatter's
    # result its 1/n share) and never cut one that is larger (kDefault*CombineThreshold,
    # xla/service/collective_utils.h; the launcher leaves the thresholds at their defaults):
    # the calls, and so the latencies, the GPU program runs (step_collectives.combined). The
    # engine itself bundles the all-to-alls (sharding/bucket.py).
    combine_bytes: float = 30 * 2**20
    # xla: as the step compiled with mesh.GPU_XLA_SCHEDULE | gpu: the hidden shares the GPU
    # schedule shows (plan/overlap.py) | none
    overlap: str = "xla"
    attention: str = "auto"  # auto: the config's model.attention, else flash on GPUs
    hbm_usable: float = 0.9  # usable fraction of HBM (what the CUDA/ROCm runtime keeps)
    # safety margin on the memory estimate for what it does not model (XLA's heap packing);
    # fits when estimate x (1 + margin) <= hbm_usable x HBM (plan/memory.py: fit_limit)
    memory_margin: float = 0.1

    def describe(self) -> list[str]:
        from boost_jax.mesh import GPU_XLA_SCHEDULE

        lines = [
            f"compute: roofline per kernel, {self.eta_flops:.0%} of peak FLOP/s, "
            f"{self.eta_hbm:.0%} of HBM bandwidth, {self.launch_s * 1e6:.0f} us launch per kernel "
            f"as XLA fuses them (each GEMM and attention one kernel, {self.elem_kernels} fused "
            "elementwise kernels per block and pass)",
            f"attention: {self.attention}" + (" (causal half of the scores, no [s,s] in HBM)"
                                               if self.attention == "flash" else
                                               " (full [s,s] fp32 scores through HBM)"
                                               if self.attention == "dense" else ""),
            f"network: each collective as NCCL / RCCL run it (rings for all-gather and "
            "reduce-scatter, or NCCL's PAT over one rank per node; ring or tree for "
            "all-reduce; the protocol their tuner picks) at "
            f"{self.eta_net:.0%} of the ring's slowest link; a ring spanning nodes leaves each "
            "node once, the node's NICs shared by the groups leaving it; every call pays the "
            "library's own latency (base + a step latency per ring step inside and between "
            "nodes, src/graph/tuning.cc); a layer's collectives merged into calls of up to "
            f"{self.combine_bytes / 2**20:.0f} MiB a result (XLA's combiners)",
        ]
        if self.overlap == "xla":
            lines.append("overlap (the launcher's XLA flags): tensor-parallel collectives and "
                         "pipeline sends on the critical path; per micro-batch weight gathers "
                         "and gradient reduce-scatters behind the neighbouring layers' compute "
                         "of the same pass (one layer's worth per pass exposed, and whatever "
                         "exceeds the pass's compute; a deferred leg in its one pass); "
                         "once-per-step reduction, weight re-gather and optimizer exposed")
            lines += [f"  {flag}: {why}" for flag, why in GPU_XLA_SCHEDULE]
        elif self.overlap == "gpu":
            lines.append("overlap (as the GPU schedule shows, benchmarks/results/gpu_overlap.md):"
                         " each phase's collective time less the share the compute scheduled "
                         "under it hides, per plan x TP mode (per micro-batch traffic beyond "
                         "the compute stays exposed)")
        else:
            lines.append("overlap: none (every collective on the critical path)")
        lines.append(f"memory: fits when the estimate + {self.memory_margin:.0%} (what the model "
                     f"does not count: XLA's heap packing) is <= {self.hbm_usable:.0%} of device "
                     "HBM")
        return lines


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
class BlockModel:
    """One block's forward kernels and TP collectives for one micro-batch on one device."""

    ops: list[Op]
    fwd: list[TPColl]
    bwd: list[TPColl]
    residual_bytes: float  # block input kept by remat=full/lowrank
    latent_bytes: float  # extra kept by remat=lowrank
    replays_collectives_lowrank: bool


def _megatron_block(m, b: int, s: int, t: int, attention: str, e: int, g: int) -> BlockModel:
    """Dense weights split over heads and d_ff; two all-reduces each way."""
    T = b * s
    d, hd, H, K, dff = m.d_model, m.head_dim, m.n_heads, m.kv_heads, m.d_ff
    qn, kn = H * hd // t, K * hd // t
    ops = [_elem("attn_norm", e * T * d, e * T * d),
           _gemm("qkv", T, d, qn + 2 * kn, e),
           _elem("rope", 2 * e * T * (qn + kn), e * T * (qn + kn)),
           _attn(b, s, H // t, K // t, hd, e, attention),
           _gemm("o", T, qn, d, e),
           _elem("residual", 2 * e * T * d, e * T * d),
           _elem("mlp_norm", e * T * d, e * T * d),
           _gemm("gate_up", T, d, g * dff // t, e),
           _elem("silu_mul", g * e * T * dff // t, e * T * dff // t),
           _gemm("down", T, dff // t, d, e),
           _elem("residual", 2 * e * T * d, e * T * d)]
    fwd, bwd = _tp_collectives(megatron, m, T, t, e, g)
    return BlockModel(ops, fwd, bwd, e * T * d, 0.0, True)


def _lowrank_proj(name: str, din: int, dout: int, T: int, rl: int, e: int) -> list[Op]:
    """One CoLA projection x -> A -> silu -> B with a rank-`rl` slice."""
    return [_gemm(f"A_{name}", T, din, rl, e, saved=True),
            _elem(f"silu_{name}", e * T * rl, e * T * rl),
            _gemm(f"B_{name}", T, rl, dout, e)]


def _vanilla_block(m, b: int, s: int, t: int, attention: str, e: int, g: int) -> BlockModel:
    """Rank split over TP, attention replicated; one all-reduce per projection each way."""
    T = b * s
    d, hd, H, K, dff, r = m.d_model, m.head_dim, m.n_heads, m.kv_heads, m.d_ff, m.r
    rl = r // t
    projs = vanilla.projections(m, g)
    pm = {p[0]: p for p in projs}

    def proj(name):
        return _lowrank_proj(*pm[name], T, rl, e)

    ops = [_elem("attn_norm", e * T * d, e * T * d)]
    for n in ("q", "k", "v"):
        ops += proj(n)
    ops += [_elem("rope", 2 * e * T * (H + K) * hd, e * T * (H + K) * hd),
            _attn(b, s, H, K, hd, e, attention)]  # replicated: every rank, all heads
    ops += proj("o")
    ops += [_elem("residual", 2 * e * T * d, e * T * d),
            _elem("mlp_norm", e * T * d, e * T * d)]
    ops += (proj("gate") if g == 2 else []) + proj("up")
    ops += [_elem("silu_mul", g * e * T * dff, e * T * dff)]
    ops += proj("down")
    ops += [_elem("residual", 2 * e * T * d, e * T * d)]
    fwd, bwd = _tp_collectives(vanilla, m, T, t, e, g)
    return BlockModel(ops, fwd, bwd, e * T * d, len(projs) * e * T * rl, True)


def _tp_collectives(layout, m, T: int, t: int, e: int, g: int):
    """The layout's own (forward, backward) list per block (sharding/tp/<mode>.py); none
    without TP."""
    return layout.block_collectives(m, T, t, e, g) if t > 1 else ([], [])


def _btp_block(m, b: int, s: int, t: int, attention: str, e: int, g: int) -> BlockModel:
    """d, heads and d_ff split over TP; the all-reduces carry rank-r latents."""
    T = b * s
    hd, H, K, r = m.head_dim, m.n_heads, m.kv_heads, m.r
    dl, ql, kl, fl = m.d_model // t, H * hd // t, K * hd // t, m.d_ff // t
    ops = [_elem("online_norm", e * T * dl, e * T * dl),
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
           _gemm("A_gate_up", T, dl, g * r, e, saved=True),
           _elem("silu_gu", e * T * g * r, e * T * g * r),
           *([_gemm("B_gate", T, r, fl, e)] if g == 2 else []), _gemm("B_up", T, r, fl, e),
           _elem("silu_mul", g * e * T * fl, e * T * fl),
           _gemm("A_down", T, fl, r, e, saved=True),
           _elem("silu_down", e * T * r, e * T * r),
           _gemm("B_down", T, r, dl, e),
           _elem("residual", 2 * e * T * dl, e * T * dl)]
    fwd, bwd = _tp_collectives(btp, m, T, t, e, g)
    return BlockModel(ops, fwd, bwd, e * T * dl, e * T * (5 + g) * r, False)


_BLOCK_BUILDERS = {"megatron": _megatron_block, "vanilla": _vanilla_block, "btp": _btp_block}


def block_model(m, b: int, s: int, mode: str, t: int, attention: str = "dense") -> BlockModel:
    """Kernels of one decoder block. mode: none | megatron | vanilla | btp (t = TP degree)."""
    e = DTYPE_BYTES[m.dtype]
    full = m.arch == "full"
    g = 2 if m.swiglu else 1  # MLP input projections: gate|up (SwiGLU) or up (GELU, GPT)
    if mode == "none":
        mode, t = ("megatron" if full else "btp"), 1
    if mode not in _BLOCK_BUILDERS:
        raise ValueError(f"unknown tp mode {mode!r}")
    return _BLOCK_BUILDERS[mode](m, b, s, t, attention, e, g)


def resolve_attention(cfg, topo: Topology, a: Assumptions) -> Assumptions:
    """The attention the step compiles: the assumption's if set, else the config's
    model.attention (flash | dense), else (auto) flash on a GPU, dense on the CPU."""
    if a.attention in ("flash", "dense"):
        return a
    want = getattr(cfg.model, "attention", "auto")
    if want not in ("flash", "dense"):
        gpu = topo.job is not None and topo.job.platform in ("cuda", "rocm")
        want = "flash" if gpu else "dense"
    return replace(a, attention=want)


def block_kernels(cfg, bm: BlockModel) -> float:
    """Launches of one block per micro-batch in the roofline model: forward, backward (two
    GEMMs per GEMM), and the forward replayed under remat."""
    ops = bm.ops
    bwd = sum(2 if o.kind == "gemm" else 1 for o in ops)
    remat = cfg.train.remat
    rec = len(ops) if remat == "full" else (
        sum(not o.lowrank_saved for o in ops) if remat == "lowrank" else 0)
    return float(len(ops) + bwd + rec)


def head_model(m, b: int, s: int, mode: str, t: int) -> BlockModel:
    """Embedding lookup, final norm, LM head and softmax cross-entropy (logits in fp32)."""
    e = DTYPE_BYTES[m.dtype]
    T, d, V = b * s, m.d_model, m.vocab_size
    vl = V // t if t > 1 else V
    ops = [_elem("embed", e * T * d // max(t, 1), e * T * d // max(t, 1)),
           _elem("final_norm", e * T * d, e * T * d),
           _gemm("lm_head", T, d, vl, e),
           _elem("cross_entropy", 4 * T * vl * 2, 4 * T * vl)]
    fwd, bwd = head_collectives(mode, T, d, e) if t > 1 else ([], [])
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
    launches = 0 if op.kind == "elem" else n  # fused: counted per block (elem_kernels)
    return max(f / (a.eta_flops * peak), by / (a.eta_hbm * hbm)) + launches * a.launch_s

