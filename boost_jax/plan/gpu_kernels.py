"""Kernels one block launches per micro-batch on the GPU, as XLA emits them: the table the cost
model counts launch overhead with.

benchmarks/gpu_kernels.py compiles CoLA-1B's step (8 micro-batches) for the A100 (compile-only
devices, the launcher's XLA flags) per arch × family × TP mode × remat mode and writes
gpu_kernels.json: the GPU program's kernel launches per layer per micro-batch (forward,
backward, remat replay: the 24-layer program's launches less the 23-layer one's) next to the
roofline's list (roofline.block_kernels). The roofline costs each GEMM and attention launch
and `elem_kernels` fused elementwise kernels per block and pass; XLA emits about twice as
many (copies, transposes, reductions, layout changes), whose launches `extra_launches` adds.
Layouts the table lacks get no correction.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Optional

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_kernels.json")


def key(arch: str, family: str, tp_mode: str, remat: str) -> str:
    return f"{arch}/{family}/{tp_mode}/{remat}"


def cfg_key(cfg) -> str:
    m = cfg.model
    return key(m.arch, m.family, cfg.parallel.tp_mode, cfg.train.remat)


@functools.lru_cache(maxsize=None)
def table(path: str = TABLE_PATH) -> dict:
    """The measured table ({} when it was never written)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def measured(cfg) -> Optional[dict]:
    """The layout's row: {kernels_per_layer, analytic_kernels_per_layer}, None if absent."""
    return table().get("layouts", {}).get(cfg_key(cfg))


def extra_per_block(cfg) -> float:
    """Launches per block and micro-batch the GPU program makes beyond the roofline's list
    (0 when the table lacks the layout)."""
    row = measured(cfg)
    if row is None:
        return 0.0
    return max(row["kernels_per_layer"] - row["analytic_kernels_per_layer"], 0.0)
