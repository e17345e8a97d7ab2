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

Online-RMSNorm (boost_jax.pallas.dispatch.online_rmsnorm_matmul): RMSNorm(x)·A = ((x⊙γ)·A) /
rms(x), so rank i sends u_i = (x_i⊙γ_i)·A_i and s_i = Σ x_i² (fp32) in ONE all-reduce. Per
layer (elements, b·s tokens): forward 4 all-reduces, b·s·(7r + 2); backward 4, b·s·7r. GPT
families (Online-LayerNorm): forward b·s·(6r + 2(1 + t)) + (t+1)·4r, backward b·s·6r.
Derivation (the statistics, remat's replays, the GPT families): benchmarks/README.md §4,
"Derivations moved from the code".
"""

from __future__ import annotations

import jax.numpy as jnp

from boost_jax.layers.forward import lax_cross, latent_activation
from boost_jax.pallas import dispatch
from boost_jax.sharding.tp.common import (
    TPColl, TPContext, TPOps, matmul, name_latent, psum, rank_index, to_varying)

# the dim of each leaf split over the TP axes (None: replicated; sharding/tp/specs.py reads it):
# everything laid out like the residual stream, split along d: gpt2's positions, the untied
# embedding, the norms, every A by its rows d_in, every B and bias by its columns d_out
SPLIT = {"positions": -1, "embed": -1, "norm": -1, "leaves": {"a": -2, "b": -1, "bias": -1}}


def block_collectives(m, T: int, t: int, e: int, g: int) -> tuple[list[TPColl], list[TPColl]]:
    """(forward, backward) all-reduces of one block per micro-batch of T tokens, e bytes an
    element (the planner's list, plan/roofline.py): the four rank-r latents z each way, the
    fp32 norm statistics riding in the qkv and gate|up ones (RMSNorm Σx²; LayerNorm M2 + t
    slot means per token, and γ·A, β·A once)."""
    r = m.r
    stats = (lambda n: 4 * T) if m.swiglu else (lambda n: 4 * (T * (1 + t) + (t + 1) * n))
    fwd = [TPColl("z_qkv", "all-reduce", e * T * 3 * r + stats(3 * r)),
           TPColl("z_o", "all-reduce", e * T * r),
           TPColl("z_gu", "all-reduce", e * T * g * r + stats(g * r)),
           TPColl("z_down", "all-reduce", e * T * r)]
    bwd = [TPColl("dz_qkv", "all-reduce", e * T * 3 * r),
           TPColl("dz_o", "all-reduce", e * T * r),
           TPColl("dz_gu", "all-reduce", e * T * g * r),
           TPColl("dz_down", "all-reduce", e * T * r)]
    return fwd, bwd


def norm_down(ctx: TPContext, x, norm: dict, w):
    """[Online norm + grouped A] of a d-sharded x → replicated latent [b, s, n]: RMSNorm, or
    LayerNorm when the norm has a bias (GPT families)."""
    if "bias" in norm:
        return layernorm_down(ctx, x, norm, w)
    return rmsnorm_down(ctx, x, norm["scale"], w)


def layernorm_down(ctx: TPContext, x, norm: dict, w):
    """Online-LayerNorm (boost_jax/pallas/layernorm.py): the latent's partial sums, the
    statistics (M2_i and this rank's mean in its slot) and the weights-only γ·A, β·A travel as
    ONE flat fp32 buffer in one all-reduce (bf16: the latent in bf16 beside one fp32 buffer,
    merged by XLA's combiner as for RMSNorm). The reduced values are tagged for remat."""
    fp32 = jnp.dtype(ctx.dtype) == jnp.float32

    def reduce_fn(payload):
        token, weights = payload
        n = weights.shape[-1]
        u, rest = (None, token) if fp32 else (token[..., :n].astype(ctx.dtype), token[..., n:])
        flat = jnp.concatenate([rest.reshape(-1), weights.reshape(-1)])
        if fp32:
            flat = name_latent(psum(ctx, flat))
        else:
            u, flat = (name_latent(v) for v in psum(ctx, (u, flat)))
        k = rest.size
        rest, weights = flat[:k].reshape(rest.shape), flat[k:].reshape(weights.shape)
        token = rest if fp32 else jnp.concatenate([u.astype(jnp.float32), rest], axis=-1)
        return token, weights

    w = w.astype(ctx.dtype)  # fp32 master rows would turn the GEMM into an fp32 one
    return dispatch.online_layernorm_matmul(x, norm["scale"], norm["bias"], w, ctx.d, ctx.eps,
                                            reduce_fn, rank_index(ctx), ctx.t,
                                            impl=ctx.kernels, out_dtype=ctx.dtype)


def rmsnorm_down(ctx: TPContext, x, gamma, w):
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

    w = w.astype(ctx.dtype)  # fp32 master rows made this an fp32 GEMM: 2.4x a step on an H200
    return dispatch.online_rmsnorm_matmul(x, gamma, w, ctx.d, ctx.eps, reduce_fn,
                                          impl=ctx.kernels, comm_dtype=jnp.float32,
                                          out_dtype=ctx.dtype)


class BTPOps(TPOps):
    def finish(self, z, prev, p):
        """The reduced latent → the carried latent (LaX crossing on replicated values)."""
        return lax_cross(z, prev, p, self.ctx.eps) if self.ctx.lax else z

    def up(self, zs: list, ws: list) -> list:
        """σ, then the column-parallel B projections as one batched GEMM. The σ'd latents enter
        per-rank compute through ONE pcast, so backward all-reduces the group's cotangent once."""
        ctx = self.ctx
        a = latent_activation(ctx.arch, jnp.concatenate(zs, axis=-1) if len(zs) > 1 else zs[0])
        a = to_varying(ctx, a)
        if len(zs) == 1:
            return [matmul(a, ws[0], ctx.dtype)]
        parts = jnp.split(a, [sum(z.shape[-1] for z in zs[:i]) for i in range(1, len(zs))],
                          axis=-1)
        return dispatch.grouped_up(parts, [w.astype(ctx.dtype) for w in ws], impl=ctx.kernels)

    def project_in(self, h, norm, projs, prevs):
        """[Online norm + grouped A] → AR(n·r + stats) → σ → grouped B (local columns)."""
        r = self.ctx.r
        z = norm_down(self.ctx, h, norm, jnp.concatenate([p["a"] for p in projs], axis=-1))
        zs = [self.finish(z[..., i * r:(i + 1) * r], prev, p)
              for i, (p, prev) in enumerate(zip(projs, prevs))]
        return self.up(zs, [p["b"] for p in projs]), zs

    def project_out(self, x, proj, prev):
        """A row-parallel → AR(r) → σ → B column-parallel (into the residual's d-slice)."""
        z = self.finish(name_latent(psum(self.ctx, matmul(x, proj["a"], self.ctx.dtype))),
                        prev, proj)
        return self.up([z], [proj["b"]])[0], z
