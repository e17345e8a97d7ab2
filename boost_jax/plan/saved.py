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
parallelism one block is traced inside the layout's shard_map over an abstract mesh of the
layout's sizes, once, with a symbolic batch, so the bytes are the device's own (per-device
shapes, the layout's TP collectives and latents). Scaling the whole layer's bytes by the
layout's share of the kernel outputs instead was 10-30% short (BTP x2 0.78, x4 0.70;
Megatron x4 0.90): CoLA-1B ZeRO-3 over a BTP pair, one micro-batch, 0.89x of its A100
program, now 1.01x (benchmarks/README.md section 11).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals prints

from jax.sharding import AbstractMesh

from boost_jax.analysis.tp_layers import block_residual_avals
from boost_jax.config import TrainConfig
from boost_jax.layers import forward
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


def per_layer_tp(cfg, sizes: dict, gathers: bool, attention: str) -> tuple[float, float]:
    """per_layer on one device of a TP layout: one block traced inside the layout's shard_map
    over an abstract mesh of `sizes` (analysis/tp_layers.block_saved_residuals, per-device
    shapes; nothing compiled)."""
    m = dataclasses.replace(cfg.model, attention=attention)
    par = cfg.parallel
    # a block's per-device shapes depend on the TP axes' sizes alone, not on the data-parallel
    # or stage axes a search varies
    key = (repr(m), par.tp_mode, tuple((a, sizes[a]) for a in par.tp_axes), cfg.data.seq_len,
           gathers)
    if key not in _TRACED:
        cfg = dataclasses.replace(cfg, model=m)
        mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
        def avals(batch):
            return [a for a, _ in block_residual_avals(cfg, mesh, batch, cfg.data.seq_len,
                                                       gathers)]

        try:  # one trace, shapes in a symbolic batch b
            b = avals(jax.export.symbolic_shape("b")[0])
            one, two = (sum(_nbytes(a, v) for a in b) for v in (1, 2))
        except jax.errors.InconclusiveDimensionOperation:  # a kernel tiles by the token count
            one, two = (sum(_nbytes(a, v) for a in avals(v)) for v in (1, 2))
        _TRACED[key] = (float(two - one), float(2 * one - two))
    return _TRACED[key]


def _nbytes(aval, b: int) -> int:
    """Bytes of `aval` with its symbolic dims at batch b, dim by dim in Python integers (a
    whole expression's coefficients overflow JAX's int32 evaluation)."""
    dims = [d._evaluate({"b": b}) if hasattr(d, "_evaluate") else d for d in aval.shape]
    return math.prod(int(d) for d in dims) * aval.dtype.itemsize


def per_device(cfg, sizes: dict, b: int, gathers: bool, attention: str) -> float:
    """Bytes one layer keeps on one device for b sequences under train.remat=none with
    `gathers` (the plan gathers weights) and `attention`: the whole layer's trace without TP,
    the layout's own per-device trace under TP."""
    if cfg.parallel.tp_mode == "none":
        seq, const = per_layer(cfg.model, cfg.data.seq_len, gathers, attention)
    else:
        seq, const = per_layer_tp(cfg, sizes, gathers, attention)
    return b * seq + const
