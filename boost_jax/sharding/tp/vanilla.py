"""Vanilla low-rank tensor parallelism: each (A, B) pair is one Megatron unit (the baseline).

The residual stream is replicated and every projection y = B·σ(A·x) is cut at its rank: A
[d_in, r] column-parallel (r/t latent columns per rank), σ elementwise on the local columns, B
[r, d_out] row-parallel → all-reduce of the full-width output. Attention runs replicated on all
heads (q, k, v arrive all-reduced). Norm scales are replicated.

Parameter split (leading layer axis L omitted): `a` along r (columns), `b` along r (rows);
LaX latent_scale/g and the GPT families' biases (added to the all-reduced outputs) replicated.

Communication per layer (elements, b·s tokens, MHA; under GQA k/v carry K·hd instead of d):
    forward   7 all-reduces, b·s·(5d + 2·d_ff): outputs of q, k, v, o, down (d) and gate, up (d_ff)
    backward  7 all-reduces, b·s·(6d + d_ff): the input cotangents of the 7 column-parallel A
              projections (q, k, v, gate, up take d; o takes H·hd = d; down takes d_ff) — each
              pair has its own f operator, as in the naive scheme.
    LaX additionally all-gathers each local latent forward (7 per layer, b·s·r) to apply the
    crossing Norm_r on the full rank, and all-reduces its cotangent (b·s·r) backward where the
    local slice re-enters per-rank compute.
    remat=full and remat=lowrank both replay the forward all-reduces (the latents here are
    sharded over r and the attention inputs are the all-reduced outputs).
"""

from __future__ import annotations

from boost_jax.layers.forward import apply_norm, lax_cross, latent_activation
from boost_jax.sharding.tp.common import (
    TPColl, TPOps, all_gather, local_slice, matmul, name_latent, name_reduced, psum, to_varying)

# the dim of each leaf split over the TP axes (None: replicated; sharding/tp/specs.py reads it):
# the residual stream, its norms and gpt2's positions replicated, the embedding vocab-parallel,
# `a` by its rank columns, `b` by its rank rows, biases replicated
SPLIT = {"positions": None, "embed": -2, "norm": None, "leaves": {"a": -1, "b": -2, "bias": None}}


def projections(m, g: int) -> list[tuple[str, int, int]]:
    """(name, d_in, d_out) of a block's low-rank projections; g = 2 with a gate (SwiGLU)."""
    d, hd, H, K, dff = m.d_model, m.head_dim, m.n_heads, m.kv_heads, m.d_ff
    return [("q", d, H * hd), ("k", d, K * hd), ("v", d, K * hd), ("o", H * hd, d)] + \
        ([("gate", d, dff)] if g == 2 else []) + [("up", d, dff), ("down", dff, d)]


def block_collectives(m, T: int, t: int, e: int, g: int) -> tuple[list[TPColl], list[TPColl]]:
    """(forward, backward) all-reduces of one block per micro-batch of T tokens, e bytes an
    element (the planner's list, plan/roofline.py): each projection's output forward, its
    input's cotangent backward."""
    projs = projections(m, g)
    fwd = [TPColl(n, "all-reduce", e * T * dout) for n, _, dout in projs]
    bwd = [TPColl(f"{n}_in", "all-reduce", e * T * din) for n, din, _ in projs]
    return fwd, bwd


class VanillaOps(TPOps):
    def project(self, p: dict, x, prev=None):
        """y = B·σ(A·x), A column- and B row-parallel; x replicated → (y replicated, latent)."""
        ctx = self.ctx
        z = matmul(to_varying(ctx, x), p["a"], ctx.dtype)  # [b, s, r/t]
        lat = None
        if ctx.lax:  # Norm_r needs the whole rank: gather, cross, keep the local columns
            lat = lax_cross(all_gather(ctx, z, axis=-1), prev, p, ctx.eps)
            z = local_slice(ctx, lat, axis=-1)
        z = name_latent(z)
        y = psum(ctx, matmul(latent_activation(ctx.arch, z), p["b"], ctx.dtype))
        return name_reduced(y), lat

    def project_in(self, h, norm, projs, prevs):
        x = apply_norm(h, norm, self.ctx.eps, self.ctx.dtype)
        outs = [self.project(p, x, z) for p, z in zip(projs, prevs)]
        return [y for y, _ in outs], [z for _, z in outs]

    def project_out(self, x, proj, prev):
        return self.project(proj, x, prev)
