"""The share of each phase's collective time the GPU schedule hides, per plan × TP mode.

Measured by benchmarks/gpu_overlap.py from the training step compiled for A100s (compile-only
devices, the launcher's XLA flags): for each collective, the compute XLA's latency-hiding
scheduler put between its start and done. The cost model's `overlap="gpu"` costs a phase's
exposed time as its time × (1 − hidden share), and charges the kernels the GPU program
launches beyond the roofline's list (their ratio per layer); layouts the table lacks fall back
to the `xla` assumption (plan/costmodel.py overlap_exposed).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Optional

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_overlap.json")


def key(plan: str, tp_mode: str) -> str:
    return f"{plan}/{tp_mode}"


@functools.lru_cache(maxsize=None)
def table(path: str = TABLE_PATH) -> dict:
    """The measured table ({} when it was never written)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def kernel_ratio(plan: str, tp_mode: str) -> Optional[float]:
    """GPU kernels per layer over the roofline's count for the layout, None if not measured."""
    row = table().get("layouts", {}).get(key(plan, tp_mode))
    if row is None or not row.get("analytic_kernels_per_layer"):
        return None
    return row["kernels_per_layer"] / row["analytic_kernels_per_layer"]


def hidden(plan: str, tp_mode: str, phase: str) -> Optional[float]:
    """The hidden share of `phase` (tp | dp | step) for the layout, None if not measured."""
    row = table().get("layouts", {}).get(key(plan, tp_mode))
    if row is None:
        return None
    return row["hidden"].get(phase, 0.0)
