"""The decoder stack alone under a TP layout, for per-layer communication and memory analysis.

The same forward the step runs (layers/forward.run_blocks with the layout's ops and the step's
remat wrapper, both from the parallel layout: sharding/parallel.resolve_layers), inside a
shard_map manual over every mesh axis, without embedding, head or weight gathers, so the
compiled program's collectives are the layers' own:

    layers_program(cfg, mesh, batch, seq, backward)  (jitted fn, abstract args): h -> h, or
                                                     (blocks, h, cotangent) -> (dblocks, dh)
    block_saved_residuals(cfg, mesh, batch, seq)     what one block keeps for backward
                                                     (block_residual_avals: as avals)
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals prints
from jax.sharding import Mesh, NamedSharding

from boost_jax.layers import forward
from boost_jax.sharding import parallel
from boost_jax.sharding.tp.specs import residual_spec, tp_param_specs
from boost_jax.step.build import abstract_params


def _stack(layout, h, blocks):
    ops = layout.ops()
    positions = jnp.arange(h.shape[1], dtype=jnp.int32)
    tokens = jnp.zeros(h.shape[:2], jnp.int32)
    return forward.run_blocks(ops, layout.model, blocks, h, positions, ops.init_prev(tokens),
                              layout.checkpoint(gathers=False))[0]


def layers_fn(cfg, mesh):
    """layers(blocks, h) -> h for stacked block params [L, ...] under the TP layout."""
    layout = parallel.resolve_layers(cfg, mesh)
    hspec = residual_spec(cfg)

    def fn(blocks, h):
        specs = tp_param_specs(cfg, {"blocks": blocks})["blocks"]
        body = lambda b, x: _stack(layout, x, b)  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(specs, hspec), out_specs=hspec)(blocks, h)

    return fn


def layers_program(cfg, mesh, batch: int, seq: int, backward: bool = False):
    """(jitted fn, abstract args) of the cfg.model.n_layers TP blocks: forward h -> h, or
    forward+backward (blocks, h, cotangent) -> (dblocks, dh) via jax.vjp. Lower with
    `fn.lower(*args)` under `jax.set_mesh(mesh)`; no real arrays are needed."""
    fn = layers_fn(cfg, mesh)
    blocks = abstract_params(cfg.model, cfg.train)[1]["blocks"]
    specs = tp_param_specs(cfg, {"blocks": blocks})["blocks"]
    blocks = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, s)), blocks, specs)
    h = jax.ShapeDtypeStruct((batch, seq, cfg.model.d_model), jnp.dtype(cfg.model.dtype),
                             sharding=NamedSharding(mesh, residual_spec(cfg)))
    if not backward:
        return jax.jit(fn), (blocks, h)

    def fwd_bwd(blocks, h, ct):
        _, vjp = jax.vjp(fn, blocks, h)
        return vjp(ct)

    return jax.jit(fwd_bwd), (blocks, h, h)


def block_residual_avals(cfg, mesh, batch, seq: int, gathers: bool = False) -> list:
    """[(aval, source)] of what ONE block keeps for backward on one device under
    cfg.train.remat (`gathers`: in the checkpoint of a plan that gathers weights,
    layers/forward.remat_wrapper): jax.ad_checkpoint's saved residuals of the block traced
    inside the shard_map (per-device shapes; `mesh` may be a jax.sharding.AbstractMesh and
    `batch` a symbolic dimension, jax.export.symbolic_shape). Params are left out: they are
    inputs, not activations. Nothing is compiled."""
    layout = parallel.resolve_layers(cfg, mesh)
    blocks = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                          abstract_params(cfg.model, cfg.train)[1]["blocks"])
    specs = tp_param_specs(cfg, {"blocks": blocks})["blocks"]
    hspec = residual_spec(cfg)
    found = []

    def body(p, h):
        ops = layout.ops()
        positions = jnp.arange(seq, dtype=jnp.int32)
        layer = layout.checkpoint(gathers)(
            lambda p, h, prev: forward.block(ops, layout.model, p, h, positions, prev))
        prev = ops.init_prev(jnp.zeros(h.shape[:2], jnp.int32))
        found.extend(saved_residuals(layer, p, h, prev))
        return h

    # typed with their shardings: JAX 0.11 holds the in_specs to the arguments' own
    blocks = jax.tree.map(lambda x, sp: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, sp)), blocks, specs)
    h = jax.ShapeDtypeStruct((batch, seq, cfg.model.d_model), jnp.dtype(cfg.model.dtype),
                             sharding=NamedSharding(mesh, hspec))
    # an abstract mesh (the planner's sizes, no devices) needs no context: shard_map names it
    ctx = jax.set_mesh(mesh) if isinstance(mesh, Mesh) else contextlib.nullcontext()
    with ctx:
        jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=(specs, hspec), out_specs=hspec),
                       blocks, h)
    return [(aval, why) for aval, why in found
            if not why.startswith("from the argument p") and "iota" not in why]


def block_saved_residuals(cfg, mesh, batch: int, seq: int, gathers: bool = False
                          ) -> list[tuple[str, int, str]]:
    """block_residual_avals as [(type, bytes, source)], e.g. ("f32[2,8,16]", 1024, "named
    'lowrank_latent' from ..."), what jax.ad_checkpoint.print_saved_residuals prints."""
    return [(aval.str_short(short_dtypes=True).split("{")[0],
             math.prod(aval.shape) * aval.dtype.itemsize, why)
            for aval, why in block_residual_avals(cfg, mesh, batch, seq, gathers)]
