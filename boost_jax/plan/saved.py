"""What the layer stack keeps for its backward under train.remat=none, asked of JAX.

Without remat the backward keeps whatever JAX's autodiff saves, which is not a list of kernel
outputs: plans that keep their weights whole apply no checkpoint, so every VJP residual stays
(fp32 norm statistics, each cast, each projection's input and output); plans that gather
weights wrap each layer in a checkpoint that saves matmul outputs and named values only
(layers/forward.remat_wrapper), fewer. The planner therefore traces the stack it would run
(forward.run_blocks with single-device ops and the step's remat wrapper; jax.ad_checkpoint's
saved residuals, nothing compiled) and counts the bytes. Residuals are linear in the batch:
two traces (1 and 2 sequences) give the bytes per sequence and the per-layer constant (bf16
copies of fp32 weights), cached per model, sequence length, wrapper and attention kernel.

Flash attention is traced as the blockwise kernel (layers/flash.py): it saves what cuDNN's
and the Pallas kernel's backward read, the output and the row statistics. Under tensor
parallelism the per-sequence bytes scale as the roofline's per-device kernel outputs do
(the block's working set at the TP degree over its working set whole), the weight copies as
the layer's weights do. Against the layout's own per-device trace (analysis/tp_layers.py) the
per-sequence scaling is short by 10-30%, more at higher TP degrees (BTP x2 0.78, x4 0.70 of
the trace; Megatron x4 0.90), so the planner's report notes TP layouts under remat=none
(costmodel.remat_none_unmodelled; CoLA-1B ZeRO-3 over a BTP pair, one micro-batch: 0.89x
of its A100 program, benchmarks/README.md section 11).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals prints

from boost_jax.config import TrainConfig
from boost_jax.layers import forward
from boost_jax.plan.roofline import block_model
from boost_jax.step.build import abstract_params


def _stack_bytes(m, b: int, s: int, gathers: bool) -> int:
    """Bytes the whole stack saves for b sequences (CPU tracing: flash is the blockwise kernel)."""
    blocks = abstract_params(m, TrainConfig(remat="none"))[1]["blocks"]
    ops = forward.Local(m)
    positions = jnp.arange(s, dtype=jnp.int32)
    wrap = forward.remat_wrapper("none", gathers)

    def stack(blocks, h):
        prev = ops.init_prev(jnp.zeros((b, s), jnp.int32))
        return forward.run_blocks(ops, m, blocks, h, positions, prev, wrap)[0]

    h = jax.ShapeDtypeStruct((b, s, m.d_model), jnp.dtype(m.dtype))
    return sum(a.size * a.dtype.itemsize for a, why in saved_residuals(stack, blocks, h)
               if not why.startswith("from the argument"))


_TRACED: dict = {}  # a search asks for a few keys thousands of times


def per_layer(m, s: int, gathers: bool, attention: str) -> tuple[float, float]:
    """(bytes per sequence, bytes per layer) one layer keeps for its backward under
    train.remat=none with `gathers` (the plan gathers weights) and `attention` (flash |
    dense); m: the model config."""
    m = dataclasses.replace(m, attention=attention)
    key = (repr(m), s, gathers)
    if key not in _TRACED:
        one, two = (_stack_bytes(m, b, s, gathers) for b in (1, 2))
        _TRACED[key] = ((two - one) / m.n_layers, (2 * one - two) / m.n_layers)
    return _TRACED[key]


def layer_elements(m) -> float:
    """Weight elements of one whole layer."""
    key = ("elements", repr(m))
    if key not in _TRACED:
        blocks = abstract_params(m, TrainConfig(remat="none"))[1]["blocks"]
        _TRACED[key] = sum(x.size for x in jax.tree.leaves(blocks)) / m.n_layers
    return _TRACED[key]


def per_device(cfg, bm, b: int, gathers: bool, attention: str, weights: float) -> float:
    """Bytes one layer of `bm` (roofline.block_model: the layout's per-device kernels) keeps
    on one device for b sequences: the whole layer's per-sequence bytes scaled by the TP share
    of its working set, its per-layer constant (weight copies) by the share of its weights
    (`weights`: one layer's elements on this device, TP-local)."""
    m, s = cfg.model, cfg.data.seq_len
    seq, const = per_layer(m, s, gathers, attention)
    whole = block_model(m, b, s, "none", 1, attention)
    share = sum(o.out_bytes for o in bm.ops) / sum(o.out_bytes for o in whole.ops)
    return b * seq * share + const * weights / layer_elements(m)
