"""Bottleneck-aware tensor parallelism (BTP): the chunk boundary sits at the rank-r bottleneck.

The residual stream h is sharded along d on every TP rank (h_i = h[..., d_i]) for the whole
network. Per block, with σ the arch's latent activation (identity for svd) and LaX crossing
applied to the reduced, replicated latents:

    attention  [Online-RMSNorm + A_q|A_k|A_v (rows d_i)] ─ all-reduce [b,s,3r] (+ fp32 Σx²) ─ σ
               ─ B_q,B_k,B_v (columns = local heads, one batched GEMM) ─ RoPE + attention on
               local heads ─ A_o (rows = local heads) ─ all-reduce [b,s,r] ─ σ ─ B_o (columns d_i)
               ─ h_i += ·
    MLP        [Online-RMSNorm + A_gate|A_up (rows d_i)] ─ all-reduce [b,s,2r] (+ fp32 Σx²) ─ σ
               ─ B_gate,B_up (columns d_ff/t, batched) ─ silu(g)·u ─ A_down (rows d_ff/t)
               ─ all-reduce [b,s,r] ─ σ ─ B_down (columns d_i) ─ h_i += ·

Parameter split (leading layer axis L omitted): every A [d_in, r] is split along d_in (rows),
every B [r, d_out] along d_out (columns); attn_norm/mlp_norm scale [d] along d; LaX
latent_scale/g replicated.

Online-RMSNorm (boost_jax.pallas.dispatch.online_rmsnorm_matmul, the code base's one
implementation): RMSNorm(x)·A = ((x⊙γ)·A) / rms(x). Rank i normalises its shard locally,
computes u_i = (x_i⊙γ_i)·A_i and s_i = Σ x_i² (fp32); ONE all-reduce carries [u_i, s_i] (fp32
compute: one [b,s,n+1] buffer; bf16: the bf16 latent and the fp32 statistic, merged into one
variadic all-reduce by XLA's combiner), then z = U·rsqrt(S/d + ε) — exactly RMSNorm followed by A.

Communication per layer (elements; b·s tokens; t-way all-reduce ring bytes = 2(t-1)/t × payload):
    forward   4 all-reduces: b·s·(3r + 1 + r + 2r + 1 + r) = b·s·(7r + 2)  (the +2 are fp32 Σx²)
    backward  4 all-reduces: b·s·7r — the cotangents of σ(z_qkv), σ(z_o), σ(z_gu), σ(z_down)
              enter per-rank B GEMMs (pcast → psum on transpose); dS is computed from the
              replicated dz, no statistic travels backward.
    remat=full replays the 4 forward all-reduces in backward; remat=lowrank saves the reduced
    latents (U_qkv, S, z_o, U_gu, S, z_down — 7r + 2 per token, replicated) and the residual
    shard (d/t per token) and replays none.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from boost_jax.layers.linear import lax_cross, latent_activation
from boost_jax.pallas import dispatch
from boost_jax.sharding.tp_common import (
    TPContext, local_attention, matmul, name_latent, name_residual, psum, to_varying)

ATTN_IN = ("q", "k", "v")
MLP_IN = ("gate", "up")


def norm_down(ctx: TPContext, x, gamma, w):
    """[Online-RMSNorm + grouped A] of a d-sharded x → replicated latent [b, s, n].

    x [b, s, d/t], gamma [d/t], w [d/t, n]. The Online-RMSNorm itself is
    boost_jax.pallas.dispatch.online_rmsnorm_matmul (Pallas kernel or its XLA twin per
    parallel.kernels); we hand it the reduction of the payload [u_i | s_i]: in fp32 ONE
    all-reduce of the [b, s, n+1] buffer; in bf16 one psum of the bf16 latent and the fp32 Σx²
    (two ops that XLA's combiner merges into one variadic all-reduce). The reduced values are
    tagged for remat="lowrank"."""
    fp32 = jnp.dtype(ctx.dtype) == jnp.float32

    def reduce_fn(payload):  # [b, s, n+1] = [u_i | s_i], fp32
        if fp32:
            return name_latent(psum(ctx, payload))
        u, s = psum(ctx, (payload[..., :-1].astype(ctx.dtype), payload[..., -1:]))
        u, s = name_latent(u), name_latent(s)  # remat saves the latent in bf16
        return jnp.concatenate([u.astype(jnp.float32), s], axis=-1)

    return dispatch.online_rmsnorm_matmul(x, gamma, w, ctx.d, ctx.eps, reduce_fn,
                                          impl=ctx.kernels, comm_dtype=jnp.float32,
                                          out_dtype=ctx.dtype)


def _finish(ctx: TPContext, z, prev, p):
    """The reduced latent → the carried latent (LaX crossing on replicated values)."""
    return lax_cross(z, prev, p, ctx.eps) if ctx.lax else z


def _up(ctx: TPContext, zs: list, ws: list) -> list:
    """σ, then column-parallel B projections as one batched GEMM.

    The σ'd latents enter per-rank compute through ONE pcast, so the backward all-reduces the
    whole group's latent cotangent in one collective.
    """
    a = latent_activation(ctx.kind, jnp.concatenate(zs, axis=-1) if len(zs) > 1 else zs[0])
    a = to_varying(ctx, a)
    if len(zs) == 1:
        return [matmul(a, ws[0], ctx.dtype)]
    offsets = [sum(z.shape[-1] for z in zs[:i]) for i in range(1, len(zs))]
    parts = jnp.split(a, offsets, axis=-1)
    return dispatch.grouped_up(parts, [w.astype(ctx.dtype) for w in ws], impl=ctx.kernels)


def btp_block(ctx: TPContext, p: dict, h, positions, prev: Optional[dict]):
    """One decoder block on the d-sharded residual h [b, s, d/t] → (h, latents or None)."""
    at, ml = p["attn"], p["mlp"]
    prev = prev or {}
    h = name_residual(h)

    # attention: [norm + A_qkv] → AR(3r+1) → σ → B_qkv (local heads) → attn → A_o → AR(r)
    r = ctx.r
    z = norm_down(ctx, h, p["attn_norm"]["scale"],
                  jnp.concatenate([at[n]["a"] for n in ATTN_IN], axis=-1))
    zs = [_finish(ctx, z[..., i * r:(i + 1) * r], prev.get(n), at[n])
          for i, n in enumerate(ATTN_IN)]
    q, k, v = _up(ctx, zs, [at[n]["b"] for n in ATTN_IN])
    o = local_attention(ctx, q, k, v, positions, ctx.n_heads // ctx.t, ctx.kv_heads // ctx.t)
    zo = _finish(ctx, name_latent(psum(ctx, matmul(o, at["o"]["a"], ctx.dtype))),
                 prev.get("o"), at["o"])
    (y,) = _up(ctx, [zo], [at["o"]["b"]])
    h = name_residual(h + y.astype(h.dtype))

    # MLP: [norm + A_gate|up] → AR(2r+1) → σ → B_gate,B_up (d_ff/t) → A_down → AR(r) → B_down
    z = norm_down(ctx, h, p["mlp_norm"]["scale"],
                  jnp.concatenate([ml[n]["a"] for n in MLP_IN], axis=-1))
    zg = _finish(ctx, z[..., :r], prev.get("gate"), ml["gate"])
    zu = _finish(ctx, z[..., r:], prev.get("up"), ml["up"])
    g, u = _up(ctx, [zg, zu], [ml["gate"]["b"], ml["up"]["b"]])
    m = jax.nn.silu(g) * u
    zd = _finish(ctx, name_latent(psum(ctx, matmul(m, ml["down"]["a"], ctx.dtype))),
                 prev.get("down"), ml["down"])
    (y,) = _up(ctx, [zd], [ml["down"]["b"]])
    h = h + y.astype(h.dtype)
    lat = None
    if ctx.lax:
        lat = dict(zip(ATTN_IN, zs)) | {"o": zo, "gate": zg, "up": zu, "down": zd}
    return h, lat


def btp_init_prev(ctx: TPContext, b: int, s: int) -> Optional[dict]:
    """LaX: the first block crosses with zeros (replicated, like every BTP latent)."""
    if not ctx.lax:
        return None
    return {k: jnp.zeros((b, s, ctx.r), ctx.dtype)
            for k in ("q", "k", "v", "o", "gate", "up", "down")}
