"""The decoder stack alone under a TP layout, for per-layer communication and memory analysis.

The same forward the step runs (layers/forward.run_blocks with the layout's ops and the step's
remat wrapper, both from the parallel layout: sharding/parallel.resolve_layers), inside a
shard_map manual over every mesh axis, without embedding, head or weight gathers, so the
compiled program's collectives are the layers' own:

    layers_program(cfg, mesh, batch, seq, backward)  (jitted fn, abstract args): h -> h, or
                                                     (blocks, h, cotangent) -> (dblocks, dh)
    block_saved_residuals(cfg, mesh, batch, seq)     what one block keeps for backward
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from boost_jax.analysis.hlo import dtype_bytes
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


def block_saved_residuals(cfg, mesh, batch: int, seq: int) -> list[tuple[str, int, str]]:
    """What ONE block keeps for backward on one device under cfg.train.remat.

    [(type, bytes, source)], e.g. ("f32[2,8,16]", 1024, "named 'lowrank_latent' from ..."),
    from jax.ad_checkpoint.print_saved_residuals of the block traced inside the shard_map
    (shapes per device). Params are left out: they are inputs, not activations. Nothing is
    compiled."""
    from jax.ad_checkpoint import print_saved_residuals

    layout = parallel.resolve_layers(cfg, mesh)
    blocks = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                          abstract_params(cfg.model, cfg.train)[1]["blocks"])
    specs = tp_param_specs(cfg, {"blocks": blocks})["blocks"]
    hspec = residual_spec(cfg)
    buf = io.StringIO()

    def body(p, h):
        ops = layout.ops()
        positions = jnp.arange(seq, dtype=jnp.int32)
        layer = layout.checkpoint(gathers=False)(
            lambda p, h, prev: forward.block(ops, layout.model, p, h, positions, prev))
        prev = ops.init_prev(jnp.zeros(h.shape[:2], jnp.int32))
        with contextlib.redirect_stdout(buf):
            print_saved_residuals(layer, p, h, prev)
        return h

    h = jax.ShapeDtypeStruct((batch, seq, cfg.model.d_model), jnp.dtype(cfg.model.dtype))
    with jax.set_mesh(mesh):
        jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=(specs, hspec), out_specs=hspec),
                       blocks, h)
    out = []
    for line in buf.getvalue().splitlines():
        m = re.match(r"\s*([a-z0-9]+)\[([0-9,]*)\]\S*\s+(.*)", line)
        if not m or m.group(3).startswith("from the argument p") or "iota" in m.group(3):
            continue
        dims = [int(x) for x in m.group(2).split(",") if x]
        dt = {"f32": "f32", "bf16": "bf16", "i32": "s32", "bool": "pred"}.get(m.group(1),
                                                                              m.group(1))
        out.append((f"{m.group(1)}[{m.group(2)}]", int(np.prod(dims) * dtype_bytes(dt)),
                    m.group(3)))
    return out
