"""Embedding and LM head under tensor parallelism (vocab-parallel cross-entropy); TPOps (ops.py)
calls them for every TP layout.

Embedding table [V, d]:
    btp (untied)   split along d — rank i looks up its own slice h_i, no collective.
    megatron, vanilla, and any tied table: split along V (vocab-parallel): each rank looks up
                   the tokens it owns (zeros elsewhere), then all-reduce [b,s,d] (btp then
                   keeps its d-slice).
LM head w [d, V] (or the tied table transposed): split along V. BTP all-gathers h once (b·s·d),
applies the replicated final norm, and each rank computes its logits slice [b, s, V/t] in
fp32. The cross-entropy never forms replicated [b,s,V] logits:
    m = pmax(max_v logits_i)       (stop-gradient; one all-reduce of b·s)
    S = Σ_ranks Σ_v exp(logits_i − m), gold = Σ_ranks logits_i[target] (one all-reduce of 2·b·s)
    loss = mean(log S + m − gold)
Backward: the head input cotangent is all-reduced over ranks (b·s·d, the pcast of the normed
h entering the per-rank head GEMM; btp: the reduce-scatter of h's cotangent, the transpose of
its gather); the embedding backward needs no TP collective.
Per step (elements): forward AR b·s·d (embedding; none for untied btp) + AG b·s·d (btp gather
of h) + AR b·s (max) + AR 2·b·s (sum-exp, gold); backward AR b·s·d (btp: RS b·s·d).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from boost_jax.layers.linear import logits_matmul
from boost_jax.layers.norms import apply_norm
from boost_jax.sharding.tp.common import TPContext, local_slice, psum, rank_index, to_varying


def embed_d_sharded(ctx: TPContext) -> bool:
    return ctx.mode == "btp" and not ctx.tie


def embed(ctx: TPContext, table, tokens):
    """tokens [b, s] (replicated over TP) → h: btp [b, s, d/t], otherwise [b, s, d]."""
    if embed_d_sharded(ctx):
        return jnp.take(table, tokens, axis=0).astype(ctx.dtype)
    vt = table.shape[0]
    local = tokens - rank_index(ctx) * vt
    own = (local >= 0) & (local < vt)
    e = jnp.take(table, jnp.clip(local, 0, vt - 1), axis=0)
    e = psum(ctx, jnp.where(own[..., None], e, 0).astype(ctx.dtype))  # one rank owns each row
    return local_slice(ctx, e, axis=e.ndim - 1) if ctx.mode == "btp" else e


def vocab_parallel_cross_entropy(ctx: TPContext, x, w, targets):
    """Mean CE of logits x·w where w [d, V/t] is this rank's vocab slice; x [b, s, d]."""
    logits = logits_matmul(to_varying(ctx, x), w)
    vt = logits.shape[-1]
    m = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), ctx.axes)
    se = jnp.sum(jnp.exp(logits - m[..., None]), axis=-1)
    local = targets - rank_index(ctx) * vt
    hit = jnp.arange(vt, dtype=local.dtype) == local[..., None]  # all False off this rank
    gold = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    se, gold = psum(ctx, (se, gold))
    return jnp.mean(jnp.log(se) + m - gold)


def head_loss(ctx: TPContext, h, norm, w, targets):
    if ctx.mode == "btp":
        # typed varying: each rank's head computes only its vocab slice, so the backward of
        # this gather is the reduce-scatter of the ranks' partial cotangents
        h = jax.lax.all_gather(h, ctx.axes, axis=h.ndim - 1, tiled=True)
    x = apply_norm(h, norm, ctx.eps, ctx.dtype)
    return vocab_parallel_cross_entropy(ctx, x, w, targets)
