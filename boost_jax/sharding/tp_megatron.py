"""Megatron tensor parallelism for the full-rank baseline (arch=full).

The residual stream is replicated. Attention: q|k|v column-parallel by heads (one grouped GEMM
over the concatenated local columns), attention on local heads, o row-parallel → all-reduce
[b,s,d]. MLP: gate|up column-parallel (d_ff/t), down row-parallel → all-reduce [b,s,d].
Norm scales are replicated.

Parameter split (leading layer axis L omitted): q/k/v/gate/up `w` [d, n] along n (columns),
o/down `w` [n, d] along n (rows).

Communication per layer (elements, b·s tokens):
    forward   2 all-reduces, b·s·2d (outputs of o and down)
    backward  2 all-reduces, b·s·2d (cotangents of the normed inputs of q|k|v and gate|up:
              Megatron's f operator, one pcast per group)
    remat=full replays the 2 forward all-reduces; remat=lowrank has no latent to save in a
    full-rank block (it keeps the residuals only) and also replays them.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from boost_jax.layers.norms import rms_norm
from boost_jax.sharding.tp_common import (
    TPContext, local_attention, matmul, name_residual, psum, to_varying)


def megatron_block(ctx: TPContext, p: dict, h, positions, prev: Optional[dict]):
    at, ml = p["attn"], p["mlp"]
    hq, hk = ctx.n_heads // ctx.t, ctx.kv_heads // ctx.t
    nq, nk = hq * ctx.head_dim, hk * ctx.head_dim
    h = name_residual(h)

    x = to_varying(ctx, rms_norm(h, p["attn_norm"]["scale"], ctx.eps, ctx.dtype))
    qkv = matmul(x, jnp.concatenate([at[n]["w"] for n in ("q", "k", "v")], axis=-1), ctx.dtype)
    q, k, v = jnp.split(qkv, [nq, nq + nk], axis=-1)
    o = local_attention(ctx, q, k, v, positions, hq, hk)
    h = name_residual(h + psum(ctx, matmul(o, at["o"]["w"], ctx.dtype)).astype(h.dtype))

    x = to_varying(ctx, rms_norm(h, p["mlp_norm"]["scale"], ctx.eps, ctx.dtype))
    gu = matmul(x, jnp.concatenate([ml["gate"]["w"], ml["up"]["w"]], axis=-1), ctx.dtype)
    g, u = jnp.split(gu, 2, axis=-1)
    y = psum(ctx, matmul(jax.nn.silu(g) * u, ml["down"]["w"], ctx.dtype))
    return h + y.astype(h.dtype), None


def megatron_init_prev(ctx: TPContext, b: int, s: int):
    return None
