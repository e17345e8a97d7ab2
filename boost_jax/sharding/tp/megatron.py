"""Megatron tensor parallelism for the full-rank baseline (arch=full).

The residual stream is replicated. Attention: q|k|v column-parallel by heads (one GEMM over the
concatenated local columns), attention on local heads, o row-parallel → all-reduce [b,s,d].
MLP: gate|up column-parallel (d_ff/t), down row-parallel → all-reduce [b,s,d]. Norm scales are
replicated. Biases (GPT families) follow their outputs: q/k/v/up column-split, o/down replicated
(added after the all-reduce).

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

import jax.numpy as jnp

from boost_jax.layers.forward import apply_norm
from boost_jax.sharding.tp.common import TPColl, TPOps, matmul, name_reduced, psum, to_varying

# the dim of each leaf split over the TP axes (None: replicated; sharding/tp/specs.py reads it):
# the residual stream, its norms and gpt2's positions replicated, the embedding vocab-parallel,
# a block's `w` and `bias` by columns except the row-parallel o/down ("proj.leaf" entries)
SPLIT = {"positions": None, "embed": -2, "norm": None,
         "leaves": {"w": -1, "bias": -1,
                    "o.w": -2, "down.w": -2, "o.bias": None, "down.bias": None}}


def block_collectives(m, T: int, t: int, e: int, g: int) -> tuple[list[TPColl], list[TPColl]]:
    """(forward, backward) all-reduces of one block per micro-batch of T tokens, e bytes an
    element (the planner's list, plan/roofline.py): o and down forward, the normed inputs of
    q|k|v and gate|up backward, b·s·d each."""
    d = m.d_model
    fwd = [TPColl("o", "all-reduce", e * T * d), TPColl("down", "all-reduce", e * T * d)]
    bwd = [TPColl("qkv_in", "all-reduce", e * T * d),
           TPColl("gate_up_in", "all-reduce", e * T * d)]
    return fwd, bwd


class MegatronOps(TPOps):
    def project_in(self, h, norm, projs, prevs):
        ctx = self.ctx
        x = to_varying(ctx, apply_norm(h, norm, ctx.eps, ctx.dtype))
        ws = [p["w"] for p in projs]
        y = matmul(x, jnp.concatenate(ws, axis=-1), ctx.dtype)
        cuts = [sum(w.shape[-1] for w in ws[:i]) for i in range(1, len(ws))]
        return jnp.split(y, cuts, axis=-1), [None] * len(projs)

    def project_out(self, x, proj, prev):
        return name_reduced(psum(self.ctx, matmul(x, proj["w"], self.ctx.dtype))), None
