"""Vanilla low-rank tensor parallelism: each (A, B) pair is one Megatron unit (the baseline).

The residual stream is replicated and every projection y = B·σ(A·x) is cut at its rank: A
[d_in, r] column-parallel (r/t latent columns per rank), σ elementwise on the local columns, B
[r, d_out] row-parallel → all-reduce of the full-width output. Attention runs replicated on all
heads (q, k, v arrive all-reduced). Norm scales are replicated.

Parameter split (leading layer axis L omitted): `a` along r (columns), `b` along r (rows);
LaX latent_scale/g replicated.

Communication per layer (elements, b·s tokens, MHA; under GQA k/v carry K·hd instead of d):
    forward   7 all-reduces, b·s·(5d + 2·d_ff): outputs of q, k, v, o, down (d) and gate, up (d_ff)
    backward  7 all-reduces, b·s·(6d + d_ff): the input cotangents of the 7 column-parallel A
              projections (q, k, v, gate, up take d; o takes H·hd = d; down takes d_ff) — each
              pair has its own f operator, as in the naive scheme.
    LaX additionally gathers each local latent forward (7 per layer, an all-reduce of the
    zero-padded b·s·r latent) to apply the crossing Norm_r on the full rank, and all-reduces
    its cotangent (b·s·r) backward where the local slice re-enters per-rank compute.
    remat=full and remat=lowrank both replay the forward all-reduces (the latents here are
    sharded over r and the attention inputs are the all-reduced outputs).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from boost_jax.layers.linear import lax_cross, latent_activation
from boost_jax.layers.norms import rms_norm
from boost_jax.sharding.tp_common import (
    TPContext, all_gather, local_slice, matmul, name_latent, name_residual, psum, to_varying)
from boost_jax.layers.attention import causal_attention
from boost_jax.layers.rope import apply_rope

LATENT_KEYS = ("q", "k", "v", "o", "gate", "up", "down")


def vanilla_proj(ctx: TPContext, p: dict, x, prev=None):
    """y = B·σ(A·x) with A column- and B row-parallel; x replicated → (y replicated, latent)."""
    z = matmul(to_varying(ctx, x), p["a"], ctx.dtype)  # [b, s, r/t]
    lat = None
    if ctx.lax:  # Norm_r needs the whole rank: gather, cross, keep the local columns
        lat = lax_cross(all_gather(ctx, z, axis=-1), prev, p, ctx.eps)
        z = local_slice(ctx, lat, axis=-1)
    z = name_latent(z)
    y = psum(ctx, matmul(latent_activation(ctx.kind, z), p["b"], ctx.dtype))
    return y, lat


def vanilla_block(ctx: TPContext, p: dict, h, positions, prev: Optional[dict]):
    at, ml = p["attn"], p["mlp"]
    prev = prev or {}
    b, s, _ = h.shape
    hd = ctx.head_dim
    lat = {}
    h = name_residual(h)

    x = rms_norm(h, p["attn_norm"]["scale"], ctx.eps, ctx.dtype)
    q, lat["q"] = vanilla_proj(ctx, at["q"], x, prev.get("q"))
    k, lat["k"] = vanilla_proj(ctx, at["k"], x, prev.get("k"))
    v, lat["v"] = vanilla_proj(ctx, at["v"], x, prev.get("v"))
    q = apply_rope(q.reshape(b, s, ctx.n_heads, hd), positions, ctx.rope_theta)
    k = apply_rope(k.reshape(b, s, ctx.kv_heads, hd), positions, ctx.rope_theta)
    v = v.reshape(b, s, ctx.kv_heads, hd)
    o = causal_attention(q, k, v).reshape(b, s, ctx.n_heads * hd)
    y, lat["o"] = vanilla_proj(ctx, at["o"], o, prev.get("o"))
    h = name_residual(h + y.astype(h.dtype))

    x = rms_norm(h, p["mlp_norm"]["scale"], ctx.eps, ctx.dtype)
    g, lat["gate"] = vanilla_proj(ctx, ml["gate"], x, prev.get("gate"))
    u, lat["up"] = vanilla_proj(ctx, ml["up"], x, prev.get("up"))
    y, lat["down"] = vanilla_proj(ctx, ml["down"], jax.nn.silu(g) * u, prev.get("down"))
    return h + y.astype(h.dtype), (lat if ctx.lax else None)


def vanilla_init_prev(ctx: TPContext, b: int, s: int) -> Optional[dict]:
    """LaX: the first block crosses with zeros (replicated, like the gathered latents)."""
    if not ctx.lax:
        return None
    return {k: jnp.zeros((b, s, ctx.r), ctx.dtype) for k in LATENT_KEYS}
