"""How much of a step's collective time stays on the critical path: the assumption the
launcher's XLA flags stand for (`overlap_exposed`), or what the GPU schedule showed.

The GPU figures, per plan × TP mode × micro-batch count (gpu_overlap.json), are measured by
benchmarks/gpu_overlap.py from the training step compiled for A100s (compile-only devices,
the launcher's XLA flags): for each collective, the compute XLA's latency-hiding scheduler put
between its start and done. `overlap="gpu"` costs a phase's exposed time as its time × (1 −
hidden share) at the measured micro-batch count nearest the layout's, and charges the kernels
the GPU program launches beyond the roofline's list (their ratio per layer; a plan's own at
the layout's count through a + b/m, `kernels_at`);
layouts the table lacks fall back to the `xla` assumption.
"""

from __future__ import annotations

import os
from typing import Optional

from boost_jax.plan import gpu_kernels
from boost_jax.plan.roofline import Assumptions, BlockModel, block_kernels

# the kinds XLA's GPU combiners merge (Assumptions.combine_bytes: how far)
XLA_COMBINED = ("all-gather", "reduce-scatter", "all-reduce")

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_overlap.json")


def key(plan: str, tp_mode: str) -> str:
    return f"{plan}/{tp_mode}"


def table(path: str = TABLE_PATH) -> dict:
    """The measured table ({} when it was never written)."""
    return gpu_kernels.table(path)  # the same cached reader


def measured(plan: str, tp_mode: str, micro_batches: int) -> Optional[dict]:
    """The layout's row at the measured micro-batch count nearest `micro_batches` (the fewer on
    a tie), None if the layout was not measured."""
    by_micro = table().get("layouts", {}).get(key(plan, tp_mode))
    if not by_micro:
        return None
    near = min(by_micro, key=lambda m: (abs(int(m) - micro_batches), int(m)))
    return by_micro[near]


def kernel_ratio(plan: str, tp_mode: str, micro_batches: int) -> Optional[float]:
    """GPU kernels per layer over the roofline's count for the layout, None if not measured."""
    row = measured(plan, tp_mode, micro_batches)
    if row is None or not row.get("analytic_kernels_per_layer"):
        return None
    return row["kernels_per_layer"] / row["analytic_kernels_per_layer"]


def hidden(plan: str, tp_mode: str, phase: str, micro_batches: int) -> Optional[float]:
    """The hidden share of `phase` (tp | dp | step) for the layout, None if not measured (the
    layout is not in the table, or its measured step had no collective of that phase: ddp's
    per-layer all-reduce at one micro-batch, measured at two and four). Ask only under
    overlap="gpu": benchmarks/gpu_overlap.py costs layouts while it rewrites the table."""
    row = measured(plan, tp_mode, micro_batches)
    if row is None:
        return None
    return row["hidden"].get(phase)


def overlap_exposed(t_dp: float, t_compute: float, layers: int, a: Assumptions,
                    hidden_share: Optional[float] = None) -> float:
    """Seconds of the per-micro-batch data-parallel collectives left on the critical path.

    With the launcher's XLA flags (mesh.GPU_XLA_SCHEDULE) the scanned layers pipeline them: a
    layer's weight gather runs behind the previous layer's compute, its gradient
    reduce-scatter behind the next backward layer. Each pass over the layers leaves one
    layer's share exposed (the first gather, the last reduce-scatter): t_dp / L over the step,
    or, when the traffic outlasts the compute it hides behind, what the compute leaves over
    (whichever is more). overlap="gpu" with a measured `hidden_share`: only that share can
    hide."""
    if a.overlap == "none":
        return t_dp
    if a.overlap == "gpu" and hidden_share is not None:
        return t_dp * (1.0 - hidden_share) + max(t_dp * hidden_share - t_compute, 0.0)
    return max(t_dp - t_compute, t_dp / max(layers, 1), 0.0)


def pass_exposed(traffic: dict, passes: int, fwd_s: float, bwd_s: float,
                 layers: int) -> tuple[float, float]:
    """(exposed seconds, of them the once-per-step legs') of the data-parallel collectives when
    each pass over the layers hides only its own traffic (overlap="xla", no pipeline).

    `traffic`: seconds per step by the pass they run in (step_collectives.RUNS): every forward,
    every backward, the first forward only (a deferred update), the last backward only (a
    reduction in the backward). `passes` forward and as many backward passes of `fwd_s` /
    `bwd_s` compute each. A pass with T traffic and C compute leaves max(T − C, T / L) exposed
    (`overlap_exposed`); a once-per-step leg adds its traffic to its one pass, and what that
    adds to the pass's exposure is its share. The scheduler cannot move a forward gather into
    a backward, nor the first micro-batch's gathers into the second's compute."""
    def exposed(t, c):
        return max(t - c, t / max(layers, 1), 0.0)

    total = once = 0.0
    for every, only, c in (("forward", "first forward", fwd_s),
                           ("backward", "last backward", bwd_s)):
        t, o = traffic.get(every, 0.0) / passes, traffic.get(only, 0.0)
        base, with_once = exposed(t, c), exposed(t + o, c)
        total += (passes - 1) * base + with_once
        once += with_once - base
    return total, once


def gpu_launch_seconds(cfg, bm: BlockModel, blocks: float, a: Assumptions) -> float:
    """The launches the GPU program makes beyond the roofline's kernel list, at launch_s each,
    for `blocks` block passes: under overlap="gpu" the plan x TP mode's ratio (GPU / analytic
    kernels per layer, gpu_overlap.json), otherwise the arch x family x TP mode x remat
    mode's count plus the plan's own (extra_kernels); 0 where the tables lack the layout."""
    if a.overlap == "gpu":
        ratio = kernel_ratio(cfg.parallel.plan, cfg.parallel.tp_mode, cfg.train.micro_batches)
        if ratio is not None:
            return max(ratio - 1.0, 0.0) * block_kernels(cfg, bm) * a.launch_s * blocks
    return extra_kernels(cfg) * a.launch_s * blocks


def kernels_at(plan: str, tp_mode: str, micro_batches: int) -> Optional[float]:
    """Kernels per layer and micro-batch at `micro_batches`: k(m) = a + b/m through the two
    measured counts (b: what runs once per step but is counted per micro-batch, e.g. a
    deferred update's first and a peeled last micro-batch), the one count when only one was
    measured; None if the layout was not measured."""
    by_micro = table().get("layouts", {}).get(key(plan, tp_mode))
    if not by_micro:
        return None
    pts = sorted((int(m), row["kernels_per_layer"]) for m, row in by_micro.items())
    (m1, k1), (m2, k2) = pts[0], pts[-1]
    if m1 == m2:
        return k1
    b = (k1 - k2) / (1.0 / m1 - 1.0 / m2)
    return max(k2 - b / m2 + b / micro_batches, 0.0)


def plan_kernels(cfg) -> float:
    """Kernels per layer a plan launches beyond DDP's at the same TP mode (its gathers,
    (de)quantization, per-layer reductions), from gpu_overlap.json; 0 if not measured."""
    plan, mode, micro = cfg.parallel.plan, cfg.parallel.tp_mode, cfg.train.micro_batches
    row, ddp = kernels_at(plan, mode, micro), kernels_at("ddp", mode, micro)
    if row is None or ddp is None:
        return 0.0
    return max(row - ddp, 0.0)


def extra_kernels(cfg) -> float:
    """Kernels per block and micro-batch the GPU program launches beyond the roofline's list:
    the block's as measured per arch x family x TP mode x remat mode (plan/gpu_kernels.py,
    under DDP), plus what the plan adds (plan_kernels)."""
    return gpu_kernels.extra_per_block(cfg) + plan_kernels(cfg)


def gpu_exposed(cfg, phase: str, t: float, a: Assumptions) -> float:
    """overlap="gpu": a phase's collective time less the share the GPU schedule hides for the
    layout (the whole time when the table lacks the layout, or with other overlap modes)."""
    if a.overlap != "gpu":
        return t
    h = hidden(cfg.parallel.plan, cfg.parallel.tp_mode, phase, cfg.train.micro_batches)
    return t if h is None else t * (1.0 - h)
